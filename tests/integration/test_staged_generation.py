"""Encode, prefill and decode stage engines in three OS processes, joined only by their records and NIXL READs,
equal model.generate() (the same engines and hand-offs a stage worker serves, without Triton)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from support import IMAGE_CASES as CASES
from support import build_reference, chat_prompt, child_processes, make_image, png_bytes
from trident.core.protocol import HFKVRecord, decode_record

NEW_TOKENS = 24
GREEDY = '{"max_tokens": %d, "temperature": 0}' % NEW_TOKENS


def _stage(conn, stage: str, model_path: str, dtype: str = "auto") -> None:
    """Child process serving one stage's engine (the same object a stage worker serves) over a pipe."""
    import asyncio

    torch.set_num_threads(1)
    from trident.core.config import MiB, TransferConfig
    from trident.worker.engines.hf.stage import HFStageEngine
    from trident.core.media import MediaItem
    from trident.core.processor import SamplingParams
    from trident.core.protocol import STAGES

    engine = HFStageEngine(STAGES[stage], model_path, TransferConfig(send_pool_bytes=64 * MiB, recv_pool_bytes=64 * MiB),
                           dtype=dtype)

    async def generate(text: str, pngs: list, params: SamplingParams):
        """The whole request in this one engine (the EPD stage)."""
        media = [MediaItem(raw, i) for i, raw in enumerate(pngs)]
        generation = await engine.generate(text, params, media=media)
        return [t async for event in generation.events for t in event.token_ids]

    async def decode(kv: bytes, params: SamplingParams):
        generation = await engine.generate(None, params, kv_meta=kv)
        tokens, text, reason, events = [], "", None, []
        async for event in generation.events:
            tokens += event.token_ids
            text += event.text
            reason = event.finish_reason
            events.append((event.text, event.finish_reason))
        return tokens, text, reason, events

    async def first_only(kv: bytes, params: SamplingParams):
        """A client that goes away after the first token: the stream is closed there."""
        generation = await engine.generate(None, params, kv_meta=kv)
        event = await anext(generation.events)
        await generation.events.aclose()
        return event.token_ids, event.finish_reason

    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "encode":
                out = asyncio.run(engine.encode([MediaItem(raw, i) for i, raw in enumerate(arg)])).record
            elif cmd == "prefill":
                text, emb, params = arg
                out = asyncio.run(engine.prefill(text, SamplingParams.from_json(params), embedding_meta=emb))
            elif cmd == "decode":
                kv, params = arg
                out = asyncio.run(decode(kv, SamplingParams.from_json(params)))
            elif cmd == "generate":
                text, pngs, params = arg
                out = asyncio.run(generate(text, pngs, SamplingParams.from_json(params)))
            elif cmd == "decode_first":
                kv, params = arg
                out = asyncio.run(first_only(kv, SamplingParams.from_json(params)))
            elif cmd == "decode_text":
                out = engine.processor.tokenizer.decode(arg, skip_special_tokens=True)
            elif cmd == "stats":
                out = engine.stats()
            elif cmd == "exit":
                engine.close()
                conn.send("bye")
                return
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Stage:
    def __init__(self, stage: str, model_path: str, dtype: str = "auto") -> None:
        ctx = child_processes()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_stage, args=(child, stage, model_path, dtype), daemon=True)
        self.proc.start()

    def wait_ready(self) -> None:
        assert self.conn.poll(120), "stage process did not start"
        assert self.conn.recv() == "ready"

    def __call__(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        assert self.conn.poll(120), f"stage did not answer {cmd}"
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def stop(self) -> None:
        try:
            self.conn.send(("exit", None))
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


# (LLaVA here; Qwen2-VL's three stages, M-RoPE across the records included, are held to model.generate() through
# real servers in tests/e2e/test_media_serving.py, every mode)
@pytest.fixture(scope="module", params=["llava"])
def pipeline(request, demo_models):
    path = demo_models[request.param]
    stages = {stage: Stage(stage, path) for stage in ("encode", "prefill", "decode")}
    try:
        for s in stages.values():
            s.wait_ready()
        yield request.param, path, stages
    finally:
        for s in stages.values():
            s.stop()


@pytest.fixture(scope="module")
def references(pipeline):
    """model.generate() on the same checkpoint, in this process."""
    _, path, _ = pipeline
    return build_reference(path, CASES, NEW_TOKENS)


@pytest.mark.parametrize("case", list(CASES))
def test_three_processes_equal_generate(pipeline, references, case):
    _, _, stages = pipeline
    c = references[case]
    assert len(c["ids"]) == NEW_TOKENS

    emb = stages["encode"]("encode", c["pngs"]) if c["pngs"] else None
    if emb is not None:
        assert len(emb) < 1024
    kv = stages["prefill"]("prefill", (c["text"], emb, GREEDY))
    assert len(kv) < 1024
    tokens, out_text, reason, events = stages["decode"]("decode", (kv, GREEDY))

    assert tokens == c["ids"]
    assert reason == "length"
    assert out_text == c["expected"]
    # the record tells the decode's first streamed response (the entry model sends it early) exactly
    first_text, first_reason = events[0]
    announced = decode_record(kv, HFKVRecord).first_text
    assert announced == (first_text if first_text and first_reason is None else None)
    _assert_pools_drained(stages)


def test_a_first_token_held_back_is_not_announced(pipeline, references):
    """A stop string that may start in the first token's text holds that text back: the decode's first event
    is empty, and the record announces no first text (the entry model then waits for the decode)."""
    _, _, stages = pipeline
    c = references["one-image"]
    first = stages["decode"]("decode_text", c["ids"][:1])
    assert first, "the reference's first token has no text of its own: pick another case"
    params = json.dumps({"max_tokens": 4, "temperature": 0, "stop": [first + "\u0000never"]})
    emb = stages["encode"]("encode", c["pngs"])
    kv = stages["prefill"]("prefill", (c["text"], emb, params))
    assert decode_record(kv, HFKVRecord).first_text is None
    tokens, out_text, _, events = stages["decode"]("decode", (kv, params))
    assert events[0][0] == "" and tokens == c["ids"][:4]
    assert out_text == stages["decode"]("decode_text", c["ids"][:4])
    _assert_pools_drained(stages)


def test_placeholder_mismatch_frees_the_embeddings(pipeline):
    _, path, stages = pipeline
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    emb = stages["encode"]("encode", [png_bytes(make_image(224, 224, 3))])
    text = chat_prompt(tokenizer, 2, "Two placeholders, one image.")
    with pytest.raises(RuntimeError, match="2 image placeholder.*1 image"):
        stages["prefill"]("prefill", (text, emb, GREEDY))
    _assert_pools_drained(stages)


def test_a_request_ending_at_its_first_token_reads_no_kv(pipeline, references):
    """The prefill sampled the first token and the record carries it: with max_tokens 1 the decode stage
    answers from the record, never READs the KV cache, and its producer frees it at once (not at expiry)."""
    _, _, stages = pipeline
    c = references["one-image"]
    one = '{"max_tokens": 1, "temperature": 0}'
    emb = stages["encode"]("encode", c["pngs"])
    kv = stages["prefill"]("prefill", (c["text"], emb, one))
    fetched = stages["decode"]("stats")["fetched"]
    assert decode_record(kv, HFKVRecord).first_text is None  # the first response is the last: not sent early
    tokens, _, reason, _ = stages["decode"]("decode", (kv, one))
    assert tokens == c["ids"][:1]
    assert reason == "length"
    assert stages["decode"]("stats")["fetched"] == fetched
    _assert_pools_drained(stages)


def test_a_stream_closed_after_its_first_token_frees_the_kv(pipeline, references):
    """The first token leaves before the READ: a client that goes away then leaves nothing held on either
    side, and the same record replayed afterwards is refused before any token."""
    _, _, stages = pipeline
    c = references["one-image"]
    emb = stages["encode"]("encode", c["pngs"])
    kv = stages["prefill"]("prefill", (c["text"], emb, GREEDY))
    tokens, reason = stages["decode"]("decode_first", (kv, GREEDY))
    assert tokens == c["ids"][:1] and reason is None
    _assert_pools_drained(stages)
    with pytest.raises(RuntimeError, match="ReplayedRecord"):
        stages["decode"]("decode", (kv, GREEDY))


def _assert_pools_drained(stages, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = {role: s("stats") for role, s in stages.items()}
        busy = {  # the encoder's embedding cache keeps its entries; nothing else may stay
            r: st for r, st in stats.items()
            if st["leases"] or st["send_regions_in_use"] > st.get("cache_entries", 0) or st["recv_regions_in_use"]
        }
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not busy, busy
    assert all(st["expired"] == 0 for st in stats.values()), stats


def test_in_bfloat16_three_processes_equal_one(demo_models, references):
    """``dtype: bfloat16`` (a GPU's default), here on the CPU: the embeddings and the KV cache are handed on in
    bfloat16, and encode -> prefill -> decode in three processes gives the tokens the one-process EPD engine gives
    in bfloat16."""
    from trident.core.protocol import EmbeddingsRecord

    c = references["one-image"]
    stages = {stage: Stage(stage, demo_models["llava"], "bfloat16") for stage in ("encode", "prefill", "decode", "generate")}
    try:
        for s in stages.values():
            s.wait_ready()
        emb = stages["encode"]("encode", c["pngs"])
        assert {t.dtype for t in decode_record(emb, EmbeddingsRecord).transfer.tensors} == {"bfloat16"}
        kv = stages["prefill"]("prefill", (c["text"], emb, GREEDY))
        assert {t.dtype for t in decode_record(kv, HFKVRecord).transfer.tensors} == {"bfloat16"}
        tokens, _, reason, _ = stages["decode"]("decode", (kv, GREEDY))
        assert reason == "length" and len(tokens) == NEW_TOKENS
        assert tokens == stages["generate"]("generate", (c["text"], c["pngs"], GREEDY))
        _assert_pools_drained({k: v for k, v in stages.items() if k != "generate"})
    finally:
        for s in stages.values():
            s.stop()
