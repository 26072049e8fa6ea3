"""`trident serve` for end-to-end tests (:class:`trident.dev.served.Server`) and what tests check of its workers."""

from __future__ import annotations

import contextlib
import time

from trident.dev.served import Server, descendants, held

__all__ = ["Server", "descendants", "serving", "wait_drained"]


@contextlib.contextmanager
def serving(model: str, workspace, *, timeout: float = 240, **kwargs):
    """A ready `trident serve` of ``model`` (:class:`Server` arguments), stopped at the end, where it must
    exit cleanly (0)."""
    srv = Server(model, workspace, **kwargs)
    try:
        srv.wait_ready(timeout=timeout)
        yield srv
    finally:
        assert srv.stop() == 0, "\n".join(srv.log[-30:])


def wait_drained(server: Server, stages: set[str], timeout: float = 10.0) -> dict[str, dict]:
    """Wait until no worker holds anything for a request (:func:`trident.dev.served.held`); assert it, and
    that no lease expired. Returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        busy = held(stats)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stages <= set(stats)
    assert not busy, busy
    assert all(v.get("expired", 0) == 0 for v in stats.values()), stats
    return stats


def vllm_python() -> str:
    """The vLLM environment's interpreter (``TRIDENT_VLLM_PYTHON``, else the checkout's ``.venv-vllm``)."""
    import os
    from pathlib import Path

    import pytest

    repo = Path(__file__).resolve().parents[2]
    python = os.environ.get("TRIDENT_VLLM_PYTHON") or str(repo / ".venv-vllm" / "bin" / "python")
    if not os.path.exists(python):
        pytest.skip(f"no vLLM environment at {python}: run `make install-vllm` (make test does)")
    return python
