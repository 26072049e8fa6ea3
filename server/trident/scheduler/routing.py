"""Which instance of a stage gets a request: round-robin, least-loaded, or affinity.

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
from typing import Iterable

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
