"""The front of Triton's gRPC port on a ``scheduler: ensemble`` server, in the head process: clients reach Triton's
gRPC through it, and Triton itself listens on a Unix socket of the workspace (its user's alone; the shim's argv
swap, as for HTTP). A BLS server has none: its entry models need no credential, and a relayed message costs about
as much again as Triton's own handling of it (tokens/s 0.89-0.92 in three of eight ``make bench-ab`` rows).

It relays every call of Triton's ``inference.GRPCInferenceService`` as it is (bytes and metadata both ways, a stream
message by message, a client that goes away cancels its call to Triton), with two changes:

- an inference request (``ModelInfer``, each message of ``ModelStreamInfer``) for an entry model carries the stage
  credential (:data:`trident.core.auth.CREDENTIAL`) as a request parameter, in place of any the client sent. An entry
  model that is a Triton ensemble forwards its request's parameters to its steps, the stage models, which answer
  only the deployment's own callers: so an ensemble's clients, the OpenAI frontend and the warm-up hold no
  deployment credential. The request is parsed and written again (protobuf), so Triton reads the very model name
  the front read. Requests for any other model pass unchanged: a stage model still needs the credential from its
  caller.
- a message larger than the HTTP front's body limit (what the media limits let one request carry) is refused
  (RESOURCE_EXHAUSTED) before it reaches Triton, which would take 2 GiB.

While Triton does not answer (starting, restarting, stopped), calls fail UNAVAILABLE, as they would at Triton.
"""

from __future__ import annotations

import threading

import grpc
from grpc import aio

from trident.supervisor.entry_credential import CredentialForEntries
from trident.supervisor.loop_thread import LoopThread

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
NOT_PASSED = ("user-agent", "content-type", "te", "grpc-")  # metadata gRPC sets itself on each hop


def _metadata(context: aio.ServicerContext) -> tuple:
    return tuple((k, v) for k, v in context.invocation_metadata() or ()
                 if not k.startswith(":") and not k.startswith(NOT_PASSED))


def _left(context: aio.ServicerContext) -> float | None:
    """The client's deadline, as the time left to the call to Triton (None: it set none)."""
    left = context.time_remaining()
    return left if left is not None and left < 1e8 else None


class _Relay(grpc.GenericRpcHandler):
    """Each call to Triton's Unix socket, and its answer back."""

    def __init__(self, channel: aio.Channel, upstream: str, rewrite: CredentialForEntries) -> None:
        self._channel = channel
        self._upstream = upstream.removeprefix("unix:")
        self._rewrite = rewrite

    async def _fail(self, context: aio.ServicerContext, e: aio.AioRpcError) -> None:
        """End the client's call with the status Triton's ended with; the front's own failure to reach Triton as
        Triton's absence, naming no path of the host."""
        details = e.details() or ""
        if e.code() == grpc.StatusCode.UNAVAILABLE and (self._upstream in details or "failed to connect" in details):
            details = "Triton is not answering (starting, restarting or stopped); try again"
        await context.abort(e.code(), details, e.trailing_metadata() or ())

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        if not method.startswith(SERVICE):
            return None  # UNIMPLEMENTED, as at Triton
        if method == STREAM_INFER:
            return grpc.stream_stream_rpc_method_handler(self._stream)

        async def unary(request: bytes, context: aio.ServicerContext) -> bytes:
            return await self._unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)

    async def _unary(self, method: str, request: bytes, context: aio.ServicerContext) -> bytes:
        if method == INFER:
            request = self._rewrite(request)
        call = self._channel.unary_unary(method)(request, metadata=_metadata(context), timeout=_left(context))
        try:
            return await call
        except aio.AioRpcError as e:
            await self._fail(context, e)
        finally:
            call.cancel()  # (the client went away: the call to Triton ends with it)

    async def _stream(self, requests, context: aio.ServicerContext):
        async def rewritten():
            async for request in requests:
                yield self._rewrite(request)

        call = self._channel.stream_stream(STREAM_INFER)(rewritten(), metadata=_metadata(context),
                                                         timeout=_left(context))
        try:
            async for response in call:
                yield response
        except aio.AioRpcError as e:
            await self._fail(context, e)
        finally:
            call.cancel()


class GrpcFront(LoopThread):
    """Listens on the public gRPC port (bound at :meth:`start`: a taken one is a :class:`StartupError` naming it) and
    relays to Triton's gRPC Unix socket (``upstream``: a ``unix:`` target), in a thread of its own with its own
    event loop."""

    def __init__(self, host: str, port: int, upstream: str, limit: int, rewrite: CredentialForEntries) -> None:
        super().__init__()
        self.host, self.port, self.upstream, self.limit, self.rewrite = host, port, upstream, limit, rewrite
        self.what = f"gRPC port {host}:{port}"

    async def _serve(self, started: threading.Event) -> None:
        # (to Triton: no message bound, it is the deployment's own; from clients: the front's)
        channel = aio.insecure_channel(self.upstream, options=[("grpc.max_receive_message_length", -1),
                                                               ("grpc.max_send_message_length", -1)])
        server = aio.server(handlers=[_Relay(channel, self.upstream, self.rewrite)], maximum_concurrent_rpcs=None,
                            options=[("grpc.max_receive_message_length", self.limit),
                                     ("grpc.max_send_message_length", -1),
                                     ("grpc.so_reuseport", 0)])
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            try:
                bound = server.add_insecure_port(f"{host}:{self.port}")
            except RuntimeError:  # (newer gRPC raises where older ones answered 0)
                bound = 0
            if bound == 0:
                raise OSError("could not bind it (in use?)")
            await server.start()
            started.set()
            await self._stopped.wait()
        finally:
            await server.stop(grace=1.0)
            await channel.close()
