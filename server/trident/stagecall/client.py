"""A caller's side of the stage protocol: calls, streams and control messages to a stage worker, on its socket.

Every caller of a stage worker uses :class:`StageClient`: the BLS schedulers (the record stages' calls, the
streaming stages' calls, a stream's :class:`~trident.protocol.Cancel`, a posted call's
:class:`~trident.protocol.Withdraw`) and the encode worker handing its record to a prefill worker
(:class:`~trident.protocol.Deliver`). Through Triton, one call crosses BLS -> Triton -> the stage's python-backend
stub -> worker and back: four hand-offs between processes, 2-3 ms on the 2-core machine (``make bench-hops``).
The worker also listens on a socket of its own (:func:`trident.workers.channel.direct_path`), named in the worker
file of its stage model's folder; on it a caller sends the same frames the stub would (:mod:`trident.workers.wire`)
after both ends proved the deployment secret (:mod:`trident.auth`), and reads the answer: two hand-offs.

What does not change: the stage is still a Triton model (clients and ensembles call it through Triton), the
scheduler still routes among the instances Triton has ready, and the worker runs the call as it runs one from
its stub (the same checks, admission, at most ``calls_at_once`` at a time). An instance with no such socket (a
worker that joined from another host), one that does not answer the connect, or a stopping one (it answers
``GONE``, and lets the calls it took finish), or one whose socket has closed before the call could be written
is called through Triton, which tells whether it is there. A worker that goes away during a call fails it as
the stub would: 503, "the request was lost with it".
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import socket
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np
from pytriton.proxy.types import Request

from .. import auth
from ..errors import TridentError, Unavailable, from_wire, to_wire
from ..protocol import WORKER_FILE, Cancel, Deliver, Withdraw, encode_control
from ..workers.channel import CONTROL, EOS, ERROR, GONE, HEADER, recv_exact
from ..workers.wire import InlineSerializer

_wire = InlineSerializer()


class DirectStream:
    """The responses of one streamed direct call, for the thread that relays them: an iterator of what
    ``convert(flags, payload)`` makes of each message, up to the call's end (an error ends it too)."""

    def __init__(self, convert: Callable[[int, bytes], list]) -> None:
        self._convert = convert
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: deque = deque()
        self._ended = False
        self._told = False  # (the reader thread's own)
        self._loop = asyncio.get_running_loop()
        self.first: asyncio.Future = self._loop.create_future()  # the first message's flags, on the event loop

    def put(self, flags: int, payload: bytes) -> None:
        """A message from the worker (on the connection's reader thread)."""
        if not self._told:
            self._told = True
            self._loop.call_soon_threadsafe(_settle, self.first, flags)
        self._messages.put((flags, payload))

    def __iter__(self) -> "DirectStream":
        return self

    def __next__(self):
        while not self._ready:
            if self._ended:
                raise StopIteration
            flags, payload = self._messages.get()
            self._ended = bool(flags & EOS)
            if payload or flags & ERROR:
                self._ready.extend(self._convert(flags, payload))
        return self._ready.popleft()


class NotSent(Exception):
    """The call could not be written (the worker's end has closed): the worker never saw it."""


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class _Connection:
    """One open socket to a worker: calls written from the event loop, the answers read by a thread of their own
    (a streamed call's go to its relaying thread without passing through the event loop)."""

    def __init__(self, sock: socket.socket, lost: str) -> None:
        self._sock, self._lost = sock, lost
        self._loop = asyncio.get_running_loop()
        self._send_lock = threading.Lock()
        self._pending: dict[int, asyncio.Future | DirectStream] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="trident-bls-direct", daemon=True)
        self._reader.start()

    @property
    def open(self) -> bool:
        return not self._closed

    async def call(self, payload: bytes) -> tuple[int, bytes]:
        """``(flags, payload)`` of the call's one answer."""
        answer = self._loop.create_future()
        rid = self._send(payload, answer)
        try:
            return await answer
        finally:
            self._pending.pop(rid, None)

    def stream(self, payload: bytes, stream: DirectStream) -> None:
        """Send a streamed call; its messages go to ``stream`` as they come."""
        self._send(payload, stream)

    def post(self, payload: bytes, flags: int = 0) -> None:
        """Send a frame whose answer is dropped."""
        self._send(payload, None, flags)

    async def control(self, payload: bytes) -> tuple[int, bytes]:
        """``(flags, payload)`` of a control message's answer."""
        answer = self._loop.create_future()
        rid = self._send(payload, answer, CONTROL)
        try:
            return await answer
        finally:
            self._pending.pop(rid, None)

    def _send(self, payload: bytes, target, flags: int = 0) -> int:
        rid = next(self._ids) % 2**32
        self._pending[rid] = target
        try:
            if self._closed:
                raise OSError("closed")
            with self._send_lock:  # one write: the worker wakes once
                self._sock.sendall(HEADER.pack(len(payload), rid, flags) + payload)
        except OSError:
            self._pending.pop(rid, None)
            raise NotSent from None
        return rid

    def _read(self) -> None:
        try:
            while True:
                head = recv_exact(self._sock, HEADER.size)
                if head is None:
                    return
                size, rid, flags = HEADER.unpack(head)
                payload = recv_exact(self._sock, size) if size else bytearray()
                if payload is None:
                    return
                target = self._pending.pop(rid, None) if flags & EOS else self._pending.get(rid)
                if isinstance(target, DirectStream):
                    target.put(flags, bytes(payload))
                elif target is not None and flags & EOS:
                    self._loop.call_soon_threadsafe(_settle, target, (flags, bytes(payload)))
        except OSError:
            pass
        finally:
            self._closed = True
            self._sock.close()
            lost = to_wire(Unavailable(self._lost)).encode()
            for rid in list(self._pending):
                target = self._pending.pop(rid, None)
                if isinstance(target, DirectStream):
                    target.put(EOS | ERROR, lost)
                elif target is not None:
                    self._loop.call_soon_threadsafe(_settle, target, None, Unavailable(self._lost))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader thread ends
        except OSError:
            pass


class StageClient:
    """Calls to stage workers, one connection per stage instance (opened on first use, again after the
    worker went away). ``store``: the server's model repository folder, where each local stage instance's
    worker file is."""

    def __init__(self, store: Path) -> None:
        self._store = store
        self._connections: dict[str, _Connection] = {}

    async def call(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str],
                   parameters: dict | None = None) -> dict[str, np.ndarray] | None:
        """The outputs of one call of ``instance``; None when it has no direct socket to take it (call it through
        Triton). Raises the stage's error (a :class:`~trident.errors.TridentError`) as it sent it."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        request = Request(data=inputs, parameters=parameters or {}, requested_output_names=outputs)
        try:
            flags, payload = await self._answer(connection, request)
        except NotSent:
            return None
        if flags & GONE:  # the worker is stopping: Triton tells what became of the instance
            return None
        responses = _wire.deserialize_responses(payload)
        if not responses:
            raise TridentError(f"stage instance {instance} answered without outputs")
        return responses[0].data

    async def stream(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str], parameters: dict,
                     convert: Callable[[int, bytes], list]) -> DirectStream | None:
        """A streamed call of ``instance`` (a decoupled stage), once its first message is in; None when it has no
        direct socket to take it (call it through Triton)."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        request = Request(data=inputs, parameters=parameters, requested_output_names=outputs)
        stream = DirectStream(convert)
        try:
            connection.stream(_wire.serialize_requests([request]), stream)
        except NotSent:
            return None
        if await stream.first & GONE:
            return None
        return stream

    async def cancel(self, instance: str, request_id: str) -> None:
        """Stop the stream started with ``request_id`` (a :class:`~trident.protocol.Cancel` message), once the
        worker has taken it."""
        connection = await self._connection(instance)
        if connection is None:
            raise Unavailable(f"stage instance {instance} has no direct socket any more")
        try:
            flags, payload = await connection.control(encode_control(Cancel(request_id)))
        except NotSent:
            raise Unavailable(f"the worker of stage instance {instance} has gone") from None
        if flags & ERROR:
            raise from_wire(payload.decode("utf-8", "replace"))

    async def deliver(self, instance: str, token: str, record: bytes) -> bool:
        """Hand ``record`` to the prefill call posted on ``instance`` under ``token`` (a
        :class:`~trident.protocol.Deliver` message), without waiting for the worker (its event loop may be in a
        prefill); False when it could not be written (no direct socket, or its worker has gone)."""
        return await self._post(instance, encode_control(Deliver(token, record)))

    async def withdraw(self, instance: str, token: str) -> bool:
        """The prefill call posted on ``instance`` under ``token`` gets no record (a
        :class:`~trident.protocol.Withdraw` message, not waited for)."""
        return await self._post(instance, encode_control(Withdraw(token)))

    async def _post(self, instance: str, payload: bytes) -> bool:
        connection = await self._connection(instance)
        if connection is None:
            return False
        try:
            connection.post(payload, CONTROL)
        except NotSent:
            return False
        return True

    @staticmethod
    async def _answer(connection: _Connection, request: Request) -> tuple[int, bytes]:
        """``(flags, payload)`` of a one-answer call; the stage's error raised as it sent it; :class:`NotSent`."""
        flags, payload = await connection.call(_wire.serialize_requests([request]))
        if flags & ERROR:
            raise from_wire(payload.decode("utf-8", "replace"))
        return flags, payload

    async def _connection(self, instance: str) -> _Connection | None:
        connection = self._connections.get(instance)
        if connection is not None and connection.open:
            return connection
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            info = json.loads((self._store / instance / "1" / WORKER_FILE).read_text())
            sock.connect(info["direct"])  # a local socket: at once, or refused
            auth.connect(sock)  # both ends prove the deployment secret
        except (OSError, ValueError, KeyError, TypeError):
            sock.close()
            self._connections.pop(instance, None)
            return None
        lost = (f"the {instance} stage's worker (pid {info.get('pid')}) exited; the request was lost with it (the "
                "server restarts the worker)")
        connection = self._connections[instance] = _Connection(sock, lost)
        return connection

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()


def responses_of(flags: int, payload: bytes) -> list:
    """A streamed call's message as data: ``[error]`` (a :class:`~trident.errors.TridentError`), or the output
    dicts (name -> array) it carries."""
    if flags & ERROR:
        return [from_wire(payload.decode("utf-8", "replace"))]
    return [response.data for response in _wire.deserialize_responses(payload)]
