"""Producer side: put tensors in the send pool under a lease and free them when released or expired."""

from __future__ import annotations

import hmac
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config import TransferConfig
from ..errors import PoolExhausted
from ..protocol import RELEASE_KEY_BYTES, STAMP_BYTES, Transfer
from .tensors import specs_for
from .agent import NixlAgent
from .pool import MemoryPool, Region

log = logging.getLogger(__name__)
STAMP_SLOTS = 1 << 16  # open leases a producer can keep at once


@dataclass
class _Lease:
    on_release: Callable[[], None]  # frees (or unpins) what the lease covers
    nbytes: int
    expires_at: float
    stamp: int  # slot in the stamp table
    release_key: bytes  # in the record only: the consumer proves with it that it read the lease


class StampTable:
    """Registered slots, one per open lease, each holding its lease id until the lease ends.

    A consumer READs its lease's slot after the data (:meth:`TransferReceiver.fetch`): a slot cleared or
    holding another id means the lease had ended, so the regions may have held another request's data when
    they were read (a record used by a second consumer, after the first one's release).
    """

    def __init__(self, agent: NixlAgent, slots: int = STAMP_SLOTS) -> None:
        self.buffer = torch.zeros(slots * STAMP_BYTES, dtype=torch.uint8)
        agent.register(self.buffer)
        self.address = self.buffer.data_ptr()
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, lease_id: str) -> int:
        """A slot stamped with ``lease_id``."""
        with self._lock:
            if not self._free:
                raise PoolExhausted(f"{len(self.buffer) // STAMP_BYTES} leases are open, the most a producer keeps")
            slot = self._free.pop()
        self.buffer[slot * STAMP_BYTES : (slot + 1) * STAMP_BYTES].copy_(torch.frombuffer(bytearray(lease_id.encode()), dtype=torch.uint8))
        return slot

    def clear(self, slot: int) -> None:
        self.buffer[slot * STAMP_BYTES : (slot + 1) * STAMP_BYTES].zero_()
        with self._lock:
            self._free.append(slot)

    def address_of(self, slot: int) -> int:
        return self.address + slot * STAMP_BYTES


class TransferSender:
    """Publishes tensors for one READ by a consumer.

    :meth:`publish` copies the tensors back to back into a region of the send pool and returns the
    :class:`~trident.protocol.Transfer` describing it (the caller puts it in a record). The region is freed
    when the consumer's READ-completion notification (the lease id) arrives, or once the lease has expired
    and a READ started before the expiry would have timed out, whichever comes first. A background thread polls for both while leases are open, and sleeps while none
    is (a release notification only ever names an open lease). :meth:`copy_in` and :meth:`lease` are the two
    halves, for callers that keep regions beyond one READ (the embedding cache).
    """

    def __init__(self, agent: NixlAgent, config: TransferConfig, extra_pool_bytes: int = 0) -> None:
        self.agent = agent
        self.config = config
        self.pool = MemoryPool("send", config.send_pool_bytes + extra_pool_bytes, register=agent.register)
        self.stamps = StampTable(agent)
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self.published = self.released = self.expired = 0
        self._stop = threading.Event()
        self._leased = threading.Event()  # set by lease(): wakes the reaper
        self._thread = threading.Thread(target=self._reap_loop, name="trident-lease-reaper", daemon=True)
        self._thread.start()

    def copy_in(self, tensors: Sequence[torch.Tensor], region: Region | None = None) -> Region:
        """Copy tensors back to back into ``region`` (default: a fresh one) of the send pool."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        region = region or self.pool.alloc(nbytes)
        flat = self.pool.view(region)
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[offset : offset + n].view(t.dtype).view(t.shape).copy_(t.detach())
            offset += n
        return region

    def reserve(self, dtype: torch.dtype, shape: tuple[int, ...], count: int) -> tuple[Region, list[torch.Tensor]]:
        """A fresh region of the send pool as ``count`` tensors of ``shape``, back to back, for a producer that
        computes straight into them and hands them on with :meth:`publish_in_place` (or frees the region:
        ``pool.free``)."""
        region = self.pool.alloc(count * math.prod(shape) * dtype.itemsize)
        return region, list(self.pool.view(region).view(dtype).view(count, *shape).unbind(0))

    def lease(
        self, regions: Sequence[Region], specs, on_release: Callable[[], None], *, lease_s: float | None = None
    ) -> Transfer:
        """A :class:`Transfer` for send-pool ``regions`` (read back to back as ``specs``); ``on_release``
        runs once, when the consumer's notification arrives or the lease expires."""
        lease_id = uuid.uuid4().hex[:STAMP_BYTES]
        expires_at = time.time() + (lease_s if lease_s is not None else self.config.lease_s)
        nbytes = sum(r.nbytes for r in regions)
        slot = self.stamps.take(lease_id)
        with self._lock:
            release_key = os.urandom(RELEASE_KEY_BYTES)  # never in registered memory (the stamp table is)
            self._leases[lease_id] = _Lease(on_release, nbytes, expires_at, slot, release_key)
            self.published += 1
        self._leased.set()
        return Transfer(
            agent=self.agent.name,
            agent_meta=self.agent.metadata,
            pool=(self.pool.address, self.pool.capacity),
            regions=tuple((self.pool.address_of(r), r.nbytes) for r in regions),
            tensors=tuple(specs),
            lease_id=lease_id,
            expires_at=expires_at,
            stamp=self.stamps.address_of(slot),
            release_key=release_key,
        )

    def publish(self, tensors: Sequence[torch.Tensor], *, lease_s: float | None = None) -> Transfer:
        """Copy ``tensors`` into a fresh region and lease it."""
        if not tensors:
            raise ValueError("nothing to publish")
        region = self.copy_in(tensors)
        try:
            return self.publish_in_place(region, tensors, lease_s=lease_s)
        except BaseException:
            self.pool.free(region)
            raise

    def publish_in_place(
        self, region: Region, tensors: Sequence[torch.Tensor], *, lease_s: float | None = None
    ) -> Transfer:
        """Lease ``region``, which holds ``tensors`` back to back (:meth:`reserve`); it is freed when the lease
        ends. Raising, it leaves the region to the caller."""
        return self.lease([region], specs_for(list(tensors)), lambda: self.pool.free(region), lease_s=lease_s)

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def release(self, lease_id: str, release_key: bytes) -> bool:
        """End a lease now; False when it is unknown (already released or expired) or ``release_key`` is not the
        lease's (only the consumer that holds its record can end a lease early)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or not hmac.compare_digest(lease.release_key, release_key):
                return False
            del self._leases[lease_id]
            self.released += 1
        self._end(lease)
        return True

    def _end(self, lease: _Lease) -> None:
        """Clear the lease's stamp, then free what it covers: a READ that overlaps the reuse finds the stamp
        gone when it reads it afterwards."""
        self.stamps.clear(lease.stamp)
        lease.on_release()

    def poll(self) -> None:
        """Handle pending release notifications and expired leases (the reaper thread calls this)."""
        for peer, messages in self.agent.notifications().items():
            for msg in messages:
                lease_id, key = msg[:STAMP_BYTES].decode(errors="replace"), msg[STAMP_BYTES:]
                if not self.release(lease_id, key):
                    log.debug("release of lease %s from %s ignored (unknown, or not its key)", lease_id, peer)
        # A consumer starts a READ only before expiry (less its margin) and gives up on it after its read
        # timeout: a region is reused only once no READ of it can still be running.
        cutoff = time.time() - self.config.read_timeout_s - 1.0
        with self._lock:
            gone = [(k, self._leases.pop(k)) for k, lease in list(self._leases.items()) if lease.expires_at <= cutoff]
            self.expired += len(gone)
        for lease_id, lease in gone:
            self._end(lease)
            log.warning("lease %s expired unread; freed %d bytes", lease_id, lease.nbytes)

    def _reap_loop(self) -> None:
        while not self._stop.is_set():
            if not self.active_leases:  # nothing to free: sleep until a lease opens (no busy polling)
                self._leased.wait()
                self._leased.clear()
                continue
            if self._stop.wait(self.config.poll_interval_s):
                return
            try:
                self.poll()
            except Exception:  # keep reaping whatever one poll hit
                log.exception("lease reaper poll failed")

    def close(self) -> None:
        self._stop.set()
        self._leased.set()
        self._thread.join(timeout=1.0)
