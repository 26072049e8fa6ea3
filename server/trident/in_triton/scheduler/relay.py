"""The client's stream of one request: the first text sent early from the prefill's record, and the last stage's
responses passed on as they come, in a thread of their own.

A stage's stream is an iterator of its responses as data (:func:`trident.core.stagecall.responses_of`): the outputs
(name -> array) of each, or the stage's error (a :class:`~trident.core.errors.TridentError`). What goes to the client
goes through the request's :class:`~trident.in_triton.scheduler.flow.Responder`.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Iterable

import numpy as np

from trident.core import tracing
from trident.core.errors import TridentError, Unavailable, WorkerLost, client_message
from trident.core.protocol import RECORD_TENSOR, HFKVRecord, VLLMKVRecord, decode_record
from trident.in_triton.scheduler.request import EntryRequest

CANCEL_CHECK_S = 0.05  # how often a stream looks for a cancelled client (an IPC call to Triton each time)
_KV_RECORDS = (HFKVRecord, VLLMKVRecord)


class StageGone(Exception):
    """The chosen instance is not there any more (its worker does not answer, or is stopping): try another."""


class Migrate(Exception):
    """The stage instance streaming the request went away after the client had some of its answer: the request is
    planned again and its new stream replays what the client has (dropped, checked to be the same) before it goes on
    (:func:`relay`)."""

    def __init__(self, instance: str, stage: str, reason: str, message: str) -> None:
        super().__init__(instance)
        self.instance, self.stage, self.reason, self.message = instance, stage, reason, message


def send_early(record: tuple[str, bytes] | None, req: EntryRequest) -> bytes | None:
    """Send a streaming client the first response now when the prefill told its text (the ``first_text``
    of ``kv_meta``: see :class:`~trident.core.protocol.HFKVRecord`), rather than after the decode call's round
    trip. Returns the text sent (the decode's first response, which :func:`relay` then drops), or None."""
    if record is None or record[0] != RECORD_TENSOR["kv"] or not req.asked("stream") \
            or req.asked("return_logprobs") or req.asked("return_cumulative_logprob"):
        return None  # (the logprobs of the first token are the decode's to tell)
    try:
        kv = decode_record(record[1], _KV_RECORDS)
    except TridentError:  # not ours to refuse: the decode stage names the problem
        return None
    if kv.first_text is None:
        return None
    text = kv.first_text.encode("utf-8")
    # the decode's first response as it would be: one token, not the last (finish_reason "None")
    outputs = {"text_output": np.array([text], dtype=np.object_)}
    if req.asked("return_finish_reason"):
        outputs["finish_reason"] = np.array([b"None"], dtype=np.object_)
    if req.asked("return_num_input_tokens"):
        outputs["num_input_tokens"] = np.array([kv.prompt_len], dtype=np.uint32)
    if req.asked("return_num_output_tokens"):
        outputs["num_output_tokens"] = np.array([1], dtype=np.uint32)
    t1 = req.first_ns = time.monotonic_ns()
    req.responder.send(outputs)
    req.sent_text, req.sent_tokens, req.sent_responses = text, 1, 1
    tracing.mark("first_send", t1)
    req.held.add("trident_decisions_total", decision="first_text_from_prefill")
    req.held.apply()
    return text


def relay(stream: Iterable, instance: str, req: EntryRequest, unasked: set[str], log_error: Callable[[str], None],
          step: str = "stream", t0: int = 0) -> str:
    """Send the stage's responses to the client; looks for a cancelled client every ``CANCEL_CHECK_S``. Returns
    "done" or "cancelled" (the caller then stops the stage). The call (from ``t0``) up to its first response is timed
    as ``step``, the first send to the client as ``first_send``.

    The stage's responses carry ``finish_reason`` (its last one's not "None") and the token counts (asked for
    whether or not the client did; passed on only where it did: ``unasked`` are the ones it did not; the counts
    go to ``req.answered``). A stream whose worker went away (:class:`~trident.core.errors.WorkerLost`, or a stream
    that ends without a last response) with nothing sent yet raises :class:`StageGone` (the request is planned
    again); after some of the answer, :class:`Migrate` (up to ``scheduling.migration_limit``): the request is
    planned again, and the new stream's first tokens, the ones the client has (``req.sent_text``,
    ``req.sent_tokens``), are checked to be the same and dropped before it goes on (greedy and seeded requests
    continue exactly; one that sampled differently ends with a 503). A stage's error before anything was sent is
    raised (the request's error); after, it ends the client's stream.

    ``req.early``: the text already sent as the first response (:func:`send_early`); the stage's first response,
    the same text, is not sent again.
    """
    out, held = req.responder, req.held
    stage = step.split(":", 1)[-1]
    resumed = req.migrations > 0
    early = None if resumed else req.early
    replay, left = (req.sent_text, req.sent_tokens) if resumed else (b"", 0)  # what the client has: dropped
    before = req.sent_responses  # (the early first text's, or a moved request's earlier streams')
    finished, check_at = False, time.monotonic() + CANCEL_CHECK_S
    prompt = generated = 0  # the answer's token counts, from the stage's responses
    last_ns = req.first_ns or 0  # when the client's last response went out
    for item in stream:
        if time.monotonic() >= check_at:
            if out.cancelled():
                return "cancelled"
            check_at = time.monotonic() + CANCEL_CHECK_S
        if isinstance(item, TridentError):
            if isinstance(item, WorkerLost):
                if not req.sent_responses:
                    raise StageGone(instance)
                if req.n == 1:
                    raise Migrate(instance, stage, "worker_lost", client_message(item))
            if req.sent_responses > before:  # the client has a partial answer: end it with the stage's error
                out.end(item)
                return "done"
            raise item
        reason = finish_reason(item)
        n_in, n_out = counts(item)
        prompt, generated = n_in or prompt, generated + n_out  # (each response counts its own tokens)
        outputs = {name: value for name, value in item.items() if name not in unasked}
        skipped = 0  # of this response's tokens, those the client has
        if early is not None:  # the stage's first response: the one already sent
            outputs, early = _not_again(outputs, early, reason, instance, log_error), None
            tracing.mark(step, t0)
            if outputs is None:
                return _diverged(req, instance)
            skipped = n_out if not outputs else 1
            if out.cancelled():  # (see RequestFlow._stream)
                return "cancelled"
        elif left:  # a moved request's new stream: what the client has first
            past = _past_replay(outputs, n_out, reason, replay, left)
            if past is None:
                return _diverged(req, instance)
            outputs, replay, left, skipped = past
        if reason is not None:
            finished = True
        if outputs:
            t1 = 0 if req.sent_responses else time.monotonic_ns()
            out.send(outputs)
            last_ns = time.monotonic_ns()
            req.sent_text += text_of(outputs) or b""
            req.sent_tokens += n_out - skipped
            if not req.sent_responses:
                req.first_ns = t1
                tracing.mark(step, t0, t1)
                tracing.mark("first_send", t1)
                if held is not None:  # the first response is out: now the metric updates (an IPC each),
                    held.loop.call_soon_threadsafe(held.apply)  # from the model's event loop, as before
            req.sent_responses += 1
    if not finished:
        if not req.sent_responses:
            raise StageGone(instance)
        if req.n == 1:
            raise Migrate(instance, stage, "cut_off", f"stage instance {instance} stopped before the end of the "
                          "answer (its worker exited or its model was unloaded)")
        out.end(Unavailable(f"stage instance {instance} stopped before the end of the answer (its worker exited "
                            "or its model was unloaded)"))
        return "done"
    out.end()
    req.answered = (prompt, generated, last_ns or time.monotonic_ns(), req.sent_responses)
    return "done"


def _diverged(req: EntryRequest, instance: str) -> str:
    """End a client's stream whose new stream (after a stage instance went away) did not begin with what the
    client has: the request sampled differently."""
    req.responder.end(Unavailable(f"the answer was cut off: a stage instance went away, and the retry on {instance} "
                                  "began differently (it sampled again); retry the request"))
    return "done"


def _past_replay(outputs: dict, n_out: int, reason: bytes | None, replay: bytes, left: int):
    """One response of a moved request's new stream while it replays what the client has (``replay``: that
    text not yet matched, ``left``: its tokens): (the outputs to send, possibly none, the replay and tokens left,
    this response's tokens the client has), or None when the stream does not match what the client has."""
    text = text_of(outputs)
    if text is None:
        return None
    if n_out <= left:  # all of it the client has
        if not replay.startswith(text) or (reason is not None and n_out < left):
            return None
        if reason is None:
            return {}, replay[len(text):], left - n_out, n_out
        rest, skip = b"", n_out  # (it ends just where the client's answer does: its end goes out, empty)
    else:  # the client has its first ``left`` tokens
        if not text.startswith(replay):
            return None
        rest, skip = text[len(replay):], left
    cut = dict(outputs, text_output=np.array([rest], dtype=np.object_))
    if "num_output_tokens" in cut:
        cut["num_output_tokens"] = np.array([n_out - skip], dtype=np.uint32)
    if "logprobs" in cut:
        entries = json.loads(cut["logprobs"].reshape(-1)[0] or b"[]")
        if isinstance(entries, list):
            cut["logprobs"] = np.array([json.dumps(entries[skip:]).encode()], dtype=np.object_)
    return cut, b"", 0, skip


def _not_again(outputs: dict, early: bytes, reason: bytes | None, instance: str,
               log_error: Callable[[str], None]) -> dict | None:
    """The stage's first response's outputs (those the client asked for) less what :func:`send_early` sent
    already; None when that response does not begin with it. The same response is dropped whole (the early
    one carried its outputs); one with more text (a retry's) goes on with the rest only when the client asked
    for nothing that counts its tokens."""
    first = text_of(outputs)
    if first == early and reason is None:
        return {}
    if first is not None and first.startswith(early) and len(outputs) == 1:  # the same first token, then more
        return {"text_output": np.array([first[len(early):]], dtype=np.object_)}
    log_error(f"{instance}'s first response does not begin with the first text already sent ({early[:40]!r})")
    return None


def finish_reason(outputs: dict) -> bytes | None:
    """The response's ``finish_reason`` once every choice has one (the stream's last response; ``n`` > 1: one
    element per choice), else None."""
    value = outputs.get("finish_reason")
    if value is None:
        return None
    value = value.reshape(-1)
    # ("None": not finished, as the vLLM backend says it)
    done = value.size and all(isinstance(v, bytes) and v not in (b"", b"None") for v in value)
    return value[-1] if done else None


def text_of(outputs: dict) -> bytes | None:
    """The ``text_output`` of a response (one choice), or None."""
    value = outputs.get("text_output")
    if value is None:
        return None
    value = value.reshape(-1)
    return value[0] if value.size == 1 and isinstance(value[0], bytes) else None


def counts(outputs: dict) -> tuple[int, int]:
    """(num_input_tokens, num_output_tokens: of every choice) of a stage's response (0 where absent)."""
    n_in, n_out = outputs.get("num_input_tokens"), outputs.get("num_output_tokens")
    n_in = n_in.reshape(-1) if n_in is not None else None
    return (int(n_in[0]) if n_in is not None and n_in.size else 0,
            int(n_out.reshape(-1).sum()) if n_out is not None else 0)
