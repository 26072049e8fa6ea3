"""The hf engine's compile of structured-output constraints (trident/core/structured.py ``Grammars``), with real xgrammar
and a demo checkpoint's tokenizer: once per constraint, off the event loop, within a time budget, a bounded queue."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from trident.core.errors import InvalidRequest, Unavailable
from trident.core.structured import Grammars, StructuredOutput


@pytest.fixture(scope="module")
def tokenizer(demo_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_models["llava"])


def _grammars(tokenizer, budget_s: float = 10.0) -> tuple[Grammars, list[str]]:
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], budget_s=budget_s)
    compiled: list[str] = []
    compile = grammars._compile
    grammars._compile = lambda key: (compiled.append(key), compile(key))[1]
    return grammars, compiled


def _spec(**kind) -> StructuredOutput:
    return StructuredOutput.model_validate(kind)


def _slow_schema(properties: int = 900) -> StructuredOutput:
    """A JSON schema of about 50 KB (under the size bound) whose compile takes seconds even for the demo's 3072
    tokens (3.4 s measured here, alone)."""
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,%d}" % (i % 50 + 5)} for i in range(properties)}
    return _spec(json={"type": "object", "properties": props, "required": list(props)[:400]})


def test_a_constraint_is_compiled_once_and_masks_the_logits(tokenizer):
    import torch

    grammars, compiled = _grammars(tokenizer)
    spec = _spec(regex="[0-9]{3}")

    async def twice():
        await asyncio.gather(grammars.prepare(spec), grammars.prepare(spec))  # (the same compile, shared)
        await grammars.prepare(spec)

    asyncio.run(twice())
    assert compiled == [spec.key]
    constraint = grammars.constraint(spec)
    masked = constraint.mask(torch.zeros(len(tokenizer)))
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(masked > float("-inf")).flatten().tolist()}
    assert allowed and all(text and text.isdigit() for text in allowed), sorted(allowed)[:10]
    assert compiled == [spec.key]  # (kept)


def test_a_constraint_past_the_budget_is_a_400_the_event_loop_runs_on_and_a_repeat_is_refused_at_once(tokenizer):
    grammars, compiled = _grammars(tokenizer, budget_s=0.2)
    slow = _slow_schema()
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def go():
        ticker = asyncio.create_task(tick())
        with pytest.raises(InvalidRequest, match="longer than 0.2 s to compile"):
            await grammars.prepare(slow)
        seen = ticks
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest, match="longer than 0.2 s to compile"):  # its compile still runs
            await grammars.prepare(slow)
        refused_in = time.monotonic() - t0
        fast = _spec(regex="[a-z]")  # queued behind it past the budget: the thread is busy, not its constraint slow
        with pytest.raises(Unavailable, match="compiles queued before this request's took more than 0.2 s"):
            await grammars.prepare(fast)
        ticker.cancel()
        return seen, refused_in

    seen, refused_in = asyncio.run(go())
    assert seen >= 5, seen  # the loop ran while the compile did (0.2 s of 10 ms sleeps)
    assert refused_in < 0.1 and compiled == [slow.key]
    deadline = time.monotonic() + 120
    while grammars._queued:  # the late compile ends, and is kept: the same constraint is then served at once
        assert time.monotonic() < deadline
        time.sleep(0.1)
    grammars.budget_s = 10.0
    asyncio.run(grammars.prepare(slow))
    assert compiled.count(slow.key) == 1


def test_past_the_queue_s_bound_a_compile_is_a_503(tokenizer, monkeypatch):
    grammars, _ = _grammars(tokenizer, budget_s=0.1)
    monkeypatch.setattr(Grammars, "MAX_QUEUED", 1)

    async def go():
        with pytest.raises(InvalidRequest):
            await grammars.prepare(_slow_schema())
        with pytest.raises(Unavailable, match="1 structured outputs are waiting to compile"):
            await grammars.prepare(_spec(regex="[a-z]"))

    asyncio.run(go())
    deadline = time.monotonic() + 120
    while grammars._queued:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_schema_over_the_size_bound_is_refused_before_any_compile():
    props = {f"p{i}": {"type": "string"} for i in range(5000)}
    with pytest.raises(ValueError, match="at most 65536"):
        _spec(json=json.dumps({"type": "object", "properties": props}))
