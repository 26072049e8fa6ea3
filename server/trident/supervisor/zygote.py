"""The workers' zygote: one process of the workers' Python that imports what a stage worker needs (torch,
transformers' model class for the checkpoint, NIXL, PyTriton, vLLM) once, and then forks each worker the launcher
asks for, first start and restarts alike. A forked worker runs ``trident worker`` as one started on its own does
(a worker joining from another host is), without its seconds of imports: six workers importing at once on a
small machine was most of a server's start-up.

The launcher talks to it over a socket pair, a JSON line each way: ``{"argv": [...]}`` is answered
``{"pid": N}``, and each worker's end is told as ``{"exit": N, "code": C}`` (C as ``subprocess``'s
``returncode``: minus the signal that killed it). The zygote ends when the launcher closes its end.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from trident.supervisor.processes import OWN_GROUP, end_process, end_with_head

SPAWN_TIMEOUT_S = 300.0  # a first spawn waits for the imports (vLLM's take tens of seconds on a small machine)


class Forked:
    """A worker the zygote forked: the part of :class:`subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's end: starts the zygote (in a process group of its own, as the workers are) and forks workers."""

    def __init__(self, python: str, env: dict[str, str], backend: str, model: str) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [python, "-c", "import sys; from trident.supervisor.zygote import main; sys.exit(main(sys.argv[1:]))",
             str(theirs.fileno()), backend, model],
            pass_fds=(theirs.fileno(),), env=env, **OWN_GROUP,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one spawn at a time: answers come in the order asked
        self._answer = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def spawn(self, argv: list[str]) -> Forked:
        """Fork a process running ``trident <argv>``."""
        with self._lock:
            self._sock.sendall(json.dumps({"argv": argv}).encode() + b"\n")
            with self._answer:
                if not self._answer.wait_for(lambda: self._pids or self._gone, timeout=SPAWN_TIMEOUT_S):
                    raise RuntimeError(f"the workers' zygote did not fork within {SPAWN_TIMEOUT_S:.0f} s")
                if not self._pids:
                    raise RuntimeError(f"the workers' zygote exited (code {self.proc.poll()})")
                return Forked(self._pids.pop(0), self)

    def exit_code(self, pid: int) -> int | None:
        with self._answer:
            if pid in self._exits:
                return self._exits.pop(pid)
            gone = self._gone
        if not gone:
            return None
        # the zygote is gone, and with it the exit codes of its children (init reaps them now)
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return -signal.SIGKILL

    def close(self) -> None:
        """The zygote ends when its socket closes (the workers it forked are stopped by the launcher)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                with self._answer:
                    self._gone = True
                    self._answer.notify_all()
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            with self._answer:
                for line in lines:
                    message = json.loads(line)
                    if "pid" in message:
                        self._pids.append(message["pid"])
                    else:
                        self._exits[message["exit"]] = message["code"]
                self._answer.notify_all()


# -- the zygote's side ------------------------------------------------------------------------------------
def preload(backend: str, model: str) -> None:
    """Import what a worker of ``backend`` on checkpoint ``model`` imports; nothing starts (no thread pool, no
    NIXL agent, no engine, no tokenizer: loading one starts the tokenizers library's threads, which a fork
    would leave behind). A module that fails to import here fails in the worker, which says so."""
    import torch  # noqa: F401
    import transformers

    from trident.core.families import family_of
    import tritonclient.http  # noqa: F401  (the bind model's client)

    from trident.worker import bind, infer  # noqa: F401
    from trident.core import stagecall  # noqa: F401
    from trident.worker.engines import hf  # noqa: F401
    from trident.core.transfer import data_plane  # noqa: F401  (NIXL)

    config = transformers.AutoConfig.from_pretrained(model)
    # transformers imports a class's modules when it is named: the model's, and its processors' and tokenizer's
    names = {family_of(config, model).model_class} - {""}
    for file in Path(model).glob("*config.json"):
        try:
            named = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        names |= {named.get(key) for key in _CLASS_KEYS if isinstance(named, dict)} - {None}
    for name in names:
        getattr(transformers, str(name), None)
    if backend == "vllm":
        _preload_vllm(config)


def _preload_vllm(config) -> None:
    """What a vLLM stage worker and the engine-core process it forks import: the engine's client and core, the
    platform's worker and executor, the model loader and the checkpoint's model class (about 800 modules, which each
    of a server's six engine cores imported again)."""
    import importlib

    from trident.worker.engines import vllm  # noqa: F401
    from vllm.platforms import current_platform
    from vllm.v1.engine import async_llm, core  # noqa: F401
    from vllm.v1.executor import uniproc_executor  # noqa: F401
    from vllm.engine import arg_utils  # noqa: F401
    from vllm.model_executor import model_loader  # noqa: F401
    from vllm.model_executor.models import registry

    importlib.import_module("vllm.v1.worker." + ("cpu_worker" if current_platform.is_cpu() else "gpu_worker"))
    for arch in getattr(config, "architectures", None) or ():
        # (None for an architecture vLLM does not know: the worker says so)
        if registry.ModelRegistry._try_load_model_cls(arch) is not None:
            _inspect_here(registry, arch)


def _inspect_here(registry, arch: str) -> None:
    """vLLM inspects a model class in a subprocess that imports vLLM again (about 8 CPU s) unless the class is in its
    ``modelinfos`` cache (under ``VLLM_CACHE_ROOT``), as it is not at a machine's first start of that model: each of a
    server's engines did so, at once. The zygote has the class imported: vLLM's own inspection runs here, once, and
    writes that cache; the workers it forks have the answer in memory."""
    in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        registry.ModelRegistry._try_inspect_model_cls(arch)
    finally:
        registry._run_in_subprocess = in_subprocess


_CLASS_KEYS = ("processor_class", "image_processor_type", "video_processor_type", "feature_extractor_type",
               "tokenizer_class")


def _become_worker(sock: socket.socket, argv: list[str]) -> None:
    """In the forked child: a process group of its own in the launcher's session (:data:`.processes.OWN_GROUP`),
    ended with the head (:func:`.processes.end_with_head`), the default signal handlers, ``trident <argv>``; never
    returns."""
    code = 1
    try:
        sock.close()
        os.setpgid(0, 0)
        end_with_head()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        import setproctitle

        setproctitle.setproctitle(" ".join(["trident", *argv[:1], *_worker_name(argv)]))
        sys.argv = ["trident", *argv]
        from trident.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        end_process(code)  # (its exit handlers run, its output is flushed; never the zygote's teardown)


def _worker_name(argv: list[str]) -> list[str]:
    """The instance name in a worker's ``--settings`` (what ``ps`` shows: ``trident worker prefill-2``)."""
    if "--settings" in argv:
        try:
            settings = json.loads(argv[argv.index("--settings") + 1])
            return [settings.get("name") or settings["stage"]]
        except (IndexError, ValueError, KeyError, TypeError):
            pass
    return []


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> int:
    fd, backend, model = int(argv[0]), argv[1], argv[2]
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends it (a process group of its own: no terminal's)
    import setproctitle

    setproctitle.setproctitle(f"trident zygote ({backend} workers)")
    try:
        preload(backend, model)
    except Exception as e:  # each worker meets the same error and reports it
        print(f"[trident] workers' zygote: could not preload for {Path(model).name}: {e}", file=sys.stderr)
    # Python warns that a fork with threads may deadlock: the one other thread here is torch's, idle (it holds
    # no lock a worker takes), as in every DataLoader worker forked after `import torch`
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks", category=DeprecationWarning)
    # what the preload made lives as long as each worker: out of the collector's sight, a worker's collections
    # (vLLM's engine core runs several while it starts) no longer walk it, nor write to (and so copy) its pages
    gc.collect()
    gc.freeze()
    buf = b""
    while True:
        _reap(sock)
        ready, _, _ = select.select([sock], [], [], 0.1)
        if not ready:
            continue
        data = sock.recv(65536)
        if not data:  # the launcher closed its end (or died): no teardown of the modules it preloaded
            end_process(0)
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            pid = os.fork()
            if pid == 0:
                _become_worker(sock, json.loads(line)["argv"])
            _send(sock, {"pid": pid})

