"""A stage model's metrics on Triton's metrics port: its worker's counters, asked for every second over the stage
link (a :class:`~trident.core.protocol.Stats` message, so a worker on another host is counted as one on this host), in the
names vLLM's server gives a scheduler's and its caches' gauges, labelled as Triton's vLLM backend labels its own
(``model``: the stage instance's Triton model, ``version``), beside Trident's transfer counters.

Runs in the stage model's python-backend stub (:mod:`.proxy_model`): no torch here.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from trident.in_triton.metrics import keep_past_exit

log = logging.getLogger("trident.stage")

INTERVAL_S = 1.0


def _first(*keys: str) -> Callable[[dict], float | None]:
    return lambda stats: next((stats[k] for k in keys if k in stats), None)


def _by_memory(what: str) -> Callable[[dict], dict[tuple[str, str], float] | None]:
    """A READ counter by the memory types it went between: ``{(from, to): value}`` from the worker's
    ``read_<what>_from_<FROM>_to_<TO>`` counters (DRAM or VRAM each side)."""
    prefix = f"read_{what}_from_"

    def value_of(stats: dict) -> dict[tuple[str, str], float] | None:
        out = {}
        for key, value in stats.items():
            if key.startswith(prefix):
                src, _, dst = key[len(prefix):].partition("_to_")
                out[(src, dst)] = value
        return out or None
    return value_of


MEMORY_LABELS = ("from_memory", "to_memory")  # the labels of a by-memory counter, beside model and version


def _mm_queries(stats: dict) -> float | None:
    """vLLM's multimodal-cache queries, or an hf encode worker's embedding-cache lookups (hits and misses)."""
    if "mm_cache_queries" in stats:
        return stats["mm_cache_queries"]
    if "cache_hits" in stats and "cache_misses" in stats:
        return stats["cache_hits"] + stats["cache_misses"]
    return None


# name: (kind, description, the value from the worker's counters; None where its engine has none)
FAMILIES: dict[str, tuple[str, str, Callable[[dict], float | None]]] = {
    "vllm:num_requests_running": ("GAUGE", "Number of requests in model execution batches.",
                                  _first("vllm_running", "decode_active")),
    "vllm:num_requests_waiting": ("GAUGE", "Number of requests waiting to be processed.",
                                  _first("vllm_waiting", "decode_waiting")),
    "vllm:kv_cache_usage_perc": ("GAUGE", "KV-cache usage. 1 means 100 percent usage.", _first("kv_cache_usage")),
    "vllm:prefix_cache_queries_total": ("COUNTER", "Prefix cache queries, in terms of number of queried tokens.",
                                        _first("prefix_cache_queries")),
    "vllm:prefix_cache_hits_total": ("COUNTER", "Prefix cache hits, in terms of number of cached tokens.",
                                     _first("prefix_cache_hits")),
    # vLLM's multimodal cache; an hf encode worker's embedding cache
    "vllm:mm_cache_queries_total": ("COUNTER", "Multi-modal cache queries, in terms of number of queried items.",
                                    _mm_queries),
    "vllm:mm_cache_hits_total": ("COUNTER", "Multi-modal cache hits, in terms of number of cached items.",
                                 _first("mm_cache_hits", "cache_hits")),
    "trident_transfer_read_bytes_total": ("COUNTER", "bytes a stage instance's worker READ over NIXL (records' "
                                          "embeddings and KV, and a vLLM engine's own KV READs), by the memory they "
                                          "came from and went to (from_memory, to_memory: DRAM or VRAM)",
                                          _by_memory("bytes")),
    "trident_transfer_read_seconds_total": ("COUNTER", "seconds a stage instance's worker spent in those READs, by "
                                            "the same labels", _by_memory("seconds")),
    "trident_transfer_peers_tcp": ("GAUGE", "NIXL peers a stage instance's worker (or its vLLM engine) READs "
                                   "from over TCP (UCX's TCP transport: a peer on another host without RDMA)", _first("peers_tcp")),
    "trident_transfer_peers_not_tcp": ("GAUGE", "NIXL peers a stage instance's worker (or its vLLM engine) READs from "
                                       "without TCP "
                                       "(shared memory or cma on one host, or RDMA)", _first("peers_not_tcp")),
}


class StageMetrics:
    """The families above for one stage model (``model``), set from ``ask()`` (the worker's counters, or None when
    it does not answer) every :data:`INTERVAL_S` on a thread of its own; no-ops where Triton's metrics API is
    unavailable. A counter follows the worker's total: a worker that restarts from 0 adds its new count."""

    def __init__(self, model: str, ask: Callable[[], dict | None], pb_utils: Any) -> None:
        self._ask = ask
        self._labels = {"model": model, "version": "1"}
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple, Any] = {}  # made at a metric's first value: none for what the engine does not count
        self._seen: dict[tuple, float] = {}
        self._stop = threading.Event()
        if pb_utils is None or not hasattr(pb_utils, "MetricFamily"):
            return
        for name, (kind, description, _) in FAMILIES.items():
            family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
            keep_past_exit(family)
            self._families[name] = family
        self._thread = threading.Thread(target=self._run, name="trident-stage-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        triton = os.getppid()
        while not self._stop.wait(INTERVAL_S):
            if os.getppid() != triton:  # Triton is gone: a metric update would wait on it for good
                return
            try:
                stats = self._ask()
            except Exception as e:  # noqa: BLE001 - the next round asks again
                log.debug("stage metrics: %s", e)
                continue
            if stats is not None:
                self.update(stats)

    def update(self, stats: dict) -> None:
        for name, (kind, _, value_of) in FAMILIES.items():
            value = value_of(stats)
            if value is None or name not in self._families:
                continue
            if isinstance(value, dict):  # by memory types
                for labels, v in value.items():
                    self._set(name, kind, v, dict(zip(MEMORY_LABELS, labels)))
            else:
                self._set(name, kind, value, {})

    def _set(self, name: str, kind: str, value: float, labels: dict[str, str]) -> None:
        key = (name, *labels.values())
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = self._families[name].Metric(labels={**self._labels, **labels})
        if kind == "GAUGE":
            metric.set(float(value))
            return
        seen = self._seen.get(key, 0.0)
        delta = value - seen if value >= seen else value  # (a restarted worker counts from 0 again)
        self._seen[key] = value
        if delta > 0:
            metric.increment(float(delta))

    def stop(self) -> None:
        self._stop.set()
