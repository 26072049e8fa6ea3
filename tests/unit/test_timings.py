"""Step timings (trident.timings): nothing is written unless TRIDENT_TRACE_DIR is set; each step is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = """
import time
from trident import timings
timings.start("proc")
with timings.step("outer"):
    with timings.step("inner"):
        time.sleep(0.01)
t0 = time.monotonic_ns()
timings.mark("instant", t0, t0)
try:
    with timings.step("failing"):
        raise ValueError("x")
except ValueError:
    pass
import gc
gc.collect()  # a full collection is a step too
print(timings.enabled())
"""


def _run(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True).stdout


def test_off_by_default_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRIDENT_TRACE_DIR"}
    assert _run(dict(env, HOME=str(tmp_path))).strip() == "False"
    assert not list(tmp_path.rglob("*.jsonl"))


def test_steps_are_lines_on_the_monotonic_clock(tmp_path):
    before = __import__("time").monotonic_ns()
    assert _run(dict(os.environ, TRIDENT_TRACE_DIR=str(tmp_path / "t"))).strip() == "True"
    after = __import__("time").monotonic_ns()
    lines = [json.loads(line) for line in (tmp_path / "t" / "proc.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if not r["step"].startswith("gc")] == ["inner", "outer", "instant", "failing"]
    assert "gc2" in [r["step"] for r in lines]  # the collector's passes over the older generations are timed
    by = {r["step"]: r for r in lines}
    assert by["inner"]["t1"] - by["inner"]["t0"] >= 10_000_000  # the 10 ms sleep
    assert by["outer"]["t0"] <= by["inner"]["t0"] <= by["inner"]["t1"] <= by["outer"]["t1"]
    assert by["instant"]["t0"] == by["instant"]["t1"]
    # one clock for every process of the host: the child's times fall inside this process's window
    assert all(before <= r["t0"] <= r["t1"] <= after for r in lines)


def test_a_trace_folder_that_cannot_be_written_turns_tracing_off_and_fails_nothing(tmp_path):
    """A full disk (``/dev/full``: every write is ENOSPC) or a folder that cannot be made: the steps run, tracing is
    off after one warning, and nothing is raised."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT.replace(
        'timings.start("proc")', 'timings.start("proc"); timings._out = open("/dev/full", "w", buffering=1)')],
        env=dict(os.environ, TRIDENT_TRACE_DIR=str(tmp_path / "t")), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert out.stderr.count("step timings are off in this process") == 1, out.stderr
    (tmp_path / "file").write_text("")
    unmakeable = subprocess.run([sys.executable, "-c", _SCRIPT], env=dict(os.environ, TRIDENT_TRACE_DIR=str(tmp_path / "file" / "t")),
                                capture_output=True, text=True, check=True)
    assert unmakeable.stdout.strip() == "False" and "step timings are off" in unmakeable.stderr
