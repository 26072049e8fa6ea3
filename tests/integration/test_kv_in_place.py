"""A stage that hands its KV cache on computes it straight into its send pool: the record leases the region the
model wrote, with no copy at publish, the KV is bit-for-bit what transformers computes on its own, and every
way out of a prefill (done, refused, failed) leaves the pool as it found it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from support import chat_prompt, make_image, png_bytes
from trident.core.config import MiB, TransferConfig
from trident.core.errors import InvalidRequest, PoolExhausted
from trident.core.media import MediaItem
from trident.core.processor import SamplingParams
from trident.core.protocol import STAGES, HFKVRecord, decode_record

GREEDY = SamplingParams.from_json('{"max_tokens": 4, "temperature": 0}')


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def engine(request, demo_models):
    from trident.worker.engines.hf.stage import HFStageEngine

    torch.set_num_threads(1)
    e = HFStageEngine(STAGES["encode_prefill"], demo_models[request.param],
                      TransferConfig(send_pool_bytes=64 * MiB, recv_pool_bytes=16 * MiB))
    yield e
    e.close()


def _prompt(engine, seed: int = 3):
    """Prompt ids with one image's placeholders expanded, and that image's embeddings."""
    emb = engine.encoder.encode([make_image(224, 224, seed)])
    text = chat_prompt(engine.processor.tokenizer, 1, "What is in the picture?")
    return engine.processor.prompt_ids(text, emb.token_counts, emb.kinds), emb, text


def _in_pool(engine, t: torch.Tensor) -> bool:
    pool = engine.endpoint.sender.pool
    return pool.address <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= pool.address + pool.capacity


def _pool_regions(engine) -> int:
    return engine.endpoint.sender.pool.in_use


def test_the_kv_is_computed_in_the_send_pool_and_equals_transformers_own(engine):
    ids, emb, _ = _prompt(engine)
    own = engine.prefiller.prefill(ids, emb, GREEDY, seed=7)  # transformers' own cache (no kv_into)
    result = engine._prefill_prompt(ids, emb, GREEDY, 7)
    try:
        assert result.kv_region is not None and _pool_regions(engine) == 1
        assert all(_in_pool(engine, t) for kv in result.kv for t in kv)
        assert not any(_in_pool(engine, t) for kv in own.kv for t in kv)
        assert len(result.kv) == len(own.kv) == engine.model.num_layers
        for (k, v), (k0, v0) in zip(result.kv, own.kv):
            assert k.shape == k0.shape == (1, engine.model.kv_heads, len(ids), engine.model.head_dim)
            assert torch.equal(k, k0) and torch.equal(v, v0)
        assert (result.first_token, result.rope_delta) == (own.first_token, own.rope_delta)
    finally:
        engine.endpoint.sender.pool.free(result.kv_region)
    assert _pool_regions(engine) == 0


def test_the_record_leases_the_region_the_model_wrote(engine):
    """One region per prefill, of exactly the KV's bytes: publish copied nothing into a second one."""
    _, _, text = _prompt(engine, seed=4)
    record = decode_record(
        asyncio.run(engine.prefill(text, GREEDY, media=[MediaItem(png_bytes(make_image(224, 224, 4)), 0)])),
        HFKVRecord,
    )
    sender = engine.endpoint.sender
    try:
        kv_bytes = 2 * engine.model.num_layers * engine.model.kv_heads * record.prompt_len * engine.model.head_dim * 4
        assert _pool_regions(engine) == 1 and record.transfer.nbytes == kv_bytes
        ((address, nbytes),) = record.transfer.regions
        assert nbytes == kv_bytes and sender.pool.address <= address < sender.pool.address + sender.pool.capacity
    finally:
        assert sender.release(record.transfer.lease_id, record.transfer.release_key)
    assert _pool_regions(engine) == 0 and sender.active_leases == 0


def test_a_prefill_that_fails_gives_its_region_back(engine):
    ids, emb, _ = _prompt(engine, seed=5)
    short = [t for t in ids if t != engine.processor.token_ids["image"]][:-1] + [engine.processor.token_ids["image"]]
    with pytest.raises(InvalidRequest, match="image tokens but the embeddings cover"):
        engine._prefill_prompt(short, emb, GREEDY, 1)
    assert _pool_regions(engine) == 0


def test_a_publish_that_fails_gives_its_region_back(engine, monkeypatch):
    _, _, text = _prompt(engine, seed=6)

    def full(lease_id):
        raise PoolExhausted("65536 leases are open, the most a producer keeps")

    monkeypatch.setattr(engine.endpoint.sender.stamps, "take", full)
    with pytest.raises(PoolExhausted, match="leases are open"):
        asyncio.run(engine.prefill(text, GREEDY, media=[MediaItem(png_bytes(make_image(224, 224, 6)), 0)]))
    assert _pool_regions(engine) == 0
    with pytest.raises(PoolExhausted, match="leases are open"):  # the copying publish too
        engine.endpoint.publish([torch.ones(4, 256)])
    assert _pool_regions(engine) == 0


def test_tensors_of_another_shape_are_not_written_into(engine):
    """A cache layer the model fills with a shape other than the given tensors' keeps its own (and publish
    copies them): the stage frees the reserved region."""
    ids, emb, _ = _prompt(engine, seed=8)
    wrong = [(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)) for _ in range(engine.model.num_layers)]
    result = engine.prefiller.prefill(ids, emb, GREEDY, seed=2, kv_into=wrong)
    own = engine.prefiller.prefill(ids, emb, GREEDY, seed=2)
    assert all(k is not w[0] and v is not w[1] for (k, v), w in zip(result.kv, wrong))
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(result.kv, own.kv))
    assert all(not w[0].any() for w in wrong)
