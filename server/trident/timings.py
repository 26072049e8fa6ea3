"""Step timings: when each part of a request ran in this process, for ``trident serve`` with ``trace_dir`` set.

Off unless the environment names a folder in ``TRIDENT_TRACE_DIR`` (the launcher sets it for Triton, the
BLS schedulers and every stage worker). Each process then appends one JSON line per step to
``<dir>/<name>.jsonl``: ``{"step": ..., "t0": ns, "t1": ns}`` on ``time.monotonic_ns()``, which is
CLOCK_MONOTONIC, one clock for every process of the host and the one Triton's own trace uses.

Lines carry no request id: ``make bench-hops`` sends one request at a time and gives each request the
steps that fall inside its send..done window. When tracing is off a step costs one attribute test.

Tracing never fails a request: a folder that cannot be written (a full disk, no permission) turns it off in the
process, with one warning.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ENV = "TRIDENT_TRACE_DIR"

_out = None
_lock = threading.Lock()


def start(name: str) -> None:
    """Write this process's steps to ``<TRIDENT_TRACE_DIR>/<name>.jsonl`` (a no-op when it is unset)."""
    global _out
    folder = os.environ.get(ENV)
    if not folder or _out is not None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        _out = open(Path(folder) / f"{name}.jsonl", "a", buffering=1)  # a line each, flushed as written
    except OSError as e:
        _off(e)
        return
    gc.callbacks.append(_gc_step)


def _off(error: OSError) -> None:
    """Stop tracing in this process: its folder cannot be written."""
    global _out
    out, _out = _out, None
    logging.getLogger("trident.timings").warning("step timings are off in this process: %s", error)
    if out is not None:
        try:
            out.close()
        except OSError:
            pass


_gc_t0 = 0


def _gc_step(phase: str, info: dict) -> None:
    """The garbage collector's passes over the older generations are steps too (``gc1``, ``gc2``)."""
    global _gc_t0
    if info.get("generation", 0) == 0:
        return
    if phase == "start":
        _gc_t0 = time.monotonic_ns()
    elif _gc_t0:
        mark(f"gc{info['generation']}", _gc_t0)


def enabled() -> bool:
    return _out is not None


def mark(step: str, t0: int, t1: int | None = None) -> None:
    """Record ``step`` as having run from ``t0`` to ``t1`` (default: now), in ``time.monotonic_ns()``."""
    if _out is None:
        return
    line = json.dumps({"step": step, "t0": t0, "t1": t1 if t1 is not None else time.monotonic_ns()})
    with _lock:
        try:
            if _out is not None:
                _out.write(line + "\n")
        except OSError as e:
            _off(e)


@contextmanager
def step(name: str) -> Iterator[None]:
    """Time the ``with`` body as step ``name``."""
    if _out is None:
        yield
        return
    t0 = time.monotonic_ns()
    try:
        yield
    finally:
        mark(name, t0)
