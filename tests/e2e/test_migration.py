"""No request lost when a stage worker dies, on the hf engine (support/migration.py says what is checked; the vLLM
engine's: test_vllm_migration.py)."""

from __future__ import annotations

import pytest

from support.migration import check_no_request_lost, check_the_limit, migration_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory, shared_servers):
    return migration_server(shared_servers, demo_models["llava"], "hf", tmp_path_factory.mktemp("migration") / "ws", [])


@pytest.mark.parametrize("mode", ["e_p_d", "ep_d"])
def test_a_decode_worker_killed_mid_stream_loses_no_request(server, mode):
    check_no_request_lost(server, mode)


def test_past_the_migration_limit_the_request_ends_with_the_clean_error(server):
    check_the_limit(server)
