#!/usr/bin/env python3
"""Stage stub <-> worker messages, two ways side by side (``TRIDENT_STAGE_WIRE``, :mod:`trident.workers.wire`):
by default PyTriton's transport (with the inline tensors) against Trident's channel
(:mod:`trident.workers.channel`); ``--wires tensorstore pytriton`` compares PyTriton's tensor store with the
inline tensors.

Starts two `trident serve --mode e_p_d ep_d` servers on the LLaVA demo (hf engine), one per wire, both up at
once; rounds alternate between them. Per round and mode: TTFT at concurrency 1 (one gRPC stream, a new image
per request, 4 new tokens), tokens/s at concurrency 8 (32 requests, 32 new tokens each) and the CPU seconds
all the server's processes used for those 32. Prints the medians over the rounds as a markdown table.

    HF_HUB_OFFLINE=1 .venv/bin/python clients/perf/bench_wire.py [--rounds 3] [--wires A B]
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench_scheduler import PROMPT, Serve, Stream, image_b64, load

MODES = ("e_p_d", "ep_d")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wires", nargs=2, default=["pytriton", "channel"], choices=["tensorstore", "pytriton", "channel"],
                    help="the two ways to compare: baseline, then candidate (default: pytriton channel)")
    args = ap.parse_args()
    wires = tuple(args.wires)
    from transformers import AutoTokenizer

    from trident.dev.demo import default_demo_model

    model = str(default_demo_model("llava"))
    text = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}],
        tokenize=False, add_generation_prompt=True)
    servers: dict[str, Serve] = {}
    results: dict[tuple, list[float]] = {}
    seed = 1000
    try:
        for wire in wires:
            os.environ["TRIDENT_STAGE_WIRE"] = wire
            servers[wire] = Serve(model, [], modes=MODES)
            print(f"server with the {wire} wire is ready", flush=True)
        for rnd in range(args.rounds):
            for wire in (wires if rnd % 2 == 0 else wires[::-1]):
                server = servers[wire]
                url = f"127.0.0.1:{server.grpc}"
                for mode in MODES:
                    stream = Stream(url)
                    stream.request(mode, text, [image_b64(seed)], 4)  # warm
                    ttfts = [stream.request(mode, text, [image_b64(seed + 1 + i)], 4)[0] * 1e3 for i in range(15)]
                    stream.close()
                    jobs = [(text, [image_b64(seed + 16 + i)]) for i in range(32)]
                    seed += 48
                    cpu0 = sum(server.cpu_seconds().values())
                    tok_s = load(url, mode, jobs, 8, 32)["tok_s"]
                    cpu = sum(server.cpu_seconds().values()) - cpu0
                    for key, value in (("ttft", statistics.median(ttfts)), ("tok_s", tok_s), ("cpu", cpu)):
                        results.setdefault((wire, mode, key), []).append(value)
                    print(f"round {rnd} {wire:11s} {mode:5s} TTFT c=1 {statistics.median(ttfts):6.1f} ms  "
                          f"c=8 {tok_s:6.1f} tok/s  {cpu:5.1f} CPU s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n| mode | measure | {wires[0]} | {wires[1]} | {wires[1]} / {wires[0]} |\n|---|---|---|---|---|")
    for mode in MODES:
        for key, name in (("ttft", "TTFT p50, concurrency 1 (ms)"), ("tok_s", "tokens/s, concurrency 8"),
                          ("cpu", "CPU seconds per 32 requests, concurrency 8")):
            a, b = (statistics.median(results[(w, mode, key)]) for w in wires)
            print(f"| {mode} | {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
