"""What one stage call's hand-offs cost with no model behind them: the scheduler's direct call
(:mod:`trident.stagecall`) to a worker channel (:class:`trident.workers.channel.WorkerChannel`) whose stage
answers at once, against a bare Unix-socket ping-pong, each between two processes, one call at a time.

Each side stamps its steps on the host's monotonic clock; the table gives the median of each step in us over
``--calls`` calls (2 ms apart, as at concurrency 1, where the processes sleep between a request's hops):

- scheduler: the call's message made (``Request`` + msgpack), the socket write;
- worker: the message read on its event loop, its task started, the stage function called (message decoded,
  PyTriton's adapter), its answer written;
- scheduler: the answer read by the connection's reader thread, handed to the event loop, the call's
  coroutine resumed with the outputs.

    make bench-hops                 (after the TTFT breakdown; the table goes into docs/benchmarks.md, section
                                     `bench-direct-call`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from report import write_section

STEPS = [
    ("call", "sent", "scheduler: message made, socket written"),
    ("sent", "read", "-> worker: message read on its event loop"),
    ("read", "handle", "worker: the call's task started"),
    ("handle", "infer", "worker: message decoded, stage function called"),
    ("infer", "write", "worker: answer made, written"),
    ("write", "recv", "-> scheduler: answer read by the reader thread"),
    ("recv", "settle", "scheduler: answer handed to the event loop"),
    ("settle", "done", "scheduler: the call resumed, outputs decoded"),
]
INPUTS = {  # a prefill call's inputs: a prompt, its embeddings record, sampling parameters
    "text_input": np.array([b"USER: <image>\nWhat is in the picture? ASSISTANT:"], dtype=np.object_),
    "embedding_meta": np.array([b"r" * 1200], dtype=np.object_),
    "sampling_parameters": np.array([b'{"max_tokens": 4, "temperature": 0}'], dtype=np.object_),
}
ANSWER = [{"kv_meta": np.array([b"k" * 1200], dtype=np.object_)}]


class _Validator:
    def validate_responses(self, requests, responses) -> None:
        pass


def _worker(folder: str, conn) -> None:
    """A stage worker's channel serving a stage that answers at once, with its steps stamped; the stamps go back
    over ``conn`` when asked."""
    from trident.protocol import WORKER_FILE
    from trident.workers import channel
    from trident.workers.wire import InlineSerializer

    now, marks = time.monotonic_ns, []
    stub = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the python-backend stub's end: connected, idle
    url = f"ipc://{folder}/stage-server.sock"
    stub.bind(channel.socket_path(url))
    stub.listen(1)
    held = []  # the accepted end stays open: the worker stops when its stub's connection closes
    threading.Thread(target=lambda: held.append(stub.accept()), daemon=True).start()

    handle, write = channel.WorkerChannel._handle, channel.WorkerChannel._write
    reads = asyncio.StreamReader.readexactly

    async def readexactly(self, n):
        data = await reads(self, n)
        if n != channel.HEADER.size:
            marks.append(("read", now()))
        return data

    async def stamped_handle(self, writer, rid, payload):
        marks.append(("handle", now()))
        return await handle(self, writer, rid, payload)

    async def stamped_write(writer, rid, flags, payload):
        marks.append(("write", now()))
        return await write(writer, rid, flags, payload)

    async def stage(requests):
        marks.append(("infer", now()))
        return ANSWER

    asyncio.StreamReader.readexactly = readexactly
    channel.WorkerChannel._handle = stamped_handle
    channel.WorkerChannel._write = staticmethod(stamped_write)
    path = channel.direct_path()
    store = Path(folder) / "store" / "prefill" / "1"
    store.mkdir(parents=True)
    (store / WORKER_FILE).write_text(json.dumps({"pid": 0, "name": "prefill", "direct": path}))
    chan = channel.WorkerChannel(url, InlineSerializer())
    chan.attach(stage, _Validator(), decoupled=False)
    chan.start()
    conn.send("ready")
    conn.recv()
    conn.send(marks)


def _ping_pong(calls: int) -> list[float]:
    """Round trips of 64 bytes over a socket pair between two processes, in us."""
    a, b = socket.socketpair()

    def echo(sock):
        while data := sock.recv(64):
            sock.sendall(data)

    child = mp.get_context("fork").Process(target=echo, args=(b,), daemon=True)
    child.start()
    out = []
    for _ in range(calls):
        t0 = time.monotonic_ns()
        a.sendall(b"x" * 64)
        a.recv(64)
        out.append((time.monotonic_ns() - t0) / 1e3)
        time.sleep(0.002)
    a.close()
    child.kill()
    return out[50:]


def direct_calls(calls: int) -> tuple[dict[str, float], float]:
    """Per step, the median in us; and the median round trip."""
    from trident.protocol import WORKER_FILE
    from trident import stagecall as direct

    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="bench-direct-")
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(folder, child), daemon=True)
    worker.start()
    assert conn.poll(120) and conn.recv() == "ready", "the worker channel did not start"
    now, marks = time.monotonic_ns, []
    recv, settle, send = direct.recv_exact, direct._settle, direct._Connection._send

    def stamped_recv(sock, n):
        data = recv(sock, n)
        if n != direct.HEADER.size:
            marks.append(("recv", now()))
        return data

    def stamped_settle(*args, **kwargs):
        marks.append(("settle", now()))
        return settle(*args, **kwargs)

    def stamped_send(self, payload, target):
        rid = send(self, payload, target)
        marks.append(("sent", now()))
        return rid

    direct.recv_exact, direct._settle, direct._Connection._send = stamped_recv, stamped_settle, stamped_send

    async def run() -> list[dict[str, int]]:
        calls_ = direct.StageClient(Path(folder) / "store")
        while await calls_.call("prefill", INPUTS, ["kv_meta"]) is None:  # until the socket listens
            await asyncio.sleep(0.05)
        out = []
        for _ in range(calls):
            marks.clear()
            t0 = now()
            await calls_.call("prefill", INPUTS, ["kv_meta"])
            out.append({"call": t0, **dict(marks), "done": now()})
            await asyncio.sleep(0.002)
        calls_.close()
        return out

    try:
        mine = asyncio.run(run())
        conn.send("marks")
        theirs = sorted(conn.recv(), key=lambda m: m[1])
    finally:
        worker.join(10)  # it returns once it sent its stamps (its socket's folder goes at its exit)
        if worker.is_alive():
            worker.kill()
        sock = json.loads((Path(folder) / "store" / "prefill" / "1" / WORKER_FILE).read_text())["direct"]
        shutil.rmtree(Path(sock).parent, ignore_errors=True)  # (a multiprocessing child may skip its atexit)
        shutil.rmtree(folder, ignore_errors=True)
    for call in mine:  # the worker's stamps inside this call's window
        for name, t in theirs:
            if call["call"] <= t <= call["done"]:
                call.setdefault(name, t)
    mine = mine[50:]
    steps = {label: statistics.median((c[b] - c[a]) / 1e3 for c in mine) for a, b, label in STEPS}
    return steps, statistics.median((c["done"] - c["call"]) / 1e3 for c in mine)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="calls per way (default: 1000)")
    ap.add_argument("--report", type=Path, help="markdown file to put the table into (its section)")
    args = ap.parse_args()

    steps, total = direct_calls(args.calls)
    bare = statistics.median(_ping_pong(args.calls))
    lines = ["## One stage call with no model behind it (`make bench-hops`)", "",
             f"`clients/perf/bench_direct_call.py`: {args.calls:,} calls one at a time, 2 ms apart, between two "
             "processes: a prefill call's inputs (a prompt, a 1.2 KB record, sampling parameters) to a stage that "
             "answers a 1.2 KB record at once. The median of each step in µs, from both sides' stamps on one clock.",
             "", "| step | p50 us |", "|---|---|"]
    lines += [f"| {label} | {value:.1f} |" for label, value in steps.items()]
    lines += [f"| **direct call, round trip** | **{total:.1f}** |",
              f"| bare Unix socket, 64 bytes there and back (two processes) | {bare:.1f} |", "",
              f"Each step takes {min(steps.values()):.0f}-{max(steps.values()):.0f} µs of Python that runs cold after "
              "the process slept. Calls that come through Triton go from the stage's python-backend stub to its "
              "worker over Trident's channel (one Unix socket per stage instance, tensors inline as msgpack)."]
    print("\n".join(lines))
    if args.report:
        write_section(args.report, "bench-direct-call", lines, before="bench-scheduler")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
