#!/usr/bin/env python3
"""Where one request's time goes: a per-hop breakdown of TTFT for E/P/D and EP/D at concurrency 1.

Starts `trident serve` tracing every request into files (:mod:`trident.core.tracing`, the file exporter) on a demo
model (hf engine), sends requests one at a time over gRPC streaming (tritonclient), each with a new image, and
reads the spans every process wrote (the BLS scheduler and each stage worker). A span belongs to the request
whose send..done window holds it. The same requests also run through the ``generate`` stage's engine in this
process (no Triton, no transfers), traced the same way.

Prints, per mode, the median over the requests of each hop in ms, and TTFT against in-process.

    make bench-hops                          (LLaVA demo; the tables go into docs/benchmarks.md, section `bench-hops`)
    make bench-hops BASE=<commit>            (also that commit's server, run after the working tree's)
"""

from __future__ import annotations

import argparse
import atexit
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_scheduler import Serve, Stream, demo_with_image_prompt, image_b64
import spans
from report import DEMO_NAMES, write_section
from trees import base_python, short

MODES = ("e_p_d", "ep_d")

Steps = dict[str, list[tuple[int, int]]]  # "process/step" -> [(t0, t1)] inside the request's window


def _dur(steps: Steps, key: str) -> float | None:
    spans = steps.get(key)
    return sum(t1 - t0 for t0, t1 in spans) / 1e6 if spans else None


def _gap(a: int | None, b: int | None) -> float | None:
    return (b - a) / 1e6 if a is not None and b is not None else None


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]


def _first(steps: Steps, key: str, end: bool = False) -> int | None:
    spans = steps.get(key)
    return (spans[0][1] if end else spans[0][0]) if spans else None


def stage_rows(steps: Steps, stage: str, streamed: bool, handed: bool = False) -> list[tuple[str, float | None]]:
    """One stage call seen from the BLS: the hops to the worker and back, and the worker's own steps. ``handed``:
    a call posted ahead, whose record the encode worker handed it (from then on)."""
    call = steps.get(f"bls/call:{stage}")
    call_t0, call_t1 = (call[0] if call else (None, None))
    infer = steps.get(f"{stage}/infer_first" if streamed else f"{stage}/infer")
    infer_t0, infer_t1 = (infer[0] if infer else (None, None))
    if handed:
        rows = [(f"{stage}: record in -> call runs", _gap(_first(steps, f"{stage}/await_record", end=True), infer_t0))]
    else:
        rows = [(f"{stage}: BLS -> worker", _gap(call_t0, infer_t0))]
    rows.append((f"{stage}: worker, request inputs", _dur(steps, f"{stage}/inputs")))
    listed = 0.0
    for step in ("record_decode", "tokenize", "nixl_read", "media_decode", "image_preprocess", "vision_tower",
                 "prefill", "publish", "record_encode", "hand_on", "first_token"):
        spans = steps.get(f"{stage}/{step}", [])
        if streamed and infer_t1 is not None:  # what the stage does after its first response is not in TTFT
            spans = [(t0, t1) for t0, t1 in spans if t0 < infer_t1]
        value = _dur({"s": spans}, "s")
        if value is not None:
            label = "first token emitted" if step == "first_token" else step.replace("_", " ")
            rows.append((f"{stage}: {label}", value))
            listed += value
    if streamed:
        emitted = _gap(_first(steps, f"{stage}/first_token", end=True), infer_t1)
        rows.append((f"{stage}: first token emitted -> yielded to the stage server", emitted))
        listed += emitted or 0.0
    if infer_t0 is not None:
        inputs = _dur(steps, f"{stage}/inputs") or 0.0
        rows.append((f"{stage}: worker, between those (event loop, thread hops)", (infer_t1 - infer_t0) / 1e6 - inputs - listed))
    rows.append((f"{stage}: worker -> BLS", _gap(infer_t1, call_t1)))
    if not handed:  # (one posted ahead began before the encode call)
        rows.append((f"{stage}: whole call, from the BLS", _gap(call_t0, call_t1)))
    return rows


def breakdown(steps: Steps, clock: dict, mode: str) -> list[tuple[str, float | None]]:
    stages = {"e_p_d": ("encode", "prefill", "decode"), "ep_d": ("encode_prefill", "decode")}[mode]
    execute = _first(steps, "bls/execute")
    rows = [("client -> Triton -> BLS", _gap(clock["send"], execute)),
            ("BLS: read inputs (hash images)", _dur(steps, "bls/inputs"))]
    last = _first(steps, "bls/inputs", end=True)
    sent = _first(steps, "bls/first_send")
    early = sent_early(steps)
    for stage in stages[:-1] if early else stages:
        t0 = _first(steps, f"bls/call:{stage}")
        handed = stage == "prefill" and _first(steps, "prefill/await_record") is not None
        if handed:  # posted beside the encode call: it runs from when the encode worker hands its record on
            rows.append(("record: encode worker -> prefill worker (handed on)",
                         _gap(_first(steps, "encode/hand_on"), _first(steps, "prefill/await_record", end=True))))
        else:
            rows.append((f"BLS between calls (before {stage})", _gap(last, t0)))
        rows += stage_rows(steps, stage, streamed=stage == "decode", handed=handed)
        last = _first(steps, f"bls/call:{stage}", end=True)
    if early:
        rows.append((EARLY, _gap(last, sent)))
    rows.append(("BLS: first response sent", _dur(steps, "bls/first_send")))
    rows.append(("BLS -> Triton -> client", _gap(_first(steps, "bls/first_send", end=True), clock["first"])))
    ttft = _gap(clock["send"], clock["first"])
    rows.append(("TTFT", ttft))
    rows.append(("compute: " + ", ".join(s.replace("_", " ") for s in COMPUTE), compute(steps)))
    rows.append(("TTFT - compute: what the split costs", ttft - compute(steps)))
    return rows


EARLY = "BLS: kv_meta's first text read"


def sent_early(steps: Steps) -> bool:
    """The first text came in the prefill's kv_meta: the BLS sent it before the decode call (which is then not a
    part of TTFT)."""
    sent, decode_call = _first(steps, "bls/first_send"), _first(steps, "bls/call:decode")
    return sent is not None and decode_call is not None and sent < decode_call


def early_pair(steps: Steps, clock: dict) -> tuple[float, float] | None:
    """For a request whose first text the BLS sent early: (its TTFT, the TTFT it would have had sent on the decode's
    first response: that response's arrival at the BLS (the end of the BLS's ``call:decode`` step) plus the same
    send and way out), in ms; None for the others."""
    if not sent_early(steps):
        return None
    ttft = _gap(clock["send"], clock["first"])
    return ttft, ttft + (_first(steps, "bls/call:decode", end=True) - _first(steps, "bls/first_send")) / 1e6


def encode_to_prefill(steps: Steps) -> float | None:
    """E/P/D: ms from the encode worker's record made to the prefill call running on its worker."""
    return _gap(_first(steps, "encode/record_encode", end=True), _first(steps, "prefill/infer"))


COMPUTE = ("media_decode", "image_preprocess", "vision_tower", "prefill")  # the same work in-process


def compute(steps: Steps) -> float:
    """ms of the request's model work (the steps it takes in-process too), wherever it ran."""
    return sum(t1 - t0 for key, spans in steps.items() if key.split("/", 1)[1] in COMPUTE for t0, t1 in spans) / 1e6


def read_steps(trace_dir: Path) -> list[tuple[str, int, int]]:
    return spans.read_steps(trace_dir, lambda stem: "bls" if stem.startswith("bls-") else stem)


def window(all_steps, clock: dict) -> Steps:
    steps: Steps = defaultdict(list)
    for key, t0, t1 in sorted(all_steps, key=lambda s: s[1]):
        if clock["send"] <= t0 <= clock["done"]:
            steps[key].append((t0, t1))
    return steps


def in_process(model: str, text: str, images: list[str], trace_dir: Path, max_tokens: int) -> list[dict]:
    """The same requests through the ``generate`` stage engine here: TTFT, and this process's steps."""
    os.environ.update({"OTEL_TRACES_EXPORTER": "file", "TRIDENT_TRACE_DIR": str(trace_dir)})
    import torch

    from trident.core import tracing
    from trident.worker.engines.hf.stage import HFStageEngine
    from trident.core.media import MediaItem
    from trident.core.output import OutputOptions, entry_responses
    from trident.core.processor import SamplingParams
    from trident.core.protocol import STAGES

    torch.set_num_threads(1)  # as a worker runs
    tracing.start("in-process")
    engine = HFStageEngine(STAGES["generate"], model)
    params = SamplingParams.from_json(json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))

    async def one(b64: str) -> dict:
        with tracing.request("request"):
            return await traced(b64)

    async def traced(b64: str) -> dict:
        clock = {"send": time.monotonic_ns()}
        generation = await engine.generate(text, params, media=[MediaItem.from_base64(b64.encode(), 0)])
        # the first streamed response, as the server sends it (a first token with no text yet sends none)
        async for _ in entry_responses(generation, OutputOptions(stream=True), None):
            clock.setdefault("first", time.monotonic_ns())
        clock["done"] = time.monotonic_ns()
        return clock

    async def run() -> list[dict]:
        await one(image_b64(424_242))
        return [await one(b64) for b64 in images]

    try:
        return asyncio.run(run())
    finally:
        engine.close()


def serve_requests(model: str, text: str, args, trace_dir: Path, python: str | None = None):
    """``args.requests`` requests per mode, one at a time, into a server (from another environment's ``python``):
    (the clocks per mode, every process's steps)."""
    print(f"[bench-hops] starting the server (steps in {trace_dir})", flush=True)
    # every request takes its mode's full path (no prefill on the decode side for short prompts)
    server = Serve(model, [], modes=(*MODES, "epd"), python=python, config={
        **spans.tracing_config(trace_dir), "scheduling": {"local_prefill_tokens": 0}})
    clocks: dict[str, list[dict]] = {}
    try:
        stream = Stream(f"127.0.0.1:{server.grpc}")  # one client and stream, as a real client keeps them
        for k, mode in enumerate(MODES):
            for i in range(3):  # warm-up: connections, first-call costs
                stream.request(mode, text, [image_b64(900_000 + 10 * k + i)], args.max_tokens)
            clocks[mode] = []
            for i in range(args.requests):
                clock: dict = {}
                stream.request(mode, text, [image_b64(100_000 + i)], args.max_tokens, clock)  # the same images in every mode
                clocks[mode].append(clock)
                time.sleep(0.05)  # keep the windows apart
            print(f"[bench-hops] {mode}: {args.requests} requests", flush=True)
        stream.close()
        (trace_dir / "clocks.json").write_text(json.dumps(clocks))  # with the steps: every request's hops, again
    finally:
        server.stop()
    return clocks, read_steps(trace_dir)


def added_ttft(clocks: dict[str, list[dict]], steps) -> dict[str, tuple[float, float]]:
    """Per mode: (TTFT p50, p50 of TTFT less the model's own work) in ms."""
    out = {}
    for mode in MODES:
        rows = [dict(breakdown(window(steps, c), c, mode)) for c in clocks[mode]]
        out[mode] = (statistics.median(r["TTFT"] for r in rows),
                     statistics.median(r["TTFT - compute: what the split costs"] for r in rows))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llava", help="demo model (default: llava)")
    ap.add_argument("--requests", type=int, default=20, help="requests per mode (default: 20)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per request (default: 4)")
    ap.add_argument("--report", type=Path, help="markdown file to put the table into (its hops section)")
    ap.add_argument("--base", metavar="COMMIT", help="also run the server of this commit's trident (its tree on "
                    "today's packages), after the working tree's, and add its rows")
    args = ap.parse_args()

    model, text = demo_with_image_prompt(args.arch)
    trace_dir = Path(tempfile.mkdtemp(prefix="bench-hops-"))
    atexit.register(shutil.rmtree, trace_dir, ignore_errors=True)  # the step timings, read before the end
    runs = {"server": serve_requests(model, text, args, trace_dir / "server")}
    if args.base:
        runs["base"] = serve_requests(model, text, args, trace_dir / "base", python=base_python(args.base, trace_dir))
    images = [image_b64(100_000 + i) for i in range(args.requests)]  # and in-process
    local = in_process(model, text, images, trace_dir / "local", args.max_tokens)
    clocks, steps = runs["server"]
    local_steps = read_steps(trace_dir / "local")

    lines = ["## Where TTFT goes (`make bench-hops`)", "",
             "`clients/perf/bench_hops.py`: `trident serve` tracing every request (OpenTelemetry, the file exporter), the "
             f"{DEMO_NAMES.get(args.arch, args.arch)} demo and the hf engine, one gRPC stream (tritonclient) kept open "
             f"for {args.requests} requests per mode, each with a new 224 px image and {args.max_tokens} new tokens, "
             "one at a time. The table gives the median (p50) and 90th percentile (p90) of each hop in ms over the "
             "requests, from the spans that the BLS and the workers write. The "
             "scheduler calls the stages straight at their workers, and in E/P/D the encode worker hands "
             "its record straight to the prefill worker, whose call the BLS posts beside the encode's: the prefill "
             "call's rows start when its record is in. In-process: the same requests through the `generate` stage "
             "engine in the benchmark's process (no Triton, no transfers), traced the same way.", ""]
    in_rows = []
    for c in local:
        w = window(local_steps, c)
        row = {k: _dur(w, f"in-process/{k}") for k in (*COMPUTE, "decode_admit")}
        row["TTFT"] = _gap(c["send"], c["first"])
        row["TTFT - compute"] = row["TTFT"] - compute(w)
        in_rows.append(row)
    table: dict[str, dict[str, float]] = {}
    order: list[str] = []
    for mode in MODES:
        for clock in clocks[mode]:
            for label, value in breakdown(window(steps, clock), clock, mode):
                if label not in order:
                    order.append(label)
                if value is not None:
                    table.setdefault(label, {}).setdefault(mode, []).append(value)
    lines += ["| hop | " + " | ".join(f"{m} p50 | {m} p90" for m in MODES) + " |", "|---|" + "---|" * 2 * len(MODES)]
    for label in order:
        cells = [f"{statistics.median(table[label][m]):.2f} | {_p90(table[label][m]):.2f}" if m in table.get(label, {})
                 else " | " for m in MODES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "The BLS sends a streaming client the first text from the prefill's `kv_meta` before it calls the "
              "decode stage; the decode rows above are those of the other requests, whose first token had no text of "
              "its own (the demo's random weights pick such tokens, e.g. one byte of a UTF-8 character, whose first "
              "response waits for the next token). What the same requests' TTFT would have been had the BLS waited "
              "for the decode's first response (its arrival at the BLS, plus that request's own send and way to the "
              "client):", "",
              "| mode | requests with an early first text | TTFT p50 ms | waiting for the decode, p50 ms | saved p50 ms |",
              "|---|---|---|---|---|"]
    for mode in MODES:
        pairs = [p for p in (early_pair(window(steps, c), c) for c in clocks[mode]) if p is not None]
        if pairs:
            now, waited = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
            lines.append(f"| {mode} | {len(pairs)} of {len(clocks[mode])} | {now:.1f} | {waited:.1f} | {waited - now:.1f} |")
    lines += ["", "| in-process (generate engine) | ms |", "|---|---|"]
    for key in (*COMPUTE, "decode_admit", "TTFT", "TTFT - compute"):
        values = [r[key] for r in in_rows if r[key] is not None]
        if values:
            lines.append(f"| {key.replace('_', ' ')} | {statistics.median(values):.2f} |")
    local_ttft = statistics.median(r["TTFT"] for r in in_rows)
    local_rest = statistics.median(r["TTFT - compute"] for r in in_rows)
    lines += ["", "Added TTFT: the median of TTFT minus the model's own work (image decode, preprocess, vision tower, "
              "prefill, which vary by some ms between runs), against the same in-process"
              + (", and the same for the base commit's server, run after it." if args.base else ".") + "", "",
              "| server | TTFT p50 ms | in-process p50 ms | TTFT - compute | in-process TTFT - compute | added ms | target |",
              "|---|---|---|---|---|---|---|"]
    labels = {"server": "", "base": f"base ({short(args.base)})" if args.base else ""}
    for calls, label in labels.items():
        if calls not in runs:
            continue
        added = added_ttft(*runs[calls])
        for mode in MODES:
            ttft, rest = added[mode]
            lines.append(f"| {mode}{', ' + label if label else ''} | {ttft:.1f} | {local_ttft:.1f} | {rest:.1f} | "
                         f"{local_rest:.1f} | {rest - local_rest:+.1f} | <= +5 |")
    lines += ["", "E/P/D's way from the encode to the prefill has no compute in it: from the encode worker's record "
              "made (its `record_encode` step's end) to the prefill call running on its worker (its `infer` step's "
              "start), per request:", "",
              "| server | p25 ms | p50 ms | p75 ms |", "|---|---|---|---|"]
    for calls, label in (("server", "the encode worker hands the record to the prefill worker"),
                         ("base", labels["base"])):
        if calls not in runs:
            continue
        gaps = [g for g in (encode_to_prefill(window(runs[calls][1], c)) for c in runs[calls][0]["e_p_d"]) if g is not None]
        if len(gaps) > 1:
            q = statistics.quantiles(gaps, n=4)
            lines.append(f"| {label} | {q[0]:.2f} | {statistics.median(gaps):.2f} | {q[2]:.2f} |")
    lines += ["", "The bench runs one server at a time: servers up side by side each run cold one request in three, "
              "which raises every server's numbers."]
    print("\n".join(lines), flush=True)
    if args.report:
        write_section(args.report, "bench-hops", lines, before="bench-direct-call")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
