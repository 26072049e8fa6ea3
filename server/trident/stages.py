"""The data path of each stage, independent of Triton: engine roles joined by the transfer layer.

Building blocks (a stage worker chains the ones its stage model needs):

- :func:`publish_embeddings` / :func:`receive_embeddings`: image embeddings across processes
- :func:`prepare_prompt` + :func:`run_prefill`: prompt ids with placeholders expanded, KV cache + first token
- :func:`publish_kv` / :func:`receive_kv`: a prefilled request across processes

the three disaggregated stages built from them: :func:`encode_stage`, :func:`prefill_stage`,
:func:`decode_stage`; and :class:`HFStageEngine`, which serves them to the stage workers.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .config import TransferConfig
from .engines.base import (
    DecodeRequest, Decoder, Encoder, Generation, ImageEmbeddings, Prefiller, PrefillResult,
)
from .engines.hf import new_seed
from .errors import MalformedRecord
from .media import image_digest
from .processor import Processor, SamplingParams
from .protocol import TransferRecord
from .transfer import TransferEndpoint

EMBEDDINGS = "embeddings"
KV = "kv"


def _record(data: TransferRecord | bytes, layout: str, keys: tuple[str, ...]) -> TransferRecord:
    record = data if isinstance(data, TransferRecord) else TransferRecord.decode(data)
    if record.layout != layout:
        raise MalformedRecord(f"expected a {layout!r} record, got {record.layout!r}")
    missing = [k for k in keys if k not in record.extra]
    if missing:
        raise MalformedRecord(f"{layout} record lacks {', '.join(missing)}")
    return record


# -- embeddings -------------------------------------------------------------------------------------
def publish_embeddings(
    endpoint: TransferEndpoint, emb: ImageEmbeddings, image_ids: list[str] | None = None
) -> TransferRecord:
    extra: dict[str, Any] = {"token_counts": emb.token_counts}
    if image_ids is not None:
        extra["image_ids"] = image_ids  # content ids, for engines whose caches are keyed by image
    if emb.grid_thw is not None:
        extra["grid_thw"] = emb.grid_thw
    return endpoint.publish([emb.embeddings], layout=EMBEDDINGS, extra=extra)


def receive_embeddings(
    endpoint: TransferEndpoint, processor: Processor, text: str, data: TransferRecord | bytes
) -> tuple[list[int], ImageEmbeddings, Callable[[], None]]:
    """Check the prompt against an ``embedding_meta``, then READ the embeddings.

    Returns the prompt ids, the embeddings (views into the receive pool) and the function that frees them.
    A prompt that does not match is refused before the READ, and the producer is told to free its copy.
    """
    record = _record(data, EMBEDDINGS, ("token_counts",))
    counts = [int(c) for c in record.extra["token_counts"]]
    try:
        prompt = prepare_prompt(processor, text, counts)
    except Exception:
        endpoint.discard(record)
        raise
    received = endpoint.fetch(record)
    return prompt, ImageEmbeddings(received.tensors[0], counts, record.extra.get("grid_thw")), received.release


# -- prefill ------------------------------------------------------------------------------------------
def prepare_prompt(processor: Processor, text: str, image_token_counts: list[int]) -> list[int]:
    """Prompt ids with each image placeholder expanded; checks placeholders and the context window."""
    prompt = processor.prompt_ids(text, image_token_counts)
    processor.check_length(len(prompt))
    return prompt


def run_prefill(
    prefiller: Prefiller, prompt: list[int], images: ImageEmbeddings | None, params: SamplingParams
) -> PrefillResult:
    return prefiller.prefill(prompt, images, params, new_seed(params))


def decode_request(result: PrefillResult, params: SamplingParams, request_id: str = "") -> DecodeRequest:
    """Continue a prefill in this process (no transfer)."""
    return DecodeRequest(
        kv=result.kv, first_token=result.first_token, prompt_len=result.prompt_len, params=params,
        rope_delta=result.rope_delta, seed=result.seed, request_id=request_id,
    )


# -- KV cache -------------------------------------------------------------------------------------------
def publish_kv(endpoint: TransferEndpoint, result: PrefillResult) -> TransferRecord:
    extra = {
        "prompt_len": result.prompt_len,
        "first_token": result.first_token,
        "rope_delta": result.rope_delta,
        "seed": result.seed,
    }
    return endpoint.publish([t for kv in result.kv for t in kv], layout=KV, extra=extra)


def receive_kv(
    endpoint: TransferEndpoint, data: TransferRecord | bytes, params: SamplingParams, request_id: str = ""
) -> DecodeRequest:
    """READ a prefilled request's KV cache; the pool region is freed once the decoder has copied it."""
    record = _record(data, KV, ("prompt_len", "first_token", "rope_delta", "seed"))
    if any(spec.count % 2 for spec in record.tensors):
        raise MalformedRecord("kv record must hold (k, v) pairs")
    received = endpoint.fetch(record)
    t, extra = received.tensors, record.extra
    return DecodeRequest(
        kv=list(zip(t[0::2], t[1::2])),
        first_token=int(extra["first_token"]),
        prompt_len=int(extra["prompt_len"]),
        params=params,
        rope_delta=int(extra["rope_delta"]),
        seed=int(extra["seed"]),
        request_id=request_id,
        on_admit=received.release,
    )


# -- the three disaggregated stages -----------------------------------------------------------------------
def encode_stage(encoder: Encoder, endpoint: TransferEndpoint, images: list) -> TransferRecord:
    """Encode a request's images and publish the embeddings."""
    return publish_embeddings(endpoint, encoder.encode(images), [image_digest(im) for im in images])


def prefill_stage(
    processor: Processor,
    prefiller: Prefiller,
    endpoint: TransferEndpoint,
    text: str,
    embedding_meta: TransferRecord | bytes | None,
    params: SamplingParams,
) -> TransferRecord:
    """Prefill a prompt (with the images an ``embedding_meta`` points to) and publish its KV cache."""
    if embedding_meta is None:
        return publish_kv(endpoint, run_prefill(prefiller, prepare_prompt(processor, text, []), None, params))
    prompt, images, release = receive_embeddings(endpoint, processor, text, embedding_meta)
    try:
        result = run_prefill(prefiller, prompt, images, params)
    finally:
        release()
    return publish_kv(endpoint, result)


def decode_stage(
    decoder: Decoder, endpoint: TransferEndpoint, kv_meta: TransferRecord | bytes, params: SamplingParams,
    request_id: str = "",
):
    """READ a prefilled request's KV cache and start decoding it; returns the decoder's event stream."""
    return decoder.submit(receive_kv(endpoint, kv_meta, params, request_id))


# -- the hf engine as a stage engine ---------------------------------------------------------------------
class HFStageEngine:
    """The ``hf`` engine behind :class:`~trident.engines.base.StageEngine`: the roles a stage needs, this
    process's transfer endpoint, and one compute thread for blocking work (encode, prefill, READs)."""

    def __init__(self, model_path: str, roles: tuple[str, ...], transfer: TransferConfig | None) -> None:
        from .engines.hf import HFDecoder, HFEncoder, HFModel, HFPrefiller

        self.model = HFModel(model_path)
        self.processor = self.model.processor
        self.endpoint = TransferEndpoint(transfer) if transfer is not None else None
        self.encoder = HFEncoder(self.model) if "encoder" in roles else None
        self.prefiller = HFPrefiller(self.model) if "prefiller" in roles else None
        self.decoder = HFDecoder(self.model) if "decoder" in roles else None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trident-compute")

    async def _run(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def encode(self, images: list) -> bytes:
        return (await self._run(encode_stage, self.encoder, self.endpoint, images)).encode()

    def _prefill(self, text: str, params: SamplingParams, images: list, embedding_meta: bytes | None):
        if images:
            self.processor.check_placeholders(text, len(images))  # before spending time on the vision tower
            emb = self.encoder.encode(images)
            return run_prefill(self.prefiller, prepare_prompt(self.processor, text, emb.token_counts), emb, params)
        if embedding_meta is None:
            return run_prefill(self.prefiller, prepare_prompt(self.processor, text, []), None, params)
        prompt, emb, release = receive_embeddings(self.endpoint, self.processor, text, embedding_meta)
        try:
            return run_prefill(self.prefiller, prompt, emb, params)
        finally:
            release()

    async def prefill(
        self, text: str, params: SamplingParams, *, images: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        result = await self._run(self._prefill, text, params, list(images), embedding_meta)
        return publish_kv(self.endpoint, result).encode()

    async def generate(
        self, text: str | None, params: SamplingParams, *, images: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        if kv_meta is not None:
            request = await self._run(receive_kv, self.endpoint, kv_meta, params)
        else:
            result = await self._run(self._prefill, text, params, list(images), embedding_meta)
            request = decode_request(result, params)
        stream = self.decoder.submit(request, asyncio.get_running_loop())

        async def events():
            try:
                async for event in stream:
                    yield event
            finally:
                stream.cancel()  # no-op once finished; stops a request whose client went away

        return Generation(request.prompt_len, events())

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
