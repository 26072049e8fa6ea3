#!/usr/bin/env python3
"""The speed guard: a base commit's tree against the working tree (or a second commit), side by side in one run.

For each engine, a `trident serve` of every mode from each tree (both up at once, the same venvs: each server's
processes import `trident` from their own tree, by PYTHONPATH), then R rounds; in each round every mode of
both servers in turn (the tree that goes first alternates), each with the same OpenAI streaming client: N requests
at concurrency C, one new 224 px image each (never repeated in the run: no embedding- or prefix-cache hit),
greedy, `ignore_eos`, the LLaVA demo. Per engine and mode it prints tokens/s and TTFT p50/p99 of each tree and the
ratios new/base, with the spread of the per-round tokens/s ratios. A row whose tokens/s ratio is under 0.95 and
whose best round is under 0.95 too (below 0.95, outside the spread) is marked REGRESSION, and the exit is 1.

    make bench-ab BASE=<commit>                     (every mode, both engines; ~10 min on 2 cores)
    make bench-ab BASE=<commit> AB_ARGS="--engines vllm --modes e_p_d ep_d --new <commit>"
    make bench-ab BASE=<commit> AB_ARGS="--client triton-http"   (the same load through Triton's HTTP port)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_engines import MODES, Process, load, load_triton_http
from report import write_section
from trees import ROOT, export_tree, overlay, short
from trident.core.netutil import free_ports

SECTION = "bench-ab"
FLOOR = 0.95  # a tokens/s ratio under this, outside the rounds' spread, is a regression


@dataclass
class Tree:
    name: str  # "base" or "new"
    label: str  # the commit, or "working tree"
    path: Path
    python: str = sys.executable  # the head's python (its venv: .venv, or an overlay of it)
    vllm_python: str = ""  # the vLLM workers' (.venv-vllm, or an overlay of it)
    runs: dict = field(default_factory=dict)  # (engine, mode) -> [load() result per round]


class Server:
    """One tree's `trident serve` of every mode (``--mode`` list), its processes importing that tree's `trident`."""

    def __init__(self, tree: Tree, args, backend: str, workspace: Path) -> None:
        self.tree = tree
        http, grpc, metrics, self.openai_port = free_ports(4)
        self.http_url = f"http://127.0.0.1:{http}"
        cmd = [tree.python, "-m", "trident.cli", "serve", "--model", args.model, "--mode", *args.modes,
               "--backend", backend, "--workspace", str(workspace), "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--openai-port", str(self.openai_port), "--served-model-name", "demo"]
        if backend == "vllm":
            cmd += ["--worker-python", tree.vllm_python]
        if args.serve_config:
            cmd += ["--config", args.serve_config]
        env = {"PATH": f"{Path(tree.python).parent}:{os.environ['PATH']}"}
        self.process = Process(cmd, env)

    def wait_ready(self, timeout: float = 900) -> float:
        while not any(line.startswith("[trident] ready") for line in self.process.lines):
            if self.process.proc.poll() is not None or time.monotonic() - self.process.t0 > timeout:
                raise RuntimeError(f"{self.tree.name} server did not start:\n" + "".join(self.process.lines[-40:]))
            time.sleep(0.2)
        return self.process.started()[0]

    def url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}/v1"


def run_engine(args, backend: str, trees: list[Tree], seeds: list[int]) -> None:
    """Both trees' servers of ``backend`` up at once; the rounds alternate which tree goes first."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        servers = []
        try:
            for tree in trees:  # one after the other: two start-ups at once on 2 cores only slow each other
                print(f"[bench-ab] starting {tree.name} ({tree.label}) --backend {backend}", flush=True)
                servers.append(Server(tree, args, backend, Path(tmp) / tree.name))
                print(f"[bench-ab] {tree.name} ready in {servers[-1].wait_ready():.0f} s", flush=True)
            for r in range(args.rounds):
                for mode in args.modes:
                    order = servers if (r + args.modes.index(mode)) % 2 == 0 else servers[::-1]
                    seed = seeds.pop()  # the same new images for both trees (separate servers: no shared cache)
                    for server in order:
                        if args.client == "triton-http":
                            result = asyncio.run(load_triton_http(server.http_url, mode, args.requests,
                                                                  args.concurrency, args.max_tokens, seed=seed))
                        else:
                            result = asyncio.run(load(server.url(), f"demo:{mode}", args.requests, args.concurrency,
                                                      args.max_tokens, seed=seed))
                        server.tree.runs.setdefault((backend, mode), []).append(result)
                        print(f"[bench-ab] round {r + 1} {backend} {mode} {server.tree.name}: {result['tok_s']:.1f} "
                              f"tok/s, TTFT p50 {result['ttft_p50']:.0f} ms", flush=True)
        finally:
            for server in servers:
                server.process.stop()


def pooled(results: list[dict], key: str) -> float:
    """A TTFT percentile (ms) over every round's requests."""
    values = sorted(1000 * t for r in results for t in r["ttfts"])
    if key == "p50":
        return statistics.median(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def table(args, base: Tree, new: Tree) -> tuple[list[str], list[list[str]], list[str]]:
    header = ["engine", "mode", "base tok/s", "new tok/s", "tok/s new/base", "spread (rounds)",
              "TTFT p50 base / new ms", "TTFT p50 new/base", "TTFT p99 base / new ms", "TTFT p99 new/base", "verdict"]
    rows, regressions = [], []
    for key in base.runs:
        b, n = base.runs[key], new.runs[key]
        per_round = [y["tok_s"] / x["tok_s"] for x, y in zip(b, n)]
        tok_b, tok_n = statistics.mean(x["tok_s"] for x in b), statistics.mean(y["tok_s"] for y in n)
        ratio = tok_n / tok_b
        worse = ratio < FLOOR and max(per_round) < FLOOR
        if worse:
            regressions.append(f"{key[0]} {key[1]}")
        p50 = (pooled(b, "p50"), pooled(n, "p50"))
        p99 = (pooled(b, "p99"), pooled(n, "p99"))
        rows.append([
            key[0], key[1], " ".join(f"{x['tok_s']:.0f}" for x in b), " ".join(f"{y['tok_s']:.0f}" for y in n),
            f"{ratio:.2f}", f"{min(per_round):.2f}-{max(per_round):.2f}", f"{p50[0]:.0f} / {p50[1]:.0f}",
            f"{p50[1] / p50[0]:.2f}", f"{p99[0]:.0f} / {p99[1]:.0f}", f"{p99[1] / p99[0]:.2f}",
            "REGRESSION" if worse else "ok",
        ])
    return header, rows, regressions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the base commit")
    p.add_argument("--new", help="a commit to compare with the base (default: the working tree, as it is)")
    p.add_argument("--model", help="checkpoint folder (default: the LLaVA demo model)")
    p.add_argument("--vllm-python", default=os.environ.get("TRIDENT_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--client", choices=["openai", "triton-http"], default="openai",
                   help="the load's client: OpenAI streaming chat (default), or Triton's HTTP generate_stream")
    p.add_argument("--serve-config", metavar="FILE", help="`trident serve` config file of both servers")
    p.add_argument("--report", type=Path, help="also write the table into this Markdown file (section bench-ab)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a stopped bench stops its servers on the way out)
    if args.model is None:
        from trident.dev.demo import default_demo_model

        args.model = str(default_demo_model("llava"))

    work = Path(tempfile.mkdtemp(prefix="bench-ab-trees-"))
    args.vllm_python = str(Path(args.vllm_python).absolute())
    head_venv, vllm_venv = Path(sys.executable).parent.parent, Path(args.vllm_python).parent.parent

    def exported(name: str, commit: str) -> Tree:
        tree = export_tree(commit, work / name)
        return Tree(name, short(commit), tree, str(overlay(head_venv, tree, work / f"venv-{name}")),
                    str(overlay(vllm_venv, tree, work / f"venv-vllm-{name}")))

    try:
        base = exported("base", args.base)
        if args.new:
            new = exported("new", args.new)
        else:
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True).stdout.strip()
            new = Tree("new", f"working tree ({short('HEAD')}{' + changes' if dirty else ''})", ROOT,
                       sys.executable, args.vllm_python)
        # a new image for every load, the same ones for both trees
        seeds = [1_000_000 * (k + 1) for k in range(len(args.engines) * len(args.modes) * args.rounds)][::-1]
        for backend in args.engines:
            run_engine(args, backend, [base, new], seeds)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    header, rows, regressions = table(args, base, new)
    what = "streaming chat requests" if args.client == "openai" else "Triton HTTP generate_stream requests"
    caption = (f"base {base.label}, new {new.label}: {args.rounds} rounds of {args.requests} {what} "
               f"at concurrency {args.concurrency} per mode and tree, one new 224 px image each, {args.max_tokens} new "
               f"tokens (greedy, ignore_eos), {Path(args.model).name}; {os.cpu_count()} CPU cores")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(caption)
    print(" | ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
    if args.report:
        http = args.client == "triton-http"
        write_section(args.report, SECTION + ("-http" if http else ""), [
            "## A base commit against the working tree (`make bench-ab BASE=...`)" if not http else
            "## The same through Triton's HTTP port (`make bench-ab BASE=... AB_ARGS=\"--client triton-http\"`)", "",
            *(["The load of the section above, each request a Triton HTTP `generate_stream` (SSE) to the mode's entry "
               "model (the prompt written out, the image base64): what a `tritonclient` or `perf_analyzer` user's "
               "requests pass.", ""] if http else []),
            "`clients/perf/bench_ab.py`, the speed guard to run before a change that touches a serving path lands. Per "
            "engine it starts a `trident serve` of every mode from the base commit's tree (`git archive`) and one from "
            "the working tree, both from the same environments (the base's in a venv that links `.venv`'s and "
            "`.venv-vllm`'s packages, with its own `trident` in place of the editable install), and keeps both up. "
            "Then, in each round, every mode of both servers in turn, the tree that goes first alternating, gets the "
            "same OpenAI streaming load (`make bench-vllm`'s client: one new 224 px image per request, never repeated "
            "in the run, greedy, `ignore_eos`).", "",
            "How to read it: `tok/s new/base` is the ratio of the rounds' mean tokens/s, `spread` the lowest and "
            "highest ratio of one round's pair (the run's noise: 0.9-1.1 is common on 2 cores); the TTFT columns "
            "pool every round's requests. A row under 0.95 whose best round is under 0.95 too is below the base "
            "outside the spread: the script marks it REGRESSION and exits 1, and it is fixed or explained with "
            "numbers before the change lands. Start-up time and media other than images are not in it (`make "
            "bench-vllm`, `make bench`). The base's tree runs on today's environments: a base that needs other "
            "package versions is not measured as it shipped.", "",
            caption + ".", "",
            "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows),
        ], before="bench-vllm")
    if regressions:
        print(f"[bench-ab] below {FLOOR} of the base, outside the spread: {', '.join(regressions)}")
        return 1
    print(f"[bench-ab] every row at {FLOOR} of the base or within the spread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
