"""trident.core.transfer: real NIXL READs between two OS processes.

The endpoints' pools are on ``TRIDENT_TEST_DEVICE`` (default cpu: DRAM); ``make gpu-check`` runs this module again
with ``cuda`` (VRAM), where a producer on the CPU is read into a consumer on the GPU too.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch

from trident.core.config import MiB, TransferConfig
from trident.core.errors import LeaseExpired, PeerUnavailable, PoolExhausted, ReplayedRecord
from trident.core.protocol import Transfer
from trident.core.transfer import MemoryPool, TransferEndpoint

from support import child_processes

# (an expired region is freed read_timeout_s + 1 s after its expiry: when no READ of it can still run)
CONFIG = TransferConfig(send_pool_bytes=64 * MiB, recv_pool_bytes=64 * MiB, poll_interval_s=0.002, read_timeout_s=1.0)
DEVICE = os.environ.get("TRIDENT_TEST_DEVICE", "cpu")
MEMORY = "VRAM" if DEVICE.startswith("cuda") else "DRAM"


def _tensors(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(2, 196, 512, generator=g)
    kv = [torch.randn(1, 8, 213, 64, generator=g) for _ in range(2 * 6)]
    return {"embeddings": [emb], "kv": kv}


def _producer(conn, config: TransferConfig, device: str) -> None:
    """Child process: publishes on request and answers with the record, stats on request."""
    ep = TransferEndpoint(config, device=device)
    while True:
        cmd, arg = conn.recv()
        if cmd == "publish":
            layout, lease_s, *seed = arg
            conn.send(msgspec.msgpack.encode(ep.publish(_tensors(seed[0] if seed else 0)[layout], lease_s=lease_s)))
        elif cmd == "cached":  # two items through an embedding cache, the record over them; arg: bytes to change after
            from trident.worker.engines.embedding_cache import EmbeddingCache
            from trident.worker.engines.handoff import publish_cached_embeddings

            cache = EmbeddingCache(ep.sender.pool, 0)
            rows = _tensors(1)["embeddings"][0]
            entries = [cache.store(f"k{i}", rows[i], None) for i in range(2)]
            record = publish_cached_embeddings(ep.sender, cache, entries, ["a", "b"])
            if arg:  # a change on the way: the second item's region, after its digest was taken
                ep.sender.pool.view(entries[1].region)[:arg] += 1
            conn.send(record.encode())
        elif cmd == "stats":
            conn.send(ep.stats())
        elif cmd == "exit":
            ep.close()
            conn.send("bye")
            return


class Producer:
    def __init__(self, config: TransferConfig = CONFIG, device: str = DEVICE) -> None:
        ctx = child_processes()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer, args=(child, config, device), daemon=True)
        self.proc.start()

    def call(self, cmd, arg=None, timeout=60):
        self.conn.send((cmd, arg))
        assert self.conn.poll(timeout), f"producer did not answer {cmd}"
        return self.conn.recv()

    def stats_when(self, pred, timeout=5.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.call("stats")
            if pred(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture(scope="module")
def consumer():
    ep = TransferEndpoint(CONFIG, device=DEVICE)
    yield ep
    ep.close()


def _read(data: bytes) -> Transfer:
    return msgspec.msgpack.decode(data, type=Transfer)


@pytest.fixture
def producer():
    p = Producer()
    yield p
    p.stop()


@pytest.mark.parametrize("layout", ["embeddings", "kv"])
def test_byte_exact_and_pools_return_to_zero(consumer, producer, layout):
    data = producer.call("publish", (layout, None))
    record = _read(data)
    assert len(data) - len(record.agent_meta) < 512  # (the agent's metadata: ~700 bytes, ~1.2 KB with a GPU's pools)
    assert (record.memory, record.device) == (MEMORY, 0)
    assert producer.call("stats")["send_regions_in_use"] == 1
    expected = _tensors(0)[layout]
    before = consumer.stats().get(f"read_bytes_from_{MEMORY}_to_{MEMORY}", 0)
    with consumer.fetch(record) as got:
        assert consumer.stats()["recv_regions_in_use"] == 1
        assert len(got.tensors) == len(expected)
        for a, b in zip(got.tensors, expected):
            assert a.shape == b.shape and a.dtype == b.dtype and a.device.type == DEVICE.split(":")[0]
            assert a.cpu().numpy().tobytes() == b.numpy().tobytes()
        assert sum(t.numel() * 4 for t in got.tensors) == record.nbytes
    assert consumer.stats()["recv_regions_in_use"] == 0
    assert consumer.stats()[f"read_bytes_from_{MEMORY}_to_{MEMORY}"] - before == record.nbytes
    stats = producer.stats_when(lambda s: s["send_regions_in_use"] == 0)
    assert stats["send_regions_in_use"] == 0
    assert stats["released"] == 1 and stats["expired"] == 0


def test_the_transport_to_a_peer_on_this_host_is_told_once(consumer, producer, caplog):
    """Two processes on one host: UCX reads over shared memory or cma, not TCP; the consumer says so once, in a log
    line and in its counters (the stage metrics ``trident_transfer_peers_{tcp,not_tcp}``)."""
    from trident.core.transfer import transport

    before = consumer.stats()
    with caplog.at_level("INFO", logger="trident.core.transfer.agent"):
        for _ in range(2):
            record = _read(producer.call("publish", ("embeddings", None)))
            consumer.fetch(record).release()
    assert consumer.agent.transports[record.agent] == transport.NOT_TCP
    told = [r.getMessage() for r in caplog.records if "go over" in r.getMessage()]
    assert told == [f"READs from NIXL agent {record.agent} go over shared memory or cma on this host (no TCP "
                    f"connection) ({MEMORY} to {MEMORY})"]
    after = consumer.stats()
    assert (after["peers_tcp"] - before["peers_tcp"], after["peers_not_tcp"] - before["peers_not_tcp"]) == (0, 1)


@pytest.mark.skipif(MEMORY == "DRAM", reason="with TRIDENT_TEST_DEVICE=cuda only (make gpu-check): both ends are on "
                    "the CPU here, which every other test of this module covers")
def test_a_producer_on_the_cpu_is_read_into_the_consumer_s_gpu(consumer):
    """Memory types that differ: the producer's DRAM regions are READ into the consumer's own VRAM, byte-exact."""
    producer = Producer(device="cpu")
    try:
        record = _read(producer.call("publish", ("kv", None)))
        assert record.memory == "DRAM"
        with consumer.fetch(record) as got:
            assert all(t.is_cuda for t in got.tensors)
            assert [t.cpu().numpy().tobytes() for t in got.tensors] == [t.numpy().tobytes() for t in _tensors(0)["kv"]]
        assert consumer.stats()["read_bytes_from_DRAM_to_VRAM"] >= record.nbytes
    finally:
        producer.stop()


def test_expired_lease_frees_region_and_is_refused(consumer):
    # (a producer whose expired regions are held 4 s: the refused fetch, its connection set up first, took over the
    # 2 s of CONFIG's on a loaded machine)
    producer = Producer(CONFIG.model_copy(update={"read_timeout_s": 3.0}))
    try:
        data = producer.call("publish", ("embeddings", 0.3))
        assert producer.call("stats")["send_regions_in_use"] == 1
        time.sleep(0.5)
        with pytest.raises(LeaseExpired, match="expired"):
            consumer.fetch(_read(data))
        # not reused while a READ started just before the expiry could still be running
        assert producer.call("stats")["send_regions_in_use"] == 1
        stats = producer.stats_when(lambda s: s["send_regions_in_use"] == 0, timeout=10)
        assert stats["send_regions_in_use"] == 0 and stats["expired"] == 1
        assert consumer.stats()["recv_regions_in_use"] == 0
    finally:
        producer.stop()


def test_a_record_is_read_once(consumer, producer):
    record = _read(producer.call("publish", ("kv", None)))
    consumer.fetch(record).release()
    with pytest.raises(ReplayedRecord, match="already used"):
        consumer.fetch(record)
    with pytest.raises(ReplayedRecord):
        consumer.discard(record)
    assert consumer.stats()["recv_regions_in_use"] == 0


def test_a_record_replayed_to_a_second_consumer_after_its_release_is_refused(consumer, producer):
    """Consumer A reads the record (the producer frees its regions); the regions then hold another request's
    tensors; consumer B, which never saw the record, gets it replayed: refused, with nothing handed out."""
    first = _read(producer.call("publish", ("kv", None)))
    consumer.fetch(first).release()
    producer.stats_when(lambda s: s["send_regions_in_use"] == 0)
    second = _read(producer.call("publish", ("kv", None, 1)))  # another request's tensors
    assert second.regions == first.regions  # in the very same memory
    other = TransferEndpoint(CONFIG, agent=consumer.agent)  # another instance of the stage, as far as records go
    try:
        with pytest.raises(ReplayedRecord, match="was read after its lease ended"):
            other.fetch(first)
        assert other.stats()["recv_regions_in_use"] == 0 and other.stats()["fetched"] == 0
    finally:
        other.close()
    with consumer.fetch(second) as got:  # the new owner's read is not disturbed
        assert all(a.cpu().numpy().tobytes() == b.numpy().tobytes() for a, b in zip(got.tensors, _tensors(1)["kv"]))


def test_a_lease_is_claimed_at_its_producer_once_whichever_consumer_asks():
    """The producer's side of a record's single use (a consumer's Claim on its stage socket): a record names where its
    lease is claimed (the producer worker's file, once it binds); the first claim is granted, every later one refused,
    and so is one after the lease ended (read and released, or expired)."""
    ep = TransferEndpoint(CONFIG, device=DEVICE)
    try:
        ep.serving_at({"name": "encode", "tcp": ["127.0.0.1", 1]})
        first, second = (ep.publish(_tensors(i)["embeddings"]) for i in range(2))
        assert first.claim_at == {"name": "encode", "tcp": ["127.0.0.1", 1]}
        ep.sender.take(first.lease_id)
        with pytest.raises(ReplayedRecord, match=r"already used \(claimed by a consumer\)"):
            ep.sender.take(first.lease_id)
        assert ep.sender.release(second.lease_id, second.release_key)
        with pytest.raises(ReplayedRecord, match="its lease has ended"):
            ep.sender.take(second.lease_id)
    finally:
        ep.close()


def test_a_closed_endpoint_s_pools_leave_its_agent(consumer, producer):
    """An endpoint's close deregisters its pools and stamps from the agent, which may outlive it (the process's):
    peers can no longer READ them, and the agent's metadata is what it was. (On an H200, after a test that closed a
    second endpoint on the process's agent when close deregistered nothing, the process's next GPU allocation failed
    with "resource already mapped".)"""
    before = consumer.agent.metadata
    other = TransferEndpoint(CONFIG, agent=consumer.agent, device=DEVICE)
    assert len(consumer.agent.metadata) > len(before)
    other.close()
    other.close()  # (once is enough; twice is harmless)
    assert consumer.agent.metadata == before
    del other
    torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE).fill_(1)
    record = _read(producer.call("publish", ("kv", None)))
    with consumer.fetch(record) as got:
        assert [t.cpu().numpy().tobytes() for t in got.tensors] == [t.numpy().tobytes() for t in _tensors(0)["kv"]]


def test_dead_peer_is_a_clear_error(consumer):
    p = Producer()
    data = p.call("publish", ("kv", None))
    p.proc.kill()
    p.proc.join()
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable):
        consumer.fetch(_read(data))
    assert time.monotonic() - t0 < CONFIG.read_timeout_s
    assert consumer.stats()["recv_regions_in_use"] == 0


def test_many_transfers_interleaved(consumer, producer):
    records = [producer.call("publish", ("kv", None)) for _ in range(5)]
    assert producer.call("stats")["send_regions_in_use"] == 5
    for data in reversed(records):
        consumer.fetch(_read(data)).release()
    stats = producer.stats_when(lambda s: s["send_regions_in_use"] == 0)
    assert stats["send_regions_in_use"] == 0 and stats["released"] == 5


def test_pool_allocator_merges_and_reports_exhaustion():
    pool = MemoryPool("test", 4096)
    a, b, c = pool.alloc(1000), pool.alloc(1000), pool.alloc(1000)
    assert pool.in_use == 3
    with pytest.raises(PoolExhausted, match="cannot fit 2000 bytes"):
        pool.alloc(2000)
    pool.free(b)
    pool.free(a)
    d = pool.alloc(2000)  # fits only if a and b merged
    assert d.offset == 0
    for r in (c, d):
        pool.free(r)
    assert pool.in_use == 0 and pool.alloc(4096).offset == 0
    with pytest.raises(ValueError):
        pool.free(c)


def test_embeddings_changed_on_the_way_are_refused_by_their_record_s_digest(consumer, producer):
    """An embeddings record carries each item's SHA-256 (the tensors cross the data network unsealed): rows read as
    they were stored are taken; rows changed after the digest (here in the producer's region, as a party on the
    network would on the way) are refused, naming the item, and the consumer's region is freed."""
    from trident.worker.engines.handoff import read_embeddings
    from trident.core.errors import TransferError
    from trident.core.protocol import EmbeddingsRecord, decode_record

    record = decode_record(producer.call("cached", 0), EmbeddingsRecord)
    if DEVICE == "cpu":
        assert len(record.digests) == 2 and all(len(d) == 32 for d in record.digests)
    else:  # rows on a GPU are not hashed, at either end (docs/security.md)
        assert record.digests is None
    emb, release = read_embeddings(consumer, record)
    try:
        assert torch.equal(emb.embeddings.cpu().view(2, 196, 512), _tensors(1)["embeddings"][0])
    finally:
        release()
    changed = decode_record(producer.call("cached", 4), EmbeddingsRecord)
    if DEVICE != "cpu":  # (rows read into a GPU are not hashed)
        return
    with pytest.raises(TransferError, match="item 1 read from .* do not match their record's digest"):
        read_embeddings(consumer, changed)
    assert consumer.stats()["recv_regions_in_use"] == 0
