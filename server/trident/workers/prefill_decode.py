"""``prefill_decode`` (decoupled): ``text_input`` + ``embedding_meta`` -> the entry outputs."""

from __future__ import annotations

from .common import OutputOptions, bytes_input, entry_responses, sampling, single, text_input

ROLES = ("prefiller", "decoder")


def make(engine):
    async def infer(requests):
        request = single(requests)
        text, opts, params = text_input(request), OutputOptions.of(request), sampling(request)
        generation = await engine.generate(text, params, embedding_meta=bytes_input(request, "embedding_meta"))
        async for responses in entry_responses(generation, opts, None if opts.exclude_input_in_output else text):
            yield responses

    return infer
