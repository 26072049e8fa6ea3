"""Each remaining patch of PyTriton 0.7's internals names the limitation it works around where it is made; these
tests fail when a patched function or class changes shape, so that a PyTriton upgrade is caught here, not in
a stage that stops answering."""

from __future__ import annotations

import importlib
import inspect


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_wait_for_server_ready_is_what_bind_when_live_replaces():
    from pytriton.client.utils import wait_for_server_ready

    from trident.workers.bind import WAITS_FOR_READY

    assert _params(wait_for_server_ready) == ["client", "timeout_s", "headers"]
    for name in WAITS_FOR_READY:  # each imports it by name: each is patched
        assert importlib.import_module(name).wait_for_server_ready is wait_for_server_ready


def test_the_model_files_patch_and_the_model_store_path_still_fit():
    """The stage model's files (bind._install_proxy_model) and where they are written (bind._remote_triton)."""
    import inspect

    from pytriton.models import manager, model

    assert _params(model.Model.generate_model) == ["self", "model_repository"]
    assert _params(model.Model.get_proxy_model_files) == ["self"]
    assert "self._model_store_path = model_store_path" in inspect.getsource(manager.ModelManager.__init__)
    assert "model.generate_model(self._model_store_path)" in inspect.getsource(manager.ModelManager)


def test_what_the_stub_uses_of_pytriton_is_still_there(monkeypatch):
    """Not patched, but used: the stage stub serves PyTriton's config hand-shake with PyTriton's classes, so that
    PyTriton's binding completes; the worker side reads it and skips the tensor store by PyTriton's own setting."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from pytriton.models import model
    from pytriton.proxy import communication
    from pytriton.proxy import model as proxy

    assert _params(communication.HandshakeServer.__init__) == ["self", "socket_path", "inference_handler_config"]
    assert _params(proxy.TritonInferenceHandlerConfigGenerator.__init__) == ["self", "data_socket"]
    assert "PYTRITON_NO_TENSORSTORE" in inspect.getsource(model.Model.__init__)
    assert 'f"{self.model_name}-config.sock"' in inspect.getsource(model.Model.setup)
