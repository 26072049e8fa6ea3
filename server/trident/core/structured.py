"""Structured output: the constraint a request puts on its text, checked when it arrives and enforced as it is
sampled.

A request asks with ``sampling_parameters.structured_outputs`` in vLLM's names (``json``: a JSON schema,
``json_object``, ``regex``, ``choice``, ``grammar``: EBNF), as an object or, as Triton's vLLM backend takes it, a JSON
string; the OpenAI API's ``response_format`` and vLLM's ``guided_*`` fields arrive as the same
(:mod:`trident.frontend.schemas`). Exactly one is given, and it must compile: a schema, regex or grammar that does
not is a 400 naming the problem, before any work.

The vllm engine hands it to vLLM (its own structured outputs). The hf engine enforces it with xgrammar, the
library vLLM uses: a :class:`Constraint` per request masks the logits before each token is sampled (and before its
logprobs are taken, as in vLLM), from the first token (sampled where the prompt is prefilled) to the last. xgrammar
is imported on the first request that asks (it takes a few seconds of CPU).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from trident.core.errors import InvalidRequest, Unavailable

MAX_SPEC_BYTES = 64 << 10  # a schema, regex or grammar longer than this is refused (compiling costs with its size)
COMPILE_BUDGET_S = 10.0  # longest a request's constraint may take to compile for its model (and, apart, to wait for
# the compile thread)


class StructuredOutput(BaseModel):
    """vLLM's ``StructuredOutputsParams`` subset: exactly one of the fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: str | None = None  # vLLM's ``json`` (a schema as an object or a string), kept as its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None  # JSON without whitespace between its tokens (vLLM's)

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        if isinstance(data, (str, bytes)):  # (Triton's vLLM backend takes it as a JSON string)
            data = json.loads(data)
        if isinstance(data, dict) and "json" in data:
            data = dict(data)
            schema = data.pop("json")
            data["json_schema"] = schema if isinstance(schema, str) or schema is None else json.dumps(schema)
        return data

    @field_validator("choice")
    @classmethod
    def _choices(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and not v:
            raise ValueError("choice needs at least one string")
        return v

    @model_validator(mode="after")
    def _one_that_compiles(self) -> "StructuredOutput":
        given = [n for n in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        if len(self.key) > MAX_SPEC_BYTES:
            raise ValueError(f"is {len(self.key)} bytes; at most {MAX_SPEC_BYTES}")
        try:
            _grammar(self.key)
        except RuntimeError as e:  # xgrammar's message: "[time] file:line: what is wrong"
            found = re.match(r"\[[^\]]*\] \S+:\d+: (.*)", str(e).strip(), re.S)
            raise ValueError((found.group(1) if found else str(e)).strip() or "does not compile") from None
        return self

    @property
    def key(self) -> str:
        """One string that names the constraint (what grammars are cached by)."""
        return json.dumps({n: v for n, v in self.model_dump().items() if v}, sort_keys=True)

    def to_vllm(self) -> Any:
        from vllm.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams(json=self.json_schema, json_object=self.json_object, regex=self.regex,
                                       choice=list(self.choice) if self.choice else None, grammar=self.grammar,
                                       disable_any_whitespace=bool(self.disable_any_whitespace))


@lru_cache(maxsize=256)
def _grammar(key: str):
    """The xgrammar ``Grammar`` of a constraint (:attr:`StructuredOutput.key`)."""
    import xgrammar as xgr

    spec = json.loads(key)
    compact = {"any_whitespace": False, "separators": (",", ":")} if spec.get("disable_any_whitespace") else {}
    if "json_schema" in spec:
        return xgr.Grammar.from_json_schema(spec["json_schema"], **compact)
    if "json_object" in spec:  # (an object, as vLLM reads it, not any JSON value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', **compact)
    if "regex" in spec:
        return xgr.Grammar.from_regex(spec["regex"])
    if "choice" in spec:
        return xgr.Grammar.from_regex("|".join(_regex_literal(c) for c in spec["choice"]))
    return xgr.Grammar.from_ebnf(spec["grammar"])


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


class Grammars:
    """One model's compiler of constraints into token masks (its tokenizer and logits size), made on first use.

    A constraint is compiled once (:meth:`prepare`, awaited before the request's compute begins) on a thread of its
    own, within ``budget_s``: a request whose constraint takes longer gets a 400 naming the budget, and the same
    constraint is refused at once while its compile still runs. A request waits for that thread within the same
    budget, and at most ``MAX_QUEUED`` distinct constraints wait for it (past either: a 503). The last ``KEPT``
    compiled constraints are kept. A compile cannot be interrupted:
    one past its budget runs to its end on that thread, one core, while the worker serves everything else."""

    MAX_QUEUED = 8
    KEPT = 64

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 budget_s: float = COMPILE_BUDGET_S) -> None:
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self.budget_s = budget_s
        self._compiler = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="trident-grammar")
        self._lock = threading.Lock()  # the tables below, and the compiler's making
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # key -> xgrammar CompiledGrammar, least recent first
        self._queued: dict[str, Future] = {}  # key -> its compile, queued or running
        self._started: dict[str, float] = {}  # key -> when its compile began, while it runs
        self._late: set[str] = set()  # keys whose compile went past the budget and still runs

    async def prepare(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` for this model unless it is kept, off the event loop, within the budget; raises
        :class:`InvalidRequest` past it, :class:`Unavailable` when too many compiles wait."""
        key = spec.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return
            if key in self._late:
                raise InvalidRequest(self._too_long())
            compiling = self._queued.get(key)
            if compiling is None:
                if len(self._queued) >= self.MAX_QUEUED:
                    raise Unavailable(f"{len(self._queued)} structured outputs are waiting to compile on this worker; "
                                      "retry later")
                compiling = self._queued[key] = self._thread.submit(self._compile, key)
        done = asyncio.wrap_future(compiling)
        try:  # its turn on the thread, then its own compile, each within the budget
            await asyncio.wait_for(asyncio.shield(done), self.budget_s)
            return
        except asyncio.TimeoutError:
            started = self._started.get(key)
        if compiling.done():  # (just now)
            compiling.result()
            return
        if started is None:
            raise Unavailable(f"structured output: the compiles queued before this request's took more than "
                              f"{self.budget_s:g} s on this worker; retry later") from None
        try:
            await asyncio.wait_for(asyncio.shield(done), max(0.0, started + self.budget_s - time.monotonic()))
            return
        except asyncio.TimeoutError:
            with self._lock:
                if not compiling.done():
                    self._late.add(key)
        raise InvalidRequest(self._too_long())

    def _too_long(self) -> str:
        return (f"structured output: its constraint takes longer than {self.budget_s:g} s to compile for this model; "
                "give a smaller schema, regex or grammar")

    def _compile(self, key: str) -> Any:
        """On the compile thread: the compiled constraint, kept."""
        self._started[key] = time.monotonic()
        try:
            compiled = self._compiler_made().compile_grammar(_grammar(key))
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > self.KEPT:
                    self._compiled.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                self._queued.pop(key, None)
                self._started.pop(key, None)
                self._late.discard(key)

    def _compiler_made(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                tokenizer, vocab_size, stops = self._args
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # (kept here)
            return self._compiler

    def constraint(self, spec: StructuredOutput) -> "Constraint":
        """A request's constraint: compiled by :meth:`prepare` (here, if it was not)."""
        import xgrammar as xgr

        with self._lock:
            compiled = self._compiled.get(spec.key)
        if compiled is None:
            compiled = self._compile(spec.key)
        return Constraint(xgr.GrammarMatcher(compiled), self._args[1])


class Constraint:
    """One request's place in its grammar: :meth:`mask` the logits of its next token, then :meth:`accept` it."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._apply = xgr.apply_token_bitmask_inplace

    def mask(self, logits) -> Any:
        """``logits`` (one row) with every token the grammar does not allow next at -inf (a copy)."""
        row = logits.float().clone().unsqueeze(0)
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._apply(row, self._bitmask)
        return row[0]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise InvalidRequest(f"token {token} does not follow the request's structured output")
