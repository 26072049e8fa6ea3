"""Output side of a request, one copy for every engine and stage.

- :class:`TextStream`: generated token ids -> text deltas, holding back partial characters and stop-string
  prefixes.
- :class:`RequestOutput`: one request's finish rules (EOS, stop strings, max_tokens, context window) over
  its text stream; a decoder pushes each sampled token and gets a :class:`DecodeEvent`.
- :func:`entry_responses`: a generation's events -> the entry interface's responses (Triton vLLM backend
  semantics: streamed deltas, or one response with the whole text).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate at a generated position: its token, its log-probability (the log-softmax of the model's raw
    logits, before temperature and the other sampling rules, as vLLM's default ``raw_logprobs``) and its rank
    (1: the likeliest; ties share the larger rank, as in vLLM)."""

    token_id: int
    logprob: float
    rank: int


@dataclass
class DecodeEvent:
    """One step's output of a request: new token ids and text; ``finish_reason`` set on the last event.

    ``logprobs``: when the request asked for them (``sampling_parameters.logprobs``), one entry per new token in the
    vLLM backend's shape, ``{token id: {"logprob", "rank", "decoded_token"}}`` (the sampled token, then the top
    ones); ``cumulative_logprob``: the sampled tokens' logprobs summed so far (None when not asked for)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" | "abort"
    num_output_tokens: int = 0
    extra: dict = field(default_factory=dict)
    logprobs: list[dict[int, dict]] | None = None
    cumulative_logprob: float | None = None
    index: int = 0  # the choice it belongs to (0 .. n-1: ``sampling_parameters.n``)


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's own text (a logprob entry's ``decoded_token``): the tokenizer's decoding of it alone, with the
    leading spaces a SentencePiece piece (``▁word``) stands for, which decoding a piece alone drops."""
    text = tokenizer.decode([token_id]) or ""
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    markers = len(piece) - len(piece.lstrip("\u2581"))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def logprob_entry(tokenizer: Any, candidates: list[TokenLogprob]) -> dict[int, dict]:
    """One position's entry in the vLLM backend's shape."""
    return {c.token_id: {"logprob": c.logprob, "rank": c.rank, "decoded_token": token_text(tokenizer, c.token_id)}
            for c in candidates}


@dataclass
class Generation:
    """A started generation: the prompt's length and its events (close ``events`` to stop it early)."""

    num_input_tokens: int
    events: AsyncIterator[DecodeEvent]


class TextStream:
    """Turns generated token ids into text deltas and finds stop strings.

    Text that could be the start of a stop string, or an incomplete UTF-8 character, is held back until
    it is known not to be.

    A token's text is decoded from a window of the last few tokens (``_WINDOW`` the text has settled on, the context
    a token's text depends on: a leading space, the bytes of a character), never from the whole output, and a stop
    string is looked for only where it could end in the new text.
    """

    _WINDOW = 5

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        # per stop string, by character: the lengths k (longest first) of its prefixes s[:k] ending in it, the
        # only ones the text can end with when it ends in that character
        self._ends = [{c: sorted((k for k in range(1, len(s)) if s[k - 1] == c), reverse=True) for c in set(s)}
                      for s in self._stop]
        self._ids: list[int] = []
        self._settled = ""  # the text of ids[:_read]
        self._start = 0  # ids[_start:_read]: the window decoded again for context; its text ends _settled
        self._read = 0
        self._context = ""  # the text of ids[_start:_read] alone
        self._emitted = 0  # characters of the text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _pending(self) -> str:
        """The text of the tokens past ``_read``, decoded after the window's context."""
        return self._decode(self._ids[self._start:])[len(self._context):]

    def _advance(self) -> str:
        """The text so far: settled up to the last token whose text is whole (not ending in a broken character)."""
        pending = self._pending()
        if not pending or pending.endswith("\ufffd"):
            return self._settled + pending
        self._settled += pending
        self._read = len(self._ids)
        self._start = max(0, self._read - self._WINDOW)
        self._context = self._decode(self._ids[self._start:self._read])
        return self._settled

    @property
    def text(self) -> str:
        """The whole text so far (what the tokenizer makes of every token at once)."""
        return self._settled + self._pending()

    def push(self, token: int) -> str:
        """Add a token; return the new text that is safe to emit (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self._advance()
        for s in self._stop:
            at = text.find(s, max(0, self._emitted - len(s)))
            if at != -1:
                self.stopped = True
                return self._take(text[:at])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            return ""
        hold = max((self._held(s, ends, text) for s, ends in zip(self._stop, self._ends)), default=0) if text else 0
        return self._take(text[: len(text) - hold])

    @staticmethod
    def _held(stop: str, ends: dict[str, list[int]], text: str) -> int:
        """The longest k < len(stop) such that ``text`` ends with ``stop[:k]`` (0: none): text that may be the start
        of ``stop``, held back until the next tokens tell."""
        return next((k for k in ends.get(text[-1], ()) if text.endswith(stop[:k])), 0)

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        return "" if self.stopped else self._take(self.text)

    def _take(self, upto: str) -> str:
        if len(upto) <= self._emitted:
            return ""
        delta = upto[self._emitted :]
        self._emitted = len(upto)
        return delta


class RequestOutput:
    """The output side of one decode request: each sampled token in, a :class:`DecodeEvent` out."""

    def __init__(self, processor, params, index: int = 0) -> None:
        self.params = params
        self.index = index  # the choice (of ``params.n``) its events belong to
        self.text = TextStream(processor.tokenizer, params.stop)
        self._eos = processor.eos_token_ids
        self._max_len = processor.max_model_len
        self._tokenizer = processor.tokenizer
        self.generated = 0
        self.cumulative_logprob: float | None = None

    def push(self, token: int, cache_len: int, candidates: list[TokenLogprob] | None = None) -> DecodeEvent:
        """The event of a sampled ``token`` with ``cache_len`` positions already in the KV cache; ``candidates``:
        its logprob entry (the sampled token's first) when the request asked for logprobs."""
        self.generated += 1
        entries = None
        if candidates is not None:
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + candidates[0].logprob
            entries = [logprob_entry(self._tokenizer, candidates)]
        is_eos = token in self._eos and not self.params.ignore_eos
        text = "" if is_eos else self.text.push(token)
        reason = None
        if is_eos or self.text.stopped:
            reason = "stop"
        elif self.generated >= self.params.max_tokens or cache_len + 1 >= self._max_len:
            reason = "length"
        if reason is not None and not self.text.stopped:
            text += self.text.flush()
        return DecodeEvent([token], text, reason, self.generated, logprobs=entries,
                           cumulative_logprob=self.cumulative_logprob, index=self.index)

    def abort(self) -> DecodeEvent:
        return DecodeEvent([], "", "abort", self.generated, cumulative_logprob=self.cumulative_logprob,
                           index=self.index)


def early_text(first: DecodeEvent | None) -> str | None:
    """What a kv record's ``first_text`` carries for the decode's ``first`` event (None when the decode side
    will not start from the prefill's token): its text, when that response is neither empty nor the last."""
    if first is None or not first.text or first.finish_reason is not None:
        return None
    return first.text


# -- the entry interface's responses ---------------------------------------------------------------------
@dataclass(frozen=True)
class OutputOptions:
    """The entry interface's output controls (Triton vLLM backend semantics)."""

    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _strings(texts: list[str]) -> np.ndarray:
    """A STRING[n] output."""
    return np.array([t.encode("utf-8") for t in texts], dtype=np.object_)


class _Choice:
    """One choice's state across a request's responses."""

    def __init__(self) -> None:
        self.events: list[DecodeEvent] = []  # not in a response yet
        self.reason: str | None = None
        self.cumulative: float | None = None
        self.logprobs = False  # whether its events carry logprobs (the request asked for them)

    def take(self) -> list[DecodeEvent]:
        events, self.events = self.events, []
        for e in events:
            self.reason = e.finish_reason or self.reason
            self.cumulative = e.cumulative_logprob if e.cumulative_logprob is not None else self.cumulative
            self.logprobs = self.logprobs or e.logprobs is not None or e.cumulative_logprob is not None
        return events


def _response(choices: list[_Choice], news: list[list[DecodeEvent]], texts: list[str], opts: OutputOptions,
              num_input_tokens: int) -> dict:
    """One response covering each choice's events ``news`` (those not sent yet), in the vLLM backend's shape: every
    output the request asked for on every response, one element per choice (``n``); ``finish_reason`` "None" for a
    choice not finished; ``num_output_tokens`` and ``logprobs`` the tokens new since the last response;
    ``cumulative_logprob`` so far (NaN where logprobs were not asked for)."""
    out = {"text_output": _strings(texts)}
    if opts.return_finish_reason:
        out["finish_reason"] = np.array([str(c.reason).encode() for c in choices], dtype=np.object_)
    if opts.return_cumulative_logprob:
        out["cumulative_logprob"] = np.array(
            [float("nan") if c.cumulative is None else c.cumulative for c in choices], dtype=np.float32)
    if opts.return_logprobs:
        out["logprobs"] = np.array([
            (json.dumps([entry for e in new for entry in e.logprobs or ()]) if c.logprobs else "null").encode()
            for c, new in zip(choices, news)], dtype=np.object_)
    if opts.return_num_input_tokens:
        out["num_input_tokens"] = np.array([num_input_tokens], dtype=np.uint32)
    if opts.return_num_output_tokens:
        out["num_output_tokens"] = np.array([sum(len(e.token_ids) for e in new) for new in news], dtype=np.uint32)
    return out


async def entry_responses(
    generation: Generation, opts: OutputOptions, prompt: str | None, n: int = 1
) -> AsyncIterator[dict[str, np.ndarray]]:
    """A generation's events (of ``n`` choices) -> entry responses: when streaming, one per event with text (an
    event without text, held back, goes with its choice's next), with the other choices' outputs empty; else one
    with each choice's whole text (the prompt first unless ``exclude_input_in_output``). Stops the generation if
    the client goes away."""
    events, n_in = generation.events, generation.num_input_tokens
    choices = [_Choice() for _ in range(n)]
    try:
        if opts.stream:
            async for event in events:
                choice = choices[event.index]
                choice.events.append(event)
                if event.text or event.finish_reason is not None:
                    news = [[] for _ in choices]
                    news[event.index] = choice.take()
                    texts = ["" for _ in choices]
                    texts[event.index] = "".join(e.text for e in news[event.index])
                    yield _response(choices, news, texts, opts, n_in)
            return
        async for event in events:
            choices[event.index].events.append(event)
        news = [c.take() for c in choices]
        head = prompt if not opts.exclude_input_in_output and prompt else ""
        texts = [head + "".join(e.text for e in new) for new in news]
        yield _response(choices, news, texts, opts, n_in) if any(news) else {"text_output": _strings(texts)}
    finally:
        await events.aclose()


async def interleave(sources: list) -> AsyncIterator:
    """The items of several async iterators as each comes; the first error ends it all (the others are stopped)."""
    if len(sources) == 1:
        async for item in sources[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(source) -> None:
        try:
            async for item in source:
                await queue.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put(e)
            return
        await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
