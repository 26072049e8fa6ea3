"""The hf engine as a stage engine: the roles a stage needs, joined by the hand-offs, on one compute thread.

:class:`HFStageEngine` is what a stage worker serves with ``--backend hf`` (and the encode stage with any
backend). Each stage operation is one function here:

- :meth:`HFStageEngine.encode`: media -> embeddings (through the embedding cache) -> ``embedding_meta``
- :meth:`HFStageEngine.prefill`: prompt + media or ``embedding_meta`` -> KV cache + first token -> ``kv_meta``
- :meth:`HFStageEngine.generate`: ``kv_meta``, or a local prefill (also on the decode stage, for a short
  prompt a scheduler sends it), -> the decoder's token stream
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable


from ... import tracing
from ...config import TransferConfig
from ...errors import MalformedRecord
from ...media import MediaItem, counts
from ...output import DecodeEvent, Generation, RequestOutput, early_text
from ...processor import SamplingParams
from ...protocol import StageSpec
from ...transfer import TransferEndpoint
from .. import handoff
from ..base import DecodeRequest, Encoded, PrefillResult
from ..embedding_cache import CachedEmbedding, EmbeddingCache
from .sampling import new_seed


class HFStageEngine:
    """The ``hf`` engine behind :class:`~trident.engines.base.StageEngine` for one stage: its roles, this
    process's transfer endpoint (when the stage hands on or takes a record), and one compute thread for
    blocking work (encode, prefill, READs) beside the decoder's stream; a one-answer stage computes on its event
    loop itself."""

    calls_at_once = 1  # one compute thread: requests would only queue there instead of in Triton

    def __init__(
        self, spec: StageSpec, model_path: str, transfer: TransferConfig | None = None, embedding_cache_bytes: int = 0
    ) -> None:
        from .decoder import HFDecoder
        from .model import HFEncoder, HFModel, HFPrefiller

        self.spec = spec
        self.model = HFModel(model_path)
        self.processor = self.model.processor
        moves_records = spec.takes is not None or spec.hands_on != "tokens"  # (decode: also short prompts' embeddings)
        publishes_embeddings = spec.hands_on == "embeddings"
        extra = embedding_cache_bytes if publishes_embeddings else 0  # the cache lives in the send pool
        self.endpoint = TransferEndpoint(transfer, extra_send_bytes=extra) if moves_records else None
        self.encoder = HFEncoder(self.model) if "encode" in spec.roles else None
        # a decode stage prefills the short prompts a scheduler keeps off the prefill stage
        self.prefiller = HFPrefiller(self.model) if {"prefill", "decode"} & set(spec.roles) else None
        self.decoder = HFDecoder(self.model) if "decode" in spec.roles else None
        self.cache = (
            EmbeddingCache(self.endpoint.sender.pool, embedding_cache_bytes, _settings_digest(model_path))
            if publishes_embeddings else None
        )
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="trident-compute")
        # Triton hands a one-answer stage's instance one request at a time (calls_at_once), so nothing else
        # waits on this worker's event loop while it computes: its work runs there, not two thread hops away
        self._inline = spec.hands_on != "tokens"

    def _start(self, fn: Callable, *args) -> asyncio.Future:
        """``fn(*args)`` as a future: on the compute thread, or done at once on the event loop for a one-answer
        stage (see ``_inline``)."""
        loop = asyncio.get_running_loop()
        if not self._inline:
            return loop.run_in_executor(self._compute, tracing.carry(fn), *args)
        done = loop.create_future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done

    async def _run(self, fn: Callable, *args) -> Any:
        return await self._start(fn, *args)

    # -- stage operations ----------------------------------------------------------------------------------
    async def encode(self, media: list[MediaItem]) -> Encoded:
        """Each distinct item of the request from the cache, from another request's encode in flight, or
        from one encoder pass over the rest; the record points at the cached regions."""
        self.processor.check_kinds(counts(media))
        cache, loop = self.cache, asyncio.get_running_loop()
        keys = [cache.key(item.content_id) for item in media]
        held: dict[str, CachedEmbedding] = {}
        waits: dict[str, asyncio.Future] = {}
        mine: dict[str, MediaItem] = {}
        report = {"hits": 0, "misses": 0, "shared": 0}
        for key, item in zip(keys, media):
            if key in held or key in waits or key in mine:  # the same image again in this request
                report["shared"] += 1
                cache.counters.shared += 1
                continue
            claim = cache.claim(key, loop)
            if claim.entry is not None:
                held[key] = claim.entry
                report["hits"] += 1
            elif claim.pending is not None:
                waits[key] = claim.pending
                report["shared"] += 1
            else:
                mine[key] = item
                report["misses"] += 1
        try:
            if mine:
                held.update(await self._encode_claimed(mine))
            for key, pending in waits.items():
                held[key] = await cache.wait(pending)
        except BaseException:
            for entry in held.values():
                cache.release(entry)
            for key, pending in waits.items():  # the reference taken for us when that encode ends
                if key not in held:
                    pending.add_done_callback(lambda f: f.exception() is None and cache.release(f.result()))
            raise
        entries = [held[key] for key in keys]
        seen: set[str] = set()
        for key in keys:  # a record holds one reference per image it lists, repeats included
            if key in seen:
                cache.retain(held[key])
            seen.add(key)
        record = handoff.publish_cached_embeddings(
            self.endpoint.sender, cache, entries, [i.content_id for i in media], [i.kind for i in media]
        )
        report.update(vision_runs=int(bool(mine)), cache_bytes=cache.bytes, evictions=cache.counters.evictions)
        with tracing.step("record_encode"):
            return Encoded(record.encode(), report)

    async def _encode_claimed(self, claimed: dict[str, MediaItem]) -> dict[str, CachedEmbedding]:
        """Encode the items this request claimed, in one encoder pass on the compute thread, and wake
        the requests waiting on them whatever happens to this one."""
        cache, keys = self.cache, list(claimed)
        run = self._start(self._encode_into_cache, list(claimed.items()))

        def settle(done: asyncio.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                error = done.exception() if not done.cancelled() else asyncio.CancelledError()
                for key in keys:
                    cache.fail(key, error)
            else:
                for key, entry in zip(keys, done.result()):
                    cache.fulfil(key, entry)

        if run.done():  # encoded on the event loop: wake the waiters before anything else runs
            settle(run)
        else:
            run.add_done_callback(settle)
        try:
            entries = await asyncio.shield(run)
        except asyncio.CancelledError:  # this request went away: its references go when the encode ends
            run.add_done_callback(lambda f: f.exception() is None and [cache.release(e) for e in f.result()])
            raise
        return dict(zip(keys, entries))

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
        with tracing.step("publish"):  # the copy into the send pool
            return [self.cache.store(key, r, g, t) for (key, _), r, g, t in zip(claimed, rows, grids, seconds)]

    async def prefill(
        self, text: str, params: SamplingParams, *, media: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        result = await self._run(self._prefill, text, params, list(media), embedding_meta)
        try:
            first = RequestOutput(self.processor, params).push(  # as the decode's
                result.first_token, result.prompt_len, result.first_logprobs)
            with tracing.step("publish"):
                record = handoff.publish_kv(self.endpoint, result, early_text(first))
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

    def _prefill(self, text: str, params: SamplingParams, media: list, embedding_meta: bytes | None) -> PrefillResult:
        """Encode the raw ``media`` here, or READ the embeddings of ``embedding_meta``, then prefill."""
        seed = new_seed(params)
        if media:
            self.processor.check_placeholders(text, counts(media))  # before spending time on the encoders
            with tracing.step("media_decode"):
                decoded = list(zip([item.kind for item in media], self.processor.open(media)))
            emb = self.encoder.encode(decoded)
            prompt = handoff.prepare_prompt(self.processor, text, emb.token_counts, emb.kinds)
            return self._prefill_prompt(prompt, emb, params, seed)
        if embedding_meta is None:
            return self._prefill_prompt(handoff.prepare_prompt(self.processor, text, []), None, params, seed)
        prompt, emb, _, release = handoff.receive_embeddings(self.endpoint, self.processor, text, embedding_meta)
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
        refused or replayed one sends nothing."""
        output = RequestOutput(self.processor, params)
        if kv_meta is not None:
            record = handoff.open_kv(self.endpoint, kv_meta, self.model.check_kv)
            first_token, prompt_len = record.first_token, record.prompt_len
            logprobs = handoff.first_logprobs(record) if params.logprobs is not None else None
            constraint = None
            try:
                if params.logprobs is not None and logprobs is None:  # (a prefill that saw other parameters)
                    raise MalformedRecord("the kv record carries no first-token logprobs, and the request asks for "
                                          "logprobs")
                if params.structured_outputs is not None:  # the grammar, past the prefill's token
                    constraint = await asyncio.get_running_loop().run_in_executor(
                        None, self.model.grammars.constraint, params.structured_outputs)
                    constraint.accept(first_token)
            except BaseException:
                handoff.release_kv(self.endpoint, record)
                raise

            def read() -> DecodeRequest:
                return handoff.receive_kv(self.endpoint, record, params, output=output, constraint=constraint)

            def unread() -> None:
                handoff.release_kv(self.endpoint, record)
        else:
            result = await self._run(self._prefill, text, params, list(media), embedding_meta)
            local = handoff.continue_locally(result, params, output=output)
            first_token, prompt_len, logprobs = local.first_token, local.prompt_len, local.first_logprobs
            read, unread = None, None
        t0 = time.monotonic_ns()
        first = output.push(first_token, prompt_len, logprobs)
        tracing.mark("first_token", t0)
        return Generation(prompt_len, self._events(first, read or (lambda: local), unread))

    async def _events(self, first: DecodeEvent, read: Callable[[], DecodeRequest], unread: Callable | None):
        """The first event, then (unless it ended the request) the KV READ on the compute thread and the
        decoder's stream. A READ this request no longer waits for still frees what it read."""
        loop = asyncio.get_running_loop()
        joined = False
        try:
            yield first
            if first.finish_reason is not None:
                return
            joined = True
            if unread is None:  # prefilled here: nothing to read
                request = read()
            else:
                fetch = loop.run_in_executor(self._compute, tracing.carry(read))
                try:
                    request = await asyncio.shield(fetch)
                except asyncio.CancelledError:
                    fetch.add_done_callback(_release_unused)
                    raise
            stream = self.decoder.submit(request, loop)
            try:
                async for event in stream:
                    yield event
            finally:
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
        if self.decoder is not None:
            self.decoder.close()
        if self.endpoint is not None:
            self.endpoint.close()
        self._compute.shutdown(wait=False, cancel_futures=True)


def _release_unused(fetch: asyncio.Future) -> None:
    """The KV a READ brought in for a request that went away meanwhile: back to the receive pool."""
    if not fetch.cancelled() and fetch.exception() is None and fetch.result().on_admit is not None:
        fetch.result().on_admit()


def _settings_digest(model_path: str) -> str:
    """What an embedding depends on besides the image: the checkpoint's weights and processor settings."""
    h = hashlib.blake2b(digest_size=8)
    root = Path(model_path)
    for name in ("config.json", "preprocessor_config.json", "processor_config.json"):
        if (root / name).is_file():
            h.update(name.encode() + (root / name).read_bytes())
    for weights in sorted(root.glob("*.safetensors")):
        stat = weights.stat()
        h.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(json.dumps(str(root.resolve())).encode())
    return h.hexdigest()
