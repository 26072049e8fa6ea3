"""The hf engine's decoder: continuous batching over a slot-based KV store.

:class:`HFDecoder` runs the steps of all active requests as one batch (requests join and leave between
steps) over :class:`BatchKV`; each request's tokens go through its :class:`~trident.core.output.RequestOutput`
(text, stop strings, finish reasons) into a :class:`TokenStream`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import torch

from trident.core import tracing
from trident.core.output import DecodeEvent, RequestOutput
from trident.worker.engines.base import DecodeRequest
from trident.worker.engines.hf.sampling import candidates, sample

if TYPE_CHECKING:
    from trident.worker.engines.hf.stage import HFModel

log = logging.getLogger(__name__)


class BatchKV:
    """KV caches of the active decode requests, one row per request, for transformers' attention layers.

    Per layer, keys and values live in ``(rows, kv_heads, length, head_dim)`` buffers; request ``i`` holds
    positions ``0 .. lens[i]-1`` of row ``i``. Rows ``0 .. n-1`` are the active requests (a leaving request's
    row is filled with the last one), so a step runs over one dense batch. It implements the two methods of
    transformers' ``Cache`` the attention layers call: :meth:`update` and :meth:`get_seq_length`.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype=torch.float32, device="cpu") -> None:
        self.shape = (kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.num_layers = num_layers
        self.lens: list[int] = []
        self._alloc(rows=4, length=256)

    @property
    def n(self) -> int:
        return len(self.lens)

    def _alloc(self, rows: int, length: int) -> None:
        h, d = self.shape
        old_k, old_v = self.k, self.v
        self.k = [torch.zeros(rows, h, length, d, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(rows, h, length, d, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if old_k and self.lens:
            n, span = self.n, max(self.lens)
            for layer in range(self.num_layers):
                self.k[layer][:n, :, :span] = old_k[layer][:n, :, :span]
                self.v[layer][:n, :, :span] = old_v[layer][:n, :, :span]

    def _ensure(self, rows: int, length: int) -> None:
        cur_rows, cur_len = self.k[0].shape[0], self.k[0].shape[2]
        if rows > cur_rows or length > cur_len:
            self._alloc(max(rows, cur_rows * (2 if rows > cur_rows else 1)), max(length, cur_len * (2 if length > cur_len else 1)))

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy one request's prefill KV (per layer, ``(1, kv_heads, L, head_dim)``) into a new row."""
        length = kv[0][0].shape[2]
        self._ensure(self.n + 1, length + 1)
        row = self.n
        for layer, (k, v) in enumerate(kv):
            self.k[layer][row, :, :length] = k[0]
            self.v[layer][row, :, :length] = v[0]
        self.lens.append(length)
        return row

    def remove(self, row: int) -> None:
        """Drop a row; the last row moves into its place."""
        last = self.n - 1
        if row != last:
            span = self.lens[last]
            for layer in range(self.num_layers):
                self.k[layer][row, :, :span] = self.k[layer][last, :, :span]
                self.v[layer][row, :, :span] = self.v[layer][last, :, :span]
            self.lens[row] = self.lens[last]
        self.lens.pop()

    # -- one decode step ------------------------------------------------------------------------
    def begin_step(self) -> torch.Tensor:
        """Prepare for a step that appends one token per row; returns the attention mask."""
        self._span = max(self.lens) + 1
        self._ensure(self.n, self._span)
        self._lens_t = torch.tensor(self.lens, dtype=torch.long, device=self.device)
        self._rows = torch.arange(self.n, device=self.device)
        positions = torch.arange(self._span, device=self.device)
        return (positions[None, :] <= self._lens_t[:, None])[:, None, None, :]  # (n, 1, 1, span)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        k[self._rows, :, self._lens_t] = key_states[:, :, 0]
        v[self._rows, :, self._lens_t] = value_states[:, :, 0]
        return k[: self.n, :, : self._span], v[: self.n, :, : self._span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._span - 1

    def end_step(self) -> None:
        self.lens = [n + 1 for n in self.lens]


class TokenStream:
    """The events of one decode request; iterate it (``for``, or ``async for`` when made with a loop).

    The decode thread puts events in; with an asyncio ``loop`` they are handed over thread-safely to that
    loop, so an async worker awaits them without holding a thread per request. :meth:`cancel` ends the
    request at the next step.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._q: queue.Queue | asyncio.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.cancelled = False

    def put(self, item: DecodeEvent | BaseException) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        else:
            self._q.put(item)

    def cancel(self) -> None:
        self.cancelled = True

    def get(self, timeout: float | None = None) -> DecodeEvent:
        item = self._q.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[DecodeEvent]:
        while True:
            event = self.get()
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[DecodeEvent]:
        while True:
            item = await self._q.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class _Active:
    """Decode state of one request in the batch."""

    def __init__(self, req: DecodeRequest, stream: TokenStream, output: RequestOutput, trace=None) -> None:
        self.req, self.stream, self.output = req, stream, output
        self.last_token = req.first_token
        self.trace, self.admitted = trace, time.monotonic_ns()  # its request's trace context; when it joined

    @property
    def generated(self) -> int:
        return self.output.generated


class HFDecoder:
    """Continuous-batching decode: one background thread steps all active requests together."""

    def __init__(self, model: HFModel, max_batch: int = 64) -> None:
        self.m = model
        self.max_batch = max_batch
        self._pending: queue.Queue[tuple[DecodeRequest, TokenStream, object]] = queue.Queue()
        self._active: list[_Active] = []  # index == row in the BatchKV
        self._kv = self._new_kv()
        self._stop = threading.Event()
        self.steps = 0
        self.max_batch_seen = 0
        self._thread = threading.Thread(target=self._loop, name="trident-decode", daemon=True)
        self._thread.start()

    def _new_kv(self) -> BatchKV:
        return BatchKV(self.m.num_layers, self.m.kv_heads, self.m.head_dim, self.m.dtype, self.m.device)

    def submit(self, request: DecodeRequest, loop: asyncio.AbstractEventLoop | None = None) -> TokenStream:
        """Queue a request; it joins the batch before the next step."""
        stream = TokenStream(request.request_id, loop)
        self._pending.put((request, stream, tracing.context()))  # (the request's spans go on in the decode thread)
        return stream

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests admitted that join the batch at its next step."""
        return self._pending.qsize()

    def close(self) -> None:
        self._stop.set()
        self._pending.put(None)  # type: ignore[arg-type]  # wake the loop
        self._thread.join(timeout=5)

    # -- the loop -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit(block=not self._active)
                if self._active:
                    self._step()
            except Exception as e:  # fail the requests in flight, keep serving new ones
                log.exception("decode step failed")
                for a in self._active:
                    a.stream.put(e)
                self._active.clear()
                self._kv = self._new_kv()

    def _admit(self, block: bool) -> None:
        while len(self._active) < self.max_batch:
            try:
                item = self._pending.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return
            if item is None:
                return
            req, stream, trace = item
            block = False
            t0 = time.monotonic_ns()
            try:
                if req.output is not None:  # the engine has sent the first token already
                    active, finished = _Active(req, stream, req.output, trace), False
                else:  # the first token was sampled by prefill: emit it before the request enters the batch
                    active = _Active(req, stream, RequestOutput(self.m.processor, req.params), trace)
                    finished = self._emit(active, req.first_token, req.prompt_len, req.first_logprobs)
                    tracing.mark("first_token", t0, context=trace)
                if not finished:
                    self._kv.add(req.kv)
                    self._active.append(active)
            except Exception as e:  # this request cannot join; the batch goes on
                log.exception("decode request %s could not join the batch", req.request_id)
                stream.put(e)
            finally:
                if req.on_admit is not None:
                    req.on_admit()
                tracing.mark("decode_admit", t0, context=trace)

    def _emit(self, a: _Active, token: int, cache_len: int, logprobs: list | None = None) -> bool:
        """Send one generated token (with its logprob entry, when asked for); True when the request is finished."""
        a.last_token = token
        event = a.output.abort() if a.stream.cancelled else a.output.push(token, cache_len, logprobs)
        a.stream.put(event)
        return event.finish_reason is not None

    @torch.inference_mode()
    def _step(self) -> None:
        model, kv = self.m.model, self._kv
        device = self.m.device
        tokens = torch.tensor([[a.last_token] for a in self._active], dtype=torch.long, device=device)
        mask = kv.begin_step()
        if self.m.sliding_window is not None:  # (Gemma 3: its sliding layers see the last `window` positions only)
            near = torch.arange(kv._span, device=device)[None, :] > kv._lens_t[:, None] - self.m.sliding_window
            mask = {"full_attention": mask, "sliding_attention": mask & near[:, None, None, :]}
        positions = kv._lens_t + torch.tensor([a.req.rope_delta for a in self._active], dtype=torch.long, device=device)
        lm = self.m.family.language_model(model)
        hidden = lm(
            inputs_embeds=lm.embed_tokens(tokens),
            position_ids=positions[:, None],
            attention_mask=mask,
            past_key_values=kv,
            use_cache=True,
        ).last_hidden_state
        logits = model.lm_head(hidden[:, -1])
        kv.end_step()
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, kv.n)
        finished = []
        for row, a in enumerate(self._active):
            try:
                params, constraint, row_logits = a.req.params, a.req.constraint, logits[row]
                if constraint is not None:
                    row_logits = constraint.mask(row_logits)
                token = sample(row_logits, params, a.req.seed, step=a.generated)
                if constraint is not None:
                    constraint.accept(token)
                logprobs = candidates(row_logits, token, params.logprobs) if params.logprobs is not None else None
                done = self._emit(a, token, kv.lens[row], logprobs)
            except Exception as e:  # this request's sampling or output failed: it alone ends
                log.exception("decode request %s failed", a.req.request_id)
                a.stream.put(e)
                done = True
            if done:
                finished.append(row)
                tracing.mark("decode", a.admitted, context=a.trace, tokens=a.generated)  # in the batch to its end
        for row in reversed(finished):  # highest first, so moved rows stay valid
            kv.remove(row)
            last = self._active.pop()
            if row < len(self._active):
                self._active[row] = last
