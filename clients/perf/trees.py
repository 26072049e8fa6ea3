"""An older commit's `trident`, runnable beside the working tree's: the base of every side-by-side benchmark.

A commit's tree comes out of git (``git archive``) into a folder of its own, and gets a venv of its own that links
an existing venv's packages, with that tree's ``trident`` in place of the editable install's. A server started with
that venv's python (and its ``bin`` first on PATH, which is how Triton's python-backend stubs find their python)
runs the old commit's code on today's packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def export_tree(commit: str, into: Path) -> Path:
    """``commit``'s tree (``git archive``) in a folder of its own."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def overlay(venv: Path, tree: Path, into: Path) -> Path:
    """A venv of its own for ``tree``, with ``venv``'s packages (each linked) and ``tree``'s ``trident`` in place of
    the editable install's; its python. (Triton starts its python-backend stubs with the python first on PATH, in an
    environment of its own: a PYTHONPATH would not reach them, this venv's bin first on PATH does.)"""
    subprocess.run([str(venv / "bin" / "python"), "-m", "venv", "--without-pip", str(into)], check=True)
    site = next((into / "lib").glob("python3*/site-packages"))
    for entry in next((venv / "lib").glob("python3*/site-packages")).iterdir():
        if not entry.name.startswith("__editable__.trident") and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    (site / "trident_tree.pth").write_text(f"{tree / 'server'}\n")
    for tool in (venv / "bin").iterdir():  # the same console scripts and tools
        if not (into / "bin" / tool.name).exists():
            (into / "bin" / tool.name).symlink_to(tool)
    return into / "bin" / "python"


def short(commit: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit], check=True, capture_output=True,
                          text=True).stdout.strip()


def base_python(commit: str, work: Path) -> str:
    """The python of a venv (under ``work``) that runs ``commit``'s `trident` on this interpreter's packages."""
    tree = export_tree(commit, work / "tree")
    return str(overlay(Path(sys.executable).parent.parent, tree, work / "venv"))


def env_of(python: str | None) -> dict[str, str] | None:
    """The environment of a server started with ``python`` (None: this one's): that venv's bin first on PATH."""
    if python is None:
        return None
    return {**os.environ, "PATH": f"{Path(python).parent}:{os.environ['PATH']}"}
