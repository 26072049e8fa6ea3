"""The encode stage's request flow around an encoder, for every engine: the embedding cache's claims, encodes
shared between requests, and the record over the cached regions.

An engine gives :class:`EncodeStage` one thing, ``start``: a function that starts encoding the items a request
claimed and returns a future of their cache entries (the hf engine runs transformers' encoder; the vllm engine an
encode-only vLLM engine, :mod:`trident.worker.engines.vllm_encoder`).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Callable

from trident.core import tracing
from trident.core.media import MediaItem, counts
from trident.core.processor import Processor
from trident.core.transfer import TransferEndpoint
from trident.worker.engines import handoff
from trident.worker.engines.base import Encoded
from trident.worker.engines.embedding_cache import CachedEmbedding, EmbeddingCache

Start = Callable[[list[tuple[str, MediaItem]]], asyncio.Future]  # (cache key, item) pairs -> future of entries


class EncodeStage:
    def __init__(self, processor: Processor, cache: EmbeddingCache, endpoint: TransferEndpoint, start: Start) -> None:
        self.processor = processor
        self.cache = cache
        self.endpoint = endpoint
        self._start = start

    async def encode(self, media: list[MediaItem], private: bool = False) -> Encoded:
        """Each distinct item of the request from the cache, from another request's encode in flight, or
        from one encoder pass over the rest; the record points at the cached regions. ``private``: every item from
        this request's own encoder pass, and none kept after its record is read (``embedding_cache_scope:
        request``: another request can tell nothing of it from its own latency)."""
        self.processor.check_kinds(counts(media))
        cache, loop = self.cache, asyncio.get_running_loop()
        scope = secrets.token_hex(8) if private else None
        keys = [cache.key(item.content_id, scope) for item in media]
        held: dict[str, CachedEmbedding] = {}
        waits: dict[str, asyncio.Future] = {}
        mine: dict[str, MediaItem] = {}
        report: dict = {"hits": 0, "misses": 0, "shared": 0, "kinds": {}}  # (and each kind's: the metrics' label)

        def count(item: MediaItem, outcome: str) -> None:
            report[outcome] += 1
            by_kind = report["kinds"].setdefault(item.kind, {"hits": 0, "misses": 0, "shared": 0})
            by_kind[outcome] += 1

        for key, item in zip(keys, media):
            if key in held or key in waits or key in mine:  # the same image again in this request
                count(item, "shared")
                cache.counters.shared += 1
                continue
            claim = cache.claim(key, loop)
            if claim.entry is not None:
                held[key] = claim.entry
                count(item, "hits")
            elif claim.pending is not None:
                waits[key] = claim.pending
                count(item, "shared")
            else:
                mine[key] = item
                count(item, "misses")
        try:
            if mine:
                held.update(await self._encode_claimed(mine))
            for key, pending in waits.items():
                held[key] = await cache.wait(pending)
        except BaseException:
            for entry in held.values():
                cache.release(entry)
            for key, pending in waits.items():  # the reference taken for us when that encode ends
                if key not in held:
                    pending.add_done_callback(lambda f: f.exception() is None and cache.release(f.result()))
            raise
        entries = [held[key] for key in keys]
        seen: set[str] = set()
        for key in keys:  # a record holds one reference per image it lists, repeats included
            if key in seen:
                cache.retain(held[key])
            seen.add(key)
        record = handoff.publish_cached_embeddings(
            self.endpoint.sender, cache, entries, [i.content_id for i in media], [i.kind for i in media]
        )
        report.update(vision_runs=int(bool(mine)), cache_bytes=cache.bytes, evictions=cache.counters.evictions)
        with tracing.step("record_encode"):
            return Encoded(record.encode(), report)

    async def _encode_claimed(self, claimed: dict[str, MediaItem]) -> dict[str, CachedEmbedding]:
        """Encode the items this request claimed, in one encoder pass, and wake the requests waiting on them
        whatever happens to this one."""
        cache, keys = self.cache, list(claimed)
        run = self._start(list(claimed.items()))

        def settle(done: asyncio.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                error = done.exception() if not done.cancelled() else asyncio.CancelledError()
                for key in keys:
                    cache.fail(key, error)
            else:
                for key, entry in zip(keys, done.result()):
                    cache.fulfil(key, entry)

        if run.done():  # encoded on the event loop: wake the waiters before anything else runs
            settle(run)
        else:
            run.add_done_callback(settle)
        try:
            entries = await asyncio.shield(run)
        except asyncio.CancelledError:  # this request went away: its references go when the encode ends
            run.add_done_callback(lambda f: f.exception() is None and [cache.release(e) for e in f.result()])
            raise
        return dict(zip(keys, entries))
