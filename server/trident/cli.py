"""``trident``: the command line. It turns argv (and ``serve``'s config file) into the settings of
:mod:`trident.core.config`, whose fields hold every default and help text; mode, stage and family choices come
from :mod:`trident.core.protocol` and the family adapters.

    trident serve [--config FILE] [--model PATH] [--mode epd|e_pd|e_p_d|ep_d|all ...] [--backend hf|vllm]
                  [--http-port ...] [--instances STAGE=N ...] [--access-token-file PATH] ...
    trident worker --settings JSON          (started by `serve`; or STAGE --model PATH --join URL)
    trident node STAGE[=N] ... --model PATH --join URL   (a stage host's workers, each started again if it exits)
    trident frontend --settings JSON        (started by `serve`; or --model PATH --grpc-url HOST:PORT)
    trident config-reference                (docs/configuration.md: every key of serve's config file)
    trident build-demo-model --arch ARCH OUT   (llava, qwen2vl, qwen2_5vl, qwen3vl, qwen2_5omni, qwen2audio, gemma3,
                                               internvl; llava_next: no hf adapter, vllm only)
    trident bench transfer | decode [--model PATH | --arch llava|qwen2vl]

``serve`` takes a few flags, the settings a user sets on most days; everything else is a key of its
``--config`` file (YAML or JSON; keys are the field names of :class:`~trident.core.config.ServeSettings`, nested
as objects). Flags override environment variables, which override the file. Secrets come from files
(``--access-token-file``, ``--transfer-secret-file``) or environment variables, never argv.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trident.core.config import BACKENDS, FrontendSettings, MediaPolicy, MiB, ServeSettings, TransferConfig, WorkerSettings
from trident.core.netutil import route_address
from trident.core.usage import UsageError, read_secret_file, strong_secret
from trident.supervisor.processes import end_process
from trident.core import auth
from trident.core.protocol import MODES, STAGES


def _opt(group, flag: str, model: type[BaseModel], field: str, **kwargs) -> None:
    """A flag whose default and help come from a settings field."""
    info = model.model_fields[field]
    default = kwargs.pop("default", info.default)
    shown = kwargs.pop("shown", default)
    help_text = kwargs.pop("help", info.description or "")
    if "action" not in kwargs and shown is not None:
        help_text = f"{help_text} (default: {shown})" if help_text else f"(default: {shown})"
    group.add_argument(flag, default=default, help=help_text, **kwargs)


def _demo_archs() -> list[str]:
    from trident.dev.demo import ARCHS

    return list(ARCHS)


# -- serve ------------------------------------------------------------------------------------------------
SERVE_FLAGS: dict[str, str] = {  # flag: the settings key it sets (a path into ServeSettings)
    "--model": "model", "--mode": "modes", "--host": "host", "--http-port": "http_port", "--grpc-port": "grpc_port",
    "--metrics-port": "metrics_port", "--openai-port": "openai_port", "--backend": "backend",
    "--worker-python": "worker_python", "--instances": "instances", "--workspace": "workspace",
    "--threads": "threads_per_worker", "--served-model-name": "frontend.model_name",
    "--api-key-file": "frontend.api_key_file",
}
SERVE_ENV = {"worker_python": "TRIDENT_WORKER_PYTHON"}  # settings an environment variable may set (below the flags)
SECRET_FILES = {  # flag: (the secret's settings key, its environment variable)
    "--access-token-file": ("access_token", "TRIDENT_ACCESS_TOKEN"),
    "--transfer-secret-file": ("transfer_secret", auth.ENV),
}


def field_at(key: str, model: type[BaseModel] = ServeSettings) -> FieldInfo:
    """The settings field at a dotted key path, e.g. ``frontend.model_name``."""
    *outer, last = key.split(".")
    for name in outer:
        model = model.model_fields[name].annotation
    return model.model_fields[last]


def _stage_count(value: str) -> tuple[str, int]:
    stage, sep, count = value.partition("=")
    if not sep and stage in STAGES:  # (trident node's STAGE alone: one worker)
        return stage, 1
    if not sep or not count.isdigit():
        raise argparse.ArgumentTypeError(f"STAGE=N (e.g. prefill=2), got {value!r}")
    return stage, int(count)


def load_config_file(path: str) -> dict[str, Any]:
    """A config file's settings: a mapping of ServeSettings keys, from YAML (``.yaml``, ``.yml``) or JSON."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise UsageError(f"--config {path}: name the file .yaml, .yml or .json")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    if suffix == ".json":
        parse, kind = json.loads, "JSON"
    else:
        import yaml  # PyYAML, installed with transformers

        parse, kind = yaml.safe_load, "YAML"
    try:
        data = parse(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
        raise UsageError(f"--config {path}: not valid {kind}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: the file must hold a mapping of settings (key: value), not a "
                         f"{type(data).__name__}")
    for flag, (key, env) in SECRET_FILES.items():
        if key in data:
            raise UsageError(f"--config {path}: {key}: a secret is not read from a config file; give {flag} PATH "
                             f"(a file only you can read) or set {env}")
    return data


def _secret_from_environment() -> None:
    """A worker's or a node's secret from its environment, when set there: refused when weak."""
    if value := os.environ.get(auth.ENV):
        strong_secret(value, auth.ENV)


def _put(tree: dict, key: str, value: Any) -> None:
    *outer, last = key.split(".")
    for name in outer:
        tree = tree.setdefault(name, {})
    tree[last] = value


def merge_settings(base: dict, over: dict) -> dict:
    """``base`` with ``over`` on top, nested mappings merged key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_settings(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """``trident serve``'s settings: the config file, then environment variables, then the flags given."""
    given = vars(args)
    data = load_config_file(args.config) if getattr(args, "config", None) else {}
    over: dict[str, Any] = {}
    for key, env in SERVE_ENV.items():
        if os.environ.get(env):
            _put(over, key, os.environ[env])
    for flag, key in SERVE_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if dest in given:
            _put(over, key, dict(given[dest]) if key == "instances" else given[dest])
    for flag, (key, _) in SECRET_FILES.items():  # else the launcher takes the environment variable, or makes one
        dest = flag[2:].replace("-", "_")
        if dest in given:
            over[key] = read_secret_file(given[dest], flag)
    return ServeSettings.model_validate(merge_settings(data, over))


def _serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    from trident.supervisor import serve
    from trident.supervisor.startup import StartupError

    try:
        return serve(settings)
    except StartupError as e:  # (everything started is stopped by then)
        print(f"trident serve: {e}", file=sys.stderr)
        return 1


def _serve_flag(group, flag: str, shown: Any = None, **kwargs) -> None:
    """A flag of a ServeSettings key (``SERVE_FLAGS``): its help and default come from the field."""
    info = field_at(SERVE_FLAGS[flag])
    default = info.get_default(call_default_factory=True) if shown is None else shown
    help_text = kwargs.pop("help", info.description or "")
    if default not in (None, {}, ()):
        help_text = f"{help_text} (default: {default})"
    group.add_argument(flag, help=help_text, **kwargs)


def _add_serve(sub) -> None:
    sv = sub.add_parser(
        "serve", help="serve a model in one or more deployment modes on Triton", argument_default=argparse.SUPPRESS,
        description="Serve a model in one or more deployment modes on Triton. The flags below are the settings "
        "set on most days; every other setting is a key of --config FILE (docs/configuration.md, or `trident "
        "config-reference`). Flags override environment variables, which override the file.",
    )
    sv.add_argument("--config", metavar="FILE", help="settings file, YAML (.yaml, .yml) or JSON (.json); its keys "
                    "are those of docs/configuration.md, nested as objects; the flags below override it")
    _serve_flag(sv, "--model", metavar="PATH")
    _serve_flag(sv, "--mode", nargs="+", choices=[*MODES, "all"], shown="all",
                help="deployment modes to serve, each as its entry model")
    _serve_flag(sv, "--backend", choices=BACKENDS,
                help="engine of the stage workers: hf (PyTorch + transformers, the reference) or vllm (needs an "
                "environment with vLLM: see --worker-python)")
    _serve_flag(sv, "--worker-python", metavar="PATH", shown="this one",
                help="Python interpreter of the stage workers, an environment with trident installed "
                "(env TRIDENT_WORKER_PYTHON)")
    _serve_flag(sv, "--instances", nargs="+", metavar="STAGE=N", type=_stage_count, shown="1 each",
                help="workers per stage, e.g. --instances encode=2 prefill=2; instance n>1 of a stage is the "
                "Triton model <stage>-<n>")
    _serve_flag(sv, "--threads", type=int, metavar="N")
    _serve_flag(sv, "--workspace", metavar="DIR", shown="temporary")
    _serve_flag(sv, "--served-model-name", metavar="NAME", shown="the checkpoint folder's name",
                help="model id of the OpenAI API")
    net = sv.add_argument_group("addresses")
    _serve_flag(net, "--host")
    for flag in ("--http-port", "--grpc-port", "--metrics-port", "--openai-port"):
        _serve_flag(net, flag, type=int, metavar="PORT")
    sec = sv.add_argument_group("secrets (from files only you can read, or environment variables; never argv)")
    sec.add_argument("--access-token-file", metavar="PATH",
                     help="file holding the token of Triton's repository API (env TRIDENT_ACCESS_TOKEN; default: "
                     "generated into <workspace>/access-token, readable by you alone)")
    _serve_flag(sec, "--api-key-file", metavar="PATH", shown="none: the OpenAI API is open")
    sec.add_argument("--transfer-secret-file", metavar="PATH",
                     help="file holding the deployment's key for signing the records stages hand on; workers on "
                     f"other hosts need the same (env {auth.ENV}; default: generated at each start)")
    sv.set_defaults(func=_serve)


# -- frontend ---------------------------------------------------------------------------------------------
def _add_frontend_flags(g) -> None:
    """``trident frontend``'s flags (``serve`` takes these settings from its config file's ``frontend``)."""
    _opt(g, "--served-model-name", FrontendSettings, "model_name", shown="the checkpoint folder's name")
    _opt(g, "--default-mode", FrontendSettings, "default_mode", choices=list(MODES))
    _opt(g, "--allow-private-media-urls", MediaPolicy, "allow_private_urls", action="store_true")
    _opt(g, "--allowed-media-dir", MediaPolicy, "allowed_media_dir", shown="none allowed")
    g.add_argument("--max-body-mib", type=int, default=FrontendSettings.model_fields["max_body_bytes"].default // MiB,
                   help="largest OpenAI request body, MiB; a larger one gets 413 before it is read in full (default: "
                   f"{FrontendSettings.model_fields['max_body_bytes'].default // MiB})")


def _frontend(args: argparse.Namespace) -> int:
    from trident.frontend.app import run_frontend
    from trident.supervisor.processes import end_with_head

    end_with_head()  # (started by serve: it ends with the head)

    if args.settings:
        settings = FrontendSettings.model_validate_json(args.settings)
    else:
        if not args.model:
            raise SystemExit("trident frontend: --model (or --settings) is required")
        settings = FrontendSettings(
            model_path=args.model, model_name=args.served_model_name, grpc_url=args.grpc_url, host=args.host,
            port=args.port, default_mode=args.default_mode, max_body_bytes=args.max_body_mib * MiB,
            media=MediaPolicy(allow_private_urls=args.allow_private_media_urls, allowed_media_dir=args.allowed_media_dir),
        )
    return end_process(run_frontend(settings))


def _add_frontend(sub) -> None:
    f = sub.add_parser("frontend", help="OpenAI-compatible HTTP server over the entry models (started by serve)")
    f.add_argument("--settings", help="the whole trident.core.config.FrontendSettings as JSON (what serve passes)")
    f.add_argument("--model", help="checkpoint folder (for its chat template)")
    _opt(f, "--grpc-url", FrontendSettings, "grpc_url")
    _opt(f, "--host", FrontendSettings, "host")
    _opt(f, "--port", FrontendSettings, "port", type=int)
    _add_frontend_flags(f)
    f.set_defaults(func=_frontend)


# -- worker -----------------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> int:
    from trident.supervisor.quiet import quiet

    os.umask(0o077)  # (its files: stats, its Unix socket's folder, vLLM's IPC folder; as serve's, its user's alone)

    quiet(os.environ)  # (as the workers serve starts)
    import torch

    from trident.worker.bind import run_worker

    if args.transfer_secret_file:
        os.environ[auth.ENV] = read_secret_file(args.transfer_secret_file, "--transfer-secret-file")
    _secret_from_environment()
    if args.settings:
        settings = WorkerSettings.model_validate_json(args.settings)
    else:
        url = args.join or args.url
        if not (args.stage and args.model and url):
            raise SystemExit("trident worker: give --settings JSON, or STAGE --model PATH --join URL")
        settings = WorkerSettings(
            stage=args.stage, name=args.name, free_name=bool(args.join and not args.name), model=args.model, url=url, backend=args.backend, threads=args.threads,
            stats_dir=args.stats_dir, embedding_cache_bytes=args.embedding_cache_mib * MiB,
            # its data plane (NIXL, its TCP stage sockets) on the address it reaches the server from
            transfer=TransferConfig(data_address=route_address(url)), health_port=args.health_port,
        )
    if settings.cuda_visible_devices is not None:  # (its GPU, placed by serve: before anything starts CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.cuda_visible_devices
    torch.set_num_threads(settings.threads)
    return end_process(run_worker(settings))


def _node(args: argparse.Namespace) -> int:
    os.umask(0o077)  # (the workers' files, as serve's: its user's alone)
    from trident.core.config import VLLMConfig
    from trident.supervisor import own_side_channel
    from trident.supervisor.node import Node
    from trident.supervisor.quiet import quiet

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    quiet(env)
    env.pop("TRIDENT_ACCESS_TOKEN", None)  # (workers bind through the server's bind model: no token of its)
    if args.transfer_secret_file:
        env[auth.ENV] = read_secret_file(args.transfer_secret_file, "--transfer-secret-file")
    elif env.get(auth.ENV):
        strong_secret(env[auth.ENV], auth.ENV)
    address = route_address(args.join)  # the data plane of each: the address this host reaches the head from
    workers = {
        f"{stage}#{i}": WorkerSettings(
            stage=stage, free_name=True, model=args.model, url=args.join, backend=args.backend, threads=args.threads,
            transfer=TransferConfig(data_address=address), vllm=own_side_channel(VLLMConfig(), args.backend, stage),
            embedding_cache_bytes=args.embedding_cache_mib * MiB,
        )
        for stage, count in args.stages for i in range(1, count + 1)
    }
    if not workers:
        raise UsageError("give at least one stage, e.g. `trident node encode prefill=2 ...`")
    python = args.worker_python or os.environ.get("TRIDENT_WORKER_PYTHON") or sys.executable
    return Node(workers, python, env, out=lambda line: print(line, flush=True)).run()


def _add_node(sub) -> None:
    n = sub.add_parser("node", help="a stage host's supervisor: runs workers of the given stages, each joining a "
                       "server by URL, and starts again each that exits")
    n.add_argument("stages", nargs="+", metavar="STAGE[=N]", type=_stage_count,
                   help=f"stages to run here, N workers each (default 1); stages: {', '.join(STAGES)}")
    n.add_argument("--model", required=True, help="checkpoint folder")
    n.add_argument("--join", metavar="URL", required=True, help="the server's Triton HTTP URL, e.g. http://HEAD:8000")
    _opt(n, "--backend", WorkerSettings, "backend", choices=BACKENDS)
    _opt(n, "--threads", WorkerSettings, "threads", type=int)
    n.add_argument("--worker-python", metavar="PATH", help="Python interpreter of the workers, an environment with "
                   "trident installed (env TRIDENT_WORKER_PYTHON; default: this one)")
    n.add_argument("--embedding-cache-mib", type=int, default=ServeSettings().embedding_cache_mib,
                   help=f"encode stage: embedding cache, MiB (default: {ServeSettings().embedding_cache_mib})")
    n.add_argument("--transfer-secret-file", metavar="PATH",
                   help=f"file holding the deployment secret, which the workers bind with (env {auth.ENV})")
    n.set_defaults(func=_node)


def _add_worker(sub) -> None:
    w = sub.add_parser("worker", help="bind one stage model into a running Triton (started by serve)")
    w.add_argument("--settings", help="the whole trident.core.config.WorkerSettings as JSON (what serve passes)")
    w.add_argument("stage", nargs="?", choices=list(STAGES), help="stage model to bind (without --settings)")
    w.add_argument("--model", help="checkpoint folder")
    w.add_argument("--url", help="Triton HTTP URL, e.g. http://127.0.0.1:8000 (binds as --name, default: the stage)")
    w.add_argument("--join", metavar="URL", help="add this worker to a running server at URL (Triton HTTP) as the "
                   "next free instance <stage>-<n>; its schedulers pick it up within a second")
    _opt(w, "--name", WorkerSettings, "name", shown=None)
    _opt(w, "--health-port", WorkerSettings, "health_port", type=int, shown=None)
    w.add_argument("--transfer-secret-file", metavar="PATH",
                   help=f"file holding the deployment secret, which it binds with (env {auth.ENV}; a worker joining a "
                   "server on another host needs the secret that server was started with)")
    _opt(w, "--backend", WorkerSettings, "backend", choices=BACKENDS)
    _opt(w, "--threads", WorkerSettings, "threads", type=int)
    _opt(w, "--stats-dir", WorkerSettings, "stats_dir", shown=None)
    w.add_argument("--embedding-cache-mib", type=int, default=ServeSettings().embedding_cache_mib,
                   help=f"encode stage: embedding cache, MiB (default: {ServeSettings().embedding_cache_mib})")
    w.set_defaults(func=_worker)


# -- developer tools --------------------------------------------------------------------------------------
def _build_demo_model(args: argparse.Namespace) -> int:
    from trident.dev.demo import build_demo_model

    build_demo_model(args.arch, args.out, seed=args.seed)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from trident.dev import bench

    torch.set_num_threads(args.threads)
    if args.what == "transfer":
        bench.run_transfer_bench(repeat_scale=args.repeat_scale)
        return 0
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from trident.dev.demo import build_demo_model

            model = os.path.join(tmp, args.arch)
            build_demo_model(args.arch, model, log=None)
        bench.run_decode_bench(model, new_tokens=args.new_tokens)
    return 0


def _config_reference(args: argparse.Namespace) -> int:
    from trident.config_reference import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def _add_dev(sub) -> None:
    r = sub.add_parser("config-reference", help="print the reference of serve's config file (docs/configuration.md)")
    r.set_defaults(func=_config_reference)

    archs = _demo_archs()
    d = sub.add_parser("build-demo-model", help="write a small random-weight demo checkpoint")
    d.add_argument("--arch", choices=archs, default="llava", help="model family (default: llava)")
    d.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    d.add_argument("out", help="output folder")
    d.set_defaults(func=_build_demo_model)

    b = sub.add_parser("bench", help="print a benchmark table")
    b.add_argument("what", choices=["transfer", "decode"], help="transfer: NIXL READ vs memcpy; decode: batched decode")
    b.add_argument("--model", help="checkpoint folder for decode (default: a fresh demo model of --arch)")
    b.add_argument("--arch", choices=archs, default="llava")
    b.add_argument("--new-tokens", type=int, default=64, help="tokens per request for decode (default: 64)")
    b.add_argument("--repeat-scale", type=float, default=1.0, help="scale the transfer repetitions")
    b.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    b.set_defaults(func=_bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trident", description="Disaggregated multimodal LLM serving on Triton.")
    p.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_frontend(sub)
    _add_worker(sub)
    _add_node(sub)
    _add_dev(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return args.func(args)
    except ValidationError as e:
        print(f"trident {args.command}: invalid settings: {settings_problems(e)}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"trident {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: no traceback from each
        return 130


def settings_problems(e: ValidationError) -> str:
    """One line naming each bad key (its dotted path) and what is wrong with it."""
    def one(err) -> str:
        key = ".".join(map(str, err["loc"]))
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        return f"{key}: {msg}" if key else msg

    return "; ".join(one(err) for err in e.errors())


if __name__ == "__main__":
    sys.exit(main())
