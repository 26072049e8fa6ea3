"""Triton's process, as the head runs it: its workspace and model store, its start (the shim preloaded, the bounded
HTTP front and the gRPC front before its Unix sockets), its start again after it died (the workers keep their
engines), its stop, and a client to it.

PyTriton starts and stops it (:mod:`.pytriton_patch` adjusts how); the shim (:mod:`.triton_shim`) keeps its token out
of its argv and puts its HTTP, metrics and gRPC servers on Unix sockets of the workspace, which the fronts
(:mod:`.http_front`, :mod:`.grpc_front`) relay its public ports to.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

from trident.core import auth, tracing
from trident.core.config import ServeSettings
from trident.core.protocol import BIND_MODEL, MODES
from trident.core.stagecall import directory
from trident.supervisor import pytriton_patch, triton_shim
from trident.supervisor.gate import GATE, close_gate
from trident.supervisor.entry_credential import CredentialForEntries
from trident.supervisor.grpc_front import GrpcFront
from trident.supervisor.http_front import HttpFront, Route, max_body_bytes
from trident.supervisor.processes import descendants, is_stub, is_stub_of, kill_left, remove_shm_regions, stubs_of
from trident.supervisor.restarts import Restarts
from trident.supervisor.startup import StartupError

TRITON = "tritonserver"  # its name in its Restarts
HUNG_S = 20.0  # Triton's process alive, its HTTP server silent this long after it had answered: killed (then restarted)
PROBE_S = 2.0  # how often :meth:`TritonProcess.kill_if_hung` asks it, at most, and how long each ask waits


class TritonExited(RuntimeError):
    """Triton exited while the head waited on it (start-up starts it again)."""


class TritonProcess:
    """The head's Triton: started once (:meth:`start`), again after each death (:meth:`start_again`) until it dies
    too often, stopped last-but-one (:meth:`stop`: after the drain, before the workers)."""

    def __init__(self, settings: ServeSettings, workspace: Path, token: str, out: Callable[[str], None]) -> None:
        from pytriton.utils.workspace import Workspace

        self.s, self.workspace, self.token, self.out = settings, workspace, token, out
        self._workspace = Workspace(workspace / "triton")
        directory.create(workspace / "stages")  # Triton's stubs enter their workers here, for the schedulers
        self.triton = None
        self._front: HttpFront | None = None
        self._grpc_front: GrpcFront | None = None
        self._shim: Path | None = None
        self.restarts = Restarts(give_up=True)  # its deaths in a row
        self._heard()

    @property
    def model_store(self) -> Path:
        """Triton's model repository (PyTriton's, in the workspace)."""
        return self._workspace.model_store_path

    @property
    def headers(self) -> dict[str, str]:
        return {"triton-access-token": self.token}

    @property
    def http_url(self) -> str:
        return f"http://{self.s.host}:{self.s.http_port}"

    def is_alive(self) -> bool:
        return self.triton is not None and self.triton.is_alive()

    def check_alive(self) -> None:
        """:class:`TritonExited` when Triton has exited (or hung: :meth:`kill_if_hung`)."""
        self.kill_if_hung()
        if self.triton is not None and not self.triton.is_alive():
            raise TritonExited("Triton exited during start-up")

    def exited(self, within_s: float) -> bool:
        """Whether Triton has exited, or does within ``within_s`` (a request it broke by crashing fails before the
        process ends: the crash report is written first); past ``within_s``, while it does not answer, until
        :meth:`kill_if_hung` has decided."""
        deadline = time.monotonic() + within_s
        while self.is_alive():
            if self.kill_if_hung():
                break
            if time.monotonic() > deadline and (self._silent_since is None
                                                or time.monotonic() > deadline + HUNG_S + PROBE_S):
                return False
            time.sleep(0.1)
        return self.triton is not None

    def kill_if_hung(self) -> bool:
        """Kill a Triton whose process lives but whose HTTP server has not answered for :data:`HUNG_S` since it
        last did (Triton 2.51 was seen to stall in its own crash report, after the python backend aborted it, until
        it was signalled: 300 s of a server that neither answered nor exited), so that it is started again as an
        exited one. Asks at most every :data:`PROBE_S`; True when it killed it."""
        now = time.monotonic()
        if not self.is_alive() or now < self._next_probe:
            return False
        self._next_probe = now + PROBE_S
        if self._answers():
            self._silent_since, self._answered = None, True
            return False
        if not self._answered:  # (still starting: PyTriton waits for it)
            return False
        self._silent_since = self._silent_since or now
        if now - self._silent_since < HUNG_S:
            return False
        pid = pytriton_patch.triton_pid(self.triton)
        self.out(f"[trident] Triton (pid {pid}) has not answered for {HUNG_S:.0f} s; killing it to start it again")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return True

    def _answers(self) -> bool:
        try:
            with self.client(network_timeout=PROBE_S) as client:
                return bool(client.is_server_live())
        except Exception:  # noqa: BLE001 - not answering, whatever the way
            return False

    def _heard(self) -> None:
        """A Triton just started: not heard from yet, nothing counted against it."""
        self._answered, self._silent_since, self._next_probe = False, None, 0.0

    @contextlib.contextmanager
    def client(self, network_timeout: float = 60.0):
        """A Triton HTTP client, closed after use: a connection left open holds a stopping Triton for its whole
        ``drain_s`` (Triton waits for its HTTP connections to close)."""
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(f"{self.s.host}:{self.s.http_port}", network_timeout=network_timeout)
        try:
            yield client
        finally:
            client.close()

    def load(self, name: str, network_timeout: float = 60.0) -> None:
        with self.client(network_timeout=network_timeout) as client:
            client.load_model(name, headers=self.headers)

    def unload(self, name: str) -> None:
        with self.client(network_timeout=10) as client:
            client.unload_model(name, headers=self.headers)

    def is_ready(self, name: str) -> bool:
        try:
            with self.client() as client:
                return client.is_model_ready(name)
        except Exception:  # noqa: BLE001 - Triton still starting, or going away
            return False

    # -- start -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        from pytriton.triton import TRITON_ACCESS_HEADER, Triton, TritonConfig, TritonSecurityConfig

        self.out(
            f"[trident] starting Triton on HTTP {self.s.http_port}, gRPC {self.s.grpc_port}, metrics "
            f"{self.s.metrics_port} (server log: {self.workspace / 'triton.log'})"
        )
        pytriton_patch.bind_when_live()  # the start-up gate keeps the server from READY: PyTriton waits for it live
        pytriton_patch.quiet_triton_output()
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
            workspace=self._workspace,
            # PyTriton's own calls carry the token; the restriction is the config's above, not PyTriton's (with argv)
            security_config=TritonSecurityConfig(access_token=self.token, restricted_endpoints=[]),
        )
        # Triton's HTTP and metrics servers on Unix sockets of the workspace, the bounded front on their public
        # ports; with the ensemble scheduler its gRPC server too, behind the gRPC front: the fronts give the entry
        # models' requests the stage credential, which an ensemble forwards to its steps
        sockets = self._socket_folder()
        limit = max_body_bytes(self.s.media_limits)
        entries = CredentialForEntries(frozenset(MODES), auth.credential(), auth.CREDENTIAL) if self._ensembles else None
        self._front = HttpFront([Route("HTTP", self.s.host, self.s.http_port, sockets["http"]),
                                 Route("metrics", self.s.host, self.s.metrics_port, sockets["metrics"])],
                                limit, entries)
        self._front.start()
        if entries is not None:
            self._grpc_front = GrpcFront(self.s.host, self.s.grpc_port, f"unix:{self._grpc_socket_file()}", limit,
                                         entries)
            self._grpc_front.start()
        self._shim = triton_shim.build(self.workspace)
        triton_shim.remove_left_folders(self._temp_record)  # (a Triton of this workspace that died with its head)
        with self._preloaded():
            self.triton.run()
        pytriton_patch.keep_workspace(self.triton)  # (its exit is the head's to handle: start_again)
        self.restarts.started(TRITON)
        self._heard()

    def start_again(self, own: Callable[[], list[str]], stopping: Callable[[], bool]) -> list[str] | None:
        """Triton exited: its stubs and shared memory cleared, the start-up gate closed (not READY), and Triton
        started again after its backoff, loading the gate, the bind model and the stage models ``own()`` names (this
        head's live workers', side by side; the joined workers, and the head's workers not bound yet, bind again
        themselves). Returns those names; None when Triton has died too often in a row (:class:`.Restarts`)."""
        delay = self.restarts.exited(TRITON)
        if delay is None:
            return None
        self.out("[trident] Triton exited; starting it again (the workers keep their engines; not READY meanwhile)")
        kill_left(stubs_of(self.model_store), grace_s=0)  # (the dead Triton's: orphans now)
        remove_shm_regions(os.getpid())
        triton_shim.remove_left_folders(self._temp_record)
        for path in self._socket_files():
            path.unlink(missing_ok=True)
        close_gate(self.model_store)
        deadline = time.monotonic() + min(delay - 1.0, 8.0)  # (none after a long life; backoff after quick deaths)
        while time.monotonic() < deadline and not stopping():
            time.sleep(0.1)
        load = [name for name in own() if (self.model_store / name).is_dir()]
        with self._preloaded():
            pytriton_patch.start_again(self.triton, [GATE, BIND_MODEL, *load])
        self.restarts.started(TRITON)
        self._heard()
        return load

    def _preloaded(self):
        """What Triton starts with: the shim, the token, the front's sockets."""
        return triton_shim.preloaded(self._shim, self.token, self.s.allow_code_upload, self._sockets(), self._temp_record)

    @property
    def _temp_record(self) -> Path:
        """The file the shim lists Triton's temporary folders in (:func:`.triton_shim.remove_left_folders`)."""
        return self.workspace / "triton-temp-folders"

    @property
    def _ensembles(self) -> bool:
        """Whether the entry models are Triton ensembles (``scheduler: ensemble``): then the gRPC front too."""
        return self.s.scheduler == "ensemble"

    def _sockets(self) -> dict[str, Path]:
        """Triton's servers on Unix sockets (what the shim puts in place of their addresses): HTTP's, metrics', and
        with the gRPC front gRPC's."""
        folder = self.workspace / "sockets"
        paths = {"http": folder / "http.sock", "metrics": folder / "metrics.sock"}
        if self._ensembles:
            paths["grpc"] = folder / "grpc"
        return paths

    def _grpc_socket_file(self) -> Path:
        """The file of Triton's gRPC socket: gRPC appends :<port> to the path it is given."""
        return self._sockets()["grpc"].with_name(f"grpc:{self.s.grpc_port}")

    def _socket_files(self) -> list[Path]:
        return [path if what != "grpc" else self._grpc_socket_file() for what, path in self._sockets().items()]

    def _socket_folder(self) -> dict[str, Path]:
        """The folder of Triton's Unix sockets, its user's alone whatever the workspace's mode: :meth:`_sockets`."""
        folder = self.workspace / "sockets"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        longest = max(self._socket_files(), key=lambda path: len(os.fsencode(path)))
        if len(os.fsencode(longest)) >= 108:
            raise StartupError(f"the workspace's path is too long for a Unix socket ({longest}): choose a shorter "
                               "workspace")
        for path in self._socket_files():  # (a server stopped by SIGKILL leaves its sockets)
            path.unlink(missing_ok=True)
        return self._sockets()

    # -- stop --------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Triton stopped (it takes no new request and lets those in flight finish), the stubs that outlive it
        killed, its shared memory removed, then the front (the streams Triton let finish came through it)."""
        if self.triton is not None:
            stubs = sorted({*(pid for pid in descendants(os.getpid()) if is_stub(pid)), *stubs_of(self.model_store)})
            pytriton_patch.stop(self.triton)
            self._reap(stubs)
            triton_shim.remove_left_folders(self._temp_record)
            if regions := remove_shm_regions(os.getpid()):
                self.out(f"[trident] removed {regions} shared-memory region(s) the python backend left in /dev/shm")
        if self._front is not None:
            self._front.stop()
        if self._grpc_front is not None:
            self._grpc_front.stop()

    def _reap(self, stubs: list[int], grace_s: float = 3.0) -> None:
        """Python-backend stubs that outlive Triton (seen for entry models after dropped streams or a killed
        worker: they hang on their way out) are killed, so that a stopped server leaves no process behind."""
        # (only stubs of this server's models: an exited stub's pid may be another server's stub by now)
        if killed := kill_left(stubs, grace_s, running=lambda pid: is_stub_of(pid, self.model_store)):
            self.out(f"[trident] {killed} python-backend stub(s) outlived Triton; killed them")
