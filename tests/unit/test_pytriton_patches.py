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

    from trident.supervisor.pytriton_patch import WAITS_FOR_READY

    assert _params(wait_for_server_ready) == ["client", "timeout_s", "headers"]
    for name in WAITS_FOR_READY:  # each imports it by name: each is patched
        assert importlib.import_module(name).wait_for_server_ready is wait_for_server_ready


def test_triton_s_exporter_errors_are_shown_once_a_minute(capsys):
    from pytriton.server.triton_server import TritonServer

    from trident.supervisor.pytriton_patch import quiet_triton_output

    assert _params(TritonServer._record_logs) == ["self", "line"]
    quiet_triton_output()
    server = TritonServer.__new__(TritonServer)
    server._verbose, server._tritonserver_logs = True, ""
    error = "[Error] File: otlp_http_client.cc:200 [OTLP HTTP Client] Session state: connection failed.\n"
    nodelay = "[WARN]  evhtp.c:4050     NODELAY NOT SUPPORTED :: (errno: Operation not supported)\n"
    orphaned = "I1129 03:36:06.240649 3636 pb_stub.cc:2145]  Non-graceful termination detected. \n"
    for chunk in (error, error.encode(), "I1127 model ", "loaded\n", error[:20], error[20:], nodelay, orphaned):
        server._record_logs(chunk)
    assert capsys.readouterr().out.splitlines() == [
        "[trident] Triton's spans not exported: Session state: connection failed.", "I1127 model loaded"]


def test_triton_s_exit_callback_and_restart_are_what_keep_workspace_and_start_again_use(tmp_path):
    """PyTriton stops itself and removes its workspace when tritonserver exits (the callback keep_workspace takes
    off), its own stop takes the callback off again (pytriton_patch.stop puts it back first), and its process wrapper
    starts again with the config's load-model list."""
    from pytriton.server.triton_server import TritonServer
    from pytriton.server.triton_server_config import TritonServerConfig
    from pytriton.triton import Triton

    assert _params(Triton._on_tritonserver_exit) == ["self", "_"]
    assert "self._triton_server.unregister_on_exit(self._on_tritonserver_exit)" in inspect.getsource(
        Triton._pre_stop_impl)
    assert "self._workspace.clean()" in inspect.getsource(Triton.stop)
    assert _params(TritonServer.register_on_exit) == _params(TritonServer.unregister_on_exit) == ["self", "callback"]
    assert "self._on_exit" in inspect.getsource(TritonServer.register_on_exit)
    assert "The method can be executed multiple times" in inspect.getsource(TritonServer.start)
    config = TritonServerConfig()
    config["model-repository"] = str(tmp_path)
    config["load-model"] = ["a", "b"]
    assert config.to_args_list()[-4:] == ["--load-model", "a", "--load-model", "b"]
    server = TritonServer(path="/bin/true", libs_path=tmp_path, config=config)
    assert server._server_config is config
    # (triton_pid: kill_if_hung kills the tritonserver process by it)
    assert "self._tritonserver_running_cmd.pid" in inspect.getsource(TritonServer.start)
