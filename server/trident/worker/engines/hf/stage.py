"""The hf engine as a stage engine: the roles a stage needs, joined by the hand-offs, on one compute thread.

:class:`HFStageEngine` is what a stage worker serves with ``--backend hf`` (and the encode stage with any
backend). Each stage operation is one function here:

- :meth:`HFStageEngine.encode`: media -> embeddings (through the embedding cache) -> ``embedding_meta``
- :meth:`HFStageEngine.prefill`: prompt + media or ``embedding_meta`` -> KV cache + first token -> ``kv_meta``
- :meth:`HFStageEngine.generate`: ``kv_meta``, or a local prefill (also on the decode stage, for a short
  prompt a scheduler sends it), -> the decoder's token stream

The roles run on the checkpoint loaded with transformers, on the stage's device in its dtype (``device`` and
``dtype`` settings: float32 on a CPU, bfloat16 on a GPU by default): :class:`HFModel`, its :class:`HFEncoder` and
:class:`HFPrefiller` here (one request at a time), its batched decoder in :mod:`.decoder`; family differences
(vision call, multimodal inputs, positions) come from the family adapter. It is the correctness oracle: encode ->
prefill -> decode here reproduces ``model.generate()`` token for token under greedy sampling.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from trident.core import tracing
from trident.core.config import TransferConfig
from trident.core.device import resolve_device, resolve_dtype
from trident.core.errors import InvalidRequest, MalformedRecord
from trident.worker.heap import keep_freed_memory
from trident.core.media import MediaItem, counts
from trident.core.output import DecodeEvent, Generation, RequestOutput, early_text, interleave
from trident.core.processor import Processor, SamplingParams
from trident.core.protocol import EmbeddingsRecord, HFKVRecord, StageSpec, TensorSpec, decode_record
from trident.core.stagecall import StageClient
from trident.core.structured import Grammars
from trident.core.transfer import TransferEndpoint
from trident.core.transfer.tensors import dtype_name
from trident.worker.engines import handoff
from trident.worker.engines.base import DecodeRequest, Encoded, Fork, MediaEmbeddings, PrefillResult
from trident.worker.engines.embedding_cache import CachedEmbedding, EmbeddingCache, settings_digest
from trident.worker.engines.encode_stage import EncodeStage
from trident.worker.engines.hf.sampling import candidates, new_seed, sample


# -- the model and its roles ---------------------------------------------------------------------------------------
def load_model(model_path: str | Path, processor: Processor | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu"):
    """A checkpoint's transformers model in ``dtype`` on ``device`` with SDPA attention, in eval mode."""
    family = (processor or Processor(model_path)).family
    return family.load_model(model_path, dtype).to(device).eval()


class HFModel:
    """A loaded checkpoint: processor + model, shared by the roles one worker serves. ``dtype`` is what the model
    computes in, and so the dtype of every embedding and KV cache it hands on."""

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "auto") -> None:
        keep_freed_memory()  # every request makes and drops tensors of some MiB (see :mod:`trident.worker.heap`)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.processor = Processor(model_path)
        self.family = self.processor.family
        self.model = load_model(model_path, self.processor, self.dtype, self.device)
        text = self.model.config.text_config
        self.num_layers: int = text.num_hidden_layers
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # the window of the text model's sliding-window layers, where it has any (Gemma 3's): the decoder masks them
        self.sliding_window: int | None = (
            text.sliding_window if "sliding_attention" in (getattr(text, "layer_types", None) or ()) else None
        )
        self.vocab_size: int = self.model.get_output_embeddings().out_features
        self.lock = threading.Lock()  # prefill mutates model state (Qwen's rope_deltas)
        self.grammars = Grammars(self.processor.tokenizer, self.vocab_size, sorted(self.processor.eos_token_ids))

    def on_device(self, inputs: dict) -> dict:
        """A processor's tensors on the model's device, the floating ones in its dtype (pixels, audio features)."""
        out = {}
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor):
                # (pixels and features in the model's dtype; a 1-D float, such as seconds per grid, keeps its own)
                value = value.to(self.device, self.dtype if value.is_floating_point() and value.ndim > 1 else None)
            out[key] = value
        return out

    def kv_spec(self, prompt_len: int) -> TensorSpec:
        """A prompt's KV cache as it is handed on: ``2 * num_layers`` tensors (keys, values of each layer)."""
        return TensorSpec(dtype_name(self.dtype), (1, self.kv_heads, prompt_len, self.head_dim), 2 * self.num_layers)

    def check_kv(self, record: HFKVRecord) -> None:
        """A ``kv_meta`` must describe this model's KV cache of its prompt and a continuation it can run:
        refused before anything is read or allocated, so that one bad record fails only its own request."""
        max_len = self.processor.max_model_len
        if record.prompt_len >= max_len:
            raise MalformedRecord(f"kv record prompt_len {record.prompt_len} is not below the context window {max_len}")
        want = self.kv_spec(record.prompt_len)
        if record.transfer.tensors != (want,):
            got = ", ".join(f"{s.count} x {s.dtype}{list(s.shape)}" for s in record.transfer.tensors)
            raise MalformedRecord(
                f"kv record holds {got}; this model's KV cache of {record.prompt_len} tokens is "
                f"{want.count} x {want.dtype}{list(want.shape)}"
            )
        if not 0 <= record.first_token < self.vocab_size:
            raise MalformedRecord(f"kv record first_token {record.first_token} is outside the vocabulary ({self.vocab_size})")
        if not 0 <= record.prompt_len + record.rope_delta <= max_len:
            raise MalformedRecord(f"kv record rope_delta {record.rope_delta} puts positions outside 0..{max_len}")


class HFEncoder:
    """Decoded media -> projected embeddings: each kind's items of a request in one encoder batch."""

    def __init__(self, model: HFModel) -> None:
        self.m = model

    @torch.inference_mode()
    def encode(self, items: list) -> MediaEmbeddings:
        """``(kind, decoded item)`` pairs (a bare PIL image is an image) -> their embeddings, in order."""
        items = [item if isinstance(item, tuple) else ("image", item) for item in items]
        if not items:
            raise InvalidRequest("encode needs at least one image, video or audio clip")
        rows: list = [None] * len(items)
        grids: list = [None] * len(items)
        seconds: list[float] = [0.0] * len(items)
        for kind in dict.fromkeys(kind for kind, _ in items):
            where = [i for i, (k, _) in enumerate(items) if k == kind]
            with tracing.step(f"{kind}_preprocess"):
                inputs = self.m.on_device(self.m.processor.media_inputs(kind, [items[i][1] for i in where]))
            with tracing.step("vision_tower" if kind == "image" else f"{kind}_encoder"):
                features, grid = self.m.family.encode(self.m.model, kind, inputs)
            for j, i in enumerate(where):
                rows[i], grids[i] = features[j], (grid[j] if grid is not None else None)
                if "second_per_grid_ts" in inputs:
                    seconds[i] = float(inputs["second_per_grid_ts"][j])
        has_grids = any(g is not None for g in grids)
        frames = [len(item.frames) if kind == "video" else 0 for kind, item in items]
        return MediaEmbeddings(
            torch.cat(rows), [r.shape[0] for r in rows], [list(g) if g is not None else [] for g in grids] if has_grids else None,
            [kind for kind, _ in items], seconds if any(seconds) else None, frames if any(frames) and has_grids else None,
        )


class HFPrefiller:
    """Prompt ids + media embeddings -> the prompt's KV cache and the first sampled token."""

    def __init__(self, model: HFModel) -> None:
        self.m = model
        # whether transformers' cache for this model is plain full-attention layers, which can be computed in place
        layers = DynamicCache(config=model.model.config).layers
        self._full_attention = len(layers) == model.num_layers and all(type(x) is DynamicLayer for x in layers)

    @torch.inference_mode()
    def prefill(
        self, prompt_ids: list[int], media: MediaEmbeddings | None, params: SamplingParams, seed: int,
        kv_into: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> PrefillResult:
        """``kv_into``: per layer, the (k, v) tensors the prompt's KV cache is to be computed into (a region of
        the send pool, :meth:`HFModel.kv_spec`); the result's ``kv`` is them when the model wrote there (check with
        ``is``), else tensors of its own."""
        self.m.processor.check_length(len(prompt_ids))
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.m.device)
        kwargs: dict = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
        family, token_ids = self.m.family, self.m.processor.token_ids
        if media is not None and media.token_counts:
            for kind, (rows, _) in media.by_kind().items():
                expected = int((ids == token_ids[kind]).sum()) if kind in token_ids else 0
                if expected != sum(r.shape[0] for r in rows):
                    raise InvalidRequest(
                        f"the prompt has {expected} {kind} tokens but the embeddings cover {sum(r.shape[0] for r in rows)}"
                    )
        if kv_into is not None and self._full_attention and len(kv_into) == self.m.num_layers:
            kwargs["past_key_values"] = _cache_into(kv_into)
        elif self.m.sliding_window is not None:
            # every layer keeps the whole prompt (a sliding layer's own cache would keep its window only): the KV
            # handed on covers the prompt at every layer, and the sliding layers' masks still see their window
            kwargs["past_key_values"] = DynamicCache()
        with self.m.lock, tracing.step("prefill"):
            family.reset(self.m.model)
            if media is not None and media.token_counts:
                kwargs.update(family.prefill_inputs(self.m.model, ids, media, token_ids))
            out = self.m.model(**kwargs, logits_to_keep=1)
        rope_delta = family.rope_delta(out)
        cache = out.past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        # each choice's first token from the one prompt's logits (choice i samples with seed + i)
        firsts = [self._first(out.logits[0, -1], params, seed + i) for i in range(params.n)]
        first = firsts[0]
        return PrefillResult(kv=kv, first_token=first.first_token, prompt_len=len(prompt_ids), rope_delta=rope_delta,
                             seed=seed, first_logprobs=first.first_logprobs, constraint=first.constraint,
                             forks=firsts[1:])

    def _first(self, logits: torch.Tensor, params: SamplingParams, seed: int) -> Fork:
        """A choice's first token (within the request's structure, when it asks for one) and its logprob entry."""
        constraint = None
        if params.structured_outputs is not None:  # the first token keeps to the request's structure too
            constraint = self.m.grammars.constraint(params.structured_outputs)
            logits = constraint.mask(logits)
        token = sample(logits, params, seed, step=0)
        if constraint is not None:
            constraint.accept(token)
        logprobs = candidates(logits, token, params.logprobs) if params.logprobs is not None else None
        return Fork(token, logprobs, constraint)


class _IntoLayer(DynamicLayer):
    """A cache layer whose prefill writes its keys and values into given tensors (where transformers' own
    layer concatenates them into new ones: the same one copy, into memory the stage then hands on as it is);
    later updates grow it as usual."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self._into: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        into, self._into = self._into, None
        if self.is_initialized or into is None or into[0].shape != key_states.shape or into[1].shape != value_states.shape:
            return super().update(key_states, value_states, *args, **kwargs)
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = into[0].copy_(key_states), into[1].copy_(value_states)
        return self.keys, self.values


def _cache_into(kv_into: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """The cache transformers builds for a model of full-attention layers, with those layers writing into
    ``kv_into``."""
    cache = DynamicCache()
    cache.layers = [_IntoLayer(k, v) for k, v in kv_into]
    return cache


# -- the stage engine ----------------------------------------------------------------------------------------------
class HFStageEngine:
    """The ``hf`` engine behind :class:`~trident.worker.engines.base.StageEngine` for one stage: its roles, this
    process's transfer endpoint (when the stage hands on or takes a record), and one compute thread for
    blocking work (encode, prefill, READs) beside the decoder's stream, so that its event loop answers its stage
    socket meanwhile."""

    calls_at_once = 1  # one compute thread: requests would only queue there instead of in Triton
    kv_claims = None  # (a READ of its KV is claimed through the transfer lease: TransferSender.take)

    def __init__(
        self, spec: StageSpec, model_path: str, transfer: TransferConfig | None = None, embedding_cache_bytes: int = 0,
        device: str = "cpu", dtype: str = "auto",
    ) -> None:
        from trident.worker.engines.hf.decoder import HFDecoder

        self.spec = spec
        self.model = HFModel(model_path, device, dtype)
        self.processor = self.model.processor
        moves_records = spec.takes is not None or spec.hands_on != "tokens"  # (decode: also short prompts' embeddings)
        publishes_embeddings = spec.hands_on == "embeddings"
        extra = embedding_cache_bytes if publishes_embeddings else 0  # the cache lives in the send pool
        # (its pools on the model's device: on a GPU, embeddings and KV are published and read as VRAM)
        self.endpoint = TransferEndpoint(transfer, extra_send_bytes=extra, device=self.model.device) if moves_records else None
        self.encoder = HFEncoder(self.model) if "encode" in spec.roles else None
        # a decode stage prefills the short prompts a scheduler keeps off the prefill stage
        self.prefiller = HFPrefiller(self.model) if {"prefill", "decode"} & set(spec.roles) else None
        self.decoder = HFDecoder(self.model) if "decode" in spec.roles else None
        self.cache = (
            EmbeddingCache(self.endpoint.sender.pool, embedding_cache_bytes, settings_digest(model_path))
            if publishes_embeddings else None
        )
        self.encode_stage = (
            EncodeStage(self.processor, self.cache, self.endpoint, lambda claimed: self._start(self._encode_into_cache, claimed))
            if publishes_embeddings else None
        )
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trident-compute")
        self._producers = StageClient()  # its connections to the workers whose records it reads (to claim them)

    def _start(self, fn: Callable, *args) -> asyncio.Future:
        """``fn(*args)`` on the compute thread, as a future: the worker's event loop stays free meanwhile for its
        stage socket, where the consumers of its records claim them (a claim waits on no encode or prefill)."""
        return asyncio.get_running_loop().run_in_executor(self._compute, tracing.carry(fn), *args)

    async def _run(self, fn: Callable, *args) -> Any:
        return await self._start(fn, *args)

    # -- stage operations ----------------------------------------------------------------------------------
    async def encode(self, media: list[MediaItem], private: bool = False) -> Encoded:
        return await self.encode_stage.encode(media, private)

    def _encode_into_cache(self, claimed: list[tuple[str, MediaItem]]) -> list[CachedEmbedding]:
        with tracing.step("media_decode"):
            items = [item for _, item in claimed]
            decoded = list(zip([item.kind for item in items], self.processor.open(items)))
        emb = self.encoder.encode(decoded)
        self.cache.counters.vision_runs += 1
        self.cache.counters.images_encoded += len(decoded)
        rows = emb.embeddings.split(emb.token_counts)
        grids = emb.grid_thw or [None] * len(rows)
        seconds = emb.seconds or [0.0] * len(rows)
        frames = emb.frames or [0] * len(rows)
        with tracing.step("publish"):  # the copy into the send pool
            return [self.cache.store(key, r, g, t, frames=n)
                    for (key, _), r, g, t, n in zip(claimed, rows, grids, seconds, frames)]

    async def prefill(
        self, text: str, params: SamplingParams, *, media: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        if params.structured_outputs is not None:  # (compiled off the event loop and the compute thread)
            await self.model.grammars.prepare(params.structured_outputs)
        record = await self._taken_embeddings(embedding_meta)
        result = await self._run(self._prefill, text, params, list(media), record)
        try:
            first = RequestOutput(self.processor, params).push(  # as the decode's
                result.first_token, result.prompt_len, result.first_logprobs)
            with tracing.step("publish"):  # (the first text goes out early for a request of one choice)
                record = handoff.publish_kv(self.endpoint, result, early_text(first) if params.n == 1 else None)
        except BaseException:
            if result.kv_region is not None:
                self.endpoint.sender.pool.free(result.kv_region)
            raise
        try:
            with tracing.step("record_encode"):
                return record.encode()
        except BaseException:  # nobody will read it: its lease ends now, not at its expiry
            self.endpoint.sender.release(record.transfer.lease_id, record.transfer.release_key)
            raise

    async def _taken_embeddings(self, embedding_meta: bytes | None) -> EmbeddingsRecord | None:
        """The record of ``embedding_meta``, decoded and its lease claimed at its producer (:func:`handoff.take`)."""
        if embedding_meta is None:
            return None
        with tracing.step("record_decode"):
            record = decode_record(embedding_meta, EmbeddingsRecord)
        await handoff.take(self._producers, record.transfer)
        return record

    def _prefill(self, text: str, params: SamplingParams, media: list,
                 embeddings: EmbeddingsRecord | None) -> PrefillResult:
        """Encode the raw ``media`` here, or READ the embeddings of the record ``embeddings`` (claimed), then
        prefill."""
        seed = new_seed(params)
        if media:
            self.processor.check_placeholders(text, counts(media))  # before spending time on the encoders
            with tracing.step("media_decode"):
                decoded = list(zip([item.kind for item in media], self.processor.open(media)))
            emb = self.encoder.encode(decoded)
            prompt = handoff.prepare_prompt(self.processor, text, emb.token_counts, emb.kinds, emb)
            return self._prefill_prompt(prompt, emb, params, seed)
        if embeddings is None:
            return self._prefill_prompt(handoff.prepare_prompt(self.processor, text, []), None, params, seed)
        prompt, emb, _, release = handoff.receive_embeddings(self.endpoint, self.processor, text, embeddings)
        try:
            return self._prefill_prompt(prompt, emb, params, seed)
        finally:
            release()

    def _prefill_prompt(self, prompt: list[int], emb, params: SamplingParams, seed: int) -> PrefillResult:
        """Prefill; a stage that hands the KV cache on computes it straight into a region of its send pool (no
        copy at publish: ``kv_region``), a decode stage prefilling a short prompt into tensors of its own."""
        if self.spec.hands_on != "kv":
            return self.prefiller.prefill(prompt, emb, params, seed)
        spec = self.model.kv_spec(len(prompt))
        region, views = self.endpoint.sender.reserve(self.model.dtype, spec.shape, spec.count)
        try:
            into = list(zip(views[0::2], views[1::2]))
            result = self.prefiller.prefill(prompt, emb, params, seed, kv_into=into)
        except BaseException:
            self.endpoint.sender.pool.free(region)
            raise
        if all(k is ki and v is vi for (k, v), (ki, vi) in zip(result.kv, into)):
            result.kv_region = region
        else:  # the model kept tensors of its own: publish copies them
            self.endpoint.sender.pool.free(region)
        return result

    async def generate(
        self, text: str | None, params: SamplingParams, *, media: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        """The first token goes out before the KV cache is read and before the request joins the decode batch:
        the prefill sampled it (``kv_meta`` carries it), and sent from here it waits neither for the READ nor
        for the batch's next step, which would hold the other core. A request that ends at its first token
        (``max_tokens`` 1, EOS, a stop string) reads no KV at all. The record is checked and claimed first, so a
        refused or replayed one sends nothing. With ``n`` > 1 every choice's first token comes from the one
        prefill, and the KV cache, read once, is forked into a sequence per choice still open."""
        outputs = [RequestOutput(self.processor, params, i) for i in range(params.n)]
        if kv_meta is not None:
            record = handoff.open_kv(self.endpoint, kv_meta, self.model.check_kv)
            await handoff.take(self._producers, record.transfer)  # (refused: another consumer reads it; nothing sent)
            prompt_len = record.prompt_len
            try:
                firsts = await self._record_firsts(record, params)
            except BaseException:
                handoff.release_kv(self.endpoint, record)
                raise

            def read(choices: list) -> list[DecodeRequest]:
                return handoff.fork(handoff.receive_kv(self.endpoint, record, params), choices)

            def unread() -> None:
                handoff.release_kv(self.endpoint, record)
        else:
            if params.structured_outputs is not None:  # (compiled off the event loop and the compute thread)
                await self.model.grammars.prepare(params.structured_outputs)
            record = await self._taken_embeddings(embedding_meta)
            result = await self._run(self._prefill, text, params, list(media), record)
            prompt_len = result.prompt_len
            firsts = [Fork(result.first_token, result.first_logprobs, result.constraint), *result.forks]
            local = handoff.continue_locally(result, params)
            read, unread = (lambda choices: handoff.fork(local, choices)), None
        t0 = time.monotonic_ns()
        events = [output.push(f.first_token, prompt_len, f.first_logprobs) for output, f in zip(outputs, firsts)]
        tracing.mark("first_token", t0)
        choices = [(i, f, outputs[i]) for i, (f, event) in enumerate(zip(firsts, events)) if event.finish_reason is None]
        return Generation(prompt_len, self._events(events, choices, read, unread))

    async def _record_firsts(self, record: HFKVRecord, params: SamplingParams) -> list[Fork]:
        """Each choice's first token from a kv record, with its logprob entry when the request asks for logprobs
        and its structured output past that token."""
        if record.n != params.n:
            raise MalformedRecord(f"the kv record continues {record.n} choices and the request asks for n={params.n}")
        firsts = handoff.record_firsts(record)
        if params.logprobs is None:
            firsts = [Fork(f.first_token) for f in firsts]
        elif firsts[0].first_logprobs is None:  # (a prefill that saw other parameters)
            raise MalformedRecord("the kv record carries no first-token logprobs, and the request asks for logprobs")
        if params.structured_outputs is not None:  # the grammar, past the prefill's token
            await self.model.grammars.prepare(params.structured_outputs)  # (off the event loop)
            made = []
            for f in firsts:
                constraint = self.model.grammars.constraint(params.structured_outputs)
                constraint.accept(f.first_token)
                made.append(Fork(f.first_token, f.first_logprobs, constraint))
            firsts = made
        return firsts

    async def _events(self, firsts: list[DecodeEvent], choices: list, read: Callable, unread: Callable | None):
        """The first events, then (for the choices they did not end) the KV READ on the compute thread and the
        decoder's streams. A READ this request no longer waits for still frees what it read."""
        loop = asyncio.get_running_loop()
        joined = False
        try:
            for event in firsts:
                yield event
            if not choices:
                return
            joined = True
            if unread is None:  # prefilled here: nothing to read
                requests = read(choices)
            else:
                fetch = loop.run_in_executor(self._compute, tracing.carry(read), choices)
                try:
                    requests = await asyncio.shield(fetch)
                except asyncio.CancelledError:
                    fetch.add_done_callback(_release_unused)
                    raise
            streams = [self.decoder.submit(request, loop) for request in requests]
            try:
                async for event in interleave(streams):
                    yield event
            finally:
                for stream in streams:
                    stream.cancel()  # no-op once finished; stops a request whose client went away
        finally:
            if not joined and unread is not None:
                unread()

    def discard(self, record: bytes) -> None:
        """A record this stage will not read: tell its producer to free it now (best effort)."""
        handoff.discard(self.endpoint, record)

    def stats(self) -> dict:
        out: dict = dict(self.endpoint.stats()) if self.endpoint is not None else {}
        if self.cache is not None:
            out.update(self.cache.stats())
        if self.decoder is not None:
            out["decode_active"] = self.decoder.active
            out["decode_waiting"] = self.decoder.waiting
        return out

    def close(self) -> None:
        self._producers.close()
        if self.decoder is not None:
            self.decoder.close()
        if self.endpoint is not None:
            self.endpoint.close()
        self._compute.shutdown(wait=False, cancel_futures=True)


def _release_unused(fetch: asyncio.Future) -> None:
    """The KV a READ brought in for a request that went away meanwhile: back to the receive pool (once every
    choice's request has let it go)."""
    if not fetch.cancelled() and fetch.exception() is None:
        for request in fetch.result():
            if request.on_admit is not None:
                request.on_admit()
