"""The serving side of the stage protocol: one :class:`StageServer` in each stage worker.

Every caller reaches the worker here, with the same messages (:data:`trident.core.protocol.StageMessage`): the stage
model's python-backend stub (the calls of Triton's clients and ensembles), the BLS schedulers (their own calls,
cancels, withdrawals) and the encode worker handing a record on (:class:`~trident.core.protocol.Deliver`). It listens on
a Unix socket for callers on this host (a file in a folder of mode 0700) and on TCP at the data-plane address for
callers on other hosts; both are named in the worker file of the stage model's folder. A connection is served
only after both ends proved the deployment secret (:mod:`trident.core.auth`); handshakes in progress on the TCP socket
are bounded by peer and in all (:mod:`.handshakes`), and a TCP caller that stops answering is dropped with its
calls (:func:`.frames.fail_when_unanswered`).

All of it runs on one thread's event loop, the engine's: the calls' stage function, the control hooks, the
reading and writing. A one-answer stage's calls run at most ``calls_at_once`` at a time (:func:`at_most`), from
all callers together; a prefill call posted ahead of its record waits for it before it takes its slot.

Stopping (:meth:`StageServer.stop`): calls that come after it are answered :class:`~trident.core.protocol.Gone` (the
scheduler then asks Triton, which says the instance is not there), the calls taken finish (up to
:data:`DRAIN_S`), then the connections close and the Unix socket goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import atexit
import functools
import inspect
import logging
import os
import shutil
import socket
import tempfile
import threading
from typing import Callable, get_args

from trident.core import auth, tracing
from trident.core.errors import InvalidRequest, MalformedRecord, TridentError, Unavailable, client_message
from trident.core.protocol import (
    Abandon, Call, Control, Gone, Reply, StageMessage, Stats, encode_message, failure, worker_file,
)
from trident.core.stagecall.frames import fail_when_unanswered, read_message
from trident.core.stagecall.handshakes import Handshakes

SOCKET_NAME = "calls.sock"
DIR_PREFIX = "trident-calls-"
DRAIN_S = 60.0  # how long a stopping worker lets the calls it took finish
UNANSWERED_S = 60.0  # a TCP caller that answers neither data nor keep-alive probes this long is gone: its calls end

log = logging.getLogger("trident.worker")


def at_most(infer, count: int, entry=None):
    """``infer`` with at most ``count`` calls running at once (on the loop it runs on): the engine is built for
    ``count`` (``calls_at_once``). ``entry(call)``, an async context manager, is entered first, outside the limit,
    and left when the call ends (the stage handler's admission, and a prefill call posted ahead of its record
    waiting for it: :meth:`trident.worker.infer.StageHandler.entry`)."""
    slots: asyncio.Semaphore | None = None

    @functools.wraps(infer)
    async def limited(call):
        nonlocal slots
        async with entry(call) if entry is not None else contextlib.nullcontext():
            slots = slots or asyncio.Semaphore(count)
            async with slots:
                return await infer(call)

    return limited


def unix_folder() -> str:
    """A folder of this process's own (mode 0700), removed at its exit: the Unix stage socket's, and vLLM's IPC
    sockets' (``VLLM_RPC_BASE_PATH``)."""
    if "folder" not in _made:
        _made["folder"] = folder = tempfile.mkdtemp(prefix=DIR_PREFIX)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return _made["folder"]


_made: dict = {}


def remove_unix_folder() -> None:
    """This process's own folder (:func:`unix_folder`) removed now, where it made one: before it ends by a kill."""
    if "folder" in _made:
        shutil.rmtree(_made["folder"], ignore_errors=True)


class StageServer:
    """A worker's stage sockets and the loop that serves them. ``infer(call)``: the stage function (a one-answer
    stage's returns its outputs, a streaming stage's is an async iterator of them); ``control(message)``: the
    stage's hook for :data:`~trident.core.protocol.Control` messages. ``address``: the data-plane address the TCP
    socket listens on."""

    def __init__(self, infer: Callable, control: Callable, address: str) -> None:
        self._infer, self._control = infer, control
        self.path = os.path.join(unix_folder(), SOCKET_NAME)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._unix.bind(self.path)
        self._unix.listen(64)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._tcp = socket.create_server((address, 0), family=family, backlog=64)
        self.address: tuple[str, int] = tuple(self._tcp.getsockname()[:2])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trident-stage-server", daemon=True)
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._sessions: dict[asyncio.StreamWriter, auth.Session] = {}  # each connection's, after its handshake
        self._connections: set[asyncio.Task] = set()
        self._calls: set[asyncio.Task] = set()
        self._stopping = False
        self._handshakes = Handshakes(log)

    def worker_file(self, pid: int | None, name: str) -> dict:
        """What the worker file says of this server: the Unix socket (with the pid: on this host only) and TCP."""
        return worker_file(name, pid, self.path, self.address)

    def start(self) -> None:
        """Serve both sockets from now on."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    async def _listen(self) -> None:
        self._servers = [await asyncio.start_unix_server(self._serve, sock=self._unix),
                         await asyncio.start_server(self._serve, sock=self._tcp)]

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Take no more calls, let the ones taken finish (at most ``drain_s``), close; safe to call again."""
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started
                self._unix.close()
                self._tcp.close()
                self._unlink()
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(drain_s), self._loop).result(drain_s + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)  # (its folder goes at the process's exit)
        except OSError:
            pass

    async def _stop(self, drain_s: float) -> None:
        self._stopping = True
        for server in self._servers:
            server.close()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=drain_s)
        for task in list(self._calls):  # past the drain: cancelled, their callers told
            task.cancel()
        for writer in list(self._writers):
            writer.close()
        if self._connections:
            await asyncio.wait(set(self._connections), timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        peer = None
        if sock is not None and sock.family != socket.AF_UNIX:  # (TCP: anyone who reaches the data address)
            peer = str(writer.get_extra_info("peername")[0])
            if not self._handshakes.admit(peer):
                writer.transport.abort()
                return
            fail_when_unanswered(sock, UNANSWERED_S)
        where = auth.identity(self.address if peer is not None else self.path)  # (the socket as its worker file says)
        try:
            session = await auth.accept_stream(reader, writer, where)  # a caller of this deployment, or it gets nothing
        except auth.NotAuthenticated as e:
            self._handshakes.refused(str(e))
            writer.close()
            return
        finally:
            if peer is not None:
                self._handshakes.done(peer)
        self._writers.add(writer)
        self._sessions[writer] = session
        me = asyncio.current_task()
        self._connections.add(me)
        tasks: set[asyncio.Task] = set()
        by_id: dict[int, asyncio.Task] = {}  # this connection's calls in progress
        try:
            while True:
                message = await read_message(reader, session)
                if isinstance(message, Abandon):  # the caller gave up on one of its calls: it stops
                    if (abandoned := by_id.get(message.call)) is not None:
                        abandoned.cancel()
                    await self._write(writer, Reply(message.id))
                    continue
                if not isinstance(message, Call):
                    await self._control_message(writer, message)
                    continue
                if self._stopping:
                    await self._write(writer, Gone(message.id))
                    continue
                task = asyncio.ensure_future(self._handle(writer, message))
                for held in (tasks, self._calls):
                    held.add(task)
                    task.add_done_callback(held.discard)
                by_id[message.id] = task
                task.add_done_callback(lambda _, i=message.id: by_id.pop(i, None))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the other end went away, or the worker stops
        except MalformedRecord as e:
            log.warning("worker: a caller sent %s; closing its connection", e)
        finally:
            for task in list(tasks):  # the caller is gone: its calls stop
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._writers.discard(writer)
            self._sessions.pop(writer, None)
            self._connections.discard(me)
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, message: StageMessage) -> None:
        session = self._sessions.get(writer)
        if writer.is_closing() or session is None:
            return
        writer.write(encode_message(message, session))  # one write (sealed and written at once: in order)
        await writer.drain()

    async def _control_message(self, writer: asyncio.StreamWriter, message: StageMessage) -> None:
        """A control message: handed to the stage's hook (:meth:`StageHandler.control
        <trident.worker.infer.StageHandler.control>`), answered with an empty :class:`Reply` (or its
        :class:`Failure`); :class:`Stats` is answered with the hook's counters."""
        try:
            if not isinstance(message, get_args(Control)):  # (Abandon is answered before, by the server)
                raise InvalidRequest(f"a caller does not send {type(message).__name__} messages")
            done = self._control(message)
            if inspect.isawaitable(done):
                done = await done
            await self._write(writer, Reply(message.id, {"stats": done} if isinstance(message, Stats) else {}))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the connection serves on
            log.info("stage control message refused: %s", e)
            await self._write(writer, failure(message.id, e))

    async def _handle(self, writer: asyncio.StreamWriter, call: Call) -> None:
        with tracing.request("stage_call", call.traceparent):  # (its own task: the span is current in it alone)
            await self._answer(writer, call)

    async def _answer(self, writer: asyncio.StreamWriter, call: Call) -> None:
        try:
            result = self._infer(call)
            if inspect.isasyncgen(result):
                async for outputs in result:
                    await self._write(writer, Reply(call.id, outputs, end=False))
                await self._write(writer, Reply(call.id))
            else:
                await self._write(writer, Reply(call.id, await result))
        except asyncio.CancelledError:
            await self._write(writer, failure(call.id, Unavailable("the worker is stopping")))
            raise
        except Exception as e:
            if isinstance(e, TridentError) and type(e) is not TridentError:
                log.info("stage request refused: %s", client_message(e))
            elif isinstance(e, TridentError):
                log.warning("stage request failed", exc_info=True)
            await self._write(writer, failure(call.id, e))  # (any other exception: logged with its reference)
