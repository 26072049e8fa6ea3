"""Stage workers on hosts of their own: each "host" is a network namespace on the test's bridge, each of its
processes in PID and mount namespaces of its own with a private /tmp and /dev/shm (:mod:`support.hosts`), so
nothing reaches it but TCP. A head `trident serve` (Triton, the BLS, an encode, prefill and decode worker of its
own) binds its ports and its data plane to the bridge; a prefill worker and a decode worker join it from their own
hosts by URL (``trident worker --join``), with the secrets from the environment."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from support import build_reference, grpc_generate, serving
from support.hosts import Hosts, unavailable

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"no hosts can be made here: {WHY}")]

GREEDY = {"max_tokens": 6, "temperature": 0}
CASES = {f"image-{i}": [(224, 224, 700 + i)] for i in range(4)}
JOINED = {"prefill": "prefill-2", "decode": "decode-2"}


@pytest.fixture(scope="module")
def cluster(demo_models, tmp_path_factory):
    with Hosts(list(JOINED)) as hosts:
        head = hosts.head_address
        config = {"host": "0.0.0.0", "transfer": {"data_address": head},
                  # each stage's instances take turns; every prompt is prefilled by a prefill stage
                  "scheduling": {"routing": "round_robin", "local_prefill_tokens": 0}}
        with serving(demo_models["llava"], tmp_path_factory.mktemp("head") / "ws", modes=["e_p_d"],
                     config=config) as server:
            env = dict(os.environ, TRIDENT_ACCESS_TOKEN=server.token, HF_HUB_OFFLINE="1", UCX_TLS="tcp")
            workers = {}
            for stage, host in hosts.hosts.items():
                settings = {"stage": stage, "free_name": True, "model": server.model_path,
                            "url": f"http://{head}:{server.http_port}", "transfer": {"data_address": host.address}}
                workers[stage] = host.popen([sys.executable, "-m", "trident.cli", "worker", "--settings",
                                             json.dumps(settings)], env=env)
            deadline = time.monotonic() + 180
            import tritonclient.http as httpclient

            admin = httpclient.InferenceServerClient(server.http)
            while not all(admin.is_model_ready(name) for name in JOINED.values()):
                for stage, proc in workers.items():
                    assert proc.poll() is None, f"the {stage} worker on its host exited ({proc.returncode})"
                assert time.monotonic() < deadline, "the workers on other hosts did not bind"
                time.sleep(0.5)
            time.sleep(1.0)  # the scheduler looks for instances every 0.5 s
            server.hosts, server.joined = hosts, workers
            yield server


@pytest.fixture(scope="module")
def ref(cluster):
    return build_reference(cluster.model_path, CASES, GREEDY["max_tokens"])


def _routed(server, instance: str) -> float:
    return sum(v for (n, labels), v in server.metrics().items()
               if n == "trident_routed_total" and ("instance", instance) in labels)


def test_stages_on_other_hosts_give_the_reference_tokens(cluster, ref):
    """E/P/D with a prefill and a decode instance on hosts of their own beside the head's: turn by turn each request
    goes to the head's or the other host's instance of each stage (embeddings from the head to the prefill host,
    KV from it to the head's decode or the decode host, over UCX's TCP), and every answer is model.generate()'s."""
    before = {name: _routed(cluster, name) for name in ("prefill", "decode", *JOINED.values())}
    for case in CASES.values():
        assert grpc_generate(cluster.grpc, "e_p_d", case["text"], case["images"], GREEDY, stream=True).text \
            == case["expected"]
    time.sleep(0.5)
    served = {name: _routed(cluster, name) - before[name] for name in before}
    assert all(count >= 1 for count in served.values()), served
