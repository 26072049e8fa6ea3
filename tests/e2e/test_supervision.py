"""Supervision: a stage worker killed with SIGKILL with a request inside: the request moves on and ends whole, and
the worker comes back; the other modes serve throughout (Triton's L0_lifecycle, Dynamo's worker-restart and
migration checks). The short soak runs on the same server, then a hung Triton is killed and started again there, then
Triton is killed until the head gives up."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from support import Server, bridged_llava_server, grpc_generate
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


def test_a_worker_shows_its_stacks_on_sigusr1_and_serves_on(server):
    """kill -USR1 a stage worker: every thread's Python stack comes out in the server's output (the worker's binding
    loop among them: what a worker that does not bind is doing), and the same process serves on."""
    expected = grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text
    pid, seen = server.worker_pid("prefill"), len(server.log)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not any("in run_worker" in line for line in server.log[seen:]):
        assert time.monotonic() < deadline, "\n".join(server.log[seen:])
        time.sleep(0.1)
    assert any(line.startswith("Thread 0x") for line in server.log[seen:])
    assert server.worker_pid("prefill") == pid  # (no restart: the same worker)
    assert grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text == expected
    assert not any("worker prefill exited" in line for line in server.log[seen:])


@pytest.mark.parametrize("stage", ["decode", "prefill", "encode"])
def test_a_killed_worker_s_request_moves_on_and_the_worker_comes_back(server, stage):
    """SIGKILL to a stage's worker with a request inside (decode: mid-stream; prefill: held there by a test-only
    marker): the request moves on (scheduling.migration_limit; here to a fallback mode, the only decode gone) and
    the client's stream ends whole, with the uninterrupted greedy text; the migration is counted; the worker comes
    back and the other modes serve throughout."""
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
        if stage in ("decode", "prefill"):
            result: dict = {}
            prompt = PROMPT if stage == "decode" else PROMPT.replace(" ASSISTANT:", " [[trident-stall@prefill]] ASSISTANT:")
            long = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
            whole = grpc_generate(server.grpc, "epd", prompt, [], long, stream=True).text  # (epd: no prefill stage)
            before = _migrations(server)

            def stream():
                try:
                    result["text"] = grpc_generate(server.grpc, "e_p_d", prompt, [], long, stream=True).text
                except Exception as e:
                    result["error"] = str(e)

            t = threading.Thread(target=stream)
            t.start()
            time.sleep(2.0)
            os.kill(pid, signal.SIGKILL)
            t.join(120)
            assert result.get("text") == whole, result.get("error")
            if stage == "decode":  # (a prefill lost mid-call had sent nothing: planned again, not a migration)
                assert _migrations(server) > before
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


def _migrations(server) -> float:
    return sum(v for (name, _), v in server.metrics("trident_migrations").items() if name.endswith("_total"))


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


def test_a_hung_triton_is_killed_and_started_again(server):
    """A tritonserver whose process lives but answers nothing (SIGSTOP here; Triton 2.51 was seen to stall that way
    in its own crash report, for 300 s, after its python backend aborted it): the head kills it once it has been
    silent for HUNG_S, starts it again with the same workers, and the server serves the same answer. The killed
    Triton's python-backend folder in /tmp (which a clean exit removes) is removed too."""
    from support import descendants
    from trident.supervisor.triton_process import HUNG_S

    expected = grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text
    tritons = {pid for pid in descendants(server.proc.pid) if _cmdline(pid).split(" ", 1)[0].endswith("tritonserver")}
    (triton,) = [pid for pid in tritons if _parent(pid) not in tritons]
    record = server.workspace / "triton-temp-folders"
    (folder,) = record.read_text().split()  # (the shim's list: supervisor/triton_shim.c)
    assert folder.startswith("/tmp/python_env_") and os.path.isdir(folder)
    workers, seen = sorted(server.worker_pids()), len(server.log)
    os.kill(triton, signal.SIGSTOP)
    t0, said = time.monotonic(), f"[trident] Triton (pid {triton}) has not answered for {HUNG_S:.0f} s; killing it"
    while not any(line.startswith("[trident] Triton is back") for line in server.log[seen:]):
        assert time.monotonic() - t0 < HUNG_S + 120 and server.proc.poll() is None, "\n".join(server.log[-20:])
        time.sleep(0.2)
    assert any(line.startswith(said) for line in server.log[seen:]), "\n".join(server.log[-20:])
    assert sorted(server.worker_pids()) == workers  # (the same workers: their engines kept)
    assert grpc_generate(server.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text == expected
    assert not os.path.exists(folder) and record.read_text().split() != [folder]


def test_a_triton_that_keeps_dying_stops_everything_and_exits_non_zero(server):
    """Triton killed again and again, each soon after the head started it anew: after 5 deaths in a row the head
    gives up, stops every process it started and exits 1, so that a service manager restarts it (a single death:
    it comes back, tests/e2e/test_trust.py). Last of the module's tests on its server."""
    from support import descendants

    started = descendants(server.proc.pid)
    server.exit_code = 1
    killed: set[int] = set()
    deadline = time.monotonic() + 150
    while server.proc.poll() is None and time.monotonic() < deadline:
        for pid in descendants(server.proc.pid):
            if pid not in killed and (_cmdline(pid).startswith("tritonserver") or "/tritonserver " in _cmdline(pid)):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.1)
    assert server.proc.wait(30) == 1, server.log[-10:]
    server._reader.join(10)
    assert len(killed) >= 5, killed  # (each death ours; the first counts only if Triton had run under 60 s)
    assert any("Triton exited 5 times in a row" in line for line in server.log), server.log[-10:]
    deadline = time.monotonic() + 10
    while (alive := [p for p in started if os.path.exists(f"/proc/{p}") and _cmdline(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, [_cmdline(p)[:80] for p in alive]


def test_a_killed_head_leaves_nothing_and_its_ports_serve_again(demo_models, tmp_path):
    """`trident serve` killed with SIGKILL (the OOM killer's way): within seconds no process it started is left (the
    OpenAI frontend and the workers used to live on, holding their ports), nor the workers' socket folders in /tmp,
    and a new server starts on the same ports."""
    from support import descendants

    srv = Server(demo_models["llava"], tmp_path / "ws", modes=["e_pd"])
    try:
        srv.wait_ready()
        tree = descendants(srv.proc.pid)
        names = {pid: _cmdline(pid) for pid in tree}
        assert any(" frontend " in n for n in names.values()) and len(srv.worker_pids()) == 2, names
        folders = set(srv.socket_folders().values())
        assert len(folders) == 2 and all(os.path.isdir(f) for f in folders), folders  # (the workers' sockets)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        deadline = time.monotonic() + 10
        while (alive := [p for p in tree if os.path.exists(f"/proc/{p}") and _cmdline(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, {p: names[p][:80] for p in alive}
        assert not [f for f in folders if os.path.exists(f)]  # (removed by the workers themselves: no head left)
    finally:
        srv.stop()
    again = Server(demo_models["llava"], tmp_path / "ws2", modes=["e_pd"],
                   ports=(srv.http_port, srv.grpc_port, srv.metrics_port, srv.openai_port))
    try:
        again.wait_ready()
    finally:
        again.stop()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


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


def test_triton_killed_during_start_up_is_started_again_and_the_server_gets_ready(demo_models, tmp_path):
    """kill -9 tritonserver twice during start-up: while the bind model loads (its python-backend stub started: CI saw
    Triton crash there, in its python backend), then while the stages bind (one stage model ready, the others not
    yet). Each time the head starts Triton again, with the same workers (their engines kept), the stages bind again,
    and the server gets ready and serves; it is not READY before."""
    from support import descendants

    def triton() -> int:
        # (a stub Triton has forked and not yet exec'd has Triton's command line: its parent is Triton)
        tritons = {pid for pid in descendants(srv.proc.pid) if _cmdline(pid).split(" ", 1)[0].endswith("tritonserver")}
        (pid,) = [pid for pid in tritons if _parent(pid) not in tritons]
        return pid

    def until(seen, what: str, poll_s: float = 0.05):
        deadline = time.monotonic() + 180
        while not (found := seen()):
            assert time.monotonic() < deadline and srv.proc.poll() is None, f"{what}:\n" + "\n".join(srv.log[-20:])
            time.sleep(poll_s)
        return found

    srv = Server(demo_models["llava"], tmp_path / "ws", modes=["e_p_d"])
    try:
        until(lambda: [pid for pid in descendants(srv.proc.pid)
                       if "triton_python_backend_stub" in (c := _cmdline(pid)) and "/trident_bind/" in c],
              "no bind-model stub", poll_s=0.01)
        os.kill(triton(), signal.SIGKILL)
        until(lambda: any(line.startswith("[trident] waiting for stage workers") for line in srv.log), "no workers")
        first = [line for line in srv.log if "Triton exited" in line or "waiting for stage workers" in line]
        # (noticed by the bind model's load, before the workers started: the first death's own step)
        assert first[0].startswith("[trident] Triton exited; starting it again"), first
        until(lambda: any(" is ready" in line and "stage model" in line for line in srv.log), "no stage model ready")
        assert not any(line.startswith("[trident] ready") for line in srv.log)
        os.kill(triton(), signal.SIGKILL)
        workers = sorted(srv.worker_pids())
        srv.wait_ready()
        assert sum("Triton exited; starting it again" in line for line in srv.log) == 2, "\n".join(srv.log[-30:])
        assert sorted(srv.worker_pids()) == workers and len(workers) == 3  # (none started again)
        expected = grpc_generate(srv.grpc, "e_p_d", PROMPT, [], GREEDY, stream=True).text
        assert expected and grpc_generate(srv.grpc, "e_p_d", PROMPT, [], GREEDY, stream=False).text == expected
    finally:
        srv.stop()


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
