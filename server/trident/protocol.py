"""What crosses Triton between stages: the transfer metadata record.

A :class:`TransferRecord` tells a consumer where a producer's tensors live (NIXL agent, memory regions)
and how to read them back (dtype, shape, layout), plus the small facts the next stage needs to continue
(``extra``: prompt token count, first sampled token, per-image token counts, Qwen's rope delta...).
None of the tensor values are in it. It is encoded with msgpack as a positional array, so a record for a
one-image request stays well under 1 KiB.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch

from .errors import MalformedRecord

FORMAT_VERSION = 1

# Wire names of the dtypes a record may carry.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be transferred; supported: {sorted(_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a wire name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise MalformedRecord(f"unknown dtype {name!r} in transfer record") from None


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """``count`` consecutive contiguous tensors of one dtype and shape.

    A KV cache of L layers is one spec with ``count = 2 * L`` (k and v of layer 0, then layer 1, ...).
    """

    dtype: str
    shape: tuple[int, ...]
    count: int = 1

    @property
    def nbytes(self) -> int:
        return self.count * math.prod(self.shape) * torch_dtype(self.dtype).itemsize


class TransferRecord(msgspec.Struct, array_like=True, frozen=True):
    """Where a producer's tensors are and how to read them; see the module docstring."""

    version: int
    layout: str  # what the tensors mean, e.g. "embeddings" or "kv"
    agent: str  # producer NIXL agent name
    agent_meta: bytes  # producer NIXL agent metadata (lets the consumer connect)
    regions: tuple[tuple[int, int], ...]  # (address, length) in the producer's registered memory
    tensors: tuple[TensorSpec, ...]  # laid out back to back across the regions
    lease_id: str
    expires_at: float  # unix time after which the producer frees the regions
    extra: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.regions)

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> "TransferRecord":
        """Decode and validate a record; raises :class:`MalformedRecord` naming the problem."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MalformedRecord(f"transfer record must be bytes, got {type(data).__name__}")
        if not data:
            raise MalformedRecord("transfer record is empty")
        try:
            head = msgspec.msgpack.decode(data)
        except msgspec.DecodeError as e:
            raise MalformedRecord(f"transfer record is not valid msgpack: {e}") from None
        if not isinstance(head, list) or not head or not isinstance(head[0], int):
            raise MalformedRecord("transfer record does not start with a format version")
        if head[0] != FORMAT_VERSION:
            raise MalformedRecord(f"transfer record format version {head[0]} is not supported (this side reads {FORMAT_VERSION})")
        try:
            record = _decoder.decode(data)
        except msgspec.ValidationError as e:
            raise MalformedRecord(f"transfer record is malformed: {e}") from None
        record._validate()
        return record

    def _validate(self) -> None:
        if not self.regions or any(addr <= 0 or length <= 0 for addr, length in self.regions):
            raise MalformedRecord(f"transfer record has invalid regions {self.regions}")
        for spec in self.tensors:
            torch_dtype(spec.dtype)
            if spec.count < 1 or any(d < 0 for d in spec.shape):
                raise MalformedRecord(f"transfer record has an invalid tensor spec {spec}")
        want = sum(spec.nbytes for spec in self.tensors)
        if want != self.nbytes:
            raise MalformedRecord(f"transfer record tensors need {want} bytes but its regions hold {self.nbytes} bytes")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(TransferRecord)


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


# -- Triton tensors -------------------------------------------------------------------------------
# The entry interface is Triton's vLLM backend's; stage models add the transfer records.
# (name, numpy dtype, shape, optional)
TensorDef = tuple[str, type, tuple[int, ...], bool]

ENTRY_INPUTS: list[TensorDef] = [
    ("text_input", bytes, (1,), False),
    ("image", bytes, (-1,), True),
    ("stream", bool, (1,), True),
    ("sampling_parameters", bytes, (1,), True),
    ("exclude_input_in_output", bool, (1,), True),
    ("return_finish_reason", bool, (1,), True),
    ("return_num_input_tokens", bool, (1,), True),
    ("return_num_output_tokens", bool, (1,), True),
]
ENTRY_OUTPUTS: list[TensorDef] = [
    ("text_output", bytes, (-1,), False),
    ("finish_reason", bytes, (-1,), False),
    ("num_input_tokens", "uint32", (-1,), False),
    ("num_output_tokens", "uint32", (-1,), False),
]
_OUTPUT_CONTROLS = [t for t in ENTRY_INPUTS if t[0] in ("stream", "exclude_input_in_output") or t[0].startswith("return_")]
_SAMPLING = ("sampling_parameters", bytes, (1,), True)

EMBEDDING_META: TensorDef = ("embedding_meta", bytes, (1,), False)
KV_META: TensorDef = ("kv_meta", bytes, (1,), False)

# stage model -> (inputs, outputs, decoupled)
STAGE_MODELS: dict[str, tuple[list[TensorDef], list[TensorDef], bool]] = {
    "generate": (ENTRY_INPUTS, ENTRY_OUTPUTS, True),
    "encode": ([("image", bytes, (-1,), True)], [EMBEDDING_META], False),
    "prefill": (
        [("text_input", bytes, (1,), False), ("embedding_meta", bytes, (1,), True), _SAMPLING],
        [KV_META],
        False,
    ),
    "decode": (
        [("kv_meta", bytes, (1,), False), ("text_input", bytes, (1,), True), _SAMPLING, *_OUTPUT_CONTROLS],
        ENTRY_OUTPUTS,
        True,
    ),
    "encode_prefill": (
        [("text_input", bytes, (1,), False), ("image", bytes, (-1,), True), _SAMPLING],
        [KV_META],
        False,
    ),
    "prefill_decode": (
        [("text_input", bytes, (1,), False), ("embedding_meta", bytes, (1,), True), _SAMPLING, *_OUTPUT_CONTROLS],
        ENTRY_OUTPUTS,
        True,
    ),
}

# deployment mode (entry model name) -> the stage models it chains
MODES: dict[str, tuple[str, ...]] = {
    "epd": ("generate",),
    "e_pd": ("encode", "prefill_decode"),
    "e_p_d": ("encode", "prefill", "decode"),
    "ep_d": ("encode_prefill", "decode"),
}
