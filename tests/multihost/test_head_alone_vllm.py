"""The vLLM engine across hosts: every mode with each stage on a host of its own (:mod:`support.hosts`: nothing
crosses but TCP) and a head with no worker (Triton, the BLS). Each host runs the command the Helm chart's stage
containers run (:func:`support.roles.worker_argv` with ``--backend vllm``, from the vLLM environment): the embeddings
go from the encode host to the prefill and prefill_decode hosts over Trident's NIXL, the KV from the prefill host (or
the encode_prefill host) to the decode host, which serves both E/P/D and EP/D, over vLLM's NixlConnector (its side
channel on the producer's data address), all over UCX's TCP. Every answer is model.generate()'s (for LLaVA, vLLM's one-engine output is the same:
test_vllm_serving.py)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from support import (Server, build_reference, cancellable_stream, decode_kv, grpc_generate, hosted_head, stage_output,
                     strings, vllm_python)
from support.hosts import unavailable, worker_env
from support.roles import head_settings, worker_argv

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"no hosts can be made here: {WHY}")]

MODES = ["e_p_d", "ep_d", "e_pd", "epd"]
STAGES = ("encode", "prefill", "decode", "encode_prefill", "prefill_decode", "generate")
MODE_STAGES = {"ep_d": ("encode_prefill", "decode"), "e_pd": ("encode", "prefill_decode"), "epd": ("generate",)}
GREEDY = {"max_tokens": 8, "temperature": 0}
CASES = {"text": [], "image": [(224, 224, 900)]}
CHECKOUT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def head(demo_models, tmp_path_factory, shared_servers):
    """The head (from the pool of shared servers: whatever ran before stops first), its six stage hosts and a host
    with no secret (tests/multihost/attacker.py)."""
    model, python = demo_models["llava"], vllm_python()

    def start(hosts, made) -> Server:
        # every prompt goes through the prefill host (none is prefilled on the decode host)
        config = {**head_settings(MODES), "scheduling": {"local_prefill_tokens": 0}}
        srv = Server(model, tmp_path_factory.mktemp("vllm-head") / "ws", modes=MODES, config=config,
                     extra=["--backend", "vllm", "--worker-python", python])
        made(srv)
        env = worker_env()
        url = f"http://{hosts.head_address}:{srv.http_port}"
        for stage in STAGES:
            argv = worker_argv(stage, model, url, backend="vllm")
            hosts[stage].popen([python, "-m", "trident.cli", *argv[1:]], env=env, copies=(model, CHECKOUT))
        srv.wait_ready(timeout=400)
        return srv

    return hosted_head(shared_servers, ("llava", "vllm-hosts"), [*STAGES, "attacker"], start)  # (attacker: no worker)


@pytest.fixture(scope="module")
def ref(head):
    return build_reference(head.model_path, CASES, GREEDY["max_tokens"])


def _stage_metrics(head, prefix: str) -> dict[tuple[str, str], float]:
    return {(name, dict(labels)["model"]): v for (name, labels), v in head.metrics(prefix).items()}


def test_each_stage_on_its_own_host_gives_the_reference_tokens(head, ref):
    """Streamed and not, with an image and without, every answer is model.generate()'s; the prefill host READs the
    embeddings over TCP, and the decode host's vLLM engine the KV (the transports they saw, in the stage metrics)."""
    for case in ref.values():
        for stream in (True, False):
            assert grpc_generate(head.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=stream).text \
                == case["expected"], (case, stream)
    deadline = time.monotonic() + 5
    while (peers := _stage_metrics(head, "trident_transfer_peers")).get(("trident_transfer_peers_tcp", "prefill-2")) \
            != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert peers.get(("trident_transfer_peers_tcp", "prefill-2")) == 1, peers
    assert peers.get(("trident_transfer_peers_not_tcp", "prefill-2")) == 0, peers
    # the decode host's vLLM engine READ the KV from the prefill host's over TCP too (its connector's transport)
    deadline = time.monotonic() + 5
    while (peers := _stage_metrics(head, "trident_transfer_peers")).get(("trident_transfer_peers_tcp", "decode-2"), 0) \
            < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert peers.get(("trident_transfer_peers_tcp", "decode-2"), 0) >= 1, peers
    assert peers.get(("trident_transfer_peers_not_tcp", "decode-2")) == 0, peers
    assert _stage_metrics(head, "trident_transfer_read_bytes").get(("trident_transfer_read_bytes_total", "decode-2"), 0) > 0


@pytest.mark.parametrize("mode", ["ep_d", "e_pd", "epd"])
def test_the_other_modes_across_hosts_give_the_reference_tokens(head, ref, mode):
    """EP/D (the encode_prefill host encodes and prefills; the decode host, E/P/D's too, claims the KV there and
    reads it over TCP), E/PD (the encode host's embeddings to the prefill_decode host) and EPD (the generate host
    alone): streamed and not, every answer is model.generate()'s, each served by its stages' hosts."""
    joined = [f"{stage}-2" for stage in MODE_STAGES[mode]]

    def routed() -> dict[str, float]:
        return {name: sum(v for (metric, labels), v in head.metrics().items()
                          if metric == "trident_routed_total" and ("instance", name) in labels) for name in joined}

    before = routed()
    for case in ref.values():
        for stream in (True, False):
            assert grpc_generate(head.grpc, mode, case["text"], case["images"], GREEDY, stream=stream).text \
                == case["expected"], (case, stream)
    time.sleep(0.5)  # (the scheduler's metric updates)
    after = routed()
    with_images = sum(bool(case["images"]) for case in ref.values())  # (a text-only prompt skips the encode stage)
    wanted = {name: 2 * (with_images if name == "encode-2" else len(ref)) for name in joined}
    assert {name: after[name] - before[name] for name in joined} == wanted, (before, after)


def test_a_stream_cancelled_across_hosts_frees_the_decode_host_s_blocks(head, ref):
    """A stream cancelled after its first tokens: the decode host's vLLM stops it and holds no KV within 5 s (vLLM's
    own gauges, which the stage model's stub asks its worker for over the stage link every second), and the next
    request is exact."""
    case = ref["image"]
    with cancellable_stream(head.grpc, "e_p_d", case["text"], case["images"],
                            {"max_tokens": 200, "temperature": 0}) as next_response:
        next_response()
        next_response()
    deadline = time.monotonic() + 5
    while True:
        gauges = _stage_metrics(head, "vllm:")
        held = {key: v for key, v in gauges.items() if key[1] == "decode-2" and v > 0
                and key[0] in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")}
        if not held or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not held, gauges
    assert grpc_generate(head.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text \
        == case["expected"]


def test_a_host_without_the_secret_gets_no_kv_agent_metadata_from_the_side_channel(head, ref):
    """vLLM's NIXL side channel on the prefill host (a KV producer's ZeroMQ listener: its agent metadata gives READ and
    WRITE on its KV cache) answers nothing to a host on the network that holds no secret: neither vLLM's plain
    ``get_meta_msg`` nor one sealed with a secret of that host's making (issue 50 item 4, across hosts); the
    decode host still takes the KV through it."""
    from trident.core.protocol import decode_record

    case = ref["text"]
    kv = stage_output(head.grpc, "prefill-2", {"text_input": strings(case["text"])})  # (the hosts' workers join as -2)
    params = decode_record(kv).kv_transfer_params  # (the record names the producer's side channel)
    assert params["remote_host"] == head.hosts["prefill"].address, params
    env = {k: v for k, v in worker_env().items() if k != "TRIDENT_TRANSFER_SECRET"}
    env.update(TRIDENT_TRANSFER_SECRET="the attacker's own secret, not the deployment's",
               PYTHONPATH=os.pathsep.join([str(Path(CHECKOUT) / "server"), str(Path(CHECKOUT) / "tests")]))
    proc = head.hosts["attacker"].popen(
        [vllm_python(), str(Path(__file__).with_name("attacker.py")), "side_channel",
         json.dumps({"host": params["remote_host"], "port": params["remote_port"]})],
        env=env, copies=(CHECKOUT,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"plain": None, "sealed with its own secret": None}, out
    assert decode_kv(head.grpc, kv, case["text"], "decode-2") is None  # (the deployment's own decode takes it)
    assert grpc_generate(head.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text == case["expected"]
