"""`trident serve`'s settings: a few flags, everything else from a config file (issue 32), and the generated
reference of its keys (docs/configuration.md)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from trident import cli
from trident.core.config import FrontendSettings, MediaLimits, MiB, ServeSettings, WorkerSettings
from trident.config_reference import INTRO, reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def settings(argv: list[str]) -> ServeSettings:
    return cli.serve_settings(cli.build_parser().parse_args(["serve", *argv]))


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data) if path.suffix in (".yaml", ".yml") else json.dumps(data))
    return str(path)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("TRIDENT_WORKER_PYTHON", "TRIDENT_ACCESS_TOKEN", "TRIDENT_TRANSFER_SECRET"):
        monkeypatch.delenv(name, raising=False)


def test_serve_help_lists_at_most_20_options():
    options = [a for a in serve_parser()._actions if a.option_strings]  # -h counts as one
    flags = {f for a in options for f in a.option_strings}
    assert len(options) <= 20, sorted(flags)
    assert {"--config", "--model", "--mode", "--access-token-file", "--transfer-secret-file"} <= flags
    gone = {"--stage-calls", "--record-handoff", "--vllm-executor", "--vllm-nixl-progress-thread", "--fault-injection",
            "--access-token", "--transfer-secret"}
    assert not flags & gone


def test_no_flag_means_every_default():
    assert settings([]) == ServeSettings()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_values_reach_the_settings_and_flags_override_them(tmp_path, suffix):
    path = write(tmp_path / f"serve{suffix}", {
        "modes": ["e_p_d"], "http_port": 8100, "backend": "vllm", "instances": {"prefill": 2},
        "scheduling": {"routing": "least_loaded", "local_prefill_tokens": 0},
        "media_limits": {"max_images": 4, "max_bytes": "2 MiB"},
        "frontend": {"max_body_bytes": 8 * MiB, "model_name": "from-file", "media": {"allowed_media_dir": "/srv"}},
        "vllm": {"kv_cache_gib": 4}, "transfer": {"lease_s": 10}, "warm_up": False,
    })
    s = settings(["--config", path])
    assert s.modes == ("e_p_d",) and s.http_port == 8100 and s.backend == "vllm" and s.instances == {"prefill": 2}
    assert s.scheduling.routing == "least_loaded" and s.scheduling.local_prefill_tokens == 0
    assert s.scheduling.local_encode_images == 0  # a key left out keeps its default
    assert s.media_limits.max_images == 4 and s.media_limits.max_bytes == 2 * MiB
    assert s.frontend.max_body_bytes == 8 * MiB and s.frontend.model_name == "from-file"
    assert str(s.frontend.media.allowed_media_dir) == "/srv"
    assert s.vllm.kv_cache_gib == 4 and s.transfer.lease_s == 10 and not s.warm_up

    s = settings(["--config", path, "--http-port", "9100", "--served-model-name", "cli", "--mode", "all",
                  "--instances", "encode=2", "--backend", "hf"])
    assert s.http_port == 9100 and s.backend == "hf" and s.modes == ServeSettings().modes
    assert s.frontend.model_name == "cli" and s.frontend.max_body_bytes == 8 * MiB  # the rest of frontend stays
    assert s.instances == {"prefill": 2, "encode": 2}


def test_flags_override_the_environment_which_overrides_the_file(tmp_path, monkeypatch):
    path = write(tmp_path / "serve.json", {"worker_python": "/from/file"})
    assert settings(["--config", path]).worker_python == "/from/file"
    monkeypatch.setenv("TRIDENT_WORKER_PYTHON", "/from/env")
    assert settings(["--config", path]).worker_python == "/from/env"
    assert settings(["--config", path, "--worker-python", "/from/flag"]).worker_python == "/from/flag"


@pytest.mark.parametrize("data, names", [
    ({"http_prot": 1}, "http_prot: unknown key"),
    ({"scheduling": {"routin": "affinity"}}, "scheduling.routin: unknown key"),
    ({"frontend": {"media": {"max_byte": 1}}}, "frontend.media.max_byte: unknown key"),
    ({"scheduling": {"routing": "fastest"}}, "scheduling.routing: Input should be"),
    ({"media_limits": {"max_bytes": "lots"}}, "media_limits.max_bytes:"),
    ({"modes": ["e_p_d", "xyz"]}, "modes: unknown mode(s) ['xyz']"),
    ({"frontend": {"port": 1}}, "invalid settings: frontend: port: set by trident serve"),
    ({"vllm": {"executor": "mp"}}, "vllm.executor: unknown key"),  # (finished experiments: the engine's model runs
    ({"vllm": {"nixl_progress_thread": True}}, "vllm.nixl_progress_thread: unknown key"),  # in its engine core, NIXL unthreaded)
])
def test_an_unknown_key_or_a_bad_value_is_refused_naming_it(tmp_path, capsys, data, names):
    path = write(tmp_path / "serve.yaml", data)
    assert cli.main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trident serve: invalid settings: ") and names in err and "Traceback" not in err


@pytest.mark.parametrize("name, text, says", [
    ("serve.yaml", "a: [1", "not valid YAML"),
    ("serve.json", "{", "not valid JSON"),
    ("serve.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("serve.toml", "a = 1", "name the file .yaml, .yml or .json"),
    ("serve.yaml", "transfer_secret: abc\n", "a secret is not read from a config file"),
    ("serve.yaml", "access_token: abc\n", "--access-token-file"),
])
def test_a_config_file_that_is_not_one_is_refused(tmp_path, capsys, name, text, says):
    (tmp_path / name).write_text(text)
    assert cli.main(["serve", "--config", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trident serve: --config ") and says in err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_secrets_come_from_files_only_their_owner_may_read(tmp_path, capsys):
    token, secret = tmp_path / "token", tmp_path / "secret"
    strong = "s3cret-" + "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    token.write_text("tok-123\n")
    secret.write_text(strong)
    for f in (token, secret):
        f.chmod(0o600)
    s = settings(["--access-token-file", str(token), "--transfer-secret-file", str(secret)])
    assert s.access_token == "tok-123" and s.transfer_secret == strong
    assert strong not in repr(s) and "tok-123" not in repr(s)
    secret.write_text("s3cret")  # (a weak one: refused, naming the file)
    assert cli.main(["serve", "--transfer-secret-file", str(secret)]) == 2
    assert f"--transfer-secret-file {secret}: the deployment secret's key on line 1" in capsys.readouterr().err

    token.chmod(0o640)
    assert cli.main(["serve", "--access-token-file", str(token)]) == 2
    err = capsys.readouterr().err
    assert "--access-token-file" in err and "mode 640" in err and "chmod 600" in err
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty").chmod(0o600)
    assert cli.main(["serve", "--transfer-secret-file", str(tmp_path / "empty")]) == 2
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["worker", "node"])
def test_a_stage_host_takes_the_deployment_secret_from_a_file_and_no_repository_token(command):
    """Workers bind through the head's bind model: a stage host needs the deployment secret alone."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f for a in sub.choices[command]._actions for f in a.option_strings}
    assert "--transfer-secret-file" in flags
    assert not flags & {"--access-token", "--transfer-secret", "--access-token-file"}


# -- the reference ----------------------------------------------------------------------------------------
def _fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        inner = next((t for t in (info.annotation, *getattr(info.annotation, "__args__", ()))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        yield f"{prefix}{name}", info, inner
        if inner is not None:
            yield from _fields(inner, f"{prefix}{name}.")


def _internal(info) -> bool:
    return bool((info.json_schema_extra or {}).get("internal"))


@pytest.mark.parametrize("model", [ServeSettings, WorkerSettings, FrontendSettings])
def test_every_setting_has_a_description(model):
    missing = [key for key, info, _ in _fields(model) if not info.description]
    assert not missing, f"settings without a description: {missing}"


def test_the_reference_lists_every_key_but_the_internal_ones():
    doc = reference_markdown()
    for key, info, _ in _fields(ServeSettings):
        shown = f"| `{key}` |" in doc
        hidden = _internal(info) or (key.startswith("frontend.") and (info.json_schema_extra or {}).get("set_by_serve"))
        assert shown != bool(hidden), key
    for key in ("access_token", "transfer_secret"):
        assert f"{key}` |" not in doc


def test_the_example_in_the_reference_is_a_valid_config(tmp_path):
    example = re.search(r"```yaml\n(.*?)```", INTRO, re.S).group(1)
    s = settings(["--config", write(tmp_path / "serve.yaml", yaml.safe_load(example))])
    assert s.scheduling.routing == "least_loaded" and s.media_limits.max_bytes == 8 * MiB


def test_docs_configuration_md_is_what_the_generator_prints():
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `trident config-reference > docs/configuration.md`")


def test_media_limits_defaults_are_unchanged_by_byte_sizes():
    assert MediaLimits().max_bytes == 32 * MiB
    assert MediaLimits.model_validate_json(MediaLimits(max_bytes="1 MiB").model_dump_json()).max_bytes == MiB


def test_serve_with_a_port_in_use_says_which_and_exits_1_at_once(tmp_path):
    """Before anything starts: Triton would exit on it, and PyTriton wait two minutes for it."""
    import socket
    import subprocess
    import sys

    from trident.core.netutil import free_ports

    http, grpc, metrics = free_ports(3)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", grpc))
        holder.listen()
        done = subprocess.run([sys.executable, "-m", "trident.cli", "serve", "--model", str(tmp_path), "--http-port",
                               str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", "0",
                               "--workspace", str(tmp_path / "ws")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"trident serve: ports in use: gRPC 127.0.0.1:{grpc} (another " \
        "server, or one still stopping?)"
    assert "Traceback" not in done.stderr
