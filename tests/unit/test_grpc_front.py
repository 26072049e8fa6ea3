"""The gRPC front (supervisor/grpc_front.py) between a real tritonclient and a real gRPC server on a Unix socket that
answers as Triton's service would (each request's model name and parameters back): what passes, what it adds, what
it refuses."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from trident.core.netutil import free_ports
from trident.supervisor.entry_credential import CredentialForEntries
from trident.supervisor.grpc_front import GrpcFront

CREDENTIAL = "c" * 64
LIMIT = 1 << 20


def _echo(request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    """A response whose output ``seen`` holds the model name and parameters the upstream got."""
    seen = {"model": request.model_name,
            "parameters": {k: v.string_param or v.int64_param for k, v in request.parameters.items()}}
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    response.outputs.add(name="seen", datatype="BYTES", shape=[1])
    raw = json.dumps(seen).encode()
    response.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)
    return response


class _Upstream(grpc.GenericRpcHandler):
    def service(self, details):
        if details.method.endswith("/ModelInfer"):
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: _echo(request), request_deserializer=service_pb2.ModelInferRequest.FromString,
                response_serializer=service_pb2.ModelInferResponse.SerializeToString)
        if details.method.endswith("/ModelStreamInfer"):
            def stream(requests, context):
                for request in requests:
                    yield service_pb2.ModelStreamInferResponse(infer_response=_echo(request))
            return grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=service_pb2.ModelInferRequest.FromString,
                response_serializer=service_pb2.ModelStreamInferResponse.SerializeToString)
        if details.method.endswith("/ServerLive"):
            def live(request, context):
                if dict(context.invocation_metadata()).get("x-probe") != "kept":
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the client's metadata did not come through")
                return service_pb2.ServerLiveResponse(live=True)
            return grpc.unary_unary_rpc_method_handler(
                live, request_deserializer=service_pb2.ServerLiveRequest.FromString,
                response_serializer=service_pb2.ServerLiveResponse.SerializeToString)
        return None


@pytest.fixture
def front(tmp_path):
    socket = f"unix:{tmp_path / 'grpc'}:8001"
    upstream = grpc.server(futures.ThreadPoolExecutor(4), handlers=[_Upstream()])
    upstream.add_insecure_port(socket)
    upstream.start()
    (port,) = free_ports(1)
    relay = GrpcFront("127.0.0.1", port, socket, LIMIT,
                      CredentialForEntries(frozenset({"e_p_d"}), CREDENTIAL, "trident_stage_key"))
    relay.start()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        yield client, upstream
    finally:
        client.close()
        relay.stop()
        upstream.stop(0)


def _seen(result) -> dict:
    return json.loads(result.as_numpy("seen").reshape(-1)[0])


def _inputs(size: int = 8) -> list:
    t = grpcclient.InferInput("x", [size], "UINT8")
    t.set_data_from_numpy(np.zeros(size, np.uint8))
    return [t]


def test_an_entry_model_s_request_gets_the_credential_in_place_of_the_client_s(front):
    client, _ = front
    assert _seen(client.infer("e_p_d", _inputs())) == {"model": "e_p_d", "parameters": {"trident_stage_key": CREDENTIAL}}
    got = _seen(client.infer("e_p_d", _inputs(), parameters={"trident_stage_key": "mine", "other": "kept"}))
    assert got["parameters"] == {"trident_stage_key": CREDENTIAL, "other": "kept"}


def test_other_models_requests_pass_as_they_are(front):
    client, _ = front
    assert _seen(client.infer("prefill", _inputs())) == {"model": "prefill", "parameters": {}}
    assert _seen(client.infer("prefill", _inputs(), parameters={"trident_stage_key": "mine"}))["parameters"] == \
        {"trident_stage_key": "mine"}
    assert client.is_server_live(headers={"x-probe": "kept"})  # (metadata passes)


def test_a_request_naming_an_entry_model_and_then_another_is_the_other_s():
    """Protobuf keeps a field's last value: the front reads the name Triton reads, and passes such bytes unchanged."""
    rewrite = CredentialForEntries(frozenset({"e_p_d"}), CREDENTIAL, "trident_stage_key")
    raw = service_pb2.ModelInferRequest(model_name="e_p_d").SerializeToString() \
        + service_pb2.ModelInferRequest(model_name="prefill").SerializeToString()
    assert rewrite(raw) == raw
    again = service_pb2.ModelInferRequest.FromString(rewrite(
        service_pb2.ModelInferRequest(model_name="prefill").SerializeToString()
        + service_pb2.ModelInferRequest(model_name="e_p_d").SerializeToString()))
    assert again.model_name == "e_p_d" and again.parameters["trident_stage_key"].string_param == CREDENTIAL
    assert rewrite(b"\xff\xff not protobuf") == b"\xff\xff not protobuf"


def test_a_stream_passes_message_by_message_each_request_rewritten(front):
    client, _ = front
    got: list = []
    done = threading.Event()

    def callback(result, error):
        got.append(error or _seen(result))
        if len(got) == 2:
            done.set()

    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("e_p_d", _inputs())
        client.async_stream_infer("decode", _inputs(), parameters={"trident_stage_key": "mine"})
        assert done.wait(30), got
    finally:
        client.stop_stream()
    assert got == [{"model": "e_p_d", "parameters": {"trident_stage_key": CREDENTIAL}},
                   {"model": "decode", "parameters": {"trident_stage_key": "mine"}}]


def test_a_message_over_the_limit_is_refused_before_triton(front):
    client, _ = front
    with pytest.raises(InferenceServerException) as refused:
        client.infer("e_p_d", _inputs(LIMIT + 1))
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value


def test_triton_away_is_unavailable(front):
    client, upstream = front
    upstream.stop(0)
    with pytest.raises(InferenceServerException) as away:
        client.infer("e_p_d", _inputs())
    assert away.value.status() == "StatusCode.UNAVAILABLE", away.value
    assert "Triton is not answering" in away.value.message() and "grpc:8001" not in away.value.message()
