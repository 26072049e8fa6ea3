"""``trident``: the command line.

    trident serve [--model PATH] [--mode epd|e_pd|e_p_d|ep_d|all ...] [--backend hf|vllm] [--http-port ...]
    trident worker STAGE --model PATH --url URL [--backend hf|vllm]     (started by `serve`)
    trident build-demo-model --arch llava|qwen2vl OUT
    trident bench transfer
    trident bench decode [--model PATH | --arch llava|qwen2vl]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile


def _build_demo_model(args: argparse.Namespace) -> int:
    from .demo_models import build_demo_model

    build_demo_model(args.arch, args.out, seed=args.seed)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from . import bench

    torch.set_num_threads(args.threads)
    if args.what == "transfer":
        bench.run_transfer_bench(repeat_scale=args.repeat_scale)
        return 0
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from .demo_models import build_demo_model

            model = os.path.join(tmp, args.arch)
            build_demo_model(args.arch, model, log=None)
        bench.run_decode_bench(model, new_tokens=args.new_tokens)
    return 0


def _vllm_config(args: argparse.Namespace):
    from .config import VLLMConfig

    return VLLMConfig(
        dtype=args.vllm_dtype, max_model_len=args.vllm_max_model_len, kv_cache_gib=args.vllm_kv_cache_gib,
        enforce_eager=args.vllm_eager, cpu_bind=args.vllm_cpu_bind,
    )


def _serve(args: argparse.Namespace) -> int:
    from .config import MiB, TransferConfig
    from .launcher import ALL_MODES, ServeSettings, serve

    modes = ALL_MODES if "all" in args.mode else tuple(dict.fromkeys(args.mode))
    load = None if args.load is None else (ALL_MODES if "all" in args.load else tuple(dict.fromkeys(args.load)))
    settings = ServeSettings(
        model=args.model, modes=modes, load=load, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        metrics_port=args.metrics_port, access_token=args.access_token, threads_per_worker=args.threads,
        workspace=args.workspace, openai_port=args.openai_port, worker_python=args.worker_python,
        frontend_args=_frontend_argv(args), backend=args.backend, vllm=_vllm_config(args),
        transfer=TransferConfig(send_pool_bytes=args.send_pool_mib * MiB, recv_pool_bytes=args.recv_pool_mib * MiB),
    )
    return serve(settings)


def _frontend_argv(args: argparse.Namespace) -> list[str]:
    out = ["--default-mode", args.default_mode]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if args.allow_private_media_urls:
        out.append("--allow-private-media-urls")
    if args.allowed_media_dir:
        out += ["--allowed-media-dir", args.allowed_media_dir]
    return out


def _worker(args: argparse.Namespace) -> int:
    import torch

    from .config import MiB, TransferConfig, VLLMConfig
    from .workers.serve import run_worker

    torch.set_num_threads(args.threads)
    vllm = VLLMConfig.model_validate_json(args.vllm_config) if args.vllm_config else None
    transfer = TransferConfig(
        send_pool_bytes=args.send_pool_mib * MiB, recv_pool_bytes=args.recv_pool_mib * MiB, lease_s=args.lease_s
    )
    token = os.environ.get("TRIDENT_ACCESS_TOKEN")
    return run_worker(
        args.stage, args.model, args.url, token, transfer, args.stats_dir, args.model_store, args.backend, vllm,
        args.threads,
    )


def _frontend(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .frontend.app import FrontendConfig, default_model_name, run_frontend
    from .media import MediaPolicy

    config = FrontendConfig(
        model_name=args.served_model_name or default_model_name(args.model),
        model_path=args.model,
        default_mode=args.default_mode,
        media=MediaPolicy(
            allow_private_urls=args.allow_private_media_urls,
            allowed_media_dir=Path(args.allowed_media_dir) if args.allowed_media_dir else None,
        ),
    )
    return run_frontend(config, args.grpc_url, args.host, args.port)


def _add_frontend_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", help="model id of the OpenAI API (default: the checkpoint folder's name)")
    p.add_argument("--default-mode", default="e_p_d", choices=["epd", "e_pd", "e_p_d", "ep_d"],
                   help="mode the bare model id maps to; '<id>:<mode>' picks another (default: e_p_d)")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="let image URLs resolve to private/loopback addresses")
    p.add_argument("--allowed-media-dir", help="folder local image paths may come from (default: none allowed)")


def _add_backend_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", choices=["hf", "vllm"], default="hf",
        help="engine of the stage workers: hf (PyTorch + transformers, the reference) or vllm (needs an "
        "environment with vLLM: see --worker-python) (default: hf)",
    )


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vllm engine (with --backend vllm)")
    g.add_argument("--vllm-kv-cache-gib", type=float, default=1.0, help="KV cache per vLLM engine, GiB (default: 1)")
    g.add_argument("--vllm-max-model-len", type=int, help="context window (default: the model's)")
    g.add_argument("--vllm-dtype", help="model dtype (default: float32 on CPU, the checkpoint's on GPU)")
    g.add_argument("--vllm-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run without compiled graphs (default: on CPU only)")
    g.add_argument("--vllm-cpu-bind", default="nobind",
                   help="vLLM CPU thread binding: nobind (share the cores among workers), auto, or core lists "
                   "like '0-3' (default: nobind)")


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--send-pool-mib", type=int, default=256, help="registered send pool per worker (default: 256)")
    p.add_argument("--recv-pool-mib", type=int, default=256, help="registered receive pool per worker (default: 256)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trident", description="Disaggregated multimodal LLM serving on Triton.")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="serve a model in one or more deployment modes on Triton")
    sv.add_argument("--model", help="checkpoint folder (default: the LLaVA demo model, built on first use)")
    sv.add_argument(
        "--mode", nargs="+", default=["all"], choices=["epd", "e_pd", "e_p_d", "ep_d", "all"],
        help="deployment modes to serve, each as its entry model (default: all)",
    )
    sv.add_argument(
        "--load", nargs="*", choices=["epd", "e_pd", "e_p_d", "ep_d", "all"],
        help="entry models to load at start (default: those of --mode); the others can be loaded later "
        "through Triton's repository API",
    )
    sv.add_argument("--host", default="127.0.0.1", help="address Triton listens on (default: 127.0.0.1)")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.add_argument("--metrics-port", type=int, default=8002)
    sv.add_argument(
        "--access-token", default=os.environ.get("TRIDENT_ACCESS_TOKEN"),
        help="token for Triton's repository API (env TRIDENT_ACCESS_TOKEN; default: generated and printed)",
    )
    sv.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible API port; 0 turns it off (default: 9000)")
    _add_frontend_flags(sv)
    sv.add_argument("--threads", type=int, default=1, help="torch threads per worker process (default: 1)")
    sv.add_argument(
        "--worker-python", default=os.environ.get("TRIDENT_WORKER_PYTHON"),
        help="Python interpreter of the stage workers, an environment with trident installed "
        "(env TRIDENT_WORKER_PYTHON; default: this one)",
    )
    sv.add_argument("--workspace", help="new folder for the server's files: model store, logs, worker stats (default: temporary)")
    _add_backend_flag(sv)
    _add_pool_flags(sv)
    _add_vllm_flags(sv)
    sv.set_defaults(func=_serve)

    f = sub.add_parser("frontend", help="OpenAI-compatible HTTP server over the entry models (started by serve)")
    f.add_argument("--model", required=True, help="checkpoint folder (for its chat template)")
    f.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton gRPC address")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, default=9000)
    _add_frontend_flags(f)
    f.set_defaults(func=_frontend)

    w = sub.add_parser("worker", help="bind one stage model into a running Triton (started by serve)")
    w.add_argument("stage", choices=["generate", "encode", "prefill", "decode", "encode_prefill", "prefill_decode"])
    w.add_argument("--model", required=True, help="checkpoint folder")
    w.add_argument("--url", required=True, help="Triton HTTP URL, e.g. http://127.0.0.1:8000")
    w.add_argument(
        "--model-store", help="the server's model repository folder on this host (needed for ensembles over the stage)"
    )
    w.add_argument("--stats-dir", help="folder to keep <stage>.json transfer/decode counters in")
    w.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    w.add_argument("--lease-s", type=float, default=60.0, help="lease on published regions (default: 60)")
    _add_backend_flag(w)
    w.add_argument("--vllm-config", help="the vllm engine's settings as JSON (trident.config.VLLMConfig)")
    _add_pool_flags(w)
    w.set_defaults(func=_worker)

    d = sub.add_parser("build-demo-model", help="write a small random-weight demo checkpoint")
    d.add_argument("--arch", choices=["llava", "qwen2vl"], default="llava", help="model family (default: llava)")
    d.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    d.add_argument("out", help="output folder")
    d.set_defaults(func=_build_demo_model)

    b = sub.add_parser("bench", help="print a benchmark table")
    b.add_argument("what", choices=["transfer", "decode"], help="transfer: NIXL READ vs memcpy; decode: batched decode")
    b.add_argument("--model", help="checkpoint folder for decode (default: a fresh demo model of --arch)")
    b.add_argument("--arch", choices=["llava", "qwen2vl"], default="llava")
    b.add_argument("--new-tokens", type=int, default=64, help="tokens per request for decode (default: 64)")
    b.add_argument("--repeat-scale", type=float, default=1.0, help="scale the transfer repetitions")
    b.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
