"""``prefill``: ``text_input`` + ``embedding_meta`` -> ``kv_meta`` (KV stays in this worker's send pool)."""

from __future__ import annotations

from ..stages import prefill_stage
from .common import WorkerContext, bytes_input, record_output, sampling, single, text_input

ROLES = ("prefiller",)


def make(ctx: WorkerContext):
    def _prefill(request):
        record = prefill_stage(
            ctx.processor, ctx.prefiller, ctx.endpoint, text_input(request),
            bytes_input(request, "embedding_meta"), sampling(request),
        )
        return record_output("kv_meta", record)

    async def infer(requests):
        return [await ctx.run(_prefill, single(requests))]

    return infer
