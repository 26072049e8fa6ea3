"""Which transport UCX took to a NIXL peer, as the kernel shows it.

NIXL does not say which UCX transport an endpoint uses (its backend reports "UCX" only). A READ over UCX's TCP
transport runs on a TCP connection of this process to the peer's UCX listener, whose address (IP and port) is in
the peer's agent metadata; shared memory and cma (workers on one host) and RDMA use none. So after a first READ
from a peer, this process's established TCP connections (``/proc/self/fd`` and ``/proc/self/net/tcp``) tell the
transport apart: a wrong one (TCP between workers on one host, or TCP where RDMA was meant) is seen at once.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

TCP = "tcp"
NOT_TCP = "not_tcp"

_ESTABLISHED = "01"


def _socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(field: str) -> tuple[bytes, int]:
    """An address of /proc/net/tcp{,6} (``HEX:PORT``, the address in 32-bit host-order words) as (packed IP, port)."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(packed) == 16 and packed.startswith(b"\0" * 10 + b"\xff\xff"):  # an IPv4-mapped IPv6 address
        packed = packed[12:]
    return packed, int(hex_port, 16)


def tcp_connections() -> list[tuple[bytes, int]]:
    """This process's established TCP connections: each one's remote end as (packed IP, port)."""
    inodes = _socket_inodes()
    remotes = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _ESTABLISHED and fields[9] in inodes:
                remotes.append(_address(fields[2]))
    return remotes


def _shown(packed: bytes, port: int) -> str:
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    host = socket.inet_ntop(family, packed)
    return f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"


def transport_to(metadata: bytes) -> tuple[str, str]:
    """(:data:`TCP` or :data:`NOT_TCP`, a phrase for a log line) for the peer whose agent metadata is ``metadata``,
    once this process has READ from it: TCP when a connection of this process goes to an address and port that
    the metadata holds."""
    for packed, port in tcp_connections():
        if packed in metadata and port.to_bytes(2, "big") in metadata:
            return TCP, f"TCP to {_shown(packed, port)}"
    rdma = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    return NOT_TCP, ("no TCP connection: shared memory, cma or RDMA" if rdma
                     else "shared memory or cma on this host (no TCP connection)")
