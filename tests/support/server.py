"""`trident serve` for end-to-end tests (:class:`support.served.Server`) and what tests check of its workers."""

from __future__ import annotations

import contextlib
import threading
import time

from .served import Server, descendants, held

MODES = ["epd", "e_pd", "e_p_d", "ep_d"]

__all__ = ["OneServerAtATime", "Server", "descendants", "hosted_head", "serving", "settled_vllm_metrics", "shared_llava_server", "shared_media_server", "vllm_metrics",
           "vllm_server", "wait_drained"]


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


def vllm_metrics(server: Server, models) -> dict[str, dict[str, float]]:
    """Each entry model's ``vllm:*`` samples: ``{model: {sample name, or name{le}: value}}`` (its ``version`` 1)."""
    out: dict[str, dict[str, float]] = {m: {} for m in models}
    for (name, labels), value in server.metrics("vllm:").items():
        labels = dict(labels)
        if labels.get("model") in out:
            assert labels["version"] == "1", labels
            out[labels["model"]][f"{name}{{{labels['le']}}}" if "le" in labels else name] = value
    return out


def quiet_vllm_metrics(server: Server, models, quiet_s: float = 0.3, timeout: float = 5.0) -> dict:
    """:func:`vllm_metrics` once two scrapes ``quiet_s`` apart agree: a request answered just before (an earlier
    test's) is counted by then, not in what a test measures from here."""
    deadline = time.monotonic() + timeout
    last = vllm_metrics(server, models)
    while True:
        time.sleep(quiet_s)
        now = vllm_metrics(server, models)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def settled_vllm_metrics(server: Server, before: dict, answered: dict[str, int], timeout: float = 5.0) -> dict:
    """:func:`vllm_metrics` once each entry model has counted ``answered[model]`` more requests than in ``before``
    (an entry model counts a request just after its last response). A scrape is not one moment: one that shows the
    last family of a request's counts may show an earlier family before its count, so a scrape after that one is
    what is returned."""
    deadline = time.monotonic() + timeout
    while True:
        now = vllm_metrics(server, answered)
        done = all(now[m].get("vllm:request_params_n_count", 0) - before[m].get("vllm:request_params_n_count", 0) >= n
                   for m, n in answered.items())
        if done:
            return vllm_metrics(server, answered)
        if time.monotonic() > deadline:
            return now
        time.sleep(0.05)


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


SHARED_LLAVA_NAME = "demo"  # the OpenAI model id of the shared LLaVA server


def shared_llava_server(pool: OneServerAtATime, model: str, tmp_path_factory) -> Server:
    """The hf LLaVA server in every mode that test_serving.py, test_openai.py, test_bad_input.py and test_trust.py
    share (from ``pool``; conftest runs them one after the other, in that order: test_trust.py's last test stops
    it). Its settings are what they need:

    - small media limits and a 2 s body deadline (the bad-input corpus names them), every prompt prefilled by the
      prefill worker, and ``media_dir`` (a file ``ok.png`` in it) the folder local media may come from;
    - Triton on 127.0.0.1, the OpenAI API on 127.0.0.2 (``openai_host``: an address of its own);
    - ``first_ready``: what a request sent at the first READY of the e_p_d entry model (``"model"``) and of the
      server (``"server"``) got, polled from the start."""
    from .clients import http_generate
    from .media import b64, make_image, png_bytes

    def start() -> Server:
        media_dir = tmp_path_factory.mktemp("media")
        (media_dir / "ok.png").write_bytes(png_bytes(make_image(200, 150, 7)))
        srv = Server(model, tmp_path_factory.mktemp("llava") / "ws",
                     extra=["--served-model-name", SHARED_LLAVA_NAME, "--host", "127.0.0.1"],
                     config={"openai_host": "127.0.0.2", "drain_s": 20,  # (test_trust.py drains a stream)
                             "media_limits": {"max_images": 4, "max_pixels": 4000000, "max_bytes": "2 MiB",
                                              "max_request_pixels": 6000000},
                             "frontend": {"max_body_bytes": "8 MiB", "body_timeout_s": 2, "header_timeout_s": 2,
                                          "media": {"allowed_media_dir": str(media_dir)}},
                             "scheduling": {"local_prefill_tokens": 0}})
        image = b64(png_bytes(make_image(64, 48, 7)))
        ask = lambda: http_generate(srv.http, "e_p_d", "USER: <image>\nWhat is it? ASSISTANT:", [image],  # noqa: E731
                                    {"max_tokens": 2, "temperature": 0}, timeout=120)
        srv.first_ready, stop = {}, threading.Event()
        probes = [threading.Thread(target=_first_ready, args=(f"http://{srv.http}{path}", ask, srv.first_ready, key, stop),
                                   daemon=True)
                  for key, path in (("model", "/v2/models/e_p_d/ready"), ("server", "/v2/health/ready"))]
        for probe in probes:
            probe.start()
        try:
            srv.wait_ready(timeout=240)
            for probe in probes:
                probe.join(120)
        except BaseException:
            srv.stop()
            raise
        finally:
            stop.set()
        srv.media_dir = media_dir
        return srv

    return pool.get(("llava", "shared"), start, check_stopped)


SHARED_MEDIA_NAME = "media-demo"  # the OpenAI model id of the shared hf servers of the media families


def shared_media_server(pool: OneServerAtATime, model: str, arch: str, tmp_path_factory) -> Server:
    """The hf server of a media family (``arch``) in every mode that test_media_serving.py and test_serving.py
    share (from ``pool``; conftest runs them one after the other), its OpenAI model id ``SHARED_MEDIA_NAME`` and
    ``media_dir`` the folder local media may come from."""

    def start() -> Server:
        media_dir = tmp_path_factory.mktemp("media-files")
        srv = Server(model, tmp_path_factory.mktemp(arch) / "ws", extra=["--served-model-name", SHARED_MEDIA_NAME],
                     config={"frontend": {"media": {"allowed_media_dir": str(media_dir)}}}).started(240)
        srv.media_dir = media_dir
        return srv

    return pool.get((arch, "media"), start, check_stopped)


HOSTS = ("prefill", "decode", "prefill_decode", "generate", "attacker")  # the hosts the bridged server's bridge has: one
# for a worker of each of those stages, and one that holds no secret (tests/multihost/attacker.py)


def bridged_llava_server(pool: OneServerAtATime, model: str, tmp_path_factory) -> Server:
    """The hf LLaVA server in every mode, its workers loading the fault wrapper, that tests/multihost's
    test_stage_hosts.py and test_supervision.py share (from ``pool``; conftest runs them one after the other).
    Where hosts can be made (:mod:`support.hosts`) it listens, and moves data, on the bridge of ``srv.hosts``
    (one host per stage of :data:`HOSTS`, for workers that join it from there); elsewhere ``srv.hosts`` is None
    and it is on loopback. Short leases and reads (a killed worker's are freed within the soak); every prompt is
    prefilled by a prefill stage, whose instances, as the decode stage's, take turns. ``srv.exit_code``: what its
    stop must give (a test that kills Triton changes it)."""
    import os

    from .hosts import Hosts, unavailable

    def start() -> Server:
        hosts = Hosts(list(HOSTS)) if unavailable() is None else None
        config = {"scheduling": {"local_prefill_tokens": 0, "routing": "round_robin"},
                  "transfer": {"lease_s": 10, "read_timeout_s": 5}}
        if hosts is not None:
            config["host"] = "0.0.0.0"
            config["transfer"]["data_address"] = hosts.head_address
            # the head's end of the hosts' links is the bridge, which UCX leaves out of its TCP devices unless told
            os.environ["UCX_TCP_BRIDGE_ENABLE"] = "y"
        try:
            srv = Server(model, tmp_path_factory.mktemp("bridged") / "ws", modes=MODES, faults=True,
                         config=config).started()
            srv.hosts, srv.exit_code = hosts, 0
        except BaseException:
            if hosts is not None:
                hosts.close()
            raise
        finally:
            os.environ.pop("UCX_TCP_BRIDGE_ENABLE", None)
        return srv

    def stop(srv: Server) -> None:
        try:
            assert srv.stop() == srv.exit_code, "\n".join(srv.log[-20:])
        finally:
            if srv.hosts is not None:
                srv.hosts.close()

    return pool.get(("llava", "bridged"), start, stop)


def hosted_head(pool: OneServerAtATime, key: tuple, names: list[str], start) -> Server:
    """A head server from ``pool`` (under ``key``) with stage hosts ``names`` (:mod:`support.hosts`), which are made
    first and closed with it: ``start(hosts, made)`` starts the head, calls ``made(srv)`` as soon as the server
    exists (so that a start that fails stops it) and returns it ready. The head must stop cleanly (0); the hosts'
    workers, having lost it, stop when the hosts close."""
    from .hosts import Hosts

    def begin() -> Server:
        hosts, made = Hosts(names), []
        try:
            srv = start(hosts, made.append)
        except BaseException:
            try:
                for srv in made:
                    srv.stop()
            finally:
                hosts.close()
            raise
        srv.hosts = hosts
        return srv

    def end(srv: Server) -> None:
        try:
            assert srv.stop() == 0, "\n".join(srv.log[-20:])
        finally:
            srv.hosts.close()

    return pool.get(key, begin, end)


def check_stopped(srv: Server) -> None:
    """Stop ``srv`` (if a test has not): it must exit cleanly (0), say so last, and leave no worker running."""
    import os

    code = srv.stop()
    assert code == 0, "\n".join(srv.log[-30:])
    # (a worker's own output may share the line: it writes to the same pipe)
    assert any(line.endswith("[trident] stopped") for line in srv.log), "\n".join(srv.log[-30:])
    for pid in srv.worker_pids():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} is still running after the server stopped")


def _first_ready(url: str, ask, found: dict, key: str, stop: threading.Event) -> None:
    """Poll ``url`` from start-up; at its first 200, send ``ask()`` at once and keep what it answered."""
    import requests

    while not stop.is_set():
        try:
            if requests.get(url, timeout=2).status_code == 200:
                found[key] = ask()
                return
        except requests.RequestException:
            pass
        time.sleep(0.01)


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
    next module that asks for ``arch`` in the same modes). Stopped as Ctrl-C in a terminal stops it (SIGINT to its
    process group), it must print no traceback, exit cleanly (0), leave no process
    behind, and leave none of vLLM's IPC socket files in the system's temporary folder (they go in each worker's
    own folder)."""
    from pathlib import Path

    def start() -> Server:
        sockets_before = _ipc_sockets_in_tmp()
        # (no OpenAI frontend: its modules call Triton's APIs; test_vllm_migration.py's own server streams over OpenAI)
        srv = Server(model, workspace, modes=modes, extra=["--backend", "vllm", "--worker-python", vllm_python()],
                     openai=False)
        try:
            srv.wait_ready(timeout=400)
            # quiet by default: from start to ready only the server's own lines (no vLLM, transformers or torch noise)
            noise = [line for line in srv.log if line.strip() and not line.startswith(("[trident]", "[demo-model]"))]
            assert not noise, noise[:10]
        except BaseException:
            srv.stop()
            raise
        srv.arch, srv.sockets_before, srv.modes = arch, sockets_before, modes or ["epd", "e_pd", "e_p_d", "ep_d"]
        srv.tree = [p for pid in srv.worker_pids() for p in (pid, *descendants(pid))]
        return srv

    def check_stop(srv: Server) -> None:
        before = len(srv.log)
        code = srv.interrupt()  # (as Ctrl-C in a terminal: every worker's vLLM engine is shut down by its worker)
        assert code == 0, "\n".join(srv.log[-30:])
        stopping = srv.log[before:]
        assert not [line for line in stopping if "Traceback" in line or "EngineDeadError" in line], "\n".join(stopping)
        # Ctrl-C is the launcher's alone: it drains through Triton (which would otherwise have stopped at once)
        assert any("draining: not READY" in line for line in stopping), "\n".join(stopping)
        assert not [line for line in stopping if "could not withdraw readiness" in line], "\n".join(stopping)
        # (a worker's own output may share the line: it writes to the same pipe)
        assert any(line.endswith("[trident] stopped") for line in srv.log), "\n".join(srv.log[-30:])
        deadline = time.monotonic() + 20  # vLLM's engine and resource-tracker processes exit just after
        while (alive := [pid for pid in srv.tree if Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"processes left behind: {alive}"
        left = _ipc_sockets_in_tmp() - srv.sockets_before
        assert not left, f"socket files left in the temporary folder: {sorted(left)[:5]} ({len(left)})"

    return pool.get((arch, tuple(modes or ())), start, check_stop)
