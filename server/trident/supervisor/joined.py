"""Workers that joined from elsewhere (``trident worker --join``), watched: the launcher supervises the workers it
started by their exit, but a joined worker's process is on another host. Its stage model stays loaded, and READY,
after its worker has died, since Triton's stub for it lives on. Every second each joined instance in the stage
directory is connected to (the deployment's handshake, as a scheduler's call would); one whose host answers that
nothing listens there any more (the connection refused, twice in a row) has its stage model unloaded, so that
readiness tells the truth and no scheduler routes to it. The unload goes through the bind model, as the worker's own
leave would (``unbind(name, worker)``): it is done only while the name is still that worker's, so a worker that bound
the name again meanwhile (restarted on its host) keeps it. A host that does not answer at all (its link cut) is left
loaded: the schedulers route around it call by call, and it serves again when its link is back.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from trident.core.stagecall import directory
from trident.core.stagecall.client import open_stage_socket

log = logging.getLogger("trident.supervisor")

CHECK_S = 1.0  # how often each joined instance is connected to
REFUSALS = 2  # refused connections in a row after which its stage model is unloaded


class JoinedWatch:
    """A thread that unloads the stage model of each joined worker that has gone (``unbind(name, worker)``: True when
    unloaded, False when the name has another worker now); ``owned()`` names the instances the launcher started itself
    (supervised by their exit instead)."""

    def __init__(self, owned: Callable[[], set[str]], unbind: Callable[[str, dict], bool], out) -> None:
        self._owned = owned
        self._unbind = unbind
        self.out = out
        self._refused: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="joined-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No unload from now on (a round under way, waiting on a host that does not answer, is not waited for)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check()

    def check(self) -> None:
        """One round: connect to each joined instance once."""
        base = directory.folder()
        names = {p.stem for p in base.glob("*.json")} - self._owned() if base is not None else set()
        for name in list(self._refused):
            if name not in names:
                del self._refused[name]
        for name in sorted(names):
            info = directory.lookup(name)
            if info is None:
                continue
            try:
                open_stage_socket(info)[0].close()
            except ConnectionRefusedError:
                self._refused[name] = self._refused.get(name, 0) + 1
            except Exception:  # no answer (a link cut, a host down), or a peer that failed the handshake: not gone
                self._refused.pop(name, None)
                continue
            else:
                self._refused.pop(name, None)
                continue
            if self._refused[name] >= REFUSALS and not self._stop.is_set():
                where = ":".join(str(part) for part in info.get("tcp") or ()) or "?"
                try:
                    unbound = self._unbind(name, info)
                except Exception as e:  # Triton going away too: tried again next round
                    self.out(f"[trident] could not unload {name}: {e}")
                    continue
                del self._refused[name]
                if unbound:
                    self.out(f"[trident] joined worker {name} ({where}) is gone: its host refuses connections; "
                             f"unloaded its stage model")
                    directory.remove(name, info)  # (its stub takes it back as it unloads; a dead one cannot)


def unbind(http_url: str, name: str, worker: dict) -> bool:
    """Unload joined instance ``name`` through the head's bind model, as its worker's leave would: True when done,
    False when the name is no longer bound to ``worker`` (another worker bound it since)."""
    from tritonclient.utils import InferenceServerException

    from trident.core.errors import NameTaken, from_message
    from trident.core.protocol import Bind, parse_instance
    from trident.core.bind_call import ask

    request = Bind(stage=parse_instance(name)[0], tcp=tuple(worker["tcp"]), name=name, leave=True)
    try:
        ask(http_url, request, 10.0)
    except InferenceServerException as e:
        if isinstance(from_message(str(e)), NameTaken):
            return False
        raise
    return True
