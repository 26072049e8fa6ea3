"""What Trident changes in vLLM's engine-core process (trident.worker.engines.vllm_engine_core): its one-process gloo groups
share one device (one gloo loop thread instead of one per group, and the groups still work; a group of several
processes keeps its own). Its exit without full collections is checked by every vLLM server's stop (support.vllm_server:
exit 0, nothing left behind)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, store) -> str:
    """``code`` in a Python process of its own; its torch.distributed groups meet in the file ``store``."""
    env = dict(os.environ, STORE=str(store))
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip()


GROUPS_OF_ONE = """
    import os, torch, torch.distributed as dist
    from trident.worker.engines.vllm_engine_core import share_for_groups_of_one

    def loops():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return names.count("gloo_tcp_loop")

    if SHARE:
        share_for_groups_of_one()
        share_for_groups_of_one()  # (twice: once is what counts)
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=0, world_size=1)
    groups = [dist.new_group([0], backend="gloo") for _ in range(6)]
    x = torch.ones(3)
    for g in groups:
        dist.all_reduce(x, group=g)
        dist.broadcast(x, 0, group=g)
    print(loops(), x.tolist(), type(groups[0]._get_backend(torch.device("cpu"))).__name__)
    dist.destroy_process_group()
"""


def test_groups_of_one_share_one_loop_thread_and_still_work(tmp_path):
    # torch's own: a device, and its loop thread, for each group (the world and six more)
    assert _run(GROUPS_OF_ONE.replace("SHARE", "False"), tmp_path / "a") == "7 [1.0, 1.0, 1.0] ProcessGroupGloo"
    assert _run(GROUPS_OF_ONE.replace("SHARE", "True"), tmp_path / "b") == "1 [1.0, 1.0, 1.0] ProcessGroupGloo"


def test_a_group_of_two_processes_keeps_its_own_device(tmp_path):
    out = _run("""
        import os, torch, torch.multiprocessing as mp, torch.distributed as dist

        def run(rank, path, q):
            from trident.worker.engines.vllm_engine_core import share_for_groups_of_one
            share_for_groups_of_one()
            dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
            pair = dist.new_group([0, 1], backend="gloo")
            x = torch.tensor([rank + 1.0])
            dist.all_reduce(x, group=pair)
            names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
            q.put((rank, x.item(), names.count("gloo_tcp_loop")))
            dist.destroy_process_group()

        ctx, path = mp.get_context("fork"), os.environ["STORE"]
        q = ctx.Queue()
        procs = [ctx.Process(target=run, args=(r, path, q)) for r in range(2)]
        [p.start() for p in procs]
        got = sorted(q.get(timeout=60) for _ in procs)
        [p.join(30) for p in procs]
        print(got)
    """, tmp_path / "store")
    assert out == "[(0, 3.0, 2), (1, 3.0, 2)]", out  # (the world's group and the pair's: a device each)
