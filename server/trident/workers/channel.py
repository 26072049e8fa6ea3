"""The channel between a stage model's python-backend stub and its worker: one Unix stream socket per instance.

PyTriton binds a stage model into Triton (config, load, hand-shake) and, by default, also carries every
request and response between the stub and the worker: the stub's execute thread hands each request to an
asyncio loop thread, which sends it over a ZeroMQ DEALER socket (whose own I/O threads pass it on); the
worker's connector loop thread receives it and hands it to an inference loop thread, and the responses
travel the same hops back, each message behind an ``asyncio.wait_for`` of its own. On 2 cores that was
~1.2 ms each way per call. Every hop is a thread to wake, and a thread that has slept for a while takes
~0.1-0.2 ms to wake here. Here:

- stub (:class:`StubChannel`, in place of PyTriton's ``TritonRequestsServer``): the execute thread writes the
  request to the socket itself; one reader thread reads the responses and either hands a one-answer stage's
  response to the waiting execute call or, for a decoupled stage, sends it to Triton itself. When the
  worker's end closes (it exited), the calls waiting on it fail at once (503).
- worker (:class:`WorkerChannel`, in place of PyTriton's ``RequestsResponsesConnector`` and
  ``InferenceHandler``): one thread, one event loop, on which the requests are read, the inference callable
  runs and the responses are written. A one-answer stage's response and its end travel as one message.

Every message is one of :data:`trident.protocol.StageMessage` in a frame of its own (:func:`~trident.protocol.encode_message`):
a :class:`~trident.protocol.Call` one way, its :class:`~trident.protocol.Reply` (s), :class:`~trident.protocol.Failure` or
:class:`~trident.protocol.Gone` the other, and the control messages, each under the caller's id for it. The socket is a file of the workspace beside PyTriton's
(``<instance>-stage.sock``), made by the stub; the worker connects when PyTriton sets the model up. The
tensors have been checked by Triton against the model's config before they reach the stub.

The worker also takes calls straight from the scheduler (:mod:`trident.stagecall`), on a socket of its
own (:func:`direct_path`, named in the worker file of its stage model's folder): the same messages, served the
same way, without the round trip through Triton and the stub. That socket is a file in a folder only this
user can open, not a port.

"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import itertools
import logging
import os
import queue
import socket
import shutil
import struct
import tempfile
import threading
import time
from typing import Callable

from .. import auth
from ..errors import MalformedRecord
from ..protocol import FRAME, MAX_FRAME, Call, Cancel, Deliver, Failure, Gone, Reply, StageMessage, Withdraw, \
    decode_message, encode_message, failure

SEND_TIMEOUT_S = 10.0  # a call that no worker takes within this is refused (503)
CONNECT_TIMEOUT_S = 60.0  # how long a worker waits for its stub's socket
DIRECT_SOCKET = "calls.sock"
DIRECT_DIR_PREFIX = "trident-calls-"
DRAIN_S = 60.0  # how long a stopping worker lets the direct calls it took finish

log = logging.getLogger("trident.worker")


class NoWorker(Exception):
    """No worker is connected to take the call."""


def socket_path(requests_url: str) -> str:
    """The channel's socket file from PyTriton's requests-server URL of the instance (``ipc://...-server.sock``)."""
    return requests_url.removeprefix("ipc://").removesuffix("-server.sock") + "-stage.sock"


def direct_path() -> str:
    """This worker process's direct socket, in a folder of its own made on first use (mode 0700)."""
    if "path" not in _direct:
        folder = tempfile.mkdtemp(prefix=DIRECT_DIR_PREFIX)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _direct["path"] = os.path.join(folder, DIRECT_SOCKET)
    return _direct["path"]


_direct: dict = {}  # this worker's direct socket: {"path": ..., "host": the WorkerChannel serving it,
#                    "control": the stage handler's control(message), :func:`take_control`}


def take_control(handle: Callable) -> None:
    """``handle(message)`` gets the control messages that come on this worker's stage socket."""
    _direct["control"] = handle


def recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    """``n`` bytes from a blocking socket; None at its end."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def ends(message: StageMessage) -> bool:
    """Whether ``message`` is the last of its call."""
    return not isinstance(message, Reply) or message.end


def recv_message(conn: socket.socket) -> StageMessage | None:
    """The next message on a blocking socket; None at its end. Raises :class:`MalformedRecord` for a frame that
    is not one (the connection is then useless)."""
    head = recv_exact(conn, FRAME.size)
    if head is None:
        return None
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME:
        raise MalformedRecord(f"a stage frame of {size} bytes")
    body = recv_exact(conn, size)
    return None if body is None else decode_message(body)


async def read_message(reader: asyncio.StreamReader) -> StageMessage:
    """The next message on a stream (``asyncio.IncompleteReadError`` at its end)."""
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if size > MAX_FRAME:
        raise MalformedRecord(f"a stage frame of {size} bytes")
    return decode_message(await reader.readexactly(size))


# -- stub side ---------------------------------------------------------------------------------------------
class StubChannel:
    """The stub's end: the execute thread writes the calls, one reader thread (:meth:`run`) reads the answers.

    ``lost()`` gives the error for calls whose worker went away.
    """

    def __init__(self, url: str, lost: Callable[[], Exception]) -> None:
        self.path = socket_path(url)
        if os.path.exists(self.path):  # left by an earlier stub of this instance
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(1)
        self._listener.settimeout(0.5)  # how often the accept loop looks for the stop
        self._conn: socket.socket | None = None
        self._connected = threading.Event()
        self._send_lock = threading.Lock()
        self._lost = lost
        self._pending: dict[int, Callable[[StageMessage], None]] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()

    def send(self, call: Call, on_message: Callable[[StageMessage], None]) -> None:
        """Write ``call``; ``on_message(message)`` gets each answer on the reader thread, up to the last one
        (:func:`ends`). Raises :class:`NoWorker` when no worker is there to take it (or the reader has already
        given the call its error, when the worker went away as it was sent)."""
        if not self._connected.wait(SEND_TIMEOUT_S):
            raise NoWorker
        call.id = rid = next(self._ids)
        self._pending[rid] = on_message
        try:
            with self._send_lock:
                conn = self._conn
                if conn is None:
                    raise NoWorker
                conn.sendall(encode_message(call))  # one write, so that the worker wakes once
        except (OSError, NoWorker):
            if self._pending.pop(rid, None) is not None:  # else the reader has failed the call already
                raise NoWorker from None

    def run(self) -> None:
        """The reader thread: accept the worker, then hand each answer to its call until the worker's end
        closes; the calls still waiting then fail."""
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                auth.accept(conn)  # a worker of this deployment, or nobody
            except auth.NotAuthenticated as e:
                log.warning("stage stub: refused a connection to %s: %s", self.path, e)
                conn.close()
                continue
            conn.settimeout(None)
            self._conn = conn
            self._connected.set()
            try:
                self._read(conn)
            finally:
                self._connected.clear()
                with self._send_lock:
                    self._conn = None
                conn.close()
                error = self._lost()
                for rid in list(self._pending):
                    handler = self._pending.pop(rid, None)  # (a call whose send failed meanwhile is gone)
                    if handler is not None:
                        self._deliver(handler, failure(rid, error))

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                message = recv_message(conn)
            except MalformedRecord as e:
                log.error("stage stub: the worker sent %s; closing its connection", e)
                return
            if message is None:
                return
            handler = self._pending.pop(message.id, None) if ends(message) else self._pending.get(message.id)
            if handler is not None:
                self._deliver(handler, message)

    @staticmethod
    def _deliver(handler, message: StageMessage) -> None:
        try:
            handler(message)
        except Exception:  # one call's failure to answer must not stop the others'
            log.exception("stage stub: handling a response failed")

    def close(self) -> None:
        """Stop the reader thread (and with it the connection)."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        """After :meth:`run` has returned: remove the socket."""
        self._listener.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class OneAnswer:
    """A one-answer call's last message, handed from the reader thread to the execute thread."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, message: StageMessage) -> None:
        if ends(message):
            self._q.put(message)

    def wait(self, alive: Callable[[], bool]) -> StageMessage:
        while True:
            try:
                return self._q.get(timeout=2.0)
            except queue.Empty:
                if not alive():
                    raise RuntimeError("the stage stub's reader thread stopped") from None


# -- worker side -------------------------------------------------------------------------------------------
class WorkerChannel(threading.Thread):
    """The worker's end of one stage instance: calls in, the stage's function, answers out, all on this thread's
    event loop. Stands in for PyTriton's ``RequestsResponsesConnector`` (same constructor; the serializer it is
    given is not used: the messages are :data:`~trident.protocol.StageMessage`); :class:`ChannelInference`
    attaches the function: ``fn(call)`` returns the outputs (name -> array) of a one-answer stage, or is an async
    iterator of a decoupled stage's."""

    def __init__(self, url: str, serializer_deserializer=None) -> None:
        super().__init__(daemon=True, name="trident-stage-channel")
        self._path = socket_path(url)
        self._callable: Callable | None = None
        self._attached = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._closed = False
        self._stopping = False  # no more direct calls
        self._direct_calls: set[asyncio.Task] = set()

    def attach(self, model_callable: Callable) -> None:
        self._callable = model_callable
        self._attached.set()

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self._path)
                await auth.connect_stream(reader, writer)
                return reader, writer
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or self._closed:
                    raise
                await asyncio.sleep(0.05)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        reader, writer = await self._connect()
        self._writer = writer
        if self._closed:
            writer.close()
        direct = await self._offer_direct()
        try:
            await self._read_calls(reader, writer)
        finally:
            if direct is not None:
                await self._stop_direct(direct)

    async def _stop_direct(self, direct: asyncio.AbstractServer) -> None:
        """The stub has gone (the stage model was unloaded: the worker is stopping). Triton let the calls it had
        in the stage finish; so do the direct calls taken, and later ones are answered :class:`Gone` (the
        scheduler then asks Triton, which says the instance is not there)."""
        self._stopping = True
        direct.close()
        if _direct.get("host") is self:
            del _direct["host"]
        try:
            os.unlink(self._direct_path)  # (its folder goes at the process's exit)
        except OSError:
            pass
        if self._direct_calls:
            await asyncio.wait(set(self._direct_calls), timeout=DRAIN_S)

    async def _offer_direct(self) -> asyncio.AbstractServer | None:
        """The direct socket, served on this channel's loop (that of the engine when the stage has one instance)
        by the first channel of the worker, when :func:`direct_path` was asked for (a worker bound into a
        server on this host)."""
        path = _direct.get("path")
        if path is None or self._closed or _direct.setdefault("host", self) is not self:
            return None
        if os.path.exists(path):
            os.unlink(path)
        self._direct_path = path
        return await asyncio.start_unix_server(self._read_direct, path=path)

    async def _read_direct(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await auth.accept_stream(reader, writer)  # a caller of this deployment, or it gets nothing
        except auth.NotAuthenticated as e:
            log.warning("worker: refused a connection to its stage socket: %s", e)
            writer.close()
            return
        try:
            await self._read_calls(reader, writer, direct=True)
        except asyncio.CancelledError:  # the loop ends (the worker stops) with the scheduler still connected;
            pass  # asyncio's server would log the cancel of its connection's task as an error

    async def _read_calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direct: bool = False) -> None:
        """Serve the messages of one connection (the stub's, or a caller's on the stage socket) until it closes;
        the calls still running then are cancelled."""
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                message = await read_message(reader)
                if not isinstance(message, Call):
                    await self._control(writer, message, direct)
                    continue
                if direct and self._stopping:
                    await self._write(writer, Gone(message.id))
                    continue
                if not direct:  # the stub's calls come from Triton's clients: the record hand-off is the scheduler's
                    message.hand_to = message.await_record = None
                task = asyncio.ensure_future(self._handle(writer, message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if direct:
                    self._direct_calls.add(task)
                    task.add_done_callback(self._direct_calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the other end went away, or close()
        except MalformedRecord as e:
            log.warning("worker: a caller sent %s; closing its connection", e)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, message: StageMessage) -> None:
        if writer.is_closing():
            return
        writer.write(encode_message(message))  # one write: the caller wakes once
        await writer.drain()

    async def _control(self, writer: asyncio.StreamWriter, message: StageMessage, direct: bool) -> None:
        """A control message: handed to the stage's handler (:meth:`StageHandler.control
        <trident.workers.infer.StageHandler.control>`) on this loop, answered with an empty :class:`Reply` (or
        its :class:`Failure`)."""
        from ..errors import InvalidRequest, TridentError, Unauthenticated

        try:
            handle = _direct.get("control")
            if not direct:
                raise Unauthenticated("control messages come on the stage socket only")
            if not isinstance(message, (Cancel, Deliver, Withdraw)):
                raise InvalidRequest(f"a caller does not send {type(message).__name__} messages")
            if handle is None:
                raise TridentError("this stage takes no control messages")
            done = handle(message)
            if inspect.isawaitable(done):  # run on the engine's loop (:func:`trident.workers.bind._instances`)
                await done
            await self._write(writer, Reply(message.id))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the connection serves on
            log.info("stage control message refused: %s", e)
            await self._write(writer, failure(message.id, e))

    async def _handle(self, writer: asyncio.StreamWriter, call: Call) -> None:
        from ..errors import TridentError, client_message

        try:
            if not self._attached.is_set():
                await asyncio.get_running_loop().run_in_executor(None, self._attached.wait, 5.0)
            if self._callable is None:
                raise RuntimeError("the stage's inference function is not attached (the worker is stopping)")
            result = self._callable(call)
            if inspect.isasyncgen(result):
                async for outputs in result:
                    await self._write(writer, Reply(call.id, outputs, end=False))
                await self._write(writer, Reply(call.id))
            else:
                await self._write(writer, Reply(call.id, await result))
        except asyncio.CancelledError:
            await self._write(writer, failure(call.id, RuntimeError("the worker is stopping")))
            raise
        except Exception as e:
            if isinstance(e, TridentError) and type(e) is not TridentError:
                log.info("stage request refused: %s", client_message(e))
            else:
                log.warning("stage request failed", exc_info=True)
            await self._write(writer, failure(call.id, e))

    def close(self) -> None:
        """End the connection (and with it the thread); safe to call again."""
        self._closed = True
        if self._loop is not None and self._writer is not None:
            try:
                self._loop.call_soon_threadsafe(self._writer.close)
            except RuntimeError:  # the loop has ended already
                pass


class ChannelInference:
    """Stands in for PyTriton's ``InferenceHandler`` (same constructor): attaches the stage's function to its
    :class:`WorkerChannel`, which runs it."""

    def __init__(self, model_callable, requests_responses_connector: WorkerChannel, validator=None, name=None) -> None:
        self._channel = requests_responses_connector
        self._callable = model_callable

    def start(self) -> None:
        self._channel.attach(self._callable)

    def on_inference_handler_event(self, fn) -> None:
        """PyTriton's unrecoverable-error events: this channel has none."""

    def stop(self) -> None:
        self._channel.close()

    def join(self, timeout: float | None = None) -> None:
        self._channel.join(timeout)

    def is_alive(self) -> bool:
        return self._channel.is_alive()


def install_worker_side() -> None:
    """PyTriton's model binding uses this channel (the worker's side; the stub's is in :mod:`.proxy_model`)."""
    from pytriton.models import model as _model

    _model.RequestsResponsesConnector = WorkerChannel
    _model.InferenceHandler = ChannelInference

