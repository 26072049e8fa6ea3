"""The request metrics of Triton's vLLM backend, in its names, labels and buckets, for each entry model.

Dashboards and autoscalers written for the vLLM backend (``REPORT_CUSTOM_METRICS``) read eight ``vllm:*`` families
labelled ``model`` (the entry model's name) and ``version``. An entry model exports them for every engine and
mode, next to Trident's own ``trident_*`` families (:mod:`.metrics`), measured where the client's answer leaves:

- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``: the tokens of each answered request (its prompt
  with its media expanded, and what it generated);
- ``vllm:time_to_first_token_seconds``: from the request's arrival to its first response (for an answer sent in
  one response, that response);
- ``vllm:time_per_output_token_seconds``: each streamed answer's time from its first response to its last, per
  token after the first (one observation per request answered in two responses or more);
- ``vllm:e2e_request_latency_seconds``: from arrival to the last response;
- ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``: the two counts, per request;
- ``vllm:request_params_n``: the request's ``n``.

A request that fails or is cancelled is not observed (as in vLLM, where only finished requests are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trident.in_triton.metrics import keep_past_exit

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (the token-count buckets, up to the context length)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return out
            out.append(step * scale)
        scale *= 10


@dataclass(frozen=True)
class Answered:
    """One answered request as the metrics see it (times in seconds from its arrival)."""

    prompt_tokens: int
    generation_tokens: int
    first_s: float  # its first response
    last_s: float  # its last response
    responses: int = 1  # how many it had
    n: int = 1  # the choices it asked for


class EngineMetrics:
    """The eight ``vllm:*`` families of one entry model (no-ops where Triton's metrics API is unavailable)."""

    def __init__(self, model: str, version: str, context_length: int | None, pb_utils: Any = None) -> None:
        self._metrics: dict[str, Any] = {}
        if pb_utils is None or not hasattr(pb_utils, "MetricFamily"):
            return
        labels = {"model": model, "version": version}
        tokens = one_two_five(context_length or 1 << 20)
        families = {  # name: (kind, description, buckets)
            "vllm:prompt_tokens_total": ("COUNTER", "Number of prefill tokens processed.", None),
            "vllm:generation_tokens_total": ("COUNTER", "Number of generation tokens processed.", None),
            "vllm:time_to_first_token_seconds": ("HISTOGRAM", "Histogram of time to first token in seconds.",
                                                 TTFT_BUCKETS),
            "vllm:time_per_output_token_seconds": ("HISTOGRAM", "Histogram of time per output token in seconds.",
                                                   TPOT_BUCKETS),
            "vllm:e2e_request_latency_seconds": ("HISTOGRAM", "Histogram of end to end request latency in seconds.",
                                                 LATENCY_BUCKETS),
            "vllm:request_prompt_tokens": ("HISTOGRAM", "Number of prefill tokens processed.", tokens),
            "vllm:request_generation_tokens": ("HISTOGRAM", "Number of generation tokens processed.", tokens),
            "vllm:request_params_n": ("HISTOGRAM", "Histogram of the n request parameter.", N_BUCKETS),
        }
        for name, (kind, description, buckets) in families.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
            keep_past_exit(family)
            self._metrics[name] = family.Metric(labels=labels) if buckets is None else \
                family.Metric(labels=labels, buckets=[float(b) for b in buckets])

    def observe(self, answered: Answered) -> None:
        m = self._metrics
        if not m:
            return
        if answered.prompt_tokens:
            m["vllm:prompt_tokens_total"].increment(answered.prompt_tokens)
        if answered.generation_tokens:
            m["vllm:generation_tokens_total"].increment(answered.generation_tokens)
        m["vllm:time_to_first_token_seconds"].observe(answered.first_s)
        if answered.responses > 1 and answered.generation_tokens > 1:
            m["vllm:time_per_output_token_seconds"].observe(
                (answered.last_s - answered.first_s) / (answered.generation_tokens - 1))
        m["vllm:e2e_request_latency_seconds"].observe(answered.last_s)
        m["vllm:request_prompt_tokens"].observe(answered.prompt_tokens)
        m["vllm:request_generation_tokens"].observe(answered.generation_tokens)
        m["vllm:request_params_n"].observe(answered.n)
