"""A caller's side of the stage protocol: calls, streams and control messages to a stage worker, on its socket.

Every caller of a stage worker uses :class:`StageClient`: the BLS schedulers (the record stages' calls, the
streaming stages' calls, a stream's :class:`~trident.protocol.Cancel`, a posted call's
:class:`~trident.protocol.Withdraw`) and the encode worker handing its record to a prefill worker
(:class:`~trident.protocol.Deliver`). Through Triton, one call crosses BLS -> Triton -> the stage's python-backend
stub -> worker and back: four hand-offs between processes, 2-3 ms on the 2-core machine (``make bench-hops``).
The worker also listens on a socket of its own (:func:`trident.workers.channel.direct_path`), named in the worker
file of its stage model's folder; on it a caller sends the same messages the stub would
(:data:`trident.protocol.StageMessage`) after both ends proved the deployment secret (:mod:`trident.auth`), and
reads the answer: two hand-offs.

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

from .. import auth
from ..errors import MalformedRecord, TridentError, Unavailable
from ..protocol import (
    WORKER_FILE, Call, Cancel, Deliver, Failure, Gone, HandTo, Reply, StageMessage, Withdraw, encode_message, error_of,
)
from ..workers.channel import ends, recv_message


class DirectStream:
    """The messages of one streamed call, for the thread that relays them: an iterator of what ``convert(message)``
    makes of each, up to the call's end (a :class:`~trident.protocol.Failure` ends it too)."""

    def __init__(self, convert: Callable[[StageMessage], list]) -> None:
        self._convert = convert
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: deque = deque()
        self._ended = False
        self._told = False  # (the reader thread's own)
        self._loop = asyncio.get_running_loop()
        self.first: asyncio.Future = self._loop.create_future()  # the first message, on the event loop

    def put(self, message: StageMessage) -> None:
        """A message from the worker (on the connection's reader thread)."""
        if not self._told:
            self._told = True
            self._loop.call_soon_threadsafe(_settle, self.first, message)
        self._messages.put(message)

    def __iter__(self) -> "DirectStream":
        return self

    def __next__(self):
        while not self._ready:
            if self._ended:
                raise StopIteration
            message = self._messages.get()
            self._ended = ends(message)
            if isinstance(message, Failure) or (isinstance(message, Reply) and message.outputs):
                self._ready.extend(self._convert(message))
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
    """One open socket to a worker: messages written from the event loop, the answers read by a thread of their
    own (a streamed call's go to its relaying thread without passing through the event loop)."""

    def __init__(self, sock: socket.socket, lost: str) -> None:
        self._sock, self._lost = sock, lost
        self._loop = asyncio.get_running_loop()
        self._send_lock = threading.Lock()
        self._pending: dict[int, asyncio.Future | DirectStream | None] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="trident-bls-direct", daemon=True)
        self._reader.start()

    @property
    def open(self) -> bool:
        return not self._closed

    def next_id(self) -> int:
        return next(self._ids)

    async def ask(self, message: StageMessage) -> StageMessage:
        """The last answer to ``message`` (a one-answer call or a control message)."""
        answer = self._loop.create_future()
        self._send(message, answer)
        try:
            return await answer
        finally:
            self._pending.pop(message.id, None)

    def stream(self, call: Call, stream: DirectStream) -> None:
        """Send a streamed call; its messages go to ``stream`` as they come."""
        self._send(call, stream)

    def post(self, message: StageMessage) -> None:
        """Send a message whose answer is dropped."""
        self._send(message, None)

    def _send(self, message: StageMessage, target) -> None:
        self._pending[message.id] = target
        try:
            if self._closed:
                raise OSError("closed")
            with self._send_lock:  # one write: the worker wakes once
                self._sock.sendall(encode_message(message))
        except OSError:
            self._pending.pop(message.id, None)
            raise NotSent from None

    def _read(self) -> None:
        try:
            while (message := recv_message(self._sock)) is not None:
                last = ends(message)
                target = self._pending.pop(message.id, None) if last else self._pending.get(message.id)
                if isinstance(target, DirectStream):
                    target.put(message)
                elif target is not None and last:
                    self._loop.call_soon_threadsafe(_settle, target, message)
        except (OSError, MalformedRecord):
            pass
        finally:
            self._closed = True
            self._sock.close()
            for rid in list(self._pending):
                target = self._pending.pop(rid, None)
                if isinstance(target, DirectStream):
                    target.put(Failure(rid, "Unavailable", self._lost))
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
                   parameters: dict | None = None, hand_to: HandTo | None = None,
                   await_record: str | None = None) -> dict[str, np.ndarray] | None:
        """The outputs of one call of ``instance``; None when it has no stage socket to take it (call it through
        Triton). Raises the stage's error (a :class:`~trident.errors.TridentError`) as it sent it."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        call = Call(connection.next_id(), inputs, outputs, parameters or {}, hand_to, await_record)
        try:
            answer = await connection.ask(call)
        except NotSent:
            return None
        if isinstance(answer, Gone):  # the worker is stopping: Triton tells what became of the instance
            return None
        if isinstance(answer, Failure):
            raise error_of(answer)
        if not answer.outputs:
            raise TridentError(f"stage instance {instance} answered without outputs")
        return answer.outputs

    async def stream(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str], parameters: dict,
                     convert: Callable[[StageMessage], list]) -> DirectStream | None:
        """A streamed call of ``instance`` (a decoupled stage), once its first message is in; None when it has no
        stage socket to take it (call it through Triton)."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        stream = DirectStream(convert)
        try:
            connection.stream(Call(connection.next_id(), inputs, outputs, parameters), stream)
        except NotSent:
            return None
        if isinstance(await stream.first, Gone):
            return None
        return stream

    async def cancel(self, instance: str, request_id: str) -> None:
        """Stop the stream started with ``request_id`` (a :class:`~trident.protocol.Cancel` message), once the
        worker has taken it."""
        connection = await self._connection(instance)
        if connection is None:
            raise Unavailable(f"stage instance {instance} has no stage socket any more")
        try:
            answer = await connection.ask(Cancel(connection.next_id(), request_id))
        except NotSent:
            raise Unavailable(f"the worker of stage instance {instance} has gone") from None
        if isinstance(answer, Failure):
            raise error_of(answer)

    async def deliver(self, instance: str, token: str, record: bytes) -> bool:
        """Hand ``record`` to the prefill call posted on ``instance`` under ``token`` (a
        :class:`~trident.protocol.Deliver` message), without waiting for the worker (its event loop may be in a
        prefill); False when it could not be written (no stage socket, or its worker has gone)."""
        return await self._post(instance, lambda id: Deliver(id, token, record))

    async def withdraw(self, instance: str, token: str) -> bool:
        """The prefill call posted on ``instance`` under ``token`` gets no record (a
        :class:`~trident.protocol.Withdraw` message, not waited for)."""
        return await self._post(instance, lambda id: Withdraw(id, token))

    async def _post(self, instance: str, make: Callable[[int], StageMessage]) -> bool:
        connection = await self._connection(instance)
        if connection is None:
            return False
        try:
            connection.post(make(connection.next_id()))
        except NotSent:
            return False
        return True

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


def responses_of(message: StageMessage) -> list:
    """A streamed call's message as data: ``[error]`` (a :class:`~trident.errors.TridentError`), or the outputs
    (name -> array) it carries."""
    if isinstance(message, Failure):
        return [error_of(message)]
    return [message.outputs] if isinstance(message, Reply) and message.outputs else []
