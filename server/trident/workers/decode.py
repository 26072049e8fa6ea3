"""``decode`` (decoupled): ``kv_meta`` -> the entry outputs, streamed or whole."""

from __future__ import annotations

from ..errors import InvalidRequest
from ..stages import receive_kv
from .common import OutputOptions, WorkerContext, bytes_input, decode_here, sampling, single

ROLES = ("decoder",)


def make(ctx: WorkerContext):
    async def infer(requests):
        request = single(requests)
        kv_meta = bytes_input(request, "kv_meta")
        if kv_meta is None:
            raise InvalidRequest("kv_meta is required")
        opts, params = OutputOptions.of(request), sampling(request)
        text = bytes_input(request, "text_input")
        prompt = None if opts.exclude_input_in_output or text is None else text.decode("utf-8", "replace")
        decode_request = await ctx.run(receive_kv, ctx.endpoint, kv_meta, params)
        async for responses in decode_here(ctx, decode_request, opts, prompt):
            yield responses

    return infer
