"""Hosts on one machine for the multi-host tests: each "host" is a network namespace on a bridge of the test's own
(an address from 198.18.0.0/15, never routed anywhere), and each process it runs gets its own PID and mount
namespaces with a private ``/tmp`` and ``/dev/shm``. Nothing crosses between hosts but TCP over the bridge: no Unix
socket, no shared memory, no cma. The head (Triton, the schedulers) stays in this process's namespaces and reaches
the hosts through the bridge's own address.

Needs root (CI runs as root); :func:`unavailable` says why hosts cannot be made here, for a skip that names it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

PREFIX = "198.18.7"  # /24 on the test's bridge: the head is .1, hosts .2 and up


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine (None: they can)."""
    if os.geteuid() != 0:
        return "making network, PID and mount namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"trprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One host: its network namespace, its address on the bridge and the processes it runs."""

    name: str
    netns: str
    veth: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], env: dict | None = None, copies: tuple[str, ...] = (), **kwargs) -> subprocess.Popen:
        """Run ``argv`` on this host: in its network namespace, in new PID and mount namespaces (``/proc`` of its
        own, a private ``/tmp`` and ``/dev/shm``). ``copies``: folders the host has at the same path, read-only, as
        a host has its own copy of a checkpoint (bound in before ``/tmp`` is covered). The process is this test's to
        stop (:meth:`Hosts.close`)."""
        steps = ["mount -t tmpfs tmpfs /mnt"]
        for i, path in enumerate(copies):
            steps += [f"mkdir /mnt/{i}", f"mount --bind {shlex.quote(path)} /mnt/{i}"]
        steps += ["mount -t tmpfs -o mode=1777 tmpfs /tmp", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm"]
        for i, path in enumerate(copies):
            steps += [f"mkdir -p {shlex.quote(path)}", f"mount --bind /mnt/{i} {shlex.quote(path)}",
                      f"mount -o remount,bind,ro {shlex.quote(path)}"]
        inner = " && ".join(steps) + " && exec " + shlex.join(argv)
        cmd = ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount",
               "--mount-proc", "--propagation", "private", "sh", "-c", inner]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``argv`` in this host's network namespace (only), to its end."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *argv], **kwargs)

    def link(self, up: bool) -> None:
        """Cut this host's link to the bridge, or restore it."""
        _ip("link", "set", "eth0", "up" if up else "down", ns=self.netns)


def worker_env(**more: str) -> dict[str, str]:
    """The environment of a stage worker on one of these hosts: the deployment secret (this process's own; no
    repository-API token: workers bind through the head's bind model), the checkpoint offline, and ``UCX_TLS=tcp``:
    the hosts are one machine, which UCX would take for one host (shared memory, cma) unless told."""
    env = {k: v for k, v in os.environ.items() if k != "TRIDENT_ACCESS_TOKEN"}
    return dict(env, HF_HUB_OFFLINE="1", UCX_TLS="tcp", **more)


class Hosts:
    """A bridge with hosts on it; :meth:`close` stops their processes and removes the namespaces and the bridge,
    also after a failure (use it as a context manager)."""

    def __init__(self, names: list[str]) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"trbr{tag}"
        self.head_address = f"{PREFIX}.1"
        self.hosts: dict[str, Host] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.head_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                host = Host(name, f"tr{tag}-{name}", f"trv{tag}{i}", f"{PREFIX}.{i + 2}")
                _ip("netns", "add", host.netns)
                self.hosts[name] = host
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("link", "set", host.veth, "master", self.bridge)
                _ip("link", "set", host.veth, "up")
                _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.netns)
                _ip("link", "set", "eth0", "up", ns=host.netns)
                _ip("link", "set", "lo", "up", ns=host.netns)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, 15)
                        proc.wait(30)
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        os.killpg(proc.pid, 9)
                        proc.wait(10)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
