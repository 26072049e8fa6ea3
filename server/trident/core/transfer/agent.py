"""One NIXL agent per process, behind a lock.

Creating a UCX backend costs ~0.5 s, so each process makes exactly one agent (:func:`process_agent`) and
shares it between its sender and receiver. NIXL's Python agent is not thread-safe in the mode used here
(no progress thread: that thread spins a whole core), so every call goes through one lock.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import uuid

import torch

from trident.core.errors import PeerUnavailable, TransferError, TransferTimeout
from trident.core.transfer import transport

log = logging.getLogger(__name__)


def _nixl_api():
    """NIXL's agent classes, imported on first use (modules that only describe transfers skip its libs).

    The ``nixl`` shim picks the wheel matching the CUDA stack the process has loaded; when that wheel is
    absent (e.g. tritonclient's cuda-python says CUDA 13 on a machine with ``nixl-cu12``), use whichever
    backend wheel is installed.
    """
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as first:
        for name in ("nixl_cu12", "nixl_cu13"):
            try:
                api = importlib.import_module(f"{name}._api")
                return api.nixl_agent, api.nixl_agent_config
            except ImportError:
                continue
        raise first
    return nixl_agent, nixl_agent_config


DRAM = ("DRAM", 0)


class NixlAgent:
    """A NIXL agent with a UCX backend, buffers in DRAM or a GPU's memory (VRAM), and blocking READs."""

    def __init__(self, name: str | None = None, backend: str = "UCX") -> None:
        nixl_agent, nixl_agent_config = _nixl_api()

        self.name = name or f"trident-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        # The default error-handling mode can hang without a progress thread.
        self._agent.create_backend(backend, {"ucx_error_handling_mode": "none"})
        self._remotes: dict[str, bytes] = {}
        self.transports: dict[str, str] = {}  # peer -> transport.TCP / NOT_TCP, known after a first READ from it
        self.metadata: bytes = self._agent.get_agent_metadata()
        log.info("NIXL agent %s ready (%s backend, metadata %d bytes)", self.name, backend, len(self.metadata))

    def register(self, buffer: torch.Tensor) -> "Registration":
        """Register a tensor's memory for transfers (do it once, at start-up): DRAM for a CPU tensor, VRAM for a
        GPU's (NIXL takes the type and the GPU from the tensor). Close the registration before the memory is freed.

        The agent's metadata, which peers load to READ from us, covers the memory registered so far.
        """
        with self._lock:
            descs = self._agent.register_memory(buffer)
            self.metadata = self._agent.get_agent_metadata()
        return Registration(self, descs)

    def _deregister(self, descs) -> None:
        with self._lock:
            self._agent.deregister_memory(descs)
            self.metadata = self._agent.get_agent_metadata()

    def _connect(self, remote: str, metadata: bytes) -> None:
        if self._remotes.get(remote) == metadata:
            return
        if remote in self._remotes:  # same name, new metadata: the peer restarted
            self._agent.remove_remote_agent(remote)
            self.transports.pop(remote, None)
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:  # nixl raises its own binding exceptions
            raise PeerUnavailable(f"cannot load metadata of NIXL agent {remote!r}: {e}") from None
        if isinstance(name, bytes):
            name = name.decode()
        if name != remote:
            raise PeerUnavailable(f"agent metadata names {name!r}, the record names {remote!r}")
        self._remotes[remote] = metadata

    def read(
        self,
        remote: str,
        metadata: bytes,
        remote_regions: list[tuple[int, int]],
        local_address: int,
        notify: bytes,
        timeout_s: float,
        *,
        local_memory: tuple[str, int] = DRAM,
        remote_memory: tuple[str, int] = DRAM,
    ) -> None:
        """READ ``remote_regions`` back to back into local memory at ``local_address``; block until done.

        ``local_memory`` / ``remote_memory``: each side's NIXL memory type and device id (``("VRAM", 0)``: the
        first GPU the process sees); UCX picks the transport (cuda_ipc between GPUs of one host, RDMA or TCP
        across hosts). The producer gets ``notify`` as a notification once the data has arrived.
        """
        (local_type, local_dev), (remote_type, remote_dev) = local_memory, remote_memory
        local, offset = [], 0
        for _, length in remote_regions:
            local.append((local_address + offset, length, local_dev))
            offset += length
        remote_descs = [(addr, length, remote_dev) for addr, length in remote_regions]
        deadline = time.monotonic() + timeout_s
        with self._lock:
            # A connection to the peer that died meanwhile (its host cut off, and back) fails as the READ is posted,
            # before anything moved: once, the peer is dropped and the READ posted again on a new connection from its
            # metadata (a record's consumer may not hand it to another: its lease is claimed)
            for attempt in (1, 2):
                self._connect(remote, metadata)
                handle = None
                try:
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local, local_type),
                        self._agent.get_xfer_descs(remote_descs, remote_type),
                        remote,
                        notify,
                    )
                    state = self._agent.transfer(handle)
                    break
                except Exception as e:
                    if handle is not None:
                        self._release(handle)
                    self._forget(remote)
                    if attempt == 2:
                        raise PeerUnavailable(f"READ from NIXL agent {remote!r} failed: {type(e).__name__}: {e}") \
                            from None
                    log.info("READ from NIXL agent %s failed as it was posted (%s); connecting to it again", remote, e)
        released = False
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    with self._lock:
                        released = self._release(handle)
                    error = TransferTimeout(f"READ of {offset} bytes from {remote!r} took over {timeout_s:.1f} s")
                    error.aborted = released
                    raise error
                time.sleep(0)  # let other threads at the lock between polls
                with self._lock:
                    try:
                        state = self._agent.check_xfer_state(handle)
                    except Exception as e:
                        self._forget(remote)
                        raise PeerUnavailable(f"READ from NIXL agent {remote!r} failed: {type(e).__name__}: {e}") from None
            if state != "DONE":
                self._forget(remote)
                raise PeerUnavailable(f"READ from NIXL agent {remote!r} ended in state {state}")
            if remote not in self.transports:
                self._tell_transport(remote, metadata, f"{remote_type} to {local_type}")
        finally:
            if not released:
                with self._lock:
                    self._release(handle)

    def _tell_transport(self, remote: str, metadata: bytes, memory: str) -> None:
        """Log, once per peer (and again after it restarts), which transport its READs took, and between which
        memory types."""
        kind, shown = transport.transport_to(metadata)
        self.transports[remote] = kind
        log.info("READs from NIXL agent %s go over %s (%s)", remote, shown, memory)

    def transport_counts(self) -> dict[str, int]:
        """How many peers this agent READs from over TCP and without it (``peers_tcp``, ``peers_not_tcp``)."""
        kinds = list(self.transports.values())
        return {"peers_tcp": kinds.count(transport.TCP), "peers_not_tcp": kinds.count(transport.NOT_TCP)}

    def _release(self, handle) -> bool:
        """Release a transfer handle (aborting the transfer if it still runs); False when NIXL refuses."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as e:  # a failed or stuck transfer may refuse release
            log.debug("release of transfer handle failed: %s", e)
            return False

    def _forget(self, remote: str) -> None:
        """Drop a peer after an error so the next record from it reconnects from its metadata."""
        self.transports.pop(remote, None)
        if self._remotes.pop(remote, None) is not None:
            try:
                self._agent.remove_remote_agent(remote)
            except Exception as e:
                log.debug("remove_remote_agent(%s) failed: %s", remote, e)

    def notify(self, remote: str, metadata: bytes, message: bytes) -> None:
        """Send a notification to a peer without transferring anything."""
        with self._lock:
            self._connect(remote, metadata)
            try:
                self._agent.send_notif(remote, message)
            except Exception as e:
                self._forget(remote)
                raise PeerUnavailable(f"notifying NIXL agent {remote!r} failed: {type(e).__name__}: {e}") from None

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""
        with self._lock:
            return self._agent.get_new_notifs()


class Registration:
    """A buffer registered with a :class:`NixlAgent`. :meth:`close` deregisters it, once: a buffer freed while
    registered leaves UCX holding a mapping of memory that is gone (on a GPU, the process's next allocation failed
    with "resource already mapped")."""

    def __init__(self, agent: NixlAgent, descs) -> None:
        self._agent, self._descs = agent, descs

    def close(self) -> None:
        descs, self._descs = self._descs, None
        if descs is not None:
            self._agent._deregister(descs)


_process_agent: NixlAgent | None = None
_process_lock = threading.Lock()


def process_agent(backend: str = "UCX") -> NixlAgent:
    """This process's agent, created on first use."""
    global _process_agent
    with _process_lock:
        if _process_agent is None:
            try:
                _process_agent = NixlAgent(backend=backend)
            except Exception as e:
                raise TransferError(f"cannot create a NIXL agent with the {backend} backend: {e}") from e
        return _process_agent
