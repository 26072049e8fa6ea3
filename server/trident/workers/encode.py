"""``encode``: ``image`` -> ``embedding_meta`` (embeddings stay in this worker's send pool)."""

from __future__ import annotations

import numpy as np

from ..stages import encode_stage
from .common import WorkerContext, images, record_output, single

ROLES = ("encoder",)


def make(ctx: WorkerContext):
    def _encode(request):
        imgs = images(request)
        if not imgs:  # text-only request through an ensemble: nothing to encode
            return {"embedding_meta": np.array([b""], dtype=np.object_)}
        return record_output("embedding_meta", encode_stage(ctx.encoder, ctx.endpoint, imgs))

    async def infer(requests):
        return [await ctx.run(_encode, single(requests))]

    return infer
