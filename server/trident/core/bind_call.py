"""One call of the head's bind model (:data:`~trident.core.protocol.BIND_MODEL`) over Triton's HTTP: what a worker
binds and leaves with, and what the head's joined-worker watch unbinds a gone worker with."""

from __future__ import annotations

import numpy as np

from trident.core.protocol import BIND_MODEL, Bind, seal_bind


def ask(url: str, request: Bind, timeout_s: float) -> str:
    """One call of the head's bind model: the name it answers."""
    import tritonclient.http as httpclient

    scheme, _, address = url.rpartition("://")
    # (https: a TLS terminator before the head's HTTP port; the scheme is kept, and with it the certificate check)
    client = httpclient.InferenceServerClient(address, ssl=scheme.lower() == "https", network_timeout=timeout_s)
    try:
        given = httpclient.InferInput("bind", [1], "BYTES")
        given.set_data_from_numpy(np.array([seal_bind(request)], dtype=np.object_))
        answer = client.infer(BIND_MODEL, [given])
        return answer.as_numpy("name").reshape(-1)[0].decode()
    finally:
        client.close()
