"""Engines: everything engine-specific, behind :class:`~trident.worker.engines.base.StageEngine`.

:func:`build_engine` is the one place that chooses an engine for a stage. An engine derives the roles and
transfers a stage needs from its :class:`~trident.core.protocol.StageSpec` (``roles``, ``takes``, ``hands_on``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trident.core.config import WorkerSettings
    from trident.worker.engines.base import StageEngine


def build_engine(settings: "WorkerSettings") -> "StageEngine":
    """The stage engine a worker serves: ``settings.backend``'s for its stage (the vllm backend's encode stage is
    an encode-only vLLM engine)."""
    from trident.core.protocol import STAGES
    from trident.core.transfer import data_plane

    data_plane.bind(settings.transfer.data_address)  # before any NIXL agent or vLLM engine listens
    spec = STAGES[settings.stage]
    if settings.backend == "vllm":
        if spec.roles == ("encode",):
            from trident.worker.engines.vllm_encoder import VLLMEncodeEngine

            return VLLMEncodeEngine(spec, settings.model, settings.vllm, settings.transfer, settings.threads,
                                    settings.embedding_cache_bytes, settings.dtype)
        from trident.worker.engines.vllm import VLLMStageEngine

        return VLLMStageEngine(spec, settings.model, settings.vllm, settings.transfer, settings.threads, settings.dtype)
    from trident.worker.engines.hf.stage import HFStageEngine

    return HFStageEngine(spec, settings.model, settings.transfer, settings.embedding_cache_bytes, settings.device,
                         settings.dtype)
