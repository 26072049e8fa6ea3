"""A vLLM KV producer's claims: each prefill's KV is held under a claim that one consumer takes, once, at the
producer's stage socket, before its engine READs the KV (vLLM's connector would otherwise let two consumers read
the same blocks, or one read blocks already reused)."""

from __future__ import annotations

import threading
import time
import uuid

from trident.core.errors import ReplayedRecord

KV_CLAIM_S = 25.0  # how long a prefill's KV can be claimed: within vLLM's kv_lease_duration (30 s), after which vLLM
# frees unread blocks for other requests (the consumer's heartbeats extend it only once its engine has the request)


class KVClaims:
    """The claims of one producer's KV not yet taken, and where its consumers take them (its worker file: the stage
    socket's addresses, told by :meth:`serving_at` once the worker binds)."""

    def __init__(self, hold_s: float = KV_CLAIM_S) -> None:
        self.hold_s = hold_s
        self.at: dict = {}
        self._until: dict[str, float] = {}  # claim -> until (monotonic)
        self._lock = threading.Lock()

    def serving_at(self, worker_file: dict) -> None:
        """Where this worker's stage socket listens (its worker file): consumers take claims there."""
        self.at = dict(worker_file)

    def hold(self) -> str:
        """A claim for the KV of a prefill just done: good once, for ``hold_s``."""
        now, claim = time.monotonic(), uuid.uuid4().hex
        with self._lock:
            self._until = {c: until for c, until in self._until.items() if until > now}
            self._until[claim] = now + self.hold_s
        return claim

    def take(self, claim: str) -> None:
        """A consumer takes the KV held under ``claim`` (a :class:`~trident.core.protocol.Claim` message); refused the
        second time, from whichever consumer, and after ``hold_s``."""
        with self._lock:
            until = self._until.pop(claim, None)
        if until is None or until <= time.monotonic():
            raise ReplayedRecord("this kv_meta was already used, or its KV has expired; a record is good for one read")

    @property
    def held(self) -> int:
        """Claims not yet taken (expired ones included until the next :meth:`hold`)."""
        with self._lock:
            return len(self._until)
