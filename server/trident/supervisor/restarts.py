"""When a supervised process that exited starts again: 1 s after an exit that ended a long life; 2, 4, 8, ... s
after each exit in a row that came within :data:`QUICK_DEATH_S` of its start; after :data:`MAX_QUICK_DEATHS` such
exits in a row, after a pause of :data:`PAUSE_S` (a stage crashed by bad input again and again comes back once it
stops, never down for good), or with ``give_up``, never (Triton's: the head then exits for its own supervisor).
``trident serve``'s launcher and ``trident node`` share it."""

from __future__ import annotations

import time
from typing import Callable

QUICK_DEATH_S = 60.0  # a process that exits sooner than this after its start counts as a quick death
MAX_QUICK_DEATHS = 5  # quick deaths in a row after which a process pauses (or, with give_up, is left down)
PAUSE_S = 60.0


class Restarts:
    def __init__(self, clock: Callable[[], float] = time.monotonic, give_up: bool = False) -> None:
        self._clock, self._give_up = clock, give_up
        self._started: dict[str, float] = {}  # name -> when its process started
        self._quick: dict[str, int] = {}  # name -> exits in a row within QUICK_DEATH_S of a start
        self.due_at: dict[str, float] = {}  # name -> when to start it again

    def started(self, name: str) -> None:
        self._started[name] = self._clock()

    def exited(self, name: str) -> float | None:
        """Note an exit; the delay before it starts again (:data:`PAUSE_S` after :data:`MAX_QUICK_DEATHS` quick
        ones), or None when it is to be left down (``give_up``)."""
        quick = self._clock() - self._started.get(name, 0.0) < QUICK_DEATH_S
        self._quick[name] = self._quick.get(name, 0) + 1 if quick else 0
        if self._quick[name] >= MAX_QUICK_DEATHS:
            if self._give_up:
                return None
            self._quick[name] = 0  # (after the pause, the backoff starts again)
            delay = PAUSE_S
        else:
            delay = 2.0 ** self._quick[name]
        self.due_at[name] = self._clock() + delay
        return delay

    def due(self) -> list[str]:
        """The names whose delay is over (each given once)."""
        now = self._clock()
        names = [name for name, at in self.due_at.items() if now >= at]
        for name in names:
            del self.due_at[name]
        return names
