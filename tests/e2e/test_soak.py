"""The short soak (issue 13; `make soak` is the long one): streamed requests over every mode at once, gRPC and
OpenAI, about 10% cancelled midway, the decode worker killed with SIGKILL during the run. Only 503s for
requests in flight while it was down may fail; every other request gives its reference text; afterwards no
worker holds anything and every mode still answers right."""

from __future__ import annotations

import asyncio

import pytest

from support import MODES, Server
from support.soak import soak, table

pytestmark = pytest.mark.slow


def test_short_soak(demo_models, tmp_path):
    server = Server(demo_models["llava"], tmp_path / "ws", modes=MODES, config={"transfer": {"lease_s": 10, "read_timeout_s": 5}})
    try:
        server.wait_ready()
        report = asyncio.run(soak(server, requests=64, concurrency=16, kill="decode", drain_s=40))
        shown = "\n".join(table(report))
        print(shown)
        assert report.killed_at is not None and report.back_at is not None, shown
        assert not report.unexpected, shown
        assert not report.disagreements and not report.final_check, shown
        assert not report.held_after, shown
        assert report.count("cancelled") > 0 and report.count("ok") >= 32, shown
        assert len(report.outcomes) == 64
    finally:
        assert server.stop() == 0
