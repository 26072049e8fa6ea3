"""NIXL transfers between stage workers: one :class:`TransferEndpoint` per process (:mod:`.endpoint`), its
agent (:mod:`.agent`), its registered pools (:mod:`.pool`) and the tensors' layout in them (:mod:`.tensors`)."""

from __future__ import annotations

from trident.core.transfer.agent import NixlAgent, process_agent
from trident.core.transfer.endpoint import Received, TransferEndpoint, TransferReceiver, TransferSender
from trident.core.transfer.pool import MemoryPool, Region

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
