"""The workers' zygote (``trident.supervisor.zygote``): forked processes run ``trident <argv>``, their exit codes come back as ``subprocess`` gives them, and the zygote ends with its launcher."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from trident.supervisor.zygote import Zygote
from trident.core.netutil import listen_ports


@pytest.fixture(scope="module")
def zygote(demo_models):
    z = Zygote(sys.executable, dict(os.environ), "hf", demo_models["llava"])
    yield z
    z.close()


def test_a_forked_process_runs_the_command_and_gives_its_exit_code(zygote):
    assert zygote.spawn(["config-reference"]).wait(timeout=60) == 0
    assert zygote.spawn(["worker", "--settings", "{}"]).wait(timeout=60) == 2  # settings that do not validate


def test_a_forked_process_is_in_a_process_group_of_its_own_in_the_launcher_s_session_with_a_named_title(
        zygote, demo_models):
    # a frontend of a Triton nobody serves: it runs until stopped
    port = listen_ports(1)[0]
    settings = json.dumps({"model_path": demo_models["llava"], "grpc_url": "127.0.0.1:9", "port": port})
    child = zygote.spawn(["frontend", "--settings", settings])
    try:
        assert child.poll() is None
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/cmdline").read_bytes().rstrip(b"\0") != b"trident frontend":
            assert time.monotonic() < deadline, Path(f"/proc/{child.pid}/cmdline").read_bytes()
            time.sleep(0.05)
        # (it has its title: it has left the zygote's group before). Its session is the launcher's: a session of its
        # own would be a scheduling group of its own under the kernel's autogroup (processes.OWN_GROUP)
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        assert os.getsid(child.pid) == os.getsid(0)
    finally:
        child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_the_zygote_ends_when_its_launcher_closes_it(zygote):  # (the module's last test)
    zygote.close()
    assert zygote.proc.returncode == 0 and not zygote.alive
