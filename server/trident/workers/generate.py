"""``generate`` (decoupled, EPD): the entry interface itself; encode, prefill and decode in one worker."""

from __future__ import annotations

from .common import OutputOptions, entry_responses, images, sampling, single, text_input

ROLES = ("encoder", "prefiller", "decoder")


def make(engine):
    async def infer(requests):
        request = single(requests)
        text, opts, params = text_input(request), OutputOptions.of(request), sampling(request)
        generation = await engine.generate(text, params, images=await images(request))
        async for responses in entry_responses(generation, opts, None if opts.exclude_input_in_output else text):
            yield responses

    return infer
