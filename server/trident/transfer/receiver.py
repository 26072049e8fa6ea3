"""Consumer side: READ a producer's regions into this process's receive pool."""

from __future__ import annotations

import ctypes
import logging
import time

import torch

from ..config import TransferConfig
from ..errors import LeaseExpired, ReplayedRecord, TransferTimeout
from ..auth import SingleUse
from ..protocol import STAMP_BYTES, Transfer
from .agent import NixlAgent
from .pool import MemoryPool, Region
from .tensors import unpack_tensors

log = logging.getLogger(__name__)


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
    """Reads the tensors a :class:`~trident.protocol.Transfer` describes, each record once."""

    def __init__(self, agent: NixlAgent, config: TransferConfig) -> None:
        self.agent = agent
        self.config = config
        self.pool = MemoryPool("recv", config.recv_pool_bytes, register=agent.register)
        self.fetched = 0
        self.fetched_bytes = 0  # of the records read (their regions: the stamp aside)
        self.fetch_seconds = 0.0  # spent in their READs
        self.quarantined = 0  # regions a timed-out READ that NIXL could not stop may still write into
        self._used = SingleUse()  # (agent, lease id) of each record read or discarded

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

        A record is used once per consumer (:class:`~trident.auth.SingleUse`), but another consumer may hold
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
        try:
            self.agent.read(record.agent, record.agent_meta, list(record.regions), local, b"", self.config.read_timeout_s)
            self.agent.read(record.agent, record.agent_meta, [(record.stamp, STAMP_BYTES)], local + record.nbytes,
                            release, max(deadline - time.monotonic(), 0.001))
            stamp = ctypes.string_at(local + record.nbytes, STAMP_BYTES)  # (our own pool's memory, just READ)
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
        self.fetched += 1
        self.fetched_bytes += record.nbytes
        self.fetch_seconds += time.monotonic() - started
        return received

    def discard(self, record: Transfer, *, claimed: bool = False) -> None:
        """Tell the producer its regions will not be read, so it frees them now rather than at expiry."""
        if not claimed:
            self._claim(record)
        self.agent.notify(record.agent, record.agent_meta, record.lease_id.encode() + record.release_key)
