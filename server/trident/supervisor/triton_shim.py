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
TEMP_RECORD_ENV = "TRIDENT_TEMP_RECORD"  # the file Triton lists its temporary folders in (remove_left_folders)
TEMP_PREFIX = "python_env_"  # (the python backend's: /tmp/python_env_XXXXXX)
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
def preloaded(library: Path, token: str, allow_code_upload: bool = False, sockets: dict[str, Path] | None = None,
              temp_record: Path | None = None):
    """Within it, the processes started (Triton) get the library and the token by environment, with
    ``allow_code_upload`` may load models with files uploaded through the repository API, with ``sockets``
    (``http``, ``metrics``, ``grpc``: a path each) serve HTTP, metrics and gRPC on those Unix sockets (the fronts'),
    and with ``temp_record`` list the temporary folders they make in that file (:func:`remove_left_folders`)."""
    names = ("LD_PRELOAD", TOKEN_ENV, UPLOAD_ENV, TEMP_RECORD_ENV, *SOCKET_ENVS.values())
    saved = {name: os.environ.get(name) for name in names}
    os.environ["LD_PRELOAD"] = " ".join(filter(None, [str(library), saved["LD_PRELOAD"]]))
    os.environ[TOKEN_ENV] = token
    os.environ[UPLOAD_ENV] = "1" if allow_code_upload else "0"
    for what, path in (sockets or {}).items():
        os.environ[SOCKET_ENVS[what]] = str(path)
    if temp_record is not None:
        os.environ[TEMP_RECORD_ENV] = str(temp_record)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def remove_left_folders(record: Path) -> int:
    """Remove the temporary folders an exited Triton listed in ``record`` that are still there (a killed Triton's:
    a clean exit removes its own), then empty the record; how many were removed. Only what the python backend makes:
    a ``python_env_*`` folder right in /tmp, this user's, not a link (a line naming anything else removes nothing)."""
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return 0
    removed = 0
    for line in lines:
        path = Path(line)
        if path.parent != Path("/tmp") or not path.name.startswith(TEMP_PREFIX):
            continue
        try:
            mine = not path.is_symlink() and path.is_dir() and path.lstat().st_uid == os.getuid()
        except OSError:
            continue
        if mine:
            shutil.rmtree(path, ignore_errors=True)
            removed += not path.exists()
    record.unlink(missing_ok=True)
    return removed
