"""trident.worker.heap: with the hf engine's malloc settings, a tensor of some MiB comes from the heap and its memory
stays in the process once freed (glibc's defaults map it for itself and unmap it at the free)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, json, sys
import torch
from trident.worker.heap import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "kept" else False
before = libc.mallinfo2()
t = torch.ones(6 << 20, dtype=torch.uint8)  # 6 MiB, as the KV tensors of a long prompt
during = libc.mallinfo2()
del t
after = libc.mallinfo2()
print(json.dumps({"kept": kept, "mapped": during.hblkhd - before.hblkhd, "free_after": after.fordblks}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_freed_tensors_stay_in_the_process():
    default, kept = _probe("default"), _probe("kept")
    assert not default["kept"] and default["mapped"] >= 6 << 20  # glibc's default: a mapping of its own
    assert kept["kept"] and kept["mapped"] == 0  # from the heap
    assert kept["free_after"] >= 6 << 20  # and kept there once freed, for the next request
