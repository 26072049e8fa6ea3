"""vLLM's NIXL KV connector as Trident's vLLM stage workers run it: NIXL's progress thread off by default.

vLLM's ``NixlConnector`` builds its NIXL agent with NIXL's defaults, which start a UCX progress thread that
polls without pausing: a whole CPU core per KV worker, busy or idle. On a GPU host with dozens of cores that
is a small price; on a few CPU cores it takes the cores the engines need (two idle KV workers used 1.9 of 2
cores). Without the thread nothing is lost: the engine steps at least every millisecond while a request
waits for, or holds, KV blocks, and each step polls the transfers and notifications (vLLM's
``get_finished``); the READs themselves go over UCX shared-memory transports, which need no progress on the
side that is read.

vLLM imports this module by name in its engine processes (``kv_connector_module_path``), so the choice is
carried to them in :data:`PROGRESS_THREAD_ENV`, which :class:`~trident.engines.vllm.VLLMStageEngine` sets.
"""

from __future__ import annotations

import contextlib
import functools
import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

PROGRESS_THREAD_ENV = "TRIDENT_NIXL_PROGRESS_THREAD"


@contextlib.contextmanager
def _agents_without_progress_thread():
    """NIXL agents made inside this block get ``enable_prog_thread=False`` (vLLM passes no such option)."""
    made = base_worker.nixl_agent_config
    if made is None or os.environ.get(PROGRESS_THREAD_ENV) == "1":
        yield
        return
    base_worker.nixl_agent_config = functools.partial(made, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = made


class TridentNixlConnector(NixlPullConnector):
    """vLLM's pull (READ) NIXL connector, its agent polled by the engine's steps instead of a spinning thread."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        with _agents_without_progress_thread():
            super().__init__(vllm_config, role, kv_cache_config)
