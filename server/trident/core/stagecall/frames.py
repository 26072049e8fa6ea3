"""A stage socket's frames, read: each is :data:`~trident.core.protocol.FRAME` (the payload's length) and one
:data:`~trident.core.protocol.StageMessage`, sealed with the connection's :class:`~trident.core.auth.Session`
(:func:`~trident.core.protocol.encode_message` writes them). The same frames on a Unix socket and over TCP."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from typing import TYPE_CHECKING

from trident.core.auth import Session
from trident.core.errors import MalformedRecord
from trident.core.protocol import FRAME, Reply, StageMessage, decode_message

if TYPE_CHECKING:
    from trident.core.config import MediaLimits

FRAME_ALLOWANCE = 16 << 20  # a frame's bytes besides its media: the prompt, parameters, outputs, records


FRAME_LIMIT_ENV = "TRIDENT_FRAME_LIMIT"  # the head's frame_limit(), which the processes it starts inherit


def limit_for(limits: "MediaLimits") -> int:
    """The largest stage frame at ``limits``: one call's media (:meth:`MediaLimits.request_bytes`, as bytes, not
    base64) and :data:`FRAME_ALLOWANCE`."""
    return limits.request_bytes + FRAME_ALLOWANCE


@functools.cache
def frame_limit() -> int:
    """The largest frame a stage socket takes, in bytes: :func:`limit_for` this deployment's media limits, as the head
    hands it on (``TRIDENT_FRAME_LIMIT``), else as ``TRIDENT_MEDIA_LIMITS`` or the defaults give it (a worker joining
    from another host). A larger one ends the connection before its body is read (even from a peer holding the
    secret). (The handed number spares a stage model's stub importing the settings: a third of a CPU second.)"""
    handed = os.environ.get(FRAME_LIMIT_ENV)
    if handed:
        return int(handed)
    from trident.core.config import MediaLimits

    return limit_for(MediaLimits.from_env())


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
    if size > frame_limit():
        raise MalformedRecord(f"a stage frame of {size} bytes; at most {frame_limit()} (the media limits' "
                              "request_bytes and FRAME_ALLOWANCE)")
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
