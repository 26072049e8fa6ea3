"""The stage credential in an entry model's request, on a ``scheduler: ensemble`` server: the gRPC front
(:mod:`.grpc_front`) and the HTTP front (:mod:`.http_front`) give it to every inference request for an entry model,
in place of any the client sent, and a Triton ensemble forwards it to its steps, the stage models."""

from __future__ import annotations

import json


class CredentialForEntries:
    """An inference request with the stage credential set as a parameter when its model is an entry model: a gRPC
    request's bytes (called), an HTTP request's JSON (:meth:`into_json`)."""

    def __init__(self, entries: frozenset[str], credential: str, parameter: str) -> None:
        from tritonclient.grpc import service_pb2

        self._message = service_pb2.ModelInferRequest
        self.entries, self.credential, self.parameter = entries, credential, parameter

    def __call__(self, raw: bytes) -> bytes:
        request = self._message()
        try:
            request.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - not a request Triton could read either: it answers the error
            return raw
        if request.model_name not in self.entries:
            return raw
        request.parameters[self.parameter].string_param = self.credential
        return request.SerializeToString()

    def into_json(self, body: bytes, generate: bool, head: str | None) -> tuple[bytes, str | None]:
        """An HTTP inference request's body to an entry model with the credential in it, and its
        ``Inference-Header-Content-Length`` (``head``, the client's: the length of the JSON before binary tensors):
        ``generate``'s keys that name no input are its parameters, ``infer``'s are in ``parameters``. A body that is
        not a JSON object passes as it came (Triton answers it 400), without the credential."""
        try:
            size = int(head) if head is not None else len(body)
            request = json.loads(body[:size]) if 0 <= size <= len(body) else None
        except (ValueError, UnicodeDecodeError):
            request = None
        into = request if generate or not isinstance(request, dict) else request.setdefault("parameters", {})
        if not isinstance(into, dict):
            return body, head
        into[self.parameter] = self.credential
        json_part = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()
        return json_part + body[size:], (str(len(json_part)) if head is not None else None)
