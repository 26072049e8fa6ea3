"""Where a request goes: the stages it runs through (its :class:`Plan`), and which instance serves each call.

**The plan**: the mode's chain of stages, adapted to the request and to what runs.

- A request without images skips ``encode``.
- With ``local_encode_images`` N, a request with at most N images is encoded on a worker that also
  prefills (E/P/D -> ``encode_prefill``, E/PD -> ``generate``) when one runs.
- A prompt of at most ``local_prefill_tokens`` tokens is prefilled on the decode worker (E/P/D; EP/D when
  text-only): no prefill hop, no KV transfer (:func:`with_local_prefill`, once the prompt length is known).
- When a stage the mode needs has no live instance, the request falls back to the next mode whose stages
  run: E/P/D -> E/PD -> EPD, EP/D -> E/PD -> EPD; when none runs there is no plan (the scheduler answers 503).

The plan's functions are pure functions over stage names: the scheduler model calls them, unit tests check them.

**The instance**: which instance of a stage gets a call: round-robin, least-loaded, or affinity.

The scheduler counts the requests it has in flight on each instance (:meth:`Router.begin` /
:meth:`Router.end`). ``affinity`` remembers where each key went (an image's content id for the encode
stage, the prompt prefix for the stages that keep a prefix cache) and sends a request back there, unless
that instance has ``slack`` more requests in flight than the least-loaded one; then, and for keys never
seen, it sends it to the least-loaded instance.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable

from trident.core.protocol import MODES


# -- the plan ------------------------------------------------------------------------------------------------------
FALLBACK: dict[str, tuple[str, ...]] = {
    "epd": ("epd",),
    "e_pd": ("e_pd", "epd"),
    "e_p_d": ("e_p_d", "e_pd", "epd"),
    "ep_d": ("ep_d", "e_pd", "epd"),
}
"""Each mode, then the modes its requests fall back to, in order."""

LOCAL_ENCODE: dict[str, tuple[str, ...]] = {"e_p_d": ("encode_prefill", "decode"), "e_pd": ("generate",)}
"""The chain of a mode when its prefill worker encodes the images itself."""


@dataclass(frozen=True)
class Plan:
    """The stages a request runs through, in order, and why (for its log line and metrics)."""

    mode: str  # the mode asked for
    runs_as: str  # the mode whose stages run (another one after a fallback)
    stages: tuple[str, ...]
    decisions: tuple[str, ...] = ()
    local_prefill: bool = False  # the decode stage prefills the prompt itself

    @property
    def path(self) -> str:
        """E.g. ``encode>prefill>decode``; a decode stage that prefills itself shows as ``decode(prefill)``."""
        names = list(self.stages)
        if self.local_prefill:
            names[-1] += "(prefill)"
        return ">".join(names)

    @property
    def fell_back(self) -> bool:
        return self.runs_as != self.mode


def plan(mode: str, num_images: int, live: set[str], local_encode_images: int = 0) -> Plan | None:
    """The first workable chain for ``mode`` given the stages with a live instance (None: nothing runs)."""
    for runs_as in FALLBACK[mode]:
        stages = MODES[runs_as]
        decisions: list[str] = [f"fallback:{runs_as}"] if runs_as != mode else []
        if stages[0] == "encode" and num_images == 0:
            stages = stages[1:]
            decisions.append("skip_encode")
        elif stages[0] == "encode" and 0 < num_images <= local_encode_images:
            local = LOCAL_ENCODE.get(runs_as)
            if local is not None and set(local) <= live:
                stages = local
                decisions.append("local_encode")
        if set(stages) <= live:
            return Plan(mode, runs_as, tuple(stages), tuple(decisions))
    return None


def needs_prompt_length(p: Plan, local_prefill_tokens: int) -> bool:
    """Whether :func:`with_local_prefill` could change the plan (then the prompt must be measured)."""
    return local_prefill_tokens > 0 and _prefill_before_decode(p) is not None


def with_local_prefill(p: Plan, prompt_tokens: int, local_prefill_tokens: int, has_images: bool) -> Plan:
    """Drop the prefill hop of a short prompt: the decode stage prefills it (the stage before it must be a
    pure prefill, or an ``encode_prefill`` of a text-only prompt: the decode stage does not encode)."""
    i = _prefill_before_decode(p)
    if i is None or prompt_tokens > local_prefill_tokens:
        return p
    if p.stages[i] == "encode_prefill" and has_images:
        return p
    stages = p.stages[:i] + p.stages[i + 1 :]
    return replace(p, stages=stages, decisions=p.decisions + ("local_prefill",), local_prefill=True)


def _prefill_before_decode(p: Plan) -> int | None:
    if len(p.stages) >= 2 and p.stages[-1] == "decode" and p.stages[-2] in ("prefill", "encode_prefill"):
        return len(p.stages) - 2
    return None


# -- the instance --------------------------------------------------------------------------------------------------
POLICIES = ("round_robin", "least_loaded", "affinity")
PREFIX_CHUNK = 64  # characters per prefix-key step
PREFIX_STEPS = 8  # prefixes of up to 8 chunks are remembered, plus the whole prompt


def prefix_keys(text: str, image_ids: Iterable[str] = ()) -> list[str]:
    """Keys of a prompt's prefixes, longest first: the whole prompt with its images, then text prefixes
    at chunk boundaries (images are part of every key: a prefix cache holds them with the text)."""
    images = ",".join(image_ids)
    ends = [len(text)] + [n * PREFIX_CHUNK for n in range(min(PREFIX_STEPS, len(text) // PREFIX_CHUNK), 0, -1)]
    keys: list[str] = []
    for end in dict.fromkeys(ends):
        h = hashlib.blake2b(f"{images}|{end}|".encode() + text[:end].encode(), digest_size=12).hexdigest()
        keys.append(h)
    return keys


class AffinityIndex:
    """key -> the instance it was last sent to, bounded (least recently used keys go first)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def lookup(self, keys: Iterable[str], alive: set[str]) -> str | None:
        """The instance holding the most of ``keys`` (for prefix keys: the longest prefix wins ties)."""
        votes: Counter[str] = Counter()
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            where = self._where.get(key)
            if where is not None and where in alive:
                self._where.move_to_end(key)
                votes[where] += 1
                first.setdefault(where, i)
        if not votes:
            return None
        return max(votes, key=lambda w: (votes[w], -first[w]))

    def remember(self, keys: Iterable[str], instance: str) -> None:
        for key in keys:
            self._where[key] = instance
            self._where.move_to_end(key)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, instance: str) -> None:
        for key in [k for k, w in self._where.items() if w == instance]:
            del self._where[key]


class Router:
    """Chooses among the live instances of a stage and counts what is in flight on each."""

    def __init__(self, policy: str = "affinity", slack: int = 2) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; policies: {', '.join(POLICIES)}")
        self.policy = policy
        self.slack = slack
        self.inflight: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()
        self._turns: dict[str, itertools.count] = {}  # per stage: a stage's turns do not depend on another's
        self._affinity: dict[str, AffinityIndex] = {}  # per stage

    def choose(self, stage: str, instances: list[str], keys: list[str] = ()) -> tuple[str, str]:
        """``(instance, why)`` for a request to ``stage``; ``instances`` are the live ones, in a stable order."""
        if not instances:
            raise ValueError(f"no live instance of {stage}")
        if len(instances) == 1:
            chosen, why = instances[0], "only"
        elif self.policy == "round_robin":
            chosen, why = instances[self._next_turn(stage) % len(instances)], "round_robin"
        else:
            chosen, why = self._least_loaded(stage, instances), "least_loaded"
            if self.policy == "affinity" and keys:
                index = self._affinity.setdefault(stage, AffinityIndex())
                where = index.lookup(keys, set(instances))
                if where is not None and self.inflight[where] - self.inflight[chosen] <= self.slack:
                    chosen, why = where, "affinity"
                elif where is not None:
                    why = "affinity_overloaded"
        if self.policy == "affinity" and keys:
            self._affinity.setdefault(stage, AffinityIndex()).remember(keys, chosen)
        return chosen, why

    def _next_turn(self, stage: str) -> int:
        return next(self._turns.setdefault(stage, itertools.count()))

    def _least_loaded(self, stage: str, instances: list[str]) -> str:
        """Fewest in flight; ties go round-robin so that an idle pool still spreads its requests."""
        low = min(self.inflight[i] for i in instances)
        tied = [i for i in instances if self.inflight[i] == low]
        return tied[self._next_turn(stage) % len(tied)]

    def begin(self, instance: str) -> None:
        self.inflight[instance] += 1
        self.routed[instance] += 1

    def end(self, instance: str) -> None:
        self.inflight[instance] -= 1
        if self.inflight[instance] <= 0:
            del self.inflight[instance]

    def forget(self, instance: str) -> None:
        """An instance went away: nothing is sent there by affinity any more."""
        for index in self._affinity.values():
            index.forget(instance)
