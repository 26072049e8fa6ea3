"""The path a request takes through the stages: its mode's chain, adapted to the request and to what runs.

- A request without images skips ``encode``.
- With ``local_encode_images`` N, a request with at most N images is encoded on a worker that also
  prefills (E/P/D -> ``encode_prefill``, E/PD -> ``generate``) when one runs.
- A prompt of at most ``local_prefill_tokens`` tokens is prefilled on the decode worker (E/P/D; EP/D when
  text-only): no prefill hop, no KV transfer (:func:`with_local_prefill`, once the prompt length is known).
- When a stage the mode needs has no live instance, the request falls back to the next mode whose stages
  run: E/P/D -> E/PD -> EPD, EP/D -> E/PD -> EPD; when none runs there is no plan (the scheduler answers 503).

Pure functions over stage names: the scheduler model calls them, unit tests check them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..protocol import MODES

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
