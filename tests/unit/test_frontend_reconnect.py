"""The OpenAI frontend's gRPC channel to Triton finds a Triton that comes back within a second or so, however long it
was gone (gRPC's own reconnect backoff grows to 120 s: the frontend answered 503 long after Triton served again)."""

from __future__ import annotations

import asyncio
import time

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from trident.core.netutil import free_ports
from trident.frontend.app import RECONNECT_BACKOFF_MS, TritonEngine

DOWN_S = 10.0  # how long Triton is away while the frontend is probed (as a readiness probe does)


class _Ready(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's ServerReady, ready: all of Triton the frontend's /health asks first."""

    async def ServerReady(self, request, context):  # noqa: N802 - the gRPC method's name
        return service_pb2.ServerReadyResponse(ready=True)


async def _back_after_probing(port: int) -> float:
    engine = TritonEngine(f"127.0.0.1:{port}")
    t0 = time.monotonic()
    while time.monotonic() - t0 < DOWN_S:  # nothing listens: every probe fails, and gRPC backs off
        assert not await engine.server_ready()
        await asyncio.sleep(0.2)
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Ready(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        back = time.monotonic()
        while not await engine.server_ready():
            assert time.monotonic() - back < 30, "the frontend never saw Triton again"
            await asyncio.sleep(0.05)
        return time.monotonic() - back
    finally:
        await engine.client.close()
        await server.stop(None)


def test_the_frontend_sees_triton_again_within_its_longest_backoff():
    """Probed every 0.2 s for 10 s with nothing listening, then a server on the port: ready within the longest backoff
    (1 s) plus a margin. With gRPC's defaults (1 s, x1.6, up to 120 s) the next attempt after 10 s of failures comes
    3 to 9 s later."""
    (port,) = free_ports(1)
    waited = asyncio.run(_back_after_probing(port))
    assert waited < RECONNECT_BACKOFF_MS[1] / 1000 + 1.0, f"{waited:.1f} s after the server was back"
