"""The spans a server traced with the file exporter (``tracing: {exporter: file, folder: DIR}``) wrote, read back
as steps on this process's ``time.monotonic_ns()`` clock (the one the benchmarks' clients time requests with)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def tracing_config(folder: Path) -> dict:
    """The config-file setting that makes a server write its spans into ``folder``."""
    return {"tracing": {"exporter": "file", "folder": str(folder)}}


def read_steps(folder: Path, process_of=lambda stem: stem) -> list[tuple[str, int, int]]:
    """Every span in ``folder`` as ``("<process>/<name>", t0, t1)``, ``process_of`` naming each file's process."""
    offset = time.time_ns() - time.monotonic_ns()  # spans carry Unix time
    out = []
    for path in folder.glob("*.jsonl"):
        process = process_of(path.stem)
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out.append((f"{process}/{rec['name']}", rec["start"] - offset, rec["end"] - offset))
    return out
