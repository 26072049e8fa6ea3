#!/usr/bin/env python3
"""What the lease stamp costs a transfer: TransferReceiver.fetch (the data READ, then the 16-byte stamp READ
that carries the release notification) against one READ carrying the notification, alternating in one
consumer process, from a producer process. Prints a markdown table, the one in docs/benchmarks.md's section
`bench-engine`.

    .venv/bin/python clients/perf/bench_stamp.py
"""
import multiprocessing as mp
import statistics
import time

import msgspec
import torch

from trident.core.config import MiB, TransferConfig
from trident.core.protocol import Transfer
from trident.core.transfer import TransferEndpoint
from trident.core.transfer import Received

CONFIG = TransferConfig(send_pool_bytes=64 * MiB, recv_pool_bytes=64 * MiB, poll_interval_s=0.002)

def producer(conn, nbytes):
    ep = TransferEndpoint(CONFIG)
    t = [torch.zeros(nbytes // 4)]
    while True:
        cmd = conn.recv()
        if cmd == "exit":
            ep.close(); return
        conn.send(msgspec.msgpack.encode(ep.publish(t)))

def one_read(rx, record):
    """A fetch without the stamp: one READ, the notification with it."""
    region = rx.pool.alloc(record.nbytes)
    rx.agent.read(record.agent, record.agent_meta, list(record.regions), rx.pool.address_of(region),
                  record.lease_id.encode(), rx.config.read_timeout_s)
    return Received(rx.pool, region, record)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ep = TransferEndpoint(CONFIG)
    rows = []
    for nbytes in (64 * 1024, 1 * MiB, 16 * MiB):
        a, b = ctx.Pipe(); p = ctx.Process(target=producer, args=(b, nbytes)); p.start()
        times = {"one READ": [], "READ + stamp READ": []}
        for i in range(400):
            a.send("pub"); rec = msgspec.msgpack.decode(a.recv(), type=Transfer)
            name = list(times)[i % 2]
            t0 = time.perf_counter()
            got = one_read(ep.receiver, rec) if i % 2 == 0 else ep.receiver.fetch(rec)
            times[name].append((time.perf_counter() - t0) * 1e6)
            got.release()
            time.sleep(0.003)
        a.send("exit"); p.join()
        med = {k: statistics.median(v[20:]) for k, v in times.items()}
        rows.append((nbytes, med))
    print("| record | one READ µs | READ + stamp READ µs | added |")
    print("|---|---|---|---|")
    for nbytes, med in rows:
        b, n = med["one READ"], med["READ + stamp READ"]
        print(f"| {nbytes // 1024} KiB | {b:.0f} | {n:.0f} | +{n - b:.0f} µs ({n / b:.2f}x) |")
    ep.close()
