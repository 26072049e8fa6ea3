"""``trident worker``: build the stage's engine, bind its model into a running Triton, serve until stopped.

Errors cross in a structured way: a failed call's answer is a :class:`~trident.protocol.Failure` naming the error
class; the stub side (:mod:`.proxy_model`) turns it into a Triton error with the class's code, so Triton's
endpoints answer with the matching status.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from ..config import WorkerSettings
from ..protocol import NAME_TAKEN_EXIT, STAGES, WORKER_FILE, instance_name
from .health import Health

log = logging.getLogger("trident.worker")
_PROXY_MODEL = Path(__file__).with_name("proxy_model.py")  # runs inside the stub, not here


def _write_stats(stats, path: Path, stop: threading.Event) -> None:
    """Keep ``path`` holding this worker's counters (``stats()``: :meth:`StageHandler.stats
    <trident.workers.infer.StageHandler.stats>`), read by tests and operators. A write that fails (a full disk) is
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


def _install_proxy_model(server) -> None:
    """PyTriton 0.7 limitation: it offers no way to choose the python-backend ``model.py`` of a model it binds.
    It puts its own proxy beside the stage model's config, written into the server's repository folder
    (``--model-store``) or uploaded with the load request (a worker that joins from elsewhere); either way Trident's
    stub (:mod:`.proxy_model`) replaces it, with the worker file that tells the stub and the schedulers where
    ``server`` (this worker's :class:`~trident.stagecall.StageServer`) listens. PyTriton's tensor store (a manager
    process per stage model) is switched off by PyTriton's own setting, ``PYTRITON_NO_TENSORSTORE``, set here and
    in Triton's environment. ``tests/unit/test_pytriton_patches.py`` fails when the patched methods change."""
    from pytriton.models.model import Model

    os.environ["PYTRITON_NO_TENSORSTORE"] = "1"
    _serving["server"] = server
    if getattr(Model.generate_model, "_trident", False):
        return
    original, original_files = Model.generate_model, Model.get_proxy_model_files

    def generate_model(self, model_repository: Path) -> None:
        original(self, model_repository)
        version_dir = Path(model_repository) / self.model_name / str(self.model_version)
        shutil.copy(_PROXY_MODEL, version_dir / "model.py")
        info = _serving["server"].worker_file(os.getpid(), self.model_name)
        (version_dir / WORKER_FILE).write_text(json.dumps(info))

    def get_proxy_model_files(self) -> dict[str, bytes]:
        # the server may be on another host, where this pid and Unix socket mean nothing: only the TCP stage socket
        files = original_files(self)
        files[f"file:{self.model_version}/model.py"] = _PROXY_MODEL.read_bytes()
        info = _serving["server"].worker_file(None, self.model_name)
        files[f"file:{self.model_version}/{WORKER_FILE}"] = json.dumps(info).encode()
        return files

    generate_model._trident = True
    Model.generate_model = generate_model
    Model.get_proxy_model_files = get_proxy_model_files


_serving: dict = {}  # {"server": this worker's StageServer}, for the patched methods


def _wait_for_server_live(client, timeout_s: float | None = None, headers: dict | None = None) -> None:
    """Until Triton answers as live (``client``: a tritonclient client), at most ``timeout_s``."""
    from pytriton.client.exceptions import PyTritonClientTimeoutError

    deadline = time.monotonic() + (timeout_s if timeout_s is not None else 120.0)
    while True:
        try:
            if client.is_server_live(headers=headers):
                return
        except Exception:  # noqa: BLE001 - not up yet (tritonclient raises its own and socket errors)
            pass
        if time.monotonic() > deadline:
            raise PyTritonClientTimeoutError("Waiting for the server to be live timed out.")
        time.sleep(0.1)


WAITS_FOR_READY = ("pytriton.triton", "pytriton.models.manager", "pytriton.client.client")
"""PyTriton's modules that call ``pytriton.client.utils.wait_for_server_ready`` (imported by name)."""


def bind_when_live() -> None:
    """PyTriton 0.7 limitation: it waits for the whole server to be READY before it starts, connects or binds a
    model (``Triton.connect``, its log-level check, ``ModelManager.clean``, ``ModelClient.wait_for_server``). A
    Trident server is not READY until start-up is over (the launcher's start-up gate, and entry models LOADING
    until a route of their plan has live stage instances), so the launcher and the workers wait for it to be live.
    ``tests/unit/test_pytriton_patches.py`` fails when the patched function changes."""
    import importlib

    for name in WAITS_FOR_READY:
        importlib.import_module(name).wait_for_server_ready = _wait_for_server_live


def _remote_triton(url: str, access_token: str | None, model_store: str | None):
    """PyTriton's RemoteTriton; with ``model_store`` (the server's repository folder, on this host) the
    stage model's files are written there and loaded by name instead of uploaded as an override.

    PyTriton 0.7 limitation: a RemoteTriton always uploads the model's files with the load request, and Triton
    resolves an ensemble's steps in its repository only, so entry models would not load over stage models bound
    that way. Its model manager's ``_model_store_path`` (set only for a local Triton) makes it write them there.
    ``tests/unit/test_pytriton_patches.py`` fails when the attribute goes.
    """
    from pytriton.triton import RemoteTriton

    triton = RemoteTriton(url=url, access_token=access_token)
    if model_store:
        triton._model_manager._model_store_path = Path(model_store)  # pytriton 0.7: where bind() writes
    return triton


def _not_through_pytriton(*_):
    raise RuntimeError("a stage's calls come over Trident's stage socket (trident.stagecall), not PyTriton's transport")


def _block_bytecode(model_store: str, stage: str) -> None:
    """Keep the python-backend stub from writing ``__pycache__`` next to the proxy files.

    Triton watches the stage model's folder: a change after loading makes it reload the stage whenever an
    entry model that uses it is loaded, and a second proxy instance cannot attach to this worker. The stub's
    embedded interpreter ignores PYTHONDONTWRITEBYTECODE, so a plain file takes the folder's name.
    """
    version_dir = Path(model_store) / stage / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    blocker = version_dir / "__pycache__"
    if blocker.is_dir():
        shutil.rmtree(blocker)
    blocker.touch()


def _wait_for_server(url: str) -> None:
    """Until the Triton at ``url`` answers as live, for as long as it takes (one log line if it does not at once)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.split("://", 1)[-1], network_timeout=5)
    try:
        try:
            _wait_for_server_live(client, timeout_s=0)
        except Exception:  # noqa: BLE001 - not up yet, or not reachable yet
            log.warning("waiting for the server at %s to answer", url)
            _wait_for_server_live(client, timeout_s=math.inf)
    finally:
        client.close()


def _watch_server(url: str, name: str, misses: int = 3) -> None:
    """Return once the server at ``url`` has not shown stage model ``name`` ready ``misses`` times in a row, a
    second apart (it is gone, or restarted without it). Each look is a connection of its own, closed at once: a
    stopping Triton waits for its open HTTP connections."""
    import urllib.error
    import urllib.request

    base = url if "://" in url else f"http://{url}"
    missed = 0
    while missed < misses:
        time.sleep(1.0)
        try:
            with urllib.request.urlopen(f"{base}/v2/models/{name}/ready", timeout=5) as reply:
                ready = reply.status == 200
        except (urllib.error.URLError, OSError):  # (HTTPError: not ready; the others: not reachable)
            ready = False
        missed = 0 if ready else missed + 1


CLAIM_S = 300.0  # how long a worker asks the server's model index before it gives up binding


def _claim_name(settings: WorkerSettings, access_token: str | None) -> str | None:
    """The instance name to bind as, checked against the server just before binding; None when another
    worker serves it or is loading it.

    A joining worker takes the first ``<stage>-<n>`` (n >= 2) that is neither ready nor in the server's
    repository: a name with files there belongs to the worker that wrote them (the workers ``trident serve``
    supervises write theirs there), so a worker that joins while a supervised one is down does not take the
    name the supervisor is about to start it again under.
    """
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(settings.url.split("://", 1)[-1], network_timeout=10)
    headers = {"triton-access-token": access_token} if access_token else None
    deadline = time.monotonic() + CLAIM_S
    while True:  # Triton answers the index only between model loads: on a busy host that can take a while
        try:
            index = {m["name"]: m.get("state") for m in client.get_model_repository_index(headers=headers)}
            break
        except (TimeoutError, OSError):
            if time.monotonic() > deadline:
                raise
            log.info("worker %s: the server's model index did not answer within 10 s; asking again", settings.model_name)
    if not settings.free_name:
        name = settings.model_name
        held = index.get(name) == "LOADING" or client.is_model_ready(name)
        return None if held else name
    n = 2
    while instance_name(settings.stage, n) in index or client.is_model_ready(instance_name(settings.stage, n)):
        n += 1
    return instance_name(settings.stage, n)


def run_worker(settings: WorkerSettings, access_token: str | None) -> int:
    from pytriton.model_config import ModelConfig

    from .. import tracing
    from ..engines import build_engine
    from ..stagecall import StageServer
    from ..stagecall.server import at_most, unix_folder
    from .infer import make_handler

    bind_when_live()
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
    name = _claim_name(settings, access_token)
    if name is None:
        if health:
            health.state = "not bound"
        log.error("worker %s: another worker already serves stage model %s; not binding",
                  settings.model_name, settings.model_name)
        engine.close()
        return NAME_TAKEN_EXIT
    tracing.start(name)
    handler = make_handler(spec, engine, settings.max_inflight)
    infer = handler.infer if spec.decoupled else at_most(handler.infer, engine.calls_at_once, handler.entry)
    server = StageServer(infer, handler.control, settings.transfer.data_address)
    server.start()
    if (serving_at := getattr(engine, "serving_at", None)) is not None:  # a vllm KV producer's consumers claim there
        serving_at(server.worker_file(os.getpid(), name))
    _install_proxy_model(server)
    stop = threading.Event()
    if settings.stats_dir:
        Path(settings.stats_dir).mkdir(parents=True, exist_ok=True)
        threading.Thread(
            target=_write_stats, args=(handler.stats, Path(settings.stats_dir) / f"{name}.json", stop),
            daemon=True
        ).start()

    def _on_signal(signum, _frame):
        log.info("worker %s: signal %d, unbinding and stopping", name, signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    if settings.model_store:
        _block_bytecode(settings.model_store, name)
    try:
        while True:
            with _remote_triton(settings.url, access_token, settings.model_store) as triton:
                triton.bind(
                    model_name=name,
                    infer_func=[_not_through_pytriton] * engine.calls_at_once,  # (how many instances Triton runs)
                    inputs=list(spec.inputs),
                    outputs=list(spec.outputs),
                    config=ModelConfig(batching=False, decoupled=spec.decoupled),
                    strict=False,
                )
                # a worker `trident serve` started: its server says when the stage model is ready; one joined by
                # hand says it
                (log.info if settings.model_store else log.warning)(
                    "worker %s (%s engine, pid %d) bound into %s", name, settings.backend, os.getpid(), settings.url)
                if health:
                    health.state = "serving"
                if not settings.free_name:  # (`trident serve` stops its workers when its Triton goes)
                    triton.serve()
                    break
                _watch_server(settings.url, name)
            # its server went away (a restart) or no longer serves its stage model: bind again once it is back
            if health:
                health.state = "lost its server"
            log.warning("worker %s: the server at %s no longer serves %s; binding again once it answers",
                        name, settings.url, name)
            _wait_for_server(settings.url)
            name = _claim_name(settings, access_token)
    except KeyboardInterrupt:
        pass
    finally:
        if health:
            health.state = "stopping"
        server.stop()  # the stage model is unbound: the calls taken finish, later ones are answered Gone
        stop.set()
        engine.close()
    return 0
