"""What one stage call's hand-offs cost with no model behind them: the scheduler's call
(:class:`trident.core.stagecall.StageClient`) to a worker's :class:`~trident.core.stagecall.StageServer` whose stage answers
at once, over its Unix socket, against a bare Unix-socket ping-pong, each between two processes, one call at a time.

Each side stamps its steps on the host's monotonic clock; the table gives the median of each step in us over
``--calls`` calls (2 ms apart, as at concurrency 1, where the processes sleep between a request's hops):

- scheduler: the call's message made (a :class:`~trident.core.protocol.Call`, msgpack), the socket write;
- worker: the message read and decoded on its event loop, its task started, the stage function called, its
  answer written;
- scheduler: the answer read by the connection's reader thread, handed to the event loop, the call's
  coroutine resumed with the outputs.

    make bench-hops                 (after the TTFT breakdown; the table goes into docs/benchmarks.md, section
                                     `bench-direct-call`)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from report import write_section

STEPS = [
    ("call", "sent", "scheduler: message made, socket written"),
    ("sent", "read", "-> worker: message read and decoded on its event loop"),
    ("read", "handle", "worker: the call's task started"),
    ("handle", "infer", "worker: stage function called"),
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
ANSWER = {"kv_meta": np.array([b"k" * 1200], dtype=np.object_)}


def _worker(folder: str, conn, tcp: bool) -> None:
    """A stage worker's :class:`~trident.core.stagecall.StageServer` serving a stage that answers at once, with its
    steps stamped; the stamps go back over ``conn`` when asked."""
    from trident.core.stagecall import StageServer, directory
    from trident.core.stagecall import server as serving

    now, marks = time.monotonic_ns, []
    handle, write, read = StageServer._handle, StageServer._write, serving.read_message

    async def stamped_read(*args):
        message = await read(*args)
        marks.append(("read", now()))
        return message

    async def stamped_handle(self, writer, call):
        marks.append(("handle", now()))
        return await handle(self, writer, call)

    async def stamped_write(self, *args):
        marks.append(("write", now()))
        return await write(self, *args)

    async def stage(call):
        marks.append(("infer", now()))
        return ANSWER

    serving.read_message = stamped_read
    StageServer._handle = stamped_handle
    StageServer._write = stamped_write
    server = StageServer(stage, lambda message: None, "127.0.0.1")
    server.start()
    directory.create(Path(folder))
    # over TCP: the worker file a worker on another host uploads (no Unix socket in it)
    directory.enter("prefill", server.worker_file(None if tcp else 0, "prefill"))
    conn.send("ready")
    conn.recv()
    conn.send(marks)
    server.stop(drain_s=1)
    shutil.rmtree(Path(server.path).parent, ignore_errors=True)  # (a multiprocessing child skips its atexit)


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


def direct_calls(calls: int, tcp: bool = False) -> tuple[dict[str, float], float]:
    """Per step, the median in us; and the median round trip (over the worker's Unix socket, or its TCP one)."""
    from trident.core.stagecall import StageClient, directory
    from trident.core.stagecall import client as direct

    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="bench-direct-")
    directory.create(Path(folder))
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(folder, child, tcp), daemon=True)
    worker.start()
    assert conn.poll(120) and conn.recv() == "ready", "the worker channel did not start"
    now, marks = time.monotonic_ns, []
    recv, settle, send = direct.recv_message, direct._settle, direct._Connection.send

    def stamped_recv(*args):
        message = recv(*args)
        marks.append(("recv", now()))
        return message

    def stamped_settle(*args, **kwargs):
        marks.append(("settle", now()))
        return settle(*args, **kwargs)

    def stamped_send(self, *args):
        send(self, *args)
        marks.append(("sent", now()))

    direct.recv_message, direct._settle, direct._Connection.send = stamped_recv, stamped_settle, stamped_send

    async def run() -> list[dict[str, int]]:
        calls_ = StageClient()
        for _ in range(200):  # until the socket listens
            if await calls_.call("prefill", INPUTS, ["kv_meta"]) is not None:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError("the stage server did not answer")
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

    import os

    from trident.core import auth

    os.environ.setdefault(auth.ENV, auth.new_secret())  # both processes are of one deployment
    steps, total = direct_calls(args.calls)
    _, over_tcp = direct_calls(args.calls, tcp=True)
    bare = statistics.median(_ping_pong(args.calls))
    lines = ["## One stage call with no model behind it (`make bench-hops`)", "",
             f"`clients/perf/bench_direct_call.py`: {args.calls:,} calls one at a time, 2 ms apart, between two "
             "processes: a prefill call's inputs (a prompt, a 1.2 KB record, sampling parameters) to a stage that "
             "answers a 1.2 KB record at once. The median of each step in µs, from both sides' stamps on one clock.",
             "", "| step | p50 us |", "|---|---|"]
    lines += [f"| {label} | {value:.1f} |" for label, value in steps.items()]
    lines += [f"| **direct call, round trip** | **{total:.1f}** |",
              f"| the same call over the worker's TCP stage socket (loopback), round trip | {over_tcp:.1f} |",
              f"| bare Unix socket, 64 bytes there and back (two processes) | {bare:.1f} |", "",
              f"Each step takes {min(steps.values()):.0f}-{max(steps.values()):.0f} µs of Python that runs cold after "
              "the process slept. Calls that come through Triton go from the stage's python-backend stub to the same "
              "stage server, over the same socket and messages."]
    print("\n".join(lines))
    if args.report:
        write_section(args.report, "bench-direct-call", lines, before="bench-scheduler")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
