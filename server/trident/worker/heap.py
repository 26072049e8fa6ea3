"""The C heap of a process that makes and drops large tensors at every request: keep freed memory for reuse.

glibc hands a freed block of more than ``M_MMAP_THRESHOLD`` back to the kernel with ``munmap``, and trims an
arena whose free top exceeds ``M_TRIM_THRESHOLD``; its dynamic thresholds start at 128 KiB and follow the
largest block freed so far. A prefill's KV cache is a dozen or more such blocks (the llava demo's: 12 of about
0.6 MiB), dropped right after the worker copied them into its send pool: that ``del`` took 0.86 ms of the
prefill stage's answer in ``make bench-hops``, and the next request faulted the same pages in again.
With fixed thresholds (blocks up to 32 MiB from the heap; an arena's free top kept up to 256 MiB) the same
``del`` takes 0.01 ms and the pages stay mapped.

A no-op where the C library is not glibc (musl, or another allocator preloaded: it has its own settings).
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's upper bound for it (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 256 << 20

_kept = False


def keep_freed_memory() -> bool:
    """Set this process's glibc malloc thresholds (see the module docstring); True when they are set.
    Safe to call more than once."""
    global _kept
    if _kept:
        return True
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError) as e:
        log.debug("mallopt unavailable: %s", e)
    return _kept
