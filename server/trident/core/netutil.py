"""Small network helpers."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (for tests and benchmarks)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listen_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now and below the kernel's ephemeral range, for a listener
    that binds later: a port from :func:`free_ports` is an ephemeral one, which any process's outgoing
    connection or port-0 bind may take first (vLLM picks its own ports that way)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    if low < 12000:
        return free_ports(n, host)
    found: list[int] = []
    start = random.randrange(10000, low - 1000)
    for port in range(start, low):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise OSError(f"no {n} free ports between {start} and {low}")


def route_address(url: str) -> str:
    """This host's address on the way to ``url``'s host (no packet is sent): loopback for a server on this host,
    else the address of the interface the route to it leaves by, where the server and other hosts reach this one."""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    try:  # IPv4 where the name has it
        family, _, _, _, where = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0]
    except socket.gaierror:
        family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return probe.getsockname()[0]


def port_taken(host: str, port: int) -> bool:
    """Whether another process listens on ``port`` at ``host`` (tried as a server binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False
