"""Where a worker's data plane listens and how UCX's TCP moves its bytes (transfer/data_plane.py)."""

import pytest

from trident.transfer import data_plane

NAMES = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "UCX_NET_DEVICES", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")


@pytest.fixture
def env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_bind_pins_the_interface_and_the_side_channel_and_sizes_tcp_segments(env):
    data_plane.bind("127.0.0.1")
    import os

    assert {n: os.environ[n] for n in NAMES} == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_NET_DEVICES": "lo",
                                                 "UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"}


def test_what_the_operator_set_is_kept(env):
    env.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    env.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    data_plane.bind("127.0.0.1")
    import os

    assert (os.environ["UCX_NET_DEVICES"], os.environ["UCX_TCP_TX_SEG_SIZE"]) == ("mlx5_0:1", "64k")


def test_an_address_no_interface_holds_is_refused(env):
    with pytest.raises(ValueError, match="no network interface holds the data-plane address '192.0.2.77'"):
        data_plane.bind("192.0.2.77")
