"""``trident worker STAGE``: load the engine, bind the stage model into a running Triton, serve until stopped."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import signal
import threading
import traceback
from pathlib import Path

import numpy as np

from ..config import TransferConfig, VLLMConfig
from ..errors import TridentError
from ..protocol import STAGE_MODELS
from . import STAGES

log = logging.getLogger("trident.worker")


_NUMPY_TYPES = {bytes: bytes, bool: np.bool_, "uint32": np.uint32}


def _tensor(defn, Tensor):
    name, dtype, shape, optional = defn
    return Tensor(name=name, dtype=_NUMPY_TYPES[dtype], shape=shape, optional=optional)


BACKENDS = ("hf", "vllm")


def build_engine(
    stage: str, model_path: str, transfer: TransferConfig, backend: str = "hf", vllm: VLLMConfig | None = None,
    threads: int = 1,
):
    """The stage engine a worker serves. The vllm backend encodes with transformers' vision tower."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    if backend == "vllm" and stage != "encode":
        from ..engines.vllm import VLLMStageEngine

        return VLLMStageEngine(stage, model_path, vllm or VLLMConfig(), transfer, threads)
    from ..stages import HFStageEngine

    roles = importlib.import_module(f"{__package__}.{stage}").ROLES
    return HFStageEngine(model_path, roles, transfer if stage != "generate" else None)


def _write_stats(engine, path: Path, stop: threading.Event) -> None:
    """Keep ``path`` holding this worker's transfer, decode and KV-cache counters (read by tests and operators)."""
    last = None
    while True:
        stats = dict(engine.stats())
        stats["pid"] = os.getpid()
        if stats != last:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stats, sort_keys=True))
            tmp.replace(path)
            last = stats
        if stop.wait(0.2):
            return


class _PlainErrors:
    """Stand-in for the ``traceback`` module inside PyTriton's proxy, which sends a failed request's error
    to the client as a formatted traceback: Trident's own errors go as ``Class: message`` instead."""

    def __getattr__(self, name):
        return getattr(traceback, name)

    @staticmethod
    def format_exception(exc, value=None, tb=None, *args, **kwargs):
        error = value if value is not None else exc
        if isinstance(error, TridentError):
            return [f"{type(error).__name__}: {error}"]
        return traceback.format_exception(exc, value, tb, *args, **kwargs)


def _remote_triton(url: str, access_token: str | None, model_store: str | None):
    """PyTriton's RemoteTriton; with ``model_store`` (the server's repository folder, on this host) the
    stage model's files are written there and loaded by name instead of uploaded as an override.

    Triton resolves an ensemble's steps in its repository, so entry models load only over stage models
    that are in it.
    """
    from pytriton.triton import RemoteTriton

    triton = RemoteTriton(url=url, access_token=access_token)
    if model_store:
        triton._model_manager._model_store_path = Path(model_store)  # pytriton 0.7: where bind() writes
    return triton


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


def run_worker(
    stage: str, model_path: str, url: str, access_token: str | None, transfer: TransferConfig,
    stats_dir: str | None = None, model_store: str | None = None, backend: str = "hf",
    vllm: VLLMConfig | None = None, threads: int = 1,
) -> int:
    import pytriton.proxy.inference
    from pytriton.model_config import ModelConfig, Tensor

    pytriton.proxy.inference.traceback = _PlainErrors()

    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    inputs, outputs, decoupled = STAGE_MODELS[stage]
    engine = build_engine(stage, model_path, transfer, backend, vllm, threads)
    infer = importlib.import_module(f"{__package__}.{stage}").make(engine)
    stop = threading.Event()
    if stats_dir:
        Path(stats_dir).mkdir(parents=True, exist_ok=True)
        threading.Thread(
            target=_write_stats, args=(engine, Path(stats_dir) / f"{stage}.json", stop), daemon=True
        ).start()

    def _on_signal(signum, _frame):
        log.info("worker %s: signal %d, unbinding and stopping", stage, signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_signal)
    if model_store:
        _block_bytecode(model_store, stage)
    try:
        with _remote_triton(url, access_token, model_store) as triton:
            triton.bind(
                model_name=stage,
                infer_func=infer,
                inputs=[_tensor(t, Tensor) for t in inputs],
                outputs=[_tensor(t, Tensor) for t in outputs],
                config=ModelConfig(batching=False, decoupled=decoupled),
                strict=False,
            )
            log.warning("worker %s (%s engine, pid %d) bound into %s", stage, backend, os.getpid(), url)
            triton.serve()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        engine.close()
    return 0
