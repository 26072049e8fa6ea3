"""``decode`` (decoupled): ``kv_meta`` -> the entry outputs, streamed or whole."""

from __future__ import annotations

from ..errors import InvalidRequest
from .common import OutputOptions, bytes_input, entry_responses, sampling, single

ROLES = ("decoder",)


def make(engine):
    async def infer(requests):
        request = single(requests)
        kv_meta = bytes_input(request, "kv_meta")
        if kv_meta is None:
            raise InvalidRequest("kv_meta is required")
        opts, params = OutputOptions.of(request), sampling(request)
        raw = bytes_input(request, "text_input")
        text = raw.decode("utf-8", "replace") if raw is not None else None
        generation = await engine.generate(text, params, kv_meta=kv_meta)
        async for responses in entry_responses(generation, opts, None if opts.exclude_input_in_output else text):
            yield responses

    return infer
