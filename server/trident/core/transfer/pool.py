"""A block of registered memory handed out as regions: DRAM, or a GPU's memory (VRAM) for a stage on a GPU.

Registering memory with NIXL is slow, so each pool registers one buffer once, at start-up, and
allocates regions inside it (first fit over a sorted free list, regions aligned to 256 bytes).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from trident.core.device import memory_type
from trident.core.errors import PoolExhausted

ALIGN = 256


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``offset`` in a pool."""

    offset: int
    nbytes: int


class MemoryPool:
    """Registered memory split into regions; ``in_use`` counts the regions handed out."""

    def __init__(self, name: str, nbytes: int, agent=None, device: torch.device | str = "cpu") -> None:
        """``agent``: the :class:`~trident.core.transfer.agent.NixlAgent` that registers the buffer (none: a pool
        no peer reads, as in unit tests); :meth:`close` deregisters it."""
        self.name = name
        self.capacity = _aligned(nbytes)
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self.memory: tuple[str, int] = memory_type(self.buffer)  # NIXL's memory type and device id
        self.registration = agent.register(self.buffer) if agent is not None else None  # (closed by close())
        self.address = self.buffer.data_ptr()
        self.typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer seen as each dtype (tensors.unpack_tensors)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}  # offset -> aligned size

    def close(self) -> None:
        """Deregister the buffer: no peer can READ it after this."""
        if self.registration is not None:
            self.registration.close()

    def alloc(self, nbytes: int) -> Region:
        """A region of at least ``nbytes``; raises :class:`PoolExhausted` when none is free."""
        size = _aligned(max(nbytes, 1))
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._used[off] = size
                    return Region(off, nbytes)
            free_bytes = sum(s for _, s in self._free)
        raise PoolExhausted(
            f"{self.name} pool cannot fit {nbytes} bytes ({free_bytes} of {self.capacity} bytes free, "
            f"{len(self._used)} regions in use); raise its size in the transfer settings"
        )

    def free(self, region: Region) -> None:
        with self._lock:
            size = self._used.pop(region.offset, None)
            if size is None:
                raise ValueError(f"{self.name} pool: region at offset {region.offset} is not allocated")
            i = bisect.bisect(self._free, (region.offset, 0))
            self._free.insert(i, (region.offset, size))
            # Merge with the next and the previous free block.
            if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
                self._free[i] = (self._free[i][0], self._free[i][1] + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])

    def view(self, region: Region) -> torch.Tensor:
        """The region's bytes as a uint8 tensor (a view into the registered buffer)."""
        return self.buffer[region.offset : region.offset + region.nbytes]

    def address_of(self, region: Region) -> int:
        return self.address + region.offset

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._used)

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
