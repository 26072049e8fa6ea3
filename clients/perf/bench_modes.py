#!/usr/bin/env python3
"""Benchmark every deployment mode: perf_analyzer on the Triton entry models, aiperf on the OpenAI API.

Starts `trident serve` (all modes) on free ports, once per workload: the LLaVA demo model with images, the
Qwen2-VL demo with video clips, the Qwen2-Audio demo with audio clips. For each mode and concurrency:
perf_analyzer (tritonclient 2.51 wheel) over gRPC streaming with inputs from make_inputs.py, and, given
--aiperf, aiperf against /v1/chat/completions with synthetic images. The same requests also run through
the hf engine in this process. Prints a table per mode (throughput, TTFT p50/p99, ITL, tokens/s) and,
given --report, writes it into the report's section `bench-modes`, with a PNG chart beside the report.

    make bench        (installs perf_analyzer's system library and aiperf first; docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from make_inputs import perf_analyzer_inputs
from report import DEMO_NAMES, write_section
from trident.core.netutil import free_ports

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]


def start_server(model: str, workspace: Path, ports: list[int]) -> subprocess.Popen:
    workspace.mkdir(parents=True, exist_ok=True)
    # perf_analyzer cycles through a few inputs, the same ones for every mode and concurrency: with the encoder's
    # embedding cache on, all but the first of each would skip the encoder, which the in-process rows never do
    # (make bench-scheduler measures the cache)
    (workspace / "serve.json").write_text(json.dumps({"embedding_cache_mib": 0}))
    cmd = [sys.executable, "-m", "trident.cli", "serve", "--model", model, "--workspace", str(workspace),
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
           "--openai-port", str(ports[3]), "--config", str(workspace / "serve.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = open(workspace / "serve.log", "w")  # what the server says, kept with the run's files

    def keep(line: str) -> None:
        log.write(line)
        log.flush()

    t0 = time.monotonic()
    for line in proc.stdout:
        keep(line)
        if line.startswith("[trident] ready"):
            print(f"server ready in {time.monotonic() - t0:.1f} s", flush=True)
            threading.Thread(target=lambda: [keep(line) for line in proc.stdout], daemon=True).start()
            return proc
    raise RuntimeError("trident serve exited before it was ready")


def perf_analyzer(url: str, mode: str, concurrency: int, data: Path, requests: int, out_dir: Path) -> dict:
    # one file per workload: perf_analyzer will not write over an earlier run's (it prints its usage instead)
    export = out_dir / f"{data.stem}-{mode}-c{concurrency}.json"
    cmd = [
        shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer"),
        "-m", mode, "-u", url, "-i", "grpc", "--streaming", "--async",
        "--concurrency-range", str(concurrency), "--input-data", str(data),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
        "--stability-percentage", "999", "--max-trials", "10", "--profile-export-file", str(export),
    ]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"perf_analyzer did not finish {mode} c={concurrency} in 300 s: requests stalled") from None
    if run.returncode != 0:
        # (its own error comes first, before the usage text it prints after some errors)
        raise RuntimeError(f"perf_analyzer failed for {mode}:\n{run.stdout[:1500]}\n{run.stderr[:1500]}")
    doc = json.loads(export.read_text())
    reqs = [r for exp in doc["experiments"] for r in exp["requests"] if r.get("response_timestamps")]
    return _summary(
        ttft_ms=[(r["response_timestamps"][0] - r["timestamp"]) / 1e6 for r in reqs],
        itl_ms=[(b - a) / 1e6 for r in reqs for a, b in zip(r["response_timestamps"], r["response_timestamps"][1:])],
        requests=len(reqs),
        span_s=(max(r["response_timestamps"][-1] for r in reqs) - min(r["timestamp"] for r in reqs)) / 1e9,
    )


def _summary(ttft_ms: list[float], itl_ms: list[float], requests: int, span_s: float) -> dict:
    return {
        "requests": requests,
        "span_s": span_s,
        "req_s": requests / span_s,
        "ttft_p50": float(np.percentile(ttft_ms, 50)),
        "ttft_p99": float(np.percentile(ttft_ms, 99)),
        "itl_p50": float(np.percentile(itl_ms, 50)) if itl_ms else float("nan"),
    }


def aiperf(aiperf_bin: str, url: str, model: str, tokenizer: str, concurrency: int, requests: int,
           new_tokens: int, out_dir: Path) -> dict:
    """aiperf against the OpenAI chat endpoint, one synthetic 224 px image per request, streaming."""
    art = out_dir / f"aiperf-{model.replace(':', '-')}-c{concurrency}"
    cmd = [
        aiperf_bin, "profile", "--model", model, "--tokenizer", tokenizer, "--use-server-token-count",
        "--url", url, "--endpoint-type", "chat", "--streaming", "--concurrency", str(concurrency),
        "--request-count", str(requests), "--image-batch-size", "1", "--image-width-mean", "224",
        "--image-height-mean", "224", "--prompt-input-tokens-mean", "32", "--prompt-output-tokens-mean",
        str(new_tokens), "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--output-artifact-dir", str(art), "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
    ]
    # aiperf loads a local tokenizer folder only outside HF offline mode (offline it looks in the hub cache).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed for {model}:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    d = json.loads((art / "profile_export_aiperf.json").read_text())
    return {
        "requests": int(d["request_count"]["avg"]),
        "span_s": d["benchmark_duration"]["avg"],
        "req_s": d["request_throughput"]["avg"],
        "ttft_p50": d["time_to_first_token"]["p50"],
        "ttft_p99": d["time_to_first_token"]["p99"],
        "itl_p50": d["inter_token_latency"]["p50"],
        "tok_s": d["output_token_throughput"]["avg"],
    }


def in_process(model_path: str, text: str, item, params_json: str, concurrency: int, n: int) -> dict:
    """The same requests through the engine the EPD worker serves (``generate``), in this process without
    Triton, `concurrency` at a time."""
    import asyncio

    import torch

    from trident.worker.engines.hf.stage import HFStageEngine
    from trident.core.processor import SamplingParams
    from trident.core.protocol import STAGES

    torch.set_num_threads(1)
    engine = HFStageEngine(STAGES["generate"], model_path)
    params = SamplingParams.from_json(params_json)
    ttfts: list[float] = []
    itls: list[float] = []

    async def one() -> None:
        t0 = time.perf_counter()
        generation = await engine.generate(text, params, media=[item])
        first = prev = None
        async for _ in generation.events:
            now = time.perf_counter()
            if prev is not None:
                itls.append((now - prev) * 1000)
            first, prev = first or now, now
        ttfts.append((first - t0) * 1000)

    async def worker(count: int) -> None:
        for _ in range(count):
            await one()

    async def run() -> float:
        await one()  # warm-up
        ttfts.clear()
        itls.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(per) for _ in range(concurrency)))
        return time.perf_counter() - t0

    per = max(1, n // concurrency)
    span = asyncio.run(run())
    engine.close()
    return _summary(ttfts, itls, per * concurrency, span)


WORKLOADS = {  # media -> (demo family, perf_analyzer inputs, what one request carries)
    "image": ("llava", {"n_images": 1}, "1 image of 224 px"),
    "video": ("qwen2vl", {"n_images": 0, "n_videos": 1, "frames": 8}, "1 video clip of 8 frames of 224 px"),
    "audio": ("qwen2audio", {"n_images": 0, "n_audios": 1, "seconds": 5.0}, "1 audio clip of 5 s"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint of the image rows (default: the LLaVA demo model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=12, help="requests per measurement window; perf_analyzer measures 3 (default: 12)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--media", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS),
                    help="workloads: image rows (LLaVA demo), video rows (Qwen2-VL demo), audio rows (Qwen2-Audio demo)")
    ap.add_argument("--aiperf", help="aiperf executable: also load the OpenAI endpoint with it (image rows)")
    ap.add_argument("--report", help="write the tables as Markdown here, with a PNG chart beside it")
    args = ap.parse_args()

    from trident.dev.demo import default_demo_model

    sampling = {"max_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    work = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    rows: list[tuple[str, str, str, int, dict]] = []  # (media, mode, tool, concurrency, summary)
    try:
        for media in args.media:
            arch, shape, _ = WORKLOADS[media]
            model = args.model if media == "image" and args.model else str(default_demo_model(arch))
            doc = perf_analyzer_inputs(arch, size=(224, 224), requests=8, sampling=sampling, **shape)
            data = work / f"input-{media}.json"
            data.write_text(json.dumps(doc))
            ports = free_ports(4)
            server = start_server(model, work / f"ws-{media}", ports)
            try:
                for c in args.concurrency:
                    for mode in MODES:
                        r = perf_analyzer(f"127.0.0.1:{ports[1]}", mode, c, data, args.requests, work)
                        r["tok_s"] = r["requests"] * args.new_tokens / r["span_s"]
                        rows.append((media, mode, "perf_analyzer", c, r))
                        print(f"  {media} perf_analyzer {mode:6} c={c}: {r}", flush=True)
                        if args.aiperf and media == "image":
                            name = f"{Path(model).name}:{mode}"
                            r = aiperf(args.aiperf, f"http://127.0.0.1:{ports[3]}", name, model, c, 3 * args.requests,
                                       args.new_tokens, work)
                            rows.append((media, mode, "aiperf (OpenAI)", c, r))
                            print(f"  {media} aiperf        {mode:6} c={c}: {r}", flush=True)
            finally:
                if (work / f"ws-{media}" / "stats").is_dir():  # the workers' last stats, as the run left them
                    shutil.copytree(work / f"ws-{media}" / "stats", work / f"stats-{media}", dirs_exist_ok=True)
                server.send_signal(signal.SIGTERM)
                server.wait(120)
            first = doc["data"][0]
            item = _media_item(first, media)
            for c in args.concurrency:
                r = in_process(model, first["text_input"][0], item, json.dumps(sampling), c, 3 * args.requests)
                r["tok_s"] = r["requests"] * args.new_tokens / r["span_s"]
                rows.append((media, "in-process", "hf engine", c, r))
                print(f"  {media} in-process hf     c={c}: {r}", flush=True)
    except BaseException:
        print(f"failed; the run's files (server logs, worker stats, inputs) stay in {work}", flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)

    base = {(media, c): r for media, m, _, c, r in rows if m == "in-process"}
    title = (f"demo models (random weights): {'; '.join(f'{m}: {WORKLOADS[m][2]} ({WORKLOADS[m][0]})' for m in args.media)}"
             f" + prompt, {args.new_tokens} new tokens, greedy, streaming; {os.cpu_count()} CPU cores, hf engine")
    header = ["media", "mode", "tool", "conc", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "tok/s",
              "tok/s vs in-process"]
    lines = []
    for media, mode, tool, c, r in rows:
        lines.append([media, mode, tool, str(c), f"{r['req_s']:.2f}", f"{r['ttft_p50']:.1f}", f"{r['ttft_p99']:.1f}",
                      f"{r['itl_p50']:.1f}", f"{r['tok_s']:.1f}", f"{r['tok_s'] / base[media, c]['tok_s']:.2f}x"])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    print("\n" + title)
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    for line in lines:
        print(" | ".join(v.rjust(w) for v, w in zip(line, widths)))
    if args.report:
        image_rows = [(m, t, c, r) for media, m, t, c, r in rows if media == "image"]
        write_report(Path(args.report), title, header, lines, image_rows, args)
    return 0


def _media_item(entry: dict, media: str):
    """The first request's item, as the in-process engine takes it."""
    import base64

    from trident.core.media import MediaItem

    return MediaItem(base64.b64decode(entry[media]["content"][0]), 0, media)


def write_report(path: Path, title: str, header: list[str], lines: list[list[str]], rows, args) -> None:
    """The report's section `bench-modes` (the rest of the report stays as it is), and the chart of the image
    rows beside the report (its name, ending in .png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart = path.with_suffix(".png")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [*MODES, "in-process"]
    tools = ["perf_analyzer", "aiperf (OpenAI)", "hf engine"]
    concurrency = args.concurrency
    width = 0.8 / (len(tools) * len(concurrency))
    for ax, key, ylabel in ((axes[0], "tok_s", "output tokens/s"), (axes[1], "ttft_p50", "TTFT p50 (ms)")):
        k = 0
        for c in concurrency:
            for tool in tools:
                values = [next((r[key] for m, t, cc, r in rows if m == mode and t == tool and cc == c), 0.0)
                          for mode in labels]
                if any(values):
                    xs = [i + (k - len(tools) * len(concurrency) / 2 + 0.5) * width for i in range(len(labels))]
                    ax.bar(xs, values, width, label=f"{tool}, c={c}")
                k += 1
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(chart, dpi=110)
    carried = []  # what one request carries, per workload
    for media in args.media:
        arch = WORKLOADS[media][0]
        model = f"`{Path(args.model).name}`" if media == "image" and args.model else DEMO_NAMES.get(arch, arch)
        carried.append(f"{WORKLOADS[media][2]} ({model})")
    carried_text = carried[0] if len(carried) == 1 else ", ".join(carried[:-1]) + " or " + carried[-1]
    clients = ("perf_analyzer drives the Triton entry models over gRPC streaming, "
             + ("aiperf drives the OpenAI-compatible `/v1/chat/completions` with synthetic images, " if args.aiperf else "")
             + "and `hf engine` runs the same requests through the engine roles in one process (no Triton, no transfers)")
    md = [
        "## Every mode, every client (`make bench`)", "",
        f"`clients/perf/bench_modes.py`: {clients}. Per request: {carried_text}, and a prompt; {args.new_tokens} new "
        "tokens, greedy, streaming; hf engine. `make bench` runs its server with the embedding cache off "
        "(`embedding_cache_mib: 0`): perf_analyzer sends the same few inputs in every mode, and every request "
        f"encodes its media, as in-process does. The server runs every mode's workers at once, and the client (its "
        f"own process) shares the machine's {os.cpu_count()} cores with them; the in-process rows have no client "
        "process. `make bench-split` compares one mode's server with in-process alike (the same requests, one "
        "client in the benchmark's process, rounds alternating).",
        "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
        *("| " + " | ".join(line) + " |" for line in lines),
        "", f"![throughput and TTFT per mode]({chart.name})",
    ]
    write_section(path, "bench-modes", md, before="bench-split")
    print(f"wrote {chart}")


if __name__ == "__main__":
    sys.exit(main())
