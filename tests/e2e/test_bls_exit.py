"""The BLS entry model's python-backend stub exits cleanly when the server stops (gdb attached to it says how it
ended)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from support import descendants, grpc_generate, serving

pytestmark = pytest.mark.slow


class _Gdb:
    """gdb attached to a process in batch mode (``script``); its output is collected by a thread."""

    def __init__(self, gdb: str, pid: int, script: Path) -> None:
        self.proc = subprocess.Popen([gdb, "-p", str(pid), "-batch", "-x", str(script)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._attached = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ATTACHED"):  # the script prints it once it has attached
                self._attached.set()

    def wait_attached(self) -> None:
        assert self._attached.wait(60), "\n".join(self.lines[-20:])

    def finish(self, log: Path) -> None:
        """Wait for gdb to end (killed after 60 s), and keep its output in ``log``."""
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        log.write_text("\n".join(self.lines))


def _entry_stub(server, mode: str) -> int:
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmdline and f"/{mode}/1/model.py" in cmdline:
            return pid
    raise AssertionError(f"no python-backend stub runs the {mode} entry model")


EXIT_SCRIPT = """\
set pagination off
set confirm off
set print thread-events off
handle SIGPIPE SIGUSR1 SIGUSR2 SIGTERM SIGINT SIG32 SIG33 SIG34 SIG35 SIG36 nostop noprint pass
printf "ATTACHED\\n"
continue
bt 6
quit
"""


def test_the_entry_models_stub_exits_cleanly_when_the_server_stops(demo_models, tmp_path):
    """The BLS's Prometheus metric families are never deleted (``scheduler.metrics._keep_past_exit``): left to the
    interpreter's exit, their destructors ran after the stub had freed its shared memory, and every entry
    model's stub segfaulted as the server stopped (``Metric::SaveToSharedMemory``)."""
    gdb = shutil.which("gdb")
    assert gdb, "this test needs gdb (`make test` installs it)"
    script = tmp_path / "exit.gdb"
    script.write_text(EXIT_SCRIPT)
    with serving(demo_models["llava"], tmp_path / "ws", modes=["e_p_d"]) as server:
        params = {"max_tokens": 2, "temperature": 0}
        for prompt in ("Count to 3.", "Name a colour."):  # requests create the entry model's metrics
            assert grpc_generate(server.grpc, "e_p_d", prompt, [], params, stream=True).num_output_tokens >= 1
        stub = _entry_stub(server, "e_p_d")
        gdb_run = _Gdb(gdb, stub, script)
        gdb_run.wait_attached()
    # the server has stopped: the stub has exited (or crashed, and gdb printed where)
    gdb_run.finish(tmp_path / "gdb.log")
    lines = gdb_run.lines
    crashed = [i for i, line in enumerate(lines) if "received signal" in line]
    assert not crashed, "\n".join(lines[crashed[0]:crashed[0] + 8])
    assert any(f"process {stub}) exited" in line for line in lines), "\n".join(lines[-10:])
