"""The vllm engine's kv_meta record and the decode side's prompt check (no vLLM needed: vLLM's renderer is stood in
for by one that expands each placeholder token to the count it is given, and keeps what it was asked; the real one
is the e2e tests')."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from trident.worker.engines.vllm import VLLMStageEngine, prompt_digest
from trident.core.errors import InvalidRequest, MalformedRecord
from trident.core.processor import Processor
from trident.core.protocol import StandIn, VLLMKVRecord, decode_record
from trident.core.auth import sign


def _record_id(value):
    """A case's id: a record's bytes are sealed with a random nonce, so they name no case (and would differ between
    the suite's two processes)."""
    return "record" if isinstance(value, bytes) else None


PARAMS = {  # the shape of NixlConnector's kv_transfer_params (vLLM 0.32)
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "0c63c0b8-508f-4759-9a86-678c860ceb71", "remote_request_id": "r1-b060ab74",
    "remote_host": "localhost", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 220,
}


def _record(**kw) -> VLLMKVRecord:
    fields = dict(kv_transfer_params=PARAMS, prompt_len=220, prompt_digest="ab" * 8,
                  token_counts=[196], image_ids=["f" * 32],
                  claim="c" * 32, claim_at={"name": "prefill", "tcp": ["127.0.0.1", 40000]})
    fields.update(kw)
    return VLLMKVRecord(**fields)


def test_kv_record_round_trip_and_size():
    data = _record().encode()
    assert decode_record(data, VLLMKVRecord) == _record()
    assert len(data) <= 1024


@pytest.mark.parametrize("data, message", [
    (sign(b"\x00garbage"), "not valid msgpack"),
    (sign(msgspec.msgpack.encode([1, "x"])), "kind and format version"),
    (sign(msgspec.msgpack.encode(["vllm_kv/1", {}])), "'vllm_kv/1' is not supported"),
    (_record(image_ids=[]).encode(), "item token counts and item ids"),
    (_record(kinds=["audio", "image"]).encode(), "kinds"),
    (_record(claim="").encode(), "no producer to claim its KV at"),
    (_record(claim_at={}).encode(), "no producer to claim its KV at"),
], ids=_record_id)
def test_malformed_kv_records_are_refused(data, message):
    with pytest.raises(MalformedRecord, match=message):
        decode_record(data, VLLMKVRecord)


@pytest.fixture(autouse=True)
def _vllm_exceptions(monkeypatch):
    """The one vLLM name the renderer path imports (``vllm.exceptions.VLLMClientError``), where this suite's
    environment has no vLLM; for each test alone."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("vllm") is None:
        module = types.ModuleType("vllm.exceptions")
        module.VLLMClientError = type("VLLMClientError", (Exception,), {})
        monkeypatch.setitem(sys.modules, "vllm.exceptions", module)


class _Renderer:
    """vLLM's renderer as the decode side uses it: each placeholder token expanded to ``counts``' next entry."""

    def __init__(self, processor: Processor, counts: list[int]) -> None:
        self.processor, self.counts, self.asked = processor, counts, []

    async def render_cmpl_async(self, prompts, skip_mm_cache=False):
        assert skip_mm_cache  # (the engine core's item cache is never taken: see vllm_media.render)
        (prompt,) = prompts
        self.asked.append(prompt)
        tokens = {t: kind for kind, t in self.processor.token_ids.items()}
        ids, ranges, counts = [], {}, iter(self.counts)
        for token in prompt["prompt_token_ids"]:
            if token in tokens:
                n = next(counts)
                ranges.setdefault(tokens[token], []).append(SimpleNamespace(offset=len(ids), length=n, is_embed=None))
                ids += [token] * n
            else:
                ids.append(token)
        return [{"prompt_token_ids": ids, "mm_placeholders": ranges}]


def _decode_side(model_path: str, counts: list[int] = ()) -> VLLMStageEngine:
    """The decode engine's prompt handling alone (no vLLM engine started)."""
    engine = object.__new__(VLLMStageEngine)
    engine.processor = Processor(model_path)
    engine.kv_role = "kv_consumer"
    engine.family = engine.processor.family
    engine.llm = SimpleNamespace(renderer=_Renderer(engine.processor, list(counts)))
    return engine


def _decode_inputs(engine, text, record):
    return asyncio.run(engine._decode_inputs(text, record))


def test_decode_checks_text_input_against_the_prefilled_prompt(demo_models):
    engine = _decode_side(demo_models["llava"], [196] * 3)
    text = "USER: <image>\nWhat is it? ASSISTANT:"
    ids = engine.processor.tokenizer(text)["input_ids"]
    length = len(engine.processor.prompt_ids(text, [196]))
    record = _record(prompt_len=length, prompt_digest=prompt_digest(ids), stand_ins=[StandIn([300, 200], image=True)])
    rendered = _decode_inputs(engine, text, record)
    assert rendered.length == length and rendered.text_ids == ids and rendered.token_counts == [196]
    asked = engine.llm.renderer.asked[0]
    assert asked["prompt_token_ids"] == ids
    assert asked["multi_modal_data"]["image"][0].size == (200, 300)  # (PIL: width, height) the item's own
    assert asked["multi_modal_uuids"] == {"image": record.image_ids}
    with pytest.raises(InvalidRequest, match="not the prompt this kv_meta was prefilled from"):
        _decode_inputs(engine, text.replace("What", "Who"), record)
    with pytest.raises(InvalidRequest, match="not the prompt this kv_meta was prefilled from"):  # (another expansion)
        _decode_inputs(engine, text, _record(prompt_len=length + 1, prompt_digest=prompt_digest(ids),
                                             stand_ins=[StandIn([300, 200], image=True)]))
    with pytest.raises(InvalidRequest, match="needs text_input"):
        _decode_inputs(engine, None, record)


def test_decode_refuses_image_counts_beyond_the_prompt_before_allocating(demo_models):
    engine = _decode_side(demo_models["llava"])
    text = "USER: <image>\nWhat is it? ASSISTANT:"
    for counts, prompt_len in (([10**12], 220), ([300], 220), ([196], 10**9)):
        with pytest.raises(InvalidRequest, match="context window"):
            _decode_inputs(engine, text, _record(token_counts=counts, prompt_len=prompt_len))
    assert not engine.llm.renderer.asked


def test_decode_gives_vllm_each_item_s_stand_in(demo_models):
    """The decode side gives vLLM zeros of each item's own shape, with what came with it (a clip's sampling
    metadata, from which Qwen2.5-VL's positions after it follow), in the prompt's order by kind: vLLM places the
    items from them as the prefill's engine did, whatever the model."""
    from transformers import AutoTokenizer

    from support import media_prompt

    counts, kinds = [16, 30], ["image", "video"]
    engine = _decode_side(demo_models["qwen2_5vl"], counts)
    text = media_prompt(AutoTokenizer.from_pretrained(demo_models["qwen2_5vl"]), ["image", "video"], "What is it?")
    ids = engine.processor.tokenizer(text)["input_ids"]
    length = len(engine.processor.prompt_ids(text, counts, kinds))
    clip = {"fps": 2.0, "duration": 5.0, "total_num_frames": 10, "frames_indices": list(range(10))}
    record = _record(prompt_len=length, prompt_digest=prompt_digest(ids), token_counts=counts, kinds=kinds,
                     image_ids=["a" * 32, "b" * 32],
                     stand_ins=[StandIn([112, 112], image=True), StandIn([10, 56, 84, 3], meta=clip)])
    assert _decode_inputs(engine, text, record).token_counts == counts
    mm = engine.llm.renderer.asked[0]["multi_modal_data"]
    assert mm["image"][0].size == (112, 112)
    frames, meta = mm["video"][0]
    assert frames.shape == (10, 56, 84, 3) and not frames.any() and meta == clip
    with pytest.raises(InvalidRequest, match="no media stand-ins"):
        _decode_inputs(engine, text, _record(prompt_len=length, prompt_digest=prompt_digest(ids), token_counts=counts,
                                             kinds=kinds, image_ids=["a" * 32, "b" * 32]))


def _first_token_side(model_path: str, block_size: int = 16) -> VLLMStageEngine:
    engine = _decode_side(model_path)
    engine._first_token_rules(block_size, None)
    return engine


def _in_context(engine: VLLMStageEngine, ids: list[int], token: int) -> str:
    """The token's text as vLLM's detokenizer gives it after the prompt's ids."""
    whole = engine.processor.tokenizer.decode([*ids, token], skip_special_tokens=True)
    return whole[len(engine.processor.tokenizer.decode(ids, skip_special_tokens=True)):]


def test_decode_starts_from_the_prefill_s_token_only_where_vllm_would_continue_the_same(demo_models):
    """The prefill's token is sent first, and vLLM continues from it, only for a greedy request that goes on
    past it, with no stop strings, whose prompt leaves room in its last block, and whose token is a whole
    piece of text that is not a special one; otherwise (None) vLLM samples the first token itself."""
    from trident.core.processor import SamplingParams

    engine = _first_token_side(demo_models["llava"])
    text = "USER: <image>\nWhat is it? ASSISTANT:"
    prompt = {"prompt_token_ids": engine.processor.tokenizer(text)["input_ids"]}
    greedy = SamplingParams(max_tokens=8, temperature=0)
    word = engine.processor.tokenizer(" house", add_special_tokens=False)["input_ids"][0]
    event = engine._first_event(prompt, 37, word, greedy)
    assert event is not None and event.token_ids == [word] and event.num_output_tokens == 1
    assert event.finish_reason is None and event.text == _in_context(engine, prompt["prompt_token_ids"], word)
    assert event.text.strip() and event.text.strip() in " house"

    partial = engine.processor.tokenizer("日", add_special_tokens=False)["input_ids"]
    assert len(partial) > 1  # the vocabulary splits the character: its first token ends inside it
    eos = min(engine.stop_ids)
    for length, token, params in [
        (37, None, greedy),  # an older record: no token
        (37, word, SamplingParams(max_tokens=8, temperature=0.7, seed=1)),
        (37, word, SamplingParams(max_tokens=8, temperature=0, stop=["zz"])),
        (37, word, SamplingParams(max_tokens=1, temperature=0)),
        (37, eos, greedy),
        (37, engine.processor.image_token_id, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
        (37, engine.vocab_size, greedy),
        (32, word, greedy), (47, word, greedy),  # the last block full, or this token would fill it
        (engine.processor.max_model_len - 1, word, greedy),
        (37, partial[0], greedy),
    ]:
        assert engine._first_event(prompt, length, token, params) is None, (length, token, params)
    assert engine._first_event(prompt, 33, word, greedy) is not None
    assert engine._first_event(prompt, 46, word, greedy) is not None


def test_kv_record_carries_the_first_token():
    assert decode_record(_record(first_token=17).encode(), VLLMKVRecord).first_token == 17
    with pytest.raises(MalformedRecord, match="negative first token"):
        decode_record(_record(first_token=-1).encode(), VLLMKVRecord)


@pytest.mark.parametrize("local", [True, False], ids=["unix-socket", "tcp"])
def test_a_prefill_s_kv_is_claimed_once_whichever_consumer_asks(local):
    """Two consumers (two stage clients, as two decode workers) claim one record's KV at its producer's stage
    socket (Unix on one host, TCP from another): the first gets it, every later claim is refused, from either; so
    are a claim never made and one past the KV's life. The producer here is a vllm KV producer's claims behind a
    real stage server and the prefill handler's control hook (no vLLM)."""
    import asyncio
    import os

    from trident.worker.engines.kv_claims import KVClaims
    from trident.core.errors import ReplayedRecord
    from trident.core.protocol import STAGES
    from trident.core.stagecall import StageClient, StageServer
    from trident.worker.infer import StageHandler

    producer = KVClaims()
    handler = StageHandler(STAGES["prefill"], infer=None, claims=lambda claim, lease: producer.take(claim))
    server = StageServer(None, handler.control, "127.0.0.1")
    server.start()
    first, second = StageClient(), StageClient()
    try:
        producer.serving_at(server.worker_file(os.getpid() if local else None, "prefill"))
        at = _record(claim=producer.hold(), claim_at=producer.at)
        producer.hold_s = 0.0
        expired = producer.hold()

        async def claims() -> None:
            await first.claim(at.claim_at, at.claim)
            for client, claim in ((second, at.claim), (first, at.claim), (second, "0" * 32), (first, expired)):
                with pytest.raises(ReplayedRecord, match="already used, or its KV has expired"):
                    await client.claim(at.claim_at, claim)

        asyncio.run(claims())
        assert producer.held == 0  # nothing held once claimed or expired
    finally:
        first.close()
        second.close()
        server.stop(drain_s=1)


def test_claims_reach_the_producer_named_in_the_record_even_under_a_reused_name():
    """Two producers under one instance name at two addresses (two joined workers that swapped names when their
    head restarted): one consumer's claims go to the worker whose address the record names, each served once."""
    import asyncio

    from trident.worker.engines.kv_claims import KVClaims
    from trident.core.protocol import STAGES
    from trident.core.stagecall import StageClient, StageServer
    from trident.worker.infer import StageHandler

    producers, servers = [], []
    for _ in range(2):
        producer = KVClaims()
        handler = StageHandler(STAGES["prefill"], infer=None, claims=lambda claim, lease, p=producer: p.take(claim))
        server = StageServer(None, handler.control, "127.0.0.1")
        server.start()
        producer.serving_at(server.worker_file(None, "prefill-2"))
        producers.append(producer)
        servers.append(server)
    consumer = StageClient()
    try:
        async def claims() -> None:
            for producer in producers + producers[::-1]:
                await consumer.claim(producer.at, producer.hold())

        asyncio.run(claims())
        assert [p.held for p in producers] == [0, 0]
    finally:
        consumer.close()
        for server in servers:
            server.stop(drain_s=1)
