"""Two costs of vLLM's engine-core process that buy a Trident worker nothing, taken away before the worker forks it
(:func:`prepare`, called by :func:`trident.worker.engines.vllm.start_engine`), and one file it would leave behind
when killed (:func:`meet_in_own_folder`).

- **Idle: one gloo device for every one-process gloo group.** vLLM's engine core makes a pair of torch.distributed
  groups for each kind of parallelism it knows (world, tensor, pipeline, data, expert, ...): 13 gloo groups on a
  CPU, each of one process when the engine runs on one device. torch gives every gloo group a device of its own,
  and every device a thread that wakes 100 times a second (gloo's TCP loop polls with a 10 ms timeout): an idle
  engine core took 2.2% of a core here, a server in every mode (six engines) 13%, serving or not. A group of one
  process has no peer and sends nothing through its device, so those groups share one device and one thread; a
  group of several processes gets its own device, as torch gives it.
- **Exit: no full collections.** An engine core that ends runs ``EngineCore.shutdown``, which collects the whole
  heap twice (after dropping the KV cache, and after ``gc.unfreeze()``): 1.7 CPU s per engine here, with every
  module the workers' zygote imported on the heap, to free what the process's exit frees. The shutdown runs
  as vLLM wrote it (the KV connector, the scheduler and the distributed groups are closed, their files removed)
  with ``gc.collect`` a no-op meanwhile. vLLM's own ROCm path freezes the heap before exit for the same reason.

Both apply in the processes this process forks after :func:`prepare`: the engine core, forked by ``AsyncLLM`` on a
CPU (a spawned one, as on a GPU where vLLM spawns, keeps vLLM's defaults).
"""

from __future__ import annotations

import gc
import os


def prepare() -> None:
    share_for_groups_of_one()
    exit_without_collecting()
    meet_in_own_folder()


def meet_in_own_folder() -> None:
    """The file in which the engine core's torch.distributed groups meet (vLLM's ``file://`` rendezvous) is made in this
    worker's own folder (:func:`~trident.core.stagecall.server.unix_folder`), not in the temporary folder: a killed
    engine cannot remove it, and the folder goes with its worker however the worker ends (at its exit, by the head
    that started it, or by the worker itself when its head is gone)."""
    import uuid

    from vllm.v1.executor import uniproc_executor

    from trident.core.stagecall.server import unix_folder

    folder = unix_folder()
    uniproc_executor.get_file_store_init_method = lambda: f"file://{folder}/vllm_dist_{uuid.uuid4().hex}"


def share_for_groups_of_one() -> None:
    """From now on, a gloo group of one process in this process (and those it forks) uses one shared device."""
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo
    if getattr(gloo, "shares_one_device", False):
        return

    devices: dict[int, object] = {}  # by process: a device's thread does not outlive a fork

    def device():
        if os.getpid() not in devices:
            devices[os.getpid()] = gloo.create_default_device()
        return devices[os.getpid()]

    class OneDeviceForGroupsOfOne(gloo):
        shares_one_device = True

        def __init__(self, store, rank, size, *args, **kwargs):
            timeout = kwargs.get("timeout", args[0] if len(args) == 1 and not kwargs else None)
            if size != 1 or len(args) + len(kwargs) != 1 or not hasattr(timeout, "total_seconds"):
                super().__init__(store, rank, size, *args, **kwargs)  # (options given, or a group of several)
                return
            options = gloo._Options()
            options._devices = [device()]
            options._timeout = timeout
            options._threads = 2  # (what torch gives a group of one device)
            super().__init__(store, rank, size, options)

    OneDeviceForGroupsOfOne.__name__ = OneDeviceForGroupsOfOne.__qualname__ = gloo.__name__
    distributed_c10d.ProcessGroupGloo = OneDeviceForGroupsOfOne


def exit_without_collecting() -> None:
    """``EngineCore.shutdown`` (run as its process ends) with ``gc.collect`` doing nothing meanwhile."""
    from vllm.v1.engine.core import EngineCore

    shutdown = EngineCore.shutdown
    if getattr(shutdown, "collects_nothing", False):
        return

    def shutdown_without_collecting(self) -> None:
        collect, gc.collect = gc.collect, lambda generation=2: 0
        try:
            shutdown(self)
        finally:
            gc.collect = collect

    shutdown_without_collecting.collects_nothing = True
    EngineCore.shutdown = shutdown_without_collecting
