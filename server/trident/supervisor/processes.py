"""The processes a server leaves behind, found and stopped: descendants by ``/proc``, stragglers killed after a grace
period, python-backend stubs told from reused pids, a killed worker's socket folder removed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import sys
import time
from pathlib import Path

from trident.core.config import HEAD_PID_ENV
from trident.core.protocol import WORKER_FILE

# How the launcher starts the processes of a server (the workers' zygote and each worker it forks, the frontend;
# tritonserver gets the same from its shim): each in a process group of its own, so that a terminal's Ctrl-C reaches
# the launcher alone, which then stops them in order. Not in a session of its own: where the kernel groups sessions
# for scheduling (autogroup, on in most distributions' kernels), the cores are shared between sessions first, and a
# worker in a session of its own got a share as one process whatever it ran; a vLLM E/P/D or EP/D server gave about
# half its tokens/s at concurrency 8 (the A/B: `git show 59aa600`).
OWN_GROUP = {"process_group": 0}

def end_with_head() -> None:
    """When this process was started by a head (:data:`HEAD_PID_ENV`), a thread that waits on the head's pidfd and
    kills this process's group the moment the head is gone (a worker's own folder removed first: the head that
    would have removed it is gone). Call once the process has its own group."""
    import select
    import threading

    pid = os.environ.get(HEAD_PID_ENV, "")
    if not pid.isdigit():
        return
    try:
        head = os.pidfd_open(int(pid))
    except ProcessLookupError:  # gone already
        os.killpg(os.getpgrp(), signal.SIGKILL)
        return

    def wait() -> None:
        select.select([head], [], [])
        calls = sys.modules.get("trident.core.stagecall.server")
        if calls is not None:  # (a worker: its folder, which no head will remove now)
            calls.remove_unix_folder()
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=wait, name="trident-head-watch", daemon=True).start()


def remove_direct_socket(model_dir: Path, pid: int) -> None:
    """The folder of the direct socket of a stopped worker this process started (``pid``), which a killed worker
    could not remove itself. Only a folder that worker made: its worker file names that pid, and the folder is one
    of this user's ``trident-calls-*`` folders in the temporary folder (a worker file naming another path, or
    another worker's, removes nothing)."""
    from trident.core.stagecall.server import DIR_PREFIX, SOCKET_NAME

    try:
        worker = json.loads((model_dir / "1" / WORKER_FILE).read_text())
        path = Path(worker["direct"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    folder = path.parent
    if worker.get("pid") != pid or path.name != SOCKET_NAME or not folder.name.startswith(DIR_PREFIX) \
            or folder.parent != Path(tempfile.gettempdir()):
        return
    try:
        mine = not folder.is_symlink() and folder.lstat().st_uid == os.getuid()
    except OSError:
        return
    if mine:
        shutil.rmtree(folder, ignore_errors=True)


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Triton's python-backend stubs, vLLM's engine-core processes, ...)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:  # (not Path.glob: it raises when a process ends between its check of the folder and its listing)
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def cpu_seconds(pids) -> dict[int, float]:
    """The CPU seconds (user + system) each of ``pids`` still running has used so far."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``); None when there is no such process. With the
    pid it names one process: a pid alone may be another process's soon after its own has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def kill_left(pids: list[int], grace_s: float = 3.0, running=None) -> int:
    """SIGKILL those of ``pids`` still running (``running(pid)``, by default any live process) after
    ``grace_s``; how many were."""
    running = running or running_pid
    deadline = time.monotonic() + grace_s
    while (alive := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(alive)


def running_pid(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def is_stub(pid: int) -> bool:
    """Whether ``pid`` runs a python-backend stub (not a zombie, not a reused pid of something else)."""
    try:
        return running_pid(pid) and b"triton_python_backend_stub" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def is_stub_of(pid: int, model_store: Path) -> bool:
    """Whether ``pid`` runs a python-backend stub of a model in ``model_store``: a stub's pid, once it has exited, may
    already be another server's stub (pids wrap around, at 32768 on many hosts)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return running_pid(pid) and b"triton_python_backend_stub" in argv and str(model_store).encode() + b"/" in argv


def stubs_of(model_store: Path) -> list[int]:
    """The python-backend stubs of the models in ``model_store``, Triton's children or not: a stub whose Triton was
    killed is init's, and one caught in a call to its dead parent (a metric update) does not exit by itself."""
    store = str(model_store).encode() + b"/"
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"triton_python_backend_stub" in argv and store in argv:
            found.append(int(entry.name))
    return found


def remove_shm_regions(owner_pid: int, folder: Path = Path("/dev/shm")) -> int:
    """Unlink the python backend's shared-memory regions of the Triton that the process ``owner_pid`` started
    (PyTriton names them ``pytrtion<pid>-...``), once it and its stubs are gone: a stub that is killed leaves its
    regions behind, 4 MiB each, in memory until the host restarts. Returns how many were removed."""
    removed = 0
    for region in folder.glob(f"pytrtion{owner_pid}-*"):
        try:
            region.unlink()
            removed += 1
        except OSError:  # (not ours, or gone meanwhile)
            pass
    return removed


def stop_all(procs: dict, say, grace_s: float = 15.0) -> None:
    """Stop the workers ``procs`` (by name): SIGTERM to each at once, up to ``grace_s`` for each to end (then
    SIGKILL), and whatever of a worker's own processes outlive it (vLLM's engine core, an engine still starting)
    killed; ``say(line)`` tells of each that had to be killed."""
    import subprocess

    # (each with its start: a process of the tree that exits leaves its pid to whatever starts next, e.g. another
    # server's stub)
    trees = {name: {pid: started(pid) for pid in descendants(proc.pid)} for name, proc in procs.items()}
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for name, proc in procs.items():
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            say(f"worker {name} did not stop; killing it")
            proc.kill()
            proc.wait()
        # (the tree as it was: once the worker is reaped, its pid and its children's parent are no longer its own)
        tree = trees[name]
        if left := kill_left(list(tree), running=lambda pid: tree[pid] is not None and started(pid) == tree[pid]):
            say(f"worker {name} left {left} process(es) running; killed them")


def end_process(code: int) -> int:
    """End a worker or the frontend that has stopped cleanly: its exit handlers run and its output is flushed, and
    then it ends without Python's teardown of every module it imported, which takes a second or more of CPU for
    torch's and transformers' (a server's workers all stopping at once on a small machine took seconds)."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
