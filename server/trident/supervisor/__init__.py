"""``trident serve``: start Triton, the stage workers the chosen modes need, load the entry models, supervise.

The jobs beside starting and supervising have modules of their own: the start-up gate that keeps the server not
READY until the entry models are loaded (:mod:`.gate`), the warm-up request through each entry model
(:mod:`.warmup`), and finding and stopping what a server leaves behind (:mod:`.processes`).

Order matters: PyTriton starts Triton with ``--load-model=*`` and an ensemble whose steps are not bound
fails to load, so the entry models are loaded through the repository API only after every stage model
is ready. Stopping (Ctrl-C / SIGTERM) stops Triton first (it takes no new request, and the requests in flight
finish on the workers, still up), then the workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from trident.core import auth, drain, tracing
from trident.core.device import place, visible_gpus
from trident.core.config import MEDIA_LIMITS_ENV, MODEL_ENV, SCHEDULING_ENV, MiB, FrontendSettings, ServeSettings, VLLMConfig, WorkerSettings
from trident.core.netutil import listen_ports, port_taken
from trident.core.protocol import BIND_MODEL, MODES, NAME_TAKEN_EXIT, STAGES, instance_name, parse_instance, stages_for
from trident.core.repository import install_bind_model, install_entry_model
from trident.core.stagecall import directory
from trident.supervisor.gate import GATE, close_gate, open_gate
from trident.supervisor.restarts import MAX_QUICK_DEATHS, PAUSE_S, QUICK_DEATH_S, Restarts
from trident.supervisor.quiet import quiet
from trident.supervisor.startup import StartupError
from trident.supervisor.processes import (
    HEAD_PID_ENV, OWN_GROUP, descendants, is_stub, is_stub_of, kill_left, remove_direct_socket, remove_shm_regions, stop_all, stubs_of,
)
from trident.supervisor import pytriton_patch, triton_shim
from trident.supervisor.http_front import HttpFront, Route, max_body_bytes
from trident.supervisor.joined import JoinedWatch
from trident.supervisor.warmup import warm_up
from trident.supervisor.zygote import Forked, Zygote

__all__ = ["Launcher", "descendants", "serve"]

log = logging.getLogger("trident.supervisor")
TRITON = "tritonserver"  # its name in the launcher's Restarts


def _server_environment() -> None:
    """Environment the Triton server and its python-backend stubs inherit (see ENVIRONMENT.md)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:  # the stub links libpython: use this interpreter's, not the system's
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    bindir = str(Path(sys.executable).parent)
    if not os.environ.get("PATH", "").startswith(bindir):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def own_side_channel(vllm: VLLMConfig, backend: str, stage: str) -> VLLMConfig:
    """A vLLM KV worker's settings with a NIXL side-channel port of its own (unless one is set), out of the range
    vLLM's own free ports come from: two such workers on one host never collide."""
    spec = STAGES[stage]
    if backend == "vllm" and "kv" in (spec.takes, spec.hands_on) and vllm.nixl_port is None:
        return vllm.model_copy(update={"nixl_port": listen_ports(1)[0]})
    return vllm


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
        self.workers: dict[str, subprocess.Popen | Forked] = {}  # by Triton model name (and "frontend")
        self._zygote: Zygote | None = None
        self._joined: JoinedWatch | None = None
        self._serving = False  # start-up is over
        self.triton = None
        self._front: HttpFront | None = None
        self._tmp: str | None = None
        self.workspace = Path(settings.workspace or self._make_tmp())
        self.model_path: str | None = settings.model
        self._stopping = False
        self._restarts = Restarts()  # when a worker (or the frontend) that exited starts again
        self._triton_restarts = Restarts(give_up=True)  # Triton's own deaths in a row (_triton_back)
        self._coming_back: set[str] = set()  # restarted workers whose stage model is not ready yet
        self._gpus: dict[str, str] = {}  # CUDA_VISIBLE_DEVICES by worker (device.place); none on a CPU host

    def _make_tmp(self) -> str:
        self._tmp = tempfile.mkdtemp(prefix="trident-")
        return self._tmp

    @property
    def stats_dir(self) -> Path:
        return self.workspace / "stats"

    @property
    def http_url(self) -> str:
        return f"http://{self.s.host}:{self.s.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.s.host}:{self.s.grpc_port}"

    @property
    def openai_host(self) -> str:
        return self.s.openai_host or self.s.host

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
        self._gpus = place(names, visible_gpus(), self.s.gpus, self.s.device)
        if self._gpus:
            self.out("[trident] GPUs: " + ", ".join(f"{name} {gpu}" for name, gpu in self._gpus.items()))
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
        self._make_triton_workspace()
        if names:  # (a head whose stages all join from other hosts forks none)
            self._start_zygote()
        self._start_triton()
        self._load_bind_model(names)  # (before the workers start: they bind through it)
        if self.s.openai_port:  # it starts beside the workers and answers 503 until a mode is ready
            frontend = self._spawn_frontend()
        for name in names:  # as soon as the zygote has imported what they import
            self._start_worker(name)
        # Every entry model goes into the repository, so any mode whose stages run can be loaded later
        # through the repository API; the chosen ones are loaded now. A BLS scheduler finds its stage
        # instances as they come (it answers 503 until then), so it loads while the workers start; an
        # ensemble needs its steps loaded first.
        for mode in MODES:
            install_entry_model(
                mode, self.model_store, Path(self.s.repository) if self.s.repository else None,
                scheduler=self.s.scheduler,
            )
        load = self.s.load if self.s.load is not None else self.s.modes
        if names:
            self.out(f"[trident] waiting for stage workers: {', '.join(names)}")
        while True:  # (again after Triton exited meanwhile: started again, the stages bind again)
            try:
                self._serve_first(names, joining, load)
                break
            except Exception:
                if self.triton.is_alive():
                    raise
                if self._start_triton_again({"signal": None}) is None:
                    raise StartupError(f"Triton exited {MAX_QUICK_DEATHS} times in a row during start-up (its log: "
                                       f"{self.workspace / 'triton.log'})") from None
        if self.s.warm_up and load:
            warm_up(self.http_url, str(self.model_path), load, self.s.instances, self.out)
        openai = ""
        if self.s.openai_port:
            self._wait_frontend(frontend)
            openai = f"  OpenAI http://{self.openai_host}:{self.s.openai_port}/v1"
        self._serving = True
        self.out(
            f"[trident] ready in {time.monotonic() - t0:.1f} s: HTTP {self.http_url}  gRPC {self.grpc_url}  "
            f"metrics http://{self.s.host}:{self.s.metrics_port}/metrics{openai}  entry models: {', '.join(load) or 'none'}"
        )

    def _serve_first(self, names: list[str], joining: list[str], load: list[str]) -> None:
        """Start-up once Triton runs: the stage models of this head's workers ready, the joining stages joined, the
        entry models loaded (an entry model loads only when a request to it would be served: the BLS refuses to load
        otherwise, an ensemble needs its steps), and the gate opened: READY from here. :class:`TritonExited` when
        Triton exits meanwhile."""
        self._wait_ready(names)
        if joining:
            self._wait_joined(joining)
        loading = [self._load_beside(mode) for mode in load]
        for done in loading:
            done.result()
        with self._client() as client:
            open_gate(client, self.headers, self.model_store, load[0] if load else None, self.out)

    def _check_ports(self) -> None:
        """Fail at once, naming them, when a port of the server's is taken (Triton would exit, and PyTriton wait)."""
        ports = {"HTTP": (self.s.host, self.s.http_port), "gRPC": (self.s.host, self.s.grpc_port),
                 "metrics": (self.s.host, self.s.metrics_port)}
        if self.s.openai_port:
            ports["OpenAI"] = (self.openai_host, self.s.openai_port)
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
        tracing_settings = self.s.tracing
        if tracing_settings.exporter is not None:  # Triton's stubs, the workers and the frontend inherit them
            os.environ[tracing.EXPORTER_ENV] = tracing_settings.exporter
        if tracing_settings.folder:
            os.environ[tracing.DIR_ENV] = str(Path(tracing_settings.folder).resolve())
        exporter = tracing.exporter_name()
        if exporter != "none":
            where = os.environ.get(tracing.DIR_ENV) if exporter == "file" else exporter
            self.out(f"[trident] tracing every request with OpenTelemetry: spans to {where}")

    @property
    def model_store(self) -> Path:
        """Triton's model repository (PyTriton's, in the workspace; made by :meth:`_make_triton_workspace`)."""
        return self._triton_workspace.model_store_path

    def _make_triton_workspace(self) -> None:
        from pytriton.utils.workspace import Workspace

        self._triton_workspace = Workspace(self.workspace / "triton")
        directory.create(self.workspace / "stages")  # Triton's stubs enter their workers here, for the schedulers

    def _start_triton(self) -> None:
        from pytriton.triton import TRITON_ACCESS_HEADER, Triton, TritonConfig, TritonSecurityConfig


        self.out(
            f"[trident] starting Triton on HTTP {self.s.http_port}, gRPC {self.s.grpc_port}, metrics "
            f"{self.s.metrics_port} (server log: {self.workspace / 'triton.log'})"
        )
        from trident.supervisor.pytriton_patch import bind_when_live, keep_workspace, quiet_triton_output

        bind_when_live()  # the start-up gate keeps the server from READY: PyTriton waits for it to be live
        quiet_triton_output()
        close_gate(self.model_store)
        # The token guards what changes the server; statistics stay open for perf_analyzer and dashboards. Triton
        # reads it from its argv alone, so the argv holds a placeholder the preloaded shim swaps for it.
        restriction = triton_shim.restriction(["model-repository", "shared-memory", "trace", "logging"],
                                              TRITON_ACCESS_HEADER)
        config = TritonConfig(
            http_address=self.s.host, http_port=self.s.http_port, grpc_address=self.s.host, grpc_port=self.s.grpc_port,
            metrics_address=self.s.host, metrics_port=self.s.metrics_port, exit_timeout_secs=self.s.drain_s, log_verbose=0,
            log_file=self.workspace / "triton.log", exit_on_error=False,  # (the gate fails to load, by design)
            # GPU metrics need NVML; without an NVIDIA driver, asking for them only prints an error at start
            allow_gpu_metrics=None if shutil.which("nvidia-smi") else False,
            http_restricted_api=restriction, grpc_restricted_protocol=restriction,
            trace_config=tracing.triton_trace_config() or None,  # (Triton's own spans, with OTLP)
        )
        self.triton = Triton(
            config=config,
            workspace=self._triton_workspace,
            # PyTriton's own calls carry the token; the restriction is the config's above, not PyTriton's (with argv)
            security_config=TritonSecurityConfig(access_token=self.token, restricted_endpoints=[]),
        )
        # Triton's HTTP and metrics servers on Unix sockets of the workspace, the bounded front on their public ports
        sockets = self._socket_folder()
        upstream = {"http": sockets / "http.sock", "metrics": sockets / "metrics.sock"}
        self._front = HttpFront([Route("HTTP", self.s.host, self.s.http_port, upstream["http"]),
                                 Route("metrics", self.s.host, self.s.metrics_port, upstream["metrics"])],
                                max_body_bytes(self.s.media_limits))
        self._front.start()
        self._shim = triton_shim.build(self.workspace)
        with self._preloaded():
            self.triton.run()
        keep_workspace(self.triton)  # (its exit is the launcher's to handle: _triton_back)
        self._triton_restarts.started(TRITON)

    def _preloaded(self):
        """What Triton starts with: the shim, the token, the front's sockets."""
        sockets = self.workspace / "sockets"
        return triton_shim.preloaded(self._shim, self.token, self.s.allow_code_upload,
                                     {"http": sockets / "http.sock", "metrics": sockets / "metrics.sock"})

    def _socket_folder(self) -> Path:
        """The folder of Triton's Unix sockets: its user's alone, whatever the workspace's mode."""
        folder = self.workspace / "sockets"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        longest = folder / "metrics.sock"
        if len(os.fsencode(longest)) >= 108:
            raise StartupError(f"the workspace's path is too long for a Unix socket ({longest}): choose a shorter "
                               "workspace")
        for name in ("http.sock", "metrics.sock"):  # (a server stopped by SIGKILL leaves its sockets)
            (folder / name).unlink(missing_ok=True)
        return folder

    def _load_bind_model(self, names: list[str]) -> None:
        """The model every worker binds its stage model through (:mod:`..workers.bind_model`); ``names``: the
        instance names of this launcher's workers, which no joining worker takes."""
        install_bind_model(self.model_store, names)
        with self._client() as client:
            client.load_model(BIND_MODEL, headers=self.headers)

    def worker_settings(self, name: str) -> WorkerSettings:
        """What the worker bound as model ``name`` (``<stage>`` or ``<stage>-<n>``) gets, whole, as JSON."""
        stage, _ = parse_instance(name)
        vllm = own_side_channel(self.s.vllm, self.s.backend, stage)
        return WorkerSettings(
            stage=stage, name=name, model=str(self.model_path), url=self.http_url, backend=self.s.backend,
            threads=self.s.threads_per_worker, same_host=True, stats_dir=str(self.stats_dir),
            transfer=self.s.transfer, vllm=vllm, embedding_cache_bytes=self.s.embedding_cache_mib * MiB,
            max_inflight=self.s.max_inflight, device=self.s.device, dtype=self.s.dtype,
            cuda_visible_devices=self._gpus.get(name),
        )

    def _start_zygote(self) -> None:
        """The process the workers are forked from (:mod:`.zygote`), importing while Triton starts; its environment,
        taken now, is theirs (the stage directory's included). A worker may run from another environment (e.g. an engine needing numpy 2, which the Triton python-backend stub cannot
        take): the zygote runs the workers' Python."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", **{HEAD_PID_ENV: str(os.getpid())})
        quiet(env, self.s.vllm.log_level)
        self._zygote = Zygote(self.s.worker_python or sys.executable, env, self.s.backend, str(self.model_path))

    def _start_worker(self, name: str) -> None:
        # (a process group of its own: a terminal's Ctrl-C reaches the launcher alone, which stops everything in order;
        # vLLM's engine process, sent it too, died under its worker and each worker printed a traceback)
        if self._zygote is None or not self._zygote.alive:
            if self._zygote is not None:
                self.out("[trident] the workers' zygote exited; starting it again")
            self._start_zygote()
        self.workers[name] = self._zygote.spawn(["worker", "--settings", self.worker_settings(name).model_dump_json()])
        self._restarts.started(name)
        self.out(f"[trident] started worker {name} (pid {self.workers[name].pid})")

    def _spawn_frontend(self) -> subprocess.Popen:
        settings = (self.s.frontend or FrontendSettings(model_path=str(self.model_path))).model_copy(
            update={"model_path": str(self.model_path), "grpc_url": self.grpc_url, "host": self.openai_host,
                    "port": self.s.openai_port}
        )
        cmd = [sys.executable, "-m", "trident.cli", "frontend", "--settings", settings.model_dump_json()]
        # it calls the entry models, as any client: no secret of the deployment's
        env = {k: v for k, v in os.environ.items() if k != auth.ENV}
        env.update(HF_HUB_OFFLINE="1", **{HEAD_PID_ENV: str(os.getpid())})
        quiet(env, self.s.vllm.log_level)  # (it loads the checkpoint's config and tokenizer, as the workers do)
        self.workers["frontend"] = proc = subprocess.Popen(cmd, env=env, **OWN_GROUP)
        self._restarts.started("frontend")
        self.out(f"[trident] started the OpenAI frontend (pid {proc.pid}) on port {self.s.openai_port}")
        return proc

    def _frontend_up(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.openai_host}:{self.s.openai_port}/health", timeout=2):
                return True
        except urllib.error.HTTPError:  # it answers (503: no mode ready yet)
            return True
        except OSError:
            return False

    def _wait_frontend(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 60
        while not self._frontend_up():
            if proc.poll() is not None:
                raise StartupError(f"the OpenAI frontend exited with code {proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise StartupError("the OpenAI frontend did not answer /health within 60 s") from None
            time.sleep(0.2)

    @contextlib.contextmanager
    def _client(self, network_timeout: float = 60.0):
        """A Triton HTTP client, closed after use: a connection left open holds a stopping Triton for its whole
        ``drain_s`` (Triton waits for its HTTP connections to close)."""
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(f"{self.s.host}:{self.s.http_port}", network_timeout=network_timeout)
        try:
            yield client
        finally:
            client.close()

    @property
    def headers(self) -> dict[str, str]:
        return {"triton-access-token": self.token}

    def _wait_ready(self, names: list[str]) -> None:
        with self._client() as client:
            self._wait_ready_on(client, names)

    def _wait_ready_on(self, client, names: list[str]) -> None:
        deadline = time.monotonic() + self.s.startup_timeout_s
        pending = set(names)
        while pending:
            self._check_workers_up(pending)
            self._check_triton_up()
            for name in list(pending):
                try:
                    if client.is_model_ready(name):
                        pending.discard(name)
                        self.out(f"[trident] stage model {name} is ready")
                except Exception:  # server still settling
                    pass
            if pending and time.monotonic() > deadline:
                raise StartupError(f"stage models not ready after {self.s.startup_timeout_s:.0f} s: {sorted(pending)}")
            time.sleep(0.2)

    def _check_workers_up(self, names) -> None:
        """A :class:`StartupError` when one of the local workers ``names`` has exited."""
        for name in names:
            proc = self.workers[name]
            if proc.poll() is not None:
                raise StartupError(f"worker {name} exited with code {proc.returncode} during start-up")

    def _check_triton_up(self) -> None:
        """:class:`TritonExited` when Triton has exited (start-up starts it again: :meth:`start`)."""
        if self.triton is not None and not self.triton.is_alive():
            raise TritonExited("Triton exited during start-up")

    def _wait_joined(self, stages: list[str]) -> None:
        """Wait, for as long as it takes (not READY meanwhile), until each stage with no worker on this host has an
        instance that joined from another host; the workers of this host must stay up meanwhile."""
        join = f"trident worker STAGE --model PATH --join http://<this host>:{self.s.http_port}"
        self.out(f"[trident] waiting for stage hosts to join: {', '.join(stages)} (`{join}` on each)")
        said, missing = time.monotonic(), set(stages)
        while missing:
            self._check_workers_up(self.workers)
            self._check_triton_up()
            with self._client(network_timeout=5) as client:
                for name in [instance_name(stage, n) for stage in sorted(missing) for n in range(1, 5)]:
                    try:
                        ready = client.is_model_ready(name)
                    except Exception:  # noqa: BLE001 - Triton still settling
                        ready = False
                    if ready and parse_instance(name)[0] in missing:
                        missing.discard(parse_instance(name)[0])
                        self.out(f"[trident] stage model {name} joined")
            if missing and time.monotonic() - said > 60:
                said = time.monotonic()
                self.out(f"[trident] still waiting for stage hosts to join: {', '.join(sorted(missing))}")
            if missing:
                time.sleep(0.5)

    def load_entry_model(self, mode: str) -> None:
        # Triton loads one model at a time: a load may wait for the others
        with self._client(network_timeout=self.s.startup_timeout_s) as client:
            client.load_model(mode, headers=self.headers)
        self.out(f"[trident] entry model {mode} loaded")

    def _load_beside(self, mode: str) -> Future:
        """:meth:`load_entry_model` on a thread of its own; its future raises what the load raised."""
        future: Future = Future()

        def run() -> None:
            try:
                self.load_entry_model(mode)
                future.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting start-up
                future.set_exception(e)

        threading.Thread(target=run, name=f"trident-load-{mode}", daemon=True).start()
        return future

    # -- run and stop -------------------------------------------------------------------------------
    def supervise(self) -> int:
        """Block until a signal (returns 0) or until Triton has died too often (returns 1: everything is stopped, and
        a service manager restarts the server); a Triton that dies is started again (:meth:`_triton_back`). A worker that exits has its stage model unloaded, so
        that the schedulers stop sending to it (its modes fall back, or answer 503) while the rest serve, and
        is started again after a backoff (:mod:`.restarts`: 1 s, or 2, 4, 8, ... s after quick exits in a row); after :data:`MAX_QUICK_DEATHS` exits in a row
        each within :data:`QUICK_DEATH_S` of its start it is marked failed and left down. A worker that joined
        from elsewhere and has gone has its stage model unloaded too (:mod:`.joined`)."""
        stop = {"signal": None}
        self._joined = JoinedWatch(lambda: set(self.workers) | set(self._restarts.due_at), self._unbind_gone, self.out)
        self._joined.start()

        def _handler(signum, _frame):
            stop["signal"] = signum

        signal.signal(signal.SIGINT, _handler)
        signal.signal(signal.SIGTERM, _handler)
        while stop["signal"] is None:
            if self.triton is not None and not self.triton.is_alive() and not self._triton_back(stop):
                return 1
            for name, proc in list(self.workers.items()):
                if proc.poll() is not None:
                    self.workers.pop(name)
                    self._worker_exited(name, proc.returncode, proc.pid)
            self._restart_due()
            time.sleep(0.2)
        self.out(f"[trident] received {signal.Signals(stop['signal']).name}; shutting down")
        return 0

    def _triton_back(self, stop: dict) -> bool:
        """Triton exited on its own (a crash, the OOM killer): start it again (:meth:`_start_triton_again`) and serve
        again: the entry models loaded once the stage models are, and the gate opened. The requests that were in
        flight through it end with an error (the HTTP front cuts their answers; gRPC streams break). False when it
        has exited :data:`MAX_QUICK_DEATHS` times in a row, each within :data:`QUICK_DEATH_S` of its start: the head
        gives up (exit 1), and a supervisor above it (Kubernetes, systemd) takes over."""
        t0 = time.monotonic()
        own = self._start_triton_again(stop)
        if own is None:
            self.out(f"[trident] Triton exited {MAX_QUICK_DEATHS} times in a row within {QUICK_DEATH_S:.0f} s of "
                     "starting; stopping everything (exit code 1)")
            return False
        try:
            self._serve_again(own, stop)
        except Exception as e:  # noqa: BLE001 - it died again, or a load failed: the next round of the loop sees it
            self.out(f"[trident] Triton did not come back: {e}")
            return True
        self.out(f"[trident] Triton is back in {time.monotonic() - t0:.1f} s: READY")
        return True

    def _start_triton_again(self, stop: dict) -> list[str] | None:
        """Triton exited: its stubs and shared memory cleared, the start-up gate closed (not READY), and Triton
        started again, with the workers as they are (their engines loaded), loading the gate, the bind model and the
        stage models of this head's workers (side by side; the joined workers, and the head's workers not bound
        yet, bind again themselves). Returns those stage models' names; None when Triton has exited
        :data:`MAX_QUICK_DEATHS` times in a row, each within :data:`QUICK_DEATH_S` of its start (started again
        after a backoff until then)."""
        delay = self._triton_restarts.exited(TRITON)
        if delay is None:
            return None
        self.out("[trident] Triton exited; starting it again (the workers keep their engines; not READY meanwhile)")
        kill_left(stubs_of(self.model_store), grace_s=0)  # (the dead Triton's: orphans now)
        remove_shm_regions(os.getpid())
        for name in ("http.sock", "metrics.sock"):
            (self.workspace / "sockets" / name).unlink(missing_ok=True)
        close_gate(self.model_store)
        deadline = time.monotonic() + min(delay - 1.0, 8.0)  # (none after a long life; backoff after quick deaths)
        while time.monotonic() < deadline and stop["signal"] is None:
            time.sleep(0.1)
        # the stage models of this head's workers load with Triton, side by side (a load through the API waits
        # for the others); the entry models need them
        own = [name for name, proc in self.workers.items() if name != "frontend" and proc.poll() is None
               and (self.model_store / name).is_dir()]
        with self._preloaded():
            pytriton_patch.start_again(self.triton, [GATE, BIND_MODEL, *own])
        self._triton_restarts.started(TRITON)
        return own

    def _serve_again(self, own: list[str], stop: dict) -> None:
        """After :meth:`_start_triton_again` started Triton with the stage models ``own``: the entry models loaded again
        once those are ready, the gate opened."""
        deadline = time.monotonic() + self.s.startup_timeout_s
        pending = set(own)
        with self._client(network_timeout=10) as client:
            while pending or not _live(client):
                if not self.triton.is_alive() or stop["signal"] is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Triton is not live, or stage models {sorted(pending)} not ready")
                pending = {name for name in pending if self.workers[name].poll() is None
                           and not _model_ready(client, name)}  # (a worker that exited: its supervision's)
                time.sleep(0.1)
        modes = self.s.load if self.s.load is not None else self.s.modes
        loading = {mode: self._load_beside(mode) for mode in modes}
        loaded = []
        for mode, done in loading.items():
            try:
                done.result()
                loaded.append(mode)
            except Exception as e:  # noqa: BLE001 - a stage of it is down: the mode stays unloaded, the rest serve
                self.out(f"[trident] entry model {mode} did not load again: {e}")
        if not self.triton.is_alive():
            raise RuntimeError("it exited again")
        with self._client() as client:
            open_gate(client, self.headers, self.model_store, loaded[0] if loaded else None, self.out)

    def _worker_exited(self, name: str, code: int, pid: int) -> None:
        self._coming_back.discard(name)
        remove_direct_socket(self.model_store / name, pid)
        if name == "frontend":  # Triton's own endpoints serve on meanwhile
            self.out(f"[trident] the OpenAI frontend exited with code {code}; Triton keeps serving")
        elif code == NAME_TAKEN_EXIT:  # its stage model is another worker's now: leave it loaded
            self.out(f"[trident] worker {name} did not bind: another worker (one that joined) serves {name} now; "
                     "not restarting it")
            return
        else:
            self.out(f"[trident] worker {name} exited with code {code}; unloading its stage model")
            try:
                self._unload(name)
            except Exception as e:  # Triton may be going away too
                self.out(f"[trident] could not unload {name}: {e}")
        what = "the OpenAI frontend" if name == "frontend" else f"worker {name}"
        delay = self._restarts.exited(name)
        if delay == PAUSE_S:
            self.out(f"[trident] {what} exited {MAX_QUICK_DEATHS} times in a row within {QUICK_DEATH_S:.0f} s of "
                     f"starting; restarting it after a pause of {delay:.0f} s (its modes answer 503 or fall back)")
            return
        self.out(f"[trident] restarting {what} in {delay:.0f} s")

    def _unload(self, name: str) -> None:
        with self._client(network_timeout=10) as client:
            client.unload_model(name, headers=self.headers)

    def _unbind_gone(self, name: str, worker: dict) -> bool:
        """Unload joined instance ``name`` through the bind model, as its worker's leave would: True when done, False
        when the name is no longer bound to ``worker`` (another worker bound it since)."""
        from tritonclient.utils import InferenceServerException

        from trident.core.errors import NameTaken, from_message
        from trident.core.protocol import Bind
        from trident.worker.bind import ask

        request = Bind(stage=parse_instance(name)[0], tcp=tuple(worker["tcp"]), name=name, leave=True)
        try:
            ask(self.http_url, request, 10.0)
        except InferenceServerException as e:
            if isinstance(from_message(str(e)), NameTaken):
                return False
            raise
        return True

    def _restart_due(self) -> None:
        """Start the workers whose backoff is over; say when a restarted one serves again."""
        for name in self._restarts.due():
            if name == "frontend":
                self._spawn_frontend()
            else:
                self._start_worker(name)
            self._coming_back.add(name)
        for name in list(self._coming_back):
            if name == "frontend":
                if self._frontend_up():
                    self._coming_back.discard(name)
                    self.out(f"[trident] the OpenAI frontend is back on port {self.s.openai_port}")
                continue
            try:
                with self._client() as client:
                    ready = client.is_model_ready(name)
            except Exception:
                ready = False
            if ready:
                self._coming_back.discard(name)
                self.out(f"[trident] worker {name} is back: stage model {name} is ready")

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._joined is not None:
            self._joined.stop()
        if self._serving and self.triton is not None and self.triton.is_alive():
            self._drain()
        # Triton first: it takes no new request and lets those in flight finish on the workers, which are still up
        # (then the workers have no model to unbind)
        if self.triton is not None:
            stubs = sorted({*(pid for pid in descendants(os.getpid()) if is_stub(pid)), *stubs_of(self.model_store)})
            pytriton_patch.stop(self.triton)
            self._reap(stubs)
            if regions := remove_shm_regions(os.getpid()):
                self.out(f"[trident] removed {regions} shared-memory region(s) the python backend left in /dev/shm")
        if self._front is not None:  # (after Triton: the streams it let finish came through it)
            self._front.stop()
        stop_all(self.workers, lambda line: self.out(f"[trident] {line}"))
        for stage, proc in self.workers.items():
            remove_direct_socket(self.model_store / stage, proc.pid)
        if self._zygote is not None:
            self._zygote.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.out("[trident] stopped")


    def _drain(self) -> None:
        """A stop's first part, while everything still runs: readiness withdrawn (the start-up gate, failed again),
        every entry model refusing new requests at once with 503 (:mod:`trident.core.drain`) and serving those in flight
        to their end, waited for at most ``drain_s``."""
        t0 = time.monotonic()
        drain.start()
        modes: list[str] = []
        try:
            with self._client(network_timeout=5) as client:
                modes = [m["name"] for m in client.get_model_repository_index(headers=self.headers)
                         if m["name"] in MODES and m.get("state") == "READY"]
                close_gate(self.model_store)
                with contextlib.suppress(Exception):  # (it fails, by design: Triton is not READY from now on)
                    client.load_model(GATE, headers=self.headers)
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

    def _reap(self, stubs: list[int], grace_s: float = 3.0) -> None:
        """Python-backend stubs that outlive Triton (seen for entry models after dropped streams or a killed
        worker: they hang on their way out) are killed, so that a stopped server leaves no process behind."""
        # (only stubs of this server's models: an exited stub's pid may be another server's stub by now)
        if killed := kill_left(stubs, grace_s, running=lambda pid: is_stub_of(pid, self.model_store)):
            self.out(f"[trident] {killed} python-backend stub(s) outlived Triton; killed them")


class TritonExited(RuntimeError):
    """Triton exited while the launcher waited on it."""


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


