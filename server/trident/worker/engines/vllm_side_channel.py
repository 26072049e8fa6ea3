"""vLLM's NIXL side channel, closed to anyone who cannot prove the deployment secret.

A vLLM KV producer (its connector's scheduler) answers ``get_meta_msg`` on a ZeroMQ ROUTER socket with its NIXL
agent metadata: the memory keys and base addresses of its KV cache, enough for anyone who has them to READ or WRITE
other tenants' KV. vLLM answers any peer, and one message it cannot decode ends its listener thread for good (no
new or restarted decode worker can then take KV from that engine).

Here both ends of the exchange go through :func:`sealed_zmq_ctx` in place of vLLM's ``zmq_ctx`` (vLLM's own code
runs unchanged between): the consumer's request is sealed with the deployment's key (:func:`trident.core.auth.sign`,
with a fresh nonce and the time), and the producer's answer (the metadata and its clock) is sealed with the same
nonce. The producer drops, unanswered, any message that does not open under one of the deployment's keys, is older
than :data:`FRESH_S`, or is not vLLM's ``(get_meta_msg, pp_rank, tp_rank)``; its listener, if it fails all the
same, starts again (:func:`_listener_that_survives`). The consumer takes only an answer sealed for its own request:
nobody without the secret can read the metadata, forge it or replay an old answer. Refusals are logged in one line a
minute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import msgspec
import zmq

from trident.core import auth
from trident.core.errors import TridentError

FRESH_S = 60.0  # a request sealed longer ago than this (or this far ahead) is not answered
NONCE_BYTES = 16
LOG_EVERY_S = 60.0

log = logging.getLogger("trident.core.transfer")


class _Refusals:
    """Dropped messages, said in one line a minute with their count."""

    def __init__(self) -> None:
        self._count, self._last, self._lock = 0, -LOG_EVERY_S, threading.Lock()

    def __call__(self, why: str) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < LOG_EVERY_S:
                return
            count, self._count, self._last = self._count, 0, now
        log.warning("vLLM's NIXL side channel dropped %d message(s) in the last minute; the last: %s", count, why)


refused = _Refusals()


class SealedRequester:
    """vLLM's REQ socket (the KV consumer's handshake): each request sealed, each answer opened and checked."""

    def __init__(self, sock) -> None:
        self._sock, self._nonce = sock, b""

    def __getattr__(self, name):  # (setsockopt and the rest: the socket's own)
        return getattr(self._sock, name)

    def send(self, data: bytes, *args, **kwargs):
        self._nonce = os.urandom(NONCE_BYTES)
        return self._sock.send(auth.sign(msgspec.msgpack.encode((self._nonce, time.time(), data))), *args, **kwargs)

    def recv_multipart(self, *args, **kwargs) -> list[bytes]:
        parts = self._sock.recv_multipart(*args, **kwargs)
        try:
            if len(parts) != 1:
                raise ValueError(f"{len(parts)} parts")
            nonce, payload, clock = msgspec.msgpack.decode(auth.verify(parts[0]))
        except (TridentError, ValueError, TypeError, msgspec.DecodeError) as e:
            raise RuntimeError(f"vLLM NIXL side channel: the producer's answer is not sealed for this deployment "
                               f"({type(e).__name__})") from None
        if nonce != self._nonce:
            raise RuntimeError("vLLM NIXL side channel: an answer to another request (a replay?)")
        return [payload, clock]


class SealedListener:
    """vLLM's ROUTER socket (the KV producer's listener): only requests sealed by this deployment, fresh and
    well-formed, reach vLLM's loop; its answers go out sealed for the request they answer."""

    def __init__(self, sock) -> None:
        self._sock, self._nonces = sock, {}

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def recv_multipart(self, *args, **kwargs) -> list[bytes]:
        while True:  # (zmq.Again, vLLM's idle tick, passes through)
            parts = self._sock.recv_multipart(*args, **kwargs)
            try:
                identity, empty, sealed = parts
                nonce, sent_at, data = msgspec.msgpack.decode(auth.verify(sealed))
                if abs(time.time() - float(sent_at)) > FRESH_S:
                    raise ValueError("a stale request")
                message, pp_rank, tp_rank = msgspec.msgpack.decode(data)
                if message != b"get_meta_msg" or type(pp_rank) is not int or type(tp_rank) is not int:
                    raise ValueError("not vLLM's get_meta_msg")
            except (TridentError, ValueError, TypeError, msgspec.DecodeError) as e:
                refused(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            self._nonces[identity] = nonce
            return [identity, empty, data]

    def send_multipart(self, parts, *args, **kwargs):
        identity, empty, payload, clock = parts
        sealed = auth.sign(msgspec.msgpack.encode((self._nonces.pop(identity, b""), payload, clock)))
        return self._sock.send_multipart((identity, empty, sealed), *args, **kwargs)


def sealed_zmq_ctx(vllm_zmq_ctx):
    """vLLM's ``zmq_ctx``, its sockets sealed: a REQ socket a :class:`SealedRequester`, a ROUTER one a
    :class:`SealedListener`."""

    @contextlib.contextmanager
    def ctx(socket_type, addr):
        with vllm_zmq_ctx(socket_type, addr) as sock:
            yield SealedListener(sock) if socket_type == zmq.ROUTER else SealedRequester(sock)

    ctx.trident_sealed = True
    return ctx


def _listener_that_survives(listen):
    """vLLM's listener loop, started again (on the same port) whenever it fails, until it is told to stop."""

    def run(encoded_data, ready_event, stop_event, host, port):
        while True:
            try:
                return listen(encoded_data, ready_event, stop_event, host, port)
            except Exception as e:  # noqa: BLE001 - one bad message must not end the side channel for good
                refused(f"the listener failed ({type(e).__name__}: {str(e)[:200]}); listening again")
                if stop_event.is_set():
                    return None
                time.sleep(0.1)

    run.trident_sealed = True
    return run


def close() -> None:
    """Seal vLLM's NIXL side channel in this process (idempotent): vLLM's engine processes call it as they load
    Trident's connector (:mod:`.vllm_connector`)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker

    for module in (base_scheduler, base_worker):
        if not getattr(module.zmq_ctx, "trident_sealed", False):
            module.zmq_ctx = sealed_zmq_ctx(module.zmq_ctx)
    scheduler = base_scheduler.NixlBaseConnectorScheduler
    listen = scheduler.__dict__["_nixl_handshake_listener"].__func__
    if not getattr(listen, "trident_sealed", False):
        scheduler._nixl_handshake_listener = staticmethod(_listener_that_survives(listen))
