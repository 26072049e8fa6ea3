"""``encode_prefill``: ``text_input`` + ``image`` -> ``kv_meta`` (encode and prefill in one worker)."""

from __future__ import annotations

from .common import images, record_output, sampling, single, text_input

ROLES = ("encoder", "prefiller")


def make(engine):
    async def infer(requests):
        request = single(requests)
        text, params = text_input(request), sampling(request)
        return [record_output("kv_meta", await engine.prefill(text, params, images=await images(request)))]

    return infer
