"""The deployment's record key: every record a stage hands on is sealed, and opened before it is used.

A record names the producer's NIXL agent (its metadata holds the memory keys of its registered pools) and the
regions a consumer may READ. It is therefore sealed with the deployment's key (ChaCha20-Poly1305 from
``cryptography``): whoever lacks the key can neither read the agent metadata, the addresses and the lease's
release key inside, nor make or alter a record. A consumer opens the record before it decodes it, connects
to any agent or reads anything; a record from another deployment, or one altered in any byte, is refused.

Wire form: ``b"T" + key id (4 bytes) + nonce (12) + ciphertext + tag (16)``. The key id names the key that
sealed it, so that a deployment can rotate its secret without restarting every process at once: the secret
may hold several keys, one per line; the first seals, every one opens.

The secret comes from ``TRIDENT_TRANSFER_SECRET``. ``trident serve`` generates one per deployment (or reads it
from a file) and passes it to Triton and every worker; workers on other hosts get the same secret through the
variable. A process that has none (a library user, a test) generates one and puts it in its own environment,
so the processes it starts share it. :mod:`trident.auth` derives the stage credential from the same secret.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .errors import ForgedRecord, MalformedRecord, ReplayedRecord

ENV = "TRIDENT_TRANSFER_SECRET"
FORMAT = b"T"
KEY_ID_BYTES = 4
NONCE_BYTES = 12
MAC_BYTES = 16  # the AEAD tag, last in a sealed record (unique per record: the vLLM decode keys replays on it)
OVERHEAD = len(FORMAT) + KEY_ID_BYTES + NONCE_BYTES + MAC_BYTES

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


def derive(label: bytes, value: str | None = None) -> bytes:
    """A 32-byte key for one use (``label``) of the secret's first key; each use has its own."""
    first = (value if value is not None else secret()).strip().splitlines()[0].strip()
    return hashlib.blake2b(first.encode(), digest_size=32, person=label[:16]).digest()


def _ciphers() -> tuple[bytes, dict[bytes, ChaCha20Poly1305]]:
    global _sealing, _source, _keys
    value = secret()
    if value != _source:
        with _lock:
            keys: dict[bytes, ChaCha20Poly1305] = {}
            order = []
            for line in value.strip().splitlines():
                if line.strip():
                    key = hashlib.blake2b(line.strip().encode(), digest_size=32, person=b"trident-key").digest()
                    kid = hashlib.blake2b(key, digest_size=KEY_ID_BYTES, person=b"trident-kid").digest()
                    keys[kid] = ChaCha20Poly1305(key)
                    order.append(kid)
            _keys, _sealing, _source = keys, order[0], value
    return _sealing, _keys


def sign(payload: bytes) -> bytes:
    """``payload`` sealed with the deployment's current key."""
    kid, keys = _ciphers()
    head = FORMAT + kid
    nonce = os.urandom(NONCE_BYTES)
    return head + nonce + keys[kid].encrypt(nonce, payload, head)


def verify(data: bytes) -> bytes:
    """The payload of sealed ``data``; :class:`ForgedRecord` unless one of this deployment's keys sealed it."""
    data = bytes(data)
    if len(data) <= OVERHEAD or data[:1] != FORMAT:
        raise MalformedRecord(f"transfer record of {len(data)} bytes is not a sealed record")
    head, nonce = data[: 1 + KEY_ID_BYTES], data[1 + KEY_ID_BYTES : 1 + KEY_ID_BYTES + NONCE_BYTES]
    cipher = _ciphers()[1].get(head[1:])
    try:
        if cipher is None:
            raise InvalidTag
        return cipher.decrypt(nonce, data[1 + KEY_ID_BYTES + NONCE_BYTES :], head)
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
