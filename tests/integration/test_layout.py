"""What the layout promises: the protocol is torch-free, and the repository files are what protocol renders."""

from __future__ import annotations

import subprocess
import sys


def test_protocol_imports_without_torch():
    code = "import trident.core.protocol, sys; assert 'torch' not in sys.modules, 'protocol pulled in torch'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]


def test_errors_and_the_frontend_import_without_torch():
    """The python-backend stub's proxy imports trident.core.errors; the OpenAI frontend needs no torch."""
    code = ("import trident.core.errors, trident.frontend.app, trident.core.config, sys; "
            "assert 'torch' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
