"""Tensors <-> the flat bytes a :class:`~trident.core.protocol.Transfer` describes (torch side of the dtype table)."""

from __future__ import annotations

import torch

from trident.core.errors import MalformedRecord
from trident.core.protocol import DTYPE_SIZES, TensorSpec


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (the names of :data:`~trident.core.protocol.DTYPE_SIZES`)."""
    if name not in DTYPE_SIZES:
        raise MalformedRecord(f"unknown dtype {name!r} in transfer record")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {sorted(DTYPE_SIZES)}")
    return name


def unpack_tensors(
    buffer: torch.Tensor, specs: tuple[TensorSpec, ...], offset: int = 0, typed: dict | None = None
) -> list[torch.Tensor]:
    """Views into a flat, contiguous uint8 ``buffer`` for tensors laid out back to back from byte ``offset`` as
    ``specs`` describe.

    Each tensor is one ``as_strided`` on the buffer seen as its dtype (``typed``: those whole-buffer views by
    dtype, kept by the caller across calls), about 1 us, where a slice viewed as the dtype took three tensor ops
    (about 4.5 us). The specs must fit in the buffer from ``offset``, and each tensor must start at a multiple of
    its element size (a producer lays them out so; torch can view no other way).
    """
    end = offset + sum(spec.nbytes for spec in specs)
    if end > buffer.numel():
        raise MalformedRecord(f"transfer record tensors need {end - offset} bytes, more than the buffer holds")
    typed = {} if typed is None else typed
    start = offset
    out: list[torch.Tensor] = []
    for spec in specs:
        dtype = torch_dtype(spec.dtype)
        size = DTYPE_SIZES[spec.dtype]
        one = spec.nbytes // spec.count
        stride = _contiguous_strides(spec.shape)
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer[: buffer.numel() // size * size].view(dtype)
        for _ in range(spec.count):
            if offset % size:
                raise MalformedRecord(f"transfer record puts a {spec.dtype} tensor at byte {offset - start}, not a multiple "
                                      f"of its element size ({size})")
            out.append(whole.as_strided(spec.shape, stride, whole.storage_offset() + offset // size))
            offset += one
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


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
