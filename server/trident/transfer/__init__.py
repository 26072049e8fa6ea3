"""NIXL transfers between stage workers.

One :class:`TransferEndpoint` per process: a NIXL agent, a send pool for what this process produces
(:class:`TransferSender`) and a receive pool for what it reads (:class:`TransferReceiver`). Only a
:class:`~trident.protocol.Transfer` (inside a record) crosses Triton; the bytes move by NIXL READ, after
which the consumer's notification lets the producer free them (or the lease expires).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import TransferConfig
from ..protocol import Transfer
from .agent import NixlAgent, process_agent
from .pool import MemoryPool, Region
from .receiver import Received, TransferReceiver
from .sender import TransferSender

__all__ = [
    "MemoryPool",
    "NixlAgent",
    "Received",
    "Region",
    "TransferEndpoint",
    "TransferReceiver",
    "TransferSender",
    "process_agent",
]


class TransferEndpoint:
    """A process's sender and receiver on its one NIXL agent."""

    def __init__(
        self, config: TransferConfig | None = None, agent: NixlAgent | None = None, extra_send_bytes: int = 0
    ) -> None:
        self.config = config or TransferConfig()
        self.agent = agent or process_agent(self.config.backend)
        self.sender = TransferSender(self.agent, self.config, extra_send_bytes)
        self.receiver = TransferReceiver(self.agent, self.config)

    def publish(self, tensors: Sequence[torch.Tensor], *, lease_s: float | None = None) -> Transfer:
        return self.sender.publish(tensors, lease_s=lease_s)

    def claim(self, transfer: Transfer) -> None:
        self.receiver.claim(transfer)

    def fetch(self, transfer: Transfer, *, claimed: bool = False) -> Received:
        return self.receiver.fetch(transfer, claimed=claimed)

    def discard(self, transfer: Transfer, *, claimed: bool = False) -> None:
        self.receiver.discard(transfer, claimed=claimed)

    def stats(self) -> dict[str, float]:
        """Counters for tests and metrics: regions in use per pool and lease outcomes."""
        s = self.sender
        return {
            "send_regions_in_use": s.pool.in_use,
            "recv_regions_in_use": self.receiver.pool.in_use,
            "send_bytes_in_use": s.pool.bytes_in_use,
            "leases": s.active_leases,
            "published": s.published,
            "released": s.released,
            "expired": s.expired,
            "fetched": self.receiver.fetched,
            "fetched_bytes": self.receiver.fetched_bytes,
            "fetch_seconds": self.receiver.fetch_seconds,
            "recv_quarantined": self.receiver.quarantined,
            **self.agent.transport_counts(),
        }

    def close(self) -> None:
        self.sender.close()
