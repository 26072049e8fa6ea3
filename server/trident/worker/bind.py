"""``trident worker``: build the stage's engine, bind its model into a running Triton, serve until stopped.

Errors cross in a structured way: a failed call's answer is a :class:`~trident.core.protocol.Failure` naming the error
class; the stub side (:mod:`.proxy_model`) turns it into a Triton error with the class's code, so Triton's
endpoints answer with the matching status.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import msgspec

from trident.core.config import WorkerSettings
from trident.core.errors import NameTaken, TridentError, Unavailable, from_message
from trident.core.bind_call import ask
from trident.core.protocol import NAME_TAKEN_EXIT, STAGES, Bind
from trident.worker.health import Health

log = logging.getLogger("trident.worker")


def _write_stats(stats, path: Path, stop: threading.Event) -> None:
    """Keep ``path`` holding this worker's counters (``stats()``: :meth:`StageHandler.stats
    <trident.worker.infer.StageHandler.stats>`), read by tests and operators. A write that fails (a full disk) is
    tried again at the next change or tick, with one warning until one succeeds: serving goes on."""
    last, failing = None, False
    while True:
        now = stats()
        if now != last:
            tmp = path.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(now, sort_keys=True))
                tmp.replace(path)
            except OSError as e:
                if not failing:
                    log.warning("worker stats: cannot write %s (%s); trying again", path, e)
                failing = True
            else:
                last, failing = now, False
        if stop.wait(0.2):
            return


def _answers(url: str, name: str | None = None) -> bool:
    """Whether the server at ``url`` shows stage model ``name`` ready (None: answers as live). A connection of its
    own, closed at once: a stopping Triton waits for its open HTTP connections."""
    import urllib.error
    import urllib.request

    base = url if "://" in url else f"http://{url}"
    path = f"v2/models/{name}/ready" if name else "v2/health/live"
    try:
        with urllib.request.urlopen(f"{base}/{path}", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):  # (HTTPError: not ready; the others: not reachable)
        return False


def _wait_for_server(url: str) -> None:
    """Until the server at ``url`` answers as live, for as long as it takes (one log line if it does not at once)."""
    if not _answers(url):
        log.warning("waiting for the server at %s to answer", url)
        while not _answers(url):
            time.sleep(0.5)


def _watch_server(url: str, name: str | None, misses: int = 3) -> None:
    """Return once the server at ``url`` has not shown stage model ``name`` ready (None: has not answered as live)
    ``misses`` times in a row, a second apart (it is gone, or restarted without it)."""
    missed = 0
    while missed < misses:
        time.sleep(1.0)
        missed = 0 if _answers(url, name) else missed + 1


BIND_S = 300.0  # how long a worker asks the head's bind model before it gives up binding
ASK_S = 60.0  # the longest one ask waits for its answer (a bind loads a stage model: seconds); then it asks again


def bind(url: str, request: Bind) -> str | None:
    """Ask the head's bind model (:mod:`.bind_model`, at the server ``url``) to bind ``request``: the instance name it
    bound, or None when another live worker serves the name asked for. While the bind model is not there yet (the
    head starting) or cannot bind now, asks again (one line after 30 s) for up to :data:`BIND_S`; raises its
    refusal."""
    from tritonclient.utils import InferenceServerException

    started = time.monotonic()
    deadline, said = started + BIND_S, False
    while True:
        try:  # (an ask whose answer never comes, as when Triton died under it, is asked again: the same worker gets
            # its name back if that bind went through)
            return ask(url, request, max(1.0, min(ASK_S, deadline - time.monotonic())))
        except InferenceServerException as e:
            error = from_message(str(e))
            if isinstance(error, NameTaken):
                return None
            if error is not None and not isinstance(error, Unavailable):
                raise error from None
            why = error.message if error is not None else str(e)  # (not loaded yet: the head is starting)
        except OSError as e:  # not reachable, or no answer in time
            why = str(e) or type(e).__name__
        if time.monotonic() > deadline:
            raise Unavailable(f"the server at {url} did not bind {request.stage} within {BIND_S:.0f} s: {why}")
        if not said and time.monotonic() - started > 30:  # (one line: a head starting takes a while)
            log.warning("worker %s: the server at %s has not bound it yet (%s); asking until it does", request.stage,
                        url, why)
            said = True
        time.sleep(1.0)


def _bind_again(url: str, request: Bind, name: str) -> str | None:
    """Bind a worker that was bound as ``name`` and lost its server or its stage model: as ``name`` again, so it
    keeps its instance (its stats and the scheduler's view of it), or, when another worker has taken that name, as
    a joining worker (``request.name`` None) does."""
    again = bind(url, msgspec.structs.replace(request, name=name))
    if again is None and request.name is None:
        log.warning("worker %s: another worker now serves %s; joining under a new name", name, name)
        return bind(url, request)
    return again


def unbind(url: str, request: Bind) -> None:
    """Ask the head's bind model to unload the stage model bound for this worker (best effort, 5 s: a head that is
    gone unloads it itself)."""
    try:
        ask(url, msgspec.structs.replace(request, leave=True), 5.0)
    except Exception as e:  # noqa: BLE001
        log.info("worker %s: unbinding failed (%s)", request.name, e)


def run_worker(settings: WorkerSettings) -> int:
    from trident.core import tracing
    from trident.worker.engines import build_engine
    from trident.core.stagecall import StageServer
    from trident.core.stagecall.server import at_most, unix_folder
    from trident.worker.infer import make_handler

    # `kill -USR1 <pid>`: every thread's Python stack on stderr (the server's output), as a worker that does not bind
    # or answer is looked into; nothing else changes
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    health = Health(settings.transfer.data_address, settings.health_port) if settings.health_port else None
    if settings.free_name:  # a worker that joins may start before its server (pods of a cluster start together)
        _wait_for_server(settings.url)
    spec = STAGES[settings.stage]
    if settings.backend == "vllm":
        # vLLM's engine processes talk over ZeroMQ IPC socket files in VLLM_RPC_BASE_PATH (default: the system's
        # temporary folder, where they stayed after the server stopped): this worker's own folder, which goes
        # when the worker stops (the server removes it when the worker was killed)
        os.environ.setdefault("VLLM_RPC_BASE_PATH", unix_folder())
    engine = build_engine(settings)
    handler = make_handler(spec, engine, settings.max_inflight)
    infer = handler.infer if spec.decoupled else at_most(handler.infer, engine.calls_at_once, handler.entry)
    server = StageServer(infer, handler.control, settings.transfer.data_address)
    server.start()
    pid = os.getpid() if settings.same_host else None  # (a pid and a Unix socket mean something on its host only)
    request = Bind(stage=settings.stage, tcp=tuple(server.address), instances=engine.calls_at_once,
                   name=None if settings.free_name else settings.model_name, pid=pid,
                   direct=server.path if settings.same_host else None)
    # where its records' consumers claim them (its stage socket): a transfer endpoint's leases, a vllm KV producer's
    claims = [holder for holder in (engine.kv_claims, getattr(engine, "endpoint", None)) if holder is not None]
    for holder in claims:
        holder.serving_at(request.worker_file(settings.model_name))  # (its name once bound, below)
    stop = threading.Event()

    def keep_stats(name: str) -> None:
        if settings.stats_dir:
            Path(settings.stats_dir).mkdir(parents=True, exist_ok=True)
            threading.Thread(target=_write_stats, daemon=True,
                             args=(handler.stats, Path(settings.stats_dir) / f"{name}.json", stop)).start()

    if not settings.free_name:  # its name is known: its stats from now on, not from its first bind (a Triton that
        keep_stats(settings.model_name)  # died under that bind left a serving worker without them for a minute)

    def _on_signal(signum, _frame):
        log.info("worker %s: signal %d, unbinding and stopping", settings.model_name, signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    name, first = None, True
    try:
        while True:
            try:
                name = _bind_again(settings.url, request, name) if name is not None else bind(settings.url, request)
            except TridentError as e:  # refused, or no answer for BIND_S: one line, exit 1 (a supervisor starts it again)
                log.error("worker %s: the server at %s did not bind it: %s", settings.model_name, settings.url, e)
                return 1
            if name is None:
                if health:
                    health.state = "not bound"
                log.error("worker %s: another worker already serves stage model %s; not binding",
                          settings.model_name, settings.model_name)
                return NAME_TAKEN_EXIT
            for holder in claims:
                holder.serving_at(request.worker_file(name))
            if first:  # (its traces and a joined worker's stats file keep the first name it bound as)
                first = False
                tracing.start(name)
                if settings.free_name:
                    keep_stats(name)
            # a worker `trident serve` started: its server says when the stage model is ready; one joined says it
            (log.warning if settings.free_name else log.info)(
                "worker %s (%s engine, pid %d) bound into %s", name, settings.backend, os.getpid(), settings.url)
            if health:
                health.state = "serving"
            if not settings.free_name:
                from trident.core.config import HEAD_PID_ENV

                if os.environ.get(HEAD_PID_ENV):  # `trident serve`'s own: it loads the stage model again after a
                    while True:                   # Triton restart, and stops the worker (or its death does)
                        time.sleep(3600)
                _watch_server(settings.url, None)  # one started by hand with --url: it stops when the server goes
                break
            _watch_server(settings.url, name)
            # its server went away (a restart) or no longer serves its stage model: bind again once it is back
            if health:
                health.state = "lost its server"
            log.warning("worker %s: the server at %s no longer serves %s; binding again once it answers",
                        name, settings.url, name)
            _wait_for_server(settings.url)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: a second signal would cut it short
        if health:
            health.state = "stopping"
        if settings.free_name and name is not None:  # (serve unloads its own workers' stage models)
            unbind(settings.url, msgspec.structs.replace(request, name=name))
        server.stop()  # the calls taken finish, later ones are answered Gone
        stop.set()
        engine.close()
    return 0
