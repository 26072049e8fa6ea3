#!/usr/bin/env python3
"""perf_analyzer against every entry model (gRPC streaming), beside the in-process hf engine.

Starts `trident serve` on the LLaVA demo model (all modes) on free ports, runs perf_analyzer (from the
tritonclient 2.51 wheel) at each concurrency with one image + prompt per request, greedy, a fixed number
of new tokens (ignore_eos), then runs the same requests through the hf engine in this process. Prints
TTFT and output tokens/s per mode, with ratios to the in-process figures.

    make bench-serve        (installs perf_analyzer's system library first)
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from trident.netutil import free_ports

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]


def demo_image(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8))


def start_server(model: str, workspace: Path, ports: list[int]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trident.cli", "serve", "--model", model, "--workspace", str(workspace),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.monotonic()
    for line in proc.stdout:
        if line.startswith("[trident] ready"):
            print(f"server ready in {time.monotonic() - t0:.1f} s", flush=True)
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
    raise RuntimeError("trident serve exited before it was ready")


def perf_analyzer(url: str, mode: str, concurrency: int, data: Path, requests: int, out_dir: Path) -> dict:
    export = out_dir / f"{mode}-c{concurrency}.json"
    cmd = [
        shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer"),
        "-m", mode, "-u", url, "-i", "grpc", "--streaming", "--async",
        "--concurrency-range", str(concurrency), "--input-data", str(data),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
        "--stability-percentage", "999", "--max-trials", "10", "--profile-export-file", str(export),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed for {mode}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    doc = json.loads(export.read_text())
    reqs = [r for exp in doc["experiments"] for r in exp["requests"] if r.get("response_timestamps")]
    ttft = [(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs]
    start = min(r["timestamp"] for r in reqs)
    end = max(r["response_timestamps"][-1] for r in reqs)
    return {"requests": len(reqs), "ttft_ms": statistics.median(ttft), "span_s": (end - start) / 1e9}


def in_process(model_path: str, text: str, image: Image.Image, params_json: str, concurrency: int, n: int) -> dict:
    """The same requests through the hf engine's roles in this process, `concurrency` at a time."""
    import torch

    from trident.engines.hf import HFDecoder, HFEncoder, HFModel, HFPrefiller
    from trident.processor import SamplingParams
    from trident.stages import decode_request, prepare_prompt, run_prefill

    torch.set_num_threads(1)
    model = HFModel(model_path)
    enc, pre, dec = HFEncoder(model), HFPrefiller(model), HFDecoder(model)
    params = SamplingParams.from_json(params_json)
    lock = threading.Lock()  # one compute thread for encode + prefill, like a worker
    ttfts: list[float] = []

    def one() -> None:
        t0 = time.perf_counter()
        with lock:
            emb = enc.encode([image])
            result = run_prefill(pre, prepare_prompt(model.processor, text, emb.token_counts), emb, params)
        first = None
        for _ in dec.submit(decode_request(result, params)):
            first = first or time.perf_counter()
        ttfts.append((first - t0) * 1000)

    def worker(count: int) -> None:
        for _ in range(count):
            one()

    one()  # warm-up
    ttfts.clear()
    per = max(1, n // concurrency)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(per,)) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = time.perf_counter() - t0
    dec.close()
    return {"requests": per * concurrency, "ttft_ms": statistics.median(ttfts), "span_s": span}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the LLaVA demo model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=12, help="requests per measurement window; perf_analyzer measures 3 (default: 12)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    from trident.demo_models import default_demo_model

    model = args.model or str(default_demo_model("llava"))
    text = "<s>USER: <image>\nDescribe the picture in detail, please. ASSISTANT:"
    image = demo_image()
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    params = json.dumps({"max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True})
    work = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    data = work / "input.json"
    data.write_text(json.dumps({"data": [{
        "text_input": [text],
        "image": {"content": [base64.b64encode(buf.getvalue()).decode()], "shape": [1]},
        "stream": [True],
        "sampling_parameters": [params],
        "exclude_input_in_output": [True],
    }]}))

    ports = free_ports(3)
    server = start_server(model, work / "ws", ports)
    rows = []
    try:
        for c in args.concurrency:
            for mode in MODES:
                r = perf_analyzer(f"127.0.0.1:{ports[1]}", mode, c, data, args.requests, work)
                rows.append((mode, c, r))
                print(f"  perf_analyzer {mode:6} c={c}: {r}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    for c in args.concurrency:
        r = in_process(model, text, image, params, c, 3 * args.requests)  # as many as perf_analyzer measures
        rows.append(("in-process", c, r))
        print(f"  in-process hf     c={c}: {r}", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    base = {c: r for m, c, r in rows if m == "in-process"}
    print(f"\nLLaVA demo model, 1 image (224 px) + prompt, {args.new_tokens} new tokens, greedy, gRPC streaming; "
          f"{os.cpu_count()} CPU cores")
    print(f"{'mode':>10} | {'conc':>4} | {'TTFT ms':>8} | {'tok/s':>7} | {'TTFT vs in-proc':>15} | {'tok/s vs in-proc':>16}")
    for mode, c, r in rows:
        tps = r["requests"] * args.new_tokens / r["span_s"]
        b = base[c]
        btps = b["requests"] * args.new_tokens / b["span_s"]
        print(f"{mode:>10} | {c:>4} | {r['ttft_ms']:>8.1f} | {tps:>7.1f} | {r['ttft_ms'] / b['ttft_ms']:>14.2f}x | "
              f"{tps / btps:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
