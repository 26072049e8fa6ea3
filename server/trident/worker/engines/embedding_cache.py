"""The encode side's embedding cache: encoded images kept in the registered send pool, by content.

- Keyed by the image's content id (:func:`trident.core.media.content_id`) plus the model and processor
  settings, so two different images never share an entry and a changed model never reuses one.
- An LRU capped in bytes (``capacity_bytes``; 0 keeps nothing once it is read). Entries live in the send
  pool, so a hit is published as a record pointing at the cached region: no copy, no vision tower.
- Reference-counted: every record that points at an entry holds a reference until its lease ends, so an
  evicted entry's region is freed only when no READ can still be in flight.
- Encode-once: concurrent requests for an image that is being encoded wait for that one encode
  (:meth:`EmbeddingCache.claim`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trident.core.errors import PoolExhausted
from trident.core.transfer import MemoryPool, Region
from trident.core.transfer.tensors import dtype_name


_SCOPED = "@"  # in a key of one request's own (EmbeddingCache.key)


@dataclass(eq=False)
class CachedEmbedding:
    """One media item's embedding rows in the send pool."""

    key: str
    region: Region
    dtype: str  # wire name (trident.core.protocol.DTYPE_SIZES)
    shape: tuple[int, int]  # (rows, hidden)
    grid: list[int] | None  # Qwen2-VL (t, h, w)
    refs: int = 0
    seconds: float = 0.0  # Qwen2.5-VL, Qwen3-VL: a clip's seconds per temporal patch
    frames: int = 0  # Qwen3-VL: a clip's sampled frames
    indexed: bool = False  # in the LRU (else freed when the last reference goes)
    digest: bytes | None = None  # SHA-256 of its rows' bytes (None on a GPU), for the record (EmbeddingsRecord.digests)
    stand_in: Any = None  # the vllm engine's: the item's shape for vLLM's placeholders (trident.core.protocol.StandIn)


@dataclass
class _Pending:
    future: asyncio.Future
    waiters: int = 0


@dataclass
class Claim:
    """What :meth:`EmbeddingCache.claim` found for one key: a held entry, a pending encode to wait for,
    or nothing (the caller encodes it and must :meth:`EmbeddingCache.fulfil` or :meth:`EmbeddingCache.fail`)."""

    entry: CachedEmbedding | None = None
    pending: asyncio.Future | None = None


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    shared: int = 0  # encodes saved: waited on another request's encode, or a repeat within a request
    evictions: int = 0
    vision_runs: int = 0  # vision-tower passes
    images_encoded: int = 0


class EmbeddingCache:
    """Encoded images by key, inside ``pool``; thread-safe (lease releases come from the reaper thread)."""

    def __init__(self, pool: MemoryPool, capacity_bytes: int, key_prefix: str = "") -> None:
        self.pool = pool
        self.capacity = capacity_bytes
        self.key_prefix = key_prefix
        self.counters = CacheCounters()
        self._lru: OrderedDict[str, CachedEmbedding] = OrderedDict()
        self._bytes = 0
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def key(self, content_id: str, scope: str | None = None) -> str:
        """The cache key of an item; ``scope``: one request's own (a key no other request has, never kept)."""
        return f"{self.key_prefix}:{content_id}" if scope is None else f"{self.key_prefix}:{content_id}{_SCOPED}{scope}"

    # -- lookups (event-loop thread) -------------------------------------------------------------------
    def claim(self, key: str, loop: asyncio.AbstractEventLoop) -> Claim:
        """A hit (held for the caller), an encode in flight to wait on, or a claim to encode it here."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                self._lru.move_to_end(key)
                entry.refs += 1
                self.counters.hits += 1
                return Claim(entry=entry)
            pending = self._pending.get(key)
            if pending is not None:
                pending.waiters += 1
                self.counters.shared += 1
                return Claim(pending=pending.future)
            self._pending[key] = _Pending(loop.create_future())
            self.counters.misses += 1
            return Claim()

    async def wait(self, pending: asyncio.Future) -> CachedEmbedding:
        """The entry another request is encoding, held for the caller (see :meth:`fulfil`)."""
        try:
            return await asyncio.shield(pending)  # a cancelled waiter must not cancel the others
        except asyncio.CancelledError:
            pending.add_done_callback(lambda f: f.exception() is None and self.release(f.result()))
            raise

    def fulfil(self, key: str, entry: CachedEmbedding) -> None:
        """The claimed encode of ``key`` is done: wake its waiters, with one reference taken for each."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        with self._lock:
            entry.refs += pending.waiters
        pending.future.set_result(entry)

    def fail(self, key: str, error: BaseException) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.future.set_exception(error)
            pending.future.exception()  # retrieved: no "never retrieved" warning when nobody waits

    def retain(self, entry: CachedEmbedding) -> CachedEmbedding:
        with self._lock:
            entry.refs += 1
        return entry

    def release(self, entry: CachedEmbedding) -> None:
        with self._lock:
            entry.refs -= 1
            free = entry.refs == 0 and not entry.indexed
        if free:
            self.pool.free(entry.region)

    # -- stores (compute thread) -----------------------------------------------------------------------
    def store(self, key: str, tensor, grid: list[int] | None, seconds: float = 0.0, stand_in: Any = None,
              frames: int = 0) -> CachedEmbedding:
        """Copy one item's rows into the pool (evicting unused entries for room); held once for the caller."""
        nbytes = tensor.numel() * tensor.element_size()
        region = self._alloc(nbytes)
        flat = self.pool.view(region)
        flat.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        entry = CachedEmbedding(key, region, dtype_name(tensor.dtype), tuple(tensor.shape), grid, refs=1, seconds=seconds,
                                stand_in=stand_in, frames=frames, digest=digest_of(flat))
        with self._lock:
            if 0 < nbytes <= self.capacity and _SCOPED not in key:
                entry.indexed = True
                self._lru[key] = entry
                self._bytes += region.nbytes
                self._evict_over(self.capacity)
        return entry

    def _alloc(self, nbytes: int) -> Region:
        while True:
            try:
                return self.pool.alloc(nbytes)
            except PoolExhausted:
                with self._lock:
                    if not self._evict_one():
                        raise

    def _evict_over(self, limit: int) -> None:
        while self._bytes > limit and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Drop the least recently used entry (lock held); its region is freed now or by its last reader."""
        if not self._lru:
            return False
        _, entry = self._lru.popitem(last=False)
        entry.indexed = False
        self._bytes -= entry.region.nbytes
        self.counters.evictions += 1
        if entry.refs == 0:
            self.pool.free(entry.region)
        return True

    # -- counters ------------------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def stats(self) -> dict[str, int]:
        c = self.counters
        with self._lock:
            return {
                "cache_hits": c.hits, "cache_misses": c.misses, "cache_evictions": c.evictions,
                "cache_bytes": self._bytes, "cache_entries": len(self._lru), "cache_capacity": self.capacity,
                "encodes_shared": c.shared, "vision_runs": c.vision_runs, "images_encoded": c.images_encoded,
            }


def digest_of(flat) -> bytes | None:
    """SHA-256 of a region's bytes (a uint8 tensor); None for one on a GPU (its bytes would have to be copied out)."""
    return hashlib.sha256(flat.numpy()).digest() if flat.device.type == "cpu" else None


def settings_digest(model_path: str) -> str:
    """What an embedding depends on besides the image: the checkpoint's weights and processor settings."""
    h = hashlib.blake2b(digest_size=8)
    root = Path(model_path)
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        if (root / name).is_file():
            h.update(name.encode() + (root / name).read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        stat = weights.stat()
        h.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(json.dumps(str(root.resolve())).encode())
    return h.hexdigest()
