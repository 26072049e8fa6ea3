"""A stage socket's frames, read: each is :data:`~trident.core.protocol.FRAME` (the payload's length) and one
:data:`~trident.core.protocol.StageMessage`, sealed with the connection's :class:`~trident.core.auth.Session`
(:func:`~trident.core.protocol.encode_message` writes them). The same frames on a Unix socket and over TCP."""

from __future__ import annotations

import asyncio
import socket

from trident.core.auth import Session
from trident.core.errors import MalformedRecord
from trident.core.protocol import FRAME, MAX_FRAME, Reply, StageMessage, decode_message


def ends(message: StageMessage) -> bool:
    """Whether ``message`` is the last of its call."""
    return not isinstance(message, Reply) or message.end


def fail_when_unanswered(sock: socket.socket, within_s: float) -> None:
    """A TCP stage connection whose peer stops answering (its host cut off, or gone without closing) fails within
    ``within_s``, as one that cannot be opened does, instead of after the kernel's retransmissions (minutes): data
    sent unacknowledged that long ends it, and so do keep-alive probes unanswered while it is idle (a busy peer's
    kernel answers them). Both ends set it: the callers (``client.open_stage_socket``) and the worker's server."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(within_s * 1000))


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


def _size(head: bytes) -> int:
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME:
        raise MalformedRecord(f"a stage frame of {size} bytes")
    return size


def recv_message(conn: socket.socket, session: Session) -> StageMessage | None:
    """The next message on a blocking socket, opened with the connection's ``session``; None at its end. Raises
    :class:`MalformedRecord` for a frame that is not one (the connection is then useless)."""
    head = recv_exact(conn, FRAME.size)
    if head is None:
        return None
    body = recv_exact(conn, _size(head))
    return None if body is None else decode_message(session.open(body))


async def read_message(reader: asyncio.StreamReader, session: Session) -> StageMessage:
    """The next message on a stream, opened with the connection's ``session`` (``asyncio.IncompleteReadError`` at
    its end)."""
    return decode_message(session.open(await reader.readexactly(_size(await reader.readexactly(FRAME.size)))))
