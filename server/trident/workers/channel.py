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

A message is a header (payload bytes, call id, flags) and its payload: :mod:`.wire`'s msgpack frames, or for
an error :func:`trident.errors.to_wire`'s envelope. The socket is a file of the workspace beside PyTriton's
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

EOS, ERROR, GONE = 1, 2, 4  # response flags (GONE: a direct call the stopping worker did not take)
CONTROL = 8  # a caller's frame that carries a control message (:data:`trident.protocol.Control`), not a call
HEADER = struct.Struct("!IIB")  # payload bytes, call id, flags
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


# -- stub side ---------------------------------------------------------------------------------------------
class StubChannel:
    """The stub's end: the execute thread writes the calls, one reader thread (:meth:`run`) reads the answers.

    ``lost()`` gives the error envelope for calls whose worker went away.
    """

    def __init__(self, url: str, lost: Callable[[], bytes]) -> None:
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
        self._pending: dict[int, Callable[[int, bytes], None]] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()

    def send(self, payload: bytes, on_response: Callable[[int, bytes], None]) -> None:
        """Write one call; ``on_response(flags, payload)`` gets each answer on the reader thread, the last one
        with :data:`EOS`. Raises :class:`NoWorker` when no worker is there to take it (or the reader has
        already given the call its error, when the worker went away as it was sent)."""
        if not self._connected.wait(SEND_TIMEOUT_S):
            raise NoWorker
        rid = next(self._ids) % 2**32
        self._pending[rid] = on_response
        try:
            with self._send_lock:
                conn = self._conn
                if conn is None:
                    raise NoWorker
                head = HEADER.pack(len(payload), rid, 0)
                if len(payload) < 65536:  # one write, so that the worker wakes once
                    conn.sendall(head + payload)
                else:
                    conn.sendall(head)
                    conn.sendall(payload)
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
                        self._deliver(handler, EOS | ERROR, error)

    def _read(self, conn: socket.socket) -> None:
        while True:
            head = recv_exact(conn, HEADER.size)
            if head is None:
                return
            size, rid, flags = HEADER.unpack(head)
            payload = recv_exact(conn, size) if size else bytearray()
            if payload is None:
                return
            handler = self._pending.pop(rid, None) if flags & EOS else self._pending.get(rid)
            if handler is not None:
                self._deliver(handler, flags, bytes(payload))

    @staticmethod
    def _deliver(handler, flags: int, payload: bytes) -> None:
        try:
            handler(flags, payload)
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
    """A one-answer call's response, handed from the reader thread to the execute thread."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, flags: int, payload: bytes) -> None:
        self._q.put((flags, payload))

    def wait(self, alive: Callable[[], bool]) -> tuple[int, bytes]:
        while True:
            try:
                return self._q.get(timeout=2.0)
            except queue.Empty:
                if not alive():
                    raise RuntimeError("the stage stub's reader thread stopped") from None


# -- worker side -------------------------------------------------------------------------------------------
class WorkerChannel(threading.Thread):
    """The worker's end of one stage instance: requests in, the inference callable, responses out, all on
    this thread's event loop. Stands in for PyTriton's ``RequestsResponsesConnector`` (same constructor);
    :class:`ChannelInference` attaches the callable."""

    def __init__(self, url: str, serializer_deserializer) -> None:
        super().__init__(daemon=True, name="trident-stage-channel")
        self._path = socket_path(url)
        self._serializer = serializer_deserializer
        self._callable: Callable | None = None
        self._validator = None
        self._one_answer = True
        self._attached = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._closed = False
        self._stopping = False  # no more direct calls
        self._direct_calls: set[asyncio.Task] = set()

    def attach(self, model_callable: Callable, validator, decoupled: bool) -> None:
        from pytriton.proxy.inference import _AsyncGenForCallableAdapter

        self._callable = _AsyncGenForCallableAdapter(model_callable)
        self._validator = validator
        self._one_answer = not decoupled
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
        in the stage finish; so do the direct calls taken, and later ones are answered :data:`GONE` (the
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
        """Serve the calls of one connection (the stub's, or a scheduler's direct one) until it closes; the calls
        still running then are cancelled."""
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                size, rid, flags = HEADER.unpack(await reader.readexactly(HEADER.size))
                payload = await reader.readexactly(size) if size else b""
                if flags & CONTROL:  # (only the stage socket carries them: the stub never sends one)
                    await self._control(writer, rid, payload, direct)
                    continue
                if direct and self._stopping:
                    await self._write(writer, rid, EOS | GONE, b"")
                    continue
                task = asyncio.ensure_future(self._handle(writer, rid, payload, direct))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if direct:
                    self._direct_calls.add(task)
                    task.add_done_callback(self._direct_calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the other end went away, or close()
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, rid: int, flags: int, payload: bytes) -> None:
        if writer.is_closing():
            return
        writer.writelines((HEADER.pack(len(payload), rid, flags), payload))  # one write: the stub wakes once
        await writer.drain()

    async def _control(self, writer: asyncio.StreamWriter, rid: int, payload: bytes, direct: bool) -> None:
        """A control message: handed to the stage's handler (:meth:`StageHandler.control
        <trident.workers.infer.StageHandler.control>`) on this loop, answered with its end (or its error)."""
        from ..errors import TridentError, Unauthenticated, to_wire
        from ..protocol import decode_control

        try:
            handle = _direct.get("control")
            if not direct:
                raise Unauthenticated("control messages come on the stage socket only")
            if handle is None:
                raise TridentError("this stage takes no control messages")
            done = handle(decode_control(payload))
            if inspect.isawaitable(done):  # run on the engine's loop (:func:`trident.workers.bind._instances`)
                await done
            await self._write(writer, rid, EOS, b"")
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the connection serves on
            log.info("stage control message refused: %s", e)
            await self._write(writer, rid, EOS | ERROR, to_wire(e).encode())

    async def _handle(self, writer: asyncio.StreamWriter, rid: int, payload: bytes, direct: bool = False) -> None:
        from ..errors import TridentError, client_message, to_wire
        from ..protocol import DIRECT_ONLY

        try:
            if not self._attached.is_set():
                await asyncio.get_running_loop().run_in_executor(None, self._attached.wait, 5.0)
            if self._callable is None:
                raise RuntimeError("the stage's inference function is not attached (the worker is stopping)")
            requests = self._serializer.deserialize_requests(payload)
            if not direct:  # through Triton, from any client: the record hand-off is the scheduler's alone
                for request in requests:
                    for name in DIRECT_ONLY:
                        (request.parameters or {}).pop(name, None)
            held = None
            async for responses in self._callable(requests):
                self._validator.validate_responses(requests, responses)
                if self._one_answer:  # sent with the end, as one message
                    held = responses
                    continue
                await self._write(writer, rid, 0, self._serializer.serialize_responses(responses))
            await self._write(writer, rid, EOS, self._serializer.serialize_responses(held) if held is not None else b"")
        except asyncio.CancelledError:
            await self._write(writer, rid, EOS | ERROR, to_wire(RuntimeError("the worker is stopping")).encode())
            raise
        except Exception as e:
            if isinstance(e, TridentError) and type(e) is not TridentError:
                log.info("stage request refused: %s", client_message(e))
            else:
                log.warning("stage request failed", exc_info=True)
            await self._write(writer, rid, EOS | ERROR, to_wire(e).encode())

    def close(self) -> None:
        """End the connection (and with it the thread); safe to call again."""
        self._closed = True
        if self._loop is not None and self._writer is not None:
            try:
                self._loop.call_soon_threadsafe(self._writer.close)
            except RuntimeError:  # the loop has ended already
                pass


class ChannelInference:
    """Stands in for PyTriton's ``InferenceHandler`` (same constructor): attaches the inference callable to
    its :class:`WorkerChannel`, which runs it."""

    def __init__(self, model_callable, requests_responses_connector: WorkerChannel, validator, name=None) -> None:
        self._channel = requests_responses_connector
        self._callable = model_callable
        self._validator = validator

    def start(self) -> None:
        self._channel.attach(self._callable, self._validator, bool(self._validator._model_config.decoupled))

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

