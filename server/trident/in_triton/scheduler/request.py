"""One client request to an entry model, as the scheduler serves it: what it came with and what it has had."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trident.core.errors import InvalidRequest
from trident.core.media import MODALITIES, check_count, content_id, decode_base64
from trident.core.protocol import MAX_CHOICES, MAX_SAMPLING_JSON
from trident.in_triton.scheduler.routing import prefix_keys


@dataclass
class EntryRequest:
    """A request's state across the attempts of :meth:`RequestFlow._run <trident.in_triton.scheduler.flow.RequestFlow._run>`
    (a stage instance that went away makes the request planned again)."""

    responder: Any  # its way back to the client (a flow.Responder)
    held: Any  # its metric updates, held until its first response is out (SchedulerMetrics.held)
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # entry tensors by name
    text: str = ""
    text_ids: list[int] | None = None  # its text's token ids, once measured (PromptLength.ids)
    image_ids: list[str] = field(default_factory=list)  # content ids of its media items
    kinds: list[str] = field(default_factory=list)  # each item's modality
    keys: list[str] = field(default_factory=list)  # its prefix keys, for affinity routing
    records: dict[str, bytes] = field(default_factory=dict)  # the records of this attempt, by tensor name
    early: bytes | None = None  # the first text, sent from the prefill's kv_meta before the decode call
    n: int = 1  # the choices it asks for (``sampling_parameters.n``)
    arrived_ns: int = 0  # time.monotonic_ns() at its arrival
    first_ns: int | None = None  # ... when its first response went out
    # what the client has of the answer (text, tokens, responses), across the request's attempts; and how many times
    # it moved to another stage instance (its worker went away mid-stream)
    sent_text: bytes = b""
    sent_tokens: int = 0
    sent_responses: int = 0
    migrations: int = 0
    # once answered: (prompt tokens, generated tokens, its last response's time, the responses it had)
    answered: tuple[int, int, int, int] | None = None

    def cancelled(self) -> bool:
        return self.responder.cancelled()

    def read(self, inputs: dict[str, np.ndarray], text_limit: int | None) -> None:
        """Take the entry tensors: the prompt's text (``text_limit``: the most bytes a text that fits the context
        window can have), the media's content ids (base64 checked here; the items are decoded where they are
        encoded), the prefix keys and the choices asked for (``sampling_parameters``' size is bounded here; the stages
        read the rest). Raises :class:`InvalidRequest` naming what is wrong."""
        self.inputs = inputs
        sampling = inputs.get("sampling_parameters")
        if sampling is not None and sampling.size and len(raw := sampling.reshape(-1)[0]) > MAX_SAMPLING_JSON:
            raise InvalidRequest(f"sampling_parameters has {len(raw)} bytes; at most {MAX_SAMPLING_JSON}")
        self.n = choices(sampling)
        self.text = _text(inputs.get("text_input"), text_limit)
        self.image_ids, self.kinds = _media_ids(inputs)
        self.keys = prefix_keys(self.text, self.image_ids)

    def asked(self, name: str) -> bool:
        """Whether a BOOL control input (``stream``, ``return_*``) is set (absent: false)."""
        return flag(self.inputs.get(name))


def flag(value: np.ndarray | None) -> bool:
    """A BOOL control input (absent: false)."""
    if value is None:
        return False
    values = value.reshape(-1)
    return bool(values[0]) if values.size else False


def choices(value: np.ndarray | None) -> int:
    """``sampling_parameters.n``, for the metrics (1 where absent or not a number: the stages check it)."""
    if value is None:
        return 1
    try:
        raw = value.reshape(-1)[0]
        n = json.loads(raw).get("n", 1) if b'"n"' in raw else 1
    except (ValueError, AttributeError, IndexError, TypeError, RecursionError):  # (the stages name the problem)
        return 1
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES else 1


def _text(value: np.ndarray | None, limit: int | None = None) -> str:
    if value is None:
        raise InvalidRequest("text_input is required")
    values = value.reshape(-1)
    if values.size == 0:
        raise InvalidRequest("text_input is empty")
    first = values[0]
    size = len(first) if isinstance(first, bytes) else len(str(first).encode("utf-8", "surrogatepass"))
    if limit is not None and size > limit:
        raise InvalidRequest(f"text_input is {size} bytes: more than any prompt that fits the model's context "
                             f"window can have ({limit} bytes)")
    try:
        text = first.decode("utf-8") if isinstance(first, bytes) else str(first)
    except UnicodeDecodeError:
        raise InvalidRequest("text_input is not valid UTF-8") from None
    if not text:
        raise InvalidRequest("text_input is empty")
    return text


def _media_ids(inputs: dict[str, np.ndarray]) -> tuple[list[str], list[str]]:
    """Content ids and kinds of the request's media, images then video then audio."""
    ids: list[str] = []
    kinds: list[str] = []
    for kind in MODALITIES:
        value = inputs.get(kind)
        if value is None:
            continue
        values = value.reshape(-1)
        check_count(kind, len(values))
        ids += [content_id(decode_base64(v, i, kind), kind) for i, v in enumerate(values)]
        kinds += [kind] * len(values)
    return ids, kinds
