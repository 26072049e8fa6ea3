#!/usr/bin/env python3
"""What tracing costs: the same E/P/D requests into a server with tracing off and one tracing every request.

Starts two `trident serve` on a demo model (hf engine): one with `tracing.exporter: none`, one with the file
exporter (every span of every process written as it ends). One client (tritonclient, one gRPC stream per server)
sends the same requests to both, alternating request by request, one at a time, each with a new image. Prints TTFT
and request latency per server and their ratios, and the cost of one step in a process with tracing off and on.

    make bench-tracing                       (LLaVA demo; the table goes into docs/benchmarks.md, section `bench-tracing`)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_scheduler import Serve, Stream, demo_with_image_prompt, image_b64
from report import DEMO_NAMES, write_section
from spans import tracing_config

MODE = "e_p_d"


def step_cost(traced: bool, n: int = 200_000) -> float:
    """ns per ``with tracing.step(...)`` inside a request, in a fresh process (tracing off, or on with a file)."""
    import subprocess

    folder = tempfile.mkdtemp(prefix="bench-tracing-step-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if traced:
        env.update(OTEL_TRACES_EXPORTER="file", TRIDENT_TRACE_DIR=folder)
    script = f"""
import time
from trident.core import tracing
tracing.start("bench")
with tracing.request("request"):
    t0 = time.perf_counter_ns()
    for _ in range({n}):
        with tracing.step("s"):
            pass
    print((time.perf_counter_ns() - t0) / {n})
"""
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llava", help="demo model (default: llava)")
    ap.add_argument("--requests", type=int, default=40, help="requests per server (default: 40)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default: 16)")
    ap.add_argument("--report", type=Path, help="markdown file to put the table into (its bench-tracing section)")
    args = ap.parse_args()

    model, text = demo_with_image_prompt(args.arch)
    folder = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    settings = {"off": {"tracing": {"exporter": "none"}}, "on": tracing_config(folder)}
    servers, streams = {}, {}
    try:
        for name, config in settings.items():
            print(f"[bench-tracing] starting the server with tracing {name}", flush=True)
            servers[name] = Serve(model, [], modes=(MODE,), config={**config, "scheduling": {"local_prefill_tokens": 0}})
            streams[name] = Stream(f"127.0.0.1:{servers[name].grpc}")
        for name, stream in streams.items():
            for i in range(3):  # warm-up: connections, first-call costs
                stream.request(MODE, text, [image_b64(900_000 + i)], args.max_tokens)
        runs: dict[str, dict[str, list[float]]] = {name: {"ttft": [], "latency": []} for name in settings}
        for i in range(args.requests):
            order = list(settings) if i % 2 == 0 else list(reversed(settings))  # neither always goes first
            for name in order:
                clock: dict = {}
                streams[name].request(MODE, text, [image_b64(100_000 + i)], args.max_tokens, clock)
                runs[name]["ttft"].append((clock["first"] - clock["send"]) / 1e6)
                runs[name]["latency"].append((clock["done"] - clock["send"]) / 1e6)
        spans = sum(len(p.read_text().splitlines()) for p in folder.glob("*.jsonl"))
    finally:
        for stream in streams.values():
            stream.close()
        for server in servers.values():
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    off_step, on_step = step_cost(False), step_cost(True)

    def p50(name: str, key: str) -> float:
        return statistics.median(runs[name][key])

    lines = ["## What tracing costs (`make bench-tracing`)", "",
             f"`clients/perf/bench_tracing.py`: two `trident serve` on the {DEMO_NAMES.get(args.arch, args.arch)} demo "
             f"(hf engine, {MODE}), one with tracing off (`tracing.exporter: none`), one tracing every request with "
             "the file exporter (each span written as it ends). One client sends both the same requests, alternating "
             f"request by request, one at a time: {args.requests} each, a new 224 px image and {args.max_tokens} new "
             f"tokens per request. The traced server wrote {spans} spans.", "",
             "| | tracing off p50 ms | tracing on p50 ms | on / off |", "|---|---|---|---|"]
    for key, label in (("ttft", "TTFT"), ("latency", "request latency")):
        off, on = p50("off", key), p50("on", key)
        lines.append(f"| {label} | {off:.1f} | {on:.1f} | {on / off:.3f} |")
    lines += ["", "One step (`with tracing.step(...)`) inside a request, in a process of its own:", "",
              "| tracing | ns per step |", "|---|---|",
              f"| off | {off_step:.0f} |", f"| on (file exporter) | {on_step:.0f} |"]
    print("\n".join(lines), flush=True)
    if args.report:
        write_section(args.report, "bench-tracing", lines, before="bench-direct-call")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
