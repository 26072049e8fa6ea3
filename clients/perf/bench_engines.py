#!/usr/bin/env python3
"""Both engines in every mode, side by side with vLLM's own OpenAI server.

For each engine (hf, vllm) and mode, starts `trident serve --mode <mode>` and times its start-up; starts
`python -m vllm.entrypoints.openai.api_server` on the same checkpoint and times its start-up too. Then the
same OpenAI chat client (streaming, a new image per request, greedy, ignore_eos) sends R rounds of N requests
at concurrency C to each, and the table reports TTFT p50/p99 over every round, output tokens/s over the rounds
and start-up time, with each figure as a ratio to vLLM's own server. Images are never repeated, so neither
Trident's embedding cache nor vLLM's prefix cache is hit. Start-up CPU is the CPU time the server's processes
used until it answered (sampled every 0.2 s): on a machine whose cores are busy throughout start-up, wall
time follows it.

With --report, the table goes into the report's section `bench-vllm`; the notes that follow the section's
table there are kept.

    make bench-vllm                       (LLaVA demo; 32 requests at concurrency 8, 32 new tokens; docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from report import read_section, settings_text, write_section
from trident.supervisor import descendants
from trident.supervisor.processes import cpu_seconds
from trident.core.netutil import free_ports

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]
SECTION = "bench-vllm"  # the report's section; what follows its table there (notes people wrote) is kept
VLLM_ENV = {  # what vLLM's own server needs on this CPU machine (Trident's vllm workers set the same)
    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1",
}


def image_url(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Process:
    """A server process whose output is kept (and shown on failure); stopped with SIGTERM."""

    def __init__(self, cmd: list[str], env: dict | None = None) -> None:
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, **(env or {})))
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()
        self._cpu: dict[int, float] = {}
        self._sampling = True
        threading.Thread(target=self._sample_cpu, daemon=True).start()

    def _sample_cpu(self) -> None:
        while self._sampling and self.proc.poll() is None:
            self._cpu.update(self.cpu_by_pid())
            time.sleep(0.2)

    def cpu_by_pid(self) -> dict[int, float]:
        """CPU seconds (user + system) each of the server's processes has used so far."""
        return cpu_seconds([self.proc.pid, *descendants(self.proc.pid)])

    def cpu_during(self, work):
        """``work()``'s result, and the CPU seconds the server's processes used meanwhile (those alive at the
        end; a server's processes live through a load)."""
        before = self.cpu_by_pid()
        result = work()
        after = self.cpu_by_pid()
        return result, sum(t - before.get(pid, 0.0) for pid, t in after.items())

    def started(self) -> tuple[float, float]:
        """(seconds since launch, CPU seconds its processes have used): call once it is ready."""
        wall = time.monotonic() - self.t0
        self._sampling = False
        return wall, sum(self._cpu.values())

    def wait_http(self, url: str, timeout: float = 600) -> tuple[float, float]:
        """(seconds, CPU seconds) from launch until ``url`` answers 200."""
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during start-up:\n" + "".join(self.lines[-30:]))
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return self.started()
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{url} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def load(base_url: str, model: str, requests: int, concurrency: int, max_tokens: int, rounds: int = 1,
               seed: int = 1000) -> dict:
    """``rounds`` rounds of ``requests`` requests at ``concurrency``, each with an image not sent before (request i's
    image from seed ``seed + i``)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600)
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        t0 = time.monotonic()
        first = None
        stream = await client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url(seed + i)}},
                {"type": "text", "text": "Describe the picture in detail, please."},
            ]}],
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
            if chunk.usage is not None:
                tokens += chunk.usage.completion_tokens
        ttfts.append(first if first is not None else float("nan"))

    async def worker() -> None:
        while queue:
            await one(queue.pop(0))

    await one(seed + 999_999)  # warm-up, not counted
    tokens = 0
    ttfts.clear()
    span = 0.0
    for r in range(rounds):
        queue = list(range(r * requests, (r + 1) * requests))
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        span += time.monotonic() - t0
    await client.close()
    ttfts.sort()
    return {
        "ttft_p50": 1000 * statistics.median(ttfts),
        "ttft_p99": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tok_s": tokens / span,
        "tokens": tokens,
        "ttfts": ttfts,
    }


async def load_triton_http(http_url: str, mode: str, requests: int, concurrency: int, max_tokens: int,
                           seed: int = 1000) -> dict:
    """As :func:`load`, through Triton's HTTP ``generate_stream`` of entry model ``mode`` (the LLaVA demo's prompt
    written out, the image as base64): what a Triton HTTP client measures."""
    import aiohttp

    ttfts: list[float] = []
    tokens = 0

    async def one(session, i: int) -> None:
        nonlocal tokens
        t0 = time.monotonic()
        first = None
        body = {"text_input": "USER: <image>\nDescribe the picture in detail, please. ASSISTANT:",
                "image": [image_url(seed + i).split(",", 1)[1]], "stream": True, "return_num_output_tokens": True,
                "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})}
        async with session.post(f"{http_url}/v2/models/{mode}/generate_stream", json=body) as answer:
            if answer.status != 200:
                raise RuntimeError(f"{mode}: HTTP {answer.status}: {(await answer.text())[:300]}")
            async for line in answer.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"{mode}: {event['error']}")
                if first is None and event.get("text_output"):
                    first = time.monotonic() - t0
                tokens += int(event.get("num_output_tokens", 0))
        ttfts.append(first if first is not None else float("nan"))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            while queue:
                await one(session, queue.pop(0))

        await one(session, seed + 999_999)  # warm-up, not counted
        tokens = 0
        ttfts.clear()
        queue = list(range(requests))
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        span = time.monotonic() - t0
    ttfts.sort()
    return {
        "ttft_p50": 1000 * statistics.median(ttfts),
        "ttft_p99": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tok_s": tokens / span,
        "tokens": tokens,
        "ttfts": ttfts,
    }


def bench_vllm_server(args, model: str) -> dict:
    port = free_ports(1)[0]
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--served-model-name", "demo"]
    ipc = tempfile.mkdtemp(prefix="bench-vllm-ipc-")  # vLLM leaves its ZeroMQ IPC socket files behind
    server = Process(cmd, dict(VLLM_ENV, VLLM_RPC_BASE_PATH=ipc))
    try:
        startup, startup_cpu = server.wait_http(f"http://127.0.0.1:{port}/v1/models")
        result, cpu = server.cpu_during(lambda: asyncio.run(load(
            f"http://127.0.0.1:{port}/v1", "demo", args.requests, args.concurrency, args.max_tokens, args.rounds)))
    finally:
        server.stop()
        shutil.rmtree(ipc, ignore_errors=True)
    return dict(result, startup=startup, startup_cpu=startup_cpu, cpu_ms_token=1000 * cpu / max(1, result["tokens"]))


def bench_trident(args, model: str, backend: str, mode: str) -> dict:
    http, grpc, metrics, openai_port = free_ports(4)
    with tempfile.TemporaryDirectory() as tmp:
        from trident.cli import load_config_file, merge_settings

        config = load_config_file(args.serve_config) if args.serve_config else {}
        config = merge_settings(config, {"frontend": {"default_mode": mode}})
        (Path(tmp) / "serve.json").write_text(json.dumps(config))
        cmd = [sys.executable, "-m", "trident.cli", "serve", "--model", model, "--mode", mode,
               "--backend", backend, "--workspace", str(Path(tmp) / "ws"), "--http-port", str(http),
               "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai_port),
               "--served-model-name", "demo", "--config", str(Path(tmp) / "serve.json")]
        if backend == "vllm":
            cmd += ["--worker-python", args.vllm_python]
        cmd += shlex.split(args.serve_args)
        server = Process(cmd)
        try:
            while not any(line.startswith("[trident] ready") for line in server.lines):
                if server.proc.poll() is not None:
                    raise RuntimeError("trident serve exited:\n" + "".join(server.lines[-30:]))
                time.sleep(0.2)
            startup, startup_cpu = server.started()
            result, cpu = server.cpu_during(lambda: asyncio.run(load(
                f"http://127.0.0.1:{openai_port}/v1", "demo", args.requests, args.concurrency, args.max_tokens,
                args.rounds)))
        except BaseException:
            _keep_logs(Path(tmp) / "ws", server, f"{backend}-{mode}")
            raise
        finally:
            server.stop()
    return dict(result, startup=startup, startup_cpu=startup_cpu, cpu_ms_token=1000 * cpu / max(1, result["tokens"]))


def _keep_logs(workspace: Path, server: Process, name: str) -> None:
    """A failed run's server output and Triton log, kept where the temporary workspace would lose them."""
    kept = Path(tempfile.mkdtemp(prefix=f"bench-vllm-{name}-"))
    (kept / "serve.log").write_text("".join(server.lines))
    if (workspace / "triton.log").exists():
        shutil.copy(workspace / "triton.log", kept / "triton.log")
    print(f"[bench] {name} failed; its logs are in {kept}", file=sys.stderr, flush=True)


def notes_after_table(section: str | None) -> list[str]:
    """The lines of ``section`` that follow its first table."""
    lines = (section or "").strip("\n").splitlines()
    i = next((k for k, line in enumerate(lines) if line.startswith("|")), len(lines))
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    return lines[i:]


def write_report(args, header: list[str], lines: list[list[str]]) -> None:
    from trident.cli import load_config_file

    model = "the LLaVA demo" if args.model_is_demo else f"`{Path(args.model).name}`"
    serve = [f"`{args.serve_args}`"] if args.serve_args else []
    if args.serve_config:
        serve.append(f"`{settings_text(load_config_file(args.serve_config))}`")
    md = [
        "## The vLLM engine vs vLLM's own server (`make bench-vllm`)", "",
        f"`clients/perf/bench_engines.py`: per engine ({', '.join(args.backends)}) and mode a `trident serve "
        "--backend B --mode X`, and vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`: one "
        "engine doing all three stages) on the same checkpoint, each started in turn"
        + (f" (Trident's servers with {' and '.join(serve)})" if serve else "") + ". The same OpenAI chat client "
        f"sends {args.rounds} rounds of {args.requests} streaming requests at concurrency {args.concurrency} to each, "
        "one new 224 px image per request (no cache hit on either side), "
        f"{args.max_tokens} new tokens (greedy, `ignore_eos`); {model}. Start-up: until `[trident] ready`, or until "
        "vLLM's `/v1/models` answers; start-up CPU: the CPU time the server's processes used until then. CPU "
        "ms/token: the CPU time all the server's processes used during the rounds, per output token; on cores the "
        "load keeps busy, tokens/s follows it (`vLLM's CPU/token / its` is the tokens/s ratio that CPU alone would "
        "give). Each ratio is to vLLM's server, the first row.",
        "", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(line) + " |" for line in lines),
    ]
    notes = notes_after_table(read_section(args.report, SECTION))
    write_section(args.report, SECTION, md + notes, before="bench-engine")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the LLaVA demo model)")
    p.add_argument("--vllm-python", default=os.environ.get("TRIDENT_VLLM_PYTHON", ".venv-vllm/bin/python"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds of --requests per server (new images each round)")
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--backends", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    p.add_argument("--serve-args", default="", help="more `trident serve` options, e.g. '--threads 2'")
    p.add_argument("--serve-config", metavar="FILE",
                   help="`trident serve` config file (YAML or JSON) of every trident server, e.g. one with "
                   "`vllm: {prefill_calls: 2}`")
    p.add_argument("--report", type=Path, help="also write the table into this Markdown file (its section `bench-vllm`)")
    args = p.parse_args()
    args.model_is_demo = args.model is None
    if args.model is None:
        from trident.dev.demo import default_demo_model

        args.model = str(default_demo_model("llava"))

    rows: list[tuple[str, str, dict]] = []
    print(f"[bench] vLLM's own OpenAI server on {args.model}", flush=True)
    reference = bench_vllm_server(args, args.model)
    rows.append(("vllm api_server", "(one engine)", reference))
    for backend in args.backends:
        for mode in args.modes:
            print(f"[bench] trident --backend {backend} --mode {mode}", flush=True)
            rows.append((f"trident {backend}", mode, bench_trident(args, args.model, backend, mode)))

    header = ["server", "mode", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "CPU ms/token", "startup s", "startup CPU s",
              "TTFT p50 vs vLLM", "TTFT p99 vs vLLM", "tok/s vs vLLM", "vLLM's CPU/token / its", "startup vs vLLM",
              "startup CPU vs vLLM"]
    lines = [[
        name, mode, f"{r['ttft_p50']:.0f}", f"{r['ttft_p99']:.0f}", f"{r['tok_s']:.1f}", f"{r['cpu_ms_token']:.1f}",
        f"{r['startup']:.1f}", f"{r['startup_cpu']:.0f}", f"{r['ttft_p50'] / reference['ttft_p50']:.2f}x",
        f"{r['ttft_p99'] / reference['ttft_p99']:.2f}x", f"{r['tok_s'] / reference['tok_s']:.2f}x",
        f"{reference['cpu_ms_token'] / r['cpu_ms_token']:.2f}x",
        f"{r['startup'] / reference['startup']:.2f}x", f"{r['startup_cpu'] / reference['startup_cpu']:.2f}x",
    ] for name, mode, r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    table = [" | ".join(h.rjust(w) for h, w in zip(header, widths))]
    table += [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    caption = (f"{args.rounds} rounds of {args.requests} streaming chat requests at concurrency {args.concurrency}, "
               f"one new 224 px image each, {args.max_tokens} new tokens (greedy, ignore_eos), model {Path(args.model).name}; "
               f"{os.cpu_count()} CPU cores" + (f"; trident serve {args.serve_args}" if args.serve_args else "")
               + (f"; its config {args.serve_config}" if args.serve_config else ""))
    print(caption)
    print("\n".join(table))
    if args.report:
        write_report(args, header, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
