"""The vllm engine's ``encode`` stage: vLLM's own encoders, in an encode-only vLLM engine.

The engine (``ECTransferConfig(ec_role="ec_producer")``) runs the model's vision and audio encoders and no language
model or KV cache. Each encode call is one vLLM request whose prompt is the items' placeholders, with the items'
embedding cache keys as their ``multi_modal_uuids``; :class:`~trident.worker.engines.vllm_ec_connector.TridentECConnector`
hands the encoder outputs back to this worker when the request finishes. From there the stage is the hf engine's:
the outputs go into this worker's embedding cache (the one cache: vLLM is asked only for what it lacks), and the
next stage READs them over Trident's NIXL layer from a sealed record (:class:`~trident.worker.engines.encode_stage.EncodeStage`),
which also carries each item's stand-in (its shape: :mod:`trident.worker.engines.vllm_media`), what the consumer's vLLM
engine needs to place them.
No transformers model is built here: each item's embedding count is the placeholder range vLLM's own processing
gives it (:func:`~trident.worker.engines.vllm_media.render`), checked against the encoder's outputs.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from trident.core import tracing
from trident.core.config import TransferConfig, VLLMConfig
from trident.core.media import MediaItem
from trident.core.processor import Processor
from trident.core.protocol import StageSpec
from trident.core.transfer import TransferEndpoint
from trident.worker.engines.base import Encoded
from trident.worker.engines.embedding_cache import CachedEmbedding, EmbeddingCache, settings_digest
from trident.worker.engines.encode_stage import EncodeStage
from trident.worker.engines.vllm import _environment, _executor, engine_device, engine_dtype, start_engine
from trident.worker.engines.vllm_media import decode_media, render, stand_ins_of
from trident.worker.engines import vllm_ec_connector
from trident.worker.engines.vllm_ec_connector import outputs_of

log = logging.getLogger("trident.vllm")


class VLLMEncodeEngine:
    """The encode stage's :class:`~trident.worker.engines.base.StageEngine` on the vllm engine."""

    calls_at_once = 1
    kv_claims = None

    def __init__(
        self, spec: StageSpec, model_path: str, config: VLLMConfig, transfer: TransferConfig | None,
        threads: int = 1, embedding_cache_bytes: int = 0, dtype: str = "auto",
    ) -> None:
        _environment(config, threads)  # (before vLLM's import: its logging level is read then)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        if spec.roles != ("encode",):
            raise ValueError(f"VLLMEncodeEngine serves the encode stage, not {spec.name!r}")
        self.processor = Processor(model_path)
        cpu = current_platform.is_cpu()
        max_len = min(config.max_model_len or self.processor.max_model_len, self.processor.max_model_len)
        args = AsyncEngineArgs(
            model=model_path,
            dtype=engine_dtype(dtype, cpu),
            max_model_len=max_len,
            enforce_eager=config.enforce_eager if config.enforce_eager is not None else cpu,
            kv_cache_memory_bytes=1 << 26,  # (an encode-only engine allocates no KV cache; this skips the memory probe)
            ec_transfer_config=vllm_ec_connector.config("ec_producer", cpu),
            use_tqdm_on_load=False,
            seed=0,
            **_executor(cpu),
        )
        log.info("starting an encode-only vLLM engine for %s", spec.name)
        self.llm = start_engine(args, cpu)
        self.endpoint = TransferEndpoint(  # (after the fork)
            transfer, extra_send_bytes=embedding_cache_bytes, device=engine_device(cpu))
        self.cache = EmbeddingCache(self.endpoint.sender.pool, embedding_cache_bytes, settings_digest(model_path))
        self.encode_stage = EncodeStage(
            self.processor, self.cache, self.endpoint, lambda claimed: asyncio.ensure_future(self._encode(claimed))
        )

    async def encode(self, media: list[MediaItem], private: bool = False) -> Encoded:
        return await self.encode_stage.encode(media, private)

    async def _encode(self, claimed: list[tuple[str, MediaItem]]) -> list[CachedEmbedding]:
        """One vLLM request over the claimed items; their outputs into the cache, in order."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        keys = [key for key, _ in claimed]
        items = [item for _, item in claimed]
        mm, kinds, _ = await asyncio.to_thread(decode_media, self.processor, items)
        stand_ins = stand_ins_of(mm, kinds)
        order = [i for kind in dict.fromkeys(kinds) for i, item in enumerate(items) if item.kind == kind]  # vLLM's: by kind
        placeholders = "".join(self.processor.family.placeholders[items[i].kind].text for i in order)
        ordered_kinds = [kinds[i] for i in order]
        rendered = await render(self.llm, self.processor, placeholders, mm, ordered_kinds, [keys[i] for i in order])
        counts = [0] * len(items)
        for i, count in zip(order, rendered.token_counts):
            counts[i] = count
        params = VSamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        with tracing.step("vllm_encoder"):
            async for final in self.llm.generate(rendered.engine_input, params, request_id=uuid.uuid4().hex):
                pass
        outputs = outputs_of(final.ec_transfer_params if final is not None else None)
        entries = []
        try:
            with tracing.step("publish"):  # the copy into the send pool
                for key, count, stand_in in zip(keys, counts, stand_ins):
                    rows = outputs.get(key)
                    if rows is None or rows.dim() != 2 or rows.shape[0] != count:
                        raise RuntimeError(f"vLLM's encoder gave {None if rows is None else tuple(rows.shape)} for an "
                                           f"item of {count} embeddings")
                    entries.append(self.cache.store(key, rows, None, 0.0, stand_in))
        except BaseException:
            for entry in entries:
                self.cache.release(entry)
            raise
        self.cache.counters.vision_runs += 1
        self.cache.counters.images_encoded += len(items)
        return entries

    async def prefill(self, *args, **kwargs) -> bytes:
        raise NotImplementedError("the encode stage does not prefill")

    async def generate(self, *args, **kwargs):
        raise NotImplementedError("the encode stage does not generate")

    def discard(self, record: bytes) -> None:
        return None  # (the encode stage takes no record)

    def stats(self) -> dict:
        out = dict(self.endpoint.stats())
        out.update(self.cache.stats())
        out["encoder"] = "vllm"
        return out

    def close(self) -> None:
        self.llm.shutdown()
        self.endpoint.close()
