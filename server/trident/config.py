"""Trident's settings.

Small frozen pydantic models, one per concern; the CLI and (later) the launcher build them from flags,
environment variables (``TRIDENT_*``) or YAML.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20


class TransferConfig(BaseModel):
    """Settings of a process's NIXL transfer endpoint (:mod:`trident.transfer`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    send_pool_bytes: int = Field(256 * MiB, gt=0, description="registered memory for tensors this process produces")
    recv_pool_bytes: int = Field(256 * MiB, gt=0, description="registered memory consumers read into")
    lease_s: float = Field(60.0, gt=0, description="how long a producer keeps unread regions before freeing them")
    read_timeout_s: float = Field(30.0, gt=0, description="longest a READ may take before it is abandoned")
    lease_margin_s: float = Field(
        0.5, ge=0, description="a consumer refuses to start a READ this close to a lease's expiry"
    )
    poll_interval_s: float = Field(0.005, gt=0, description="how often the producer polls for release notifications")
    backend: str = "UCX"


class VLLMConfig(BaseModel):
    """Settings of the ``vllm`` engine's stage workers; the defaults run the demo on a CPU or a GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str | None = Field(None, description="model dtype (default: float32 on CPU, the checkpoint's on GPU)")
    max_model_len: int | None = Field(None, gt=0, description="context window (default: the model's)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache memory per engine, GiB")
    enforce_eager: bool | None = Field(None, description="no compiled graphs (default: on CPU only)")
    cpu_bind: str = Field(
        "nobind", description="VLLM_CPU_OMP_THREADS_BIND: 'nobind' shares the cores among workers, 'auto' or "
        "core lists such as '0-3' pin the engine's threads"
    )
    nixl_port: int | None = Field(None, gt=0, description="NixlConnector side-channel port (one per KV worker)")
    nixl_threads: int = Field(1, ge=1, description="NIXL progress threads of the NixlConnector")
    log_level: str = Field("WARNING", description="VLLM_LOGGING_LEVEL of the engines")
