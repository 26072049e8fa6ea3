"""The facts every process agrees on, torch-free: stages, modes, the entry interface and the records.

- :data:`STAGES`: one :class:`StageSpec` per stage model: its Triton tensors, what it computes (roles),
  the record it takes and what it hands on. Workers bind from it, engines are chosen from it, the
  repository renders ensembles from it.
- :data:`MODES`: each deployment mode's entry model and the stages it chains.
- The records that cross Triton between stages (``embedding_meta``, ``kv_meta``): one versioned, tagged
  union (:data:`Record`) encoded with msgpack as positional arrays, so a record stays well under 1 KiB.
  A record says where a producer's tensors are (:class:`Transfer`: NIXL agent, regions inside its
  registered pool, dtype/shape, lease) and what the next stage needs to continue; none of the tensor values
  are in it. Each record is sealed with the deployment's key (:mod:`trident.core.auth`) and opened before
  it is decoded.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Literal, Union

import msgspec
import numpy as np

from trident.core import auth
from trident.core.errors import ERRORS, ForgedRecord, InvalidRequest, MalformedRecord, TridentError, as_trident_error


@dataclass(frozen=True)
class Tensor:
    """A model input or output as Triton's config declares it: its name, numpy dtype (``bytes``: BYTES), shape (-1:
    any length) and, for an input, whether it may be left out. (Not PyTriton's: this module runs in every Triton
    stub, and importing PyTriton there took 0.8 s of each stub's start.)"""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    optional: bool = False

# -- the entry interface (Triton's vLLM backend's) ------------------------------------------------------
_SAMPLING = Tensor(name="sampling_parameters", dtype=bytes, shape=(1,), optional=True)
MAX_SAMPLING_JSON = 64 << 10  # bytes of sampling_parameters (refused past it by the scheduler and by every stage)
_TEXT = Tensor(name="text_input", dtype=bytes, shape=(1,))
_IMAGE = Tensor(name="image", dtype=bytes, shape=(-1,), optional=True)
_VIDEO = Tensor(name="video", dtype=bytes, shape=(-1,), optional=True)
_AUDIO = Tensor(name="audio", dtype=bytes, shape=(-1,), optional=True)
_MEDIA = (_IMAGE, _VIDEO, _AUDIO)  # trident.core.media.MODALITIES
_OUTPUT_CONTROLS = tuple(
    Tensor(name=n, dtype=np.bool_, shape=(1,), optional=True)
    for n in ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
              "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
)
ENTRY_INPUTS: tuple[Tensor, ...] = (_TEXT, *_MEDIA, _SAMPLING, *_OUTPUT_CONTROLS)
ENTRY_OUTPUTS: tuple[Tensor, ...] = (
    Tensor(name="text_output", dtype=bytes, shape=(-1,)),
    Tensor(name="finish_reason", dtype=bytes, shape=(-1,)),
    Tensor(name="cumulative_logprob", dtype=np.float32, shape=(-1,)),
    Tensor(name="logprobs", dtype=bytes, shape=(-1,)),
    Tensor(name="num_input_tokens", dtype=np.uint32, shape=(-1,)),
    Tensor(name="num_output_tokens", dtype=np.uint32, shape=(-1,)),
)

# Names of the record tensors, by what they carry.
RECORD_TENSOR = {"embeddings": "embedding_meta", "kv": "kv_meta"}
Handoff = Literal["embeddings", "kv", "tokens"]
Role = Literal["encode", "prefill", "decode"]


def _record_tensor(kind: str, optional: bool = False) -> Tensor:
    return Tensor(name=RECORD_TENSOR[kind], dtype=bytes, shape=(1,), optional=optional)


@dataclass(frozen=True)
class StageSpec:
    """One stage model: what it computes, what it takes and hands on, and its Triton tensors."""

    name: str
    doc: str
    roles: tuple[Role, ...]  # what the stage computes, in order
    takes: Literal["embeddings", "kv"] | None  # the record it reads (None: raw media or nothing)
    hands_on: Handoff  # a record for the next stage, or the generated tokens (the entry outputs)
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    # A record a scheduler may send instead of ``takes``: the decode stage prefills a short prompt itself
    # from ``text_input`` and its ``embedding_meta`` (Dynamo's conditional disaggregation). Ensembles
    # chain ``takes`` only.
    also_takes: Literal["embeddings"] | None = None

    @property
    def decoupled(self) -> bool:
        """Streams its responses (the stages that hand on tokens)."""
        return self.hands_on == "tokens"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)


REQUEST_ID = "trident_request"
"""Request parameter: the scheduler's id of a request it streams from a stage (what a :class:`Cancel` names)."""

EMBEDDING_SCOPE = "trident_embedding_scope"
"""Request parameter of an encode call: ``request`` keeps the request's embeddings to itself (no other request's
cached or in-flight encode is used, and its own are not kept for others: ``scheduling.embedding_cache_scope``)."""

# -- the stage protocol: every message between a caller and a stage worker ------------------------------------
class HandTo(msgspec.Struct, array_like=True, frozen=True):
    """Of an encode :class:`Call`: hand the record straight to prefill instance ``instance``'s worker (a
    :class:`Deliver` message), for its call waiting on ``token``, when the items' embedding rows number more than
    ``above`` (fewer: the prompt is short enough for the decode worker to prefill). See
    the record hand-off in :mod:`trident.worker.infer`."""

    instance: str
    token: str
    above: int = -1


class Call(msgspec.Struct, array_like=True, tag="call"):
    """A stage call: the stage model's ``inputs`` (name -> array), the ``outputs`` wanted, the request's
    ``parameters``; from the scheduler also where its record goes (``hand_to``, an encode call) or that it
    comes from the encode worker under a token (``await_record``, a prefill call posted beside the encode call).
    Only the scheduler sets those two: the stage stubs, which carry calls from Triton's clients, never do.
    ``traceparent``: the caller's span, when the request is traced (:mod:`trident.core.tracing`)."""

    id: int
    inputs: dict[str, Any]
    outputs: list[str] = []
    parameters: dict[str, Any] = {}
    hand_to: HandTo | None = None
    await_record: str | None = None
    traceparent: str | None = None


class Reply(msgspec.Struct, array_like=True, frozen=True, tag="reply"):
    """A call's answer (one-answer stages: its outputs, ``end``), or one event of a stream; a stream's last
    message has ``end`` (and may carry no outputs). A control message's answer is an empty one (:class:`Stats`'s
    carries the counters)."""

    id: int
    outputs: dict[str, Any] = {}
    end: bool = True


class Failure(msgspec.Struct, array_like=True, frozen=True, tag="failure"):
    """A call or control message that failed: its error class (:data:`trident.core.errors.ERRORS`) and message.
    It ends the call."""

    id: int
    error: str
    message: str


class Gone(msgspec.Struct, array_like=True, frozen=True, tag="gone"):
    """A call the stopping worker did not take (the caller asks Triton what became of the instance)."""

    id: int


class Cancel(msgspec.Struct, array_like=True, frozen=True, tag="cancel"):
    """Stop the stream the scheduler started with ``REQUEST_ID`` = ``request_id`` (at its next token)."""

    id: int
    request_id: str


class Deliver(msgspec.Struct, array_like=True, frozen=True, tag="deliver"):
    """The embeddings record for the prefill call posted under ``token`` (from the encode worker)."""

    id: int
    token: str
    record: bytes


class Withdraw(msgspec.Struct, array_like=True, frozen=True, tag="withdraw"):
    """The prefill call posted under ``token`` gets no record (the encode failed, or did not hand it on)."""

    id: int
    token: str


class Abandon(msgspec.Struct, array_like=True, frozen=True, tag="abandon"):
    """The caller has given up on its call ``call`` on this connection (past its deadline): the worker stops it."""

    id: int
    call: int


class Claim(msgspec.Struct, array_like=True, frozen=True, tag="claim"):
    """Take what a record points to at the worker that produced it, before reading it: the KV the vllm engine's
    prefill holds under ``claim`` (a :class:`VLLMKVRecord`'s), or, with ``lease``, the tensors of the transfer lease
    ``claim`` (a :class:`Transfer`'s: an embeddings record's, an hf KV record's). The producer answers the first claim
    with an empty :class:`Reply`, and every other one, from any consumer, and one after the lease, with
    :class:`~trident.core.errors.ReplayedRecord`: a record is read once, by one consumer, however many hold it."""

    id: int
    claim: str
    lease: bool = False


class Stats(msgspec.Struct, array_like=True, tag="stats"):
    """Ask the worker for its counters (the stage model's stub, for its metrics): answered with a :class:`Reply`
    whose ``outputs`` are ``{"stats": {name: number}}``."""

    id: int = 0


Control = Union[Cancel, Deliver, Withdraw, Abandon, Claim, Stats]
"""What a caller tells a stage worker besides calls: each a message of its own, never a parameter of a call."""
StageMessage = Union[Call, Reply, Failure, Gone, Cancel, Deliver, Withdraw, Abandon, Claim, Stats]
"""Everything that crosses a stage socket, either way. Arrays travel as msgpack extensions (:func:`encode_message`)."""

FRAME = struct.Struct("!I")
"""A stage socket's frame: this many bytes of one :data:`StageMessage`, then the message."""
_ARRAY, _BYTES = 1, 2  # msgpack extension codes: a numeric array (dtype, shape, raw bytes); a BYTES one (shape, items)


def _encode_array(obj):
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"a stage message cannot carry {type(obj).__name__}")
    if obj.dtype == np.object_ or obj.dtype.kind in "SU":
        items = [x if isinstance(x, bytes) else str(x).encode() for x in obj.reshape(-1).tolist()]
        return msgspec.msgpack.Ext(_BYTES, _encoder.encode((obj.shape, items)))
    a = np.ascontiguousarray(obj)
    return msgspec.msgpack.Ext(_ARRAY, _encoder.encode((a.dtype.str, a.shape, a.data)))


def _decode_array(code: int, data: memoryview):
    if code == _BYTES:
        shape, items = msgspec.msgpack.decode(data, type=tuple[tuple[int, ...], list[bytes]])
        out = np.empty(len(items), dtype=np.object_)
        out[:] = items
        return out.reshape(shape)
    if code == _ARRAY:
        dtype, shape, raw = msgspec.msgpack.decode(data, type=tuple[str, tuple[int, ...], bytes])
        if np.dtype(dtype).kind not in "biuf":
            raise ValueError(f"dtype {dtype} is not a stage tensor's")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise ValueError(f"unknown msgpack extension {code}")


_message_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_array)
_message_decoder = msgspec.msgpack.Decoder(StageMessage, ext_hook=_decode_array)


def failure(id: int, error: BaseException) -> Failure:
    """``error``'s :class:`Failure` (anything not a Trident error is an internal one, shown by a reference only:
    :func:`~trident.core.errors.as_trident_error`)."""
    e = as_trident_error(error)
    return Failure(id, type(e).__name__, e.message)


def error_of(message: Failure) -> TridentError:
    """The Trident error a :class:`Failure` names (an unknown class is an internal error)."""
    return ERRORS.get(message.error, TridentError)(message.message)


def encode_message(message: StageMessage, session: "auth.Session | None" = None) -> bytes:
    """``message`` as one frame (:data:`FRAME` + msgpack; with ``session``, the msgpack sealed as that connection's
    next frame: every stage connection's frames are, :class:`~trident.core.auth.Session`)."""
    body = _message_encoder.encode(message)
    if session is not None:
        body = session.seal(body)
    return FRAME.pack(len(body)) + body


def decode_message(body: bytes | memoryview) -> StageMessage:
    """A frame's message; :class:`MalformedRecord` names what is wrong with bytes that are not one."""
    try:
        return _message_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
        raise MalformedRecord(f"not a stage message: {e}") from None


WORKER_FILE = "trident_worker.json"
"""Written by a stage worker next to its stage model's ``model.py``: where its stage server listens
(:meth:`trident.core.stagecall.StageServer.worker_file`); the stub enters it in the stage directory
(:mod:`trident.core.stagecall.directory`)."""

NAME_TAKEN_EXIT = 3
"""A stage worker's exit code when the instance name it was to bind as is held by another live worker (one
that joined while a worker ``trident serve`` supervises was down): the supervisor does not restart it."""

BIND_MODEL = "trident_bind"
"""The head's model that binds stage models (:mod:`trident.in_triton.bind_model`): every worker asks it, with the
deployment's stage credential, to bind its stage model (a :class:`Bind` as JSON in the BYTES input ``bind``; the
output ``name`` is the instance name it bound). Workers need neither Triton's repository API nor its token, and no
stage model's files travel with a load request."""


class Bind(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker's request to :data:`BIND_MODEL`: bind (with ``leave``: unbind) the stage model of the worker whose
    stage server listens at ``tcp`` (on the head's host also at the Unix socket ``direct``, of process ``pid``)."""

    stage: str
    tcp: tuple[str, int]
    instances: int = 1  # how many instances Triton runs (the calls the worker takes at once)
    name: str | None = None  # the name to bind as; None: the first free <stage>-<n>, n >= 2 (a joining worker)
    pid: int | None = None
    direct: str | None = None
    leave: bool = False

    MAX_INSTANCES = 16  # (a worker takes at most vllm.prefill_calls, 16, at once; each instance is a stub on the head)

    def check(self) -> None:
        """Raise :class:`InvalidRequest` naming what is wrong with this request."""
        if self.stage not in STAGES:
            raise InvalidRequest(f"unknown stage {self.stage!r}; stages: {', '.join(STAGES)}")
        host, port = self.tcp
        if not host or len(host) > 255 or not 0 < port < 65536:
            raise InvalidRequest(f"tcp must be a host and a port (1-65535), not {list(self.tcp)!r}")
        if not 0 < self.instances <= self.MAX_INSTANCES:
            raise InvalidRequest(f"instances must be 1-{self.MAX_INSTANCES}, not {self.instances}")
        if self.name is not None and (parse_instance(self.name) or ("", 0))[0] != self.stage:
            raise InvalidRequest(f"{self.name!r} is not an instance name of stage {self.stage} (<stage> or <stage>-<n>)")
        if (self.pid is None) != (self.direct is None) or (self.pid is not None and self.pid <= 0):
            raise InvalidRequest("pid and direct go together (a worker on the head's host), pid > 0")
        if self.direct is not None and (not self.direct.startswith("/") or len(self.direct) > 4096):
            raise InvalidRequest("direct must be an absolute path")

    def worker_file(self, name: str) -> dict:
        """The worker file of instance ``name``'s worker."""
        return worker_file(name, self.pid, self.direct, self.tcp)


class SealedBind(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A :class:`Bind` as it travels: with the time it was made and a fresh nonce, under a MAC (:func:`seal_bind`)."""

    bind: Bind
    sent_at: float
    nonce: str


BIND_FRESH_S = 60.0  # a sealed bind made longer ago than this (or this far ahead) is refused
BIND_KEY = b"trident-bind-mac"  # the label of the bind key (auth.derive): not the stage credential's


def seal_bind(request: Bind) -> bytes:
    """``request`` as the bind model takes it: ``<HMAC-SHA256 hex>.<JSON>``, under the deployment's bind key (derived
    from the secret, which no client holds: the stage credential alone cannot make one)."""
    import hmac
    import os
    import time

    body = msgspec.json.encode(SealedBind(request, time.time(), os.urandom(16).hex()))
    return hmac.new(auth.derive(BIND_KEY), body, "sha256").hexdigest().encode() + b"." + body


def open_bind(data: bytes, take) -> Bind:
    """The :class:`Bind` ``data`` carries: :class:`~trident.core.errors.Unauthenticated` unless a key of the deployment
    sealed it within :data:`BIND_FRESH_S` and ``take(nonce)`` says its nonce is new (False: a replay);
    :class:`InvalidRequest` for a sealed one that is not a request."""
    import hmac
    import time

    from trident.core.errors import Unauthenticated

    mac, _, body = bytes(data).partition(b".")
    if not any(hmac.compare_digest(mac, hmac.new(key, body, "sha256").hexdigest().encode())
               for key in auth.derive_all(BIND_KEY)):
        raise Unauthenticated("the bind model answers only the deployment's own workers (a bind sealed with the "
                              "deployment secret)")
    try:
        sealed = msgspec.json.decode(body, type=SealedBind)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"bind: {e}") from None
    if abs(time.time() - sealed.sent_at) > BIND_FRESH_S or not take(sealed.nonce):
        raise Unauthenticated("a bind made more than a minute ago, or one already taken (a replay): refused")
    return sealed.bind


def worker_file(name: str, pid: int | None, direct: str | None, tcp) -> dict:
    """What a stage model's worker file says of its worker's stage server: its TCP address, and on the head's host
    (with the worker's ``pid``) its Unix socket ``direct``."""
    local = {"pid": pid, "direct": direct} if pid is not None else {}
    return {"name": name, **local, "tcp": list(tcp)}

ENCODE_REPORT = "encode_report"
"""Extra output of the encode stage: JSON counters of its embedding cache for the scheduler's metrics
(this request's hits, misses and shared encodes, the cache's bytes and evictions). Ensembles ignore it."""


def _stage(name: str, doc: str, roles: tuple[Role, ...], takes, hands_on: Handoff, also_takes=None) -> StageSpec:
    inputs: list[Tensor] = []
    if roles != ("encode",):
        # a stage that decodes after a KV transfer gets the prompt only to echo it (or to check it)
        inputs.append(Tensor(name="text_input", dtype=bytes, shape=(1,), optional=takes == "kv"))
    if takes is not None:
        # no images: no embeddings record; a KV record is optional only where the stage can prefill itself
        inputs.append(_record_tensor(takes, optional=takes == "embeddings" or also_takes is not None))
    if also_takes is not None:
        inputs.append(_record_tensor(also_takes, optional=True))
    if "encode" in roles:
        inputs += _MEDIA
    if roles != ("encode",):
        inputs.append(_SAMPLING)
    if hands_on == "tokens":
        inputs += _OUTPUT_CONTROLS
    outputs = ENTRY_OUTPUTS if hands_on == "tokens" else (_record_tensor(hands_on),)
    if roles == ("encode",):
        outputs += (Tensor(name=ENCODE_REPORT, dtype=bytes, shape=(1,)),)
    return StageSpec(name, doc, roles, takes, hands_on, tuple(inputs), tuple(outputs), also_takes)


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in (
        _stage("generate", "EPD: the entry interface in one worker", ("encode", "prefill", "decode"), None, "tokens"),
        _stage("encode", "images, video, audio -> embeddings", ("encode",), None, "embeddings"),
        _stage("prefill", "prompt + embeddings -> KV cache", ("prefill",), "embeddings", "kv"),
        _stage("decode", "KV cache (or a short prompt it prefills itself) -> tokens", ("decode",), "kv", "tokens",
               also_takes="embeddings"),
        _stage("encode_prefill", "prompt + media -> KV cache", ("encode", "prefill"), None, "kv"),
        _stage("prefill_decode", "prompt + embeddings -> tokens", ("prefill", "decode"), "embeddings", "tokens"),
    )
}

MODES: dict[str, tuple[str, ...]] = {
    "epd": ("generate",),
    "e_pd": ("encode", "prefill_decode"),
    "e_p_d": ("encode", "prefill", "decode"),
    "ep_d": ("encode_prefill", "decode"),
}
"""Deployment mode (= its entry model's name) -> the stage models it chains, in order."""


def instance_name(stage: str, index: int) -> str:
    """Triton model name of a stage's ``index``-th worker (1-based): ``prefill``, ``prefill-2``, ...

    The first instance keeps the stage's own name, which is what the ensembles chain."""
    return stage if index == 1 else f"{stage}-{index}"


def parse_instance(name: str) -> tuple[str, int] | None:
    """``(stage, index)`` of a stage instance's model name; None for any other name."""
    stage, sep, index = name.rpartition("-")
    if not sep:
        return (name, 1) if name in STAGES else None
    if stage in STAGES and index.isdigit() and int(index) >= 2 and not index.startswith("0"):
        return stage, int(index)
    return None


def stages_for(modes) -> list[str]:
    """The stage models the modes use, each once, in a stable order."""
    out: list[str] = []
    for mode in modes:
        for stage in MODES[mode]:
            if stage not in out:
                out.append(stage)
    return out


# -- records ---------------------------------------------------------------------------------------------
MAX_GRID_SIDE = 1 << 14  # patches along a grid's side (a 16k-frame clip, a 229k-pixel side at patch 14)
RECORD_VERSION = 13  # 13: a transfer names where its lease is claimed (one consumer reads it, atomically)
STAMP_BYTES = 16  # a lease id, as the producer's stamp of an open lease holds it
RELEASE_KEY_BYTES = 16  # a lease's release key: in the record, never in registered memory
MEMORY_TYPES = ("DRAM", "VRAM")  # where a transfer's regions lie (NIXL's memory types Trident registers)
MAX_DEVICES = 1024  # a VRAM region's device id is below this
MAX_TENSOR_RANK = 8

DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1,
}
"""The dtypes a record may carry, by wire name (= the torch dtype's name), with their item sizes."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """``count`` consecutive contiguous tensors of one dtype and shape.

    A KV cache of L layers is one spec with ``count = 2 * L`` (k and v of layer 0, then layer 1, ...).
    """

    dtype: str
    shape: tuple[int, ...]
    count: int = 1

    @property
    def nbytes(self) -> int:
        return self.count * math.prod(self.shape) * DTYPE_SIZES[self.dtype]


class Transfer(msgspec.Struct, array_like=True, frozen=True):
    """Where a producer's tensors are: NIXL agent, registered regions, layout, and the lease on them."""

    agent: str  # producer NIXL agent name
    agent_meta: bytes  # producer NIXL agent metadata (lets the consumer connect)
    pool: tuple[int, int]  # (address, length) of the producer's registered send pool: regions lie inside
    regions: tuple[tuple[int, int], ...]  # (address, length) in the producer's registered memory
    tensors: tuple[TensorSpec, ...]  # laid out back to back across the regions
    lease_id: str
    expires_at: float  # unix time after which the producer frees the regions
    # address of the lease's stamp in the producer's registered memory: the lease id while the lease is open,
    # cleared before the regions are freed; a consumer READs it after the data (see TransferReceiver.fetch)
    stamp: int = 0
    # what the consumer's release notification carries after the lease id: only a party that holds the record
    # (sealed: only the deployment's processes can open it) can end the lease early
    release_key: bytes = b""
    memory: str = "DRAM"  # NIXL memory type of the regions: DRAM, or VRAM (a producer's GPU memory)
    device: int = 0  # the GPU of VRAM regions, as the producer's process numbers its GPUs
    # where the consumer claims the lease before its READ (the producer worker's file: its stage socket), so that one
    # consumer alone reads it ({}: a producer with no stage socket, as in-process tests have; nothing to claim)
    claim_at: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.regions)

    def validate(self) -> None:
        if not self.regions or any(addr <= 0 or length <= 0 for addr, length in self.regions):
            raise MalformedRecord(f"transfer record has invalid regions {self.regions}")
        if self.stamp <= 0 or len(self.lease_id.encode()) != STAMP_BYTES:
            raise MalformedRecord("transfer record has no lease stamp")
        if len(self.release_key) != RELEASE_KEY_BYTES:
            raise MalformedRecord("transfer record has no release key")
        if self.memory not in MEMORY_TYPES or not 0 <= self.device < MAX_DEVICES:
            raise MalformedRecord(f"transfer record names memory {self.memory!r} on device {self.device}; a record's "
                                  f"regions are {' or '.join(MEMORY_TYPES)} on a device 0..{MAX_DEVICES - 1}")
        start, size = self.pool
        if any(addr < start or addr + length > start + size for addr, length in self.regions):
            raise ForgedRecord(
                f"transfer record regions {list(self.regions)[:4]} lie outside the producer's pool "
                f"[{start:#x}, {start + size:#x})"
            )
        if not self.tensors:
            raise MalformedRecord("transfer record describes no tensors")
        for spec in self.tensors:
            if spec.dtype not in DTYPE_SIZES:
                raise MalformedRecord(f"unknown dtype {spec.dtype!r} in transfer record")
            # every tensor holds at least one element, so ``count`` is bounded by the regions' bytes
            if spec.count < 1 or len(spec.shape) > MAX_TENSOR_RANK or any(d < 1 for d in spec.shape):
                raise MalformedRecord(f"transfer record has an invalid tensor spec {spec}")
        offset = 0
        for spec in self.tensors:  # a consumer views each tensor in place: it must start where its dtype can
            if offset % DTYPE_SIZES[spec.dtype]:
                raise MalformedRecord(f"transfer record puts a {spec.dtype} tensor at byte {offset}, not a multiple "
                                      f"of its element size")
            offset += spec.nbytes
        want = offset
        if want != self.nbytes:
            raise MalformedRecord(f"transfer record tensors need {want} bytes but its regions hold {self.nbytes} bytes")


class _Record(msgspec.Struct, array_like=True, frozen=True, tag=True):
    def encode(self) -> bytes:
        """The record's wire bytes: msgpack, then the deployment's MAC over them."""
        return auth.sign(_encoder.encode(self))

    def validate(self) -> None:
        pass


MAX_STAND_IN_ELEMENTS = 1 << 28  # a stand-in's zeros: at most 256 Mi elements (a 1 GiB clip of uint8 frames x 4)
StandInMeta = dict[str, int | float | str | bool | list[int]]


class StandIn(msgspec.Struct, array_like=True, frozen=True):
    """One media item as the vllm engine's consumers give it to vLLM: the item's shape with zeros for its values.

    vLLM sizes a prompt's placeholders (and Qwen's 3-D positions) from an item's shape alone, whatever the model;
    the embeddings themselves reach the engine from the encode stage (prefill) or are not needed (decode, whose KV
    covers them). What ``vllm_inputs`` gave vLLM at the encode stage: an RGB image (``image``: shape (h, w)), or an
    array (shape, dtype), alone or with a sample rate (``rate``) or a metadata dict (``meta``)."""

    shape: list[int]
    image: bool = False
    dtype: str = "uint8"
    rate: int | None = None
    meta: StandInMeta | None = None

    def validate(self) -> None:
        elements = 1
        for n in self.shape:
            elements *= n
        if not 0 < len(self.shape) <= MAX_TENSOR_RANK or any(n <= 0 for n in self.shape):
            raise MalformedRecord(f"a media stand-in has shape {self.shape}")
        if elements > MAX_STAND_IN_ELEMENTS or (self.image and len(self.shape) != 2):
            raise MalformedRecord(f"a media stand-in of shape {self.shape} is not one a request could bring")
        if self.dtype not in ("uint8", "float32", "int16"):
            raise MalformedRecord(f"a media stand-in has dtype {self.dtype!r}")


DIGEST_BYTES = 32  # SHA-256 (SHA-NI: about 1.7 GB/s on one core here)


class EmbeddingsRecord(_Record, tag=f"embeddings/{RECORD_VERSION}"):
    """``embedding_meta``: a request's media embeddings, all items back to back ``(sum(token_counts), hidden)``."""

    transfer: Transfer
    token_counts: list[int]  # embedding rows of each item
    grid_thw: list[list[int]] | None = None  # Qwen2-VL: (t, h, w) patches per item, for its 3-D positions ([]: none)
    image_ids: list[str] = []  # content ids of the items, for caches keyed by content
    kinds: list[str] | None = None  # each item's modality; None: all images
    seconds: list[float] | None = None  # Qwen2.5-VL, Qwen3-VL: each clip's seconds per temporal patch (0: not a clip)
    frames: list[int] | None = None  # Qwen3-VL: each clip's sampled frames (0: not a clip)
    stand_ins: list[StandIn] | None = None  # the vllm engine's: each item's shape, for vLLM's placeholders
    # each item's rows' SHA-256, checked after the READ: the tensors cross the data network unsealed, and a change on
    # the way is refused (None: a producer whose embeddings are on a GPU, not hashed there)
    digests: list[bytes] | None = None

    def validate(self) -> None:
        self.transfer.validate()
        if self.digests is not None and (len(self.digests) != len(self.token_counts)
                                         or any(len(d) != DIGEST_BYTES for d in self.digests)):
            raise MalformedRecord(f"embeddings record must have one {DIGEST_BYTES}-byte digest per item")
        _check_seconds(self.seconds, len(self.token_counts))
        _check_frames(self.frames, self.grid_thw, len(self.token_counts))
        _check_stand_ins(self.stand_ins, len(self.token_counts))
        if not self.token_counts or any(c <= 0 for c in self.token_counts):
            raise MalformedRecord(f"embeddings record has invalid token counts {self.token_counts}")
        if self.image_ids and len(self.image_ids) != len(self.token_counts):
            raise MalformedRecord("embeddings record has different numbers of token counts and image ids")
        if self.grid_thw is not None and len(self.grid_thw) != len(self.token_counts):
            raise MalformedRecord("embeddings record has different numbers of token counts and grids")
        if self.grid_thw is not None and not all(
                grid == [] or (len(grid) == 3 and all(1 <= n <= MAX_GRID_SIDE for n in grid)) for grid in self.grid_thw):
            raise MalformedRecord(f"embeddings record has a grid that is not (t, h, w) patches of 1..{MAX_GRID_SIDE}")
        _check_kinds(self.kinds, len(self.token_counts))
        if len(self.transfer.tensors) != 1 or self.transfer.tensors[0].count != 1:
            raise MalformedRecord("embeddings record must describe one tensor")
        shape = self.transfer.tensors[0].shape
        if len(shape) != 2 or shape[0] != sum(self.token_counts):
            raise MalformedRecord(f"embeddings of shape {shape} do not hold {sum(self.token_counts)} rows")


class HFKVRecord(_Record, tag=f"hf_kv/{RECORD_VERSION}"):
    """``kv_meta`` of the hf engine: the prompt's KV cache (per layer k, v) and how to continue it.

    ``first_text`` (here and in :class:`VLLMKVRecord`): the text of the first response the decode side will
    send, when the prefill can tell it (the decode's first event, by the same rules from the same token, prompt
    and parameters) and that response is neither empty nor the last. A streaming entry model sends it as soon
    as the prefill returns, instead of after the decode call's round trip, and drops the decode's copy of it.
    None: the decode side's first response is the first one."""

    transfer: Transfer
    prompt_len: int
    first_token: int  # sampled by the prefill
    rope_delta: int = 0  # Qwen2-VL: decode position = cache length + rope_delta
    seed: int = 0  # sampling seed the decode side continues with
    first_text: str | None = None  # the decode's first response text (see above)
    first_logprobs: list[tuple[int, float, int]] | None = None  # as in VLLMKVRecord
    # ``n`` > 1: the first token (and its logprob entries) of each further choice i = 1 .. n-1, sampled from the same
    # logits with seed + i; the decode side forks the one KV cache into n sequences
    forks: list[tuple[int, list[tuple[int, float, int]] | None]] | None = None

    def validate(self) -> None:
        self.transfer.validate()
        if any(spec.count % 2 for spec in self.transfer.tensors):
            raise MalformedRecord("kv record must hold (k, v) pairs")
        if self.prompt_len <= 0 or self.first_token < 0:
            raise MalformedRecord("kv record has an invalid prompt length or first token")
        _check_logprobs(self.first_logprobs, self.first_token)
        if self.forks is not None:
            if not 1 <= len(self.forks) < MAX_CHOICES or any(len(f) != 2 for f in self.forks):
                raise MalformedRecord(f"kv record has more than {MAX_CHOICES} choices, or a malformed one")
            for token, logprobs in self.forks:
                if not isinstance(token, int) or token < 0 or (logprobs is None) != (self.first_logprobs is None):
                    raise MalformedRecord("kv record has an invalid first token of a further choice")
                _check_logprobs(logprobs, token)

    @property
    def n(self) -> int:
        """The choices its KV continues into."""
        return 1 + len(self.forks or ())


class VLLMKVRecord(_Record, tag=f"vllm_kv/{RECORD_VERSION}"):
    """``kv_meta`` of the vllm engine: vLLM's NixlConnector parameters plus what the decode worker needs
    besides ``text_input`` to rebuild the prompt and check it is the prefilled one."""

    kv_transfer_params: dict[str, Any]  # vLLM's own, from the prefill engine's output
    prompt_len: int
    prompt_digest: str  # of the prompt token ids
    token_counts: list[int]  # embedding count of each media item (as the prefill engine's vLLM placed it)
    image_ids: list[str]
    kinds: list[str] | None = None  # each item's modality; None: all images
    stand_ins: list[StandIn] | None = None  # each media item's shape, for the decode engine's placeholders
    first_token: int | None = None  # the prefill's greedy token (None: not sampled)
    first_text: str | None = None  # as in HFKVRecord
    # the first token's logprob entries when the request asked for logprobs: (token id, logprob, rank), the
    # sampled token's first, then the top ones (trident.core.output.TokenLogprob)
    first_logprobs: list[tuple[int, float, int]] | None = None
    # single use across consumers and restarts: the consumer claims the KV at its producer before vLLM reads it
    # (:class:`Claim`), on the producer worker's stage socket that ``claim_at`` describes (its worker file)
    claim: str = ""
    claim_at: dict[str, Any] = {}

    def validate(self) -> None:
        if self.first_token is not None and self.first_token < 0:
            raise MalformedRecord("kv_meta has a negative first token")
        if not self.claim or not self.claim_at:
            raise MalformedRecord("kv_meta names no producer to claim its KV at")
        _check_logprobs(self.first_logprobs, self.first_token)
        if len(self.token_counts) != len(self.image_ids):
            raise MalformedRecord("kv_meta has different numbers of item token counts and item ids")
        _check_kinds(self.kinds, len(self.token_counts))
        _check_stand_ins(self.stand_ins, len(self.token_counts))


MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default max_logprobs)
MAX_CHOICES = 16  # ``n``: the choices a request may ask for (each sampled from the one prefill's KV)


def _check_logprobs(entries: list[tuple[int, float, int]] | None, token: int | None) -> None:
    """A record's first-token logprob entries: the sampled token's first, at most MAX_LOGPROBS more, each a token id,
    a logprob (<= 0, or -inf) and a rank (>= 1)."""
    if entries is None:
        return
    if not 1 <= len(entries) <= MAX_LOGPROBS + 1 or entries[0][0] != token or any(
        len(e) != 3 or not isinstance(e[0], int) or e[0] < 0 or not isinstance(e[2], int) or e[2] < 1
        or not isinstance(e[1], float) or not e[1] <= 0.0 for e in entries
    ):
        raise MalformedRecord("kv record has invalid first-token logprobs")


def _check_stand_ins(stand_ins: list[StandIn] | None, items: int) -> None:
    if stand_ins is None:
        return
    if len(stand_ins) != items:
        raise MalformedRecord(f"record has {len(stand_ins)} media stand-ins for {items} items")
    for stand_in in stand_ins:
        stand_in.validate()


def _check_seconds(seconds: list[float] | None, items: int) -> None:
    if seconds is not None and (len(seconds) != items or not all(0 <= t <= 3600 for t in seconds)):
        raise MalformedRecord("record has invalid seconds per temporal patch")


def _check_frames(frames: list[int] | None, grids: list[list[int]] | None, items: int) -> None:
    """A clip's frames fill its temporal patches (the last one padded): at most ``2 * t`` for patches of 2."""
    if frames is None:
        return
    if grids is None or len(frames) != items or any(
            not 0 <= n <= 2 * g[0] or (n and n <= 2 * (g[0] - 1)) for n, g in zip(frames, grids) if len(g) == 3):
        raise MalformedRecord("record has invalid frame counts for its clips' grids")


def _check_kinds(kinds: list[str] | None, items: int) -> None:
    if kinds is None:
        return
    if len(kinds) != items:
        raise MalformedRecord("record has different numbers of token counts and media kinds")
    if not set(kinds) <= {"image", "video", "audio"}:
        raise MalformedRecord(f"record names unknown media kinds {sorted(set(kinds) - {'image', 'video', 'audio'})}")
    order = {"image": 0, "video": 1, "audio": 2}
    if [order[k] for k in kinds] != sorted(order[k] for k in kinds):
        raise MalformedRecord("record lists its media out of order (images, then video, then audio)")


Record = Union[EmbeddingsRecord, HFKVRecord, VLLMKVRecord]
RECORD_TYPES: tuple[type, ...] = (EmbeddingsRecord, HFKVRecord, VLLMKVRecord)
_TAGS = {cls.__struct_config__.tag: cls for cls in RECORD_TYPES}
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def decode_record(data: Any, expect: type | tuple[type, ...] = RECORD_TYPES) -> Record:
    """Check the signature of a record, then decode and validate it as one of the ``expect`` types;
    :class:`MalformedRecord` (or :class:`ForgedRecord`) names the problem."""
    expect = expect if isinstance(expect, tuple) else (expect,)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedRecord(f"transfer record must be bytes, got {type(data).__name__}")
    if not data:
        raise MalformedRecord("transfer record is empty")
    data = auth.verify(data)
    try:
        head = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as e:
        raise MalformedRecord(f"transfer record is not valid msgpack: {e}") from None
    if not isinstance(head, list) or not head or not isinstance(head[0], str):
        raise MalformedRecord("transfer record does not start with its kind and format version")
    wanted = " or ".join(cls.__struct_config__.tag for cls in expect)
    if head[0] not in _TAGS:
        raise MalformedRecord(f"transfer record {head[0][:40]!r} is not supported here (this side reads {wanted})")
    if _TAGS[head[0]] not in expect:
        raise MalformedRecord(
            f"expected a {wanted} record, got {head[0]} (the stages of this mode run different engines?)"
        )
    try:
        record = _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise MalformedRecord(f"transfer record is malformed: {e}") from None
    record.validate()
    return record
