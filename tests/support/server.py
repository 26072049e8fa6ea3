"""`trident serve` for end-to-end tests (:class:`support.served.Server`) and what tests check of its workers."""

from __future__ import annotations

import contextlib
import time

from .served import Server, descendants, held

__all__ = ["OneServerAtATime", "Server", "descendants", "serving", "vllm_server", "wait_drained"]


@contextlib.contextmanager
def serving(model: str, workspace, *, timeout: float = 240, **kwargs):
    """A ready `trident serve` of ``model`` (:class:`Server` arguments), stopped at the end, where it must
    exit cleanly (0)."""
    srv = Server(model, workspace, **kwargs)
    try:
        srv.wait_ready(timeout=timeout)
        yield srv
    finally:
        assert srv.stop() == 0, "\n".join(srv.log[-30:])


def wait_drained(server: Server, stages: set[str], timeout: float = 10.0) -> dict[str, dict]:
    """Wait until no worker holds anything for a request (:func:`support.served.held`); assert it, and
    that no lease expired. Returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        busy = held(stats)
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert stages <= set(stats)
    assert not busy, busy
    assert all(v.get("expired", 0) == 0 for v in stats.values()), stats
    return stats


def vllm_python() -> str:
    """The vLLM environment's interpreter (``TRIDENT_VLLM_PYTHON``, else the checkout's ``.venv-vllm``)."""
    import os
    from pathlib import Path

    import pytest

    repo = Path(__file__).resolve().parents[2]
    python = os.environ.get("TRIDENT_VLLM_PYTHON") or str(repo / ".venv-vllm" / "bin" / "python")
    if not os.path.exists(python):
        pytest.skip(f"no vLLM environment at {python}: run `make install-vllm` (make test does)")
    return python


class OneServerAtATime:
    """Servers that several test modules share, one running at a time: :meth:`get` gives the running one when its
    key is the one asked for, else stops it (``check_stop(server)`` asserts how it stopped) and starts
    ``start()``'s. Modules that ask for the same key one after the other share its start-up."""

    def __init__(self) -> None:
        self._key, self._server, self._check = None, None, None

    def get(self, key, start, check_stop):
        if self._key != key:
            self.close()
            self._server, self._check = start(), check_stop
            self._key = key
        return self._server

    def close(self) -> None:
        server, check, self._key, self._server = self._server, self._check, None, None
        if server is not None:
            check(server)


def _ipc_sockets_in_tmp() -> set[str]:
    """Socket files in the system's temporary folder named as vLLM names its ZeroMQ IPC sockets (a uuid4)."""
    import os
    import re
    import stat
    import tempfile

    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    folder = tempfile.gettempdir()
    found = set()
    for name in os.listdir(folder):
        try:
            if uuid.fullmatch(name) and stat.S_ISSOCK(os.lstat(os.path.join(folder, name)).st_mode):
                found.add(name)
        except OSError:
            pass
    return found


def vllm_server(pool: OneServerAtATime, model: str, arch: str, workspace, modes: list[str] | None = None) -> Server:
    """A ready `trident serve --backend vllm` of ``model`` in ``modes`` (default: all) from ``pool`` (shared with the
    next module that asks for ``arch`` in the same modes). When it stops it must exit cleanly (0), leave no process
    behind, and leave none of vLLM's IPC socket files in the system's temporary folder (they go in each worker's
    own folder)."""
    from pathlib import Path

    def start() -> Server:
        sockets_before = _ipc_sockets_in_tmp()
        srv = Server(model, workspace, modes=modes, extra=["--backend", "vllm", "--worker-python", vllm_python()])
        try:
            srv.wait_ready(timeout=400)
        except BaseException:
            srv.stop()
            raise
        srv.arch, srv.sockets_before, srv.modes = arch, sockets_before, modes or ["epd", "e_pd", "e_p_d", "ep_d"]
        srv.tree = [p for pid in srv.worker_pids() for p in (pid, *descendants(pid))]
        return srv

    def check_stop(srv: Server) -> None:
        code = srv.stop()
        assert code == 0, "\n".join(srv.log[-30:])
        # (a worker's own output may share the line: it writes to the same pipe)
        assert any(line.endswith("[trident] stopped") for line in srv.log), "\n".join(srv.log[-30:])
        deadline = time.monotonic() + 20  # vLLM's engine and resource-tracker processes exit just after
        while (alive := [pid for pid in srv.tree if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes left behind: {alive}"
        left = _ipc_sockets_in_tmp() - srv.sockets_before
        assert not left, f"socket files left in the temporary folder: {sorted(left)[:5]} ({len(left)})"

    return pool.get((arch, tuple(modes or ())), start, check_stop)
