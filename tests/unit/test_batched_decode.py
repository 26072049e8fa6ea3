"""Continuous-batching decode: requests decoded together give exactly the tokens each gives alone."""

from __future__ import annotations

import json
import re

import pytest

from support import chat_prompt, make_image
from trident.worker.engines.base import DecodeRequest
from trident.worker.engines.hf.decoder import HFDecoder
from trident.worker.engines.hf.stage import HFEncoder, HFModel, HFPrefiller
from trident.core.errors import InvalidRequest, MalformedRecord
from trident.core.processor import SamplingParams
from trident.core.protocol import HFKVRecord, TensorSpec, Transfer

PROMPTS = [
    "Hi.",
    "What is in the picture?",
    "Describe the colors, the shapes and the layout of this image in great detail.",
    "Count.",
    "Is there a dog, a cat, or a bird in this picture? Answer in one sentence please.",
    "Tell a long story about the image, with a beginning, a middle and an end, and many words in it.",
    "Why?",
    "List three things.",
]


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def engine(request, demo_models):
    model = HFModel(demo_models[request.param])
    decoder = HFDecoder(model)
    yield model, HFEncoder(model), HFPrefiller(model), decoder
    decoder.close()


def _requests(model, encoder, prefiller):
    """8 prefilled requests of different prompt lengths; some with an image, some sampled with a seed."""
    out = []
    for i, text in enumerate(PROMPTS):
        n_images = i % 2
        emb = encoder.encode([make_image(224, 224, i)]) if n_images else None
        prompt = chat_prompt(model.processor.tokenizer, n_images, text)
        ids = model.processor.prompt_ids(prompt, emb.token_counts if emb else [])
        params = SamplingParams(
            max_tokens=10 + 3 * i,  # requests leave the batch at different steps
            temperature=0.0 if i % 3 else 0.8,
            top_p=0.9,
            top_k=50,
            seed=1000 + i,
            ignore_eos=True,
        )
        res = prefiller.prefill(ids, emb, params, seed=1000 + i)
        out.append(
            DecodeRequest(kv=res.kv, first_token=res.first_token, prompt_len=res.prompt_len, params=params,
                          rope_delta=res.rope_delta, seed=res.seed, request_id=str(i))
        )
    return out


def _collect(stream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    for event in stream:
        tokens += event.token_ids
        reason = event.finish_reason
    return tokens, reason


def test_batched_equals_alone(engine):
    model, encoder, prefiller, decoder = engine
    requests = _requests(model, encoder, prefiller)
    assert len({r.prompt_len for r in requests}) == len(requests)

    alone = [_collect(decoder.submit(r)) for r in requests]  # one at a time
    steps_before = decoder.steps
    streams = [decoder.submit(r) for r in requests]  # all at once
    together = [_collect(s) for s in streams]
    steps = decoder.steps - steps_before

    assert together == alone
    for (tokens, reason), req in zip(together, requests):
        assert len(tokens) == req.params.max_tokens and reason == "length"
    # Batched: far fewer forward steps than tokens (each request alone needs max_tokens - 1 steps).
    assert steps <= max(r.params.max_tokens for r in requests) + 2
    assert decoder.max_batch_seen >= 6


def test_stop_conditions(engine):
    model, encoder, prefiller, decoder = engine
    req = _requests(model, encoder, prefiller)[2]
    tokens, _ = _collect(decoder.submit(req))
    full = model.processor.decode(tokens)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop
    req.params = req.params.model_copy(update={"stop": [stop]})
    events = list(decoder.submit(req))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]
    # EOS ends a request with "stop" unless ignore_eos.
    eos = next(iter(model.processor.eos_token_ids))
    req.first_token = eos
    req.params = req.params.model_copy(update={"stop": [], "ignore_eos": False})
    events = list(decoder.submit(req))
    assert [e.finish_reason for e in events] == ["stop"] and events[0].text == ""


def test_one_bad_request_never_fails_the_batch(engine):
    model, encoder, prefiller, decoder = engine
    requests = _requests(model, encoder, prefiller)[:4]
    alone = [_collect(decoder.submit(r)) for r in requests]
    # temperature 1e-300 is greedy (it once overflowed the logits and failed every request in the batch)
    tiny = requests[1].params.model_copy(update={"temperature": 1e-300})
    assert tiny.greedy and SamplingParams.from_json('{"temperature": 1e-300}').greedy
    # sampling values that slip past validation fail their own request only
    broken = SamplingParams.model_construct(**{**requests[2].params.model_dump(), "temperature": float("nan")})
    odd = [
        DecodeRequest(kv=r.kv, first_token=r.first_token, prompt_len=r.prompt_len, params=p, rope_delta=r.rope_delta,
                      seed=r.seed, request_id=f"odd-{i}")
        for i, (r, p) in enumerate(((requests[1], tiny), (requests[2], broken)))
    ]
    streams = [decoder.submit(r) for r in requests] + [decoder.submit(r) for r in odd]
    assert [_collect(s) for s in streams[:4]] == alone
    tiny_tokens, _ = _collect(streams[4])
    greedy = requests[1].params.model_copy(update={"temperature": 0.0})
    assert tiny_tokens == _collect(decoder.submit(DecodeRequest(
        kv=requests[1].kv, first_token=requests[1].first_token, prompt_len=requests[1].prompt_len, params=greedy,
        rope_delta=requests[1].rope_delta, seed=requests[1].seed)))[0]
    with pytest.raises(RuntimeError):
        _collect(streams[5])
    assert _collect(decoder.submit(requests[0])) == alone[0]  # and the decoder keeps serving


def test_prompt_length_is_checked_before_image_tokens_are_expanded(engine):
    model, *_ = engine
    prompt = chat_prompt(model.processor.tokenizer, 1, "Hi.")
    with pytest.raises(InvalidRequest, match="context window"):
        model.processor.prompt_ids(prompt, [10**12])  # once: a list of 10**12 ids built first


def test_kv_records_are_checked_against_the_model(engine):
    model, *_ = engine
    n = 40

    def record(shape=(1, model.kv_heads, n, model.head_dim), count=2 * model.num_layers, dtype="float32", **kw):
        spec = TensorSpec(dtype, shape, count)
        transfer = Transfer("p", b"m", (1 << 40, 1 << 30), ((1 << 40, spec.nbytes),), (spec,), "0123456789abcdef", 2e9, 1 << 41, b"k" * 16)
        return HFKVRecord(**{"transfer": transfer, "prompt_len": n, "first_token": 5, **kw})

    model.check_kv(record())
    bad = {
        "a broadcast shape": (record(shape=(1, 1, n, 1)), "this model's KV cache"),
        "too few layers": (record(count=2), "this model's KV cache"),
        "another dtype": (record(dtype="float16"), "this model's KV cache"),
        "first token out of vocabulary": (record(first_token=model.vocab_size), "outside the vocabulary"),
        "huge rope_delta": (record(rope_delta=10**15), "rope_delta"),
        "negative positions": (record(rope_delta=-n - 1), "rope_delta"),
        "prompt over the context": (record(prompt_len=model.processor.max_model_len), "context window"),
    }
    for name, (rec, match) in bad.items():
        with pytest.raises(MalformedRecord, match=match):
            model.check_kv(rec)


def test_structured_output_is_kept_from_the_prefill_s_token_in_a_batch_of_free_ones(engine):
    """A request with a regex keeps to it from the token its prefill sampled to the end (then EOS, "stop"), decoded
    in a batch beside unconstrained requests, which give what they give alone."""
    import re

    model, encoder, prefiller, decoder = engine
    free = _requests(model, encoder, prefiller)[:3]
    alone = [_collect(decoder.submit(r)) for r in free]
    prompt = chat_prompt(model.processor.tokenizer, 0, "Give a code.")
    ids = model.processor.prompt_ids(prompt, [])
    params = SamplingParams.from_json('{"max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}')
    res = prefiller.prefill(ids, None, params, seed=1)
    assert res.constraint is not None
    held = DecodeRequest(kv=res.kv, first_token=res.first_token, prompt_len=res.prompt_len, params=params,
                         rope_delta=res.rope_delta, seed=res.seed, constraint=res.constraint)
    streams = [decoder.submit(held)] + [decoder.submit(r) for r in free]
    tokens, reason = _collect(streams[0])
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", model.processor.decode(tokens)) and reason == "stop"
    assert [_collect(s) for s in streams[1:]] == alone


def test_a_structure_that_does_not_compile_is_refused_naming_the_problem():
    for spec, message in (({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
                          ({"regex": "("}, "The parenthesis is not closed"),
                          ({"grammar": "root ::= "}, "Expect element"),
                          ({"regex": "a", "choice": ["b"]}, "give exactly one of"),
                          ({"choice": []}, "choice needs at least one string")):
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            SamplingParams.from_json(json.dumps({"structured_outputs": spec}))
    # Triton's vLLM backend takes it as a JSON string
    got = SamplingParams.from_json(json.dumps({"structured_outputs": json.dumps({"json": {"type": "object"}})}))
    assert got.structured_outputs.json_schema == '{"type": "object"}'
