"""What starts and supervises Trident's processes, one job per module.

- :mod:`.head`: ``trident serve``, the head (:class:`~.head.Launcher`): checks, start-up order, supervision, stop.
- :mod:`.triton_process`: Triton's process (started, started again after it died, stopped; a client to it), with
  the shim preloaded into it (:mod:`.triton_shim`), the bounded front of its HTTP and metrics ports
  (:mod:`.http_front`) and PyTriton's adjustments (:mod:`.pytriton_patch`).
- :mod:`.worker_pool`: the head's stage workers, forked from the zygote (:mod:`.zygote`), and its OpenAI frontend:
  started, watched by their exit, started again (:mod:`.restarts`).
- :mod:`.readiness`: READY only once a request would be served (the start-up gate: :mod:`.gate`), and the drain.
- :mod:`.joined`: workers that joined from other hosts, watched by their connections; :mod:`.node`: ``trident
  node``, a stage host's own supervisor.
- :mod:`.warmup`, :mod:`.processes`, :mod:`.quiet`, :mod:`.startup`: the warm-up request, finding and stopping what
  a server leaves behind, the libraries' quiet environment, the start-up error a user can act on.
"""

import importlib

# (imported when first named: every process of Trident imports this package, through trident.cli and the zygote,
# and all but the head would otherwise import the head's modules, PyTriton among them: about half a CPU second each)
_FROM = {"Launcher": "head", "serve": "head", "descendants": "processes", "own_side_channel": "worker_pool"}
__all__ = sorted(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
