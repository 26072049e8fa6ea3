"""The Triton model repository of the entry models: one per deployment mode, of either scheduler kind.

- ``bls`` (the default): a decoupled python-backend model whose ``model.py`` imports
  :mod:`trident.in_triton.scheduler.model`; its mode is a model-config parameter, its settings
  (:class:`~trident.core.config.SchedulerConfig`) and the checkpoint come by environment.
- ``ensemble``: Triton's static chain of the mode's stage models (one instance each).

Both are rendered from :mod:`trident.core.protocol` through Triton's ``model_config`` protobuf and have the
same inputs and outputs. The launcher writes them into the server's repository and loads them through
Triton's repository API once their stage models are bound. ``model_repository/{bls,ensemble}/<mode>/`` in
the checkout is the same rendering for people to read (``python -m trident.core.repository`` rewrites it; a test
checks it is in step).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb
from tritonclient.utils import np_to_triton_dtype

from trident.core.config import SCHEDULERS
from trident.core.protocol import BIND_MODEL, ENTRY_INPUTS, ENTRY_OUTPUTS, MODES, RECORD_TENSOR, STAGES, WORKER_FILE

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"
_INTERNAL = set(RECORD_TENSOR.values())  # tensors that exist only between steps
BIND_INSTANCES = 1  # binds at once (a load holds its instance of the bind model). Four made a server of six workers
# bound 2-5 s sooner, but a stopping Triton then did not stop their stubs within a 5 s drain (seen once in the suite)
BLS_MODEL_PY = '''"""Entry model of a Trident mode: the BLS scheduler. Its code is trident/in_triton/scheduler/model.py."""

from trident.in_triton.scheduler.model import TritonPythonModel  # noqa: F401
'''
STAGE_MODEL_PY = '''"""A stage model: Trident's stub that calls its worker. Its code is trident/in_triton/proxy_model.py."""

from trident.in_triton.proxy_model import TritonPythonModel  # noqa: F401
'''
BIND_MODEL_PY = '''"""The head's bind model: binds every worker's stage model. Its code is trident/in_triton/bind_model.py."""

from trident.in_triton.bind_model import TritonPythonModel  # noqa: F401
'''


def _data_type(dtype) -> int:
    name = np_to_triton_dtype(np.dtype(dtype))
    return pb.DataType.Value("TYPE_STRING" if name == "BYTES" else f"TYPE_{name}")


def _step_name(tensor: str) -> str:
    return f"_{tensor}" if tensor in _INTERNAL else tensor


def _entry_config(mode: str) -> pb.ModelConfig:
    config = pb.ModelConfig(name=mode, max_batch_size=0)
    for t in ENTRY_INPUTS:
        config.input.add(name=t.name, data_type=_data_type(t.dtype), dims=list(t.shape), optional=t.optional)
    for t in ENTRY_OUTPUTS:
        config.output.add(name=t.name, data_type=_data_type(t.dtype), dims=list(t.shape))
    return config


def ensemble_config(mode: str) -> pb.ModelConfig:
    """A mode's entry model as an ensemble: the vLLM-backend interface chained over its stage models."""
    config = _entry_config(mode)
    config.platform = "ensemble"
    for stage in MODES[mode]:
        spec = STAGES[stage]
        step = config.ensemble_scheduling.step.add(model_name=stage, model_version=-1)
        skip = RECORD_TENSOR.get(spec.also_takes)  # only a scheduler sends a stage its alternative record
        for t in spec.inputs:
            if t.name != skip:
                step.input_map[t.name] = _step_name(t.name)
        for t in spec.outputs:
            if t.name in _INTERNAL or t.name in {o.name for o in ENTRY_OUTPUTS}:
                step.output_map[t.name] = _step_name(t.name)
    return config


def bls_config(mode: str) -> pb.ModelConfig:
    """A mode's entry model as Trident's BLS scheduler (decoupled python-backend model). Its config holds the mode
    alone, which clients may read: the checkpoint's folder and the scheduler's settings reach the scheduler by
    environment (:data:`trident.core.config.MODEL_ENV`, :data:`~trident.core.config.SCHEDULING_ENV`). An operator may change
    the settings of one entry model with Triton's config override: a parameter ``scheduler`` holding the fields to
    change, as JSON."""
    config = _entry_config(mode)
    config.backend = "python"
    config.model_transaction_policy.decoupled = True
    config.instance_group.add(count=1, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    config.parameters["mode"].string_value = mode
    return config


def stage_config(name: str, stage: str, instances: int) -> pb.ModelConfig:
    """A stage instance's model (``name``: ``<stage>`` or ``<stage>-<n>``): the python-backend stub
    (:mod:`trident.in_triton.proxy_model`) that calls its worker, with ``instances`` instances."""
    spec = STAGES[stage]
    config = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    for t in spec.inputs:
        config.input.add(name=t.name, data_type=_data_type(t.dtype), dims=list(t.shape), optional=t.optional)
    for t in spec.outputs:
        config.output.add(name=t.name, data_type=_data_type(t.dtype), dims=list(t.shape))
    config.model_transaction_policy.decoupled = spec.decoupled
    config.instance_group.add(count=instances, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    return config


def bind_config(supervised: list[str]) -> pb.ModelConfig:
    """The head's bind model (:data:`~trident.core.protocol.BIND_MODEL`, :mod:`trident.in_triton.bind_model`); ``supervised``:
    the instance names the launcher's own workers bind as (never given to a joining worker)."""
    config = pb.ModelConfig(name=BIND_MODEL, backend="python", max_batch_size=0)
    config.input.add(name="bind", data_type=pb.TYPE_STRING, dims=[1])
    config.output.add(name="name", data_type=pb.TYPE_STRING, dims=[1])
    config.instance_group.add(count=BIND_INSTANCES, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    config.parameters["supervised"].string_value = json.dumps(sorted(supervised))
    return config


def _write_model(dst: Path, config: pb.ModelConfig, model_py: str, files: dict[str, str] | None = None) -> Path:
    """A python-backend model's folder, written anew: its config, ``1/model.py`` and ``files`` beside it. The stub
    would write ``__pycache__`` beside model.py: Triton then takes the folder as changed and reloads the model
    whenever a model that uses it loads; a plain file of that name keeps the folder as it was loaded."""
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "1").mkdir(parents=True)
    (dst / "config.pbtxt").write_text(text_format.MessageToString(config))
    for name, text in {"model.py": model_py, **(files or {})}.items():
        (dst / "1" / name).write_text(text)
    (dst / "1" / "__pycache__").touch()
    return dst


def install_stage_model(model_store: Path, name: str, stage: str, instances: int, worker: dict) -> Path:
    """Put a stage instance's model into the server's model store: its config, the stub and the worker file
    (``worker``: where its worker listens, :meth:`~trident.core.stagecall.StageServer.worker_file`)."""
    return _write_model(model_store / name, stage_config(name, stage, instances), STAGE_MODEL_PY,
                        {WORKER_FILE: json.dumps(worker)})


def install_bind_model(model_store: Path, supervised: list[str]) -> Path:
    """Put the head's bind model into the server's model store."""
    return _write_model(model_store / BIND_MODEL, bind_config(supervised), BIND_MODEL_PY)


def render_entry_model(mode: str, scheduler: str = "bls") -> str:
    """config.pbtxt of a mode's entry model."""
    chain = " -> ".join(MODES[mode])
    what = "Trident's BLS scheduler over" if scheduler == "bls" else "an ensemble of"
    header = (
        f"# Entry model of the {mode.upper().replace('_', '/')} mode: {what} {chain}.\n"
        "# Generated by `python -m trident.core.repository` from trident/core/protocol.py; edit there.\n"
    )
    config = bls_config(mode) if scheduler == "bls" else ensemble_config(mode)
    return header + text_format.MessageToString(config)


def _write_entry_model(dst: Path, mode: str, scheduler: str) -> None:
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; schedulers: {', '.join(SCHEDULERS)}")
    (dst / "1").mkdir(parents=True, exist_ok=True)
    (dst / "config.pbtxt").write_text(render_entry_model(mode, scheduler))
    if scheduler == "bls":
        (dst / "1" / "model.py").write_text(BLS_MODEL_PY)


def install_entry_model(mode: str, model_store: Path, source: Path | None = None, scheduler: str = "bls") -> Path:
    """Put an entry model into a server's model store (with the version folder Triton expects): rendered
    from :mod:`trident.core.protocol`, or copied from a ``source`` repository of the user's."""
    dst = model_store / mode
    if dst.exists():
        shutil.rmtree(dst)
    if source is None:
        _write_entry_model(dst, mode, scheduler)
    else:
        src = source / mode
        if not (src / "config.pbtxt").is_file():
            raise FileNotFoundError(f"no entry model {mode!r} in {source}")
        shutil.copytree(src, dst)
        (dst / "1").mkdir(exist_ok=True)
    # The python-backend stub would write __pycache__ beside model.py: Triton then takes the folder as changed and
    # reloads the entry model whenever a model that uses it loads (the start-up gate's ensemble). A plain file of
    # that name keeps the folder as it was loaded.
    blocker = dst / "1" / "__pycache__"
    if not blocker.exists():
        blocker.touch()
    return dst


def write_repository(root: Path = REPOSITORY) -> list[Path]:
    written = []
    for scheduler in SCHEDULERS:
        for mode in MODES:
            dst = root / scheduler / mode
            if dst.exists():
                shutil.rmtree(dst)
            _write_entry_model(dst, mode, scheduler)
            written += sorted(p for p in dst.rglob("*") if p.is_file())
    return written


if __name__ == "__main__":
    for p in write_repository(Path(sys.argv[1]) if len(sys.argv) > 1 else REPOSITORY):
        print("wrote", p)
