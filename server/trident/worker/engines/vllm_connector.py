"""vLLM's NIXL KV connector as Trident's vLLM stage workers run it: NIXL's progress thread off, the
engine's model thread left on every core, the transport of each KV peer's READs counted and logged, and its side
channel (the agent metadata it serves) sealed with the deployment's key (:mod:`.vllm_side_channel`).

vLLM's ``NixlConnector`` builds its NIXL agent with NIXL's defaults, which start a UCX progress thread that
polls without pausing: a whole CPU core per KV worker, busy or idle. On a GPU host with dozens of cores that
is a small price; on a few CPU cores it takes the cores the engines need (two idle KV workers used 1.9 of 2
cores). Without the thread nothing is lost: the engine steps at least every millisecond while a request
waits for, or holds, KV blocks, and each step polls the transfers and notifications (vLLM's
``get_finished``), which is also what serves a READ from another host over UCX's TCP transport.

The KV READs run in vLLM's engine process, where Trident's own NIXL agent does not see them. Once the engine has
READ from a peer, the connector tells which transport UCX took to it (:func:`trident.core.transfer.transport.transport_to`,
as Trident's agent does for its own READs), logs it once per peer, and adds the count of peers by transport to
the transfer statistics vLLM already sends from its engine to its stat loggers; the worker's stat logger
(:mod:`trident.worker.engines.vllm`) adds those and the READs' bytes and seconds to its transfer counters.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from trident.core.transfer import transport
from trident.worker.engines import vllm_side_channel

PEER_KEYS = {transport.TCP: "peers_tcp", transport.NOT_TCP: "peers_not_tcp"}

log = logging.getLogger("trident.core.transfer")


@contextlib.contextmanager
def _agents_without_progress_thread():
    """NIXL agents made inside this block get ``enable_prog_thread=False`` (vLLM passes no such option)."""
    made = base_worker.nixl_agent_config
    if made is None:
        yield
        return
    base_worker.nixl_agent_config = functools.partial(made, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = made


class KVTransferStats(NixlKVConnectorStats):
    """vLLM's NIXL transfer statistics and, each time they change, the number of KV peers by transport
    (``peers_tcp``, ``peers_not_tcp``: one entry per change, the last one current)."""

    def reset(self) -> None:
        super().reset()
        self.data.update({key: [] for key in PEER_KEYS.values()})

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in PEER_KEYS.values())


class TridentNixlConnector(NixlPullConnector):
    """vLLM's pull (READ) NIXL connector, its agent polled by the engine's steps instead of a spinning thread, and
    the transport to each peer it READs from in its statistics and in a log line."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        vllm_side_channel.close()  # (the metadata served and asked for only under the deployment's key)
        cores = os.sched_getaffinity(0)
        with _agents_without_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)
        # on a CPU, vLLM's connector worker pins the thread that builds it to the last core of each NUMA node (its
        # comment: "reserve different cores for start_load_kv() from model_forward()"), but that thread is the one
        # that then runs the model: every KV engine of a host would share one core. It keeps the cores it had.
        os.sched_setaffinity(0, cores)
        self._peer_metadata: dict[str, bytes] = {}  # engine id -> its NIXL agent metadata
        self._transports: dict[str, str] = {}  # engine id -> transport.TCP / NOT_TCP, after a first READ from it
        worker = self.connector_worker
        if worker is not None:
            worker.xfer_stats = KVTransferStats()
            add = worker.add_remote_agent

            def add_remote_agent(meta, *args, **kwargs):
                self._peer_metadata[meta.engine_id] = meta.agent_metadata
                return add(meta, *args, **kwargs)

            worker.add_remote_agent = add_remote_agent

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTransferStats:
        return KVTransferStats(data=data) if data is not None else KVTransferStats()

    def get_kv_connector_stats(self):
        worker = self.connector_worker
        if worker is not None and self._note_transports(worker):
            kinds = list(self._transports.values())
            for kind, key in PEER_KEYS.items():
                worker.xfer_stats.data[key].append(kinds.count(kind))
        return super().get_kv_connector_stats()

    def _note_transports(self, worker) -> bool:
        """Whether the peers by transport changed: a peer READ from for the first time (once a READ has finished
        in this interval) or one vLLM has let go (a peer that restarted comes back as a new engine)."""
        with worker._handshake_lock:  # (vLLM's handshake threads add to it)
            current = set(worker._remote_agents)
        changed = False
        for engine_id in list(self._transports):
            if engine_id not in current:
                del self._transports[engine_id]
                self._peer_metadata.pop(engine_id, None)
                changed = True
        if worker.xfer_stats.num_successful_transfers:
            for engine_id in current - self._transports.keys():
                metadata = self._peer_metadata.get(engine_id)
                if metadata is None:
                    continue
                kind, shown = transport.transport_to(metadata)
                self._transports[engine_id] = kind
                log.info("KV READs from vLLM engine %s go over %s", engine_id, shown)
                changed = True
        return changed
