"""The data path of each stage, independent of Triton: an engine role plus the transfer layer.

- :func:`encode_stage`: images -> embeddings in the send pool -> ``embedding_meta`` record
- :func:`prefill_stage`: prompt + ``embedding_meta`` (READ, then released) -> KV in the send pool -> ``kv_meta``
- :func:`decode_stage`: ``kv_meta`` (READ; released once the decoder has copied it into its batch) -> events

The stage workers bind these to Triton tensors; tests call them directly in separate processes.
"""

from __future__ import annotations

from typing import Any

from .engines.base import DecodeRequest, Decoder, Encoder, ImageEmbeddings, Prefiller
from .engines.hf import new_seed
from .errors import MalformedRecord
from .processor import Processor, SamplingParams
from .protocol import TransferRecord
from .transfer import TransferEndpoint

EMBEDDINGS = "embeddings"
KV = "kv"


def encode_stage(encoder: Encoder, endpoint: TransferEndpoint, images: list) -> TransferRecord:
    """Encode a request's images and publish the embeddings."""
    emb = encoder.encode(images)
    extra: dict[str, Any] = {"token_counts": emb.token_counts}
    if emb.grid_thw is not None:
        extra["grid_thw"] = emb.grid_thw
    return endpoint.publish([emb.embeddings], layout=EMBEDDINGS, extra=extra)


def _expect(record: TransferRecord, layout: str, keys: tuple[str, ...]) -> None:
    if record.layout != layout:
        raise MalformedRecord(f"expected a {layout!r} record, got {record.layout!r}")
    missing = [k for k in keys if k not in record.extra]
    if missing:
        raise MalformedRecord(f"{layout} record lacks {', '.join(missing)}")


def prefill_stage(
    processor: Processor,
    prefiller: Prefiller,
    endpoint: TransferEndpoint,
    text: str,
    embedding_meta: TransferRecord | bytes | None,
    params: SamplingParams,
) -> TransferRecord:
    """Prefill a prompt (with the images an ``embedding_meta`` points to) and publish its KV cache."""
    images: ImageEmbeddings | None = None
    received = None
    if embedding_meta is not None:
        record = embedding_meta if isinstance(embedding_meta, TransferRecord) else TransferRecord.decode(embedding_meta)
        _expect(record, EMBEDDINGS, ("token_counts",))
        counts = list(record.extra["token_counts"])
        try:
            prompt = processor.prompt_ids(text, counts)
            processor.check_length(len(prompt))
        except Exception:
            endpoint.discard(record)  # a bad prompt must not hold the encoder's memory until the lease ends
            raise
        received = endpoint.fetch(record)
        images = ImageEmbeddings(received.tensors[0], counts, record.extra.get("grid_thw"))
    else:
        prompt = processor.prompt_ids(text, [])
    try:
        seed = new_seed(params)
        result = prefiller.prefill(prompt, images, params, seed)
    finally:
        if received is not None:
            received.release()
    tensors = [t for kv in result.kv for t in kv]
    extra = {
        "prompt_len": result.prompt_len,
        "first_token": result.first_token,
        "rope_delta": result.rope_delta,
        "seed": result.seed,
    }
    return endpoint.publish(tensors, layout=KV, extra=extra)


def decode_stage(
    decoder: Decoder, endpoint: TransferEndpoint, kv_meta: TransferRecord | bytes, params: SamplingParams,
    request_id: str = "",
):
    """READ a prefilled request's KV cache and start decoding it; returns the decoder's event stream."""
    record = kv_meta if isinstance(kv_meta, TransferRecord) else TransferRecord.decode(kv_meta)
    _expect(record, KV, ("prompt_len", "first_token", "rope_delta", "seed"))
    if any(spec.count % 2 for spec in record.tensors):
        raise MalformedRecord("kv record must hold (k, v) pairs")
    received = endpoint.fetch(record)
    t = received.tensors
    extra = record.extra
    request = DecodeRequest(
        kv=list(zip(t[0::2], t[1::2])),
        first_token=int(extra["first_token"]),
        prompt_len=int(extra["prompt_len"]),
        params=params,
        rope_delta=int(extra["rope_delta"]),
        seed=int(extra["seed"]),
        request_id=request_id,
        on_admit=received.release,
    )
    return decoder.submit(request)
