"""Producer side: put tensors in the send pool under a lease and free them when released or expired."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import TransferConfig
from ..protocol import Transfer
from .tensors import specs_for
from .agent import NixlAgent
from .pool import MemoryPool, Region

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    region: Region
    expires_at: float


class TransferSender:
    """Publishes tensors for one READ by a consumer.

    :meth:`publish` copies the tensors back to back into a region of the send pool and returns the
    :class:`~trident.protocol.Transfer` describing it (the caller puts it in a record). The region is freed
    when the consumer's READ-completion notification (the lease id)
    arrives, or when the lease expires, whichever comes first. A background thread polls for both.
    """

    def __init__(self, agent: NixlAgent, config: TransferConfig) -> None:
        self.agent = agent
        self.config = config
        self.pool = MemoryPool("send", config.send_pool_bytes, register=agent.register)
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self.published = self.released = self.expired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._reap_loop, name="trident-lease-reaper", daemon=True)
        self._thread.start()

    def publish(self, tensors: Sequence[torch.Tensor], *, lease_s: float | None = None) -> Transfer:
        tensors = [t.detach() for t in tensors]
        if not tensors:
            raise ValueError("nothing to publish")
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        region = self.pool.alloc(nbytes)
        flat = self.pool.view(region)
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += n
        lease_id = uuid.uuid4().hex[:16]
        expires_at = time.time() + (lease_s if lease_s is not None else self.config.lease_s)
        with self._lock:
            self._leases[lease_id] = _Lease(region, expires_at)
            self.published += 1
        return Transfer(
            agent=self.agent.name,
            agent_meta=self.agent.metadata,
            regions=((self.pool.address_of(region), nbytes),),
            tensors=specs_for(tensors),
            lease_id=lease_id,
            expires_at=expires_at,
        )

    def release(self, lease_id: str) -> bool:
        """Free a lease's region now; False when it is unknown (already released or expired)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self.released += 1
        self.pool.free(lease.region)
        return True

    def poll(self) -> None:
        """Handle pending release notifications and expired leases (the reaper thread calls this)."""
        for peer, messages in self.agent.notifications().items():
            for msg in messages:
                lease_id = msg.decode(errors="replace")
                if not self.release(lease_id):
                    log.debug("release of unknown lease %s from %s ignored", lease_id, peer)
        now = time.time()
        with self._lock:
            gone = [k for k, lease in self._leases.items() if lease.expires_at <= now]
            regions = [self._leases.pop(k).region for k in gone]
            self.expired += len(gone)
        for lease_id, region in zip(gone, regions):
            self.pool.free(region)
            log.warning("lease %s expired unread; freed %d bytes", lease_id, region.nbytes)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self.poll()
            except Exception:  # keep reaping whatever one poll hit
                log.exception("lease reaper poll failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
