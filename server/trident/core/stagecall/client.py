"""A caller's side of the stage protocol: calls, streams and control messages to a stage worker's
:class:`~trident.core.stagecall.StageServer`, on its Unix socket on the same host or over TCP from another.

:class:`StageClient` is the caller with an event loop: the BLS schedulers (the record stages' calls, the
streaming stages' calls, a stream's :class:`~trident.core.protocol.Cancel`, a posted call's
:class:`~trident.core.protocol.Withdraw`) and the encode worker handing its record to a prefill worker
(:class:`~trident.core.protocol.Deliver`). :class:`StageLink` is the one without: the stage model's python-backend stub,
which carries the calls of Triton's clients and ensembles. Both write on one :class:`_Connection` per worker, after
both ends proved the deployment secret (:mod:`trident.core.auth`). Where a worker listens is in its worker file: the
stub's is in its stage model's folder, a :class:`StageClient`'s callers find it in the stage directory
(:mod:`.directory`).

A :class:`StageClient` call answers None when the instance is not there to take it: no entry in the stage
directory, no answer to the connect, stopping (it answers :class:`~trident.core.protocol.Gone`, and lets the calls it
took finish), or its socket closed before the call could be written; the caller then tries another instance. A
worker that goes away during a call fails it: 503, "the request was lost with it".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import socket
import threading
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from trident.core import auth, tracing
from trident.core.errors import MalformedRecord, StageTimeout, TridentError, Unavailable, WorkerLost
from trident.core.protocol import (
    Abandon, Call, Cancel, Claim, Deliver, Failure, Gone, HandTo, Reply, StageMessage, Stats, Withdraw, encode_message,
    error_of, failure,
)
from trident.core.stagecall import directory
from trident.core.stagecall.frames import fail_when_unanswered, ends, recv_message


log = logging.getLogger("trident")
CONNECT_S = 5.0  # a TCP stage socket that does not answer within this is gone


class DirectStream:
    """The messages of one streamed call, for the thread that relays them: an iterator of its responses as data
    (:func:`responses_of`), up to the call's end (a :class:`~trident.core.protocol.Failure` ends it too)."""

    def __init__(self) -> None:
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
                self._ready.extend(responses_of(message))
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
    """One open socket to a worker, for any thread: a message is written by the thread that sends it, and one
    reader thread hands each answer to its call's target, a callable, on that thread (a streamed call's go to
    its relaying thread, a one-answer call's to its waiter, without passing through an event loop). When the
    socket ends, each call still waiting gets a :class:`~trident.core.protocol.Failure` (``lost``: its message)."""

    def __init__(self, sock: socket.socket, session: auth.Session, lost: str, where: str = "") -> None:
        self._sock, self._session, self._lost, self._where = sock, session, lost, where
        self._send_lock = threading.Lock()
        self._pending: dict[int, Callable[[StageMessage], None] | None] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="trident-stage-client", daemon=True)
        self._reader.start()

    @property
    def open(self) -> bool:
        return not self._closed

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, message: StageMessage, target: Callable[[StageMessage], None] | None) -> None:
        """Write ``message``; ``target(answer)`` gets each answer on the reader thread (None: answers dropped).
        Raises :class:`NotSent` when the socket has closed: the worker never saw it."""
        self._pending[message.id] = target
        try:
            if self._closed:
                raise OSError("closed")
            with self._send_lock:  # one write: the worker wakes once (frames sealed in the order they are written)
                self._sock.sendall(encode_message(message, self._session))
        except OSError:
            self._pending.pop(message.id, None)
            raise NotSent from None

    async def ask(self, message: StageMessage, timeout_s: float | None = None) -> StageMessage:
        """The last answer to ``message`` (a one-answer call or a control message), on the event loop; raises
        :class:`asyncio.TimeoutError` when none came within ``timeout_s`` (a timer on the answer's own future:
        ``asyncio.wait_for`` would run the wait as a task of its own, two more turns of the loop per call)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.send(message, lambda m: ends(m) and loop.call_soon_threadsafe(_settle, answer, m))
        timer = None
        if timeout_s is not None:
            timer = loop.call_later(timeout_s, _settle, answer, None, asyncio.TimeoutError())
        try:
            return await answer
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(message.id, None)

    def _read(self) -> None:
        try:
            while (message := recv_message(self._sock, self._session)) is not None:
                target = self._pending.pop(message.id, None) if ends(message) else self._pending.get(message.id)
                if target is not None:
                    try:
                        target(message)
                    except Exception:  # one call's failure to take its answer must not stop the others'
                        log.exception("stage client: handing on an answer failed")
        except (OSError, MalformedRecord):
            pass
        finally:
            self._closed = True
            self._sock.close()
            if self._pending and self._where:  # (the client's message names no address: the log does)
                log.warning("%s (the worker%s)", self._lost, self._where)
            for rid in list(self._pending):
                target = self._pending.pop(rid, None)
                if target is not None:
                    target(failure(rid, WorkerLost(self._lost)))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader thread ends
        except OSError:
            pass


def _where(info: dict | None) -> str:
    """`` on <host>:<port>`` for a worker reached over TCP (one on another host), else nothing."""
    if info and not info.get("direct") and isinstance(info.get("tcp"), list | tuple) and len(info["tcp"]) == 2:
        return f" on {info['tcp'][0]}:{info['tcp'][1]}"
    return ""


def open_stage_socket(info: dict) -> tuple[socket.socket, auth.Session]:
    """A connection to the worker a worker file describes, both ends having proved the deployment secret for that
    socket, and the session its frames are sealed with: its Unix socket when it is on this host (``direct``), else
    its TCP one (``tcp``: host, port)."""
    sock = None
    try:
        if info.get("direct") and os.path.exists(info["direct"]):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(info["direct"])  # a local socket: at once, or refused
            where = auth.identity(info["direct"])
        else:
            host, port = info["tcp"]
            sock = socket.create_connection((str(host), int(port)), timeout=CONNECT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fail_when_unanswered(sock, CONNECT_S)
            where = auth.identity((host, port))
        session = auth.connect(sock, where)
        sock.settimeout(None)
        return sock, session
    except BaseException:
        if sock is not None:
            sock.close()
        raise


def lost_message(instance: str, info: dict) -> str:
    """What a call that its worker's end of the connection ended says: a worker on another host as such (its
    address is for the log alone, :class:`_Connection`; its pid there means nothing here, and no launcher here
    restarts it), one on this host by its pid."""
    if _where(info):
        return f"the {instance} stage's worker on another host went away; the request was lost with it"
    pid = f" (pid {info['pid']})" if info.get("pid") else ""
    return f"the {instance} stage's worker{pid} exited; the request was lost with it (the server restarts the worker)"


class StageClient:
    """Calls to stage workers, one connection per stage instance (opened on first use, again after the
    worker went away), found in the stage directory (:mod:`.directory`)."""

    def __init__(self) -> None:
        self._connections: dict[str, _Connection] = {}

    async def call(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str],
                   parameters: dict | None = None, hand_to: HandTo | None = None,
                   await_record: str | None = None, timeout_s: float | None = None) -> dict[str, np.ndarray] | None:
        """The outputs of one call of ``instance``; None when it is not there to take it (try another). Raises the
        stage's error (a :class:`~trident.core.errors.TridentError`) as it sent it, or :class:`StageTimeout` when no
        answer came within ``timeout_s`` (the worker is then told to stop the call: an :class:`Abandon`)."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        call = Call(connection.next_id(), inputs, outputs, parameters or {}, hand_to, await_record, tracing.traceparent())
        try:
            answer = await connection.ask(call, timeout_s)
        except NotSent:
            return None
        except asyncio.TimeoutError:
            with contextlib.suppress(NotSent):
                connection.send(Abandon(connection.next_id(), call.id), None)
            if where := _where(directory.lookup(instance)):  # (an address is the log's, never a client's)
                log.warning("stage instance %s%s did not answer within %g s", instance, where, timeout_s)
            raise StageTimeout(f"stage instance {instance} did not answer within {timeout_s:g} s "
                               "(scheduling.stage_timeout_s)") from None
        if isinstance(answer, Gone):  # the worker is stopping
            return None
        if isinstance(answer, Failure):
            raise error_of(answer)
        if not answer.outputs:
            raise TridentError(f"stage instance {instance} answered without outputs")
        return answer.outputs

    async def stream(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str],
                     parameters: dict) -> DirectStream | None:
        """A streamed call of ``instance`` (a decoupled stage), once its first message is in; None when it is not
        there to take it (try another)."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        stream = DirectStream()
        try:
            connection.send(Call(connection.next_id(), inputs, outputs, parameters, traceparent=tracing.traceparent()),
                            stream.put)
        except NotSent:
            return None
        if isinstance(await stream.first, Gone):
            return None
        return stream

    async def cancel(self, instance: str, request_id: str) -> None:
        """Stop the stream started with ``request_id`` (a :class:`~trident.core.protocol.Cancel` message), once the
        worker has taken it."""
        await self._ask(instance, lambda id: Cancel(id, request_id),
                        f"stage instance {instance} is not in the stage directory any more",
                        f"the worker of stage instance {instance} has gone")

    async def deliver(self, instance: str, token: str, record: bytes) -> bool:
        """Hand ``record`` to the prefill call posted on ``instance`` under ``token`` (a
        :class:`~trident.core.protocol.Deliver` message), without waiting for the worker (its event loop may be in a
        prefill); False when it could not be written (no stage socket, or its worker has gone)."""
        return await self._post(instance, lambda id: Deliver(id, token, record))

    async def withdraw(self, instance: str, token: str) -> bool:
        """The prefill call posted on ``instance`` under ``token`` gets no record (a
        :class:`~trident.core.protocol.Withdraw` message, not waited for)."""
        return await self._post(instance, lambda id: Withdraw(id, token))

    async def claim(self, producer: dict, claim: str, lease: bool = False) -> None:
        """Take what a record points to at the worker ``producer`` that made it (its worker file, from the record)
        before reading it (a :class:`~trident.core.protocol.Claim` message): the vLLM KV held under ``claim``, or with
        ``lease`` the transfer lease ``claim``. Raises its refusal, or :class:`Unavailable` when that worker is not
        there (what it held went with it)."""
        name = str(producer.get("name", "?"))
        what = "this request's embeddings or KV" if lease else "this request's KV"
        await self._ask(name, lambda id: Claim(id, claim, lease),
                        f"the worker of {name} that computed {what} is not there; they went with it",
                        f"the worker of {name} that computed {what} has gone; they went with it", producer)

    async def _ask(self, instance: str, make: Callable[[int], StageMessage], absent: str, gone: str,
                   info: dict | None = None) -> None:
        """Send the control message ``make(id)`` and wait for its answer: raises its refusal, or
        :class:`Unavailable` with ``absent`` (no connection to the worker) or ``gone`` (it went before it was sent)."""
        connection = await self._connection(instance, info)
        if connection is None:
            raise Unavailable(absent)
        try:
            answer = await connection.ask(make(connection.next_id()))
        except NotSent:
            raise Unavailable(gone) from None
        if isinstance(answer, Failure):
            raise error_of(answer)

    async def _post(self, instance: str, make: Callable[[int], StageMessage]) -> bool:
        connection = await self._connection(instance)
        if connection is None:
            return False
        try:
            connection.send(make(connection.next_id()), None)
        except NotSent:
            return False
        return True

    async def _connection(self, instance: str, info: dict | None = None) -> _Connection | None:
        """The open connection to ``instance``, or a new one to where ``info`` (a worker file) or else the stage
        directory says it listens; None when it cannot be opened. One named by its worker file is kept by its
        address too (after a head's restart, two joined workers may have swapped their instance names)."""
        key = instance if info is None else f"{instance}@{info.get('tcp')}"
        connection = self._connections.get(key)
        if connection is not None and connection.open:
            return connection
        info = info or directory.lookup(instance)
        try:
            if info is None:
                raise OSError("no entry in the stage directory")
            sock, session = await asyncio.get_running_loop().run_in_executor(None, open_stage_socket, info)
        except (OSError, ValueError, KeyError, TypeError):
            self._connections.pop(key, None)
            return None
        connection = self._connections[key] = _Connection(sock, session, lost_message(instance, info), _where(info))
        return connection

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()


class NoWorker(Exception):
    """No worker is connected to take the call."""


class StageLink:
    """One stage instance's worker, for a caller without an event loop (the stage model's python-backend stub):
    a connection kept open by a thread of its own, from the worker file at ``worker_file`` (again after the worker
    went away); calls written by the thread that sends them, answers handed to their targets on the reader
    thread (:class:`_Connection`)."""

    SEND_TIMEOUT_S = 10.0  # a call that no worker takes within this is refused (503)

    def __init__(self, instance: str, worker_file: Path) -> None:
        self._instance, self._file = instance, worker_file
        self._conn: _Connection | None = None
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="trident-stage-link", daemon=True)
        self._keeper.start()

    def _keep(self) -> None:
        told = False
        while not self._stop.is_set():
            try:
                info = json.loads(self._file.read_text())
                sock, session = open_stage_socket(info)
            except Exception as e:  # noqa: BLE001 - not there yet, or gone: try again
                if not told:
                    log.info("stage %s: waiting for its worker (%s)", self._instance, e)
                    told = True
                self._stop.wait(0.05)
                continue
            told = False
            self._conn = _Connection(sock, session, lost_message(self._instance, info), _where(info))
            self._connected.set()
            self._conn._reader.join()  # until the worker's end closes
            self._connected.clear()

    def send(self, call: Call | Stats, target: Callable[[StageMessage], None]) -> None:
        """Write ``call``; ``target(message)`` gets each answer on the reader thread, up to the last one (:func:`ends`).
        Raises :class:`NoWorker` when no worker is there to take it."""
        if not self._connected.wait(self.SEND_TIMEOUT_S) or self._conn is None:
            raise NoWorker
        conn = self._conn
        call.id = conn.next_id()
        try:
            conn.send(call, target)
        except NotSent:
            raise NoWorker from None

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            self._conn.close()
        self._keeper.join(5)


def responses_of(message: StageMessage) -> list:
    """A streamed call's message as data: ``[error]`` (a :class:`~trident.core.errors.TridentError`), or the outputs
    (name -> array) it carries."""
    if isinstance(message, Failure):
        return [error_of(message)]
    return [message.outputs] if isinstance(message, Reply) and message.outputs else []
