"""The scheduler's Prometheus metrics, on Triton's own metrics port (``pb_utils.MetricFamily``).

Every family carries the entry model's ``mode``; the encode stage's cache counters arrive with each
encode (its ``encode_report``) and are summed per encode instance.
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

_FAMILIES = {
    # name: (kind, description)
    "trident_requests_total": ("COUNTER", "requests per entry model (mode) and the path they took"),
    "trident_decisions_total": ("COUNTER", "scheduling decisions: skip_encode, local_prefill, local_encode, fallback:<mode>, first_text_from_prefill"),
    "trident_fallbacks_total": ("COUNTER", "requests served by another mode because a stage had no live instance"),
    "trident_routed_total": ("COUNTER", "stage calls per stage instance"),
    "trident_stage_inflight": ("GAUGE", "stage calls in flight per stage instance"),
    "trident_embedding_cache_hits_total": ("COUNTER", "media items (by kind) whose embeddings came from an encode worker's cache"),
    "trident_embedding_cache_misses_total": ("COUNTER", "media items (by kind) an encode worker had to encode"),
    "trident_embedding_cache_evictions_total": ("COUNTER", "embedding cache entries evicted, per encode instance"),
    "trident_embedding_cache_bytes": ("GAUGE", "bytes held in an encode instance's embedding cache"),
    "trident_encodes_saved_total": ("COUNTER", "media item encodes (by kind) saved by encode-once (shared with a concurrent or repeated item)"),
    "trident_scheduler_errors_total": ("COUNTER", "requests the scheduler answered with an error, by status"),
    "trident_migrations_total": ("COUNTER", "requests moved to another stage instance mid-stream, by stage and reason "
                                            "(worker_lost, cut_off)"),
    "trident_model_info": ("GAUGE", "1, labelled with the served model's family (its adapter's name, else its model type), its "
                                    "model type and whether the hf engine has an adapter for it"),
}


def keep_past_exit(family: Any) -> None:
    """Give ``family`` a reference that is never dropped, so that it is never deleted.

    A ``MetricFamily``'s destructor tells Triton through the stub's shared memory. Left to the interpreter's
    exit, it ran after the stub had freed that memory, and every entry model's stub segfaulted as the server
    stopped (in ``Metric::SaveToSharedMemory``). Deleting the families in ``finalize()`` instead deadlocked
    Triton when an entry model was reloaded while serving (docs/reliability.md, "Shutdown"). Never deleted,
    they send nothing: the stub exits cleanly, and Triton keeps the families as it did when the stub
    crashed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(family))


class SchedulerMetrics:
    """Counters and gauges of one entry model; no-ops where Triton's metrics API is unavailable."""

    def __init__(self, mode: str, pb_utils: Any = None) -> None:
        self.mode = mode
        self._pb = pb_utils
        self._families: dict[str, Any] = {}
        self._metrics: dict[tuple, Any] = {}
        self._evictions_seen: dict[str, int] = {}
        self._held: list | None = None
        if pb_utils is not None and hasattr(pb_utils, "MetricFamily"):
            for name, (kind, description) in _FAMILIES.items():
                family = pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))
                keep_past_exit(family)
                self._families[name] = family

    def held(self, loop=None) -> "SchedulerMetrics":
        """A view of these metrics that holds its updates (and the calls given to :meth:`later`) until
        :meth:`apply`: each update is an IPC round trip to Triton, so a request's updates wait until its first
        response is out. ``loop``: the event loop to apply them from (the python-backend stub's API is used
        from the model's loop, not from the threads that forward streams)."""
        view = copy.copy(self)  # shares the families, the metrics and the evictions seen
        view._held = []
        view.loop = loop
        return view

    def later(self, fn, *args) -> None:
        """Call ``fn(*args)`` with the held updates (at once when not held)."""
        if self._held is None:
            fn(*args)
        else:
            self._held.append((fn, args))

    def apply(self) -> None:
        """Make the held updates (once; later updates go at once)."""
        held, self._held = self._held, None
        for fn, args in held or ():
            fn(*args)

    def _metric(self, name: str, **labels: str):
        family = self._families.get(name)
        if family is None:
            return None
        key = (name, *sorted(labels.items()))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = family.Metric(labels={"mode": self.mode, **labels})
        return metric

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        if value:
            metric = self._metric(name, **labels)
            if metric is not None:
                self.later(metric.increment, value)

    def set(self, name: str, value: float, **labels: str) -> None:
        metric = self._metric(name, **labels)
        if metric is not None:
            self.later(metric.set, value)

    def model_info(self, family: str, model_type: str, adapter: bool) -> None:
        self.set("trident_model_info", 1, family=family, model_type=model_type, hf_adapter="yes" if adapter else "no")

    def request(self, path: str, decisions: tuple[str, ...], runs_as: str) -> None:
        self.add("trident_requests_total", path=path)
        for decision in decisions:
            self.add("trident_decisions_total", decision=decision)
        if runs_as != self.mode:
            self.add("trident_fallbacks_total", to=runs_as)

    def encode_report(self, instance: str, report: dict) -> None:
        """An encode instance's report: this request's hits/misses/shared by kind, its cache's bytes and evictions."""
        for kind, counts in (report.get("kinds") or {}).items():
            self.add("trident_embedding_cache_hits_total", counts.get("hits", 0), instance=instance, kind=kind)
            self.add("trident_embedding_cache_misses_total", counts.get("misses", 0), instance=instance, kind=kind)
            self.add("trident_encodes_saved_total", counts.get("shared", 0), instance=instance, kind=kind)
        if "cache_bytes" in report:
            self.set("trident_embedding_cache_bytes", report["cache_bytes"], instance=instance)
        evictions = int(report.get("evictions", 0))
        seen = self._evictions_seen.get(instance, 0)
        if evictions < seen:  # the instance restarted: its count began again
            seen = 0
        self.add("trident_embedding_cache_evictions_total", evictions - seen, instance=instance)
        self._evictions_seen[instance] = evictions
