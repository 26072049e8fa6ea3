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
