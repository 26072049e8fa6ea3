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


def test_the_stub_side_replacements_keep_their_constructors(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from pytriton.proxy import model as proxy

    assert _params(proxy.TritonRequestsServer.__init__) == [
        "self", "url", "responses_handle_fn", "serializer_deserializer", "model_config"]
    assert _params(proxy.get_config_from_handshake_server) == ["socket_path", "timeout_s"]
    assert hasattr(proxy, "TensorStoreSerializerDeserializer")


def test_the_worker_side_replacements_keep_their_constructors():
    from pytriton.models import model

    assert _params(model.RequestsResponsesConnector.__init__)[:3] == ["self", "url", "serializer_deserializer"]
    assert _params(model.InferenceHandler.__init__)[:5] == [
        "self", "model_callable", "requests_responses_connector", "validator", "name"]
    assert _params(model.Model.generate_model) == ["self", "model_repository"]
    assert _params(model.Model.get_proxy_model_files) == ["self"]
