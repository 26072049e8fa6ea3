"""A stopping server kills the python-backend stubs that outlive its Triton, and only its own: once a stub has
exited, its pid may already run another server's stub (pids wrap around at 32768 on many hosts), which a kill by
pid alone would take down mid-request. And the walk that lists a server's processes goes on past one that ends
meanwhile (real processes; no Triton)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trident.supervisor.processes import is_stub_of, kill_left


def _stub(store) -> subprocess.Popen:
    """A process whose command line reads as a python-backend stub of a model in ``store``: once the kernel shows it
    (Popen returns as the exec closes its pipe, a moment before the new command line can be read)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "triton_python_backend_stub",
                             f"{store}/encode/1/model.py"])
    deadline = time.monotonic() + 10
    while b"triton_python_backend_stub" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the process never showed its command line"
        time.sleep(0.01)
    return proc


def test_only_the_server_s_own_stubs_are_killed(tmp_path):
    ours, theirs = tmp_path / "a" / "model-store", tmp_path / "ab" / "model-store"
    mine, other = _stub(ours), _stub(theirs)
    try:
        assert is_stub_of(mine.pid, ours) and not is_stub_of(other.pid, ours) and is_stub_of(other.pid, theirs)
        # (as if both pids had been listed as this server's stubs: the other's is a reused pid)
        assert kill_left([mine.pid, other.pid], 0.2, running=lambda pid: is_stub_of(pid, ours)) == 1
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait(timeout=10)


def test_a_process_is_known_by_its_pid_and_its_start():
    """A pid and when its process started name that process: a new process on the same pid starts later."""
    from trident.supervisor.processes import started

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        birth = started(proc.pid)
        assert birth is not None and started(proc.pid) == birth
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert started(proc.pid) is None or started(proc.pid) != birth


def test_descendants_go_on_past_a_process_that_ends_while_they_are_listed(monkeypatch):
    """A process that ends between the check of its ``/proc/PID/task`` folder and its listing (CI saw it while
    Triton was killed again and again: FileNotFoundError out of the walk) is skipped; the rest are listed."""
    import os

    from trident.supervisor.processes import descendants

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants(parent.pid)) < 1:
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.01)
        (child,) = found
        ending = f"/proc/{child}/task"
        real_scandir, real_listdir = os.scandir, os.listdir

        def gone(real):
            def listing(path="."):
                if os.fspath(path) == ending:
                    raise FileNotFoundError(2, "No such file or directory", ending)
                return real(path)
            return listing

        monkeypatch.setattr(os, "scandir", gone(real_scandir))
        monkeypatch.setattr(os, "listdir", gone(real_listdir))
        assert descendants(parent.pid) == [child]
    finally:
        monkeypatch.undo()
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait(timeout=10)
