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

from trident.supervisor.head import Launcher, serve
from trident.supervisor.processes import descendants
from trident.supervisor.worker_pool import own_side_channel

__all__ = ["Launcher", "descendants", "own_side_channel", "serve"]
