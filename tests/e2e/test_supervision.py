"""Supervision: a stage worker killed with SIGKILL fails only its own in-flight request, quickly and by name,
and comes back; the other modes serve throughout (Triton's L0_lifecycle, Dynamo's worker-restart checks). The short
soak runs on the same server, then Triton is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from support import MODES, Server, bridged_llava_server, grpc_generate
from support.soak import soak, table

pytestmark = pytest.mark.slow

PROMPT = "USER: Tell me a long story about the sea. ASSISTANT:"
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory, shared_servers):
    # every mode for the soak; its workers load the fault wrapper (shared with tests/multihost: support.server)
    return bridged_llava_server(shared_servers, demo_models["llava"], tmp_path_factory)


def _wait_back(server, name: str, pid: int, timeout: float = 180) -> float:
    """Seconds until the stage model is served by a new worker process."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.ready(name) and server.worker_pid(name) != pid:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"{name} did not come back within {timeout} s")


@pytest.mark.parametrize("stage", ["decode", "prefill", "encode"])
def test_a_killed_worker_fails_its_request_and_comes_back(server, stage):
    expected = grpc_generate(server.grpc, "epd", PROMPT, [], GREEDY, stream=True).text
    assert grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text == expected
    pid = server.worker_pid(stage)
    other: list = []
    stop = threading.Event()

    def keep_serving_epd():  # the other mode, throughout
        while not stop.is_set():
            other.append(grpc_generate(server.grpc, "epd", PROMPT, [], GREEDY, stream=True).text)

    background = threading.Thread(target=keep_serving_epd)
    background.start()
    try:
        if stage in ("decode", "prefill"):  # with a request inside: it fails within 5 s, naming the stage
            result: dict = {}
            # decode: mid-stream; prefill: held there by a test-only marker (the server injects faults)
            prompt = PROMPT if stage == "decode" else PROMPT.replace(" ASSISTANT:", " [[trident-stall@prefill]] ASSISTANT:")

            def stream():
                try:
                    grpc_generate(server.grpc, "e_p_d", prompt, [], {"max_tokens": 400, "ignore_eos": True}, stream=True)
                except Exception as e:
                    result["error"], result["at"] = str(e), time.monotonic()

            t = threading.Thread(target=stream)
            t.start()
            time.sleep(2.0)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            t.join(30)
            assert "error" in result, "the in-flight request did not fail"
            assert result["at"] - killed < 5
            print(f"{stage}: the request inside failed {result['at'] - killed:.2f} s after the kill")
            assert f"Unavailable: the {stage} stage's worker" in result["error"] and "exited" in result["error"]
        else:
            os.kill(pid, signal.SIGKILL)
        back = _wait_back(server, stage, pid)
    finally:
        stop.set()
        background.join(60)
    assert other and all(text == expected for text in other)
    assert grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text == expected
    assert f"[trident] worker {stage} is back" in "".join(server.log)
    print(f"{stage} back in {back:.1f} s")


def test_short_soak(server):
    """The short soak (`make soak` is the long one): streamed requests over every mode at once, gRPC and OpenAI,
    about 10% cancelled midway, the decode worker killed with SIGKILL during the run. Only 503s for requests in
    flight while it was down may fail; every other request gives its reference text; afterwards no worker holds
    anything and every mode still answers right."""
    report = asyncio.run(soak(server, requests=64, concurrency=16, kill="decode", drain_s=40))
    shown = "\n".join(table(report))
    print(shown)
    assert report.killed_at is not None and report.back_at is not None, shown
    assert not report.unexpected, shown
    assert not report.disagreements and not report.final_check, shown
    assert not report.held_after, shown
    assert report.count("cancelled") > 0 and report.count("ok") >= 32, shown
    assert len(report.outcomes) == 64


def test_triton_dying_stops_everything_and_exits_non_zero(server):
    """Triton killed: the server stops every process it started and exits 1, so that a service manager restarts it
    (it used to exit 0, as if stopped on purpose). Last of the module's tests on its server."""
    from support import descendants

    started = descendants(server.proc.pid)
    triton = [p for p in started if _cmdline(p).startswith("tritonserver") or "/tritonserver " in _cmdline(p)]
    assert len(triton) == 1, [_cmdline(p)[:80] for p in started]
    server.exit_code = 1
    os.kill(triton[0], signal.SIGKILL)
    assert server.proc.wait(90) == 1
    server._reader.join(10)
    assert any("Triton exited; stopping everything (exit code 1)" in line for line in server.log), server.log[-10:]
    deadline = time.monotonic() + 10
    while (alive := [p for p in started if os.path.exists(f"/proc/{p}") and _cmdline(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, [_cmdline(p)[:80] for p in alive]


def test_a_killed_head_leaves_nothing_and_its_ports_serve_again(demo_models, tmp_path):
    """`trident serve` killed with SIGKILL (the OOM killer's way): within seconds no process it started is left (the
    OpenAI frontend and the workers used to live on, holding their ports), and a new server starts on the same
    ports."""
    from support import descendants

    srv = Server(demo_models["llava"], tmp_path / "ws", modes=["e_pd"])
    try:
        srv.wait_ready()
        tree = descendants(srv.proc.pid)
        names = {pid: _cmdline(pid) for pid in tree}
        assert any(" frontend " in n for n in names.values()) and len(srv.worker_pids()) == 2, names
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        deadline = time.monotonic() + 10
        while (alive := [p for p in tree if os.path.exists(f"/proc/{p}") and _cmdline(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, {p: names[p][:80] for p in alive}
    finally:
        srv.stop()
    again = Server(demo_models["llava"], tmp_path / "ws2", modes=["e_pd"],
                   ports=(srv.http_port, srv.grpc_port, srv.metrics_port, srv.openai_port))
    try:
        again.wait_ready()
    finally:
        again.stop()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_sigterm_during_start_up_stops_what_has_started(demo_models, tmp_path):
    """SIGTERM (a service manager's stop) while the server is still starting: the workers started so far are
    stopped too, and nothing is left running."""
    from support import descendants

    srv = Server(demo_models["llava"], tmp_path / "ws", modes=["e_p_d"])
    try:
        deadline = time.monotonic() + 120
        while len(srv.worker_pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(srv.worker_pids()) == 3, "\n".join(srv.log[-20:])
        assert not any(line.startswith("[trident] ready") for line in srv.log)
        tree = [srv.proc.pid, *descendants(srv.proc.pid)]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in tree if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"left running: {alive}"
    assert any("interrupted during start-up" in line for line in srv.log)


def test_a_worker_python_without_vllm_is_a_clear_error_and_leaves_nothing(demo_models, tmp_path):
    """--backend vllm with a --worker-python that cannot import vllm: the server says so and exits, and what
    it started meanwhile (Triton, the OpenAI frontend) is stopped."""
    import sys

    from support import descendants

    srv = Server(demo_models["llava"], tmp_path / "ws", modes=["epd"],
                 extra=["--backend", "vllm", "--worker-python", sys.executable])
    tree: set[int] = set()
    try:
        while srv.proc.poll() is None:
            tree.update(descendants(srv.proc.pid))
            time.sleep(0.05)
        assert srv.proc.wait(60) != 0
    finally:
        srv.stop()
    assert any("cannot import vllm" in line for line in srv.log), "\n".join(srv.log[-20:])
    deadline = time.monotonic() + 20
    while (alive := [pid for pid in tree if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"left running: {alive}"
