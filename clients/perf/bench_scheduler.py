#!/usr/bin/env python3
"""The BLS scheduler's benchmark: embedding cache, encode-once, text-only dispatch, BLS vs ensemble.

Two `trident serve` runs on a demo model (E/PD, E/P/D and EPD), one after the other, driven by the same gRPC
streaming client (tritonclient, one thread per in-flight request):

1. embedding cache on (256 MiB) and 2. cache off (``embedding_cache_mib: 0``): 200 requests at concurrency
   8 over a fixed pool of 40 images (each image 5 times, shuffled: 80% reuse), per mode; mean TTFT cache on /
   cache off, and encoder runs / unique images (from the encode worker's stats). On server 1 also: text-only
   TTFT at concurrency 1 through ``e_p_d`` and through ``epd``.
2. also: tokens/s at concurrency 8 with unique images through each entry model as the BLS scheduler and as
   Triton's ensemble, swapped while serving (Triton's repository API), alternating three times: the scheduler's own
   cost, one instance per stage.

With ``--base COMMIT``, a server of that commit's `trident` (its tree on today's packages) is up beside server 1,
with its settings, and gets each of its loads right after it: TTFT and tokens/s new / base per mode.

    make bench-scheduler                     (LLaVA and Qwen2-VL demos; the tables go into docs/benchmarks.md)
    make bench-scheduler BASE=<commit>       (and the base commit's server beside server 1)
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from report import DEMO_NAMES, write_section
from trees import base_python, env_of, short
from trident.core import auth
from trident.core.netutil import free_ports

auth.secret()  # made here when unset: the servers this bench starts inherit it, so its ensemble calls prove it

MODES = ["e_pd", "e_p_d"]
PROMPT = "Describe the picture in detail, please."
BLS_ROUNDS = 3  # BLS / ensemble: how many times each kind runs, alternating


def demo_with_image_prompt(arch: str) -> tuple[str, str]:
    """The demo model of ``arch`` (its folder) and its chat template's prompt of one image and :data:`PROMPT`."""
    from transformers import AutoTokenizer

    from trident.dev.demo import default_demo_model

    model = str(default_demo_model(arch, log=None))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    return model, AutoTokenizer.from_pretrained(model).apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)


def image_b64(seed: int, size: int = 224) -> str:
    import base64
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class Serve:
    """`trident serve` on free ports, output kept; stopped with SIGTERM. ``config``: settings of its config file
    (``--config``; the keys of docs/configuration.md, nested as dicts)."""

    TOKEN = "bench-scheduler"

    def __init__(self, model: str, extra: list[str], modes: tuple[str, ...] = (*MODES, "epd"),
                 openai: bool = False, config: dict | None = None, python: str | None = None,
                 ports: list[int] | None = None) -> None:
        self.http, self.grpc, metrics, openai_port = ports or free_ports(4)
        self.openai = openai_port if openai else 0
        self.model = model
        self.workspace = Path(tempfile.mkdtemp(prefix="bench-sched-"))
        token = self.workspace / "access-token"  # mkdtemp's folder is the user's alone
        token.write_text(self.TOKEN)
        token.chmod(0o600)
        # ``python``: a venv's interpreter whose trident is an older commit's (trees.base_python: a side-by-side base)
        cmd = [python or sys.executable, "-m", "trident.cli", "serve", "--model", model, "--mode", *modes,
               "--access-token-file", str(token), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
               "--metrics-port", str(metrics), "--openai-port", str(self.openai), "--workspace", str(self.workspace),
               *extra]
        if config:
            (self.workspace / "serve.json").write_text(json.dumps(config))
            cmd += ["--config", str(self.workspace / "serve.json")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env_of(python))
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("[trident] ready"):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        while not ready.wait(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during start-up:\n" + "".join(self.lines[-30:]))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each stage worker, and by Triton with its python-backend stubs."""
        workers = {line.split()[3]: int(line.rsplit("pid ", 1)[1].strip().rstrip(")"))
                   for line in self.lines if line.startswith("[trident] started worker ")}
        tree = _process_tree(self.proc.pid)
        out = {name: sum(_cpu(p) for p in tree.get(pid, [pid])) for name, pid in workers.items()}
        worker_pids = {p for pid in workers.values() for p in tree.get(pid, [pid])}
        out["triton"] = sum(_cpu(p) for p in tree[self.proc.pid] if p not in worker_pids and p != self.proc.pid)
        return out

    def encode_stats(self) -> dict:
        time.sleep(0.5)  # stats files are rewritten every 0.2 s
        return json.loads((self.workspace / "stats" / "encode.json").read_text())

    def swap(self, mode: str, kind: str) -> None:
        """Reload an entry model as the BLS scheduler or as an ensemble (a config override)."""
        import tritonclient.http as httpclient
        from google.protobuf import json_format

        from trident.core.repository import bls_config, ensemble_config

        config = bls_config(mode) if kind == "bls" else ensemble_config(mode)
        httpclient.InferenceServerClient(f"127.0.0.1:{self.http}").load_model(
            mode, config=json_format.MessageToJson(config), headers={"triton-access-token": self.TOKEN}
        )

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.workspace, ignore_errors=True)


def _cpu(pid: int) -> float:
    """utime + stime of a live process, in seconds (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(root: int) -> dict[int, list[int]]:
    """pid -> that process and all its descendants, for every process under ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))

    def below(pid: int) -> list[int]:
        return [pid] + [q for c in children.get(pid, []) for q in below(c)]

    return {pid: below(pid) for pid in below(root)}


class Stream:
    """One gRPC stream (tritonclient) for requests sent one after another."""

    def __init__(self, url: str) -> None:
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self._q: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self._q.put((result, error, time.monotonic_ns())))

    def _tensor(self, name, arr, dtype):
        t = self._grpc.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    def request(self, mode: str, text: str, images: list[str], max_tokens: int, clock: dict | None = None):
        """(TTFT s, output tokens); ``clock`` gets the send, first-token and done times (``time.monotonic_ns()``)."""
        params = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        inputs = [
            self._tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
            self._tensor("sampling_parameters", np.array([params.encode()], dtype=np.object_), "BYTES"),
            self._tensor("stream", np.array([True]), "BOOL"),
            self._tensor("return_num_output_tokens", np.array([True]), "BOOL"),
        ]
        if images:
            inputs.append(self._tensor("image", np.array([i.encode() for i in images], dtype=np.object_), "BYTES"))
        clock = clock if clock is not None else {}
        clock["send"] = time.monotonic_ns()
        ttft, tokens = None, 0
        # the ensemble's steps are stage models: its caller proves the deployment secret (the BLS ignores it)
        self.client.async_stream_infer(mode, inputs, enable_empty_final_response=True,
                                       parameters={auth.CREDENTIAL: auth.credential()})
        while True:
            result, error, arrived = self._q.get(timeout=300)
            if error is not None:
                raise RuntimeError(str(error))
            out = result.as_numpy("text_output")
            if out is not None and out.size and ttft is None:
                ttft = (arrived - clock["send"]) / 1e9
                clock["first"] = arrived
            n = result.as_numpy("num_output_tokens")
            if n is not None and n.size:
                tokens += int(n.reshape(-1)[0])  # (each response counts its own tokens)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                clock["done"] = arrived
                return ttft or float("nan"), tokens

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def one_request(
    url: str, mode: str, text: str, images: list[str], max_tokens: int, clock: dict | None = None
) -> tuple[float, int]:
    """(TTFT s, output tokens) of one streamed request on a stream of its own (as each client thread of the
    load opens one)."""
    stream = Stream(url)
    try:
        return stream.request(mode, text, images, max_tokens, clock)
    finally:
        stream.close()


def warm_up(url: str, mode: str, job: tuple[str, list[str]]) -> None:
    """One request like ``job``, with an image of no run."""
    text, images = job
    one_request(url, mode, text, [image_b64(999_999, _side(images[0]))] * len(images) if images else [], 2)


def load(url: str, mode: str, jobs: list[tuple[str, list[str]]], concurrency: int, max_tokens: int,
         warm: bool = True) -> dict:
    """Run ``jobs`` (text, images) at ``concurrency`` (after a warm-up); mean/p50 TTFT and output tokens/s."""
    if warm:
        warm_up(url, mode, jobs[0])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda job: one_request(url, mode, job[0], job[1], max_tokens), jobs))
    span = time.perf_counter() - t0
    ttfts = [r[0] * 1000 for r in results]
    return {
        "ttft_mean": statistics.fmean(ttfts), "ttft_p50": statistics.median(ttfts),
        "tok_s": sum(r[1] for r in results) / span, "requests": len(results),
    }


def _side(b64: str) -> int:
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).width


def reuse_jobs(text: str, pool_size: int, requests: int, seed: int, size: int = 224) -> tuple[list, int]:
    """``requests`` jobs over ``pool_size`` images, each used requests/pool_size times, shuffled."""
    images = [image_b64(seed + i, size) for i in range(pool_size)]
    order = [i % pool_size for i in range(requests)]
    random.Random(seed).shuffle(order)
    return [(text, [images[i]]) for i in order], pool_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["llava", "qwen2vl"], help="demo models to run (default: both)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pool", type=int, default=40, help="distinct images in the reuse runs")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--size", type=int, default=224, help="image side, px (default: 224)")
    ap.add_argument("--report", type=Path, help="markdown file to put the tables into (its section `bench-scheduler`)")
    ap.add_argument("--base", metavar="COMMIT", help="also a server of this commit's trident beside server 1")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a stopped bench stops its servers on the way out)
    work = Path(tempfile.mkdtemp(prefix="bench-sched-base-"))
    try:
        args.base_python = base_python(args.base, work) if args.base else None
        return run(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args) -> int:
    lines = ["## Scheduler (`make bench-scheduler`)", "",
             "`clients/perf/bench_scheduler.py`, with the same gRPC streaming client for every row; hf engine. Reuse "
             f"runs: {args.requests} requests at concurrency {args.concurrency} over a pool of {args.pool} images "
             f"({1 - args.pool / args.requests:.0%} reuse), {args.max_tokens} new tokens, with the encode worker's "
             f"embedding cache on and off. BLS / ensemble: 48 requests with unique images, 32 new tokens, each kind "
             f"{BLS_ROUNDS} times, alternating, on one server. CPU s: each process's user + system time over the "
             f"{args.requests} requests (`triton`: the server with its python-backend stubs, the BLS among them). On "
             f"saturated cores ({os.cpu_count()} here) the cache can cut TTFT by at most the share of the CPU it "
             "saves, which the \"best TTFT ratio\" rows give."
             + (f" new / base: server 1 against a server of commit {short(args.base)} (its tree on today's packages) "
                "up beside it, each load on one right after the other." if args.base else ""), ""]
    for arch in args.arch:
        rows = run_arch(arch, args)
        lines += table(arch, rows, args)
        print("\n".join(lines), flush=True)
    if args.report:
        write_section(args.report, "bench-scheduler", lines, before="bench-vllm")
    return 0


def run_arch(arch: str, args) -> dict[str, dict]:
    from transformers import AutoTokenizer

    from trident.dev.demo import default_demo_model

    model = str(default_demo_model(arch, log=None))
    tok = AutoTokenizer.from_pretrained(model)
    chat = lambda n, t: tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": t}]}],
        tokenize=False, add_generation_prompt=True,
    )
    image_text = chat(1, PROMPT)
    text_only = chat(0, "Tell me a short story about a lighthouse.")
    rows: dict[str, dict] = {}
    for label, config in (("cache on", {}), ("cache off", {"embedding_cache_mib": 0})):
        print(f"[bench] {arch}, {label}: starting the server", flush=True)
        server = Serve(model, [], config=config)
        base = Serve(model, [], config=config, python=args.base_python) if args.base and label == "cache on" else None
        try:
            url = f"127.0.0.1:{server.grpc}"
            base_url = f"127.0.0.1:{base.grpc}" if base else ""
            for k, mode in enumerate(MODES):
                jobs, unique = reuse_jobs(image_text, args.pool, args.requests, 1000 * (k + 1), args.size)
                if base and k % 2 == 0:  # the same load on the base (its own cache), first every other mode
                    rows[f"base/{mode}"] = load(base_url, mode, jobs, args.concurrency, args.max_tokens)
                warm_up(url, mode, jobs[0])  # (its image is not one of the pool's)
                before, cpu_before = server.encode_stats(), server.cpu_seconds()
                result = load(url, mode, jobs, args.concurrency, args.max_tokens, warm=False)
                after, cpu_after = server.encode_stats(), server.cpu_seconds()
                result["cpu"] = {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after}
                result["encoder_runs_per_unique"] = (after["images_encoded"] - before["images_encoded"]) / unique
                rows[f"{label}/{mode}"] = result
                print(f"[bench] {arch} {label} {mode}: {result}", flush=True)
                if base and k % 2 == 1:
                    rows[f"base/{mode}"] = load(base_url, mode, jobs, args.concurrency, args.max_tokens)
            if label == "cache on":
                for mode in ("epd", "e_p_d"):  # text-only at concurrency 1
                    rows[f"text/{mode}"] = load(url, mode, [(text_only, [])] * 30, 1, args.max_tokens)
                    if base:
                        rows[f"base text/{mode}"] = load(base_url, mode, [(text_only, [])] * 30, 1, args.max_tokens)
                continue
            for mode in MODES:  # the scheduler's own cost: BLS and ensemble alternating, unique images
                for round_ in range(BLS_ROUNDS):
                    for kind in ("bls", "ensemble"):
                        server.swap(mode, kind)
                        seed = 50_000 + 1000 * round_ + (100 if kind == "ensemble" else 0)
                        jobs = [(image_text, [image_b64(seed + i, args.size)]) for i in range(48)]
                        result = load(url, mode, jobs, args.concurrency, 32)
                        rows.setdefault(f"{kind}/{mode}", []).append(result["tok_s"])
                        print(f"[bench] {arch} {kind} {mode} round {round_}: {result}", flush=True)
                server.swap(mode, "bls")
        finally:
            server.stop()
            if base:
                base.stop()
    return rows


def table(arch: str, rows: dict, args) -> list[str]:
    out = [
        f"### {DEMO_NAMES.get(arch, arch)} demo, {args.size} px images",
        "", "| measure | mode | value | target |", "|---|---|---|---|",
    ]
    for mode in MODES:
        on, off = rows[f"cache on/{mode}"], rows[f"cache off/{mode}"]
        out.append(f"| mean TTFT cache on / cache off ({on['ttft_mean']:.0f} / {off['ttft_mean']:.0f} ms) | {mode} | "
                   f"{on['ttft_mean'] / off['ttft_mean']:.2f} | <= 0.6 |")
        out.append(f"| encoder runs / unique images, cache on | {mode} | {on['encoder_runs_per_unique']:.2f} | 1.00 |")
        out.append(f"| encoder runs / unique images, cache off | {mode} | {off['encoder_runs_per_unique']:.2f} | (every request) |")
        stages = [k for k in off["cpu"] if off["cpu"][k] >= 0.05]
        for label, run in (("cache on", on), ("cache off", off)):
            spent = ", ".join(f"{k} {run['cpu'].get(k, 0.0):.1f}" for k in stages)
            out.append(f"| CPU s over the run, {label}: {spent} | {mode} | {sum(run['cpu'].values()):.1f} | |")
        saved = off["cpu"].get("encode", 0.0) - on["cpu"].get("encode", 0.0)
        out.append(f"| best TTFT ratio the cache allows here: 1 - encoder CPU saved / all CPU, cache off "
                   f"({saved:.1f} / {sum(off['cpu'].values()):.1f} s) | {mode} | "
                   f"{1 - saved / sum(off['cpu'].values()):.2f} | |")
    t_epd, t_epd3 = rows["text/epd"], rows["text/e_p_d"]
    out.append(f"| text-only TTFT e_p_d / epd, concurrency 1 ({t_epd3['ttft_mean']:.0f} / {t_epd['ttft_mean']:.0f} ms) | "
               f"e_p_d | {t_epd3['ttft_mean'] / t_epd['ttft_mean']:.2f} | <= 1.05 |")
    for mode in MODES:
        if f"base/{mode}" in rows:
            on, base = rows[f"cache on/{mode}"], rows[f"base/{mode}"]
            out.append(f"| mean TTFT new / base, cache on ({on['ttft_mean']:.0f} / {base['ttft_mean']:.0f} ms) | {mode} "
                       f"| {on['ttft_mean'] / base['ttft_mean']:.2f} | <= 1.05 |")
            out.append(f"| tok/s new / base, cache on ({on['tok_s']:.0f} / {base['tok_s']:.0f}) | {mode} "
                       f"| {on['tok_s'] / base['tok_s']:.2f} | >= 0.95 |")
    for mode in ("epd", "e_p_d"):
        if f"base text/{mode}" in rows:
            new, base = rows[f"text/{mode}"], rows[f"base text/{mode}"]
            out.append(f"| text-only TTFT new / base, concurrency 1 ({new['ttft_mean']:.0f} / {base['ttft_mean']:.0f} "
                       f"ms) | {mode} | {new['ttft_mean'] / base['ttft_mean']:.2f} | <= 1.05 |")
    for mode in MODES:
        bls, ens = statistics.fmean(rows[f"bls/{mode}"]), statistics.fmean(rows[f"ensemble/{mode}"])
        out.append(f"| tok/s BLS / ensemble, one instance each, concurrency {args.concurrency} "
                   f"({bls:.0f} / {ens:.0f}) | {mode} | {bls / ens:.2f} | >= 0.97 |")
    return out + [""]


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
