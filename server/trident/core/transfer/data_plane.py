"""Where a worker's data plane listens: NIXL/UCX and vLLM's NIXL side channel, on the data-plane address only.

UCX opens a TCP listener on every network device it may use, and vLLM's side channel (which hands out the NIXL
agent's metadata, the keys to its registered memory) listens where ``VLLM_NIXL_SIDE_CHANNEL_HOST`` says. Both are
pinned to one address here, before the process makes its NIXL agent or its vLLM engine: ``UCX_NET_DEVICES`` names
the interface holding the address (loopback on one host), ``VLLM_NIXL_SIDE_CHANNEL_HOST`` the address itself.
Values the operator set in the environment are kept. Shared memory and ``cma`` between workers on one host are
not network devices: they stay available.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address``; None for a wildcard or an address no
    interface holds."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.is_unspecified:
        return None
    if wanted.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == str(wanted):
                return name
    return None


TCP_SEGMENT = "256k"  # UCX's TCP segments (its default: 8 KiB out, 64 KiB in)


def bind(address: str) -> None:
    """Pin this process's UCX devices and vLLM's side channel to ``address`` (unless the environment says), and
    give UCX's TCP transport (between hosts) segments of :data:`TCP_SEGMENT`: with its defaults a 64 MiB READ
    between two hosts ran at half a plain socket's bandwidth, with these at 1.1x (``make bench-hosts``)."""
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", address)
    os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", TCP_SEGMENT)
    os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", TCP_SEGMENT)
    if "UCX_NET_DEVICES" not in os.environ:
        interface = interface_of(address)
        if interface is None:
            raise ValueError(f"no network interface holds the data-plane address {address!r}")
        os.environ["UCX_NET_DEVICES"] = interface
