"""Benchmarks that print a table: NIXL transfer vs memcpy, and batched decode throughput.

``trident bench transfer``: a producer process publishes a tensor, this process READs it; the READ's
bandwidth and latency are set beside a plain in-process memcpy of the same size.
``trident bench decode``: the hf engine decodes N concurrent requests; output tokens/s beside one
request decoded alone.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from trident.core.config import MiB, TransferConfig

SIZES = [(64 * 1024, "64 KiB", 300), (MiB, "1 MiB", 100), (16 * MiB, "16 MiB", 20), (256 * MiB, "256 MiB", 5)]


def _transfer_producer(conn, pool_bytes: int) -> None:
    from trident.core.transfer import TransferEndpoint

    ep = TransferEndpoint(TransferConfig(send_pool_bytes=pool_bytes, recv_pool_bytes=MiB))
    tensors: dict[int, torch.Tensor] = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            ep.close()
            return
        nbytes = msg
        if nbytes not in tensors:
            tensors[nbytes] = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        conn.send(ep.publish([tensors[nbytes]]))  # the Transfer (pickled over the pipe)


def run_transfer_bench(repeat_scale: float = 1.0, out=print) -> list[dict]:
    """READ latency/bandwidth between two processes against memcpy, per size; prints a table."""
    from trident.core.transfer import TransferEndpoint

    biggest = max(s for s, _, _ in SIZES)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_transfer_producer, args=(child, 2 * biggest + MiB), daemon=True)
    proc.start()
    rows = []
    try:
        assert conn.poll(60) and conn.recv() == "ready", "producer did not start"
        ep = TransferEndpoint(TransferConfig(send_pool_bytes=MiB, recv_pool_bytes=2 * biggest + MiB))
        for nbytes, label, n in SIZES:
            n = max(3, int(n * repeat_scale))
            times = []
            for i in range(n + 1):
                conn.send(nbytes)
                record = conn.recv()
                t0 = time.perf_counter()
                received = ep.fetch(record)
                dt = time.perf_counter() - t0
                received.release()
                if i:  # the first READ of a size warms up pages and connection
                    times.append(dt)
            # A plain single-threaded memcpy (numpy's copyto), same buffers each time like the READs.
            src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            dst = np.empty_like(src)
            np.copyto(dst, src)
            copies = []
            for _ in range(n):
                t0 = time.perf_counter()
                np.copyto(dst, src)
                copies.append(time.perf_counter() - t0)
            t_read, t_copy = statistics.median(times), statistics.median(copies)
            rows.append(
                {
                    "size": label,
                    "read_us": t_read * 1e6,
                    "read_gbps": nbytes / t_read / 1e9,
                    "memcpy_us": t_copy * 1e6,
                    "memcpy_gbps": nbytes / t_copy / 1e9,
                    "ratio": t_copy / t_read,
                    "n": n,
                }
            )
        fixed = _fixed_cost(ep, conn)
        ep.close()
    finally:
        conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    out("NIXL READ between two processes (UCX, DRAM; fetch() as a consumer calls it) vs single-threaded memcpy; medians")
    out(f"{'size':>8} | {'READ us':>9} | {'READ GB/s':>9} | {'memcpy us':>9} | {'memcpy GB/s':>11} | {'READ/memcpy bw':>14} | {'n':>4}")
    for r in rows:
        out(
            f"{r['size']:>8} | {r['read_us']:>9.1f} | {r['read_gbps']:>9.2f} | {r['memcpy_us']:>9.1f} | "
            f"{r['memcpy_gbps']:>11.2f} | {r['ratio']:>14.2f} | {r['n']:>4}"
        )
    out("")
    out("Fixed cost of a small READ on a reused connection (64 bytes, medians of %d), each right after a new "
        "record arrived:" % fixed["n"])
    out(f"  NIXL alone, one READ + notify:                            {fixed['read_notify_us']:7.1f} us")
    out(f"  fetch(): data READ, then the stamp READ with notify:      {fixed['fetch_us']:7.1f} us")
    out(f"  (NIXL alone, READ + notify repeated back to back, warm:   {fixed['hot_read_us']:7.1f} us)")
    rows.append({"size": "fixed", **fixed})
    return rows


def _fixed_cost(ep, conn, n: int = 500) -> dict:
    """The fixed cost of a READ of 64 bytes on a reused connection, each timed as a consumer meets it: right after
    a new record has arrived (over a pipe from the producer, which has just published it). ``read_notify_us``:
    NIXL alone, one READ of the record's regions with the release notification; ``fetch_us``: Trident's
    :meth:`fetch` (claim, two READs: the data, then the lease's stamp with the notification; the stamp check;
    the tensor views). ``hot_read_us``: NIXL's READ + notify repeated back to back on one record, for scale."""
    region = ep.receiver.pool.alloc(64)
    local = ep.receiver.pool.address_of(region)
    raw, hot, fetches = [], [], []
    for i in range(n + 10):
        conn.send(64)
        record = conn.recv()
        t0 = time.perf_counter()
        ep.agent.read(record.agent, record.agent_meta, list(record.regions), local, record.lease_id.encode(), 5.0)
        if i >= 10:
            raw.append(time.perf_counter() - t0)
    conn.send(64)
    record = conn.recv()  # a lease left open: the producer polls for notifications only while one is
    for i in range(n + 10):
        t0 = time.perf_counter()
        ep.agent.read(record.agent, record.agent_meta, list(record.regions), local, b"bench", 5.0)
        if i >= 10:
            hot.append(time.perf_counter() - t0)
    ep.receiver.pool.free(region)
    ep.fetch(record).release()
    for i in range(n + 10):
        conn.send(64)
        record = conn.recv()
        t0 = time.perf_counter()
        received = ep.fetch(record)
        dt = time.perf_counter() - t0
        received.release()
        if i >= 10:
            fetches.append(dt)
    return {"n": n, "read_notify_us": statistics.median(raw) * 1e6, "fetch_us": statistics.median(fetches) * 1e6,
            "hot_read_us": statistics.median(hot) * 1e6}


def run_decode_bench(model_path: str, concurrency=(1, 4, 8, 16), new_tokens: int = 64, out=print) -> list[dict]:
    """Output tokens/s of the hf engine's batched decode at each concurrency; prints a table."""
    from trident.worker.engines.base import DecodeRequest
    from trident.worker.engines.hf.decoder import HFDecoder
    from trident.worker.engines.hf.stage import HFModel, HFPrefiller
    from trident.core.processor import SamplingParams

    model = HFModel(model_path)
    prefiller, decoder = HFPrefiller(model), HFDecoder(model)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tok = model.processor.tokenizer
    base = "Tell me about the weather, the sea, the mountains and the city. "

    def requests(n: int) -> list[DecodeRequest]:
        reqs = []
        for i in range(n):
            text = tok.apply_chat_template(
                [{"role": "user", "content": base * (1 + i % 4)}], tokenize=False, add_generation_prompt=True
            )
            res = prefiller.prefill(model.processor.prompt_ids(text, []), None, params, seed=i)
            reqs.append(DecodeRequest(kv=res.kv, first_token=res.first_token, prompt_len=res.prompt_len, params=params))
        return reqs

    def run(reqs: list[DecodeRequest]) -> float:
        t0 = time.perf_counter()
        streams = [decoder.submit(r) for r in reqs]
        tokens = sum(sum(len(e.token_ids) for e in s) for s in streams)
        assert tokens == len(reqs) * new_tokens
        return tokens / (time.perf_counter() - t0)

    run(requests(1))  # warm-up
    rows = []
    alone = None
    for c in concurrency:
        tps = statistics.median(run(requests(c)) for _ in range(2))
        alone = alone if alone is not None else (tps if c == 1 else run(requests(1)))
        rows.append({"concurrency": c, "tokens_per_s": tps, "per_request": tps / c, "ratio": tps / alone})
    decoder.close()
    out(f"hf batched decode, {model.family.name} demo model, {new_tokens} new tokens per request, {torch.get_num_threads()} threads")
    out(f"{'concurrent':>10} | {'tokens/s':>9} | {'per request':>11} | {'vs alone':>8}")
    for r in rows:
        out(f"{r['concurrency']:>10} | {r['tokens_per_s']:>9.1f} | {r['per_request']:>11.1f} | {r['ratio']:>7.2f}x")
    return rows
