"""Soak: many streamed requests over every mode at once, some cancelled midway, one worker killed with
SIGKILL during the run; then what the server left behind.

One asyncio client drives a running server (:class:`support.served.Server`):

1. **calm pass**: every case once per mode, one at a time. The four modes must agree; their text is each
   case's reference. Then a burst at full concurrency at each mode warms the batched paths.
2. **soak**: ``requests`` streamed requests at ``concurrency``, each a random mode and case (images,
   text-only, or a fresh image no cache has seen), over gRPC or (a share of them) the OpenAI API. About
   ``cancel`` of them are cancelled by the client after half their tokens. When ``warm`` of them have
   finished, each process's RSS is read ("before", warmed up by the same mix, under load); when ``kill_at``
   have, the worker of stage ``kill`` is killed with SIGKILL and the supervisor starts it again.
3. **after**: the server must drain (no lease, region, KV block or decode left), the killed worker must be
   back, every mode must still give each reference; RSS is read again ("after", idle).
4. **endings** (``make soak``, not the suite's short soak): with 16 streams sent (half of them answering, the others
   queued or starting) the server gets SIGTERM: each
   stream finishes with its reference text or ends with a clean 503, a request sent just after gets a 503 within
   a second, the server exits 0; then a second server has its Triton killed (SIGKILL) under the same load: each
   stream ends (its reference text or an error, no hang), the server exits 1. Neither leaves a process or a
   shared-memory region behind (:class:`Ending`).

An error is *expected* only when it is a 503 naming the problem (the worker exited, no live stage instance,
over capacity) for a request in flight between the kill and a moment after the worker was back; every other
error, a wrong text, a short stream or a hang is *unexpected*.

    make soak                              (1,000 requests at concurrency 64; report -> docs/reliability.md)
    PYTHONPATH=tests python -m support.soak --help
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import sys
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trident.core.protocol import MODES
from .served import Server, descendants, held

MAX_TOKENS = 16
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
TEXTS = [
    "Tell me a short story about a lighthouse.",
    "What is the capital of a small imaginary country?",
    "List three colors of the sea at dawn.",
]
IMAGE_QUESTION = "Describe the picture in detail, please."
EXPECTED_503 = ("exited", "no live stage instances", "Unavailable", "retry later", "is not running")
SECTION, END = "<!-- soak -->", "<!-- /soak -->"


def image_b64(seed: int, side: int = 224) -> str:
    """A deterministic PNG, base64."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (np.add.outer(np.arange(side), np.arange(side))[..., None] * (seed % 7 + 1) + rng.integers(0, 40, (side, side, 3))) % 256
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class Case:
    """One request's content: the chat messages' text and images (base64), and the prompt they render to."""

    name: str
    text: str
    images: tuple[str, ...]
    prompt: str


def make_cases(model_path: str) -> list[Case]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)

    def case(name: str, text: str, images: tuple[str, ...]) -> Case:
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        return Case(name, text, images, prompt)

    cases = [case(f"text-{i}", t, ()) for i, t in enumerate(TEXTS)]
    cases += [case(f"image-{i}", IMAGE_QUESTION, (image_b64(i),)) for i in range(2)]
    cases.append(case("two-images", IMAGE_QUESTION, (image_b64(10), image_b64(11, 160))))
    return cases


@dataclass
class Outcome:
    """What one request got."""

    mode: str
    case: str
    path: str  # grpc | openai
    start: float
    end: float = 0.0
    ttft: float | None = None
    text: str = ""
    chunks: int = 0
    cancelled: bool = False
    error: str | None = None
    kind: str = ""  # ok | cancelled | expected_error | unexpected


class Client:
    """Streams one request over gRPC (an entry model) or the OpenAI API; cancels after ``cancel_after``
    text chunks when given."""

    def __init__(self, grpc_url: str, openai_url: str | None, model_id: str) -> None:
        import aiohttp
        import tritonclient.grpc.aio as grpcclient

        self.g = grpcclient
        self.grpc = grpcclient.InferenceServerClient(grpc_url)
        self.openai_url = openai_url
        self.model_id = model_id
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                          connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.http.close()
        await self.grpc.close()

    async def run(self, out: Outcome, case: Case, cancel_after: int | None, timeout: float) -> Outcome:
        try:
            async with asyncio.timeout(timeout):
                await (self._openai if out.path == "openai" else self._grpc)(out, case, cancel_after)
        except TimeoutError:
            out.error = f"no answer within {timeout:.0f} s (a hang)"
        except Exception as e:  # noqa: BLE001 - the soak records every failure
            out.error = f"{type(e).__name__}: {e}"
        out.end = time.monotonic()
        return out

    def _chunk(self, out: Outcome, text: str) -> None:
        if text:
            if out.ttft is None:
                out.ttft = time.monotonic() - out.start
            out.text += text
            out.chunks += 1

    async def _grpc(self, out: Outcome, case: Case, cancel_after: int | None) -> None:
        spec = [
            ("text_input", np.array([case.prompt.encode()], dtype=np.object_), "BYTES"),
            ("sampling_parameters", np.array([json.dumps(GREEDY).encode()], dtype=np.object_), "BYTES"),
            ("stream", np.array([True]), "BOOL"),
            ("exclude_input_in_output", np.array([True]), "BOOL"),
        ]
        if case.images:
            spec.append(("image", np.array([i.encode() for i in case.images], dtype=np.object_), "BYTES"))
        inputs = []
        for name, arr, dtype in spec:
            t = self.g.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)

        async def requests():
            yield {"model_name": out.mode, "inputs": inputs}

        stream = self.grpc.stream_infer(requests())
        async for result, error in stream:
            if error is not None:
                raise RuntimeError(str(error))
            piece = result.as_numpy("text_output")
            if piece is not None and piece.size:
                self._chunk(out, piece.reshape(-1)[0].decode())
            if cancel_after is not None and out.chunks >= cancel_after:
                stream.cancel()  # the client goes away mid-stream
                out.cancelled = True
                return

    async def _openai(self, out: Outcome, case: Case, cancel_after: int | None) -> None:
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + i}} for i in case.images]
        content.append({"type": "text", "text": case.text})
        body = {"model": f"{self.model_id}:{out.mode}", "stream": True, "messages": [{"role": "user", "content": content}],
                **GREEDY}
        async with self.http.post(f"{self.openai_url}/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error'].get('message')}")
                if event.get("choices"):
                    self._chunk(out, event["choices"][0]["delta"].get("content") or "")
                if cancel_after is not None and out.chunks >= cancel_after:
                    response.close()  # drop the connection mid-stream
                    out.cancelled = True
                    return


# -- processes and their memory ------------------------------------------------------------------------
def _label(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv if a]
    joined = " ".join(args)
    if joined.startswith("trident worker "):  # a stage worker trident serve forked (its process title)
        return f"worker {joined.split()[2]}"
    if "frontend" in args:
        return "frontend"
    if "triton_python_backend_stub" in joined:
        model = next((Path(a).parent.parent.name for a in args if a.endswith("model.py")), "?")
        return f"stub {model}"
    if "tritonserver" in joined:
        return "tritonserver"
    if " serve " in f"{joined} ":
        return "serve"
    return None


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _triton_rss(serve_pid: int) -> float:
    """tritonserver's RSS (MiB) now; 0 when it is not found."""
    return next((rss for label, (_pid, rss) in memory(serve_pid).items() if label == "tritonserver"), 0.0)



def memory(serve_pid: int) -> dict[str, tuple[int, float]]:
    """``{label: (pid, RSS MiB)}`` of the server's processes (children of a worker are added to it)."""
    out: dict[str, tuple[int, float]] = {}
    for pid in [serve_pid, *descendants(serve_pid)]:
        label = _label(pid)
        try:
            rss = _rss_mib(pid)
        except OSError:
            continue
        if label is None:
            continue
        if label in out:
            label = f"{label} ({pid})"
        out[label] = (pid, rss)
    return out


# -- the run -------------------------------------------------------------------------------------------
@dataclass
class Report:
    requests: int
    concurrency: int
    kill: str
    warm: float = 0.2
    outcomes: list[Outcome] = field(default_factory=list)
    killed_at: float | None = None
    back_at: float | None = None
    killed_pid: int | None = None
    disagreements: list[str] = field(default_factory=list)
    held_after: dict[str, dict] = field(default_factory=dict)
    rss_before: dict[str, tuple[int, float]] = field(default_factory=dict)
    rss_after: dict[str, tuple[int, float]] = field(default_factory=dict)
    triton_rss: list[tuple[int, float]] = field(default_factory=list)  # (requests finished, tritonserver's RSS MiB)
    final_check: list[str] = field(default_factory=list)
    seconds: float = 0.0
    reference: dict[str, str] = field(default_factory=dict)  # each case's text (the calm pass)

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    @property
    def unexpected(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "unexpected"]

    def growth(self) -> dict[str, float | None]:
        """RSS growth per process, as a fraction; None for a process that was restarted (a new pid)."""
        out: dict[str, float | None] = {}
        for label, (pid, before) in self.rss_before.items():
            after = self.rss_after.get(label)
            out[label] = None if after is None or after[0] != pid else (after[1] - before) / before
        return out

    def latency_ms(self, kind: str = "ok") -> dict[str, float]:
        done = [o for o in self.outcomes if o.kind == kind]
        total = sorted((o.end - o.start) * 1000 for o in done)
        ttft = sorted(o.ttft * 1000 for o in done if o.ttft is not None)
        q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")  # noqa: E731
        return {"p50": q(total, 0.5), "p99": q(total, 0.99), "ttft_p50": q(ttft, 0.5), "ttft_p99": q(ttft, 0.99)}

    @property
    def passed(self) -> bool:
        grown = [g for g in self.growth().values() if g is not None and g > 0.10]
        return not (self.unexpected or self.disagreements or self.held_after or self.final_check or grown)


def _classify(o: Outcome, reference: dict[str, str], window: tuple[float, float] | None) -> str:
    if o.error is not None:
        in_window = window is not None and o.start <= window[1] and o.end >= window[0]
        if in_window and any(s in o.error for s in EXPECTED_503):
            return "expected_error"
        return "unexpected"
    if o.cancelled:
        return "cancelled" if reference.get(o.case, o.text).startswith(o.text) else "unexpected"
    if o.case in reference and o.text != reference[o.case]:
        o.error = f"wrong text: {o.text!r} != {reference[o.case]!r}"
        return "unexpected"
    if o.chunks == 0:
        o.error = "no text"
        return "unexpected"
    return "ok"


async def _references(client: Client, cases: list[Case], modes: list[str], report: Report) -> dict[str, str]:
    ref: dict[str, str] = {}
    for case in cases:
        for mode in modes:
            o = await client.run(Outcome(mode, case.name, "grpc", time.monotonic()), case, None, 120)
            if o.error:
                report.disagreements.append(f"calm pass: {mode} {case.name}: {o.error}")
            elif ref.setdefault(case.name, o.text) != o.text:
                report.disagreements.append(f"calm pass: {mode} {case.name}: {o.text!r} != {ref[case.name]!r}")
    return ref


async def _wait_back(server: Server, stage: str, old_pid: int, report: Report) -> None:
    while True:
        await asyncio.sleep(0.2)
        try:
            pid = server.worker_pid(stage)
            if pid != old_pid and await asyncio.to_thread(server.ready, stage):
                report.back_at = time.monotonic()
                return
        except Exception:  # noqa: BLE001 - not back yet
            pass


async def soak(server: Server, *, requests: int = 1000, concurrency: int = 64, cancel: float = 0.1,
               kill: str | None = "decode", kill_at: float = 0.3, openai_share: float = 0.25,
               fresh_share: float = 0.15, warm: float = 0.2, drain_s: float = 120.0, seed: int = 0,
               say=lambda line: None) -> Report:
    """Run the soak against ``server`` (serving every mode) and return what it measured."""
    rng = random.Random(seed)
    modes = [m for m in MODES if server.ready(m)]
    cases = make_cases(server.model_path)
    by_name = {c.name: c for c in cases}
    report = Report(requests, concurrency, kill or "none", warm)
    client = Client(server.grpc, server.openai_url if server.openai_port else None,
                    Path(server.model_path).name)
    t0 = time.monotonic()
    try:
        say(f"[soak] calm pass: {len(cases)} cases x {len(modes)} modes")
        reference = report.reference = await _references(client, cases, modes, report)
        # a burst of `concurrency` at each mode in turn: every worker reaches the batch it may see in the soak
        # (a mode whose stage is down falls back, so one worker may take every request in flight)
        say(f"[soak] warm-up: a burst of {concurrency} at each mode")
        for mode in modes:
            await asyncio.gather(*(client.run(Outcome(mode, c.name, "grpc", time.monotonic()), c, None, 300)
                                   for c in (rng.choice(cases) for _ in range(concurrency))))
        plan = []
        for i in range(requests):
            fresh = rng.random() < fresh_share
            case = Case(f"fresh-{i}", IMAGE_QUESTION, (image_b64(1000 + seed * 100_000 + i),), by_name["image-0"].prompt) \
                if fresh else rng.choice(cases)
            path = "openai" if client.openai_url and rng.random() < openai_share else "grpc"
            cancel_after = MAX_TOKENS // 2 if rng.random() < cancel else None
            plan.append((rng.choice(modes), case, path, cancel_after))
        todo = iter(plan)
        finished = 0
        waiter: asyncio.Task | None = None

        async def lane() -> None:
            nonlocal finished, waiter
            for mode, case, path, cancel_after in todo:
                o = await client.run(Outcome(mode, case.name, path, time.monotonic()), case, cancel_after, 300)
                report.outcomes.append(o)
                finished += 1
                if not report.rss_before and finished >= warm * requests:
                    report.rss_before = memory(server.proc.pid)
                if finished % max(1, requests // 10) == 0:
                    say(f"[soak] {finished}/{requests} done, {sum(x.error is not None for x in report.outcomes)} errors")
                    report.triton_rss.append((finished, _triton_rss(server.proc.pid)))
                if kill and report.killed_at is None and finished >= kill_at * requests:
                    report.killed_pid = server.worker_pid(kill)
                    os.kill(report.killed_pid, signal.SIGKILL)
                    report.killed_at = time.monotonic()
                    say(f"[soak] killed worker {kill} (pid {report.killed_pid}) with SIGKILL")
                    waiter = asyncio.create_task(_wait_back(server, kill, report.killed_pid, report))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
        if waiter is not None:
            say(f"[soak] waiting for worker {kill} to be back")
            await asyncio.wait_for(waiter, 300)
        report.seconds = time.monotonic() - t0

        window = None
        if report.killed_at is not None:
            window = (report.killed_at - 0.5, (report.back_at or time.monotonic()) + 2.0)
        for o in report.outcomes:
            o.kind = _classify(o, reference, window)

        say(f"[soak] draining (up to {drain_s:.0f} s: unread leases are freed when they expire)")
        deadline = time.monotonic() + drain_s
        while (busy := held(server.stats())) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        report.held_after = busy
        for case in cases:  # every mode still gives the reference
            for mode in modes:
                o = await client.run(Outcome(mode, case.name, "grpc", time.monotonic()), case, None, 120)
                if o.error or o.text != reference.get(case.name):
                    report.final_check.append(f"{mode} {case.name}: {o.error or repr(o.text)}")
        await asyncio.sleep(1.0)
        report.rss_after = memory(server.proc.pid)
    finally:
        await client.close()
    return report


# -- the server's end under load -----------------------------------------------------------------------
ENDINGS = ("SIGTERM", "Triton killed")
LATE_WITHIN_S = 1.0  # a request sent after SIGTERM is answered (503) within this


@dataclass
class Ending:
    """How a server ended with streams in flight: ``how`` is SIGTERM (a drain: each stream finishes with its
    reference text or ends with a clean error, a request sent afterwards gets a 503 at once, the server exits 0) or
    Triton killed (each stream ends, with its reference text or an error, none hangs; the server exits 1). Either
    way nothing it started is left: no process, no shared-memory region."""

    how: str
    in_flight: list[Outcome] = field(default_factory=list)
    late: list[Outcome] = field(default_factory=list)  # sent just after the signal
    exit_code: int | None = None
    exit_s: float = 0.0  # from the signal to the server's exit
    left: list[str] = field(default_factory=list)

    def wrong(self, reference: dict[str, str]) -> list[str]:
        """What broke the promise above, one line each."""
        out = []
        for o in self.in_flight:
            if o.error is None and o.text != reference.get(o.case):
                out.append(f"in flight: {o.mode} {o.case}: wrong text {o.text!r}")
            elif o.error is not None and ("a hang" in o.error or (self.how == "SIGTERM" and not any(
                    s in o.error for s in EXPECTED_503))):
                out.append(f"in flight: {o.mode} {o.case}: {o.error}")
        for o in self.late:
            if o.error is None:
                out.append(f"sent after {self.how}: {o.path} answered as a success")
            elif self.how == "SIGTERM" and not ("shutting down" in o.error and o.end - o.start <= LATE_WITHIN_S):
                out.append(f"sent after SIGTERM: {o.path}: {o.end - o.start:.2f} s: {o.error[:200]}")
        expected = 0 if self.how == "SIGTERM" else 1
        if self.exit_code != expected:
            out.append(f"exit code {self.exit_code}, not {expected}")
        return out + [f"left behind: {x}" for x in self.left]


def _triton_pid(serve_pid: int) -> int:
    return next(pid for pid in descendants(serve_pid) if _label(pid) == "tritonserver")


async def end_under_load(server: Server, how: str, cases: list[Case], streams: int = 16, seed: int = 1,
                         say=lambda line: None) -> Ending:
    """Send ``streams`` streams over every mode (gRPC and OpenAI), wait until half of them have their first text, then
    end the server ``how`` (:data:`ENDINGS`), send one more request each way, and watch everything end."""
    rng = random.Random(seed)
    modes = [m for m in MODES if server.ready(m)]
    client = Client(server.grpc, server.openai_url if server.openai_port else None, Path(server.model_path).name)
    ending = Ending(how)
    try:
        outcomes = [Outcome(rng.choice(modes), c.name, "openai" if client.openai_url and i % 4 == 0 else "grpc", 0.0)
                    for i, c in enumerate(rng.choice(cases) for _ in range(streams))]
        by_name = {c.name: c for c in cases}
        tasks = []
        for o in outcomes:
            o.start = time.monotonic()
            tasks.append(asyncio.create_task(client.run(o, by_name[o.case], None, 120)))
        deadline = time.monotonic() + 60  # half of them have their first text: the others are queued or starting
        while sum(o.ttft is not None for o in outcomes) < streams // 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tree = [server.proc.pid, *descendants(server.proc.pid)]
        triton = _triton_pid(server.proc.pid)
        say(f"[soak] {how} with {sum(not t.done() for t in tasks)} streams in flight")
        t0 = time.monotonic()
        if how == "SIGTERM":
            server.proc.send_signal(signal.SIGTERM)
        else:
            os.kill(triton, signal.SIGKILL)
        await asyncio.sleep(0.2)
        late = [Outcome(modes[0], cases[0].name, path, time.monotonic())
                for path in (["grpc", "openai"] if client.openai_url else ["grpc"])]
        ending.late = list(await asyncio.gather(*(client.run(o, cases[0], None, 30) for o in late)))
        ending.in_flight = list(await asyncio.gather(*tasks))
        ending.exit_code = await asyncio.to_thread(server.proc.wait, 120)
        ending.exit_s = time.monotonic() - t0
        await asyncio.sleep(1.0)  # (vLLM's engine processes end just after their worker)
        ending.left = [f"pid {pid} ({_label(pid) or 'gone meanwhile'})" for pid in tree
                       if Path(f"/proc/{pid}").exists() and _label(pid) is not None]
        ending.left += [f"/dev/shm/{r.name}" for r in Path("/dev/shm").glob(f"pytrtion{server.proc.pid}-*")]
    finally:
        await client.close()
    return ending


def ending_table(endings: list[Ending], reference: dict[str, str]) -> list[str]:
    lines = ["| ending | streams in flight | finished with the reference text | ended with a clean error | "
             "sent after it: answered in | exit code (s after the signal) | left behind |", "|---|---|---|---|---|---|---|"]
    for e in endings:
        done = sum(o.error is None and o.text == reference.get(o.case) for o in e.in_flight)
        late = ", ".join(f"{o.path} {o.end - o.start:.2f} s ({'503' if o.error and 'shutting down' in o.error else 'error' if o.error else 'success!'})"
                         for o in e.late)
        lines.append(f"| {e.how} | {len(e.in_flight)} | {done} | {sum(o.error is not None for o in e.in_flight)} | "
                     f"{late} | {e.exit_code} ({e.exit_s:.1f} s) | {len(e.left) or 'nothing'} |")
    for e in endings:
        lines += [f"\n{e.how}: {line}" for line in e.wrong(reference)]
    return lines


# -- the report ----------------------------------------------------------------------------------------
def table(r: Report) -> list[str]:
    lat = r.latency_ms()
    lines = [
        f"{r.requests} streamed requests at concurrency {r.concurrency}, {MAX_TOKENS} tokens each, mixed over the "
        f"modes, gRPC and OpenAI, images, text-only and fresh images; worker `{r.kill}` killed with SIGKILL "
        f"after {sum(o.end <= (r.killed_at or 0) for o in r.outcomes)} had finished. {r.seconds:.0f} s in all.",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| completed with the reference text | {r.count('ok')} | |",
        f"| cancelled by the client midway | {r.count('cancelled')} | about 10% |",
        f"| expected errors (503 while `{r.kill}` was down) | {r.count('expected_error')} | |",
        f"| unexpected errors, wrong texts, hangs | {len(r.unexpected)} | 0 |",
        f"| modes disagreeing (calm pass) | {len(r.disagreements)} | 0 |",
        f"| workers holding leases, regions, KV blocks or decodes after the run | {len(r.held_after)} | 0 |",
        f"| every mode gives the reference after the run | {'yes' if not r.final_check else 'no'} | yes |",
        f"| `{r.kill}` back after the kill | "
        + (f"{r.back_at - r.killed_at:.1f} s" if r.back_at and r.killed_at else "n/a") + " | |",
        f"| latency p50 / p99 (completed) | {lat['p50']:.0f} / {lat['p99']:.0f} ms | |",
        f"| TTFT p50 / p99 (completed) | {lat['ttft_p50']:.0f} / {lat['ttft_p99']:.0f} ms | |",
        "",
        f"RSS before: once the first {r.warm:.0%} of the requests had finished (warmed up by the same mix, under load); "
        "after: drained and idle. A restarted process is a new one, not compared.",
        "",
        "| process | RSS before (MiB) | RSS after (MiB) | growth |",
        "|---|---|---|---|",
    ]
    growth = r.growth()
    for label, (_pid, before) in sorted(r.rss_before.items()):
        after = r.rss_after.get(label)
        g = growth[label]
        shown = "restarted (new process)" if g is None else f"{g * 100:+.1f}%"
        lines.append(f"| {label} | {before:.0f} | {after[1]:.0f} | {shown} |" if after else
                     f"| {label} | {before:.0f} | gone | {shown} |")
    if r.triton_rss:
        lines += ["", "tritonserver's RSS (MiB) as the requests finished (every tenth): "
                  + ", ".join(f"{n}: {rss:.0f}" for n, rss in r.triton_rss) + "."]
    for o in r.unexpected[:10]:
        when = f" (from {o.start - r.killed_at:+.1f} to {o.end - r.killed_at:+.1f} s of the kill)" if r.killed_at else ""
        lines.append(f"\nunexpected: {o.mode} {o.case} over {o.path}{when}: {o.error}")
    for line in r.disagreements + r.final_check:
        lines.append(f"\n{line}")
    if r.held_after:
        lines.append(f"\nstill held: {json.dumps(r.held_after)}")
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    text = path.read_text() if path.exists() else ""
    block = "\n".join([SECTION, *lines, END])
    if SECTION in text and END in text:
        text = text[: text.index(SECTION)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Soak (`make soak`)\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m support.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the LLaVA demo model)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel", type=float, default=0.1, help="share of requests the client cancels midway")
    p.add_argument("--kill", default="decode", help="stage whose worker is killed during the run ('none': no kill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, help="write the table into this markdown file (section `soak`)")
    p.add_argument("--no-endings", action="store_true",
                   help="stop the server as usual after the run (default: end it with SIGTERM under load, then start "
                        "another and kill its Triton under load)")
    p.add_argument("serve_args", nargs="*", help="more `trident serve` arguments, after --")
    args = p.parse_args(argv)
    from trident.dev.demo import default_demo_model

    model = args.model or str(default_demo_model("llava"))
    workspace = Path(tempfile.mkdtemp(prefix="trident-soak-"))
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"[soak] starting trident serve (every mode) on {model}")
    server = Server(model, workspace / "ws", modes=list(MODES), extra=args.serve_args)
    endings: list[Ending] = []
    try:
        server.wait_ready()
        report = asyncio.run(soak(server, requests=args.requests, concurrency=args.concurrency, cancel=args.cancel,
                                  kill=None if args.kill == "none" else args.kill, seed=args.seed, say=say))
        if not args.no_endings:
            cases = make_cases(model)
            endings.append(asyncio.run(end_under_load(server, "SIGTERM", cases, say=say)))
            say("[soak] starting another server, to kill its Triton under load")
            server = Server(model, workspace / "ws2", modes=list(MODES), extra=args.serve_args)
            server.wait_ready()
            endings.append(asyncio.run(end_under_load(server, "Triton killed", cases, say=say)))
    finally:
        code = server.stop()  # (its exit code, where it has ended already)
        shutil.rmtree(workspace, ignore_errors=True)
    lines = table(report)
    wrong = [line for e in endings for line in e.wrong(report.reference)]
    if endings:
        lines += ["", "Then the server's end with streams in flight (`Ending` in `tests/support/soak.py`): SIGTERM to "
                  "`trident serve` (a drain), and on a second server SIGKILL to Triton.", "",
                  *ending_table(endings, report.reference)]
    elif code != 0:
        say(f"[soak] trident serve exited with {code}")
    print("\n".join(lines))
    if args.report:
        write_section(args.report, lines)
    return 0 if report.passed and not wrong and (endings or code == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
