"""When the head's server is READY, and when it stops being so.

READY comes once a request would be served: the stage models of the head's workers ready, each stage with no worker
on this host joined from another, the entry models loaded (a BLS entry model loads only when a request to it would
be served; an ensemble needs its steps), and then the start-up gate opened (:mod:`.gate`). The same holds after
Triton was started again. A stop withdraws it first: the drain (:meth:`Readiness.drain`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from typing import Callable

from trident.core import drain
from trident.core.config import ServeSettings
from trident.core.protocol import MODES, instance_name, parse_instance
from trident.supervisor.gate import GATE, close_gate, open_gate
from trident.supervisor.startup import StartupError
from trident.supervisor.triton_process import TritonProcess
from trident.supervisor.worker_pool import WorkerPool


class Readiness:
    def __init__(self, settings: ServeSettings, triton: TritonProcess, workers: WorkerPool,
                 out: Callable[[str], None]) -> None:
        self.s, self.triton, self.workers, self.out = settings, triton, workers, out

    def bring_up(self, own: list[str], joining: list[str], modes: list[str], again: bool = False) -> list[str]:
        """Wait for the stage models ``own`` (this head's workers') and for an instance of each stage of ``joining``
        (stages with no worker here) to be ready, load the entry models ``modes`` side by side, and open the gate;
        returns the modes loaded. At start-up (not ``again``) each step must succeed: a worker that exits, a load that
        fails or the time running out is a :class:`StartupError`, and Triton's exit a :class:`.TritonExited`. After
        Triton was started ``again``, a worker that exits meanwhile is its supervision's, and a mode that does not
        load stays unloaded while the rest serve; a Triton that is not back raises."""
        self._wait_ready(own, again)
        if joining:
            self._wait_joined(joining)
        loading = {mode: self._load_beside(mode) for mode in modes}
        loaded = []
        for mode, done in loading.items():
            try:
                done.result()
                loaded.append(mode)
            except Exception as e:  # noqa: BLE001 - a stage of it is down: the mode stays unloaded, the rest serve
                if not again:
                    raise
                self.out(f"[trident] entry model {mode} did not load again: {e}")
        if again and not self.triton.is_alive():
            raise RuntimeError("it exited again")
        with self.triton.client() as client:
            open_gate(client, self.triton.headers, self.triton.model_store, loaded[0] if loaded else None, self.out)
        return loaded

    def _wait_ready(self, names: list[str], again: bool) -> None:
        deadline = time.monotonic() + self.s.startup_timeout_s
        pending = set(names)
        with self.triton.client(network_timeout=10 if again else 60) as client:
            while True:
                if again:  # (a worker that exits meanwhile is its supervision's)
                    if not self.triton.is_alive():
                        raise RuntimeError("it exited again")
                    pending = {name for name in pending if self.workers.running(name)}
                else:
                    self.workers.check_up(pending)
                    self.triton.check_alive()
                for name in [name for name in pending if _model_ready(client, name)]:
                    pending.discard(name)
                    if not again:
                        self.out(f"[trident] stage model {name} is ready")
                if not pending and (not again or _live(client)):
                    return
                if time.monotonic() > deadline:
                    what = f"stage models not ready after {self.s.startup_timeout_s:.0f} s: {sorted(pending)}"
                    raise StartupError(what) if not again else RuntimeError(f"Triton is not live, or {what}")
                time.sleep(0.1)

    def _wait_joined(self, stages: list[str]) -> None:
        """Wait, for as long as it takes (not READY meanwhile), until each stage with no worker on this host has an
        instance that joined from another host; the workers of this host must stay up meanwhile."""
        join = f"trident worker STAGE --model PATH --join http://<this host>:{self.s.http_port}"
        self.out(f"[trident] waiting for stage hosts to join: {', '.join(stages)} (`{join}` on each)")
        said, missing = time.monotonic(), set(stages)
        while missing:
            self.workers.check_up(self.workers.procs)
            self.triton.check_alive()
            with self.triton.client(network_timeout=5) as client:
                for name in [instance_name(stage, n) for stage in sorted(missing) for n in range(1, 5)]:
                    if parse_instance(name)[0] in missing and _model_ready(client, name):
                        missing.discard(parse_instance(name)[0])
                        self.out(f"[trident] stage model {name} joined")
            if missing and time.monotonic() - said > 60:
                said = time.monotonic()
                self.out(f"[trident] still waiting for stage hosts to join: {', '.join(sorted(missing))}")
            if missing:
                time.sleep(0.5)

    def _load_beside(self, mode: str) -> Future:
        """The entry model ``mode`` loaded on a thread of its own (Triton loads one model at a time: a load may wait
        for the others); its future raises what the load raised."""
        future: Future = Future()

        def run() -> None:
            try:
                self.triton.load(mode, network_timeout=self.s.startup_timeout_s)
                self.out(f"[trident] entry model {mode} loaded")
                future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting start-up
                future.set_exception(e)

        threading.Thread(target=run, name=f"trident-load-{mode}", daemon=True).start()
        return future

    def drain(self) -> None:
        """A stop's first part, while everything still runs: readiness withdrawn (the start-up gate, failed again),
        every entry model refusing new requests at once with 503 (:mod:`trident.core.drain`) and serving those in
        flight to their end, waited for at most ``drain_s``."""
        t0 = time.monotonic()
        drain.start()
        modes: list[str] = []
        try:
            with self.triton.client(network_timeout=5) as client:
                modes = [m["name"] for m in client.get_model_repository_index(headers=self.triton.headers)
                         if m["name"] in MODES and m.get("state") == "READY"]
                close_gate(self.triton.model_store)
                with contextlib.suppress(Exception):  # (it fails, by design: Triton is not READY from now on)
                    client.load_model(GATE, headers=self.triton.headers)
        except Exception as e:  # noqa: BLE001 - Triton going away: its own drain still runs
            self.out(f"[trident] could not withdraw readiness: {e}")
        self.out(f"[trident] draining: not READY, new requests answered 503; waiting for the requests in flight "
                 f"(at most {self.s.drain_s:g} s)")
        if self.s.scheduler != "bls":  # (an ensemble's requests are Triton's own to drain)
            return
        while not all(drain.drained(m) for m in modes) and time.monotonic() - t0 < self.s.drain_s:
            time.sleep(0.05)
        left = [m for m in modes if not drain.drained(m)]
        self.out(f"[trident] drained in {time.monotonic() - t0:.1f} s" if not left else
                 f"[trident] {', '.join(left)} still serving after {self.s.drain_s:g} s; stopping anyway")


def _live(client) -> bool:
    try:
        return client.is_server_live()
    except Exception:  # noqa: BLE001 - not up yet (the front answers 503, or the client's own errors)
        return False


def _model_ready(client, name: str) -> bool:
    try:
        return client.is_model_ready(name)
    except Exception:  # noqa: BLE001 - Triton still starting
        return False
