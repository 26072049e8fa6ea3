"""vLLM's encoder outputs out of an encode-only engine: Trident's EC connector (vLLM's ``ECConnectorBase``).

The vllm engine's ``encode`` stage runs an encode-only vLLM engine (``ec_role="ec_producer"``: vLLM's own vision
and audio encoders, no language model, no KV cache; :mod:`trident.engines.vllm_encoder`). vLLM keeps each item's
encoder output in its model runner's encoder cache, keyed by the item's identifier (the ``multi_modal_uuids``
the worker gives: its embedding cache keys). When a request finishes, this connector hands the outputs of its
items back to the worker in the request's ``ec_transfer_params``, where they go into the worker's embedding cache
and out to the next stage as today's sealed records over Trident's NIXL layer.

The scheduler-side and worker-side connectors are two objects in the one engine-core process (the workers run the
engine's model in its engine core: vLLM's ``UniProcExecutor``), so the worker side shares the model runner's
encoder cache with the scheduler side through :data:`_RUNNER_CACHES`. ``request_finished`` runs after the step
that encoded the request's items and before vLLM frees them (the next step), so every item is still there,
whether this request encoded it or vLLM's encoder cache already held it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

PARAMS_KEY = "trident_embeddings"  # ec_transfer_params[PARAMS_KEY]: [[identifier, dtype, shape, bytes], ...]
MISSING_KEY = "trident_missing"  # identifiers of items whose output was not in the encoder cache

_RUNNER_CACHES: dict[str, dict[str, torch.Tensor]] = {}  # engine id -> the model runner's encoder cache


class _NoMetadata(ECConnectorMetadata):
    """Nothing passes from the scheduler side to the worker side: the outputs go out in ``request_finished``."""


class TridentECConnector(ECConnectorBase):
    """A producer's connector: each finished request's encoder outputs, as bytes, in its ``ec_transfer_params``."""

    def __init__(self, vllm_config, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if not self.is_producer or self.is_consumer:
            raise ValueError("TridentECConnector runs in an encode-only engine (ec_role 'ec_producer')")
        self._engine = vllm_config.ec_transfer_config.engine_id

    # -- worker side (the model runner) --------------------------------------------------------------------
    def start_save_caches(self, encoder_cache: dict | None = None, **kwargs: Any) -> None:
        if encoder_cache is not None:
            _RUNNER_CACHES[self._engine] = encoder_cache

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        _RUNNER_CACHES[self._engine] = encoder_cache

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        return None

    # -- scheduler side --------------------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return False  # the worker asks vLLM only for what its own embedding cache lacks

    def update_state_after_alloc(self, request, index: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        cache = _RUNNER_CACHES.get(self._engine, {})
        items, missing = [], []
        for feature in request.mm_features:
            output = cache.get(feature.identifier)
            if output is None:
                missing.append(feature.identifier)
                continue
            output = output.detach().to("cpu").contiguous()
            items.append([feature.identifier, str(output.dtype).removeprefix("torch."), list(output.shape),
                          output.view(torch.uint8).numpy().tobytes()])
        return False, {PARAMS_KEY: items, MISSING_KEY: missing}


def outputs_of(params: dict | None) -> dict[str, torch.Tensor]:
    """The encoder outputs a finished request's ``ec_transfer_params`` carry, by identifier; a clear error for
    an item the engine had no output for."""
    if not params or PARAMS_KEY not in params:
        raise RuntimeError("the encode engine returned no encoder outputs (is TridentECConnector its EC connector?)")
    if params.get(MISSING_KEY):
        raise RuntimeError(f"the encode engine had no encoder output for {params[MISSING_KEY]}")
    out = {}
    for identifier, dtype, shape, data in params[PARAMS_KEY]:
        out[identifier] = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return out
