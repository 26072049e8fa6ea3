"""``trident serve``: the head. It checks what it is asked, starts Triton (:mod:`.triton_process`), the stage workers
the chosen modes need and the OpenAI frontend (:mod:`.worker_pool`), brings the server to READY
(:mod:`.readiness`), supervises, and stops everything in order.

Order matters: PyTriton starts Triton with ``--load-model=*`` and an ensemble whose steps are not bound fails to load,
so the entry models are loaded through the repository API only after every stage model is ready. Stopping (Ctrl-C /
SIGTERM) drains first (not READY, new requests 503, those in flight finish), then stops Triton, then the workers.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from trident.core import auth, tracing
from trident.core.config import MEDIA_LIMITS_ENV, MODEL_ENV, SCHEDULING_ENV, ServeSettings
from trident.core.device import place, visible_gpus
from trident.core.netutil import port_taken
from trident.core.protocol import BIND_MODEL, MODES, instance_name, stages_for
from trident.core.repository import install_bind_model, install_entry_model
from trident.core.stagecall import frames
from trident.supervisor.joined import JoinedWatch, unbind
from trident.supervisor.readiness import Readiness
from trident.supervisor.restarts import MAX_QUICK_DEATHS, QUICK_DEATH_S
from trident.supervisor.startup import StartupError
from trident.supervisor.triton_process import TritonProcess
from trident.supervisor.warmup import warm_up
from trident.supervisor.worker_pool import WorkerPool

BIND_LOADS = 3  # tries of the bind model's load at start-up, Triton alive
TRITON_DEATH_S = 5.0  # how long a step that failed waits to see whether Triton is exiting (its crash report takes time)


class Launcher:
    """Owns every process ``trident serve`` starts."""

    def __init__(self, settings: ServeSettings, out=None) -> None:
        self.s = settings
        self.out = out or _say
        # (Triton alone gets it, by the shim: no process started inherits it, the workers and the frontend included)
        from_env = os.environ.pop("TRIDENT_ACCESS_TOKEN", None)
        self.token = settings.access_token or from_env or secrets.token_urlsafe(24)
        # the key every record is signed with: Triton (the schedulers) and every worker get it by environment
        self.transfer_secret = settings.transfer_secret or os.environ.get(auth.ENV) or auth.new_secret()
        try:  # (a weak one would let a leaked credential or record give it away offline)
            auth.check_secret(self.transfer_secret, "transfer_secret" if settings.transfer_secret else auth.ENV)
        except ValueError as e:
            raise StartupError(str(e)) from None
        self._tmp: str | None = None
        self.workspace = Path(settings.workspace or self._make_tmp())
        self.model_path: str | None = settings.model
        self.triton: TritonProcess | None = None
        self.workers: WorkerPool | None = None
        self.readiness: Readiness | None = None
        self._joined: JoinedWatch | None = None
        self._serving = False  # start-up is over
        self._stopping = False

    def _make_tmp(self) -> str:
        self._tmp = tempfile.mkdtemp(prefix="trident-")
        return self._tmp

    @property
    def http_url(self) -> str:
        return f"http://{self.s.host}:{self.s.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.s.host}:{self.s.grpc_port}"

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        self._check_ports()
        missing = {m: s for m in (self.s.load or ()) for s in MODES[m] if s not in stages_for(self.s.modes)}
        if missing:
            raise ValueError(f"--load {sorted(missing)} needs stage models that --mode does not start: {missing}")
        counts = {stage: self.s.instances.get(stage, 1) for stage in stages_for(self.s.modes)}  # (0: they join)
        names = [instance_name(stage, i) for stage, count in counts.items() for i in range(1, count + 1)]
        joining = [stage for stage, count in counts.items() if count == 0]
        gpus = place(names, visible_gpus(), self.s.gpus, self.s.device)
        if gpus:
            self.out("[trident] GPUs: " + ", ".join(f"{name} {gpu}" for name, gpu in gpus.items()))
        probe = self._probe_backend() if names else None  # answered while the model folder is found
        if self.model_path is None:
            from trident.dev.demo import default_demo_model

            self.model_path = str(default_demo_model("llava", log=self.out))
        self.out(
            f"[trident] model {self.model_path}; modes {', '.join(self.s.modes)}; {self.s.backend} engine; "
            f"{self.s.scheduler} scheduler" + (f" ({self.s.scheduling.routing} routing)" if self.s.scheduler == "bls" else "")
        )
        self._set_environment()
        self.out(f"[trident] repository-API access token: in {self._token_file()} (readable by you alone)")
        self._check_backend(probe)
        self._check_family()
        # The workers take the longest (their engines load): their zygote starts importing first (once the workspace,
        # which the environment it inherits names, is made), Triton and the frontend beside it, and the workers bind
        # their stage models into Triton's repository once it answers.
        self.triton = triton = TritonProcess(self.s, self.workspace, self.token, self.out)
        self.workers = workers = WorkerPool(self.s, self.model_path, self.http_url, self.grpc_url, self.stats_dir,
                                            triton.model_store, triton.unload, self.out)
        workers.gpus = gpus
        self.readiness = Readiness(self.s, triton, workers, self.out)
        if names:  # (a head whose stages all join from other hosts forks none)
            workers.start_zygote()
        triton.start()
        # the model every worker binds its stage model through (before the workers start); ``names``, the
        # instances of this head's workers, are taken by no joining worker
        install_bind_model(triton.model_store, names)
        self._through_triton_deaths(self._load_bind_model)
        if self.s.openai_port:  # it starts beside the workers and answers 503 until a mode is ready
            workers.start_frontend()
        for name in names:  # as soon as the zygote has imported what they import
            workers.start_worker(name)
        # Every entry model goes into the repository, so any mode whose stages run can be loaded later
        # through the repository API; the chosen ones are loaded now. A BLS scheduler finds its stage
        # instances as they come (it answers 503 until then), so it loads while the workers start; an
        # ensemble needs its steps loaded first.
        for mode in MODES:
            install_entry_model(
                mode, triton.model_store, Path(self.s.repository) if self.s.repository else None,
                scheduler=self.s.scheduler,
            )
        load = self.s.load if self.s.load is not None else self.s.modes
        if names:
            self.out(f"[trident] waiting for stage workers: {', '.join(names)}")
        self._through_triton_deaths(lambda: self.readiness.bring_up(names, joining, load))
        if self.s.warm_up and load:
            warm_up(self.http_url, str(self.model_path), load, self.s.instances, self.out)
        openai = ""
        if self.s.openai_port:
            workers.wait_frontend()
            openai = f"  OpenAI http://{workers.openai_host}:{self.s.openai_port}/v1"
        self._serving = True
        self.out(
            f"[trident] ready in {time.monotonic() - t0:.1f} s: HTTP {self.http_url}  gRPC {self.grpc_url}  "
            f"metrics http://{self.s.host}:{self.s.metrics_port}/metrics{openai}  entry models: {', '.join(load) or 'none'}"
        )

    def _through_triton_deaths(self, step) -> None:
        """Run the start-up ``step``; when Triton exited meanwhile (a crash of its python backend, the OOM killer),
        start it again (after its backoff; the stages bind again) and run ``step`` again, until Triton has exited
        :data:`MAX_QUICK_DEATHS` times in a row (a :class:`StartupError`)."""
        while True:
            try:
                return step()
            except Exception as e:
                if not self.triton.exited(within_s=0.0 if isinstance(e, StartupError) else TRITON_DEATH_S):
                    raise
                if self.triton.start_again(self.workers.live_stage_models, lambda: False) is None:
                    raise StartupError(f"Triton exited {MAX_QUICK_DEATHS} times in a row during start-up (its log: "
                                       f"{self.workspace / 'triton.log'})") from None

    def _load_bind_model(self) -> None:
        """Load the bind model (a start after Triton exited loads it too), asking again after a load that fails while
        Triton lives: its python-backend stub may miss its health checks on a starved host (Triton 2.51 then fails
        the load); :data:`BIND_LOADS` failures in a row are a :class:`StartupError`."""
        for attempt in range(1, BIND_LOADS + 1):
            if self.triton.is_ready(BIND_MODEL):
                return
            try:
                self.triton.load(BIND_MODEL)
                return
            except Exception as e:
                if self.triton.exited(within_s=TRITON_DEATH_S):
                    raise
                if attempt == BIND_LOADS:
                    raise StartupError(f"the bind model did not load ({BIND_LOADS} tries): {e} (Triton's log: "
                                       f"{self.workspace / 'triton.log'})") from None
                self.out(f"[trident] the bind model did not load ({e}); loading it again")

    @property
    def stats_dir(self) -> Path:
        return self.workspace / "stats"

    def _check_ports(self) -> None:
        """Fail at once, naming them, when a port of the server's is taken (Triton would exit, and PyTriton wait)."""
        ports = {"HTTP": (self.s.host, self.s.http_port), "gRPC": (self.s.host, self.s.grpc_port),
                 "metrics": (self.s.host, self.s.metrics_port)}
        if self.s.openai_port:
            ports["OpenAI"] = (self.s.openai_host or self.s.host, self.s.openai_port)
        taken = [f"{what} {host}:{port}" for what, (host, port) in ports.items() if port_taken(host, port)]
        if taken:
            raise StartupError(f"ports in use: {', '.join(taken)} (another server, or one still stopping?)")

    def _probe_backend(self) -> subprocess.Popen | None:
        """With ``--backend vllm``: whether the workers' Python can import vllm, asked now, answered to
        :meth:`_check_backend`."""
        if self.s.backend != "vllm":
            return None
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        return subprocess.Popen([self.s.worker_python or sys.executable, "-c", probe])

    def _check_backend(self, probe: subprocess.Popen | None) -> None:
        if probe is None:
            return
        python = self.s.worker_python or sys.executable
        if probe.wait() != 0:
            raise StartupError(
                f"--backend vllm: the workers' Python ({python}) cannot import vllm. Install it with "
                "`make install-vllm` and pass --worker-python .venv-vllm/bin/python (or set TRIDENT_WORKER_PYTHON)"
            )

    def _check_family(self) -> None:
        """The engine must be able to serve the model: the hf engine its family adapters' models, the vllm engine also
        a model none lists whose chat template marks its media (:mod:`trident.core.families.checkpoint`)."""
        import json
        from types import SimpleNamespace

        from trident.core.families import family_of

        try:
            config = json.loads((Path(self.model_path) / "config.json").read_bytes())
            family = family_of(SimpleNamespace(model_type=config.get("model_type")), self.model_path)
        except (OSError, ValueError) as e:
            raise StartupError(f"model {self.model_path}: {e}") from None
        if not family.listed and self.s.backend == "hf":
            try:
                family.load_model()
            except ValueError as e:
                raise StartupError(str(e)) from None

    def _token_file(self) -> Path:
        """The access token in a file of the workspace only its owner may read (never in a log line)."""
        self.workspace.mkdir(parents=True, exist_ok=True)
        path = self.workspace / "access-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        return path

    def _set_environment(self) -> None:
        """What Triton, its stubs, the workers and the frontend inherit."""
        _server_environment()
        os.environ[MODEL_ENV] = str(self.model_path)  # the schedulers' tokenizer (not in a config a client can read)
        os.environ[SCHEDULING_ENV] = self.s.scheduling.model_dump_json()  # (nor are the schedulers' settings)
        os.environ[auth.ENV] = self.transfer_secret
        os.environ[MEDIA_LIMITS_ENV] = self.s.media_limits.model_dump_json()  # Triton's stubs, the workers, the frontend
        os.environ[frames.FRAME_LIMIT_ENV] = str(frames.limit_for(self.s.media_limits))
        tracing_settings = self.s.tracing
        if tracing_settings.exporter is not None:  # Triton's stubs, the workers and the frontend inherit them
            os.environ[tracing.EXPORTER_ENV] = tracing_settings.exporter
        if tracing_settings.folder:
            os.environ[tracing.DIR_ENV] = str(Path(tracing_settings.folder).resolve())
        exporter = tracing.exporter_name()
        if exporter != "none":
            where = os.environ.get(tracing.DIR_ENV) if exporter == "file" else exporter
            self.out(f"[trident] tracing every request with OpenTelemetry: spans to {where}")

    # -- run and stop -------------------------------------------------------------------------------
    def supervise(self) -> int:
        """Block until a signal (returns 0) or until Triton has died too often (returns 1: everything is stopped, and
        a service manager restarts the server); a Triton that dies is started again (:meth:`_triton_back`). The
        head's workers are watched by their exit (:class:`.WorkerPool`), the workers that joined from elsewhere by
        their connections (:mod:`.joined`)."""
        stop = {"signal": None}
        self._joined = JoinedWatch(self.workers.names, lambda name, worker: unbind(self.http_url, name, worker),
                                   self.out)
        self._joined.start()

        def _handler(signum, _frame):
            stop["signal"] = signum

        signal.signal(signal.SIGINT, _handler)
        signal.signal(signal.SIGTERM, _handler)
        while stop["signal"] is None:
            self.triton.kill_if_hung()
            if not self.triton.is_alive() and not self._triton_back(lambda: stop["signal"] is not None):
                return 1
            self.workers.watch(self.triton.is_ready)
            time.sleep(0.2)
        self.out(f"[trident] received {signal.Signals(stop['signal']).name}; shutting down")
        return 0

    def _triton_back(self, stopping) -> bool:
        """Triton exited on its own (a crash, the OOM killer): start it again and serve again (:class:`.Readiness`).
        The requests that were in flight through it end with an error (the HTTP front cuts their answers; gRPC
        streams break). False when it has exited :data:`MAX_QUICK_DEATHS` times in a row, each within
        :data:`QUICK_DEATH_S` of its start: the head gives up (exit 1), and a supervisor above it (Kubernetes,
        systemd) takes over."""
        t0 = time.monotonic()
        own = self.triton.start_again(self.workers.live_stage_models, stopping)
        if own is None:
            self.out(f"[trident] Triton exited {MAX_QUICK_DEATHS} times in a row within {QUICK_DEATH_S:.0f} s of "
                     "starting; stopping everything (exit code 1)")
            return False
        if stopping():
            return True
        try:
            self.readiness.bring_up(own, [], self.s.load if self.s.load is not None else self.s.modes, again=True)
        except Exception as e:  # noqa: BLE001 - it died again, or a load failed: the next round of the loop sees it
            self.out(f"[trident] Triton did not come back: {e}")
            return True
        self.out(f"[trident] Triton is back in {time.monotonic() - t0:.1f} s: READY")
        return True

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._joined is not None:
            self._joined.stop()
        if self._serving and self.triton is not None and self.triton.is_alive():
            self.readiness.drain()
        # Triton first: it takes no new request and lets those in flight finish on the workers, which are still up
        # (then the workers have no model to unbind)
        if self.triton is not None:
            self.triton.stop()
        if self.workers is not None:
            self.workers.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.out("[trident] stopped")


def _server_environment() -> None:
    """Environment the Triton server and its python-backend stubs inherit (see ENVIRONMENT.md)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:  # the stub links libpython: use this interpreter's, not the system's
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    bindir = str(Path(sys.executable).parent)
    if not os.environ.get("PATH", "").startswith(bindir):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _say(line: str) -> None:
    """Print a log line; output that has gone away (a closed pipe) must not stop a shutdown half-way and leave
    workers running."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, OSError):
        pass


def serve(settings: ServeSettings) -> int:
    # every file the server and the processes it starts write (its workspace: worker files, stats, Triton's log, the
    # model store) is its user's alone (the python backend's /dev/shm regions too: supervisor/triton_shim.c)
    os.umask(0o077)
    launcher = Launcher(settings)

    interrupted: list[int] = []

    def _during_start_up(signum, _frame):
        interrupted.append(signum)
        raise KeyboardInterrupt  # stop what has started (below), not exit with workers left running

    signal.signal(signal.SIGTERM, _during_start_up)
    try:
        launcher.start()
        if interrupted:  # raised where Python ignores exceptions (logging's at-fork hook as a worker started): lost
            raise KeyboardInterrupt
        code = launcher.supervise()
    except KeyboardInterrupt:
        launcher.out("[trident] interrupted during start-up; shutting down")
        code = 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the shutdown short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
    return code
