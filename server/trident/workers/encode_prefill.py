"""``encode_prefill``: ``text_input`` + ``image`` -> ``kv_meta`` (encode and prefill in one worker)."""

from __future__ import annotations

from ..stages import publish_kv
from .common import WorkerContext, images, local_prefill, record_output, sampling, single, text_input

ROLES = ("encoder", "prefiller")


def make(ctx: WorkerContext):
    def _run(request):
        result = local_prefill(ctx, text_input(request), images(request), sampling(request))
        return record_output("kv_meta", publish_kv(ctx.endpoint, result))

    async def infer(requests):
        return [await ctx.run(_run, single(requests))]

    return infer
