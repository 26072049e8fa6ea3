"""The hf engine as a stage engine: the roles a stage needs, joined by the hand-offs, on one compute thread.

:class:`HFStageEngine` is what a stage worker serves with ``--backend hf`` (and the encode stage with any
backend). Each stage operation is one function here:

- :meth:`HFStageEngine.encode`: images -> embeddings -> ``embedding_meta``
- :meth:`HFStageEngine.prefill`: prompt + images or ``embedding_meta`` -> KV cache + first token -> ``kv_meta``
- :meth:`HFStageEngine.generate`: ``kv_meta``, or a local prefill, -> the decoder's token stream
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ...config import TransferConfig
from ...media import image_digest
from ...output import Generation
from ...processor import SamplingParams
from ...protocol import StageSpec
from ...transfer import TransferEndpoint
from .. import handoff
from ..base import PrefillResult
from .sampling import new_seed


class HFStageEngine:
    """The ``hf`` engine behind :class:`~trident.engines.base.StageEngine` for one stage: its roles, this
    process's transfer endpoint (when the stage hands on or takes a record), and one compute thread for
    blocking work (encode, prefill, READs)."""

    def __init__(self, spec: StageSpec, model_path: str, transfer: TransferConfig | None = None) -> None:
        from .decoder import HFDecoder
        from .model import HFEncoder, HFModel, HFPrefiller

        self.spec = spec
        self.model = HFModel(model_path)
        self.processor = self.model.processor
        moves_records = spec.takes is not None or spec.hands_on != "tokens"
        self.endpoint = TransferEndpoint(transfer) if moves_records else None
        self.encoder = HFEncoder(self.model) if "encode" in spec.roles else None
        self.prefiller = HFPrefiller(self.model) if "prefill" in spec.roles else None
        self.decoder = HFDecoder(self.model) if "decode" in spec.roles else None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trident-compute")

    async def _run(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # -- stage operations ----------------------------------------------------------------------------------
    async def encode(self, images: list) -> bytes:
        return (await self._run(self._encode, images)).encode()

    def _encode(self, images: list):
        return handoff.publish_embeddings(self.endpoint, self.encoder.encode(images), [image_digest(i) for i in images])

    async def prefill(
        self, text: str, params: SamplingParams, *, images: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        result = await self._run(self._prefill, text, params, list(images), embedding_meta)
        return handoff.publish_kv(self.endpoint, result).encode()

    def _prefill(self, text: str, params: SamplingParams, images: list, embedding_meta: bytes | None) -> PrefillResult:
        """Encode the raw ``images`` here, or READ the embeddings of ``embedding_meta``, then prefill."""
        seed = new_seed(params)
        if images:
            self.processor.check_placeholders(text, len(images))  # before spending time on the vision tower
            emb = self.encoder.encode(images)
            prompt = handoff.prepare_prompt(self.processor, text, emb.token_counts)
            return self.prefiller.prefill(prompt, emb, params, seed)
        if embedding_meta is None:
            return self.prefiller.prefill(handoff.prepare_prompt(self.processor, text, []), None, params, seed)
        prompt, emb, _, release = handoff.receive_embeddings(self.endpoint, self.processor, text, embedding_meta)
        try:
            return self.prefiller.prefill(prompt, emb, params, seed)
        finally:
            release()

    async def generate(
        self, text: str | None, params: SamplingParams, *, images: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        if kv_meta is not None:
            request = await self._run(handoff.receive_kv, self.endpoint, kv_meta, params)
        else:
            result = await self._run(self._prefill, text, params, list(images), embedding_meta)
            request = handoff.continue_locally(result, params)
        stream = self.decoder.submit(request, asyncio.get_running_loop())

        async def events():
            try:
                async for event in stream:
                    yield event
            finally:
                stream.cancel()  # no-op once finished; stops a request whose client went away

        return Generation(request.prompt_len, events())

    def discard(self, record: bytes) -> None:
        """A record this stage will not read: tell its producer to free it now (best effort)."""
        handoff.discard(self.endpoint, record)

    def stats(self) -> dict:
        out: dict = dict(self.endpoint.stats()) if self.endpoint is not None else {}
        if self.decoder is not None:
            out["decode_active"] = self.decoder.active
        return out

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
        if self.endpoint is not None:
            self.endpoint.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
