"""The patches of PyTriton 0.7's internals (the launcher starts Triton through PyTriton; workers bind
through the head's bind model, without PyTriton) names the limitation it works around where it is made; this test
fails when the patched function changes shape, so that a PyTriton upgrade is caught here."""

from __future__ import annotations

import importlib
import inspect


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_wait_for_server_ready_is_what_bind_when_live_replaces():
    from pytriton.client.utils import wait_for_server_ready

    from trident.launcher.pytriton_patch import WAITS_FOR_READY

    assert _params(wait_for_server_ready) == ["client", "timeout_s", "headers"]
    for name in WAITS_FOR_READY:  # each imports it by name: each is patched
        assert importlib.import_module(name).wait_for_server_ready is wait_for_server_ready


def test_triton_s_exporter_errors_are_shown_once_a_minute(capsys):
    from pytriton.server.triton_server import TritonServer

    from trident.launcher.pytriton_patch import quiet_triton_output

    assert _params(TritonServer._record_logs) == ["self", "line"]
    quiet_triton_output()
    server = TritonServer.__new__(TritonServer)
    server._verbose, server._tritonserver_logs = True, ""
    error = "[Error] File: otlp_http_client.cc:200 [OTLP HTTP Client] Session state: connection failed.\n"
    nodelay = "[WARN]  evhtp.c:4050     NODELAY NOT SUPPORTED :: (errno: Operation not supported)\n"
    for chunk in (error, error.encode(), "I1127 model ", "loaded\n", error[:20], error[20:], nodelay):
        server._record_logs(chunk)
    assert capsys.readouterr().out.splitlines() == [
        "[trident] Triton's spans not exported: Session state: connection failed.", "I1127 model loaded"]
