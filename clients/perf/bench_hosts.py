#!/usr/bin/env python3
"""Stages on hosts of their own against all stages on one host, and NIXL/UCX over TCP between two hosts against a
plain TCP socket copy of the same bytes between the same two hosts, side by side in one run.

Hosts are Linux namespaces on this machine (tests/support/hosts.py: own network on a bridge, own PID and mount
namespaces with a private /tmp and /dev/shm; needs root): nothing crosses between them but TCP.

- Serving, per mode (E/P/D, EP/D): a one-host server (`trident serve --mode X`, its workers beside Triton: Unix
  stage sockets, UCX's shared memory) and a head with no worker (`--instances STAGE=0 ...`) whose stages join
  from a host each (`trident worker STAGE --join URL`, UCX_TLS=tcp), in rounds alternating between the two: the
  same requests both ways, a new 224 px image each, greedy, ``--max-tokens`` new tokens; tokens/s at concurrency
  8 and TTFT p50 at concurrency 1. Both on the same 2 cores: what differs is the wire.
- Transfers: a producer on one host publishes a tensor (trident.core.transfer, UCX over TCP), a consumer on another
  READs it (``fetch``); the same bytes sent over a plain TCP socket between the same hosts (``sendall`` into
  ``recv_into``). Medians per size.

    make bench-hosts [BASE=<commit>]        (as root; BASE: the same on hosts with that commit's trident too)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests")]

MiB = 1 << 20
SIZES = [(MiB, "1 MiB", 30), (4 * MiB, "4 MiB", 20), (16 * MiB, "16 MiB", 10), (64 * MiB, "64 MiB", 5)]
STAGES_OF = {"e_p_d": ["encode", "prefill", "decode"], "ep_d": ["encode_prefill", "decode"]}
TRANSFER_PORT, PLAIN_PORT = 7100, 7101


# -- transfers: the two ends, each run on its host by this script -----------------------------------------------
def _send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def _recv_msg(sock: socket.socket):
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return pickle.loads(_recv_exact(sock, n))


def producer(address: str, read_window: bool) -> None:
    """Publishes a tensor of each size asked for (its record back over a TCP control socket), and sends the
    same number of bytes over a plain socket to whoever connects to the plain port."""
    import threading

    import torch

    from trident.core.config import TransferConfig
    from trident.core.transfer import TransferEndpoint, data_plane, endpoint

    data_plane.bind(address)  # (as a worker does: UCX on the interface holding its data address)
    biggest = max(s for s, _, _ in SIZES)
    if not read_window:
        endpoint.READ_WINDOW_S = 0.0
    ep = TransferEndpoint(TransferConfig(send_pool_bytes=2 * biggest + MiB, recv_pool_bytes=MiB,
                                         data_address=address))
    tensors = {size: torch.randint(0, 255, (size,), dtype=torch.uint8) for size, _, _ in SIZES}
    payload = bytes(biggest)

    def plain() -> None:
        srv = socket.create_server((address, PLAIN_PORT))
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while head := conn.recv(8):
                    (n,) = struct.unpack("!Q", head)
                    conn.sendall(memoryview(payload)[:n])

    threading.Thread(target=plain, daemon=True).start()
    srv = socket.create_server((address, TRANSFER_PORT))
    print("ready", flush=True)
    conn, _ = srv.accept()
    while True:
        size = _recv_msg(conn)
        if size is None:
            break
        _send_msg(conn, ep.publish([tensors[size]]))
    ep.close()


def consumer(address: str, peer: str) -> None:
    """Prints one JSON line: per size, the median seconds of a READ and of a plain socket copy."""
    import numpy as np

    from trident.core.config import TransferConfig
    from trident.core.transfer import TransferEndpoint, data_plane

    data_plane.bind(address)
    biggest = max(s for s, _, _ in SIZES)
    ep = TransferEndpoint(TransferConfig(send_pool_bytes=MiB, recv_pool_bytes=2 * biggest + MiB,
                                         data_address=address))
    control = socket.create_connection((peer, TRANSFER_PORT), timeout=60)
    plain = socket.create_connection((peer, PLAIN_PORT), timeout=60)
    plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = np.empty(biggest, dtype=np.uint8)
    rows = {}
    for size, label, n in SIZES:
        reads, copies = [], []
        for i in range(n + 1):
            _send_msg(control, size)
            record = _recv_msg(control)
            t0 = time.perf_counter()
            received = ep.fetch(record)
            dt = time.perf_counter() - t0
            received.release()
            t0 = time.perf_counter()
            plain.sendall(struct.pack("!Q", size))
            view, got = memoryview(sink)[:size], 0
            while got < size:
                got += plain.recv_into(view[got:])
            dc = time.perf_counter() - t0
            if i:  # (the first of a size warms the connection and the pages)
                reads.append(dt)
                copies.append(dc)
        rows[label] = {"bytes": size, "read_s": statistics.median(reads), "plain_s": statistics.median(copies), "n": n}
    _send_msg(control, None)
    ep.close()
    print(json.dumps(rows), flush=True)


# (what differs from Trident's defaults, whether the producer polls fast just after a lease opens, the environment of
# both ends)
VARIANTS = [("Trident's defaults", True, {}),
            ("no fast polling after a lease opens (every 5 ms)", False, {}),
            ("UCX's own TCP segments (8 KiB out, 64 KiB in)", True, {"UCX_TCP_TX_SEG_SIZE": "8k",
                                                                   "UCX_TCP_RX_SEG_SIZE": "64k"})]


def bench_transfers(hosts, env, read_window: bool) -> dict:
    a, b = hosts["h1"], hosts["h2"]
    here = [sys.executable, str(Path(__file__).resolve())]
    prod = a.popen([*here, "--producer", a.address, *([] if read_window else ["--no-read-window"])], env=env,
                   stdout=subprocess.PIPE, text=True)
    try:
        while (line := prod.stdout.readline()) and line.strip() != "ready":  # (past any log line)
            pass
        assert line, "the producer did not start"
        done = b.popen([*here, "--consumer", b.address, "--peer", a.address], env=env, stdout=subprocess.PIPE,
                       text=True)
        out, _ = done.communicate(timeout=600)
        assert done.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])
    finally:
        prod.kill()
        prod.wait(10)


# -- serving ---------------------------------------------------------------------------------------------------
async def _rounds(servers: dict, mode: str, text: str, args, seed: int) -> list[dict]:
    import tritonclient.grpc.aio as grpcclient

    from bench_openai import grpc_stream
    from bench_scheduler import image_b64
    from bench_split import load

    clients = {way: grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc}") for way, srv in servers.items()}
    rows = []
    try:
        for way, client in clients.items():  # warm each (connections, lazy set-up) with an image of no round
            await grpc_stream(client, mode, text, [image_b64(seed)], args.max_tokens)
        for r in range(args.rounds):
            row = {}
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for k, way in enumerate(order):
                base = seed + 1 + (r * len(clients) + k) * (args.requests + 4)
                one = lambda im, c=clients[way]: grpc_stream(c, mode, text, [im], args.max_tokens)  # noqa: E731
                busy = await load(one, [image_b64(base + i) for i in range(args.requests)], args.concurrency)
                alone = await load(one, [image_b64(base + args.requests + i) for i in range(4)], 1)
                if busy["tokens"] != args.requests * args.max_tokens:
                    raise RuntimeError(f"{mode} {way}: {busy['tokens']} tokens")
                row[way] = {"tok_s": busy["tok_s"], "ttft_ms": alone["ttft_p50"]}
            print(f"[bench-hosts] {mode} round {r}: " + ", ".join(
                f"{w} {row[w]['tok_s']:.1f} tok/s, TTFT {row[w]['ttft_ms']:.0f} ms" for w in clients), flush=True)
            rows.append(row)
    finally:
        for client in clients.values():
            await client.close()
    return rows


def _on_hosts(hosts, env, model: str, mode: str, python: str | None, copies: tuple[str, ...], workers: list):
    """A head with no worker of its own whose stages of ``mode`` join from a host each, all run by ``python`` (None:
    this one; else a base commit's venv, which the hosts see at the same path: ``copies``); the head's Serve."""
    from bench_scheduler import Serve

    from trees import env_of
    from trident.core.netutil import free_ports

    ports = free_ports(4)
    url = f"http://{hosts.head_address}:{ports[0]}"
    for i, stage in enumerate(STAGES_OF[mode]):  # (each waits for the head, then joins it)
        host = hosts[f"h{i + 1}"]
        workers.append(host.popen([python or sys.executable, "-m", "trident.cli", "worker", stage, "--model", model,
                                   "--join", url],
                                  env=dict(env, TRIDENT_ACCESS_TOKEN=Serve.TOKEN, PATH=(env_of(python) or env)["PATH"]),
                                  copies=copies, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    zeros = [f"{stage}=0" for stage in STAGES_OF[mode]]
    return Serve(model, ["--host", "0.0.0.0", "--instances", *zeros], modes=(mode,), ports=ports, python=python)


def bench_serving(hosts, env, model: str, text: str, args, base: tuple[str, Path] | None) -> dict:
    """Per mode, rounds over the one-host server, the head with its stages on hosts, and (``base``: a base commit's
    python and its folder) the same on hosts run by the base commit's trident."""
    from bench_scheduler import Serve

    results = {}
    for k, mode in enumerate(args.modes):
        servers, workers = {}, []
        try:
            servers["one host"] = Serve(model, [], modes=(mode,))
            servers["hosts"] = _on_hosts(hosts, env, model, mode, None, (), workers)
            if base is not None:
                servers["hosts, base"] = _on_hosts(hosts, env, model, mode, base[0], (str(base[1]),), workers)
            results[mode] = asyncio.run(_rounds(servers, mode, text, args, seed=90_000 + 10_000 * k))
        finally:
            for srv in servers.values():
                srv.stop()
            for proc in workers:
                if proc.poll() is None:
                    os.killpg(proc.pid, 15)
                    proc.wait(30)
    return results


def table(serving: dict, transfers: dict, args) -> list[str]:
    from trees import short

    lines = [
        "## Stages on hosts of their own (`make bench-hosts`)", "",
        "`clients/perf/bench_hosts.py`, as root: hosts are Linux namespaces on this machine (own network on a "
        "bridge, own PID and mount namespaces, private /tmp and /dev/shm: nothing crosses but TCP). Per mode, a "
        "one-host server (workers beside Triton: Unix stage sockets, UCX shared memory) and a head with no worker "
        "whose stages join from a host each (`trident worker STAGE --join`, UCX_TLS=tcp), in rounds alternating "
        f"between the two, the same 2 cores under both: {args.requests} requests at concurrency {args.concurrency} "
        f"(tokens/s) and 4 at concurrency 1 (TTFT p50), a new 224 px image each, {args.max_tokens} new tokens, "
        f"greedy; medians of {args.rounds} rounds. LLaVA demo, hf engine."
        + (f" With `--base {args.base}` ({short(args.base)}), a third server in the same rounds: that commit's "
           "head and stage workers on the same hosts, on today's packages (`clients/perf/trees.py`); "
           "hosts new / base is its ratio to today's." if args.base else ""), "",
        "| mode | one host tok/s | hosts tok/s | hosts / one host | target | one host TTFT ms | hosts TTFT ms |"
        + (" base on hosts tok/s | hosts new / base | base TTFT ms |" if args.base else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if args.base else ""),
    ]
    med = statistics.median
    for mode, rounds in serving.items():
        one = med(r["one host"]["tok_s"] for r in rounds)
        many = med(r["hosts"]["tok_s"] for r in rounds)
        ratio = med(r["hosts"]["tok_s"] / r["one host"]["tok_s"] for r in rounds)
        row = (f"| {mode} | {one:.1f} | {many:.1f} | **{ratio:.2f}** | >= 0.9 | "
               f"{med(r['one host']['ttft_ms'] for r in rounds):.0f} | {med(r['hosts']['ttft_ms'] for r in rounds):.0f} |")
        if args.base:
            spread = [r["hosts"]["tok_s"] / r["hosts, base"]["tok_s"] for r in rounds]
            row += (f" {med(r['hosts, base']['tok_s'] for r in rounds):.1f} | **{med(spread):.2f}** "
                    f"({min(spread):.2f}-{max(spread):.2f}) | {med(r['hosts, base']['ttft_ms'] for r in rounds):.0f} |")
        lines.append(row)
    lines += [
        "", "Between two hosts: a NIXL READ (`TransferEndpoint.fetch`, UCX over TCP) of a tensor another host "
        "published, against the same bytes sent over a plain TCP socket between the same hosts (`sendall` into "
        "`recv_into`, TCP_NODELAY); medians. With Trident's defaults, and with one thing changed: over TCP a READ "
        "is not one-sided, the producer's UCX worker must progress to serve it, and a Trident producer progresses "
        "it as it polls for release notifications: every 0.5 ms for 0.25 s after it opens a lease when other hosts "
        "can reach it, else every `transfer.poll_interval_s` (5 ms; `core/transfer/endpoint.py`, `READ_POLL_S`; NIXL's "
        "own progress thread spins a core); and UCX's own TCP segment sizes, which Trident raises to 256 KiB "
        "(`core/transfer/data_plane.py`).", "",
        "| size | with | READ ms | READ GB/s | plain socket ms | plain GB/s | READ / plain bandwidth | target | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for what, rows in transfers.items():
        for label, row in rows.items():
            lines.append(f"| {label} | {what} | {row['read_s'] * 1e3:.2f} | {row['bytes'] / row['read_s'] / 1e9:.2f} "
                         f"| {row['plain_s'] * 1e3:.2f} | {row['bytes'] / row['plain_s'] / 1e9:.2f} | "
                         f"**{row['plain_s'] / row['read_s']:.2f}** | >= 0.8 | {row['n']} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producer", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--consumer", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--no-read-window", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transfers-only", action="store_true", help="measure the transfers only")
    ap.add_argument("--modes", nargs="+", default=list(STAGES_OF), choices=list(STAGES_OF))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests per round at concurrency (default: 16)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--report", type=Path, help="markdown file to put the table into")
    ap.add_argument("--base", metavar="COMMIT", help="also serve on the hosts with this commit's trident (its tree "
                    "on today's packages), in the same rounds: hosts new / base")
    args = ap.parse_args()
    if args.producer:
        producer(args.producer, not args.no_read_window)
        return 0
    if args.consumer:
        consumer(args.consumer, args.peer)
        return 0

    from support.hosts import Hosts, unavailable

    if why := unavailable():
        raise SystemExit(f"bench-hosts: no hosts can be made here: {why}")
    from bench_scheduler import demo_with_image_prompt
    from report import write_section
    from trees import base_python

    model, text = demo_with_image_prompt("llava")
    # UCX_TLS: the hosts are one machine, which UCX would take for one host (shared memory, cma) unless told
    env = dict(os.environ, HF_HUB_OFFLINE="1", UCX_TLS="tcp", NIXL_LOG_LEVEL="WARN",
               PYTHONPATH=os.pathsep.join(sys.path[:2]))
    with tempfile.TemporaryDirectory(prefix="bench-hosts-base-") as work, Hosts(["h1", "h2", "h3"]) as hosts:
        base = (base_python(args.base, Path(work)), Path(work)) if args.base and not args.transfers_only else None
        transfers = {what: bench_transfers(hosts, dict(env, **more), window) for what, window, more in VARIANTS}
        serving = {} if args.transfers_only else bench_serving(hosts, env, model, text, args, base)
    lines = table(serving, transfers, args)
    print("\n".join(lines))
    if args.report:
        write_section(args.report, "bench-hosts", lines, before="bench-engine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
