"""The scheduler's pure parts: paths and fallbacks, routing policies, the embedding cache's bookkeeping,
and a stage's stream cancellation by id."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trident.worker.engines.embedding_cache import EmbeddingCache
from trident.core.errors import InvalidRequest
from trident.in_triton.scheduler.routing import AffinityIndex, Router, needs_prompt_length, plan, prefix_keys, with_local_prefill
from trident.core.transfer import MemoryPool
from trident.worker.infer import Streams

ALL = {"encode", "prefill", "decode", "encode_prefill", "prefill_decode", "generate"}


# -- plans ------------------------------------------------------------------------------------------------
def test_plan_follows_the_mode_and_skips_encode_without_images():
    assert plan("e_p_d", 1, ALL).stages == ("encode", "prefill", "decode")
    text_only = plan("e_p_d", 0, ALL)
    assert text_only.stages == ("prefill", "decode") and text_only.decisions == ("skip_encode",)
    assert plan("e_pd", 0, ALL).path == "prefill_decode"
    assert plan("ep_d", 2, ALL).stages == ("encode_prefill", "decode")
    assert plan("epd", 3, ALL).stages == ("generate",)


def test_plan_falls_back_to_the_modes_whose_stages_run():
    no_prefill = ALL - {"prefill"}
    p = plan("e_p_d", 1, no_prefill)
    assert (p.runs_as, p.stages, p.fell_back) == ("e_pd", ("encode", "prefill_decode"), True)
    assert p.decisions == ("fallback:e_pd",)
    assert plan("e_p_d", 1, {"generate"}).stages == ("generate",)
    assert plan("ep_d", 1, {"encode", "prefill_decode"}).runs_as == "e_pd"
    # a text-only E/P/D request does not need the encoder
    assert plan("e_p_d", 0, {"prefill", "decode"}).runs_as == "e_p_d"
    assert plan("e_p_d", 1, {"prefill", "decode"}) is None  # nothing encodes: no plan (503)
    assert plan("epd", 0, ALL - {"generate"}) is None


def test_local_encode_uses_a_prefill_worker_that_encodes():
    p = plan("e_p_d", 2, ALL, local_encode_images=2)
    assert p.stages == ("encode_prefill", "decode") and "local_encode" in p.decisions
    assert plan("e_p_d", 3, ALL, local_encode_images=2).stages[0] == "encode"  # more images than N
    assert plan("e_pd", 1, ALL, local_encode_images=1).stages == ("generate",)
    # no worker that both encodes and prefills: the encode stage does it
    assert plan("e_p_d", 1, ALL - {"encode_prefill"}, local_encode_images=4).stages[0] == "encode"


def test_local_prefill_keeps_short_prompts_on_the_decode_worker():
    p = plan("e_p_d", 1, ALL)
    assert needs_prompt_length(p, 128) and not needs_prompt_length(p, 0)
    short = with_local_prefill(p, 100, 128, has_images=True)
    assert short.stages == ("encode", "decode") and short.local_prefill and short.path == "encode>decode(prefill)"
    assert with_local_prefill(p, 129, 128, has_images=True) is p
    # EP/D: the decode worker cannot encode, so only a text-only prompt stays there
    ep_d = plan("ep_d", 1, ALL)
    assert with_local_prefill(ep_d, 10, 128, has_images=True) is ep_d
    assert with_local_prefill(plan("ep_d", 0, ALL), 10, 128, has_images=False).stages == ("decode",)
    assert not needs_prompt_length(plan("e_pd", 1, ALL), 128)


# -- routing ----------------------------------------------------------------------------------------------
def test_least_loaded_spreads_and_counts():
    r = Router("least_loaded")
    chosen = []
    for _ in range(4):
        instance, _ = r.choose("prefill", ["prefill", "prefill-2"])
        r.begin(instance)
        chosen.append(instance)
    assert sorted(chosen) == ["prefill", "prefill", "prefill-2", "prefill-2"]
    r.end("prefill")
    r.end("prefill")
    assert r.choose("prefill", ["prefill", "prefill-2"])[0] == "prefill"
    assert r.routed == {"prefill": 2, "prefill-2": 2}


def test_round_robin_alternates():
    r = Router("round_robin")
    assert [r.choose("encode", ["encode", "encode-2"])[0] for _ in range(4)] == ["encode", "encode-2"] * 2


def test_each_stage_takes_its_own_turns():
    """Requests that call two stages of two instances each: each stage alternates on its own (one shared turn
    sent every prefill to one instance and every decode to the other). The same for least-loaded's ties."""
    for policy in ("round_robin", "least_loaded"):
        r = Router(policy)
        calls = [(r.choose("prefill", ["prefill", "prefill-2"])[0], r.choose("decode", ["decode", "decode-2"])[0])
                 for _ in range(4)]
        assert sorted({p for p, _ in calls}) == ["prefill", "prefill-2"], (policy, calls)
        assert sorted({d for _, d in calls}) == ["decode", "decode-2"], (policy, calls)


def test_affinity_returns_to_where_a_key_went_unless_overloaded():
    r = Router("affinity", slack=2)
    live = ["prefill", "prefill-2"]
    first, why = r.choose("prefill", live, ["img-a"])
    assert why == "least_loaded"
    for _ in range(3):
        assert r.choose("prefill", live, ["img-a"]) == (first, "affinity")
    other = next(i for i in live if i != first)
    for _ in range(3):
        r.begin(first)  # three more in flight there than on the other instance
    instance, why = r.choose("prefill", live, ["img-a"])
    assert (instance, why) == (other, "affinity_overloaded")
    r.forget(other)  # gone: its keys go back to least-loaded
    assert r.choose("prefill", [first], ["img-a"])[0] == first


def test_affinity_index_prefers_most_keys_then_longest_prefix():
    index = AffinityIndex(capacity=3)
    index.remember(["a", "b"], "x")
    index.remember(["c"], "y")
    assert index.lookup(["a", "b", "c"], {"x", "y"}) == "x"
    assert index.lookup(["c", "a"], {"x", "y"}) == "y"  # tie: the first (longest) key wins
    assert index.lookup(["a"], {"y"}) is None  # x is not live
    index.remember(["d"], "y")  # capacity 3: the least recently used key (b) goes
    assert index.lookup(["b"], {"x", "y"}) is None and index.lookup(["a"], {"x", "y"}) == "x"


def test_prefix_keys_share_chunks_and_know_images():
    shared = "You are a helpful assistant. " * 10
    a, b = prefix_keys(shared + "Question one?"), prefix_keys(shared + "Another question?")
    assert a[0] != b[0] and set(a[1:]) & set(b[1:])  # whole prompts differ, prefixes match
    assert not set(prefix_keys(shared, ["img1"])) & set(prefix_keys(shared, ["img2"]))


# -- embedding cache ----------------------------------------------------------------------------------------
def _rows(n: int, value: float) -> torch.Tensor:
    return torch.full((n, 8), float(value))  # 32 bytes a row


def test_cache_is_an_lru_capped_in_bytes_and_freed_by_the_last_reader():
    pool = MemoryPool("t", 1 << 16)
    cache = EmbeddingCache(pool, capacity_bytes=3 * 320, key_prefix="m")
    loop = asyncio.new_event_loop()
    try:
        held = []
        for i in range(4):  # 4 entries of 320 bytes into a 960-byte cache
            key = cache.key(f"img{i}")
            assert cache.claim(key, loop).entry is None  # a miss: this caller encodes it
            entry = cache.store(key, _rows(10, i), None)
            cache.fulfil(key, entry)
            held.append(entry)
        assert cache.bytes <= 3 * 320 and cache.counters.evictions == 1
        assert not held[0].indexed and held[0].refs == 1  # evicted while read: its region stays
        regions = pool.in_use
        cache.release(held[0])
        assert pool.in_use == regions - 1  # the last reader frees an evicted entry
        hit = cache.claim(cache.key("img3"), loop)
        assert hit.entry is held[3] and hit.entry.refs == 2 and cache.counters.hits == 1
        assert torch.equal(pool.view(hit.entry.region).view(torch.float32).view(10, 8), _rows(10, 3))
        for entry in held[1:] + [hit.entry]:
            cache.release(entry)
        assert pool.in_use == 3  # the cached entries, no references left
    finally:
        loop.close()


def test_cache_off_keeps_nothing_and_pool_pressure_evicts():
    pool = MemoryPool("t", 1024)
    off = EmbeddingCache(pool, capacity_bytes=0)
    entry = off.store("k", _rows(4, 1.0), None)
    assert not entry.indexed and off.bytes == 0
    off.release(entry)
    assert pool.in_use == 0
    cache = EmbeddingCache(pool, capacity_bytes=1024)
    for i in range(3):
        cache.release(cache.store(f"k{i}", _rows(8, i), None))  # 256 bytes each, cached
    big = cache.store("big", _rows(24, 9.0), None)  # 768 bytes: needs the room of all three
    assert cache.counters.evictions == 3 and big.indexed


def test_concurrent_claims_wait_on_one_encode():
    pool = MemoryPool("t", 1 << 16)
    cache = EmbeddingCache(pool, capacity_bytes=0)

    async def scenario():
        loop = asyncio.get_running_loop()
        assert cache.claim("k", loop).entry is None  # the encoder
        waits = [cache.claim("k", loop).pending for _ in range(3)]
        assert all(w is not None for w in waits) and cache.counters.shared == 3
        entry = cache.store("k", _rows(2, 5.0), None)
        cache.fulfil("k", entry)
        got = await asyncio.gather(*(cache.wait(w) for w in waits))
        assert all(g is entry for g in got) and entry.refs == 4
        for _ in range(4):
            cache.release(entry)
        assert pool.in_use == 0  # cache off: freed with the last reference
        assert cache.claim("bad", loop).entry is None
        waiter = cache.claim("bad", loop).pending
        cache.fail("bad", InvalidRequest("image 0 could not be decoded"))
        with pytest.raises(InvalidRequest):
            await cache.wait(waiter)

    asyncio.run(scenario())


# -- stream cancellation ------------------------------------------------------------------------------------
def test_streams_stop_a_request_by_id_and_close_its_generation():
    closed = []

    async def tokens():
        try:
            for i in range(1000):
                await asyncio.sleep(0.001)
                yield i
        finally:
            closed.append(True)

    async def scenario():
        streams = Streams()
        got = []

        async def consume():
            async for item in streams.relay("r1", tokens()):
                got.append(item)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.001)
        assert streams.cancel("r1") and not streams.cancel("unknown")
        await asyncio.wait_for(task, 1)
        assert 3 <= len(got) < 1000 and closed == [True]
        assert [x async for x in streams.relay(None, tokens())][-1] == 999

    asyncio.run(scenario())


class _FakeMetricFamily:
    """pb_utils.MetricFamily as the BLS sees it: every increment is recorded (in Triton, an IPC round trip)."""

    COUNTER, GAUGE = "counter", "gauge"
    log: list = []

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 (pb_utils' name)
        family = self

        class _Metric:
            def increment(self, value):
                _FakeMetricFamily.log.append((family.name, labels.get("stage"), value))

            def set(self, value):
                _FakeMetricFamily.log.append((family.name, "set", value))

        return _Metric()


def test_a_requests_metric_updates_wait_for_apply():
    from types import SimpleNamespace

    from trident.in_triton.metrics import SchedulerMetrics

    _FakeMetricFamily.log = []
    metrics = SchedulerMetrics("e_p_d", SimpleNamespace(MetricFamily=_FakeMetricFamily))
    held = metrics.held()
    held.add("trident_routed_total", stage="encode", instance="encode")
    held.request("encode>prefill>decode", ("skip_encode",), "e_p_d")
    called = []
    held.later(called.append, "logged")
    metrics.add("trident_scheduler_errors_total", code="400")  # the model's own updates go at once
    assert _FakeMetricFamily.log == [("trident_scheduler_errors_total", None, 1)] and called == []
    held.apply()
    assert [entry[0] for entry in _FakeMetricFamily.log[1:]] == [
        "trident_routed_total", "trident_requests_total", "trident_decisions_total"]
    assert called == ["logged"]
    held.add("trident_routed_total", stage="decode", instance="decode")  # after apply: at once
    assert _FakeMetricFamily.log[-1] == ("trident_routed_total", "decode", 1)
    held.apply()  # again: nothing twice
    assert len(_FakeMetricFamily.log) == 5


def test_metric_families_outlive_their_scheduler():
    """Never deleted: their destructors would run at the stub's exit, after its shared memory is gone."""
    import gc
    import weakref
    from types import SimpleNamespace

    from trident.in_triton.metrics import _FAMILIES, SchedulerMetrics

    metrics = SchedulerMetrics("e_p_d", SimpleNamespace(MetricFamily=_FakeMetricFamily))
    refs = [weakref.ref(f) for f in metrics._families.values()]
    assert len(refs) == len(_FAMILIES)
    del metrics
    gc.collect()
    assert all(r() is not None for r in refs)


def test_a_request_of_embedding_cache_scope_request_is_encoded_for_itself_and_keeps_nothing(monkeypatch):
    """``scheduling.embedding_cache_scope: request`` (the encode call's ``trident_embedding_scope``): the request's
    items are neither taken from the cache nor from another request's encode in flight, and are not kept; a repeat
    within the request still shares its one encode. A shared request after it finds nothing of it."""
    from types import SimpleNamespace

    from trident.worker.engines import encode_stage
    from trident.worker.engines.encode_stage import EncodeStage
    from trident.core.media import MediaItem

    pool = MemoryPool("t", 1 << 16)
    cache = EmbeddingCache(pool, capacity_bytes=1 << 15, key_prefix="m")
    encoded: list[list[str]] = []  # each encoder pass: its items' bytes

    def start(claimed):
        encoded.append([item.raw.decode() for _, item in claimed])
        done = asyncio.get_running_loop().create_future()
        done.set_result([cache.store(key, _rows(4, len(item.raw)), None) for key, item in claimed])
        return done

    published: list[list] = []

    def publish(sender, cache_, entries, ids, kinds):
        published.append(entries)
        return SimpleNamespace(encode=lambda: b"record")

    monkeypatch.setattr(encode_stage.handoff, "publish_cached_embeddings", publish)
    stage = EncodeStage(SimpleNamespace(check_kinds=lambda counts: None), cache, SimpleNamespace(sender=None), start)
    a, b = MediaItem(b"a", 0), MediaItem(b"b", 1)

    async def scenario():
        shared = await stage.encode([a])
        private = await stage.encode([a, b, MediaItem(b"b", 2)], private=True)
        again = await stage.encode([a, b])
        return shared.report, private.report, again.report

    shared, private, again = asyncio.run(scenario())
    assert encoded == [["a"], ["a", "b"], ["b"]]  # the private request: its own pass over both; b again after it
    assert (shared["misses"], private["misses"], private["shared"], private["hits"]) == (1, 2, 1, 0)
    assert (again["hits"], again["misses"]) == (1, 1)  # a from the shared request; nothing of the private one's
    assert [e.indexed for e in published[1]] == [False, False, False] and published[1][1] is published[1][2]
    assert cache.stats()["cache_entries"] == 2
    for entries in published:  # the records' leases end: the private request's regions are freed, the cache stays
        for entry in entries:
            cache.release(entry)
    assert pool.in_use == 2
