"""The deployment's record key: every record a stage hands on is signed, and checked before it is used.

Stage models are public Triton models, so a client can send ``prefill`` or ``decode`` a record of its own
making. Each record therefore ends with a MAC (keyed BLAKE2b, 32 bytes) over its msgpack bytes, made with the
deployment's secret; a consumer checks it before it decodes the record, connects to any agent or reads
anything. A record from another deployment, or one altered in any byte, is refused.

The secret comes from ``TRIDENT_TRANSFER_SECRET``. ``trident serve`` generates one per deployment (or takes
``--transfer-secret``) and passes it to Triton and every worker; workers on other hosts get the same
secret through the variable. A process that has none (a library user, a test) generates one and puts it in
its own environment, so the processes it starts share it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time

from .errors import ForgedRecord, MalformedRecord, ReplayedRecord

ENV = "TRIDENT_TRANSFER_SECRET"
MAC_BYTES = 32

_key: bytes | None = None
_key_source: str | None = None


def new_secret() -> str:
    return secrets.token_hex(32)


def _current_key() -> bytes:
    """The key of the secret in the environment now (made and set there when there is none)."""
    global _key, _key_source
    secret = os.environ.get(ENV)
    if not secret:
        secret = os.environ[ENV] = new_secret()
    if secret != _key_source:
        # any string works as a secret: the key is its digest
        _key, _key_source = hashlib.blake2b(secret.encode(), digest_size=32, person=b"trident-key").digest(), secret
    return _key


def _mac(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=MAC_BYTES, key=_current_key()).digest()


def sign(payload: bytes) -> bytes:
    """``payload`` followed by its MAC."""
    return payload + _mac(payload)


def verify(data: bytes) -> bytes:
    """The payload of signed ``data``; :class:`ForgedRecord` unless its MAC is this deployment's."""
    if len(data) <= MAC_BYTES:
        raise MalformedRecord(f"transfer record of {len(data)} bytes is too short to carry its signature")
    payload, mac = bytes(data[:-MAC_BYTES]), bytes(data[-MAC_BYTES:])
    if not hmac.compare_digest(mac, _mac(payload)):
        raise ForgedRecord(
            "transfer record signature does not match this deployment's key (the record was altered, made "
            "by hand, or comes from another deployment)"
        )
    return payload


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
