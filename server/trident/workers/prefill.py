"""``prefill``: ``text_input`` + ``embedding_meta`` -> ``kv_meta`` (the KV cache stays in this worker)."""

from __future__ import annotations

from .common import bytes_input, record_output, sampling, single, text_input

ROLES = ("prefiller",)


def make(engine):
    async def infer(requests):
        request = single(requests)
        text, params = text_input(request), sampling(request)
        kv_meta = await engine.prefill(text, params, embedding_meta=bytes_input(request, "embedding_meta"))
        return [record_output("kv_meta", kv_meta)]

    return infer
