"""The library ``tritonserver`` runs with (``triton_shim.c``, by LD_PRELOAD): its repository-API token out of its
command line, the python backend's /dev/shm regions its user's alone, and no model files uploaded through the
repository API (unless the operator allows them).

Triton 2.51 takes the token only on its command line, where any local user reads it from /proc/<pid>/cmdline; the
launcher writes :data:`PLACEHOLDER` there and hands the token over by environment (readable by the same user alone),
and the library swaps them before Triton's ``main`` runs. A Triton started without the library keeps the
placeholder as its token: it refuses the launcher's repository calls and start-up fails, never open."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from trident.supervisor.startup import StartupError

PLACEHOLDER = "@TRIDENT_ACCESS_TOKEN@"
TOKEN_ENV = "TRIDENT_ACCESS_TOKEN"
UPLOAD_ENV = "TRIDENT_ALLOW_CODE_UPLOAD"
SOCKET_ENVS = {"http": "TRIDENT_HTTP_SOCKET", "metrics": "TRIDENT_METRICS_SOCKET",  # Triton's servers on Unix sockets
               "grpc": "TRIDENT_GRPC_SOCKET"}  # (gRPC's: the path, and :PORT after it)
SOURCE = Path(__file__).with_name("triton_shim.c")


def build(folder: Path) -> Path:
    """Compile the library into ``folder`` (the server's workspace, its user's alone) and return its path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise StartupError("a C compiler (cc) is needed to keep Triton's access token out of its command line "
                           "(e.g. apt-get install gcc)")
    library = folder / "triton_shim.so"
    done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE), "-ldl"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise StartupError(f"compiling {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
    return library


def restriction(endpoints: list[str], header: str) -> str:
    """Triton's ``--http-restricted-api`` / ``--grpc-restricted-protocol`` value, with the placeholder for the token."""
    return f"{','.join(endpoints)}:{header}={PLACEHOLDER}"


@contextlib.contextmanager
def preloaded(library: Path, token: str, allow_code_upload: bool = False, sockets: dict[str, Path] | None = None):
    """Within it, the processes started (Triton) get the library and the token by environment, with
    ``allow_code_upload`` may load models with files uploaded through the repository API, and with ``sockets``
    (``http``, ``metrics``, ``grpc``: a path each) serve HTTP, metrics and gRPC on those Unix sockets (the fronts')."""
    saved = {name: os.environ.get(name) for name in ("LD_PRELOAD", TOKEN_ENV, UPLOAD_ENV, *SOCKET_ENVS.values())}
    os.environ["LD_PRELOAD"] = " ".join(filter(None, [str(library), saved["LD_PRELOAD"]]))
    os.environ[TOKEN_ENV] = token
    os.environ[UPLOAD_ENV] = "1" if allow_code_upload else "0"
    for what, path in (sockets or {}).items():
        os.environ[SOCKET_ENVS[what]] = str(path)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
