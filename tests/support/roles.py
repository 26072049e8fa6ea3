"""The command each role of a deployment runs, as tests/multihost runs it on its hosts and as the Helm chart
(deploy/helm/trident) runs it in its containers; tests/unit/test_chart.py holds the chart to these."""

from __future__ import annotations

from trident.core.protocol import stages_for


HEALTH_PORT = 8080  # a stage worker's GET /health, on its data address (the chart's probes)


def worker_argv(stage: str, model: str, head_url: str, backend: str = "hf") -> list[str]:
    """A stage host's worker, joining the head at ``head_url`` (its data address: the one it reaches the head
    from; its secrets from the environment)."""
    argv = ["trident", "worker", stage, "--model", model, "--join", head_url, "--health-port", str(HEALTH_PORT)]
    return argv + (["--backend", backend] if backend != "hf" else [])


def head_argv(config: str) -> list[str]:
    """The head: Triton, the schedulers and the OpenAI frontend, its settings in the file ``config``."""
    return ["trident", "serve", "--config", config]


def head_settings(modes: list[str]) -> dict:
    """What a head whose stages all run on stage hosts has in its config file, whatever else it holds."""
    return {"host": "0.0.0.0", "modes": list(modes), "instances": {stage: 0 for stage in stages_for(modes)}}


def python_argv(argv: list[str]) -> list[str]:
    """``argv`` run by this interpreter (``trident ...`` is ``python -m trident.cli ...``)."""
    import sys

    assert argv[0] == "trident"
    return [sys.executable, "-m", "trident.cli", *argv[1:]]
