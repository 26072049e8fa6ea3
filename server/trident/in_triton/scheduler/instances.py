"""The live instances of the stages an entry model may call: the Triton models ``<stage>`` and ``<stage>-<n>``
that are ready.

The BLS looks again every ``refresh_s`` and whenever a call finds an instance gone, so workers can join and leave a
running server: the names in the server's model store, and a few past the highest seen (a worker that joined from
another host need not be in this store).

An instance a call found gone stays out for ``GONE_HOLD_S`` even while Triton still shows its model ready (its
worker may be restarting under the same entry); then one call tries it again, and a refused connect costs little.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from trident.core.protocol import instance_name, parse_instance

GONE_HOLD_S = 1.0


class Instances:
    """``live[stage]``: the ready instances of each of ``stages``, by index."""

    def __init__(self, stages: list[str], store: Path, ready: Callable[[str], bool], refresh_s: float,
                 forget: Callable[[str], None], log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.live: dict[str, list[str]] = {s: [] for s in stages}
        self._store, self._ready, self._refresh_s = store, ready, refresh_s
        self._forget, self._log = forget, log  # the router forgets a gone instance; one log line per change
        self._clock = clock
        self._refreshed = 0.0
        self._held: dict[str, float] = {}  # instance found gone -> when it may be tried again

    def stages(self) -> set[str]:
        """The stages with at least one live instance."""
        return {s for s, names in self.live.items() if names}

    def refresh(self, force: bool = False) -> None:
        """Look for the live instances again (at most every ``refresh_s`` unless ``force``)."""
        now = self._clock()
        if not force and now - self._refreshed < self._refresh_s:
            return
        self._refreshed = now
        try:
            listed = [n for n in os.listdir(self._store) if parse_instance(n) is not None]
        except OSError:
            listed = []
        for stage in self.live:
            known = [n for n in listed + self.live[stage] if parse_instance(n)[0] == stage]
            top = max((parse_instance(n)[1] for n in known), default=1)
            candidates = dict.fromkeys([*known, *(instance_name(stage, i) for i in range(1, top + 3))])
            live = sorted((n for n in candidates if self._held.get(n, 0.0) <= now and self._ready(n)),
                          key=lambda n: parse_instance(n)[1])
            for name in set(self.live[stage]) - set(live):
                self._forget(name)
                self._log(f"stage instance {name} is gone")
            for name in set(live) - set(self.live[stage]):
                self._log(f"stage instance {name} is live")
            self.live[stage] = live

    def mark_gone(self, name: str) -> None:
        """A call found ``name`` gone: no more calls to it for ``GONE_HOLD_S``, and then only if it is ready."""
        self._held[name] = self._clock() + GONE_HOLD_S
        stage = parse_instance(name)[0]
        if name in self.live.get(stage, []):
            self.live[stage] = [n for n in self.live[stage] if n != name]
            self._forget(name)
