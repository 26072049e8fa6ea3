"""``encode``: ``image`` -> ``embedding_meta`` (embeddings stay in this worker's send pool)."""

from __future__ import annotations

from .common import images, record_output, single

ROLES = ("encoder",)


def make(engine):
    async def infer(requests):
        imgs = await images(single(requests))
        # a text-only request through an ensemble: nothing to encode, the next stage gets an empty record
        return [record_output("embedding_meta", await engine.encode(imgs) if imgs else None)]

    return infer
