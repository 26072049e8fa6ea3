#!/usr/bin/env python3
"""Trident on a GPU, checked end to end: the checks of ``make gpu-check`` after its install.

1. NIXL on the GPU: tests/integration/test_transfer.py with both ends' pools in VRAM
   (``TRIDENT_TEST_DEVICE=cuda``): byte-exact READs between two processes, VRAM to VRAM and DRAM to VRAM.
2. Each engine whose Python is there (hf always; vllm where ``--vllm-python`` imports vllm): one ``trident serve``
   of every mode on the GPU (``device: auto``), then
   - exact tokens: each disaggregated mode's greedy text equals EPD's (the same engine in one process on the
     same device), request by request, for images never sent before;
   - the memory the hand-offs crossed in: ``trident_transfer_read_bytes_total`` with ``from_memory`` and
     ``to_memory`` VRAM, for the stages that READ (E/P/D's prefill the embeddings, the decode the KV);
   - speed: the OpenAI client's load (as ``make bench-vllm`` sends it) per mode: tokens/s and TTFT p50/p99,
     each mode's ratio to EPD's beside it.
3. ``docs/benchmarks-gpu.md`` (``--report``): the machine, each check's outcome, the tables.

Exits 1 when any check fails; every check runs even after one failed. On a machine without a GPU it says so in
one line and exits 0.

    python clients/perf/gpu_check.py --report docs/benchmarks-gpu.md [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from bench_engines import Process, load
from trident.core.netutil import free_ports

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "<s>USER: <image>\nDescribe the picture in detail, please. ASSISTANT:"  # (the LLaVA demo's template)
# the stage instances that READ a hand-off in each mode of one server of every mode: E/P/D's prefill the
# embeddings, the decode the KV of E/P/D's prefill and EP/D's encode_prefill
READERS = {"prefill": "embeddings", "decode": "KV cache"}


class Checks:
    """Each check's outcome, in order, for the report and the exit status."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bool, float, str]] = []

    @contextmanager
    def check(self, name: str):
        t0 = time.monotonic()
        detail: list[str] = []
        print(f"[gpu-check] {name} ...", flush=True)
        try:
            yield detail
            ok = True
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
            ok = False
            detail.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300])
            traceback.print_exc()
        seconds = time.monotonic() - t0
        self.rows.append((name, ok, seconds, "; ".join(detail)))
        print(f"[gpu-check] {name}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s) {'; '.join(detail)}", flush=True)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _, _ in self.rows)


def machine() -> dict[str, str]:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    import torch

    return {"gpu": "; ".join(smi), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "python": sys.version.split()[0], "cores": str(os.cpu_count())}


def image_b64(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def generate(http: int, mode: str, image: str, max_tokens: int) -> str:
    body = {"text_input": PROMPT, "image": [image], "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": max_tokens, "temperature": 0})}
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/{mode}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["text_output"]


def read_bytes_by_memory(metrics: int) -> dict[tuple[str, str, str], float]:
    """``trident_transfer_read_bytes_total`` by (model, from_memory, to_memory)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("trident_transfer_read_bytes_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[(labels["model"], labels.get("from_memory", "?"), labels.get("to_memory", "?"))] = float(line.split()[-1])
    return out


def serve(args, engine: str, model: str, workspace: Path) -> tuple[Process, dict[str, int]]:
    http, grpc, metrics, openai_port = free_ports(4)
    config = workspace / "serve.json"
    config.write_text(json.dumps({"device": args.device, "frontend": {"default_mode": "epd"}}))
    cmd = [args.serve_python or sys.executable, "-m", "trident.cli", "serve", "--model", model, "--mode", "all",
           "--backend", engine,
           "--workspace", str(workspace / "ws"), "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--openai-port", str(openai_port), "--served-model-name", "demo",
           "--config", str(config)]
    if engine == "vllm":
        cmd += ["--worker-python", args.vllm_python]
    elif args.serve_python:  # (this script's Python, the workers' environment)
        cmd += ["--worker-python", sys.executable]
    # (a worker that never binds shows where it waits: SIGABRT dumps its threads' stacks)
    server = Process(cmd, {"PYTHONFAULTHANDLER": "1"})
    deadline = time.monotonic() + args.startup_timeout
    while not any(line.startswith("[trident] ready") for line in server.lines):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            if server.proc.poll() is None:
                _dump_stacks(server)
            server.stop()
            (workspace / "serve.log").write_text("".join(server.lines))
            raise RuntimeError("trident serve did not start (its output: serve.log):\n" + "".join(server.lines[-40:]))
        time.sleep(0.2)
    return server, {"http": http, "metrics": metrics, "openai": openai_port}


def _dump_stacks(server: Process) -> None:
    """Every stage worker of a server that did not start, made to print its threads' stacks (faulthandler)."""
    import signal

    from trident.supervisor import descendants

    for pid in descendants(server.proc.pid):
        try:
            if b"trident worker" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                os.kill(pid, signal.SIGABRT)
        except OSError:
            pass
    time.sleep(3)


def check_engine(args, checks: Checks, engine: str, model: str, tables: dict) -> None:
    workspace = Path(tempfile.mkdtemp(prefix=f"gpu-check-{engine}-"))
    server = None
    with checks.check(f"{engine}: serve every mode on the GPU") as detail:
        t0 = time.monotonic()
        server, ports = serve(args, engine, model, workspace)
        detail.append(f"ready in {time.monotonic() - t0:.0f} s")
        detail.extend(line.strip() for line in server.lines if line.startswith("[trident] GPUs"))
    if server is None:
        _keep(workspace, engine, None)
        return
    try:
        with checks.check(f"{engine}: exact tokens, each mode against EPD on the same GPU") as detail:
            mismatches, total = [], 0
            for i in range(args.exact):
                image = image_b64(10_000 + i)
                want = generate(ports["http"], "epd", image, args.max_tokens)
                for mode in MODES[1:]:
                    got = generate(ports["http"], mode, image, args.max_tokens)
                    total += 1
                    if got != want:
                        mismatches.append(f"{mode} request {i}: {got!r} != EPD's {want!r}")
            detail.append(f"{total - len(mismatches)} of {total} equal")
            if mismatches:
                raise AssertionError("; ".join(mismatches[:3]))
        memory = "DRAM" if args.device == "cpu" else "VRAM"  # (a dry run on the CPU: its hand-offs cross as DRAM)
        with checks.check(f"{engine}: embeddings and KV crossed as {memory}") as detail:
            deadline = time.monotonic() + 5  # (each stage stub asks its worker for counters every second)
            while True:
                by = read_bytes_by_memory(ports["metrics"])
                crossed = {model_: by.get((model_, memory, memory), 0) for model_ in READERS}
                if all(crossed.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            detail.append(", ".join(f"{m} READ {int(v)} bytes of {READERS[m]} {memory} to {memory}"
                                    for m, v in crossed.items()))
            other = {k: v for k, v in by.items() if k[1:] != (memory, memory) and v}
            if other:
                detail.append(f"other memory: {other}")
            if not all(crossed.values()) or other:
                raise AssertionError(f"trident_transfer_read_bytes_total: {by}")
        with checks.check(f"{engine}: load per mode (OpenAI client, {args.requests} requests at "
                          f"concurrency {args.concurrency}, {args.max_tokens} tokens)") as detail:
            rows = {}
            for mode in MODES:
                rows[mode] = asyncio.run(load(f"http://127.0.0.1:{ports['openai']}/v1", f"demo:{mode}", args.requests,
                                              args.concurrency, args.max_tokens))
                detail.append(f"{mode} {rows[mode]['tok_s']:.0f} tok/s")
            tables[engine] = rows
    except BaseException:
        _keep(workspace, engine, server)
        raise
    finally:
        server.stop()
    if checks.ok:
        shutil.rmtree(workspace, ignore_errors=True)
    else:
        _keep(workspace, engine, server)


def _keep(workspace: Path, engine: str, server: Process | None) -> None:
    if server is not None:
        (workspace / "serve.log").write_text("".join(server.lines))
    print(f"[gpu-check] {engine}: its logs are in {workspace}", flush=True)


def report(args, facts: dict, checks: Checks, tables: dict, not_run: list[str]) -> str:
    lines = ["# Trident on a GPU", "",
             "Written by `make gpu-check` on a machine with a GPU (`clients/perf/gpu_check.py`); nothing here is "
             "estimated. Where a row says *not run*, it was not measured on a GPU.", "",
             f"Machine: {facts['gpu']}; {facts['cores']} CPU cores; Python {facts['python']}, torch {facts['torch']} "
             f"(CUDA {facts['cuda']}); `device: {args.device}`, `dtype: auto` (bfloat16). Run on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "| check | outcome | seconds | detail |", "| --- | --- | --- | --- |"]
    for name, ok, seconds, detail in checks.rows:
        lines.append(f"| {name} | {'passed' if ok else '**failed**'} | {seconds:.0f} | {detail.replace('|', '/')} |")
    for line in not_run:
        lines.append(f"| {line} | *not run* | - | - |")
    for engine, rows in tables.items():
        base = rows["epd"]
        lines += ["", f"## {engine} engine: every mode on one GPU", "",
                  f"The OpenAI client of `make bench-vllm` (streaming, greedy, `ignore_eos`, a new 224x224 image per "
                  f"request), {args.requests} requests at concurrency {args.concurrency}, {args.max_tokens} new "
                  "tokens, through one `trident serve --mode all` (model id `demo:<mode>`); ratios to EPD in the "
                  "same run.", "",
                  "| mode | tokens/s | TTFT p50 ms | TTFT p99 ms | tokens/s vs EPD | TTFT p50 vs EPD |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for mode, r in rows.items():
            lines.append(f"| {mode} | {r['tok_s']:.1f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
                         f"{r['tok_s'] / base['tok_s']:.2f}x | {r['ttft_p50'] / base['ttft_p50']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", help="write the results here (docs/benchmarks-gpu.md)")
    ap.add_argument("--vllm-python", help="Python of the vllm engine's workers (checked when it imports vllm)")
    ap.add_argument("--serve-python", help="Python that runs trident serve (Triton's stubs: numpy 1), when it is not "
                    "this one; the hf workers then run from this one")
    ap.add_argument("--model", help="checkpoint (default: the LLaVA demo model)")
    ap.add_argument("--device", default="auto", help="the serve's device setting (cpu: a dry run of this script)")
    ap.add_argument("--exact", type=int, default=4, help="images for the exact-token check")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--startup-timeout", type=float, default=240)
    ap.add_argument("--transfer-tests", help="pytest -k expression: the transfer tests to run (default: all)")
    args = ap.parse_args()
    if args.device != "cpu" and (shutil.which("nvidia-smi") is None
                                 or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0):
        print("gpu-check: no GPU on this machine (nvidia-smi finds none); nothing to check")
        return 0
    facts = machine() if args.device != "cpu" else {"gpu": "none (a dry run on the CPU)", "torch": "", "cuda": "",
                                                     "python": sys.version.split()[0], "cores": str(os.cpu_count())}
    print(f"[gpu-check] {facts}", flush=True)
    checks, tables, not_run = Checks(), {}, []
    from trident.dev.demo import default_demo_model

    model = args.model or str(default_demo_model("llava"))
    with checks.check("NIXL READs between two processes, pools on the GPU (tests/integration/test_transfer.py)") as detail:
        env = dict(os.environ, TRIDENT_TEST_DEVICE="cpu" if args.device == "cpu" else "cuda")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               *(["-k", args.transfer_tests] if args.transfer_tests else []),
                               str(ROOT / "tests/integration/test_transfer.py")], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        detail.append(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:])
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
            raise AssertionError(f"pytest exited {done.returncode}")
    check_engine(args, checks, "hf", model, tables)
    vllm_ok = args.vllm_python and subprocess.run(
        [args.vllm_python, "-c", "import vllm"], capture_output=True).returncode == 0
    if vllm_ok:
        check_engine(args, checks, "vllm", model, tables)
    else:
        not_run.append(f"vllm engine (every mode, exact tokens, VRAM hand-offs, `make bench-vllm` against `vllm serve`): "
                       f"vllm is not importable by {args.vllm_python or 'a --vllm-python'} on this machine")
    if args.report:
        Path(args.report).write_text(report(args, facts, checks, tables, not_run))
        print(f"[gpu-check] wrote {args.report}", flush=True)
    print(f"[gpu-check] {'all checks passed' if checks.ok else 'FAILED'}", flush=True)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
