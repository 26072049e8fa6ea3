"""One client request to an entry model, as the BLS serves it: what it came with and what it has had."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EntryRequest:
    """A request's state across the attempts of :meth:`TritonPythonModel._run
    <trident.scheduler.model.TritonPythonModel._run>` (a stage instance that went away makes the request planned
    again)."""

    triton: Any  # Triton's request (``is_cancelled``)
    sender: Any  # its response sender
    held: Any  # its metric updates, held until its first response is out (SchedulerMetrics.held)
    inputs: dict = field(default_factory=dict)  # entry tensors by name (pb_utils.Tensor, or arrays passed on)
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
        return self.triton.is_cancelled()
