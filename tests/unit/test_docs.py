"""The docs name only files that exist: every path the README and docs/ give (a source file, a document, a chart's
template, a test) is in the checkout, so a file moved or removed shows here, not to a reader."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/.<>{}$-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|c|pbtxt|toml|yaml|sh))(?![\w/])")
# where a short path is read from: the repository, the package (``core/protocol.py``), docs/, tests/, the clients'
# and the chart's folders
BASES = ("", "server/", "server/trident/", "docs/", "tests/", "clients/perf/", "deploy/helm/trident/")
USERS_FILES = {"trident.yaml", "serve.yaml"}  # config files the docs have a user write


def _missing(text: str, tracked: set[str]) -> set[str]:
    names = {m.group(1) for m in PATH.finditer(text)} - USERS_FILES
    return {name for name in names
            if not any(base + name in tracked for base in BASES)
            and not ("/" not in name and any(t.endswith("/" + name) for t in tracked))}


def test_every_file_the_docs_name_exists():
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {str(d.relative_to(ROOT)): sorted(names) for d in docs if (names := _missing(d.read_text(), tracked))}
    assert not missing, missing


def test_a_path_that_does_not_exist_is_found():
    tracked = {"server/trident/core/protocol.py", "docs/security.md", "tests/unit/test_docs.py"}
    text = "`core/protocol.py`, `security.md`, `unit/test_docs.py`, (`worker/engines/gone.py`) and launcher/gate.py"
    assert _missing(text, tracked) == {"worker/engines/gone.py", "launcher/gate.py"}
