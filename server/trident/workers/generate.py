"""``generate`` (decoupled, EPD): the entry interface itself; encode, prefill and decode in one worker."""

from __future__ import annotations

from ..stages import decode_request
from .common import OutputOptions, WorkerContext, decode_here, images, local_prefill, sampling, single, text_input

ROLES = ("encoder", "prefiller", "decoder")


def make(ctx: WorkerContext):
    async def infer(requests):
        request = single(requests)
        text, opts, params = text_input(request), OutputOptions.of(request), sampling(request)
        result = await ctx.run(local_prefill, ctx, text, images(request), params)
        prompt = None if opts.exclude_input_in_output else text
        async for responses in decode_here(ctx, decode_request(result, params), opts, prompt):
            yield responses

    return infer
