"""``trident``: the command line.

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trident", description="Disaggregated multimodal LLM serving on Triton.")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

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
