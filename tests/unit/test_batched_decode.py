"""Continuous-batching decode: requests decoded together give exactly the tokens each gives alone."""

from __future__ import annotations

import pytest

from support import chat_prompt, make_image
from trident.engines.base import DecodeRequest
from trident.engines.hf.decoder import HFDecoder
from trident.engines.hf.model import HFEncoder, HFModel, HFPrefiller
from trident.processor import SamplingParams

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
