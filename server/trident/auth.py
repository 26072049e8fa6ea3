"""Who may call a stage: every caller proves the deployment secret before a stage does any work for it.

Clients reach the entry models and the OpenAI API. The stage models and the stage workers' sockets answer only
the deployment's own processes (the schedulers, the stage stubs, the encode worker handing on its record):

- through Triton, a stage-model request carries the stage credential as the request parameter
  :data:`CREDENTIAL` (a bearer value derived from the secret; the BLS adds it, a Triton ensemble forwards the
  one its client sent, an operator's ``perf_analyzer`` passes it with ``--request-parameter``). The stage's
  python-backend stub refuses a request without it (:class:`~trident.errors.Unauthenticated`) before the
  request reaches the worker, and strips it from the ones it passes on;
- on a stage socket (the stub <-> worker channel and a worker's direct socket), the two ends prove the secret to
  each other when the connection opens (:class:`Handshake`: a challenge each way, keyed BLAKE2b), and the side
  that accepted the connection sends nothing but its challenge until the other side has proved it.

Neither gives away the secret: the credential is a one-way derivation of it, and the handshake's proofs are
MACs over fresh random challenges.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import socket

from . import signing

CREDENTIAL = "trident_stage_key"
"""Request parameter of a stage-model call through Triton: :func:`credential`."""

MAGIC = b"TRS1"  # opens the accepting side's challenge
NONCE_BYTES = 32
PROOF_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


def credential() -> str:
    """The stage credential of this deployment (hex)."""
    return signing.derive(b"trident-stage-cr").hex()


def check_credential(value) -> bool:
    """Whether ``value`` (a request parameter, any type) is this deployment's stage credential."""
    return isinstance(value, str) and hmac.compare_digest(value.encode(), credential().encode())


class NotAuthenticated(ConnectionError):
    """The other end of a stage socket did not prove the deployment secret."""


def _proof(side: bytes, challenge: bytes, answer: bytes) -> bytes:
    key = signing.derive(b"trident-stage-hs")
    return hashlib.blake2b(side + challenge + answer, digest_size=PROOF_BYTES, key=key).digest()


class Handshake:
    """The exchange when a stage socket opens, both ends proving the secret:

    1. acceptor -> ``MAGIC + challenge``
    2. connector -> ``nonce + proof("c", challenge, nonce)``
    3. acceptor -> ``proof("s", challenge, nonce)`` (or closes: the connector proved nothing)
    """

    @staticmethod
    def hello() -> bytes:
        return MAGIC + os.urandom(NONCE_BYTES)

    @staticmethod
    def answer(hello: bytes) -> tuple[bytes, bytes]:
        """The connector's reply to ``hello`` and the proof it expects back."""
        if len(hello) != len(MAGIC) + NONCE_BYTES or not hello.startswith(MAGIC):
            raise NotAuthenticated("the other end is not a Trident stage socket")
        challenge, nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
        return nonce + _proof(b"c", challenge, nonce), _proof(b"s", challenge, nonce)

    @staticmethod
    def check(hello: bytes, reply: bytes) -> bytes:
        """The acceptor's last message, once ``reply`` proves the secret; :class:`NotAuthenticated` otherwise."""
        challenge, nonce, proof = hello[len(MAGIC):], reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if len(reply) != NONCE_BYTES + PROOF_BYTES or not hmac.compare_digest(proof, _proof(b"c", challenge, nonce)):
            raise NotAuthenticated("the caller did not prove the deployment secret")
        return _proof(b"s", challenge, nonce)


HELLO_BYTES = len(MAGIC) + NONCE_BYTES
REPLY_BYTES = NONCE_BYTES + PROOF_BYTES


# -- blocking sockets ------------------------------------------------------------------------------------------
def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise NotAuthenticated("the connection closed during the stage handshake")
        buf += chunk
    return buf


@contextlib.contextmanager
def _handshaking(sock: socket.socket, timeout_s: float):
    """The blocking socket under ``timeout_s`` for the handshake; a socket error becomes :class:`NotAuthenticated`."""
    previous = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        yield
    except NotAuthenticated:
        raise
    except OSError as e:
        raise NotAuthenticated(f"stage handshake failed: {e}") from None
    finally:
        sock.settimeout(previous)


def accept(sock: socket.socket, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The accepting side of :class:`Handshake` on a blocking socket; raises :class:`NotAuthenticated`
    (the caller closes the socket)."""
    with _handshaking(sock, timeout_s):
        hello = Handshake.hello()
        sock.sendall(hello)
        sock.sendall(Handshake.check(hello, _recv(sock, REPLY_BYTES)))


def connect(sock: socket.socket, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The connecting side of :class:`Handshake` on a blocking socket."""
    with _handshaking(sock, timeout_s):
        reply, expected = Handshake.answer(_recv(sock, HELLO_BYTES))
        sock.sendall(reply)
        if not hmac.compare_digest(_recv(sock, PROOF_BYTES), expected):
            raise NotAuthenticated("the stage socket did not prove the deployment secret")


# -- asyncio streams -------------------------------------------------------------------------------------------
async def accept_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The accepting side of :class:`Handshake` on an asyncio stream."""
    try:
        hello = Handshake.hello()
        writer.write(hello)
        reply = await asyncio.wait_for(reader.readexactly(REPLY_BYTES), timeout_s)
        writer.write(Handshake.check(hello, reply))
        await writer.drain()
    except NotAuthenticated:
        raise
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as e:
        raise NotAuthenticated(f"stage handshake failed: {type(e).__name__}") from None


async def connect_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The connecting side of :class:`Handshake` on an asyncio stream."""
    try:
        reply, expected = Handshake.answer(await asyncio.wait_for(reader.readexactly(HELLO_BYTES), timeout_s))
        writer.write(reply)
        proof = await asyncio.wait_for(reader.readexactly(PROOF_BYTES), timeout_s)
    except NotAuthenticated:
        raise
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as e:
        raise NotAuthenticated(f"stage handshake failed: {type(e).__name__}") from None
    if not hmac.compare_digest(proof, expected):
        raise NotAuthenticated("the stage socket did not prove the deployment secret")
