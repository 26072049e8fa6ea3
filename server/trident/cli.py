"""``trident``: the command line. Flags build the settings of :mod:`trident.config`, whose fields hold every
default and most help texts; mode, stage and family choices come from :mod:`trident.protocol` and the
family adapters.

    trident serve [--model PATH] [--mode epd|e_pd|e_p_d|ep_d|all ...] [--backend hf|vllm] [--http-port ...]
                  [--scheduler bls|ensemble] [--instances STAGE=N ...] [--routing ...]
    trident worker --settings JSON          (started by `serve`; or STAGE --model PATH --join URL)
    trident frontend --settings JSON        (started by `serve`; or --model PATH --grpc-url HOST:PORT)
    trident build-demo-model --arch llava|qwen2vl OUT
    trident bench transfer | decode [--model PATH | --arch llava|qwen2vl]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

from pydantic import BaseModel, ValidationError

from .config import (
    BACKENDS, ROUTINGS, SCHEDULERS, FrontendSettings, MediaLimits, MediaPolicy, MiB, SchedulerConfig, ServeSettings,
    TransferConfig, VLLMConfig, WorkerSettings,
)
from . import signing
from .protocol import MODES, STAGES


def _opt(group, flag: str, model: type[BaseModel], field: str, **kwargs) -> None:
    """A flag whose default and help come from a settings field."""
    info = model.model_fields[field]
    default = kwargs.pop("default", info.default)
    shown = kwargs.pop("shown", default)
    help_text = kwargs.pop("help", info.description or "")
    if "action" not in kwargs and shown is not None:
        help_text = f"{help_text} (default: {shown})" if help_text else f"(default: {shown})"
    group.add_argument(flag, default=default, help=help_text, **kwargs)


def _demo_archs() -> list[str]:
    from .dev.demo import ARCHS

    return list(ARCHS)


# -- serve ------------------------------------------------------------------------------------------------
def _modes(values: list[str] | None) -> tuple[str, ...] | None:
    if values is None:
        return None
    return tuple(MODES) if "all" in values else tuple(dict.fromkeys(values))


def _instances(values: list[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values or ():
        stage, sep, count = value.partition("=")
        if not sep or not count.isdigit():
            raise SystemExit(f"trident serve: --instances takes STAGE=N (e.g. prefill=2), got {value!r}")
        out[stage] = int(count)
    return out


def _serve_settings(args: argparse.Namespace) -> ServeSettings:
    media = MediaPolicy(allow_private_urls=args.allow_private_media_urls, allowed_media_dir=args.allowed_media_dir)
    frontend = FrontendSettings(
        model_path="", model_name=args.served_model_name, default_mode=args.default_mode, media=media,
        max_body_bytes=args.max_body_mib * MiB,
    )
    vllm = VLLMConfig(
        dtype=args.vllm_dtype, max_model_len=args.vllm_max_model_len, kv_cache_gib=args.vllm_kv_cache_gib,
        enforce_eager=args.vllm_eager, cpu_bind=args.vllm_cpu_bind, nixl_progress_thread=args.vllm_nixl_progress_thread,
        prefill_calls=args.vllm_prefill_calls, executor=args.vllm_executor,
    )
    transfer = TransferConfig(
        send_pool_bytes=args.send_pool_mib * MiB, recv_pool_bytes=args.recv_pool_mib * MiB, lease_s=args.lease_s,
        read_timeout_s=args.read_timeout_s,
    )
    scheduling = SchedulerConfig(
        routing=args.routing, local_prefill_tokens=args.local_prefill_tokens,
        local_encode_images=args.local_encode_images, stage_calls=args.stage_calls, record_handoff=args.record_handoff,
    )
    return ServeSettings(
        scheduler=args.scheduler, scheduling=scheduling, instances=_instances(args.instances),
        embedding_cache_mib=args.embedding_cache_mib, max_inflight=args.max_inflight,
        model=args.model, modes=_modes(args.mode), load=_modes(args.load), host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, openai_port=args.openai_port,
        access_token=args.access_token, transfer_secret=args.transfer_secret, threads_per_worker=args.threads,
        workspace=args.workspace,
        worker_python=args.worker_python, backend=args.backend, vllm=vllm, transfer=transfer, frontend=frontend,
        media_limits=MediaLimits(
            max_images=args.max_images, max_pixels=args.max_image_pixels, max_bytes=args.max_image_mib * MiB,
            max_videos=args.max_videos, video_max_bytes=args.max_video_mib * MiB, video_fps=args.video_fps,
            video_max_frames=args.video_max_frames, video_max_seconds=args.video_max_seconds,
            max_audios=args.max_audios, audio_max_bytes=args.max_audio_mib * MiB,
            audio_max_seconds=args.audio_max_seconds, audio_sample_rate=args.audio_sample_rate,
        ),
        warm_up=args.warm_up, trace_dir=args.trace_dir, fault_injection=args.fault_injection,
    )


def _serve(args: argparse.Namespace) -> int:
    from .launcher import serve

    return serve(_serve_settings(args))


def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="serve a model in one or more deployment modes on Triton")
    _opt(sv, "--model", ServeSettings, "model")
    sv.add_argument("--mode", nargs="+", default=["all"], choices=[*MODES, "all"],
                    help="deployment modes to serve, each as its entry model (default: all)")
    _opt(sv, "--load", ServeSettings, "load", nargs="*", choices=[*MODES, "all"], shown=None)
    _opt(sv, "--host", ServeSettings, "host")
    for port in ("http_port", "grpc_port", "metrics_port", "openai_port"):
        _opt(sv, f"--{port.replace('_', '-')}", ServeSettings, port, type=int)
    _opt(sv, "--access-token", ServeSettings, "access_token", default=os.environ.get("TRIDENT_ACCESS_TOKEN"),
         help="token for Triton's repository API (env TRIDENT_ACCESS_TOKEN; default: generated and printed)")
    _opt(sv, "--transfer-secret", ServeSettings, "transfer_secret", default=os.environ.get(signing.ENV), shown=None,
         help="the deployment's key for signing the records stages hand on; workers on other hosts need the same "
         f"(env {signing.ENV}; default: generated at each start)")
    _opt(sv, "--threads", ServeSettings, "threads_per_worker", type=int)
    _opt(sv, "--worker-python", ServeSettings, "worker_python", default=os.environ.get("TRIDENT_WORKER_PYTHON"),
         help="Python interpreter of the stage workers, an environment with trident installed "
         "(env TRIDENT_WORKER_PYTHON; default: this one)")
    _opt(sv, "--workspace", ServeSettings, "workspace", shown="temporary")
    _opt(sv, "--backend", ServeSettings, "backend", choices=BACKENDS,
         help="engine of the stage workers: hf (PyTorch + transformers, the reference) or vllm (needs an "
         "environment with vLLM: see --worker-python)")
    sc = sv.add_argument_group("scheduling")
    _opt(sc, "--scheduler", ServeSettings, "scheduler", choices=SCHEDULERS)
    sc.add_argument("--instances", nargs="+", metavar="STAGE=N", default=None,
                    help="workers per stage, e.g. --instances encode=2 prefill=2 (default: 1 each); instance n>1 "
                    "of a stage is the Triton model <stage>-<n>")
    _opt(sc, "--routing", SchedulerConfig, "routing", choices=ROUTINGS)
    _opt(sc, "--embedding-cache-mib", ServeSettings, "embedding_cache_mib", type=int)
    _opt(sc, "--max-inflight", ServeSettings, "max_inflight", type=int)
    _opt(sc, "--local-prefill-tokens", SchedulerConfig, "local_prefill_tokens", type=int)
    _opt(sc, "--local-encode-images", SchedulerConfig, "local_encode_images", type=int)
    _opt(sc, "--stage-calls", SchedulerConfig, "stage_calls", choices=("direct", "triton"))
    _opt(sc, "--record-handoff", SchedulerConfig, "record_handoff", choices=("worker", "scheduler"))
    lim = sv.add_argument_group("media limits and sampling (per request; a request over a limit gets 400 naming it)")
    _opt(lim, "--max-images", MediaLimits, "max_images", type=int)
    _opt(lim, "--max-image-pixels", MediaLimits, "max_pixels", type=int)
    for flag, field in (("--max-image-mib", "max_bytes"), ("--max-video-mib", "video_max_bytes"),
                        ("--max-audio-mib", "audio_max_bytes")):
        default = getattr(MediaLimits(), field) // MiB
        lim.add_argument(flag, type=int, default=default,
                         help=f"{MediaLimits.model_fields[field].description}, MiB (default: {default})")
    _opt(lim, "--max-videos", MediaLimits, "max_videos", type=int)
    _opt(lim, "--video-fps", MediaLimits, "video_fps", type=float)
    _opt(lim, "--video-max-frames", MediaLimits, "video_max_frames", type=int)
    _opt(lim, "--video-max-seconds", MediaLimits, "video_max_seconds", type=float)
    _opt(lim, "--max-audios", MediaLimits, "max_audios", type=int)
    _opt(lim, "--audio-max-seconds", MediaLimits, "audio_max_seconds", type=float)
    _opt(lim, "--audio-sample-rate", MediaLimits, "audio_sample_rate", type=int, shown=None)
    _add_frontend_flags(sv.add_argument_group("OpenAI frontend"))
    t = sv.add_argument_group("transfers")
    t.add_argument("--send-pool-mib", type=int, default=TransferConfig().send_pool_bytes // MiB,
                   help=f"registered send pool per worker, MiB (default: {TransferConfig().send_pool_bytes // MiB})")
    t.add_argument("--recv-pool-mib", type=int, default=TransferConfig().recv_pool_bytes // MiB,
                   help=f"registered receive pool per worker, MiB (default: {TransferConfig().recv_pool_bytes // MiB})")
    _opt(t, "--lease-s", TransferConfig, "lease_s", type=float)
    _opt(t, "--read-timeout-s", TransferConfig, "read_timeout_s", type=float)
    g = sv.add_argument_group("vllm engine (with --backend vllm)")
    _opt(g, "--vllm-kv-cache-gib", VLLMConfig, "kv_cache_gib", type=float)
    _opt(g, "--vllm-max-model-len", VLLMConfig, "max_model_len", type=int, shown=None)
    _opt(g, "--vllm-dtype", VLLMConfig, "dtype", shown=None)
    _opt(g, "--vllm-eager", VLLMConfig, "enforce_eager", action=argparse.BooleanOptionalAction)
    _opt(g, "--vllm-cpu-bind", VLLMConfig, "cpu_bind")
    _opt(g, "--vllm-prefill-calls", VLLMConfig, "prefill_calls", type=int)
    _opt(g, "--vllm-executor", VLLMConfig, "executor", choices=["uni", "mp"])
    _opt(g, "--vllm-nixl-progress-thread", VLLMConfig, "nixl_progress_thread", action=argparse.BooleanOptionalAction)
    _opt(sv, "--warm-up", ServeSettings, "warm_up", action=argparse.BooleanOptionalAction)
    _opt(sv, "--trace-dir", ServeSettings, "trace_dir", metavar="DIR", shown="off")
    sv.add_argument("--fault-injection", action="store_true", help=argparse.SUPPRESS)  # tests only
    sv.set_defaults(func=_serve)


# -- frontend ---------------------------------------------------------------------------------------------
def _add_frontend_flags(g) -> None:
    _opt(g, "--served-model-name", FrontendSettings, "model_name", shown="the checkpoint folder's name")
    _opt(g, "--default-mode", FrontendSettings, "default_mode", choices=list(MODES))
    _opt(g, "--allow-private-media-urls", MediaPolicy, "allow_private_urls", action="store_true")
    _opt(g, "--allowed-media-dir", MediaPolicy, "allowed_media_dir", shown="none allowed")
    g.add_argument("--max-body-mib", type=int, default=FrontendSettings.model_fields["max_body_bytes"].default // MiB,
                   help="largest OpenAI request body, MiB; a larger one gets 413 before it is read in full (default: "
                   f"{FrontendSettings.model_fields['max_body_bytes'].default // MiB})")


def _frontend(args: argparse.Namespace) -> int:
    from .frontend.app import run_frontend

    if args.settings:
        settings = FrontendSettings.model_validate_json(args.settings)
    else:
        if not args.model:
            raise SystemExit("trident frontend: --model (or --settings) is required")
        settings = FrontendSettings(
            model_path=args.model, model_name=args.served_model_name, grpc_url=args.grpc_url, host=args.host,
            port=args.port, default_mode=args.default_mode, max_body_bytes=args.max_body_mib * MiB,
            media=MediaPolicy(allow_private_urls=args.allow_private_media_urls, allowed_media_dir=args.allowed_media_dir),
        )
    return run_frontend(settings)


def _add_frontend(sub) -> None:
    f = sub.add_parser("frontend", help="OpenAI-compatible HTTP server over the entry models (started by serve)")
    f.add_argument("--settings", help="the whole trident.config.FrontendSettings as JSON (what serve passes)")
    f.add_argument("--model", help="checkpoint folder (for its chat template)")
    _opt(f, "--grpc-url", FrontendSettings, "grpc_url")
    _opt(f, "--host", FrontendSettings, "host")
    _opt(f, "--port", FrontendSettings, "port", type=int)
    _add_frontend_flags(f)
    f.set_defaults(func=_frontend)


# -- worker -----------------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> int:
    import torch

    from .workers.bind import run_worker

    token = args.access_token
    if args.transfer_secret:
        os.environ[signing.ENV] = args.transfer_secret
    if args.settings:
        settings = WorkerSettings.model_validate_json(args.settings)
    else:
        url = args.join or args.url
        if not (args.stage and args.model and url):
            raise SystemExit("trident worker: give --settings JSON, or STAGE --model PATH --join URL")
        settings = WorkerSettings(
            stage=args.stage, name=args.name, free_name=bool(args.join and not args.name), model=args.model, url=url, backend=args.backend, threads=args.threads,
            model_store=args.model_store, stats_dir=args.stats_dir, embedding_cache_bytes=args.embedding_cache_mib * MiB,
        )
    torch.set_num_threads(settings.threads)
    return run_worker(settings, token)


def _add_worker(sub) -> None:
    w = sub.add_parser("worker", help="bind one stage model into a running Triton (started by serve)")
    w.add_argument("--settings", help="the whole trident.config.WorkerSettings as JSON (what serve passes)")
    w.add_argument("stage", nargs="?", choices=list(STAGES), help="stage model to bind (without --settings)")
    w.add_argument("--model", help="checkpoint folder")
    w.add_argument("--url", help="Triton HTTP URL, e.g. http://127.0.0.1:8000 (binds as --name, default: the stage)")
    w.add_argument("--join", metavar="URL", help="add this worker to a running server at URL (Triton HTTP) as the "
                   "next free instance <stage>-<n>; its schedulers pick it up within a second")
    _opt(w, "--name", WorkerSettings, "name", shown=None)
    w.add_argument("--access-token", default=os.environ.get("TRIDENT_ACCESS_TOKEN"),
                   help="the server's repository-API token, printed by serve (env TRIDENT_ACCESS_TOKEN)")
    w.add_argument("--transfer-secret", default=None,
                   help=f"the server's record-signing key (env {signing.ENV}; a worker joining a server on "
                   "another host needs the secret that server was started with)")
    _opt(w, "--backend", WorkerSettings, "backend", choices=BACKENDS)
    _opt(w, "--threads", WorkerSettings, "threads", type=int)
    _opt(w, "--model-store", WorkerSettings, "model_store", shown=None)
    _opt(w, "--stats-dir", WorkerSettings, "stats_dir", shown=None)
    w.add_argument("--embedding-cache-mib", type=int, default=ServeSettings().embedding_cache_mib,
                   help=f"encode stage: embedding cache, MiB (default: {ServeSettings().embedding_cache_mib})")
    w.set_defaults(func=_worker)


# -- developer tools --------------------------------------------------------------------------------------
def _build_demo_model(args: argparse.Namespace) -> int:
    from .dev.demo import build_demo_model

    build_demo_model(args.arch, args.out, seed=args.seed)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .dev import bench

    torch.set_num_threads(args.threads)
    if args.what == "transfer":
        bench.run_transfer_bench(repeat_scale=args.repeat_scale)
        return 0
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from .dev.demo import build_demo_model

            model = os.path.join(tmp, args.arch)
            build_demo_model(args.arch, model, log=None)
        bench.run_decode_bench(model, new_tokens=args.new_tokens)
    return 0


def _add_dev(sub) -> None:
    archs = _demo_archs()
    d = sub.add_parser("build-demo-model", help="write a small random-weight demo checkpoint")
    d.add_argument("--arch", choices=archs, default="llava", help="model family (default: llava)")
    d.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    d.add_argument("out", help="output folder")
    d.set_defaults(func=_build_demo_model)

    b = sub.add_parser("bench", help="print a benchmark table")
    b.add_argument("what", choices=["transfer", "decode"], help="transfer: NIXL READ vs memcpy; decode: batched decode")
    b.add_argument("--model", help="checkpoint folder for decode (default: a fresh demo model of --arch)")
    b.add_argument("--arch", choices=archs, default="llava")
    b.add_argument("--new-tokens", type=int, default=64, help="tokens per request for decode (default: 64)")
    b.add_argument("--repeat-scale", type=float, default=1.0, help="scale the transfer repetitions")
    b.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    b.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trident", description="Disaggregated multimodal LLM serving on Triton.")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_frontend(sub)
    _add_worker(sub)
    _add_dev(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors())
        print(f"trident {args.command}: invalid settings: {problems}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
