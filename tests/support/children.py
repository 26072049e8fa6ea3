"""Child processes of the integration tests (a stage engine, a transfer endpoint), each forked from one server
process of the test's lane that imported torch, transformers and Trident's engines once: a spawned child imported
them again, seconds of CPU each (a stage worker is forked from the workers' zygote for the same reason). The server
ends with the lane's pytest process."""

from __future__ import annotations

import multiprocessing

PRELOAD = ["torch", "transformers", "trident.worker.engines.hf.stage", "trident.core.transfer", "support"]


def child_processes():
    """The multiprocessing context to start them from (``Process``, ``Pipe``)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
