"""Where a worker's data plane listens and how UCX's TCP moves its bytes (core/transfer/data_plane.py)."""

import pytest

from trident.core.transfer import data_plane

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


def test_a_tcp_connection_to_the_address_in_a_peers_metadata_is_its_transport():
    """core/transfer/transport.py reads this process's established TCP connections from /proc: one to the address and
    port a peer's metadata holds makes that peer's transport TCP; the address alone (another process on its host)
    or no connection does not."""
    import socket

    from trident.core.transfer import transport

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with listener, socket.create_connection(("127.0.0.1", port)) as conn, listener.accept()[0]:
        assert (socket.inet_aton("127.0.0.1"), port) in transport.tcp_connections()
        metadata = b"ucx\x00" + socket.inet_aton("127.0.0.1") + b"\x07" + port.to_bytes(2, "big") + b"\x00"
        assert transport.transport_to(metadata) == (transport.TCP, f"TCP to 127.0.0.1:{port}")
        other_port = (port + 1) % 65536
        assert transport.transport_to(metadata.replace(port.to_bytes(2, "big"), other_port.to_bytes(2, "big")))[0] \
            == transport.NOT_TCP
        conn.close()
    assert (socket.inet_aton("127.0.0.1"), port) not in transport.tcp_connections()
    assert transport.transport_to(metadata)[0] == transport.NOT_TCP
