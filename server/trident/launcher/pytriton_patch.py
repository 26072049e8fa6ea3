"""The one patch of PyTriton 0.7's internals: the launcher starts Triton through PyTriton, which waits for the
server to be READY; a Trident server is not READY until its start-up is over."""

from __future__ import annotations

import time


def _wait_for_server_live(client, timeout_s: float | None = None, headers: dict | None = None) -> None:
    """Until Triton answers as live (``client``: a tritonclient client), at most ``timeout_s``."""
    from pytriton.client.exceptions import PyTritonClientTimeoutError

    deadline = time.monotonic() + (timeout_s if timeout_s is not None else 120.0)
    while True:
        try:
            if client.is_server_live(headers=headers):
                return
        except Exception:  # noqa: BLE001 - not up yet (tritonclient raises its own and socket errors)
            pass
        if time.monotonic() > deadline:
            raise PyTritonClientTimeoutError("Waiting for the server to be live timed out.")
        time.sleep(0.1)


WAITS_FOR_READY = ("pytriton.triton", "pytriton.models.manager", "pytriton.client.client")
"""PyTriton's modules that call ``pytriton.client.utils.wait_for_server_ready`` (imported by name)."""


def bind_when_live() -> None:
    """PyTriton 0.7 limitation: it waits for the whole server to be READY before it starts, connects or binds a
    model (``Triton.connect``, its log-level check, ``ModelManager.clean``, ``ModelClient.wait_for_server``). A
    Trident server is not READY until start-up is over (the launcher's start-up gate, and entry models LOADING
    until a route of their plan has live stage instances), so the launcher waits for it to be live.
    ``tests/unit/test_pytriton_patches.py`` fails when the patched function changes."""
    import importlib

    for name in WAITS_FOR_READY:
        importlib.import_module(name).wait_for_server_ready = _wait_for_server_live
