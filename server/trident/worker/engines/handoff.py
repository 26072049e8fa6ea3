"""Hand-offs between stages, for every engine: publish and receive embeddings and KV caches.

A producer copies tensors into its registered send pool and returns the record that crosses Triton
(:mod:`trident.core.protocol`); a consumer checks the record against its request, READs the tensors into its
receive pool over NIXL (:mod:`trident.core.transfer`) and frees them when done. The ``hf`` engine hands on
embeddings and KV this way; the ``vllm`` engine hands on embeddings this way and KV through vLLM's own
NixlConnector.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from typing import Callable

import torch

from trident.core import tracing
from trident.core.errors import MalformedRecord, TransferError, TridentError
from trident.core.output import RequestOutput, TokenLogprob
from trident.core.processor import Processor, SamplingParams
from trident.core.protocol import EmbeddingsRecord, HFKVRecord, TensorSpec, Transfer, decode_record
from trident.core.stagecall import StageClient
from trident.core.transfer import TransferEndpoint, TransferSender
from trident.worker.engines.base import DecodeRequest, Fork, MediaEmbeddings, PrefillResult
from trident.worker.engines.embedding_cache import CachedEmbedding, EmbeddingCache

log = logging.getLogger(__name__)


def prepare_prompt(
    processor: Processor, text: str, token_counts: list[int], kinds: list[str] | None = None, media=None
) -> list[int]:
    """Prompt ids with each media placeholder expanded (``media``: the items' grids, seconds and frames, see
    :meth:`Processor.prompt_ids`); checks placeholders and the context window."""
    with tracing.step("tokenize"):
        prompt = processor.prompt_ids(text, token_counts, kinds, media)
    processor.check_length(len(prompt))
    return prompt


# -- embeddings -------------------------------------------------------------------------------------
def publish_cached_embeddings(
    sender: TransferSender, cache: EmbeddingCache, entries: list[CachedEmbedding], item_ids: list[str],
    kinds: list[str] | None = None,
) -> EmbeddingsRecord:
    """A record over cached entries (one reference held per entry, given up when the lease ends): the
    consumer READs the regions back to back as one ``(sum(rows), hidden)`` tensor."""
    first = entries[0]
    spec = TensorSpec(first.dtype, (sum(e.shape[0] for e in entries), first.shape[1]))
    if any(e.dtype != first.dtype or e.shape[1] != first.shape[1] for e in entries):
        raise TridentError("cached embeddings of one request differ in dtype or width")

    def release() -> None:
        for entry in entries:
            cache.release(entry)

    return EmbeddingsRecord(
        transfer=sender.lease([e.region for e in entries], [spec], release),
        token_counts=[e.shape[0] for e in entries],
        grid_thw=[list(e.grid) for e in entries] if first.grid is not None else None,
        image_ids=list(item_ids),
        kinds=kinds if kinds and set(kinds) != {"image"} else None,
        seconds=[e.seconds for e in entries] if any(e.seconds for e in entries) else None,
        frames=[e.frames for e in entries] if any(e.frames for e in entries) else None,
        stand_ins=[e.stand_in for e in entries] if all(e.stand_in is not None for e in entries) else None,
        digests=[e.digest for e in entries] if all(e.digest is not None for e in entries) else None,
    )


def receive_embeddings(
    endpoint: TransferEndpoint, processor: Processor, text: str, data: bytes | EmbeddingsRecord
) -> tuple[list[int], MediaEmbeddings, EmbeddingsRecord, Callable[[], None]]:
    """Check the prompt against an ``embedding_meta``, then READ the embeddings.

    Returns the prompt ids, the embeddings (views into the receive pool), the record and the function that
    frees the embeddings. A prompt that does not match is refused before the READ, and the producer is told
    to free its copy.
    """
    with tracing.step("record_decode"):
        record = data if isinstance(data, EmbeddingsRecord) else decode_record(data, EmbeddingsRecord)
    try:
        width = processor.family.embedding_width(processor.config)
        if record.transfer.tensors[0].shape[1] != width:
            raise MalformedRecord(f"embeddings record rows are {record.transfer.tensors[0].shape[1]} wide; this "
                                  f"model's are {width}")
        prompt = prepare_prompt(processor, text, record.token_counts, record.kinds, record)
    except Exception:
        endpoint.discard(record.transfer)
        raise
    emb, release = read_embeddings(endpoint, record)
    return prompt, emb, record, release


async def take(producers: StageClient, transfer: Transfer) -> None:
    """Claim ``transfer``'s lease at the worker that produced it (its stage socket, named in the record) before
    anything is read or sent on its account: of every consumer holding the record, the first to claim it alone reads
    it; the others are refused (:class:`~trident.core.errors.ReplayedRecord`), and send nothing. A record from a
    producer with no stage socket (``claim_at`` empty: in-process tests) is claimed by its lease's stamp alone."""
    if transfer.claim_at:
        with tracing.step("claim"):
            await producers.claim(transfer.claim_at, transfer.lease_id, lease=True)


def read_embeddings(endpoint: TransferEndpoint, record: EmbeddingsRecord) -> tuple[MediaEmbeddings, Callable[[], None]]:
    """READ a record's embeddings (views into the receive pool) and the function that frees them."""
    with tracing.step("nixl_read"):
        received = endpoint.fetch(record.transfer)
    try:
        _check_digests(received.tensors[0], record)
    except BaseException:
        received.release()
        raise
    emb = MediaEmbeddings(received.tensors[0], list(record.token_counts), record.grid_thw, record.kinds, record.seconds,
                          record.frames)
    return emb, received.release


def _check_digests(rows: torch.Tensor, record: EmbeddingsRecord) -> None:
    """Each item's rows as read against the record's digest of them: a change on the way (the tensors cross the data
    network unsealed) is refused. Rows read into a GPU are not hashed (their bytes would have to be copied out)."""
    if record.digests is None or rows.device.type != "cpu":
        return
    flat = rows.reshape(-1).view(torch.uint8)
    per_row = flat.numel() // rows.shape[0]
    start = 0
    with tracing.step("digest"):
        for i, (count, digest) in enumerate(zip(record.token_counts, record.digests)):
            if hashlib.sha256(flat[start:start + count * per_row].numpy()).digest() != digest:
                raise TransferError(f"the embeddings of item {i} read from {record.transfer.agent} do not match their "
                                    "record's digest: they were changed on the way")
            start += count * per_row


# -- KV cache -------------------------------------------------------------------------------------------
def publish_kv(endpoint: TransferEndpoint, result: PrefillResult, first_text: str | None = None) -> HFKVRecord:
    """A prefill's KV cache in the send pool (leased where it was computed, else copied there); its record
    (``first_text``: see :class:`HFKVRecord`). Raising, it leaves ``result.kv_region`` to the caller."""
    tensors = [t for kv in result.kv for t in kv]
    if result.kv_region is not None:
        transfer = endpoint.sender.publish_in_place(result.kv_region, tensors)
        result.kv_region = None  # the lease's now: freed when it ends
    else:
        transfer = endpoint.publish(tensors)
    return HFKVRecord(
        transfer=transfer, prompt_len=result.prompt_len,
        first_token=result.first_token, rope_delta=result.rope_delta, seed=result.seed, first_text=first_text,
        first_logprobs=_entries(result.first_logprobs),
        forks=[(f.first_token, _entries(f.first_logprobs)) for f in result.forks] or None,
    )


def _entries(logprobs: list[TokenLogprob] | None) -> list[tuple[int, float, int]] | None:
    return None if logprobs is None else [(c.token_id, c.logprob, c.rank) for c in logprobs]


def _candidates(entries: list[tuple[int, float, int]] | None) -> list[TokenLogprob] | None:
    return None if entries is None else [TokenLogprob(*e) for e in entries]


def record_firsts(record: HFKVRecord) -> list[Fork]:
    """Each choice's first token a record carries, with its logprob entry (None where the request asked for none);
    without their structured output's state (the decode side makes it)."""
    return [Fork(record.first_token, _candidates(record.first_logprobs)),
            *(Fork(token, _candidates(entries)) for token, entries in record.forks or ())]


def fork(base: DecodeRequest, choices: list[tuple[int, Fork, RequestOutput]]) -> list[DecodeRequest]:
    """One decode request per open choice ``(index, its first token, its output)``, all continuing ``base``'s KV
    cache, read once: choice i samples with ``base.seed + i`` from its own first token. The KV is freed
    (``base.on_admit``) once the last of them has been copied into the batch."""
    release, left, lock = base.on_admit, [len(choices)], threading.Lock()

    def admitted() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and release is not None:
            release()

    return [dataclasses.replace(base, first_token=f.first_token, seed=base.seed + i, first_logprobs=f.first_logprobs,
                                constraint=f.constraint, output=output, on_admit=admitted)
            for i, f, output in choices]


def open_kv(
    endpoint: TransferEndpoint, data: bytes, check: Callable[[HFKVRecord], None] | None = None
) -> HFKVRecord:
    """Decode and check a ``kv_meta``, and claim it for this consumer, before anything is read or sent on
    its account. ``check`` (the model's) refuses a record this decoder cannot continue; a refused record is
    discarded (its producer frees it now). Then :func:`receive_kv` READs it, or :func:`release_kv` lets it go."""
    with tracing.step("record_decode"):
        record = decode_record(data, HFKVRecord)
        try:
            if check is not None:
                check(record)
        except Exception:
            endpoint.discard(record.transfer)
            raise
        endpoint.claim(record.transfer)
    return record


def receive_kv(endpoint: TransferEndpoint, record: HFKVRecord, params: SamplingParams) -> DecodeRequest:
    """READ the KV cache of a record :func:`open_kv` claimed, as the request :func:`fork` makes each choice's of;
    the pool region is freed once the decoder has copied it."""
    with tracing.step("nixl_read"):
        received = endpoint.fetch(record.transfer, claimed=True)  # decode_record checked the (k, v) pairs and sizes
    t = received.tensors
    return DecodeRequest(
        kv=list(zip(t[0::2], t[1::2])), first_token=record.first_token, prompt_len=record.prompt_len,
        params=params, rope_delta=record.rope_delta, seed=record.seed, on_admit=received.release,
    )


def release_kv(endpoint: TransferEndpoint, record: HFKVRecord) -> None:
    """A claimed record that will not be read (the request ended at its first token, or went away): its
    producer frees it now (best effort; otherwise at the lease's end)."""
    try:
        endpoint.discard(record.transfer, claimed=True)
    except TridentError as e:
        log.info("could not release an unread record: %s", e)


def continue_locally(result: PrefillResult, params: SamplingParams) -> DecodeRequest:
    """A prefill decoded in the process that ran it (no transfer), as the request :func:`fork` makes each choice's
    of."""
    return DecodeRequest(kv=result.kv, first_token=result.first_token, prompt_len=result.prompt_len, params=params,
                         rope_delta=result.rope_delta, seed=result.seed)


def discard(endpoint: TransferEndpoint | None, data: bytes) -> None:
    """Tell the producer of a record that will not be read to free its regions now rather than at expiry.
    Best effort: a record that cannot be decoded or a producer that is gone is left to its lease."""
    record = None
    try:
        record = decode_record(data, (EmbeddingsRecord, HFKVRecord))
        if endpoint is not None:
            endpoint.discard(record.transfer)
    except TridentError as e:
        if record is not None:
            log.info("could not release an unread record: %s", e)
