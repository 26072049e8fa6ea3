"""Where each live stage instance's worker listens, for the callers on the head host (the BLS schedulers, the encode
worker handing its record on): one worker file per instance, ``<instance>.json``, in a private folder named by
``TRIDENT_STAGE_DIRECTORY`` (the server sets it for Triton and its workers).

The stage model's python-backend stub publishes its worker file there when Triton loads the model and takes it
back when Triton unloads it, so an entry is there exactly while the instance is loaded, whether its worker runs on
this host (the file names its Unix socket and its TCP address) or joined from another (its TCP address only, as
the head's bind model wrote it). A caller that finds no entry, or an entry whose worker does not
answer, treats the instance as gone.

An entry is only an address: every connection proves the deployment secret both ways (:mod:`trident.core.auth`), so
a file put there by anyone else leads to a refused connection, never to a stranger taking the calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "TRIDENT_STAGE_DIRECTORY"


def folder() -> Path | None:
    """The stage directory of this server (None: not set, as in a process the server did not start)."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def create(path: Path) -> Path:
    """Make ``path`` the stage directory of the processes started from here (a new, private folder)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    os.environ[ENV] = str(path)
    return path


def enter(name: str, info: dict) -> None:
    """Enter instance ``name``'s worker file (replacing a stale one)."""
    base = folder()
    if base is None:
        return
    tmp = base / f".{name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    tmp.replace(base / f"{name}.json")


def remove(name: str, info: dict) -> None:
    """Take instance ``name``'s entry back, if it is still ``info`` (a newer load of the name may have replaced it)."""
    if lookup(name) == info:
        try:
            (folder() / f"{name}.json").unlink()
        except OSError:
            pass


def lookup(name: str) -> dict | None:
    """Instance ``name``'s worker file, or None when it has no entry."""
    base = folder()
    if base is None:
        return None
    try:
        info = json.loads((base / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
