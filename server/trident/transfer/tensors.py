"""Tensors <-> the flat bytes a :class:`~trident.protocol.Transfer` describes (torch side of the dtype table)."""

from __future__ import annotations

import torch

from ..errors import MalformedRecord
from ..protocol import DTYPE_SIZES, TensorSpec


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (the names of :data:`~trident.protocol.DTYPE_SIZES`)."""
    if name not in DTYPE_SIZES:
        raise MalformedRecord(f"unknown dtype {name!r} in transfer record")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {sorted(DTYPE_SIZES)}")
    return name


def unpack_tensors(buffer: torch.Tensor, specs: tuple[TensorSpec, ...]) -> list[torch.Tensor]:
    """Views into a flat uint8 ``buffer`` for tensors laid out back to back as ``specs`` describe."""
    out: list[torch.Tensor] = []
    offset = 0
    for spec in specs:
        dtype = torch_dtype(spec.dtype)
        one = spec.nbytes // spec.count
        for _ in range(spec.count):
            out.append(buffer[offset : offset + one].view(dtype).view(spec.shape))
            offset += one
    return out


def specs_for(tensors: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    """Compact specs for tensors: runs of equal dtype and shape become one spec with a count."""
    specs: list[TensorSpec] = []
    for t in tensors:
        name, shape = dtype_name(t.dtype), tuple(t.shape)
        if specs and specs[-1].dtype == name and specs[-1].shape == shape:
            specs[-1] = TensorSpec(name, shape, specs[-1].count + 1)
        else:
            specs.append(TensorSpec(name, shape))
    return tuple(specs)
