#!/usr/bin/env python3
"""What the split costs in throughput: each single-mode server against the same engine in-process, side by side.

For each mode, starts `trident serve --mode X` (hf engine, LLaVA demo, OpenAI frontend off) and alternates
rounds between it and the ``generate`` stage engine in this process (the engine roles EPD's worker runs, no
Triton, no transfers, one torch thread as a worker has). A round is the same requests both ways: ``--requests``
prompts, each with a new 224 px image (so no embedding-cache hit), ``--max-tokens`` new tokens (greedy,
ignore_eos), ``--concurrency`` at a time. The server is driven by one asyncio client (``tritonclient.grpc.aio``,
one stream per request, as Triton's vLLM-backend clients send); in-process requests go from image bytes to
streamed text the same way the worker serves them. The server's process tree's CPU seconds per round are
kept, to show where the time goes.

Prints, per mode, tokens/s and TTFT of both and their ratio per round; with --report the table goes into the
report's section `bench-split` (docs/benchmarks.md).

    make bench-split                   (BASE=<commit>: also a server of that commit, up beside each mode's)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_openai import grpc_stream
from bench_scheduler import PROMPT, Serve, image_b64
from report import write_section
from trees import base_python, short

MODES = ("epd", "e_pd", "e_p_d", "ep_d")


class InProcess:
    """The ``generate`` stage engine in this process, served as the EPD worker serves it."""

    def __init__(self, model: str, max_tokens: int) -> None:
        import torch

        from trident.worker.engines.hf.stage import HFStageEngine
        from trident.core.processor import SamplingParams
        from trident.core.protocol import STAGES

        torch.set_num_threads(1)  # as a worker runs (--threads 1)
        self.engine = HFStageEngine(STAGES["generate"], model)
        self.params = SamplingParams.from_json(json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))

    async def request(self, text: str, image: str) -> tuple[float, int]:
        from trident.core.media import MediaItem
        from trident.core.output import OutputOptions, entry_responses

        t0 = time.monotonic_ns()
        generation = await self.engine.generate(text, self.params, media=[MediaItem.from_base64(image.encode(), 0)])
        ttft, tokens = None, 0
        opts = OutputOptions(stream=True, exclude_input_in_output=True, return_num_output_tokens=True)
        async for response in entry_responses(generation, opts, None):
            ttft = ttft or (time.monotonic_ns() - t0) / 1e9
            tokens += int(response["num_output_tokens"][0])  # (each response counts its own tokens)
        return ttft or float("nan"), tokens

    def close(self) -> None:
        self.engine.close()


async def load(one, images: list[str], concurrency: int) -> dict:
    """``one(image)`` for every image, ``concurrency`` at a time: tokens/s and TTFT p50 (ms)."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(image: str) -> tuple[float, int]:
        async with gate:
            return await one(image)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(gated(im) for im in images))
    span = time.perf_counter() - t0
    return {"tok_s": sum(r[1] for r in results) / span, "ttft_p50": statistics.median(r[0] for r in results) * 1e3,
            "tokens": sum(r[1] for r in results)}


def _own_cpu() -> float:
    """CPU seconds of this process so far (all its threads)."""
    t = os.times()
    return t.user + t.system


async def compare(servers: dict[str, Serve], local: InProcess, mode: str, text: str, args, seed: int) -> list[dict]:
    """Rounds going the same requests each way: every server (``"server"``: the default one; the others: those of
    :data:`OTHER_SERVERS`) and in-process, in an order that turns each round."""
    import tritonclient.grpc.aio as grpcclient

    clients = {way: grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc}") for way, srv in servers.items()}
    ways = {way: (lambda im, c=c: grpc_stream(c, mode, text, [im], args.max_tokens)) for way, c in clients.items()}
    ways["in-process"] = lambda im: local.request(text, im)
    order = list(ways)
    rounds = []
    try:
        for way in ways:  # warm each (connections, lazy set-up) with an image of no round
            await ways[way](image_b64(seed))
        for r in range(args.rounds):
            images = [image_b64(seed + 1 + r * args.requests + i) for i in range(args.requests)]
            row = {}
            for way in order[r % len(order):] + order[:r % len(order)]:
                srv = servers.get(way)
                cpu0, own0 = srv.cpu_seconds() if srv else {}, _own_cpu()
                row[way] = await load(ways[way], images, args.concurrency)
                row[way]["own_cpu"] = _own_cpu() - own0  # in-process: the engine; server rounds: the client
                if way == "server":
                    cpu1 = srv.cpu_seconds()
                    row["cpu"] = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
                expected = args.requests * args.max_tokens
                if row[way]["tokens"] != expected:
                    raise RuntimeError(f"{mode} {way}: {row[way]['tokens']} tokens, expected {expected}")
            local_tok_s = row["in-process"]["tok_s"]
            print(f"[bench] {mode} round {r}: " + ", ".join(f"{w} {row[w]['tok_s']:.1f} tok/s ({row[w]['tok_s'] / local_tok_s:.2f})"
                                                          for w in ways), flush=True)
            rounds.append(row)
    finally:
        for client in clients.values():
            await client.close()
    return rounds


OTHER_SERVERS = {  # --base: (its column, what the other server does)
    "base": ("base", "of commit {base}'s `trident` on today's packages (`--base`, up beside it)"),
}


def table(results: dict[str, list[dict]], args) -> list[str]:
    ways = [way for way in OTHER_SERVERS if any(way in r for rounds in results.values() for r in rounds)]
    others_text = "".join(f" {column[0].upper() + column[1:]}: the same rounds against another server {what}."
                          for column, what in (OTHER_SERVERS[way] for way in ways)).format(
                              base=short(args.base) if args.base else "")
    lines = [
        "## Single-mode servers vs in-process (`make bench-split`)", "",
        "`clients/perf/bench_split.py`: per mode a `trident serve --mode X` (LLaVA demo, hf engine, BLS scheduler, "
        "OpenAI frontend off) and the `generate` stage engine in the benchmark's own process (no Triton, no "
        "transfers, 1 torch thread as in a worker), in rounds alternating between the two. A round: the same "
        f"{args.requests} requests both ways, a new 224 px image each (no embedding-cache hit), {args.max_tokens} new "
        f"tokens, greedy, {args.concurrency} at a time; the server through one asyncio gRPC client (one stream per "
        f"request). server / in-process: the median of {args.rounds} rounds' ratios.{others_text} CPU s: the "
        "server's processes over a round (`triton`: Triton with its python-backend stubs, the BLS among them); "
        "in-process CPU s: the benchmark's process over its round (the engine; no client); client CPU s: the "
        "benchmark's process over a server round.", "",
        "| mode | server tok/s | in-process tok/s | server / in-process | "
        + "".join(f"{OTHER_SERVERS[way][0]} / in-process | server / {OTHER_SERVERS[way][0]} | " for way in ways)
        + "TTFT p50 server / in-process ms | server CPU s per round | in-process CPU s | client CPU s | target |",
        "|---|---|---|---|" + "---|---|" * len(ways) + "---|---|---|---|---|",
    ]
    follows = []  # per mode: all the server's CPU s per round / in-process's CPU s
    for mode, rounds in results.items():
        ratios = [r["server"]["tok_s"] / r["in-process"]["tok_s"] for r in rounds]
        others = "".join(f"{statistics.median(r[way]['tok_s'] / r['in-process']['tok_s'] for r in rounds):.2f} | "
                         f"{statistics.median(r['server']['tok_s'] / r[way]['tok_s'] for r in rounds):.2f} | "
                         if way in rounds[0] else " | | " for way in ways)
        cpu: dict[str, float] = {}
        for r in rounds:
            for k, v in r["cpu"].items():
                cpu[k] = cpu.get(k, 0.0) + v / len(rounds)
        cpu_text = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        local_cpu = statistics.median(r["in-process"]["own_cpu"] for r in rounds)
        follows.append(f"{mode} {sum(cpu.values()):.1f} / {local_cpu:.1f}")
        lines.append(
            f"| {mode} | {statistics.median(r['server']['tok_s'] for r in rounds):.1f} | "
            f"{statistics.median(r['in-process']['tok_s'] for r in rounds):.1f} | **{statistics.median(ratios):.2f}** | "
            f"{others}{statistics.median(r['server']['ttft_p50'] for r in rounds):.0f} / "
            f"{statistics.median(r['in-process']['ttft_p50'] for r in rounds):.0f} | {cpu_text} | {local_cpu:.1f} | "
            f"{statistics.median(r['server']['own_cpu'] for r in rounds):.1f} | >= 0.9 |")
    lines += ["", "Throughput follows CPU. CPU s per round, all the server's processes / in-process: "
              + ", ".join(follows) + "."]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32, help="requests per round and way (default: 32)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--report", type=Path, help="markdown file to put the table into")
    ap.add_argument("--base", metavar="COMMIT", help="also run a server of this commit's trident (its tree on "
                    "today's packages): the same rounds side by side")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a stopped bench stops its servers on the way out)
    work = Path(tempfile.mkdtemp(prefix="bench-split-base-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    base = base_python(args.base, work) if args.base else None

    from transformers import AutoTokenizer

    from trident.dev.demo import default_demo_model

    model = str(default_demo_model("llava"))
    text = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        tokenize=False, add_generation_prompt=True)
    local = InProcess(model, args.max_tokens)
    results: dict[str, list[dict]] = {}
    try:
        for k, mode in enumerate(args.modes):
            servers = {"server": Serve(model, [], modes=(mode,))}
            if base:
                servers["base"] = Serve(model, [], modes=(mode,), python=base)
            try:
                results[mode] = asyncio.run(compare(servers, local, mode, text, args, seed=50_000 + 10_000 * k))
            finally:
                for server in servers.values():
                    server.stop()
    finally:
        local.close()
    lines = table(results, args)
    print("\n".join(lines))
    if args.report:
        write_section(args.report, "bench-split", lines, before="bench-openai")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
