"""``trident node``: a stage host's supervisor. It runs the workers of the stages it is given on this host, each
joining the head as ``trident worker STAGE --join URL`` does (binding as the first free ``<stage>-<n>``), forked
from a zygote as ``trident serve``'s workers are; it starts again each worker that exits (:mod:`.restarts`), and
on SIGTERM / Ctrl-C stops them all, each unbinding first."""

from __future__ import annotations

import signal
import time

from trident.core.config import WorkerSettings
from trident.supervisor.processes import stop_all
from trident.supervisor.restarts import MAX_QUICK_DEATHS, PAUSE_S, QUICK_DEATH_S, Restarts
from trident.supervisor.zygote import Forked, Zygote


class Node:
    def __init__(self, workers: dict[str, WorkerSettings], python: str, env: dict[str, str], out=print) -> None:
        """``workers``: each worker's settings by its name on this host (``prefill#2``: the second prefill)."""
        self.settings = workers
        self.out = out
        first = next(iter(workers.values()))
        self._zygote = Zygote(python, env, first.backend, first.model)
        self._args = (python, env, first.backend, first.model)
        self.procs: dict[str, Forked] = {}
        self._restarts = Restarts()

    def _start(self, key: str) -> None:
        if not self._zygote.alive:
            self.out("[trident node] the workers' zygote exited; starting it again")
            self._zygote = Zygote(*self._args)
        self.procs[key] = self._zygote.spawn(["worker", "--settings", self.settings[key].model_dump_json()])
        self._restarts.started(key)
        self.out(f"[trident node] started worker {key} (pid {self.procs[key].pid})")

    def run(self) -> int:
        """Until SIGTERM / SIGINT (0), or until every worker has failed (1)."""
        stop: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
        signal.signal(signal.SIGINT, lambda signum, _frame: stop.append(signum))
        try:
            for key in self.settings:
                self._start(key)
            while not stop:
                for key, proc in list(self.procs.items()):
                    if proc.poll() is None:
                        continue
                    del self.procs[key]
                    delay = self._restarts.exited(key)
                    if delay == PAUSE_S:
                        self.out(f"[trident node] worker {key} exited {MAX_QUICK_DEATHS} times in a row within "
                                 f"{QUICK_DEATH_S:.0f} s of starting; starting it again after a pause of {delay:.0f} s")
                    else:
                        self.out(f"[trident node] worker {key} exited with code {proc.returncode}; starting it "
                                 f"again in {delay:.0f} s")
                for key in self._restarts.due():
                    self._start(key)
                time.sleep(0.2)
            self.out(f"[trident node] received {signal.Signals(stop[0]).name}; stopping the workers")
            return 0
        finally:
            self._stop()

    def _stop(self) -> None:
        stop_all(self.procs, lambda line: self.out(f"[trident node] {line}"))
        self._zygote.close()
        self.out("[trident node] stopped")
