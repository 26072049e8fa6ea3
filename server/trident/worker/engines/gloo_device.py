"""One gloo device for every one-process gloo group of a vLLM engine core.

vLLM's engine core makes a pair of torch.distributed groups for each kind of parallelism it knows (world, tensor,
pipeline, data, expert, ...): 13 gloo groups on a CPU, with one process in each when the engine runs on one device.
torch gives every gloo group a device of its own, and every device a thread that wakes 100 times a second
(gloo's TCP loop polls with a 10 ms timeout). An idle engine core's 13 threads took 2.2% of a core here, a server
in every mode (six engines) 13%, whether it served or not. A group of one process has no peer and sends nothing
through its device, so those groups share one device, and one thread. A group of several processes gets its own
device, as torch gives it.

It applies in the process that creates the groups: an engine core forked from a worker that called
:func:`share_for_groups_of_one` (:func:`trident.worker.engines.vllm.start_engine` does, before the fork).
"""

from __future__ import annotations

import os


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
