"""The ``vllm`` engine: vLLM ``AsyncLLM`` engines behind :class:`~trident.worker.engines.base.StageEngine`.

What each stage runs:

- ``generate`` (EPD) and ``encode_prefill`` (EP/D): raw media into vLLM, which runs its own vision or audio tower.
- ``encode``: an encode-only vLLM engine, vLLM's own encoders (:mod:`trident.worker.engines.vllm_encoder`), the
  embeddings published through :mod:`trident.worker.engines.handoff` exactly as with the ``hf`` engine.
- ``prefill`` (E/P/D) and ``prefill_decode`` (E/PD): the embeddings READ through :mod:`trident.worker.engines.handoff`
  and given to the engine through Trident's EC connector (:mod:`trident.worker.engines.vllm_ec_connector`, consumer
  role), the prompt's media as stand-ins of their shapes (:mod:`trident.worker.engines.vllm_media`).
- ``prefill`` / ``encode_prefill`` -> ``decode``: vLLM's ``NixlConnector`` moves the KV cache (producer on
  the prefill side, consumer on the decode side); ``kv_meta`` carries its ``kv_transfer_params``.

Every stage's prompt goes through vLLM's own renderer (:func:`~trident.worker.engines.vllm_media.render`): the expanded
prompt and each item's embedding count come from vLLM's processing of the model, whatever its family, and the
rendered input is what the engine is given. The decode side renders ``text_input`` again with the stand-ins in
``kv_meta`` and checks the result against the prefill's prompt length and digest. It hands vLLM the media's stand-ins (zeros of their
shapes, from ``kv_meta``) under the items' content ids: the KV of those positions comes from the prefill worker,
the shapes give vLLM the placeholders (and Qwen its M-RoPE positions), whatever the model, and the ids keep
vLLM's prefix cache keyed by content.
vLLM computes the prompt's last position on the decode side, so that position must not be an image token.

First token first: the prefill samples the first token greedily and ``kv_meta`` carries it. For a greedy
request that goes on past it, the decode side sends that token at once and gives vLLM the prompt plus that
token, so vLLM continues from it (the token's own position is computed on the decode side, as the prompt's last
position is otherwise) instead of sampling it again after the KV pull, which under load takes the decode
engine several steps. :meth:`VLLMStageEngine._first_event` lists when this applies; otherwise vLLM samples
the first token itself, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import tokenizers
import torch

from trident.core import tracing
from trident.core.config import TransferConfig, VLLMConfig
from trident.core.errors import InvalidRequest
from trident.core.media import counts as media_counts
from trident.core.output import DecodeEvent, Generation, TokenLogprob, early_text, logprob_entry
from trident.core.processor import Processor, SamplingParams
from trident.core.protocol import EmbeddingsRecord, StageSpec, VLLMKVRecord, decode_record
from trident.core.stagecall.client import StageClient
from trident.worker.engines import handoff
from trident.worker.engines.vllm_media import Rendered, decode_media, mm_of, outputs_param, render, stand_ins_of
from trident.worker.engines.base import MediaEmbeddings
from trident.worker.engines.kv_claims import KVClaims

FIRST_OUTPUT_WAIT_S = 10.0  # how long a cancelled request may wait for vLLM's first output before it is aborted

log = logging.getLogger("trident.vllm")


def kv_role(spec: StageSpec) -> str | None:
    """The stage's NixlConnector role: producer when it hands on KV, consumer when it takes KV."""
    if spec.hands_on == "kv":
        return "kv_producer"
    return "kv_consumer" if spec.takes == "kv" else None


def prompt_digest(ids: list[int]) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(ids), digest_size=8).hexdigest()


def _environment(config: VLLMConfig, threads: int) -> None:
    """vLLM reads these from the environment when its engine process starts; set only what is unset."""
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": config.cpu_bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # with auto binding, keep a core for vLLM's busy loop
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": config.log_level,
    }
    if config.nixl_port:
        defaults["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(config.nixl_port)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def _executor(cpu: bool) -> dict:
    """The engine's executor argument. On a CPU, vLLM turns its single-process default ("uni") into "mp" (a worker
    process beside the engine core, so that it can set OpenMP's environment before torch starts); the workers here
    set that environment before vLLM starts, so "uni" is passed as the class, which vLLM takes as given: the model
    runs in the engine core, as on a GPU (one process fewer per engine, and 0.05-0.17x more tokens/s here)."""
    if not cpu:
        return {}
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return {"distributed_executor_backend": UniProcExecutor}


def start_engine(args, cpu: bool, stat_loggers=None):
    """An ``AsyncLLM`` from engine arguments; call before this process opens a NIXL agent."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from trident.worker.engines import vllm_engine_core

    vllm_engine_core.prepare()  # (an engine core's idle gloo threads, its collections at exit)
    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    if cpu:
        # vLLM's CPU platform makes its engine-core process a spawned one, which imports vLLM afresh (tens of
        # seconds of CPU per engine on a small machine); this process has imported it, run no OpenMP region
        # and opened no NIXL agent yet (the caller's endpoint comes after), so a fork is safe here and starts
        # the engine core without the imports
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers)


class _EngineStats:
    """Keeps the latest scheduler counters of an engine (a vLLM stat logger)."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens, since the engine started
        self.mm_queries = self.mm_hits = 0  # media items
        self.kv_read_bytes = 0  # the engine's own KV READs (its NIXL connector), since it started
        self.kv_read_seconds = 0.0
        self.kv_peers: dict[str, int] = {}  # the connector's peers by transport (peers_tcp, peers_not_tcp)

    def factory(self, vllm_config, engine_index: int = 0):
        from vllm.v1.metrics.loggers import StatLoggerBase

        from trident.worker.engines.vllm_connector import PEER_KEYS

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, *args, **kwargs) -> None:
                if scheduler_stats is not None:
                    sink.kv_cache_usage = scheduler_stats.kv_cache_usage
                    sink.running = scheduler_stats.num_running_reqs
                    sink.waiting = scheduler_stats.num_waiting_reqs
                    prefix = scheduler_stats.prefix_cache_stats  # (each step's, as vLLM's Prometheus logger adds them)
                    if prefix is not None:
                        sink.prefix_queries += prefix.queries
                        sink.prefix_hits += prefix.hits
                    if kv := scheduler_stats.kv_connector_stats:  # (vllm_connector.KVTransferStats' data)
                        sink.kv_read_bytes += sum(kv.get("bytes_transferred", ()))
                        sink.kv_read_seconds += sum(kv.get("transfer_duration", ()))
                        sink.kv_peers.update({key: kv[key][-1] for key in PEER_KEYS.values() if kv.get(key)})
                if mm_cache_stats is not None:
                    sink.mm_queries += mm_cache_stats.queries
                    sink.mm_hits += mm_cache_stats.hits

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


def _token_ids(value: int | list[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


def _candidates(position: dict, sampled: int) -> list[tuple[TokenLogprob, str]]:
    """vLLM's logprob entry of one position (``{token id: Logprob}``): each candidate with vLLM's text of it, the
    sampled token's first."""
    order = [sampled, *(t for t in position if t != sampled)] if sampled in position else list(position)
    return [(TokenLogprob(t, float(position[t].logprob), int(position[t].rank)), position[t].decoded_token or "")
            for t in order]


def _sampling(params: SamplingParams, **overrides):
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    args: dict[str, Any] = dict(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0, seed=params.seed, stop=list(params.stop) or None,
        ignore_eos=params.ignore_eos, output_kind=RequestOutputKind.DELTA, skip_special_tokens=True,
        logprobs=params.logprobs, n=params.n,  # (vLLM's children: choice i samples with seed + i)
        structured_outputs=params.structured_outputs.to_vllm() if params.structured_outputs is not None else None,
    )
    args.update(overrides)
    return VSamplingParams(**args)


def engine_dtype(dtype: str, cpu: bool) -> str:
    """vLLM's ``dtype`` for the ``dtype`` setting: ``auto`` is float32 on a CPU, bfloat16 on a GPU (as the hf
    engine's)."""
    return ("float32" if cpu else "bfloat16") if dtype == "auto" else dtype


def engine_device(cpu: bool) -> str:
    """Where a vLLM engine's process keeps the tensors it hands on or takes (its transfer pools): the GPU it
    computes on (the first it sees), else the CPU."""
    return "cpu" if cpu else "cuda:0"


class VLLMStageEngine:
    """One vLLM engine configured for one stage (see the module docstring)."""

    def __init__(
        self, spec: StageSpec, model_path: str, config: VLLMConfig, transfer: TransferConfig | None, threads: int = 1,
        dtype: str = "auto",
    ) -> None:
        _environment(config, threads)  # (before vLLM's import: its logging level is read then)
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        from trident.core.transfer import TransferEndpoint

        if spec.roles == ("encode",):
            raise ValueError("the vllm engine's encode stage is trident.worker.engines.vllm_encoder.VLLMEncodeEngine")
        self.kv_role = kv_role(spec)
        self.stage = stage = spec.name
        self.calls_at_once = 1 if spec.decoupled else config.prefill_calls
        self.processor = Processor(model_path)
        self.family = self.processor.family
        self._io = ThreadPoolExecutor(1, thread_name_prefix="trident-read")
        self.kv_claims = KVClaims() if self.kv_role == "kv_producer" else None
        self._producers = StageClient()  # a consumer's connections to the producers it claims KV at
        self._stats = _EngineStats()
        self._first_tokens_sent = 0  # decodes that started from the prefill's token

        self._cpu = cpu = current_platform.is_cpu()
        max_len = min(config.max_model_len or self.processor.max_model_len, self.processor.max_model_len)
        self.processor.max_model_len = max_len  # prompts are checked against what the engine accepts
        kv_transfer = None
        if self.kv_role is not None:
            kv_transfer = KVTransferConfig(
                kv_connector="TridentNixlConnector", kv_connector_module_path="trident.worker.engines.vllm_connector",
                kv_role=self.kv_role, kv_buffer_device="cpu" if cpu else "cuda",
                # always READ the prefill's KV: recomputing it here would run on placeholder embeddings
                kv_connector_extra_config={"num_threads": config.nixl_threads, "kv_recompute_threshold": 0},
            )
        takes_embeddings = "embeddings" in (spec.takes, spec.also_takes)
        ec_transfer = None
        if takes_embeddings:  # the encode stage's embeddings reach the engine through Trident's EC connector
            from trident.worker.engines import vllm_ec_connector

            ec_transfer = vllm_ec_connector.config("ec_consumer", cpu)
        args = AsyncEngineArgs(
            model=model_path,
            dtype=engine_dtype(dtype, cpu),
            max_model_len=max_len,
            enforce_eager=config.enforce_eager if config.enforce_eager is not None else cpu,
            kv_cache_memory_bytes=int(config.kv_cache_gib * (1 << 30)),
            kv_transfer_config=kv_transfer,
            ec_transfer_config=ec_transfer,
            disable_log_stats=False,
            use_tqdm_on_load=False,  # (a progress bar per checkpoint load, in every engine's output)
            seed=0,
            **_executor(cpu),
        )
        log.info("starting a vLLM engine for %s (kv role %s, embeddings in: %s)", stage, self.kv_role, takes_embeddings)
        self.llm = start_engine(args, cpu, stat_loggers=[self._stats.factory])
        self.endpoint = TransferEndpoint(transfer, device=engine_device(cpu)) if takes_embeddings else None
        self._first_token_rules(
            self.llm.vllm_config.cache_config.block_size,
            self.llm.model_config.try_get_generation_config().get("eos_token_id"),
        )

    def _first_token_rules(self, block_size: int, generation_eos: int | list[int] | None) -> None:
        """What :meth:`_first_event` checks a prefill's token against."""
        text_config = self.processor.config.get_text_config()
        self.vocab_size: int = text_config.vocab_size
        self.block_size = block_size
        # what ends a request at a token in vLLM: the tokenizer's and config's EOS and generation_config's
        self.stop_ids = self.processor.eos_token_ids | _token_ids(generation_eos)
        self._detokenizer = getattr(self.processor.tokenizer, "backend_tokenizer", None)  # vLLM's, when fast
        # tokens a prompt is not continued from: special and added ones (media placeholders among them)
        self._added_ids = frozenset(self.processor.token_ids.values()) | frozenset(
            self._detokenizer.get_added_tokens_decoder() if self._detokenizer is not None else ()
        )

    # -- inputs ------------------------------------------------------------------------------------------
    async def _prompt(self, text: str, kinds: list[str], mm: dict | None, item_ids: list[str]) -> Rendered:
        """vLLM's processed prompt (:func:`~trident.worker.engines.vllm_media.render`: its own placeholder expansion, so
        any model vLLM serves, family adapter or not), checked against the context window; a prefill handed on must
        not end with media."""
        rendered = await render(self.llm, self.processor, text, mm, kinds, item_ids)
        if rendered.ends_in is not None and self.kv_role == "kv_producer":
            # the decode engine recomputes the last prompt position, without the media's embeddings
            article = "an" if rendered.ends_in in ("image", "audio") else "a"
            raise InvalidRequest(f"with the vllm engine the prompt must not end with {article} {rendered.ends_in} placeholder")
        return rendered

    def _read_embeddings(self, record: EmbeddingsRecord) -> MediaEmbeddings:
        emb, release = handoff.read_embeddings(self.endpoint, record)
        try:
            emb.embeddings = emb.embeddings.clone()
            return emb
        finally:
            release()

    async def _inputs(self, text: str, media: list, embedding_meta: bytes | None):
        """vLLM's processed prompt and what the decode side needs: (the :class:`Rendered` prompt, the media's layout
        (token counts and kinds), the items' ids, the ``extra_args`` that carry the embeddings of ``embedding_meta``
        to the engine's EC connector, the items' stand-ins)."""
        if media:
            self.processor.check_placeholders(text, media_counts(media))
            mm, kinds, ids = await asyncio.to_thread(decode_media, self.processor, media)
            rendered = await self._prompt(text, kinds, mm, ids)
            layout = MediaEmbeddings(torch.empty(0), rendered.token_counts, kinds=kinds)
            return rendered, layout, ids, {}, stand_ins_of(mm, kinds)
        if embedding_meta is not None:
            record = decode_record(embedding_meta, EmbeddingsRecord)
            kinds = list(record.kinds) if record.kinds is not None else ["image"] * len(record.token_counts)
            try:
                if record.stand_ins is None or not record.image_ids:
                    raise InvalidRequest("embedding_meta carries no media stand-ins: it is not a vllm encode stage's")
                self.processor.check_placeholders(text, {k: kinds.count(k) for k in dict.fromkeys(kinds)})
                ids = list(record.image_ids)
                rendered = await self._prompt(text, kinds, mm_of(record.stand_ins, kinds), ids)
                if rendered.token_counts != list(record.token_counts):
                    raise InvalidRequest(f"the prompt's media take {rendered.token_counts} embeddings but embedding_meta "
                                         f"holds {list(record.token_counts)}")
            except BaseException:
                handoff.discard(self.endpoint, embedding_meta)  # (its producer frees it now)
                raise
            await handoff.take(self._producers, record.transfer)  # (refused: another consumer reads it)
            loop = asyncio.get_running_loop()
            emb = await loop.run_in_executor(self._io, tracing.carry(self._read_embeddings), record)
            return rendered, emb, ids, {"ec_transfer_params": outputs_param(ids, emb)}, list(record.stand_ins)
        rendered = await self._prompt(text, [], None, [])
        return rendered, MediaEmbeddings(torch.empty(0), [], kinds=[]), [], {}, []

    async def _decode_inputs(self, text: str | None, record: VLLMKVRecord) -> Rendered:
        if text is None:
            raise InvalidRequest("the vllm decode stage needs text_input (the prompt) along with kv_meta")
        if record.prompt_len > self.processor.max_model_len or sum(record.token_counts) > record.prompt_len:
            raise InvalidRequest(
                f"kv_meta describes a prompt of {record.prompt_len} tokens with {sum(record.token_counts)} media "
                f"tokens; the context window is {self.processor.max_model_len}"
            )
        mm = None
        kinds = list(record.kinds) if record.kinds is not None else ["image"] * len(record.token_counts)
        if record.token_counts:
            self.processor.check_kinds(dict.fromkeys(kinds, 1))
            if record.stand_ins is None or len(record.stand_ins) != len(kinds):
                raise InvalidRequest("kv_meta carries no media stand-ins for its media items")
            mm = mm_of(record.stand_ins, kinds)  # (the KV covers the media: vLLM places them by their shapes)
        self.processor.check_placeholders(text, {k: kinds.count(k) for k in dict.fromkeys(kinds)})
        rendered = await self._prompt(text, kinds, mm, record.image_ids)
        if rendered.length != record.prompt_len or prompt_digest(rendered.text_ids) != record.prompt_digest:
            raise InvalidRequest("text_input is not the prompt this kv_meta was prefilled from")
        return rendered

    # -- stage operations --------------------------------------------------------------------------------
    async def encode(self, media: list, private: bool = False) -> bytes:
        raise InvalidRequest(f"the {self.stage} stage does not encode")

    async def prefill(
        self, text: str, params: SamplingParams, *, media: list = (), embedding_meta: bytes | None = None
    ) -> bytes:
        self._one_choice(params, embedding_meta)
        rendered, layout, image_ids, extra, stand_ins = await self._inputs(text, list(media), embedding_meta)
        prompt, length = rendered.engine_input, rendered.length
        sampling = _sampling(params, max_tokens=1, temperature=0.0, stop=None, ignore_eos=True, n=1,
                             extra_args={"kv_transfer_params": {"do_remote_decode": True}, **extra})
        final = None
        async for final in self._run(prompt, sampling):
            pass
        if final is None or not final.kv_transfer_params:
            raise RuntimeError("vLLM's prefill returned no kv_transfer_params (is the NixlConnector configured?)")
        digest = prompt_digest(rendered.text_ids)
        completion = final.outputs[0] if final.outputs else None
        first_token = completion.token_ids[0] if completion is not None and completion.token_ids else None
        first_logprobs = None
        if params.logprobs is not None and first_token is not None and completion.logprobs:
            first_logprobs = [(c.token_id, c.logprob, c.rank) for c, _ in _candidates(completion.logprobs[0], first_token)]
        return VLLMKVRecord(
            claim=self.kv_claims.hold(), claim_at=self.kv_claims.at,
            kv_transfer_params=final.kv_transfer_params, prompt_len=length, prompt_digest=digest,
            token_counts=layout.token_counts, image_ids=image_ids,
            kinds=layout.item_kinds if set(layout.item_kinds) - {"image"} else None,
            stand_ins=stand_ins or None, first_token=first_token, first_logprobs=first_logprobs,
            first_text=early_text(self._first_event(prompt, length, first_token, params, first_logprobs)),
        ).encode()

    async def generate(
        self, text: str | None, params: SamplingParams, *, media: list = (),
        embedding_meta: bytes | None = None, kv_meta: bytes | None = None,
    ) -> Generation:
        if self.kv_role == "kv_consumer":  # (E/P/D, EP/D: a prompt it prefills itself too, for one answer in a mode)
            self._one_choice(params, embedding_meta)
        if kv_meta is not None:
            record = decode_record(kv_meta, VLLMKVRecord)
            rendered = await self._decode_inputs(text, record)
            prompt, length = rendered.engine_input, rendered.length
            # vLLM frees the prefill's blocks once read: a second read, by this consumer or any other, would find
            # other requests' KV there, so the KV is claimed at its producer first, once for all consumers
            await self._producers.claim(record.claim_at, record.claim)
            extra = {"kv_transfer_params": record.kv_transfer_params}
            t0 = time.monotonic_ns()
            first = self._first_event(prompt, length, record.first_token, params, record.first_logprobs)
            if first is not None:
                tracing.mark("first_token", t0)
                self._first_tokens_sent += 1
                prompt = dict(prompt, prompt_token_ids=[*prompt["prompt_token_ids"], first.token_ids[0]])
                sampling = _sampling(params, max_tokens=params.max_tokens - 1, extra_args=extra)
                return Generation(length, self._events(prompt, sampling, first))
            sampling = _sampling(params, extra_args=extra)
        else:
            rendered, _, _, extra, _ = await self._inputs(text, list(media), embedding_meta)
            prompt, length = rendered.engine_input, rendered.length
            sampling = _sampling(params, extra_args=extra or None)
        return Generation(length, self._events(prompt, sampling))

    async def _run(self, prompt: dict, sampling):
        """vLLM's outputs of one request; vLLM's input errors become :class:`InvalidRequest`.

        A request cancelled before vLLM's first output is aborted only once that output is in (at most
        :data:`FIRST_OUTPUT_WAIT_S`). vLLM's ``generate`` cancelled inside its ``add_request`` neither adds the
        request nor aborts it, so a decode request's remote KV was never pulled and the prefill's blocks waited
        for vLLM's 30 s lease; once the first output is in, the pull is done and the abort frees everything."""
        from vllm.exceptions import VLLMClientError

        stream = self.llm.generate(prompt, sampling, request_id=uuid.uuid4().hex)
        first = asyncio.ensure_future(anext(stream, None))
        try:
            try:
                output = await asyncio.shield(first)
            except asyncio.CancelledError:
                await asyncio.wait({first}, timeout=FIRST_OUTPUT_WAIT_S)
                raise
            while output is not None:
                yield output
                output = await anext(stream, None)
        except (ValueError, VLLMClientError) as e:
            raise InvalidRequest(str(e)) from None
        finally:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
            await stream.aclose()  # aborts the request in vLLM if it has not finished

    def _first_event(
        self, prompt: dict, length: int, token: int | None, params: SamplingParams,
        logprobs: list[tuple[int, float, int]] | None = None,
    ) -> DecodeEvent | None:
        """The event of the prefill's token when the decode can start from it (see the module docstring), or
        None when vLLM must sample the first token itself:

        - the request is not greedy (the prefill sampled greedily), or has stop strings (vLLM finds them in its
          own output text, which would not hold this token's);
        - the token ends the request (EOS, ``max_tokens`` 1, the context window): vLLM then reads the KV, which
          frees the prefill's blocks at once;
        - the prompt's last block is full, or this token fills it: vLLM would allocate a block the prefill did
          not fill, or cache a full block before this token's position in it is computed;
        - the token is a special or added one (a media placeholder would be taken for media);
        - the token ends inside a character (its text depends on the next token, so vLLM's detokenizer,
          primed with the prompt and this token, would join them differently), or the tokenizer is not a fast
          one (vLLM's detokenizer then works otherwise);
        - the request asks for logprobs and the prefill's are not given (``logprobs``: its record's);
        - the request asks for structured output (vLLM's grammar starts with the first token it samples).
        """
        if (
            token is None or self._detokenizer is None or not params.greedy or params.stop or params.max_tokens < 2
            or params.structured_outputs is not None
            or (params.logprobs is not None and not logprobs)
            or not 0 <= token < self.vocab_size or token in self._added_ids
            or (token in self.stop_ids and not params.ignore_eos)
            or length + 1 >= self.processor.max_model_len or not 0 < length % self.block_size < self.block_size - 1
        ):
            return None
        stream = tokenizers.decoders.DecodeStream(ids=prompt["prompt_token_ids"], skip_special_tokens=True)
        text = stream.step(self._detokenizer, token)
        if text is None:
            return None
        if params.logprobs is None:
            return DecodeEvent(token_ids=[token], text=text, num_output_tokens=1)
        entry = [TokenLogprob(*e) for e in logprobs]
        return DecodeEvent(token_ids=[token], text=text, num_output_tokens=1,
                           logprobs=[logprob_entry(self.processor.tokenizer, entry)], cumulative_logprob=entry[0].logprob)

    async def _events(self, prompt: dict, sampling, first: DecodeEvent | None = None):
        """vLLM's outputs as events, after ``first`` (the prefill's token) when given: vLLM takes the request
        once ``first`` is out and the next event is asked for. (A generation closed right after ``first``
        never reaches vLLM; the prefill side frees its blocks at vLLM's KV lease, 30 s.)"""
        counts, before = [0] * sampling.n, 0.0  # each choice's tokens so far; the logprob of the first, when vLLM did
        if first is not None:  # not sample it (one choice)
            yield first
            counts[0], before = first.num_output_tokens, first.cumulative_logprob or 0.0
        async for output in self._run(prompt, sampling):
            for completion in output.outputs:  # (n > 1: vLLM's children, each as it has new tokens)
                i = completion.index
                counts[i] += len(completion.token_ids)
                logprobs = cumulative = None
                if sampling.logprobs is not None:  # vLLM's own entries and sum
                    logprobs = [{c.token_id: {"logprob": c.logprob, "rank": c.rank, "decoded_token": text}
                                 for c, text in _candidates(position, token)}
                                for position, token in zip(completion.logprobs or (), completion.token_ids)]
                    if completion.cumulative_logprob is not None:
                        cumulative = before + completion.cumulative_logprob
                yield DecodeEvent(
                    token_ids=list(completion.token_ids), text=completion.text,
                    finish_reason=completion.finish_reason if completion.finished() else None,
                    num_output_tokens=counts[i], logprobs=logprobs, cumulative_logprob=cumulative, index=i,
                )

    def _one_choice(self, params: SamplingParams, embedding_meta: bytes | None) -> None:
        """A prefill handed on to another engine continues into one choice: vLLM's children of a request (``n`` >
        1) would each READ the one prefill's KV, which its producer frees after the first READ. The embeddings of a
        request refused here are freed at once, not at their lease's end."""
        if params.n == 1:
            return
        if embedding_meta is not None:
            self.discard(embedding_meta)
        raise InvalidRequest(f"n={params.n}: with the vllm engine a request of more than one choice is served in the "
                             "EPD and E/PD modes (one engine prefills and samples every choice), not where another "
                             "engine prefills (E/P/D, EP/D)")

    # -- single use of a prefill's KV ----------------------------------------------------------------------
    def discard(self, record: bytes) -> None:
        """An ``embedding_meta`` this stage will not read is freed now (vLLM frees its KV blocks itself)."""
        if self.endpoint is not None:
            handoff.discard(self.endpoint, record)

    def stats(self) -> dict:
        out: dict = dict(self.endpoint.stats()) if self.endpoint is not None else {}
        st = self._stats
        # the engine's own KV READs (vLLM's connector, in the engine process): apart, and in the transfer counters
        # with the records' (Trident's agent)
        tcp, not_tcp = st.kv_peers.get("peers_tcp", 0), st.kv_peers.get("peers_not_tcp", 0)
        if st.kv_read_bytes:  # (vLLM's KV cache is in the engine's device memory at both ends)
            pair = "DRAM_to_DRAM" if self._cpu else "VRAM_to_VRAM"
            out[f"read_bytes_from_{pair}"] = out.get(f"read_bytes_from_{pair}", 0) + st.kv_read_bytes
            out[f"read_seconds_from_{pair}"] = out.get(f"read_seconds_from_{pair}", 0.0) + st.kv_read_seconds
        out.update(kv_read_bytes=st.kv_read_bytes, kv_read_seconds=st.kv_read_seconds, kv_peers_tcp=tcp,
                   kv_peers_not_tcp=not_tcp, peers_tcp=out.get("peers_tcp", 0) + tcp, peers_not_tcp=out.get("peers_not_tcp", 0) + not_tcp)
        out.update(
            kv_cache_usage=st.kv_cache_usage, vllm_running=st.running, vllm_waiting=st.waiting,
            prefix_cache_queries=st.prefix_queries, prefix_cache_hits=st.prefix_hits,
            mm_cache_queries=st.mm_queries, mm_cache_hits=st.mm_hits,
        )
        if self.kv_role == "kv_consumer":
            out["first_tokens_from_prefill"] = self._first_tokens_sent
        return out

    def close(self) -> None:
        self._producers.close()
        self.llm.shutdown()
        if self.endpoint is not None:
            self.endpoint.close()
        self._io.shutdown(wait=False, cancel_futures=True)

