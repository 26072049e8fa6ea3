"""The scheduler's record-stage calls (encode, prefill, encode_prefill), straight to the stage's worker.

Through Triton, one such call crosses BLS -> Triton -> the stage's python-backend stub -> worker and back: four
hand-offs between processes, 2-3 ms on the 2-core machine (``make bench-hops``). The worker also listens on a
socket of its own (:func:`trident.workers.channel.direct_path`), named in the worker file of its stage model's
folder; on it the scheduler sends the same message the stub would (:mod:`trident.workers.wire`) and reads the
answer, on its own event loop: two hand-offs.

What does not change: the stage is still a Triton model (clients and ensembles call it through Triton), the
scheduler still routes among the instances Triton has ready, and the worker runs the call as it runs one from
its stub (the same checks, admission, at most ``calls_at_once`` at a time). An instance with no such socket (a
worker that joined from another host), one that does not answer the connect, or a stopping one (it answers
``GONE``, and lets the calls it took finish) is called through Triton, which tells whether it is there. A
worker that goes away during a call fails it as the stub would: 503, "the request was lost with it".
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np
from pytriton.proxy.types import Request

from ..errors import TridentError, Unavailable, from_wire, to_wire
from ..protocol import WORKER_FILE
from ..workers.channel import EOS, ERROR, GONE, HEADER
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
        self.first: asyncio.Future = asyncio.get_running_loop().create_future()  # the first message's flags

    def put(self, flags: int, payload: bytes) -> None:
        """A message from the worker (on the event loop)."""
        if not self.first.done():
            self.first.set_result(flags)
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


class _Connection:
    """One open socket to a worker: calls written on the event loop, answers read by a task of their own."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lost: str) -> None:
        self._reader, self._writer, self._lost = reader, writer, lost
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._task = asyncio.ensure_future(self._read())

    @property
    def open(self) -> bool:
        return not self._task.done()

    async def call(self, payload: bytes) -> tuple[int, bytes]:
        """``(flags, payload)`` of the call's one answer."""
        answer = asyncio.get_running_loop().create_future()
        rid = await self._send(payload, answer)
        try:
            return await answer
        finally:
            self._pending.pop(rid, None)

    async def stream(self, payload: bytes, stream: DirectStream) -> None:
        """Send a streamed call; its messages go to ``stream`` as they come."""
        await self._send(payload, stream)

    async def _send(self, payload: bytes, target) -> int:
        rid = next(self._ids) % 2**32
        self._pending[rid] = target
        try:
            self._writer.write(HEADER.pack(len(payload), rid, 0) + payload)  # one write: the worker wakes once
            await self._writer.drain()
        except ConnectionError:
            self._pending.pop(rid, None)
            raise Unavailable(self._lost) from None
        return rid

    async def _read(self) -> None:
        try:
            while True:
                size, rid, flags = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                payload = await self._reader.readexactly(size) if size else b""
                target = self._pending.pop(rid, None) if flags & EOS else self._pending.get(rid)
                if isinstance(target, DirectStream):
                    target.put(flags, payload)
                elif target is not None and flags & EOS and not target.done():
                    target.set_result((flags, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writer.close()
            lost = to_wire(Unavailable(self._lost)).encode()
            for target in self._pending.values():
                if isinstance(target, DirectStream):
                    target.put(EOS | ERROR, lost)
                elif not target.done():
                    target.set_exception(Unavailable(self._lost))
            self._pending.clear()

    def close(self) -> None:
        self._writer.close()


class DirectCalls:
    """The scheduler's direct calls, one connection per stage instance (opened on first use, again after the
    worker went away). ``store``: the server's model repository folder, where each local stage instance's
    worker file is."""

    def __init__(self, store: Path) -> None:
        self._store = store
        self._connections: dict[str, _Connection] = {}

    async def call(self, instance: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray] | None:
        """The outputs of one call of ``instance``; None when it has no direct socket to take it (call it through
        Triton). Raises the stage's error (a :class:`~trident.errors.TridentError`) as it sent it."""
        connection = await self._connection(instance)
        if connection is None:
            return None
        request = Request(data=inputs, parameters={}, requested_output_names=outputs)
        flags, payload = await connection.call(_wire.serialize_requests([request]))
        if flags & GONE:  # the worker is stopping: Triton tells what became of the instance
            return None
        if flags & ERROR:
            raise from_wire(payload.decode("utf-8", "replace"))
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
        await connection.stream(_wire.serialize_requests([request]), stream)
        if await stream.first & GONE:
            return None
        return stream

    async def cancel(self, instance: str, parameters: dict) -> None:
        """A control call (``parameters`` name the stream to stop), answered with nothing."""
        connection = await self._connection(instance)
        if connection is None:
            raise Unavailable(f"stage instance {instance} has no direct socket any more")
        request = Request(data={"text_input": np.array([b""], dtype=np.object_)}, parameters=parameters)
        flags, payload = await connection.call(_wire.serialize_requests([request]))
        if flags & ERROR:
            raise from_wire(payload.decode("utf-8", "replace"))


    async def _connection(self, instance: str) -> _Connection | None:
        connection = self._connections.get(instance)
        if connection is not None and connection.open:
            return connection
        try:
            info = json.loads((self._store / instance / "1" / WORKER_FILE).read_text())
            path = info["direct"]
            reader, writer = await asyncio.open_unix_connection(path)
        except (OSError, ValueError, KeyError, TypeError):
            self._connections.pop(instance, None)
            return None
        other = self._connections.get(instance)
        if other is not None and other.open:  # another request opened one meanwhile
            writer.close()
            return other
        lost = (f"the {instance} stage's worker (pid {info.get('pid')}) exited; the request was lost with it (the "
                "server restarts the worker)")
        connection = self._connections[instance] = _Connection(reader, writer, lost)
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
