"""The handshakes a worker's TCP stage socket has open at once, bounded.

Anyone who reaches the data-plane address can open a connection to a stage socket; until it has proved the
deployment secret it holds a file descriptor for up to :data:`trident.core.auth.HANDSHAKE_TIMEOUT_S`. One peer address
may hold :data:`PER_PEER` such connections, all peers together :data:`TOTAL`; past either, a connection is closed at
once, unread. The Unix socket is not bounded: its folder is its user's alone. Refused connections (over a bound, or
a failed proof) are logged in one line a minute with their count, not in one line each."""

from __future__ import annotations

import logging
import time
from collections import Counter

PER_PEER = 16  # handshakes one address may have open at once (a head's stubs and schedulers open a few each)
TOTAL = 128  # and all addresses together
LOG_EVERY_S = 60.0


class Handshakes:
    """Counts the handshakes in progress by peer address, and the refusals since the last line logged."""

    def __init__(self, log: logging.Logger, per_peer: int = PER_PEER, total: int = TOTAL,
                 every_s: float = LOG_EVERY_S) -> None:
        self.log, self.per_peer, self.total, self.every_s = log, per_peer, total, every_s
        self._open: Counter[str] = Counter()
        self._refused = 0
        self._last_line = -every_s

    def admit(self, peer: str) -> bool:
        """Whether a handshake from ``peer`` may start now (then :meth:`done` when it ends, either way)."""
        if self._open[peer] >= self.per_peer or sum(self._open.values()) >= self.total:
            self.refused(f"{peer} has {self._open[peer]} handshakes open, {sum(self._open.values())} in all "
                         f"(bounds {self.per_peer} and {self.total})")
            return False
        self._open[peer] += 1
        return True

    def done(self, peer: str) -> None:
        self._open[peer] -= 1
        if self._open[peer] <= 0:
            del self._open[peer]

    def refused(self, why: str) -> None:
        """A connection refused for ``why``: logged now if no line was in the last :attr:`every_s`, else counted for
        the next line."""
        self._refused += 1
        now = time.monotonic()
        if now - self._last_line < self.every_s:
            return
        count, self._refused, self._last_line = self._refused, 0, now
        self.log.warning("worker: refused %d connection(s) to its stage socket%s; the last: %s", count,
                         f" in the last {self.every_s:.0f} s" if count > 1 else "", why)

    def open_now(self) -> int:
        return sum(self._open.values())
