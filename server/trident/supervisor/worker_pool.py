"""The head's own processes beside Triton: its stage workers (forked from the zygote) and the OpenAI frontend;
each started, watched by its exit, and started again after a backoff (:mod:`.restarts`).

A worker that exits has its stage model unloaded (the schedulers stop sending to it: its modes fall back, or answer
503, while the rest serve) and is started again; one that exits because another worker (one that joined) bound its
name is left down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from trident.core import auth
from trident.core.config import MiB, FrontendSettings, ServeSettings, VLLMConfig, WorkerSettings
from trident.core.netutil import listen_ports
from trident.core.protocol import NAME_TAKEN_EXIT, STAGES, parse_instance
from trident.core.config import HEAD_PID_ENV
from trident.supervisor.processes import OWN_GROUP, remove_direct_socket, stop_all
from trident.supervisor.quiet import quiet
from trident.supervisor.restarts import MAX_QUICK_DEATHS, PAUSE_S, QUICK_DEATH_S, Restarts
from trident.supervisor.startup import StartupError
from trident.supervisor.zygote import Forked, Zygote

FRONTEND = "frontend"  # the OpenAI frontend's name among the processes


def own_side_channel(vllm: VLLMConfig, backend: str, stage: str) -> VLLMConfig:
    """A vLLM KV worker's settings with a NIXL side-channel port of its own (unless one is set), out of the range
    vLLM's own free ports come from: two such workers on one host never collide."""
    spec = STAGES[stage]
    if backend == "vllm" and "kv" in (spec.takes, spec.hands_on) and vllm.nixl_port is None:
        return vllm.model_copy(update={"nixl_port": listen_ports(1)[0]})
    return vllm


class WorkerPool:
    """The head's workers and frontend by name (a stage model's, and :data:`FRONTEND`); ``gpus``: each worker's
    ``CUDA_VISIBLE_DEVICES`` (none on a CPU host); ``unload(name)``: unloads a stage model from Triton."""

    def __init__(self, settings: ServeSettings, model_path: str, http_url: str, grpc_url: str, stats_dir: Path,
                 model_store: Path, unload: Callable[[str], None], out: Callable[[str], None]) -> None:
        self.s, self.model_path, self.http_url, self.grpc_url = settings, model_path, http_url, grpc_url
        self.stats_dir, self.model_store, self._unload, self.out = stats_dir, model_store, unload, out
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.gpus: dict[str, str] = {}
        self._zygote: Zygote | None = None
        self._restarts = Restarts()
        self._coming_back: set[str] = set()  # restarted ones not serving yet

    @property
    def openai_host(self) -> str:
        return self.s.openai_host or self.s.host

    def names(self) -> set[str]:
        """Every name this head runs, or will start again."""
        return set(self.procs) | set(self._restarts.due_at)

    def live_stage_models(self) -> list[str]:
        """The stage models of this head's workers that run."""
        return [name for name, proc in self.procs.items() if name != FRONTEND and proc.poll() is None]

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def check_up(self, names) -> None:
        """A :class:`StartupError` when one of ``names`` has exited."""
        for name in names:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise StartupError(f"worker {name} exited with code {proc.returncode} during start-up")

    # -- start -------------------------------------------------------------------------------------------------
    def settings_of(self, name: str) -> WorkerSettings:
        """What the worker bound as model ``name`` (``<stage>`` or ``<stage>-<n>``) gets, whole, as JSON."""
        stage, _ = parse_instance(name)
        vllm = own_side_channel(self.s.vllm, self.s.backend, stage)
        return WorkerSettings(
            stage=stage, name=name, model=self.model_path, url=self.http_url, backend=self.s.backend,
            threads=self.s.threads_per_worker, same_host=True, stats_dir=str(self.stats_dir),
            transfer=self.s.transfer, vllm=vllm, embedding_cache_bytes=self.s.embedding_cache_mib * MiB,
            max_inflight=self.s.max_inflight, device=self.s.device, dtype=self.s.dtype,
            cuda_visible_devices=self.gpus.get(name),
        )

    def start_zygote(self) -> None:
        """The process the workers are forked from (:mod:`.zygote`), importing while Triton starts; its environment,
        taken now, is theirs (the stage directory's included). A worker may run from another environment (e.g. an
        engine needing numpy 2, which the Triton python-backend stub cannot take): the zygote runs the workers'
        Python."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", **{HEAD_PID_ENV: str(os.getpid())})
        quiet(env, self.s.vllm.log_level)
        self._zygote = Zygote(self.s.worker_python or sys.executable, env, self.s.backend, self.model_path)

    def start_worker(self, name: str) -> None:
        # (a process group of its own: a terminal's Ctrl-C reaches the head alone, which stops everything in order;
        # vLLM's engine process, sent it too, died under its worker and each worker printed a traceback)
        if self._zygote is None or not self._zygote.alive:
            if self._zygote is not None:
                self.out("[trident] the workers' zygote exited; starting it again")
            self.start_zygote()
        self.procs[name] = self._zygote.spawn(["worker", "--settings", self.settings_of(name).model_dump_json()])
        self._restarts.started(name)
        self.out(f"[trident] started worker {name} (pid {self.procs[name].pid})")

    def start_frontend(self) -> subprocess.Popen:
        settings = (self.s.frontend or FrontendSettings(model_path=self.model_path)).model_copy(
            update={"model_path": self.model_path, "grpc_url": self.grpc_url, "host": self.openai_host,
                    "port": self.s.openai_port}
        )
        cmd = [sys.executable, "-m", "trident.cli", "frontend", "--settings", settings.model_dump_json()]
        # it calls the entry models, as any client: no secret of the deployment's
        env = {k: v for k, v in os.environ.items() if k != auth.ENV}
        env.update(HF_HUB_OFFLINE="1", **{HEAD_PID_ENV: str(os.getpid())})
        quiet(env, self.s.vllm.log_level)  # (it loads the checkpoint's config and tokenizer, as the workers do)
        self.procs[FRONTEND] = proc = subprocess.Popen(cmd, env=env, **OWN_GROUP)
        self._restarts.started(FRONTEND)
        self.out(f"[trident] started the OpenAI frontend (pid {proc.pid}) on port {self.s.openai_port}")
        return proc

    def frontend_up(self) -> bool:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://{self.openai_host}:{self.s.openai_port}/health", timeout=2):
                return True
        except urllib.error.HTTPError:  # it answers (503: no mode ready yet)
            return True
        except OSError:
            return False

    def wait_frontend(self) -> None:
        proc = self.procs[FRONTEND]
        deadline = time.monotonic() + 60
        while not self.frontend_up():
            if proc.poll() is not None:
                raise StartupError(f"the OpenAI frontend exited with code {proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise StartupError("the OpenAI frontend did not answer /health within 60 s") from None
            time.sleep(0.2)

    # -- watch -------------------------------------------------------------------------------------------------
    def watch(self, ready: Callable[[str], bool]) -> None:
        """One round of supervision: the exited ones noted (a worker's stage model unloaded), those whose backoff is
        over started again, and each restarted one said once it serves again (``ready``: its stage model is)."""
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.procs.pop(name)
                self._exited(name, proc.returncode, proc.pid)
        for name in self._restarts.due():
            if name == FRONTEND:
                self.start_frontend()
            else:
                self.start_worker(name)
            self._coming_back.add(name)
        for name in list(self._coming_back):
            if name == FRONTEND and self.frontend_up():
                self._coming_back.discard(name)
                self.out(f"[trident] the OpenAI frontend is back on port {self.s.openai_port}")
            elif name != FRONTEND and ready(name):
                self._coming_back.discard(name)
                self.out(f"[trident] worker {name} is back: stage model {name} is ready")

    def _exited(self, name: str, code: int, pid: int) -> None:
        self._coming_back.discard(name)
        remove_direct_socket(self.model_store / name, pid)
        if name == FRONTEND:  # Triton's own endpoints serve on meanwhile
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
        what = "the OpenAI frontend" if name == FRONTEND else f"worker {name}"
        delay = self._restarts.exited(name)
        if delay == PAUSE_S:
            self.out(f"[trident] {what} exited {MAX_QUICK_DEATHS} times in a row within {QUICK_DEATH_S:.0f} s of "
                     f"starting; restarting it after a pause of {delay:.0f} s (its modes answer 503 or fall back)")
            return
        self.out(f"[trident] restarting {what} in {delay:.0f} s")

    # -- stop --------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        stop_all(self.procs, lambda line: self.out(f"[trident] {line}"))
        for name, proc in self.procs.items():
            remove_direct_socket(self.model_store / name, proc.pid)
        if self._zygote is not None:
            self._zygote.close()
