"""Trident's settings: the one home of every setting and its default.

Small frozen pydantic models, one per concern. ``trident serve`` builds them from a config file
(``--config``, whose keys are the field names here; docs/configuration.md is generated from these fields) and a
few flags; ``trident serve`` hands each stage worker its :class:`WorkerSettings` whole, as one
JSON document, and the OpenAI frontend its :class:`FrontendSettings` the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

from trident.core.device import DType, check_device
from trident.core.protocol import MODES, STAGES, parse_instance

MiB = 1 << 20

Backend = Literal["hf", "vllm"]
BACKENDS: tuple[str, ...] = get_args(Backend)

HEAD_PID_ENV = "TRIDENT_HEAD_PID"
"""The head's pid: in the environment of each process it starts (the zygote passes it on to the workers): a process
that finds it there ends, with its process group (a vLLM worker's engine processes), when the head ends, even killed
with SIGKILL as the OOM killer does; the OpenAI frontend used to live on, holding its port, and the next start
failed with "ports in use". (tritonserver gets the same from PyTriton's PR_SET_PDEATHSIG, its python-backend stubs
from Triton.)"""
MODEL_ENV = "TRIDENT_MODEL"
"""The checkpoint's folder, for the BLS schedulers (their tokenizer, to measure prompts for local prefill): set by
``trident serve`` for Triton, and so for its python-backend stubs (not in a model config, which clients can read)."""
SCHEDULING_ENV = "TRIDENT_SCHEDULING"
"""The BLS schedulers' settings (:class:`SchedulerConfig` as JSON), set by ``trident serve`` for Triton like
:data:`MODEL_ENV`; an entry model's config parameter ``scheduler`` (an operator's config override) overrides fields
of it for that model."""
SECRET = {"internal": True, "secret": True}
"""A secret: never read from a config file or the command line (``--*-file`` and environment variables instead); the
reference (docs/configuration.md) leaves it out."""
SET_BY_SERVE = {"set_by_serve": True}
"""A field of a process's settings that ``trident serve`` fills in itself (not a key of its config file)."""


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TransferConfig(_Settings):
    """Settings of a process's NIXL transfer endpoint (:mod:`trident.core.transfer`)."""

    send_pool_bytes: ByteSize = Field(
        256 * MiB, gt=0, description="registered memory for tensors this process produces (its send pool)"
    )
    recv_pool_bytes: ByteSize = Field(
        256 * MiB, gt=0, description="registered memory consumers read into (the receive pool)"
    )
    lease_s: float = Field(60.0, gt=0, description="how long a producer keeps unread regions before freeing them")
    read_timeout_s: float = Field(30.0, gt=0, description="longest a READ may take before it is abandoned")
    lease_margin_s: float = Field(
        0.5, ge=0, description="a consumer refuses to start a READ this close to a lease's expiry"
    )
    poll_interval_s: float = Field(0.005, gt=0, description="how often the producer polls for release notifications "
                                   "(one reachable from other hosts: every 0.5 ms for 0.25 s after it opens a lease)")
    backend: str = Field("UCX", description="NIXL backend plugin of the transfer agent")
    data_address: str = Field(
        "127.0.0.1", description="the address NIXL/UCX, vLLM's NIXL side channel and the workers' TCP stage sockets "
        "listen on (the data plane); loopback keeps every transfer on this host"
    )


class VLLMConfig(_Settings):
    """Settings of the ``vllm`` engine's stage workers; the defaults run the demo on a CPU or a GPU."""

    max_model_len: int | None = Field(None, gt=0, description="context window (default: the model's)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache memory per engine, GiB")
    enforce_eager: bool | None = Field(None, description="run without compiled graphs (default: on CPU only)")
    cpu_bind: str = Field(
        "nobind", description="vLLM CPU thread binding: 'nobind' shares the cores among workers, 'auto' or "
        "core lists such as '0-3' pin the engine's threads"
    )
    prefill_calls: int = Field(
        2, ge=1, le=16, description="prefill requests a vLLM prefill engine (E/P/D's prefill, EP/D's encode_prefill) "
        "takes at once, to batch a burst's prefills; each is a python-backend stub in Triton (~75 MiB)"
    )
    nixl_port: int | None = Field(None, gt=0, description="NixlConnector side-channel port (one per KV worker)")
    nixl_threads: int = Field(1, ge=1, description="UCX worker threads of the NixlConnector's NIXL agent")
    log_level: str = Field("ERROR", description="VLLM_LOGGING_LEVEL of the engines (WARNING shows vLLM's warnings "
                           "about its environment, several per engine at start-up)")


class MediaLimits(_Settings):
    """What one request's media (images, video clips, audio clips) may be, checked wherever they arrive (the
    OpenAI frontend, the entry models, the encode workers). ``trident serve`` hands them to every process it
    starts in the environment variable ``TRIDENT_MEDIA_LIMITS`` (JSON); a worker joining from another host
    takes it from its own. Video sampling (``video_fps``, ``video_max_frames``) and the audio rate are part of
    them: every process must agree on them (the scheduler counts a request's tokens the same way)."""

    max_images: int = Field(16, ge=1, description="images per request (each is decoded, encoded and held until it ends)")
    max_pixels: int = Field(
        40_000_000, ge=1, description="pixels per image or video frame (width x height, read from its header: a "
        "decompression bomb is refused before it is decoded)"
    )
    max_bytes: ByteSize = Field(32 * MiB, gt=0, description="encoded bytes per image")
    max_request_pixels: int = Field(
        160_000_000, ge=1, description="pixels one request's media decode to, images and sampled video frames together "
        "(each item's counted from its header before it is decoded; 3 bytes each as RGB)"
    )
    max_videos: int = Field(4, ge=1, description="video clips per request")
    video_max_bytes: ByteSize = Field(64 * MiB, gt=0, description="encoded bytes per video clip")
    video_fps: float = Field(2.0, gt=0, le=60, description="frames sampled per second of video")
    video_max_frames: int = Field(
        32, ge=1, le=1024, description="frames sampled per clip at most (a longer clip is sampled evenly)"
    )
    video_max_seconds: float = Field(
        600.0, gt=0, description="longest video clip, from its header (a longer one is refused before decoding)"
    )
    max_audios: int = Field(8, ge=1, description="audio clips per request")
    audio_max_bytes: ByteSize = Field(32 * MiB, gt=0, description="encoded bytes per audio clip")
    audio_max_seconds: float = Field(30.0, gt=0, description="longest audio clip")
    audio_sample_rate: int | None = Field(
        None, gt=0, description="rate audio is resampled to (default: the model's processor's, else 16000)"
    )

    @property
    def request_bytes(self) -> int:
        """The most encoded media bytes one request can carry: every item the limits allow, each at its largest."""
        return (self.max_images * self.max_bytes + self.max_videos * self.video_max_bytes
                + self.max_audios * self.audio_max_bytes)

    @classmethod
    def from_env(cls) -> "MediaLimits":
        import os

        raw = os.environ.get(MEDIA_LIMITS_ENV)
        return cls.model_validate_json(raw) if raw else cls()


MEDIA_LIMITS_ENV = "TRIDENT_MEDIA_LIMITS"


class MediaPolicy(_Settings):
    """Where the OpenAI frontend may take images, video and audio from, and how much."""

    allow_private_urls: bool = Field(False, description="let media URLs resolve to private/loopback addresses")
    allowed_media_dir: Path | None = Field(None, description="folder local media paths may come from (default: none)")
    max_bytes: ByteSize = Field(
        64 * MiB, gt=0, description="most bytes one request's media URLs and files may bring together (each item "
        "also within its kind's media_limits); counted as they arrive, the request refused at the first item past it"
    )
    allowed_ports: list[int] | None = Field(
        [80, 443, 8080, 8443], description="ports a media URL may name (null: any)"
    )
    timeout_s: float = Field(10.0, gt=0, description="longest a request's media URLs may take to fetch, together")


Scheduler = Literal["bls", "ensemble"]
SCHEDULERS: tuple[str, ...] = get_args(Scheduler)
Routing = Literal["round_robin", "least_loaded", "affinity"]
CacheScope = Literal["shared", "request"]
ROUTINGS: tuple[str, ...] = get_args(Routing)


class SchedulerConfig(_Settings):
    """The BLS entry models' decisions (``scheduler: bls``); handed to them by environment, not in their model configs
    (which clients may read). A config override of an entry model with a parameter ``scheduler`` (JSON of the fields
    to change) changes them for that model while serving."""

    routing: Routing = Field(
        "affinity", description="how a stage instance is chosen: round_robin, least_loaded (fewest requests in "
        "flight), affinity (where the request's images or prompt prefix went before, unless that instance is "
        "overloaded)"
    )
    affinity_slack: int = Field(
        2, ge=0, description="affinity gives way to least-loaded when its instance has this many more requests "
        "in flight than the least loaded one"
    )
    local_prefill_tokens: int = Field(
        128, ge=0, description="E/P/D and EP/D: a prompt of at most this many tokens is prefilled on the decode "
        "worker, with no KV transfer (0: never)"
    )
    local_encode_images: int = Field(
        0, ge=0, description="a request with at most this many images is encoded on a prefill worker that can "
        "encode (encode_prefill, generate) when one runs (0: never)"
    )
    refresh_s: float = Field(0.5, gt=0, description="how often the scheduler looks for stage instances that came or went")
    stage_timeout_s: float = Field(
        120.0, gt=0, description="longest a one-answer stage call (encode, prefill, encode_prefill) may take; past it "
        "the request ends with 504 (gRPC/Triton: UNAVAILABLE) naming the instance, and its worker is told to stop "
        "the call"
    )
    embedding_cache_scope: CacheScope = Field(
        "shared", description="the encode workers' embedding cache: shared (a media item encoded for one request "
        "serves every later request that carries it) or request (each request's items are encoded for it alone and "
        "not kept: no request can tell from its latency what another sent; docs/security.md)"
    )
    migration_limit: int = Field(
        3, ge=0, description="times a request is moved to another stage instance (or a fallback mode) when the "
        "worker serving it dies or is cut off mid-request; the stream goes on with no gap and no repeat. Past it "
        "(0: never), the request ends with 503"
    )


class WorkerSettings(_Settings):
    """Everything one stage worker needs (``trident worker --settings JSON``)."""

    stage: str = Field(description=f"stage model this worker binds: {', '.join(STAGES)}")
    name: str | None = Field(
        None, description="Triton model name of this instance (default: the stage's; more instances: <stage>-<n>)"
    )
    free_name: bool = Field(
        False, description="bind as the first <stage>-<n> (n >= 2) no other worker holds (a joining worker)"
    )
    model: str = Field(description="checkpoint folder")
    url: str = Field(description="Triton HTTP URL the stage model is bound into, e.g. http://127.0.0.1:8000")
    backend: Backend = Field("hf", description="engine: hf (PyTorch + transformers, the reference) or vllm")
    threads: int = Field(1, ge=1, description="torch / engine CPU threads")
    same_host: bool = Field(
        False, description="on the server's host (serve's workers): its stage stub calls it over its Unix socket"
    )
    stats_dir: str | None = Field(None, description="folder to keep <model>.json counters in (one per instance)")
    transfer: TransferConfig = Field(TransferConfig(), description="its NIXL transfer endpoint")
    vllm: VLLMConfig = Field(VLLMConfig(), description="its vLLM engine (backend vllm)")
    embedding_cache_bytes: ByteSize = Field(256 * MiB, ge=0, description="encode stage: embedding cache size (0: off)")
    device: str = Field(
        "auto", description="where the stage computes: auto (a GPU when the worker sees one, else the CPU), cpu, "
        "cuda or cuda:N"
    )
    dtype: DType = Field("auto", description="what the hf engine computes in and hands on: auto (bfloat16 on a GPU, "
                         "float32 on a CPU), float32, bfloat16 or float16; a vLLM engine's dtype")
    cuda_visible_devices: str | None = Field(
        None, json_schema_extra=SET_BY_SERVE, description="the GPU(s) this worker sees, as CUDA_VISIBLE_DEVICES (trident serve places each of its "
        "workers on one)"
    )
    max_inflight: int = Field(
        64, ge=1, description="requests this worker takes at once; one more is refused at once with 503 and "
        "Retry-After rather than queued"
    )
    health_port: int | None = Field(
        None, ge=1, le=65535, description="port of its GET /health on its data address (200 while it serves; for a "
        "cluster's probes)"
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, v: str) -> str:
        if v not in STAGES:
            raise ValueError(f"unknown stage {v!r}; stages: {', '.join(STAGES)}")
        return v

    @model_validator(mode="after")
    def _instance_of_stage(self) -> "WorkerSettings":
        parsed = parse_instance(self.name) if self.name is not None else None
        if self.name is not None and (parsed is None or parsed[0] != self.stage):
            raise ValueError(f"instance name {self.name!r} is not {self.stage!r} or {self.stage}-<n> (n >= 2)")
        return self

    @property
    def model_name(self) -> str:
        return self.name or self.stage


class FrontendSettings(_Settings):
    """The OpenAI-compatible frontend (``trident frontend``)."""

    model_path: str = Field(
        "", json_schema_extra=SET_BY_SERVE, description="checkpoint folder (its chat template is applied here)"
    )
    model_name: str | None = Field(None, description="model id of the OpenAI API (default: the checkpoint folder's name)")
    grpc_url: str = Field("127.0.0.1:8001", json_schema_extra=SET_BY_SERVE, description="Triton gRPC address")
    host: str = Field("127.0.0.1", json_schema_extra=SET_BY_SERVE, description="address the frontend listens on")
    port: int = Field(9000, json_schema_extra=SET_BY_SERVE, description="port the frontend listens on")
    default_mode: str = Field("e_p_d", description="mode the bare model id maps to; '<id>:<mode>' picks another")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that sets none")
    max_body_bytes: ByteSize = Field(
        64 * MiB, gt=0, description="largest request body; a larger one is refused with 413 before it is read in full"
    )
    max_buffered_bytes: ByteSize = Field(
        1024 * MiB, gt=0, description="request bodies held at once, all connections together; past it a request is "
        "answered 503 at once"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="longest a request's headers may take to arrive, from the connection's start or the "
        "first byte of its next request; slower ones are answered 408 and the connection closed"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="longest a request body may take to arrive; a slower one is answered 408 and its "
        "connection closed"
    )
    max_connections: int = Field(
        1024, ge=1, description="connections (and requests) the frontend serves at once; past it, 503 at once"
    )
    media: MediaPolicy = Field(MediaPolicy(), description="where media may come from")
    api_key_file: Path | None = Field(
        None, description="file of the OpenAI API's keys, one per line, readable by its owner only: every /v1/ request "
        "must then send one as Authorization: Bearer <key> (else 401); /health and /metrics stay open"
    )

    @field_validator("default_mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        if v not in MODES:
            raise ValueError(f"unknown mode {v!r}; modes: {', '.join(MODES)}")
        return v

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model_path).name


class TracingConfig(_Settings):
    exporter: Literal["otlp", "console", "file", "none"] | None = Field(
        None, description="where each request's spans go: otlp (to where the OTEL_EXPORTER_OTLP_* variables say), "
        "console (each process's output), file (a <process>.jsonl in `folder`: what `make bench-hops` reads) or none; "
        "unset: the OTEL_TRACES_EXPORTER variable decides (none when it is unset)"
    )
    folder: str | None = Field(None, description="the file exporter's folder")

    @model_validator(mode="after")
    def _file_has_folder(self):
        if self.exporter == "file" and not self.folder:
            raise ValueError("the file exporter needs tracing.folder")
        return self


class ServeSettings(_Settings):
    """``trident serve``: the server, its stage workers and the frontend."""

    model: str | None = Field(None, description="checkpoint folder (default: the LLaVA demo model, built on first use)")
    modes: tuple[str, ...] = Field(
        tuple(MODES), description=f"deployment modes whose stage workers run, each served as its entry model: "
        f"{', '.join(MODES)}, or all"
    )
    load: tuple[str, ...] | None = Field(
        None, description="entry models loaded at start (default: those of modes); the others can be loaded "
        "later through Triton's repository API"
    )
    host: str = Field("127.0.0.1", description="address Triton and the frontend listen on")
    http_port: int = Field(8000, description="Triton's HTTP/REST port")
    grpc_port: int = Field(8001, description="Triton's gRPC port")
    metrics_port: int = Field(8002, description="Triton's Prometheus metrics port")
    openai_port: int = Field(9000, description="OpenAI-compatible API port; 0 turns it off")
    openai_host: str | None = Field(
        None, description="address the OpenAI API listens on (default: host), so that it alone can face clients while "
        "Triton stays on a private address"
    )
    access_token: str | None = Field(
        None, repr=False, json_schema_extra=SECRET,
        description="token for Triton's repository API (default: generated)",
    )
    allow_code_upload: bool = Field(
        False, description="let a repository-API `load` carry model files (`file:` parameters), which run as this "
        "server's user: off, such a load is refused (HTTP 501 / gRPC UNIMPLEMENTED); Trident itself never needs it"
    )
    transfer_secret: str | None = Field(
        None, exclude=True, repr=False, json_schema_extra=SECRET,
        description="the deployment's key for signing transfer records (default: generated per start)",
    )
    threads_per_worker: int = Field(1, ge=1, description="torch threads per worker process")
    startup_timeout_s: float = Field(
        300.0, gt=0, description="longest the stage models may take to become ready before serve gives up"
    )
    drain_s: int = Field(
        20, ge=0, le=25, description="on SIGTERM / Ctrl-C, longest the requests in flight may take to finish "
        "(Triton's --exit-timeout-secs); new ones are refused at once and readiness goes false. At most 25: "
        "PyTriton kills a Triton still running 30 s after its stop"
    )
    repository: str | None = Field(
        None, description="folder of the user's own entry models, one <mode>/ folder each (default: Trident's, "
        "written from trident.core.protocol)"
    )
    workspace: str | None = Field(None, description="folder for the server's files: model store, logs, worker stats")
    worker_python: str | None = Field(
        None, description="Python interpreter of the stage workers, an environment with trident installed"
    )
    backend: Backend = Field("hf", description="engine of the stage workers")
    vllm: VLLMConfig = Field(VLLMConfig(), description="the vLLM engines (backend vllm)")
    transfer: TransferConfig = Field(TransferConfig(), description="each worker's NIXL transfer endpoint")
    scheduler: Scheduler = Field("bls", description="what the entry models are: bls (Trident's scheduler) or ensemble")
    scheduling: SchedulerConfig = Field(SchedulerConfig(), description="the BLS scheduler's decisions")
    instances: dict[str, int] = Field(
        default_factory=dict, description="workers per stage on this host (default 1 each); 0: none here, the "
        "stage's instances join from other hosts (`trident worker STAGE --join URL`) and serve waits for one"
    )
    embedding_cache_mib: int = Field(256, ge=0, description="encode workers' embedding cache, MiB (0: off)")
    device: str = Field(
        "auto", description="where the stage workers compute: auto (a GPU when the worker sees one, else the CPU), cpu, "
        "cuda or cuda:N"
    )
    dtype: DType = Field("auto", description="what the hf engine computes in and hands on: auto (bfloat16 on a GPU, "
                         "float32 on a CPU), float32, bfloat16 or float16; a vLLM engine's dtype")
    gpus: dict[str, str] = Field(
        default_factory=dict, description="CUDA_VISIBLE_DEVICES of named worker instances (e.g. prefill: '0', "
        "decode-2: '3'); the other workers get one visible GPU each, round-robin in start order"
    )
    max_inflight: int = Field(
        64, ge=1, description="requests each stage worker takes at once; one more is refused at once with 503 "
        "and Retry-After rather than queued"
    )
    media_limits: MediaLimits = Field(MediaLimits(), description="what one request's media may be")
    frontend: FrontendSettings = Field(
        FrontendSettings(), description="the OpenAI frontend (its model path, address and port are serve's)"
    )
    warm_up: bool = Field(
        True, description="send one small request with an image through each loaded entry model before "
        "serving, so that the first client request pays no first-call costs (NIXL connections, lazy set-up)"
    )
    tracing: TracingConfig = Field(TracingConfig(), description="OpenTelemetry traces of every request")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("instances")
    @classmethod
    def _known_stages(cls, v: dict[str, int]) -> dict[str, int]:
        for stage, count in v.items():
            if stage not in STAGES:
                raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
            if count < 0:
                raise ValueError(f"{stage}={count}: a count of workers is 0 or more")
        return v

    @field_validator("modes", "load", mode="before")
    @classmethod
    def _known_modes(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is None or not isinstance(v, (list, tuple)):
            return v
        unknown = [m for m in v if m not in MODES and m != "all"]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown}; modes: {', '.join(MODES)}, all")
        return tuple(MODES) if "all" in v else tuple(dict.fromkeys(v))

    @model_validator(mode="after")
    def _frontend_of_serve(self) -> "ServeSettings":
        given = sorted(k for k in self.frontend.model_fields_set
                       if (FrontendSettings.model_fields[k].json_schema_extra or {}).get("set_by_serve"))
        if given:
            raise ValueError(f"frontend: {', '.join(given)}: set by trident serve itself (from model, host, "
                             "grpc_port, openai_port); leave them out")
        return self
