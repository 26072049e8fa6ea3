#!/usr/bin/env python3
"""The OpenAI frontend's own cost: the same requests through `/v1/chat/completions` and straight at the gRPC
entry model, side by side on one server, from one lightweight async client.

Starts `trident serve` (hf engine, one mode, the OpenAI frontend on) on a demo model. One asyncio client
process drives both paths:

- OpenAI: ``aiohttp.ClientSession`` streaming POSTs (SSE), the image as a ``data:`` URL, ``stream_options.include_usage``;
- gRPC: ``tritonclient.grpc.aio`` ``stream_infer``, one stream per request (as the frontend itself opens), the
  prompt the chat template renders for the same message and the same image as base64.

Each request has an image of its own (no embedding-cache hits). At concurrency 1 the two paths alternate
request by request; at concurrency 8 they alternate round by round. Prints TTFT and tokens/s of each path and
their ratios. The server writes its spans (the file exporter): per request at concurrency 1, TTFT minus the time the entry
model held the request before its first response left is the path's own cost, the compute behind it taken
out (TTFT itself moves by tens of ms between requests, more than the frontend costs).

    make bench-openai                        (LLaVA demo, EPD; the table goes into docs/benchmarks.md, section `bench-openai`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_scheduler import PROMPT, Serve, image_b64
from report import DEMO_NAMES, write_section
from spans import read_steps, tracing_config

TEXT_ONLY = "Tell me a short story about a lighthouse."


async def grpc_stream(client, mode: str, text: str, images: list[str], max_tokens: int) -> tuple[float, int]:
    """(TTFT s, output tokens) of one streamed request to an entry model on a gRPC stream of its own
    (``client``: a ``tritonclient.grpc.aio`` client), as a client of Triton's vLLM backend sends it."""
    import tritonclient.grpc.aio as g

    params = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    spec = [
        ("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
        ("sampling_parameters", np.array([params.encode()], dtype=np.object_), "BYTES"),
        ("stream", np.array([True]), "BOOL"),
        ("exclude_input_in_output", np.array([True]), "BOOL"),
        ("return_num_output_tokens", np.array([True]), "BOOL"),
    ]
    if images:
        spec.append(("image", np.array([i.encode() for i in images], dtype=np.object_), "BYTES"))
    inputs = []
    for name, arr, dtype in spec:
        t = g.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    async def requests():
        yield {"model_name": mode, "inputs": inputs}

    t0 = time.monotonic_ns()
    ttft, tokens = None, 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(str(error))
        out = result.as_numpy("text_output")
        if out is not None and out.size and out.reshape(-1)[0] and ttft is None:
            ttft = (time.monotonic_ns() - t0) / 1e9
        n = result.as_numpy("num_output_tokens")
        if n is not None and n.size:
            tokens += int(n.reshape(-1)[0])  # (each response counts its own tokens)
            if tokens >= max_tokens:
                break
    return ttft or float("nan"), tokens


class Paths:
    """The two ways into one mode, each returning (TTFT s, output tokens) for one streamed request."""

    def __init__(self, server: Serve, mode: str, prompt: str, text_prompt: str, max_tokens: int) -> None:
        import aiohttp
        import tritonclient.grpc.aio as grpcclient

        self.mode, self.prompt, self.text_prompt, self.max_tokens = mode, prompt, text_prompt, max_tokens
        self.grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        self.url = f"http://127.0.0.1:{server.openai}/v1/chat/completions"
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                          connector=aiohttp.TCPConnector(limit=64))
        self.model = f"{Path(server.model).name}:{mode}"
        self.sent: list[int] = []  # when each request was sent (time.monotonic_ns(), the server's trace clock)

    async def openai(self, image: str | None) -> tuple[float, int]:
        content = [{"type": "text", "text": PROMPT if image else TEXT_ONLY}]
        if image:
            content.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}})
        body = {
            "model": self.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
        }
        t0 = time.monotonic_ns()
        ttft, tokens = None, 0
        async with self.http.post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for raw in response.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0]["delta"].get("content") and ttft is None:
                    ttft = (time.monotonic_ns() - t0) / 1e9
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        self.sent.append(t0)
        return ttft or float("nan"), tokens

    async def triton(self, image: str | None) -> tuple[float, int]:
        t0 = time.monotonic_ns()
        ttft, tokens = await grpc_stream(self.grpc, self.mode, self.prompt if image else self.text_prompt,
                                         [image] if image else [], self.max_tokens)
        self.sent.append(t0)
        return ttft, tokens

    async def close(self) -> None:
        await self.http.close()
        await self.grpc.close()


async def run(server: Serve, args) -> dict[str, dict[str, list[float]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model)
    chat = lambda content: tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    paths = Paths(server, args.mode, chat([{"type": "image"}, {"type": "text", "text": PROMPT}]),
                  chat([{"type": "text", "text": TEXT_ONLY}]), args.max_tokens)
    call = {"openai": paths.openai, "grpc": paths.triton}
    seed = iter(range(10_000, 1_000_000))
    out: dict[str, dict[str, list]] = {p: {"ttft": [], "ttft_text": [], "tok_s": [], "windows": [], "windows_text": []}
                                       for p in call}
    try:
        for path in call:  # warm each path (and its connections) once
            await call[path](image_b64(next(seed), args.size))
        for i in range(2 * args.requests_c1):  # concurrency 1, alternating request by request
            path = ("openai", "grpc")[i % 2]
            for kind, image in (("", image_b64(next(seed), args.size)), ("_text", None)):  # with an image, text-only
                ttft, _ = await call[path](image)
                out[path]["ttft" + kind].append(ttft * 1000)
                out[path]["windows" + kind].append((paths.sent[-1], ttft))
        for round_ in range(args.rounds):  # concurrency N, alternating round by round
            for path in (("openai", "grpc") if round_ % 2 == 0 else ("grpc", "openai")):
                images = [image_b64(next(seed), args.size) for _ in range(args.requests)]
                gate = asyncio.Semaphore(args.concurrency)

                async def one(image: str) -> int:
                    async with gate:
                        return (await call[path](image))[1]

                t0 = time.perf_counter()
                tokens = await asyncio.gather(*(one(im) for im in images))
                rate = sum(tokens) / (time.perf_counter() - t0)
                out[path]["tok_s"].append(rate)
                print(f"[bench] round {round_} {path}: {rate:.1f} tok/s", flush=True)
    finally:
        await paths.close()
    return out


def outside_bls(trace: Path, mode: str, windows: list[tuple[int, float]]) -> list[float]:
    """Per request (sent at ``t0`` ns, first token ``ttft`` s later): TTFT minus the time the entry model held
    it before its first response left (its ``execute`` .. ``first_send`` spans, from the file exporter): the path
    to and from the entry model, without the work behind it, whose run-to-run spread (tens of ms) would hide a
    ms of difference between the paths."""
    steps = read_steps(trace)
    arrivals = sorted(t0 for key, t0, _ in steps if key == f"bls-{mode}/execute")
    sent = sorted(t1 for key, _, t1 in steps if key == f"bls-{mode}/first_send")
    out = []
    for t0, ttft in windows:
        t1 = t0 + int(ttft * 1e9)
        a = next((t for t in arrivals if t0 <= t <= t1), None)
        b = next((t for t in sent if a is not None and a <= t <= t1), None)
        if a is not None and b is not None:
            out.append((t1 - t0 - (b - a)) / 1e6)
    return out


def table(out: dict, args) -> list[str]:
    o, g = out["openai"], out["grpc"]
    ttft_o, ttft_g = statistics.median(o["ttft"]), statistics.median(g["ttft"])
    rate_o, rate_g = statistics.fmean(o["tok_s"]), statistics.fmean(g["tok_s"])
    return [
        "## OpenAI frontend vs gRPC (`make bench-openai`)", "",
        "`clients/perf/bench_openai.py`: one asyncio client process for both paths (aiohttp SSE to "
        "`/v1/chat/completions`; `tritonclient.grpc.aio` to the entry model); "
        f"{DEMO_NAMES.get(args.arch, args.arch)} demo, `{args.mode}`, hf engine, {args.size} px images (a new one per "
        f"request), {args.max_tokens} new tokens. Concurrency 1: {args.requests_c1} requests per path with an image "
        f"and as many text-only, alternating. Concurrency {args.concurrency}: {args.requests} requests per round, "
        f"{args.rounds} rounds per path, alternating. Time outside the entry model: TTFT minus the time from the entry "
        "model's `execute` to its first response's hand-over to Triton (from the step timings), per request: the "
        "client, the frontend and Triton's way in and out, without the compute behind it (which varies by tens of "
        "ms between runs).",
        "", "| measure | OpenAI | gRPC | OpenAI / gRPC | target |", "|---|---|---|---|---|",
        f"| median TTFT with an image, concurrency 1 (ms) | {ttft_o:.1f} | {ttft_g:.1f} | {ttft_o - ttft_g:+.1f} ms | |",
        f"| p90 TTFT, concurrency 1 (ms) | {np.percentile(o['ttft'], 90):.1f} | {np.percentile(g['ttft'], 90):.1f} | | |",
        f"| median TTFT, text-only, concurrency 1 (ms) | {statistics.median(o['ttft_text']):.1f} | "
        f"{statistics.median(g['ttft_text']):.1f} | "
        f"{statistics.median(o['ttft_text']) - statistics.median(g['ttft_text']):+.1f} ms | |",
        f"| median time outside the entry model, with an image, concurrency 1 (ms) | {o['outside']:.2f} | "
        f"{g['outside']:.2f} | {o['outside'] - g['outside']:+.2f} ms | <= +2 ms |",
        f"| median time outside the entry model, text-only, concurrency 1 (ms) | {o['outside_text']:.2f} | "
        f"{g['outside_text']:.2f} | {o['outside_text'] - g['outside_text']:+.2f} ms | <= +2 ms |",
        f"| tokens/s, concurrency {args.concurrency} (mean of rounds) | {rate_o:.1f} | {rate_g:.1f} | "
        f"{rate_o / rate_g:.2f} | >= 0.95 |",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llava", help="demo model (default: llava)")
    ap.add_argument("--mode", default="epd", help="entry model (default: epd)")
    ap.add_argument("--requests-c1", type=int, default=30, help="requests per path at concurrency 1")
    ap.add_argument("--requests", type=int, default=48, help="requests per round at concurrency N")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per path at concurrency N")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--size", type=int, default=224, help="image side, px (default: 224)")
    ap.add_argument("--report", type=Path, help="markdown file to put the table into")
    args = ap.parse_args()

    from trident.dev.demo import default_demo_model

    model = str(default_demo_model(args.arch, log=None))
    print(f"[bench] starting the server ({args.mode}, OpenAI frontend on)", flush=True)
    trace = Path(tempfile.mkdtemp(prefix="bench-openai-trace-"))
    server = Serve(model, [], modes=(args.mode,), openai=True, config=tracing_config(trace))
    try:
        out = asyncio.run(run(server, args))
        for path in out.values():
            for kind in ("", "_text"):
                path["outside" + kind] = statistics.median(outside_bls(trace, args.mode, path["windows" + kind]))
    finally:
        server.stop()
        shutil.rmtree(trace, ignore_errors=True)
    lines = table(out, args)
    print("\n".join(lines), flush=True)
    if args.report:
        write_section(args.report, "bench-openai", lines, before="bench-hops")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
