"""A process's two ends of NIXL transfers, on its one agent.

A producer (:class:`TransferSender`) puts tensors in its send pool under a lease and frees them when the consumer
has read them or the lease expires. A consumer (:class:`TransferReceiver`) READs a producer's regions into its own
receive pool. :class:`TransferEndpoint` holds one of each: one per process. Only a
:class:`~trident.core.protocol.Transfer` (inside a sealed record) crosses between stages; the bytes move by NIXL READ,
after which the consumer's notification lets the producer free them.
"""

from __future__ import annotations

import ctypes
import hmac
import ipaddress
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from trident.core.auth import SingleUse
from trident.core.config import TransferConfig
from trident.core.errors import LeaseExpired, PoolExhausted, ReplayedRecord, TransferTimeout
from trident.core.protocol import RELEASE_KEY_BYTES, STAMP_BYTES, Transfer
from trident.core.transfer.agent import NixlAgent, process_agent
from trident.core.transfer.pool import MemoryPool, Region
from trident.core.transfer.tensors import specs_for, unpack_tensors

log = logging.getLogger(__name__)


# -- the producer --------------------------------------------------------------------------------------------------
STAMP_SLOTS = 1 << 16  # open leases a producer can keep at once
# Over TCP a READ is not one-sided: the producer's UCX worker serves it only while it is progressed, which the lease
# reaper does each time it polls. A producer that other hosts can reach polls every READ_POLL_S for READ_WINDOW_S
# after it opens a lease (its READ comes then, as a rule), else every transfer.poll_interval_s; on one host (a
# loopback data address) shared memory and cma need no progress from the producer.
READ_POLL_S = 0.0005
READ_WINDOW_S = 0.25


@dataclass
class _Lease:
    on_release: Callable[[], None]  # frees (or unpins) what the lease covers
    nbytes: int
    expires_at: float
    stamp: int  # slot in the stamp table
    release_key: bytes  # in the record only: the consumer proves with it that it read the lease
    claimed: bool = False  # a consumer took it (TransferSender.take): no other one may


class StampTable:
    """Registered slots, one per open lease, each holding its lease id until the lease ends.

    A consumer READs its lease's slot after the data (:meth:`TransferReceiver.fetch`): a slot cleared or
    holding another id means the lease had ended, so the regions may have held another request's data when
    they were read (a record used by a second consumer, after the first one's release).
    """

    def __init__(self, agent: NixlAgent, slots: int = STAMP_SLOTS) -> None:
        self.buffer = torch.zeros(slots * STAMP_BYTES, dtype=torch.uint8)
        self.registration = agent.register(self.buffer)
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
    :class:`~trident.core.protocol.Transfer` describing it (the caller puts it in a record). The region is freed
    when the consumer's READ-completion notification (the lease id) arrives, or once the lease has expired
    and a READ started before the expiry would have timed out, whichever comes first. A background thread polls for both while leases are open, and sleeps while none
    is (a release notification only ever names an open lease). :meth:`copy_in` and :meth:`lease` are the two
    halves, for callers that keep regions beyond one READ (the embedding cache).
    """

    def __init__(
        self, agent: NixlAgent, config: TransferConfig, extra_pool_bytes: int = 0, device: torch.device | str = "cpu"
    ) -> None:
        self.agent = agent
        self.config = config
        self.pool = MemoryPool("send", config.send_pool_bytes + extra_pool_bytes, agent=agent, device=device)
        self.stamps = StampTable(agent)
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self.published = self.released = self.expired = 0
        self.claimed = self.claims_refused = 0  # consumers' claims of its leases granted, refused (TransferSender.take)
        self._stop = threading.Event()
        self._leased = threading.Event()  # set by lease(): wakes the reaper
        self._reachable = _reachable(config.data_address)
        self._read_until = 0.0  # (monotonic) polling every READ_POLL_S until then
        self.claim_at: dict = {}  # where consumers claim this producer's leases (its worker file, once it binds)
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
        if self._reachable:
            self._read_until = time.monotonic() + READ_WINDOW_S
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
            memory=self.pool.memory[0],
            device=self.pool.memory[1],
            claim_at=self.claim_at,
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

    def take(self, lease_id: str) -> None:
        """A consumer claims lease ``lease_id`` before its READ (a :class:`~trident.core.protocol.Claim` on this
        worker's stage socket): granted once; refused (:class:`ReplayedRecord`) to every later claim, from whichever
        consumer, and once the lease has ended. Atomic: of two consumers holding the same record, one reads it."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and not lease.claimed:
                lease.claimed = True
                self.claimed += 1
                return
            self.claims_refused += 1
        raise ReplayedRecord(f"record of lease {lease_id} was already used (claimed by a consumer), or its lease has "
                             "ended; a record is good for one read")

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
            soon = time.monotonic() < self._read_until
            if self._stop.wait(READ_POLL_S if soon else self.config.poll_interval_s):
                return
            try:
                self.poll()
            except Exception:  # keep reaping whatever one poll hit
                log.exception("lease reaper poll failed")

    def close(self) -> None:
        """Stop the reaper and deregister the pool and the stamps: no consumer READs from this producer after it."""
        self._stop.set()
        self._leased.set()
        self._thread.join(timeout=1.0)
        self.pool.close()
        self.stamps.registration.close()


def _reachable(address: str) -> bool:
    """Whether other hosts can READ from a producer whose UCX listens on ``address``."""
    try:
        return not ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return True


# -- the consumer --------------------------------------------------------------------------------------------------
class Received:
    """Tensors read into the receive pool; call :meth:`release` (or use ``with``) when done with them.

    The tensors are views into registered memory: copy what must outlive the release.
    """

    def __init__(self, pool: MemoryPool, region: Region, record: Transfer) -> None:
        self._pool = pool
        self._region: Region | None = region
        self.record = record
        self.tensors: list[torch.Tensor] = unpack_tensors(pool.buffer, record.tensors, region.offset, pool.typed)

    def release(self) -> None:
        if self._region is not None:
            self._pool.free(self._region)
            self._region = None
            self.tensors = []

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class TransferReceiver:
    """Reads the tensors a :class:`~trident.core.protocol.Transfer` describes, each record once."""

    def __init__(self, agent: NixlAgent, config: TransferConfig, device: torch.device | str = "cpu") -> None:
        self.agent = agent
        self.config = config
        self.pool = MemoryPool("recv", config.recv_pool_bytes, agent=agent, device=device)
        self.fetched = 0
        self.fetched_bytes = 0  # of the records read (their regions: the stamp aside)
        self.fetch_seconds = 0.0  # spent in their READs
        # the same two, by the memory types a READ went between ("VRAM_to_VRAM", "DRAM_to_VRAM", ...)
        self.by_memory: dict[str, list[float]] = {}
        self.quarantined = 0  # regions a timed-out READ that NIXL could not stop may still write into
        self._used = SingleUse()  # (agent, lease id) of each record read or discarded

    def close(self) -> None:
        self.pool.close()

    def _claim(self, record: Transfer) -> None:
        self._used.claim((record.agent, record.lease_id), record.expires_at,
                         f"record of lease {record.lease_id} from {record.agent}")

    def claim(self, record: Transfer) -> None:
        """Take ``record`` for this consumer before anything is read or sent on its account: refused when its
        lease ends too soon to read safely (:class:`LeaseExpired`) or this consumer has used it already
        (:class:`ReplayedRecord`). :meth:`fetch` and :meth:`discard` claim it unless told it is claimed."""
        left = record.expires_at - time.time()
        if left < self.config.lease_margin_s:
            state = f"expired {-left:.2f} s ago" if left <= 0 else f"expires in {left:.2f} s, too soon to read safely"
            raise LeaseExpired(f"lease {record.lease_id} from {record.agent} {state}")
        self._claim(record)

    def fetch(self, record: Transfer, *, claimed: bool = False) -> Received:
        """READ the record's regions into a fresh region of the receive pool, then the lease's stamp; the
        producer is notified with the second READ.

        A record is used once per consumer (:class:`~trident.core.auth.SingleUse`), but another consumer may hold
        it too (a replay to a second instance of the stage). Its READ could then come after the first one's
        release, when the producer has put another request's data in the regions. The producer clears a
        lease's stamp before it frees the regions, so a stamp that no longer holds the lease id, read after
        the data, means the data may not be this record's: refused (:class:`ReplayedRecord`).
        """
        if not claimed:
            self.claim(record)
        region = self.pool.alloc(record.nbytes + STAMP_BYTES)
        local = self.pool.address_of(region)
        lease = record.lease_id.encode()
        release = lease + record.release_key  # the producer ends the lease on this alone
        started = time.monotonic()
        deadline = started + self.config.read_timeout_s  # both READs together
        mine = self.pool.memory
        try:
            self.agent.read(record.agent, record.agent_meta, list(record.regions), local, b"", self.config.read_timeout_s,
                            local_memory=mine, remote_memory=(record.memory, record.device))
            # (the producer's stamps are in DRAM, whatever its regions' memory)
            self.agent.read(record.agent, record.agent_meta, [(record.stamp, STAMP_BYTES)], local + record.nbytes,
                            release, max(deadline - time.monotonic(), 0.001), local_memory=mine)
            stamp = self._stamp(region, record.nbytes)
            if stamp != lease:
                raise ReplayedRecord(
                    f"record of lease {record.lease_id} from {record.agent} was read after its lease ended (it was "
                    "used by another consumer first)"
                )
            received = Received(self.pool, region, record)
        except TransferTimeout as e:
            if e.aborted:
                self.pool.free(region)
            else:  # the READ may still land: never hand this memory out again
                self.quarantined += 1
                log.warning("READ from %s timed out and could not be stopped; %d bytes of the receive pool "
                            "are set aside", record.agent, region.nbytes)
            raise
        except BaseException:
            self.pool.free(region)
            raise
        seconds = time.monotonic() - started
        self.fetched += 1
        self.fetched_bytes += record.nbytes
        self.fetch_seconds += seconds
        pair = self.by_memory.setdefault(f"{record.memory}_to_{mine[0]}", [0, 0.0])
        pair[0] += record.nbytes
        pair[1] += seconds
        return received

    def _stamp(self, region: Region, offset: int) -> bytes:
        """The stamp just READ to ``offset`` in ``region`` of the receive pool (in DRAM or on the GPU)."""
        if self.pool.memory[0] == "DRAM":
            return ctypes.string_at(self.pool.address_of(region) + offset, STAMP_BYTES)
        return self.pool.view(region)[offset : offset + STAMP_BYTES].cpu().numpy().tobytes()

    def discard(self, record: Transfer, *, claimed: bool = False) -> None:
        """Tell the producer its regions will not be read, so it frees them now rather than at expiry."""
        if not claimed:
            self._claim(record)
        self.agent.notify(record.agent, record.agent_meta, record.lease_id.encode() + record.release_key)


# -- one per process -----------------------------------------------------------------------------------------------
class TransferEndpoint:
    """A process's sender and receiver on its one NIXL agent."""

    def __init__(
        self, config: TransferConfig | None = None, agent: NixlAgent | None = None, extra_send_bytes: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        """``device``: where both pools lie, the stage's device (a GPU's pools are registered as VRAM)."""
        self.config = config or TransferConfig()
        self.agent = agent or process_agent(self.config.backend)
        self.sender = TransferSender(self.agent, self.config, extra_send_bytes, device)
        self.receiver = TransferReceiver(self.agent, self.config, device)

    def publish(self, tensors: Sequence[torch.Tensor], *, lease_s: float | None = None) -> Transfer:
        return self.sender.publish(tensors, lease_s=lease_s)

    def serving_at(self, worker_file: dict) -> None:
        """Where this worker's stage socket listens (its worker file, once it binds): the consumers of its records
        claim their leases there."""
        self.sender.claim_at = dict(worker_file)

    def claim(self, transfer: Transfer) -> None:
        self.receiver.claim(transfer)

    def fetch(self, transfer: Transfer, *, claimed: bool = False) -> Received:
        return self.receiver.fetch(transfer, claimed=claimed)

    def discard(self, transfer: Transfer, *, claimed: bool = False) -> None:
        self.receiver.discard(transfer, claimed=claimed)

    def stats(self) -> dict[str, float]:
        """Counters for tests and metrics: regions in use per pool, lease outcomes, and the READs' bytes and
        seconds, also by the memory types they went between (``read_bytes_from_VRAM_to_VRAM``, ...)."""
        s = self.sender
        return {
            "send_regions_in_use": s.pool.in_use,
            "recv_regions_in_use": self.receiver.pool.in_use,
            "send_bytes_in_use": s.pool.bytes_in_use,
            "leases": s.active_leases,
            "published": s.published,
            "released": s.released,
            "expired": s.expired,
            "claimed": s.claimed,
            "claims_refused": s.claims_refused,
            "fetched": self.receiver.fetched,
            "fetched_bytes": self.receiver.fetched_bytes,
            "fetch_seconds": self.receiver.fetch_seconds,
            **{f"read_{what}_from_{pair}": v[i] for pair, v in self.receiver.by_memory.items()
               for i, what in enumerate(("bytes", "seconds"))},
            "recv_quarantined": self.receiver.quarantined,
            **self.agent.transport_counts(),
        }

    def close(self) -> None:
        """Deregister both pools from the agent (the process's, which may live on); the tensors read so far stay
        valid as tensors."""
        self.sender.close()
        self.receiver.close()
