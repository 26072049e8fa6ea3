"""A stopping server's drain, as its processes see it: markers in the stage directory
(:mod:`trident.core.stagecall.directory`, private to the server). ``trident serve`` starts the drain on SIGTERM or Ctrl-C
(:func:`start`); from then on every entry model refuses new requests at once (503, ``Unavailable``) and serves those
in flight to their end, and each one says when it has none left (:func:`mark_drained`), which the launcher waits for
(at most ``drain_s``) before it stops Triton."""

from __future__ import annotations

from pathlib import Path

from trident.core.stagecall import directory

MARK = "draining"


def _marker(name: str) -> Path | None:
    base = directory.folder()
    return base / name if base is not None else None


def start() -> None:
    if (path := _marker(MARK)) is not None:
        path.touch(mode=0o600)


def draining() -> bool:
    """Whether the server is stopping (a stat: cheap enough for every request)."""
    path = _marker(MARK)
    return path is not None and path.exists()


def mark_drained(mode: str) -> None:
    """Entry model ``mode`` has no request left in flight."""
    if (path := _marker(f"drained-{mode}")) is not None:
        path.touch(mode=0o600)


def drained(mode: str) -> bool:
    path = _marker(f"drained-{mode}")
    return path is not None and path.exists()
