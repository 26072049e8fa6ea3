"""``prefill_decode`` (decoupled): ``text_input`` + ``embedding_meta`` -> the entry outputs."""

from __future__ import annotations

from ..stages import decode_request, prepare_prompt, receive_embeddings, run_prefill
from .common import OutputOptions, WorkerContext, bytes_input, decode_here, sampling, single, text_input

ROLES = ("prefiller", "decoder")


def make(ctx: WorkerContext):
    def _prefill(text, embedding_meta, params):
        if embedding_meta is None:
            return run_prefill(ctx.prefiller, prepare_prompt(ctx.processor, text, []), None, params)
        prompt, emb, release = receive_embeddings(ctx.endpoint, ctx.processor, text, embedding_meta)
        try:
            return run_prefill(ctx.prefiller, prompt, emb, params)
        finally:
            release()

    async def infer(requests):
        request = single(requests)
        text, opts, params = text_input(request), OutputOptions.of(request), sampling(request)
        result = await ctx.run(_prefill, text, bytes_input(request, "embedding_meta"), params)
        prompt = None if opts.exclude_input_in_output else text
        async for responses in decode_here(ctx, decode_request(result, params), opts, prompt):
            yield responses

    return infer
