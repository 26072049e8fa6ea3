"""Stage workers on hosts of their own: each "host" is a network namespace on the test's bridge, each of its
processes in PID and mount namespaces of its own with a private /tmp and /dev/shm (:mod:`support.hosts`), so
nothing reaches it but TCP. The head is the LLaVA server test_supervision.py goes on with
(:func:`support.bridged_llava_server`: Triton, the BLS and a worker of each stage of its own, its ports and data
plane on the bridge); a prefill, a decode, a prefill_decode and a generate worker join it, each from a host of its
own, by URL (``trident worker --join``), the checkpoint a copy of their own, the deployment secret from the
environment (no repository-API token: the head's bind model binds them). (EP/D across hosts: test_head_alone.py; the
vLLM engine across hosts: test_head_alone_vllm.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support import bridged_llava_server, build_reference, grpc_generate
from support.hosts import unavailable, worker_env

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"no hosts can be made here: {WHY}")]

GREEDY = {"max_tokens": 6, "temperature": 0}
CASES = {f"image-{i}": [(224, 224, 700 + i)] for i in range(4)}
JOINED = {"prefill": "prefill-2", "decode": "decode-2",  # the stage model each host's worker binds as
          "prefill_decode": "prefill_decode-2", "generate": "generate-2"}
MODE_STAGES = {"e_p_d": ("prefill", "decode"), "e_pd": ("prefill_decode",), "epd": ("generate",)}
CHECKOUT = str(Path(__file__).resolve().parents[2])  # Trident and its environments, a host's own copy (a clone in
# /tmp would be hidden by the host's private /tmp)


@pytest.fixture(scope="module")
def cluster(demo_models, tmp_path_factory, shared_servers):
    import tritonclient.http as httpclient

    server = bridged_llava_server(shared_servers, demo_models["llava"], tmp_path_factory)
    head = server.hosts.head_address
    # UCX_TCP_BRIDGE_ENABLE: the head's end of the links is the test's bridge, which UCX leaves out unless told
    env = worker_env(UCX_TCP_BRIDGE_ENABLE="y")
    workers = {}
    try:
        for stage in JOINED:
            host = server.hosts[stage]
            settings = {"stage": stage, "free_name": True, "model": server.model_path,
                        "url": f"http://{head}:{server.http_port}", "transfer": {"data_address": host.address},
                        "max_inflight": 1 if stage == "generate" else 64}
            workers[stage] = host.popen([sys.executable, "-m", "trident.cli", "worker", "--settings",
                                         json.dumps(settings)], env=env, copies=(server.model_path, CHECKOUT),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            _keep_log(workers[stage])
        admin = httpclient.InferenceServerClient(server.http)
        deadline = time.monotonic() + 180
        while not all(admin.is_model_ready(name) for name in JOINED.values()):
            for stage, proc in workers.items():
                assert proc.poll() is None, f"the {stage} worker on its host exited ({proc.returncode})"
            assert time.monotonic() < deadline, "the workers on other hosts did not bind"
            time.sleep(0.5)
        admin.close()
        time.sleep(1.0)  # the scheduler looks for instances every 0.5 s
        server.joined_workers = workers
        yield server
    finally:  # the joined workers leave: each unbinds itself and exits 0; the head serves on (test_supervision.py)
        server.__dict__.pop("joined_workers", None)
        running = [proc for proc in workers.values() if proc.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGTERM)
        assert [proc.wait(60) for proc in running] == [0] * len(running)


def _keep_log(proc) -> None:
    """Collect ``proc``'s output lines in ``proc.log`` (a test reads what the worker said), passing them on to this
    process's stderr as they come."""
    proc.log = []

    def pump() -> None:
        for line in proc.stdout:
            proc.log.append(line.rstrip("\n"))
            sys.stderr.write(line)

    threading.Thread(target=pump, daemon=True).start()


def _said(proc, words: str, after: int, timeout: float) -> str:
    """The first line from ``after`` on that the worker ``proc`` wrote with ``words`` in it, within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        for line in proc.log[after:]:
            if words in line:
                return line
        assert time.monotonic() < deadline, f"the worker did not say {words!r} within {timeout:g} s: {proc.log[-5:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ref(cluster):
    return build_reference(cluster.model_path, CASES, GREEDY["max_tokens"])


def _routed(server, instance: str) -> float:
    return sum(v for (n, labels), v in server.metrics().items()
               if n == "trident_routed_total" and ("instance", instance) in labels)


def test_stages_on_other_hosts_give_the_reference_tokens(cluster, ref):
    """E/P/D, E/PD and EPD with an instance of each of their stages on a host of its own beside the head's: turn by
    turn each request goes to the head's or the other host's instance of each stage (embeddings from the head to the
    prefill and prefill_decode hosts, KV from a prefill to the other host's decode, over UCX's TCP: the hosts share
    no memory; EPD's whole request on the generate host), and every answer is model.generate()'s. E/PD's images, which
E/P/D's requests encoded, come from the encode worker's embedding cache."""
    for mode, stages in MODE_STAGES.items():
        names = [name for stage in stages for name in (stage, JOINED[stage])]
        before = {name: _routed(cluster, name) for name in names}
        runs = cluster.stats(settled=True)["encode"]["vision_runs"]
        for case in ref.values():
            assert grpc_generate(cluster.grpc, mode, case["text"], case["images"], GREEDY, stream=True).text \
                == case["expected"], mode
        time.sleep(0.5)  # (the scheduler's metric updates)
        served = {name: _routed(cluster, name) - before[name] for name in names}
        assert served == {name: 2 for name in names}, (mode, served)
        if mode == "e_pd":  # E/P/D encoded these images: E/PD's come from the encode worker's cache, to either host
            assert cluster.stats(settled=True)["encode"]["vision_runs"] == runs
    # the transport each instance's READs took, as the stage metrics show it: TCP from the other hosts, and none
    # between the head's own prefill and encode (shared memory or cma)
    wanted = {("prefill", "tcp"): 0, ("prefill", "not_tcp"): 1, ("prefill-2", "tcp"): 1, ("prefill-2", "not_tcp"): 0,
              ("prefill_decode-2", "tcp"): 1, ("prefill_decode-2", "not_tcp"): 0, ("decode-2", "not_tcp"): 0}
    deadline = time.monotonic() + 5
    while True:  # (the stage metrics follow the workers' counters every second)
        peers = {(dict(labels)["model"], n.removeprefix("trident_transfer_peers_")): v
                 for (n, labels), v in cluster.metrics("trident_transfer_peers").items()}
        if all(peers.get(k) == v for k, v in wanted.items()) and peers.get(("decode-2", "tcp"), 0) >= 1 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(peers.get(k) == v for k, v in wanted.items()) and peers.get(("decode-2", "tcp"), 0) >= 1, peers



def _routing(cluster, routing: str | None) -> None:
    """E/P/D's scheduler routes by ``routing`` from now on (Triton's config override, by the operator's token);
    None: by the server's own setting again."""
    import tritonclient.http as httpclient

    admin = httpclient.InferenceServerClient(cluster.http)
    try:
        config = admin.get_model_config("e_p_d")
        parameters = config.setdefault("parameters", {})
        parameters.pop("scheduler", None)
        if routing is not None:
            parameters["scheduler"] = {"string_value": json.dumps({"routing": routing})}
        admin.load_model("e_p_d", config=json.dumps(config), headers={"triton-access-token": cluster.token})
    finally:
        admin.close()


def _attacker(server, what: str, args: dict):
    """tests/multihost/attacker.py ``what`` on the attacker host (no secret: one of its own making), its pipes ours."""
    env = {k: v for k, v in worker_env().items() if k not in ("TRIDENT_TRANSFER_SECRET", "TRIDENT_ACCESS_TOKEN")}
    env.update(TRIDENT_TRANSFER_SECRET="the attacker's own secret, not the deployment's",
               PYTHONPATH=os.pathsep.join([str(Path(CHECKOUT) / "server"), str(Path(CHECKOUT) / "tests")]))
    return server.hosts["attacker"].popen(
        [sys.executable, str(Path(__file__).with_name("attacker.py")), what, json.dumps(args)], env=env,
        copies=(CHECKOUT,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _joined_tcp(server, stage: str) -> list:
    """The TCP stage address the joined worker of ``stage`` bound with (what its traffic shows on the network)."""
    worker = server.workspace / "triton" / "model-store" / JOINED[stage] / "1" / "trident_worker.json"
    return list(json.loads(worker.read_text())["tcp"])


def _exact(server, ref) -> None:
    for mode in MODE_STAGES:
        for case in ref.values():
            text = grpc_generate(server.grpc, mode, case["text"], case["images"], GREEDY, stream=True).text
            assert text == case["expected"], mode


def test_a_host_on_the_network_without_the_secret_gets_nothing_behind_the_entry_models(cluster, ref):
    """A host on the deployment's network (the bridge) that holds no secret, only what the network shows (the
    head's ports, a joined worker's stage address, the stage models' names) and a secret of its own making
    (tests/multihost/attacker.py probe). Its client request to an entry model is served (it does reach the head);
    every stage model refuses it, with or without a credential of its making (Unauthenticated); the repository API
    refuses its unloads without the access token (403); the bind model refuses its bind (Unauthenticated) and
    binds nothing; a joined worker's TCP stage socket fails its handshake, and closes on a frame sent with no
    handshake, answering nothing of it. Afterwards every model is still loaded and the answers are the reference's."""
    import tritonclient.http as httpclient

    stage_models = ["encode", "prefill", "decode", *JOINED.values()]
    proc = _attacker(cluster, "probe", {"head": cluster.hosts.head_address, "http_port": cluster.http_port,
                                        "grpc_port": cluster.grpc_port,
                                        "stage_models": stage_models, "worker_tcp": _joined_tcp(cluster, "prefill"),
                                        "own_tcp": [cluster.hosts["attacker"].address, 9]})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["entry"]["status"] == 200 and seen["entry"]["text"], seen["entry"]
    for name in stage_models:
        for how in ("", " with a credential of its own"):
            answer = seen[f"stage {name}{how}"]
            assert not answer["answered"] and "Unauthenticated" in answer["error"], (name, how, answer)
    for name in (stage_models[0], "epd"):
        for how in ("", " with a guessed token"):
            assert seen[f"unload {name}{how}"]["status"] == 403, (name, how, seen[f"unload {name}{how}"])
    assert seen["bind"]["status"] != 200 and "Unauthenticated" in seen["bind"]["error"], seen["bind"]
    socket_seen = seen["stage socket"]
    assert socket_seen["handshake"].startswith("NotAuthenticated"), socket_seen
    # (the worker's hello, if it came before the close, and nothing else)
    assert socket_seen["raw_bytes_back"] <= 64 and socket_seen["raw_end"] in ("closed", "ConnectionResetError"), (
        socket_seen)
    admin = httpclient.InferenceServerClient(cluster.http)
    try:
        assert all(admin.is_model_ready(name) for name in [*stage_models, *MODE_STAGES])
        assert not admin.is_model_ready("decode-9")
    finally:
        admin.close()
    _exact(cluster, ref)


def test_a_relay_and_a_handshake_flood_from_that_host_fail_while_every_request_gets_its_exact_answer(cluster, ref):
    """From the host with no secret: (1) a relay to a joined worker's stage socket, which a deployment process
    told the relay's address connects through: the handshake fails at both ends, as the proofs name the socket the
    connector meant; (7) 64 connections to that worker's stage socket held without a handshake: the worker closes
    those past its bound for one peer (16) at once, and meanwhile every request, the worker's share included, gets
    its exact answer."""
    from trident.core.auth import NotAuthenticated
    from trident.core.stagecall.client import open_stage_socket

    worker_tcp, attacker = _joined_tcp(cluster, "prefill"), cluster.hosts["attacker"]
    relay = _attacker(cluster, "relay", {"address": attacker.address, "worker_tcp": worker_tcp})
    flood = _attacker(cluster, "flood", {"connections": 64, "worker_tcp": worker_tcp})
    try:
        port = json.loads(relay.stdout.readline())["port"]
        with pytest.raises(NotAuthenticated):
            open_stage_socket({"tcp": [attacker.address, port]})
        held = json.loads(flood.stdout.readline())
        assert held["opened"] == 64 and held["closed_at_once"] >= 64 - 16, held
        before = _routed(cluster, JOINED["prefill"])
        _exact(cluster, ref)
        time.sleep(0.5)  # (the scheduler's metric updates)
        assert _routed(cluster, JOINED["prefill"]) > before  # (the flooded worker served its share meanwhile)
    finally:
        for proc in (relay, flood):
            proc.stdin.close()
            proc.wait(30)


def _stage_ports(server) -> set[int]:
    """The TCP stage ports of every worker bound into the head (its own and the joined ones)."""
    files = (server.workspace / "triton" / "model-store").glob("*/1/trident_worker.json")
    return {json.loads(f.read_text())["tcp"][1] for f in files}


def test_embeddings_changed_on_the_way_between_hosts_are_refused_and_every_other_answer_is_exact(cluster, ref):
    """(6) The host with no secret puts itself on the path from the head to the prefill host (ARP spoofing, as any
    host on a shared network can) and changes one byte of each tensor that crosses there: the UCX traffic, the
    stage sockets' and Triton's ports spared. E/P/D's requests, turn by turn on the head's prefill and the other
    host's: each READ on that host finds its embeddings unlike their record's digest and its request ends in a clean
    error naming it; every other request gets its exact answer. Once the attacker is gone, the same requests are
    answered exactly there too."""
    fresh = build_reference(cluster.model_path, {f"fresh-{i}": [(224, 224, 800 + i)] for i in range(4)},
                            GREEDY["max_tokens"])
    head = cluster.hosts.head_address
    spared = sorted(_stage_ports(cluster) | {cluster.http_port, cluster.grpc_port, cluster.metrics_port})
    proc = _attacker(cluster, "tamper", {"from": head, "to": cluster.hosts["prefill"].address, "spared": spared,
                                        "min_bytes": 4096})
    refused = []
    try:
        assert json.loads(proc.stdout.readline()) == {"on_path": True}, proc.stderr.read()[-2000:]
        before = _routed(cluster, JOINED["prefill"])
        for name, case in fresh.items():
            try:
                text = grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text
            except Exception as e:  # noqa: BLE001 - the error is what is read
                assert "TransferError" in str(e) and "changed on the way" in str(e), str(e)
                refused.append(name)
            else:
                assert text == case["expected"], name
        time.sleep(0.5)  # (the scheduler's metric updates)
        assert len(refused) == _routed(cluster, JOINED["prefill"]) - before == 2, refused
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    counts = json.loads(proc.stdout.read().strip().splitlines()[-1])
    assert counts["changed"] >= len(refused) and counts["passed"] > counts["changed"], counts
    before = _routed(cluster, JOINED["prefill"])
    for name, case in fresh.items():
        assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text \
            == case["expected"], name
    time.sleep(0.5)
    assert _routed(cluster, JOINED["prefill"]) - before == 2


def test_affinity_sends_a_prompt_back_to_the_host_that_prefilled_it(cluster, ref):
    """With affinity routing, each prompt's first prefill goes to the least-loaded instance (turn by turn when idle:
    the head's or the other host's), and the same prompt again goes back there, to the instance on the other host
    too; every answer is the reference."""
    _routing(cluster, "affinity")
    try:
        first = {}
        for name, case in ref.items():
            before = {n: _routed(cluster, n) for n in ("prefill", "prefill-2")}
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text \
                == case["expected"]
            time.sleep(0.5)  # (the scheduler's metric updates)
            went = [n for n in before if _routed(cluster, n) > before[n]]
            assert len(went) == 1, went
            first[name] = went[0]
        assert set(first.values()) == {"prefill", "prefill-2"}, first  # (both hosts took prompts)
        for name, case in [*ref.items(), *ref.items()]:
            before = _routed(cluster, first[name])
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text \
                == case["expected"]
            time.sleep(0.5)
            assert _routed(cluster, first[name]) == before + 1, (name, first[name])
    finally:
        _routing(cluster, None)


def test_a_full_instance_on_another_host_refuses_at_once_with_503(cluster, ref):
    """The generate host's worker takes one request at a time (``max_inflight`` 1): while a stream runs there, a
    second call to it (through its stage model, as a caller with the stage credential) is refused at once across
    the network (UNAVAILABLE, naming its limit), not queued; the running stream ends whole and the instance then
    serves the reference."""
    import threading

    from support import credential

    case = next(iter(ref.values()))
    long = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    done: dict = {}
    stream = threading.Thread(target=lambda: done.update(result=grpc_generate(
        cluster.grpc, "generate-2", case["text"], case["images"], long, stream=True, parameters=credential())))
    stream.start()
    deadline = time.monotonic() + 30
    while not cluster.metrics("vllm:").get(("vllm:num_requests_running", (("model", "generate-2"), ("version", "1"))), 0):
        assert time.monotonic() < deadline and stream.is_alive(), "the stream did not start on generate-2"
        time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Unavailable: the generate stage has 1 requests in flight, its limit"):
        grpc_generate(cluster.grpc, "generate-2", case["text"], case["images"], GREEDY, stream=True,
                      parameters=credential())
    assert time.monotonic() - t0 < 5
    stream.join(120)
    assert done["result"].finish_reason == "length" and done["result"].num_output_tokens > 0, done
    assert grpc_generate(cluster.grpc, "generate-2", case["text"], case["images"], GREEDY, stream=True,
                         parameters=credential()).text == case["expected"]


def test_a_host_cut_off_fails_its_calls_within_seconds_and_serves_again_when_its_link_is_back(cluster, ref):
    """The decode host's link goes down while the scheduler holds a connection to its worker: a request sent there
    ends within 10 s, as the reference answer (served by the head's decode) or an error, never a hang or a wrong
    answer; with the link back, the host's worker answers right again within 10 s."""
    cases = list(ref.values())
    host = cluster.hosts["decode"]
    host.link(False)
    try:
        for case in cases[:2]:  # (turn by turn: one of them goes to the cut-off host)
            t0 = time.monotonic()
            try:
                text = grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True,
                                     timeout=30).text
            except Exception as e:  # noqa: BLE001 - an error naming what was lost is a right answer here
                assert "decode-2" in str(e) and "Unavailable" in str(e), e
            else:
                assert text == case["expected"]
            assert time.monotonic() - t0 < 10
    finally:
        host.link(True)
    t0, before = time.monotonic(), _routed(cluster, "decode-2")
    while _routed(cluster, "decode-2") == before:
        assert time.monotonic() - t0 < 10, "the host's worker did not serve again within 10 s of its link coming back"
        for case in cases[2:]:
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True,
                                 timeout=30).text == case["expected"]
        time.sleep(0.3)


def test_a_worker_cut_off_from_its_server_binds_again_as_the_instance_it_was(cluster, ref):
    """The decode host's link stays down until its worker has seen that it lost the server (the head, which hears
    nothing from the host either, keeps decode-2 loaded: the schedulers route around it call by call). With the link
    back, the worker binds again as decode-2, the instance it was, not as a second instance (decode-3) of the same
    worker, and serves as it."""
    import tritonclient.http as httpclient

    proc, host = cluster.joined_workers["decode"], cluster.hosts["decode"]
    seen = len(proc.log)
    host.link(False)
    try:
        _said(proc, "no longer serves decode-2", seen, 60)
    finally:
        host.link(True)
    assert "worker decode-2 " in _said(proc, "bound into", seen, 120)
    admin = httpclient.InferenceServerClient(cluster.http)
    try:
        assert admin.is_model_ready("decode-2") and not admin.is_model_ready("decode-3")
    finally:
        admin.close()
    t0, before = time.monotonic(), _routed(cluster, "decode-2")
    while _routed(cluster, "decode-2") == before:
        assert time.monotonic() - t0 < 30, "decode-2 did not serve within 30 s of its worker binding again"
        for case in ref.values():
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True,
                                 timeout=30).text == case["expected"]


def test_streams_decoded_on_a_host_cut_off_mid_stream_move_on_with_their_uninterrupted_text(cluster, ref):
    """Migration across hosts: three E/P/D streams at once, decoded on the head's decode worker and the decode host's
    (decode-2); the decode host's link goes down mid-stream. Every stream still ends with the text it gets
    uninterrupted (greedy), the ones on decode-2 moved to the head's decode (counted); with the link back, decode-2
    serves again."""
    from concurrent.futures import ThreadPoolExecutor

    from support.migration import PROMPTS, _grpc_stream, _migrations

    params = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}
    prompts = PROMPTS[:3]
    with ThreadPoolExecutor(len(prompts)) as pool:  # uninterrupted
        expected = dict(zip(prompts, pool.map(
            lambda p: _grpc_stream(cluster, "e_p_d", p, threading.Event(), params), prompts)))
    before = _migrations(cluster)
    results: dict = {}
    firsts = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        try:
            results[prompts[i]] = _grpc_stream(cluster, "e_p_d", prompts[i], firsts[i], params)
        except Exception as e:  # noqa: BLE001 - what the client got
            results[prompts[i]] = e
        finally:
            firsts[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(120)
    on_host = sum(v for (name, labels), v in cluster.metrics("trident_stage_inflight").items()
                  if dict(labels).get("instance") == "decode-2" and dict(labels).get("mode") == "e_p_d")
    host = cluster.hosts["decode"]
    host.link(False)
    try:
        for t in threads:
            t.join(120)
    finally:
        host.link(True)
    assert on_host > 0, "no stream was being decoded on the decode host when its link went down"
    wrong = {p: r for p, r in results.items() if r != expected[p]}
    assert not wrong, {p: (str(r)[:300], expected[p][:60]) for p, r in wrong.items()}
    moved = sum(_migrations(cluster).values()) - sum(before.values())
    assert moved >= 1, (before, _migrations(cluster))
    print(f"{on_host:.0f} stream(s) on decode-2 when its host was cut off; {moved:.0f} moved")
    t0, routed = time.monotonic(), _routed(cluster, "decode-2")
    while _routed(cluster, "decode-2") == routed:  # (decode-2 is tried again once its hold is over)
        assert time.monotonic() - t0 < 30, "the host's worker did not serve again within 30 s of its link coming back"
        for case in ref.values():
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True,
                                 timeout=30).text == case["expected"]


def test_a_joined_worker_killed_has_its_stage_model_unloaded_and_its_stage_is_served_on(cluster, ref):
    """The decode host's worker is killed (SIGKILL: it unbinds nothing). Its host refuses connections from then on,
    and within 5 s the server has unloaded its stage model: Triton no longer shows decode-2 READY (a request to it
    would fail), the server is READY again once the unload is over (not during it: Triton's strict readiness), and
    every request is served right by the head's decode."""
    import tritonclient.http as httpclient

    proc = cluster.joined_workers["decode"]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    admin = httpclient.InferenceServerClient(cluster.http)
    try:
        t0 = time.monotonic()
        while admin.is_model_ready("decode-2"):
            assert time.monotonic() - t0 < 5, "decode-2 is still READY 5 s after its worker was killed"
            time.sleep(0.2)
        while not admin.is_server_ready():
            assert time.monotonic() - t0 < 5, "the server is not READY 5 s after the worker was killed"
            time.sleep(0.2)
        before = _routed(cluster, "decode")
        for case in ref.values():
            assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True,
                                 timeout=30).text == case["expected"]
        time.sleep(0.5)  # (the scheduler's metric updates)
        assert _routed(cluster, "decode") - before == len(ref)
    finally:
        admin.close()

