"""Where a stage computes: the ``device`` and ``dtype`` settings resolved, the GPU each worker of a host gets, and
the NIXL memory type of a tensor.

``device: auto`` is CUDA when this process sees a GPU, else the CPU; ``dtype: auto`` is bfloat16 on a GPU and
float32 on a CPU. On a host with several GPUs, ``trident serve`` gives each of its workers one
(``CUDA_VISIBLE_DEVICES``): the instances named in ``gpus`` the GPUs named there, the others round-robin over
the visible GPUs in start order. Inside a worker its GPU is then ``cuda:0``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Iterable, Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_device(name: str) -> str:
    """``name`` if it is a device setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else ValueError naming it."""
    if name in ("auto", "cpu", "cuda"):
        return name
    prefix, _, index = name.partition(":")
    if prefix == "cuda" and index.isdigit():
        return name
    raise ValueError(f"device {name!r} is not auto, cpu, cuda or cuda:N")


def resolve_device(name: str = "auto"):
    """The torch device of a ``device`` setting in this process. ``cuda`` where no GPU is visible is an error
    naming the setting, not a silent fall-back to the CPU."""
    import torch

    check_device(name)
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r}: this process sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, torch {torch.__version__})")
    device = torch.device(name if ":" in name else "cuda:0")
    if device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {name!r}: this process sees {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(name: str, device) -> "torch.dtype":
    """The torch dtype of a ``dtype`` setting on ``device``: ``auto`` is bfloat16 on a GPU, float32 on a CPU."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def memory_type(tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor's memory: ``("VRAM", gpu)`` on a GPU, ``("DRAM", 0)`` else."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


# -- the head: one GPU per worker --------------------------------------------------------------------------------
def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs the head may hand out, as ``CUDA_VISIBLE_DEVICES`` entries: that variable's list when it is set,
    else one entry per GPU ``nvidia-smi -L`` lists (none on a host without it). The head never initialises CUDA."""
    env = os.environ if env is None else env
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in listed.splitlines() if l.startswith("GPU "))]


def place(names: Iterable[str], gpus: list[str], fixed: dict[str, str], device: str) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of each worker ``names`` (in start order): ``fixed``'s entry for those it
    names, the others round-robin over ``gpus``. None at all when the workers compute on the CPU (``device:
    cpu``, or ``auto`` on a host with no GPU), so that a CPU host's workers keep the environment they had."""
    names = list(names)
    unknown = sorted(set(fixed) - set(names))
    if unknown:
        raise ValueError(f"gpus: {', '.join(unknown)}: no worker of this server has that name "
                         f"(its workers: {', '.join(names)})")
    if device == "cpu" or (device == "auto" and not gpus and not fixed):
        return {}
    if not gpus and not fixed:
        raise ValueError(f"device {device!r}: this host has no visible GPU to place workers on")
    out, turn = {}, 0
    for name in names:
        if name in fixed:
            out[name] = fixed[name]
        elif gpus:
            out[name] = gpus[turn % len(gpus)]
            turn += 1
    return out
