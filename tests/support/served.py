"""`trident serve` in a subprocess on free localhost ports, for the end-to-end tests and the soak, and what
they read of its workers (stats, pids, what each still holds)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from trident.supervisor import descendants
from trident.core.netutil import free_ports

__all__ = ["Server", "descendants", "held"]  # descendants: for the tests and the soak
FAULTS = Path(__file__).with_name("faults")  # the fault wrapper's sitecustomize


DRAIN_S = 5
KV_CACHE_GIB = 0.25


class Server:
    """`trident serve` on free localhost ports; stopped with SIGTERM like a user's Ctrl-C.

    ``config`` holds settings of its config file (``--config``: keys of docs/configuration.md, nested as dicts),
    ``extra`` more command-line arguments; ``faults``: its workers inject the faults a prompt's markers name
    (`tests/support/faults`); ``ports``: its HTTP, gRPC, metrics and OpenAI ports (default: free ones); ``openai``:
    False starts no OpenAI frontend (``openai_port: 0``), for the modules whose tests do not call it. The config
    file and the access-token file are written beside the workspace, in ``<workspace>.serve/``."""

    def __init__(
        self, model: str, workspace: Path, modes: list[str] | None = None, load: list[str] | None = None,
        extra: list[str] | None = None, config: dict | None = None, faults: bool = False,
        ports: tuple[int, int, int, int] | None = None, openai: bool = True,
    ) -> None:
        self.http_port, self.grpc_port, self.metrics_port, self.openai_port = ports or free_ports(4)
        if not openai:  # (no OpenAI frontend: 2.5 CPU s of a start saved where a module's tests do not use it)
            self.openai_port = 0
        self.model_path = model
        self.openai_host = (config or {}).get("openai_host", "127.0.0.1")
        self.workspace = workspace = Path(workspace)
        self.token = "test-token-123"
        self._bls_configs: dict[str, str] = {}  # an entry model's BLS config while an ensemble stands in for it
        files = workspace.with_name(workspace.name + ".serve")
        files.mkdir(parents=True, exist_ok=True)
        token_file = files / "access-token"
        token_file.touch(mode=0o600)
        token_file.chmod(0o600)  # trident refuses a secret file others may read
        token_file.write_text(self.token)
        # a test server drains for 5 s at most unless told otherwise (a stream a test left running ends by then), and
        # a vllm engine's KV cache is a quarter of the default GiB (10,900 tokens of the largest demo's: each engine
        # zeroes its cache at start-up, 0.8 CPU s a GiB here, and a server in every mode has five)
        config = {"drain_s": DRAIN_S, **(config or {}), **({"load": load} if load is not None else {})}
        config["vllm"] = {"kv_cache_gib": KV_CACHE_GIB, **config.get("vllm", {})}
        cmd = [
            sys.executable, "-m", "trident.cli", "serve", "--model", model,
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port), "--openai-port", str(self.openai_port),
            "--workspace", str(workspace), "--access-token-file", str(token_file), "--mode", *(modes or ["all"]),
        ]
        (files / "serve.json").write_text(json.dumps(config, indent=1))
        cmd += ["--config", str(files / "serve.json")]
        cmd += extra or []
        self.log: list[str] = []
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if faults:  # its processes, the workers among them, load the fault wrapper at start-up (sitecustomize)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULTS), env.get("PYTHONPATH")) if p)
        # (a process group of its own, as a terminal's: interrupt() sends it Ctrl-C)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Keep the server's output (Triton's own among it: what it wrote before it died) in :attr:`log` and in
        ``<workspace>.serve/server.log``, where it stays after the test for a failure to be looked into."""
        with open(self.workspace.with_name(self.workspace.name + ".serve") / "server.log", "a") as kept:
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                kept.write(line)
                kept.flush()
                if line.startswith("[trident] ready"):
                    self._ready.set()

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError("server did not start:\n" + "\n".join(self.log[-40:]))
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in time:\n" + "\n".join(self.log[-40:]) + self._stuck())

    def started(self, timeout: float = 240) -> "Server":
        """This server once it is ready (:meth:`wait_ready`); one that does not get ready is stopped, then the error
        raised."""
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _stuck(self) -> str:
        """What a server that did not get ready is doing: its own output's and its Triton log's last lines, and each
        python-backend stub's state and stacks (gdb, when there), also kept in ``<workspace>.serve/stuck.txt``."""
        lines = ["--- trident serve (end)", *self.log[-60:]]
        living, seen = set(descendants(self.proc.pid)), len(self.log)
        for pid in (pid for pid in self.worker_pids() if pid in living):  # each prints its threads' stacks (faulthandler)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)
        lines += ["--- the workers' Python stacks (SIGUSR1)", *self.log[seen:]]
        triton_log = self.workspace / "triton.log"
        if triton_log.exists():
            lines += ["--- triton.log (end)", *triton_log.read_text(errors="replace").splitlines()[-30:]]
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = Path(f"/proc/{pid}/wchan").read_text()
            except OSError:
                continue
            if "triton_python_backend_stub" not in argv:
                continue
            lines.append(f"--- stub {pid} ({state}, in {wchan}): {argv[:300]}")
            if shutil.which("gdb"):
                try:
                    bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 20"],
                                        capture_output=True, text=True, timeout=60).stdout
                except subprocess.TimeoutExpired:
                    bt = "(gdb did not answer in 60 s)"
                lines += [line for line in bt.splitlines() if line.startswith(("#", "Thread"))]
        report = "\n".join(lines)
        (self.workspace.with_name(self.workspace.name + ".serve") / "stuck.txt").write_text(report)
        return "\n" + report

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def openai_url(self) -> str:
        return f"http://{self.openai_host}:{self.openai_port}/v1"

    def worker_pids(self) -> list[int]:
        return [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in self.log if "started worker" in line]

    def worker_pid(self, name: str) -> int:
        """The pid of the (latest) worker bound as stage model ``name`` (e.g. ``prefill-2``)."""
        for line in reversed(self.log):
            if line.startswith(f"[trident] started worker {name} (pid "):
                return int(line.rsplit("pid ", 1)[1].rstrip(")"))
        raise KeyError(name)

    def socket_folders(self) -> dict[str, str]:
        """Each bound stage model's worker's own folder (its worker file's ``direct`` socket's), by stage model."""
        from trident.core.protocol import WORKER_FILE

        return {file.parent.parent.name: os.path.dirname(json.loads(file.read_text())["direct"])
                for file in self.workspace.rglob(WORKER_FILE)}

    def ready(self, model: str) -> bool:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.http)
        try:
            return client.is_model_ready(model)
        finally:
            client.close()  # (an open connection holds a stopping Triton: see drain_s)

    def swap_scheduler(self, mode: str, kind: str) -> None:
        """Reload entry model ``mode`` as a BLS scheduler or an ensemble while serving (a config override
        through Triton's repository API, as an operator would)."""
        import tritonclient.http as httpclient
        from google.protobuf import json_format

        from trident.core.repository import bls_config, ensemble_config

        admin = httpclient.InferenceServerClient(self.http)
        try:
            if kind == "ensemble":  # the BLS's own config (its scheduler settings) comes back with it
                self._bls_configs.setdefault(mode, json.dumps(admin.get_model_config(mode)))
                config = json_format.MessageToJson(ensemble_config(mode))
            else:
                config = self._bls_configs.pop(mode, None) or json_format.MessageToJson(bls_config(mode))
            admin.load_model(mode, config=config, headers={"triton-access-token": self.token})
            assert admin.is_model_ready(mode)
        finally:
            admin.close()

    def metrics(self, prefix: str = "trident") -> dict[tuple, float]:
        """Triton's metrics port: ``{(name, (("label", "value"), ...)): value}`` of the families named ``prefix...``
        (Trident's own; ``"vllm:"``: those in the vLLM backend's names)."""
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) if family.name.startswith(prefix)
            for sample in family.samples
        }

    def stats(self, settled: bool = False) -> dict[str, dict]:
        """Each worker's counters, from the file it rewrites every 0.2 s. ``settled`` waits (up to 5 s) until
        two reads 0.3 s apart agree, so that a snapshot taken right after a request includes it."""
        read = lambda: {p.stem: json.loads(p.read_text()) for p in (self.workspace / "stats").glob("*.json")}
        now = read()
        deadline = time.monotonic() + 5
        while settled and time.monotonic() < deadline:
            time.sleep(0.3)
            now, last = read(), now
            if now == last:
                break
        return now

    def interrupt(self) -> int:
        """Stop the server as Ctrl-C in its terminal does (SIGINT to its whole process group); its exit code."""
        return self._end(lambda: os.killpg(self.proc.pid, signal.SIGINT))

    def stop(self) -> int:
        """Stop the server as a service manager does (SIGTERM to it); its exit code."""
        return self._end(lambda: self.proc.send_signal(signal.SIGTERM))

    def _end(self, signal_it) -> int:
        """``signal_it()`` unless it has exited, wait up to 60 s (then kill it), read its last lines."""
        if self.proc.poll() is None:
            signal_it()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)  # the log's last lines
        return self.proc.returncode


def held(stats: dict[str, dict]) -> dict[str, dict]:
    """The workers that still hold something for a request: a lease, a pool region outside the embedding
    cache, a vLLM KV block, a running request, or a handed record or a call waiting for one
    (``{worker: its stats}``)."""
    return {
        k: v for k, v in stats.items()
        if v.get("leases") or v.get("send_regions_in_use", 0) > v.get("cache_entries", 0)
        or v.get("recv_regions_in_use") or v.get("kv_cache_usage") or v.get("vllm_running")
        or v.get("vllm_waiting") or v.get("decode_active") or v.get("handoff_early_records")
        or v.get("handoff_waiting_calls")
    }
