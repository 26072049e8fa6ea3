"""A head with no stage worker of its own (``instances`` 0 for each of its stages): Triton, the BLS and nothing
else. Its EP/D stages join from two hosts (:mod:`support.hosts`: nothing crosses but TCP): the decode host runs
the command the Helm chart's stage containers run (:func:`support.roles.worker_argv`; its data address the one it
reaches the head from), the encode_prefill host ``trident node encode_prefill`` (a supervisor that starts its
worker again when it exits). The head is not READY until both have joined, then serves model.generate()'s tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from support import Server, build_reference, descendants, grpc_generate, hosted_head
from support.hosts import unavailable, worker_env
from support.roles import HEALTH_PORT, head_settings, python_argv, worker_argv

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"no hosts can be made here: {WHY}")]

MODES = ["ep_d"]
STAGES = ("encode_prefill", "decode")
GREEDY = {"max_tokens": 6, "temperature": 0}
CASES = {"text": [], **{f"image-{i}": [(224, 224, 800 + i)] for i in range(2)}}
CHECKOUT = str(Path(__file__).resolve().parents[2])


def _head(model: str, tmp_path_factory, ports=None) -> Server:
    return Server(model, tmp_path_factory.mktemp("head") / "ws", modes=MODES, ports=ports,
                  config={**head_settings(MODES), "scheduling": {"local_prefill_tokens": 0}})


@pytest.fixture(scope="module")
def head(demo_models, tmp_path_factory, shared_servers):
    """The head (from the pool of shared servers: whatever ran before stops first) and its two stage hosts;
    ``head.not_ready_before_join``: what Triton's readiness said while it waited for them."""
    import requests

    model = demo_models["llava"]

    def start(hosts, made) -> Server:
        srv = _head(model, tmp_path_factory)
        made(srv)
        srv.joined = {}
        deadline = time.monotonic() + 120
        while not any(line.startswith("[trident] waiting for stage hosts to join") for line in srv.log):
            assert srv.proc.poll() is None and time.monotonic() < deadline, "\n".join(srv.log[-20:])
            time.sleep(0.2)
        srv.not_ready_before_join = requests.get(f"http://{srv.http}/v2/health/ready", timeout=5).status_code
        env = worker_env()
        url = f"http://{hosts.head_address}:{srv.http_port}"
        srv.joined["decode"] = hosts["decode"].popen(python_argv(worker_argv("decode", model, url)), env=env,
                                                    copies=(model, CHECKOUT))
        srv.node_log = []
        srv.joined["encode_prefill"] = node = hosts["encode_prefill"].popen(
            python_argv(["trident", "node", "encode_prefill", "--model", model, "--join", url]), env=env,
            copies=(model, CHECKOUT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: srv.node_log.extend(line.rstrip() for line in node.stdout),
                         daemon=True).start()
        srv.wait_ready(timeout=240)
        return srv

    return hosted_head(shared_servers, ("llava", "head-alone"), list(STAGES), start)


@pytest.fixture(scope="module")
def ref(head):
    return build_reference(head.model_path, CASES, GREEDY["max_tokens"])


def test_a_head_starts_no_worker_and_is_not_ready_until_its_stages_join(head):
    assert not [line for line in head.log if line.startswith("[trident] started worker")], head.log
    assert head.not_ready_before_join != 200
    joined = sorted(line.split("stage model ")[1].split()[0] for line in head.log if line.endswith(" joined"))
    assert joined == ["decode-2", "encode_prefill-2"], joined


def test_a_stage_worker_s_health_is_200_while_it_serves(head):
    """The probe the chart's stage containers have: GET /health on the worker's data address (the address it
    reaches the head from: its host's), 200 while bound; anything else there is a 404."""
    import requests

    for stage in ["decode"]:  # (the node's workers have no --health-port)
        url = f"http://{head.hosts[stage].address}:{HEALTH_PORT}"
        reply = requests.get(f"{url}/health", timeout=5)
        assert (reply.status_code, reply.text) == (200, "serving")
        assert requests.get(f"{url}/metrics", timeout=5).status_code == 404


def test_its_stages_on_other_hosts_give_the_reference_tokens(head, ref):
    """Every request goes head -> encode_prefill host -> decode host (the KV over UCX's TCP between the two
    hosts), with and without an image, each answer model.generate()'s."""
    for case in ref.values():
        assert grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True).text \
            == case["expected"]
        assert grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=False).text \
            == case["expected"]


def _node_worker(head) -> int:
    """The pid (this machine's) of the worker the encode_prefill host's node runs."""
    node = head.joined["encode_prefill"]
    for pid in descendants(node.pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"trident worker encode_prefill"):
                return pid
        except OSError:
            pass
    raise AssertionError(f"no worker under the node: {head.node_log[-10:]}")


def test_a_stage_host_s_worker_killed_comes_back_with_a_new_agent_and_the_answers_stay_exact(head, ref):
    """SIGKILL to the encode_prefill host's worker (it unbinds nothing): its node starts it again (a new process,
    a new NIXL agent, the decode host untouched), the head unloads the dead instance, and once the new one has
    joined every answer is model.generate()'s again: the decode worker READs the KV from the new agent, whose
    metadata the records carry."""
    killed = _node_worker(head)
    t0 = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    case = next(iter(ref.values()))
    while True:
        try:
            text = grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True, timeout=30).text
        except Exception as e:  # noqa: BLE001 - no encode_prefill instance meanwhile: an error, never a wrong answer
            assert "Unavailable" in str(e) or "encode_prefill" in str(e), e
        else:
            assert text == case["expected"]
            if _node_worker(head) != killed:
                break
        assert time.monotonic() - t0 < 60, head.node_log[-10:]
        time.sleep(0.5)
    print(f"served again by the node's new worker {time.monotonic() - t0:.1f} s after the kill")
    assert any("worker encode_prefill#1 exited with code -9; starting it again" in line for line in head.node_log)
    assert head.joined["decode"].poll() is None
    for case in ref.values():
        assert grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True).text \
            == case["expected"]


def test_a_stage_host_s_worker_killed_mid_stream_fails_that_stream_in_seconds_naming_it_and_its_replacement_serves(
        head, ref):
    """SIGKILL to the decode host's worker while it streams: the stream ends within 5 s with an error naming the
    instance, not its address (no hang, never a success); a new worker started on that host (as a cluster restarts
    its container) joins, and every answer is exact again."""
    import threading

    decode = head.hosts["decode"]
    proc = head.joined["decode"]
    case = next(iter(ref.values()))
    outcome: dict = {}

    def stream() -> None:
        try:
            outcome["text"] = grpc_generate(head.grpc, "ep_d", case["text"], case["images"],
                                            {"max_tokens": 400, "temperature": 0, "ignore_eos": True},
                                            stream=True, timeout=60).text
        except Exception as e:  # noqa: BLE001 - what the client gets
            outcome["error"] = str(e)
        outcome["at"] = time.monotonic()

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(2.0)  # (well into its decode)
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    reader.join(30)
    assert "error" in outcome, outcome
    took = outcome["at"] - killed
    assert took < 5, took
    assert "decode-2 stage's worker on another host went away" in outcome["error"], outcome["error"]
    assert decode.address not in outcome["error"]  # (its address is for the head's log alone)
    print(f"the stream failed {took:.1f} s after the kill: {outcome['error'][:200]}")
    env = worker_env()
    url = f"http://{head.hosts.head_address}:{head.http_port}"
    head.joined["decode"] = decode.popen(python_argv(worker_argv("decode", head.model_path, url)), env=env,
                                         copies=(head.model_path, CHECKOUT))
    t0 = time.monotonic()
    while True:
        try:
            text = grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True, timeout=30).text
        except Exception as e:  # noqa: BLE001 - no decode instance meanwhile
            assert "Unavailable" in str(e) or "decode" in str(e), e
        else:
            assert text == case["expected"]
            break
        assert time.monotonic() - t0 < 90, "the new decode worker did not serve within 90 s"
        time.sleep(0.5)
    for case in ref.values():
        assert grpc_generate(head.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True).text \
            == case["expected"]


def test_a_restarted_head_gets_its_stage_hosts_back_without_touching_them(head, ref, tmp_path_factory):
    """The module's last test. The head stops (SIGTERM) and a new one starts on the same ports, with the same
    secrets: the stage hosts' workers, left alone, see their stage models gone, wait for the head and bind again
    (the same names), and the new head serves model.generate()'s tokens once they have. No worker restarted."""
    assert head.stop() == 0, "\n".join(head.log[-20:])
    t0 = time.monotonic()
    again = _head(head.model_path, tmp_path_factory,
                  ports=(head.http_port, head.grpc_port, head.metrics_port, head.openai_port))
    try:
        again.wait_ready(timeout=120)
        took = time.monotonic() - t0
        joined = sorted(line.split("stage model ")[1].split()[0] for line in again.log if line.endswith(" joined"))
        assert joined == ["decode-2", "encode_prefill-2"], again.log
        assert all(proc.poll() is None for proc in head.joined.values())  # the same processes
        for case in ref.values():
            assert grpc_generate(again.grpc, "ep_d", case["text"], case["images"], GREEDY, stream=True).text \
                == case["expected"]
        print(f"the new head was READY {took:.1f} s after the old one stopped")
    finally:
        assert again.stop() == 0, "\n".join(again.log[-20:])
