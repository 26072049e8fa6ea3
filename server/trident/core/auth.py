"""The deployment secret, and everything proved with it: no record and no stage call is good without it.

**Sealed records.** A record names the producer's NIXL agent (its metadata holds the memory keys of its registered
pools) and the regions a consumer may READ. It is therefore sealed with the deployment's key (ChaCha20-Poly1305
from ``cryptography``): whoever lacks the key can neither read the agent metadata, the addresses and the lease's
release key inside, nor make or alter a record. A consumer opens the record before it decodes it, connects
to any agent or reads anything; a record from another deployment, or one altered in any byte, is refused.
Wire form: ``b"T" + key id (4 bytes) + nonce (12) + ciphertext + tag (16)``. The key id names the key that
sealed it, so that a deployment can rotate its secret without restarting every process at once: the secret
may hold several keys, one per line; the first seals, every one opens.

**Who may call a stage.** Clients reach the entry models and the OpenAI API. The stage models and the stage
workers' sockets answer only the deployment's own processes (the schedulers, the stage stubs, the encode worker
handing on its record):

- through Triton, a stage-model request carries the stage credential as the request parameter
  :data:`CREDENTIAL` (a bearer value derived from the secret; the BLS adds it, a Triton ensemble forwards the
  one its client sent, an operator's ``perf_analyzer`` passes it with ``--request-parameter``). The stage's
  python-backend stub refuses a request without it (:class:`~trident.core.errors.Unauthenticated`) before the
  request reaches the worker, and strips it from the ones it passes on;
- on a stage socket (the stub <-> worker channel and a worker's direct socket), the two ends prove the secret to
  each other for that socket when the connection opens (:class:`Handshake`: a challenge each way, keyed BLAKE2b
  over the socket's :func:`identity`), the side that accepted the connection sends nothing but its challenge until
  the other side has proved it, and every frame after it is sealed with the connection's :class:`Session`.

Neither gives away the secret: every key is derived from it with HKDF-SHA256, one label per use (records' keys
and ids, the credential, the handshake's key), the handshake's proofs are MACs over fresh random challenges, and a
secret weaker than :data:`MIN_SECRET_BITS` (by its length and alphabet) is refused where it comes in
(:func:`check_secret`), so that a leaked credential does not let anyone guess it offline. During a rotation (a
second key line), the first key seals records and makes calls, and every listed key opens records and is accepted
as credential and in handshakes.

The secret comes from ``TRIDENT_TRANSFER_SECRET``. ``trident serve`` generates one per deployment (or reads it
from a file) and passes it to Triton and every worker; workers on other hosts get the same secret through the
variable. A process that has none (a library user, a test) generates one and puts it in its own environment,
so the processes it starts share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import math
import os
import secrets
import socket
import threading
import time
import zlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from trident.core.errors import ForgedRecord, MalformedRecord, ReplayedRecord

ENV = "TRIDENT_TRANSFER_SECRET"
FORMAT = b"T"
KEY_ID_BYTES = 4
RECORD_NONCE_BYTES = 12
MAC_BYTES = 16  # the AEAD tag, last in a sealed record (unique per record: the vLLM decode keys replays on it)
OVERHEAD = len(FORMAT) + KEY_ID_BYTES + RECORD_NONCE_BYTES + MAC_BYTES

_keys: dict[bytes, ChaCha20Poly1305] = {}  # key id -> cipher, of the secret in the environment now
_sealing: bytes = b""  # id of the key that seals
_source: str | None = None
_lock = threading.Lock()


def new_secret() -> str:
    return secrets.token_hex(32)


def secret() -> str:
    """The deployment's secret as the environment holds it (made and set there when there is none)."""
    value = os.environ.get(ENV)
    if not value:
        value = os.environ[ENV] = new_secret()
    return value


MIN_SECRET_BITS = 128
SALT = b"trident deployment secret v2"  # HKDF's salt: one per derivation scheme


def key_lines(value: str | None = None) -> list[str]:
    """The secret's keys, one per line (the first seals and calls; every one opens and is accepted)."""
    return [line.strip() for line in (value if value is not None else secret()).strip().splitlines() if line.strip()]


def strength(key: str) -> float:
    """A key's entropy in bits, as its length and alphabet bound it: per character, log2 of the smaller of its
    alphabet (hex digits 16; else 26 each for lower and upper case letters, 10 for digits, 32 for the rest, those
    it uses) and the number of distinct characters it has; and at most 8 bits per byte it compresses to (a
    repeated pattern is short)."""
    if not key:
        return 0.0
    if all(c in "0123456789abcdef" for c in key) or all(c in "0123456789ABCDEF" for c in key):
        pool = 16
    else:
        pool = sum(size for test, size in ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))
                   if any(test(c) for c in key)) + (32 if any(not c.isalnum() for c in key) else 0)
    by_alphabet = len(key) * math.log2(min(pool, len(set(key))))
    return min(by_alphabet, 8.0 * max(0, len(zlib.compress(key.encode(), 9)) - 8))  # (zlib's 8 bytes of framing)


def check_secret(value: str, where: str) -> None:
    """A :class:`ValueError` naming ``where`` (the variable or file it came from) when a key of the secret is
    weaker than :data:`MIN_SECRET_BITS`: a leaked credential or record must not let anyone guess it offline."""
    keys = key_lines(value)
    if not keys:
        raise ValueError(f"{where}: the deployment secret is empty")
    for n, key in enumerate(keys, 1):
        if (bits := strength(key)) < MIN_SECRET_BITS:
            raise ValueError(
                f"{where}: the deployment secret's key on line {n} has about {bits:.0f} bits of entropy (by its length "
                f"and alphabet); at least {MIN_SECRET_BITS} are needed. Make one with `openssl rand -hex 32`, or leave "
                f"{ENV} unset and `trident serve` makes one")


@functools.lru_cache(maxsize=256)
def _hkdf(key: str, label: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=SALT, info=label).derive(key.encode())


def derive(label: bytes, value: str | None = None) -> bytes:
    """A 32-byte key for one use (``label``) of the secret's first key (HKDF-SHA256); each use has its own."""
    return _hkdf(key_lines(value)[0], label)


def derive_all(label: bytes) -> list[bytes]:
    """:func:`derive` of every key of the secret (what a receiver accepts during a rotation)."""
    return [_hkdf(key, label) for key in key_lines()]


def _ciphers() -> tuple[bytes, dict[bytes, ChaCha20Poly1305]]:
    global _sealing, _source, _keys
    value = secret()
    if value != _source:
        with _lock:
            keys: dict[bytes, ChaCha20Poly1305] = {}
            order = []
            for line in key_lines(value):
                kid = _hkdf(line, b"trident-record-key-id", KEY_ID_BYTES)
                keys[kid] = ChaCha20Poly1305(_hkdf(line, b"trident-record-key"))
                order.append(kid)
            _keys, _sealing, _source = keys, order[0], value
    return _sealing, _keys


def sign(payload: bytes) -> bytes:
    """``payload`` sealed with the deployment's current key."""
    kid, keys = _ciphers()
    head = FORMAT + kid
    nonce = os.urandom(RECORD_NONCE_BYTES)
    return head + nonce + keys[kid].encrypt(nonce, payload, head)


def verify(data: bytes) -> bytes:
    """The payload of sealed ``data``; :class:`ForgedRecord` unless one of this deployment's keys sealed it."""
    data = bytes(data)
    if len(data) <= OVERHEAD or data[:1] != FORMAT:
        raise MalformedRecord(f"transfer record of {len(data)} bytes is not a sealed record")
    head, nonce = data[: 1 + KEY_ID_BYTES], data[1 + KEY_ID_BYTES : 1 + KEY_ID_BYTES + RECORD_NONCE_BYTES]
    cipher = _ciphers()[1].get(head[1:])
    try:
        if cipher is None:
            raise InvalidTag
        return cipher.decrypt(nonce, data[1 + KEY_ID_BYTES + RECORD_NONCE_BYTES :], head)
    except InvalidTag:
        raise ForgedRecord(
            "transfer record is not sealed with this deployment's key (the record was altered, made by hand, "
            "or comes from another deployment)"
        ) from None


class SingleUse:
    """Remembers the records a consumer has used, so that each is accepted once (a replay is refused).

    A record is remembered until ``until`` (its lease's expiry: after that the lease check refuses it
    anyway); at most ``limit`` records are remembered, the oldest forgotten first once they are past it.
    """

    def __init__(self, limit: int = 4096) -> None:
        self._until: dict[object, float] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def claim(self, key: object, until: float, what: str) -> None:
        """Accept the record ``key`` once; :class:`ReplayedRecord` (naming ``what``) the second time."""
        with self._lock:
            if key in self._until:
                raise ReplayedRecord(f"{what} was already used; a record is good for one read")
            if len(self._until) >= self._limit:
                now = time.time()
                self._until = {k: t for k, t in self._until.items() if t > now}
                while len(self._until) >= self._limit:  # all still live: forget the oldest
                    del self._until[next(iter(self._until))]
            self._until[key] = until


# -- the stage credential and the stage-socket handshake -------------------------------------------------------
CREDENTIAL = "trident_stage_key"
"""Request parameter of a stage-model call through Triton: :func:`credential`."""

MAGIC = b"TRS1"  # opens the accepting side's challenge
CHALLENGE_BYTES = 32
PROOF_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


def credential() -> str:
    """The stage credential of this deployment (hex), from the secret's first key."""
    return derive(b"trident-stage-cr").hex()


def check_credential(value) -> bool:
    """Whether ``value`` (a request parameter, any type) is this deployment's stage credential, from any key of
    the secret (a caller a rotation has not reached yet)."""
    if not isinstance(value, str):
        return False
    given = value.encode()
    return any([hmac.compare_digest(given, key.hex().encode()) for key in derive_all(b"trident-stage-cr")])


class NotAuthenticated(ConnectionError):
    """The other end of a stage socket did not prove the deployment secret."""


def _proof(side: bytes, challenge: bytes, answer: bytes, identity: bytes, key: bytes | None = None) -> bytes:
    key = key or derive(b"trident-stage-hs")
    return hashlib.blake2b(side + challenge + answer + identity, digest_size=PROOF_BYTES, key=key).digest()


def identity(where) -> bytes:
    """What names a stage socket in the handshake's proofs: ``unix:<path>`` for a Unix socket's path (a str), or
    ``tcp:<host>:<port>`` for a TCP address (host, port), as its worker file says it (and its server listens)."""
    if isinstance(where, str):
        return f"unix:{where}".encode()
    host, port = where
    return f"tcp:{host}:{int(port)}".encode()


class Session:
    """One authenticated stage connection's frames after the handshake: each sealed with ChaCha20-Poly1305 under a
    key of its direction (derived with HKDF from the handshake's key, both sides' random values and the socket's
    identity), its nonce the frame's number in that direction. A frame altered, dropped, replayed or reordered by
    anyone between fails to open, and the connection ends (:class:`~trident.core.errors.MalformedRecord`); nothing
    after the handshake is readable without the secret."""

    def __init__(self, key: bytes, challenge: bytes, nonce: bytes, identity: bytes, connector: bool) -> None:
        both = HKDF(algorithm=hashes.SHA256(), length=64, salt=challenge + nonce,
                    info=b"trident-stage-session " + identity).derive(key)
        to_acceptor, to_connector = ChaCha20Poly1305(both[:32]), ChaCha20Poly1305(both[32:])
        self._out, self._in = (to_acceptor, to_connector) if connector else (to_connector, to_acceptor)
        self._sent = self._received = 0

    def seal(self, body: bytes) -> bytes:
        """``body`` as the next frame's sealed payload (the caller writes frames in the order it seals them)."""
        nonce = self._sent.to_bytes(RECORD_NONCE_BYTES, "little")
        self._sent += 1
        return self._out.encrypt(nonce, body, None)

    def open(self, payload: bytes) -> bytes:
        """The next frame's body; :class:`MalformedRecord` when it is not the other side's next frame."""
        nonce = self._received.to_bytes(RECORD_NONCE_BYTES, "little")
        try:
            body = self._in.decrypt(nonce, bytes(payload), None)
        except InvalidTag:
            raise MalformedRecord("a stage frame that is not the other side's next one (altered, replayed or "
                                  "not sealed with this connection's key)") from None
        self._received += 1
        return body


class Handshake:
    """The exchange when a stage socket opens, both ends proving the secret and the socket's :func:`identity` (a
    connection relayed to another socket, or from another, fails), and agreeing on the :class:`Session` keys:

    1. acceptor -> ``MAGIC + challenge``
    2. connector -> ``nonce + proof("c", challenge, nonce, identity)``
    3. acceptor -> ``proof("s", challenge, nonce, identity)`` (or closes: the connector proved nothing)
    """

    @staticmethod
    def hello() -> bytes:
        return MAGIC + os.urandom(CHALLENGE_BYTES)

    @staticmethod
    def answer(hello: bytes, where: bytes) -> tuple[bytes, bytes, Session]:
        """The connector's reply to ``hello`` (to the socket named ``where``), the proof it expects back and its
        session."""
        if len(hello) != len(MAGIC) + CHALLENGE_BYTES or not hello.startswith(MAGIC):
            raise NotAuthenticated("the other end is not a Trident stage socket")
        challenge, nonce, key = hello[len(MAGIC):], os.urandom(CHALLENGE_BYTES), derive(b"trident-stage-hs")
        return (nonce + _proof(b"c", challenge, nonce, where, key), _proof(b"s", challenge, nonce, where, key),
                Session(key, challenge, nonce, where, connector=True))

    @staticmethod
    def check(hello: bytes, reply: bytes, where: bytes) -> tuple[bytes, Session]:
        """The acceptor's last message, once ``reply`` proves the secret for the socket named ``where``, and its
        session; :class:`NotAuthenticated` otherwise."""
        challenge, nonce, proof = hello[len(MAGIC):], reply[:CHALLENGE_BYTES], reply[CHALLENGE_BYTES:]
        if len(reply) == CHALLENGE_BYTES + PROOF_BYTES:
            for key in derive_all(b"trident-stage-hs"):  # (the caller's first key: any of ours, during a rotation)
                if hmac.compare_digest(proof, _proof(b"c", challenge, nonce, where, key)):  # proved with this key
                    return _proof(b"s", challenge, nonce, where, key), Session(key, challenge, nonce, where, False)
        raise NotAuthenticated("the caller did not prove the deployment secret (for this socket)")


HELLO_BYTES = len(MAGIC) + CHALLENGE_BYTES
REPLY_BYTES = CHALLENGE_BYTES + PROOF_BYTES


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


def accept(sock: socket.socket, where: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Session:
    """The accepting side of :class:`Handshake` on a blocking socket (named ``where``: :func:`identity`); raises
    :class:`NotAuthenticated` (the caller closes the socket)."""
    with _handshaking(sock, timeout_s):
        hello = Handshake.hello()
        sock.sendall(hello)
        last, session = Handshake.check(hello, _recv(sock, REPLY_BYTES), where)
        sock.sendall(last)
        return session


def connect(sock: socket.socket, where: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Session:
    """The connecting side of :class:`Handshake` on a blocking socket, to the socket named ``where``."""
    with _handshaking(sock, timeout_s):
        reply, expected, session = Handshake.answer(_recv(sock, HELLO_BYTES), where)
        sock.sendall(reply)
        if not hmac.compare_digest(_recv(sock, PROOF_BYTES), expected):
            raise NotAuthenticated("the stage socket did not prove the deployment secret")
        return session


# -- asyncio streams -------------------------------------------------------------------------------------------
async def accept_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: bytes,
                        timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Session:
    """The accepting side of :class:`Handshake` on an asyncio stream."""
    try:
        hello = Handshake.hello()
        writer.write(hello)
        reply = await asyncio.wait_for(reader.readexactly(REPLY_BYTES), timeout_s)
        last, session = Handshake.check(hello, reply, where)
        writer.write(last)
        await writer.drain()
        return session
    except NotAuthenticated:
        raise
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError) as e:
        raise NotAuthenticated(f"stage handshake failed: {type(e).__name__}") from None
