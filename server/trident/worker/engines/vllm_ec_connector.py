"""vLLM's encoder outputs out of an encode-only engine and into its consumers: Trident's EC connector (vLLM's
``ECConnectorBase``).

The vllm engine's ``encode`` stage runs an encode-only vLLM engine (``ec_role="ec_producer"``: vLLM's own vision
and audio encoders, no language model, no KV cache; :mod:`trident.worker.engines.vllm_encoder`). vLLM keeps each item's
encoder output in its model runner's encoder cache, keyed by the item's identifier (the ``multi_modal_uuids``
the worker gives: its embedding cache keys). When a request finishes, this connector hands the outputs of its
items back to the worker in the request's ``ec_transfer_params``, where they go into the worker's embedding cache
and out to the next stage as today's sealed records over Trident's NIXL layer.

The scheduler-side and worker-side connectors are two objects in the one engine-core process (the workers run the
engine's model in its engine core: vLLM's ``UniProcExecutor``), so the worker side shares the model runner's
encoder cache with the scheduler side through :data:`_RUNNER_CACHES`. ``request_finished`` runs after the step
that encoded the request's items and before vLLM frees them (the next step), so every item is still there,
whether this request encoded it or vLLM's encoder cache already held it.

In a consumer engine (``ec_role="ec_consumer"``: the vllm engine's ``prefill`` and ``prefill_decode``), the worker has
READ a request's embeddings from the encode stage's record and gives them to vLLM in the request's
``ec_transfer_params`` (:func:`trident.worker.engines.vllm_media.outputs_param`), with stand-ins of its media in the prompt.
The scheduler side takes them in when it first sees the request (``ensure_cache_available``) and says it has every
item they cover (``has_cache_item``), so vLLM runs no encoder for them; the worker side puts the items vLLM
allocates into the model runner's encoder cache (``start_load_caches``). An item held for several requests at once
is held once; a request whose items are not all there fails alone, before any compute.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from vllm.logger import init_logger

logger = init_logger(__name__)

PARAMS_KEY = "trident_embeddings"  # ec_transfer_params[PARAMS_KEY]: [[identifier, dtype, shape, bytes], ...]
MISSING_KEY = "trident_missing"  # identifiers of items whose output was not in the encoder cache

_RUNNER_CACHES: dict[str, dict[str, torch.Tensor]] = {}  # engine id -> the model runner's encoder cache


_INBOX: dict[str, list] = {}  # consumer: item id -> [its embedding rows, the requests holding it]


class _NoMetadata(ECConnectorMetadata):
    """Nothing passes from the scheduler side to the worker side: the outputs go out in ``request_finished``."""


class _Loads(ECConnectorMetadata):
    """The item ids whose rows the worker side puts into the encoder cache this step."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids


class TridentECConnector(ECConnectorBase):
    """A producer's connector (each finished request's encoder outputs, as bytes, in its ``ec_transfer_params``) or
    a consumer's (each request's embeddings from its ``ec_transfer_params`` into the encoder cache)."""

    def __init__(self, vllm_config, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer == self.is_consumer:
            raise ValueError("TridentECConnector is an encode-only engine's (ec_producer) or a consumer's (ec_consumer)")
        self._engine = vllm_config.ec_transfer_config.engine_id
        self._held: dict[str, list[str] | None] = {}  # consumer: request id -> item ids it holds (None: it fails)
        self._unavailable: set[str] = set()  # consumer: requests to fail (an item it lacks)
        self._to_load: list[str] = []  # consumer: item ids vLLM allocated this step

    # -- worker side (the model runner) --------------------------------------------------------------------
    def start_save_caches(self, encoder_cache: dict | None = None, **kwargs: Any) -> None:
        if encoder_cache is not None:
            _RUNNER_CACHES[self._engine] = encoder_cache

    def save_caches(self, encoder_cache, mm_hash, **kwargs) -> None:
        _RUNNER_CACHES[self._engine] = encoder_cache

    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        metadata = self._get_connector_metadata()
        for item_id in getattr(metadata, "ids", ()):
            if item_id not in encoder_cache and item_id in _INBOX:
                from vllm.platforms import current_platform

                encoder_cache[item_id] = _INBOX[item_id][0].to(current_platform.device_type)

    # -- scheduler side --------------------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        # a producer: the worker asks vLLM only for what its own embedding cache lacks
        return self.is_consumer and identifier in _INBOX

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        if not self.is_consumer:
            return True
        if request.request_id in self._held:
            return self._held[request.request_id] is not None
        if not request.ec_transfer_params:  # (a decode from a prefill's KV: the KV covers its media)
            self._held[request.request_id] = []
            return True
        try:
            rows = outputs_of(request.ec_transfer_params)
        except (RuntimeError, ValueError, TypeError) as e:
            rows = {}
            reason = str(e)
        else:
            reason = "no embeddings for its media item(s)"
        ids = {feature.identifier for feature in request.mm_features}
        if not ids <= rows.keys():
            logger.warning("request %s: %s", request.request_id, reason)
            self._unavailable.add(request.request_id)
            self._held[request.request_id] = None  # (failed by the scheduler at the end of this step)
            return False
        for item_id in ids:
            _INBOX.setdefault(item_id, [rows[item_id], 0])[1] += 1
        self._held[request.request_id] = sorted(ids)
        return True

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    def update_state_after_alloc(self, request, index: int) -> None:
        if self.is_consumer:
            self._to_load.append(request.mm_features[index].identifier)

    def build_connector_meta(self, scheduler_output) -> ECConnectorMetadata:
        if not self.is_consumer:
            return _NoMetadata()
        loads, self._to_load = _Loads(self._to_load), []
        return loads

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        if self.is_consumer:
            for item_id in self._held.pop(request.request_id, None) or ():
                entry = _INBOX.get(item_id)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del _INBOX[item_id]
            return False, None
        cache = _RUNNER_CACHES.get(self._engine, {})
        items, missing = [], []
        for feature in request.mm_features:
            output = cache.get(feature.identifier)
            if output is None:
                missing.append(feature.identifier)
                continue
            items.append(rows_param(feature.identifier, output))
        return False, {PARAMS_KEY: items, MISSING_KEY: missing}


def config(role: str, cpu: bool):
    """vLLM's ``ECTransferConfig`` of an engine that runs this connector in ``role`` (ec_producer, ec_consumer)."""
    from vllm.config import ECTransferConfig

    return ECTransferConfig(ec_connector="TridentECConnector", ec_connector_module_path=__name__, ec_role=role,
                            ec_buffer_device="cpu" if cpu else "cuda")


def rows_param(identifier: str, rows: torch.Tensor) -> list:
    """One item's embedding rows as ``ec_transfer_params`` carry them: [identifier, dtype, shape, bytes]."""
    rows = rows.detach().to("cpu").contiguous()
    return [identifier, str(rows.dtype).removeprefix("torch."), list(rows.shape), rows.view(torch.uint8).numpy().tobytes()]


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
