"""Faults on demand, for the tests: a stage handler wrapper (:func:`install`) that a test server's workers load
(see ``sitecustomize.py`` beside this file).

A prompt that carries ``[[trident-fault:<ErrorClass>@<stage>]]`` makes that stage raise that error of
:data:`trident.core.errors.ERRORS` before its engine runs (the records the call brought are freed, as for any refusal);
``#N`` after the stage makes it raise once the stage has sent N responses. ``[[trident-stall@<stage>]]`` holds the
request in that stage for a minute (a test can kill the worker with the request inside).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

FAULT = re.compile(r"\[\[trident-fault:(\w+)(?:@(\w+))?(?:#(\d+))?\]\]")
STALL = re.compile(r"\[\[trident-stall@(\w+)\]\]")


def _text(call) -> str:
    value = call.inputs.get("text_input")
    if value is None or not value.size:
        return ""
    first = value.reshape(-1)[0]
    return first.decode("utf-8", "replace") if isinstance(first, bytes) else str(first)


def _fault(stage: str, text: str, sent: int | None):
    """The error the text's marker names for ``stage`` after ``sent`` responses (None: before the engine runs)."""
    from trident.core.errors import ERRORS

    match = FAULT.search(text)
    after = int(match.group(3)) if match and match.group(3) else None
    if match and match.group(1) in ERRORS and match.group(2) in (None, stage) and after == sent:
        return ERRORS[match.group(1)](f"injected {match.group(1)} in the {stage} stage")
    return None


def wrap(handler, engine):
    """``handler`` (a :class:`trident.worker.infer.StageHandler`) with faults injected into its calls."""
    from trident.core.protocol import RECORD_TENSOR

    stage, infer = handler.spec.name, handler.infer
    records = [RECORD_TENSOR[kind] for kind in (handler.spec.takes, handler.spec.also_takes) if kind is not None]

    def before(call) -> None:
        text = _text(call)
        error = _fault(stage, text, None)
        if error is not None:
            for name in records:  # refused before the engine saw it: the producer may free it now
                value = call.inputs.get(name)
                if value is not None and value.size and value.reshape(-1)[0]:
                    engine.discard(value.reshape(-1)[0])
            raise error
        return text

    if handler.spec.decoupled:
        async def faulty(call):
            text = before(call)
            sent = 0
            async for item in infer(call):
                error = _fault(stage, text, sent)
                if error is not None:
                    raise error
                sent += 1
                yield item
    else:
        async def faulty(call):
            text = before(call)
            if (match := STALL.search(text)) and match.group(1) == stage:
                await asyncio.sleep(60)
            return await infer(call)

    return replace(handler, infer=faulty)


def install(infer_module) -> None:
    """Make ``trident.worker.infer.make_handler`` return wrapped handlers."""
    make_handler = infer_module.make_handler

    def faulty_make_handler(spec, engine, *args, **kwargs):
        return wrap(make_handler(spec, engine, *args, **kwargs), engine)

    infer_module.make_handler = faulty_make_handler
