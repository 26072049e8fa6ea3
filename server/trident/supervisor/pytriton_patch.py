"""The patches of PyTriton 0.7's internals: the launcher starts Triton through PyTriton, which waits for the
server to be READY (a Trident server is not READY until its start-up is over), and prints each line Triton writes
(Triton's trace exporter writes two per batch it cannot send)."""

from __future__ import annotations

import time

EXPORTER_LINE = "[OTLP HTTP Client]"  # what opentelemetry-cpp's OTLP exporter in Triton prefixes its errors with
EXPORTER_QUIET_S = 60.0
UNIX_SOCKET_NOISE = "NODELAY NOT SUPPORTED"  # libevhtp's warning at each server it starts on a Unix socket (http_front)
STUB_ORPHANED = "Non-graceful termination detected"  # each python-backend stub's line when Triton died under it


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


def quiet_triton_output() -> None:
    """PyTriton 0.7 prints every line of Triton's output. With tracing to a collector that cannot be reached,
    Triton's exporter writes two lines for each batch of spans; they are shown once a minute, in one line, as
    Trident's own exporters say it (``tracing._OnceAMinute``); the other lines are passed on whole (PyTriton
    reads Triton's output unbuffered, in parts of lines). libevhtp's warning that a Unix socket takes no TCP_NODELAY
(one line per server, at each start) is dropped, and so is each stub's line when Triton died under it (the
launcher says that Triton exited, once). ``tests/unit/test_pytriton_patches.py`` fails when
    the patched method changes."""
    from pytriton.server.triton_server import TritonServer

    record = TritonServer._record_logs
    if getattr(record, "trident_quiet", False):
        return
    last = [-EXPORTER_QUIET_S]

    def _record_logs(self, chunk) -> None:  # (what Triton wrote as it was read: parts of lines)
        text = getattr(self, "_trident_partial", "") + (
            chunk.decode("utf-8", "replace") if isinstance(chunk, bytes) else chunk)
        *lines, self._trident_partial = text.split("\n")
        for line in lines:
            if UNIX_SOCKET_NOISE in line or STUB_ORPHANED in line:
                continue
            if EXPORTER_LINE in line:
                now = time.monotonic()
                if now - last[0] < EXPORTER_QUIET_S:
                    continue
                last[0] = now
                line = f"[trident] Triton's spans not exported: {line.split(EXPORTER_LINE, 1)[1].strip()}"
            record(self, line + "\n")

    _record_logs.trident_quiet = True
    TritonServer._record_logs = _record_logs


def keep_workspace(triton) -> None:
    """PyTriton 0.7 limitation: when ``tritonserver`` exits, PyTriton's :class:`~pytriton.triton.Triton` stops itself
    and removes its workspace, the model store with it (the stage models' folders and their worker files). The
    launcher starts Triton again instead (:func:`start_again`), so the exit callback is taken off;
    :func:`stop` puts it back for PyTriton's own stop. ``tests/unit/test_pytriton_patches.py`` fails when the
    attributes these use change."""
    triton._triton_server.unregister_on_exit(triton._on_tritonserver_exit)


def triton_pid(triton) -> int:
    """The pid of ``triton``'s ``tritonserver`` process."""
    return triton._triton_server._tritonserver_running_cmd.pid


def start_again(triton, load: list[str]) -> None:
    """Start ``triton``'s ``tritonserver`` process again (the same arguments, its workspace as it was), loading only
    the models named in ``load`` at start-up (the rest are the launcher's to load)."""
    server = triton._triton_server
    server._server_config["load-model"] = list(load)
    server.start()


def stop(triton) -> None:
    """PyTriton's stop of ``triton`` (its process, then its workspace), with the exit callback it expects back."""
    if triton._on_tritonserver_exit not in triton._triton_server._on_exit:
        triton._triton_server.register_on_exit(triton._on_tritonserver_exit)
    triton.stop()
