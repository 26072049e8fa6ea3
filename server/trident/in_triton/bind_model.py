"""The head's bind model (:data:`~trident.core.protocol.BIND_MODEL`): it binds every worker's stage model.

A worker, on the head's host or joining from another, sends it a :class:`~trident.core.protocol.Bind` sealed with a key
derived from the deployment secret (:func:`~trident.core.protocol.seal_bind`: a MAC over every field, the time and a fresh
nonce; the stage credential, which a stage's caller holds, cannot make one). The model refuses a stale or replayed
one, checks that a worker of the deployment listens at the address it names (its stage socket proves the secret),
takes at most :data:`MAX_BINDS` binds per :data:`PACE_S`, keeps the launcher's own workers' names for workers on
its host, and then checks the request, chooses the instance name (the one asked for, or for a joining
worker the first ``<stage>-<n>``, n >= 2, that no live worker serves and the launcher's own workers do not bind as),
writes the stage model's folder into this server's model store (config, the stub :mod:`.proxy_model`, and the worker
file saying where the worker listens) and loads it by name. So workers need neither Triton's repository API nor its
token, and nothing of a stage model's code travels with a load request: Triton refuses any model-file upload
(``supervisor/triton_shim.c``) unless the operator turns it on.

It runs inside Triton's python-backend stub, in :data:`~trident.core.repository.BIND_INSTANCES` instances (processes):
a load through one holds its instance until the stage model is loaded. Binds of one name go one at a time, and
joining workers choose their names one at a time (file locks in the server's workspace, across instances).
"""

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore  # provided by the python-backend stub

from trident.core.errors import InvalidRequest, NameTaken, TridentError, Unavailable
from trident.core.protocol import BIND_FRESH_S, WORKER_FILE, Bind, instance_name, open_bind
from trident.core.repository import install_stage_model
from trident.core.stagecall.client import open_stage_socket
from trident.in_triton.proxy_model import triton_error

MAX_BIND_BYTES = 4096
MAX_BINDS, PACE_S = 20, 10.0  # binds per instance of this model in a window
MAX_JOINED = 1024  # <stage>-<n> names a joining worker may take, per stage
JOINING = ".joining"  # the lock joining workers choose their names under
HOLD_S = 30.0  # the longest a bind waits for another bind of the same name (the worker then asks again)


def _ready(name: str) -> bool:
    try:
        return bool(pb_utils.is_model_ready(name))
    except Exception:  # noqa: BLE001 - a name the server does not know
        return False


def _answers(worker) -> bool:
    """Whether the worker a stage model's worker file names still listens (:func:`open_stage_socket`, as the joined
    workers' watch asks it). Only a refused connection means it has gone; one that is not answered in time, or not
    with the deployment secret, counts as listening (a network cut is not a death: :mod:`trident.supervisor.joined`
    unloads a joined worker that stays gone)."""
    if not isinstance(worker, dict):
        return False
    try:
        open_stage_socket(worker)[0].close()
    except ConnectionRefusedError:
        return False
    except Exception:  # noqa: BLE001 - no answer in time, or no proof of the secret: not gone
        return True
    return True


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self._store = Path(args["model_repository"]).parent
        self._supervised = set(json.loads(config["parameters"]["supervised"]["string_value"]))
        self._locks = self._store.parent / "binding"  # (beside the model store: Triton watches the model folders)
        self._locks.mkdir(mode=0o700, exist_ok=True)
        self._nonces = self._locks / "nonces"  # of the sealed binds taken, across this model's instances
        self._nonces.mkdir(mode=0o700, exist_ok=True)
        self._recent: list[float] = []  # when the last binds came (_pace)

    @contextlib.contextmanager
    def _holding(self, name: str, wait: bool = True):
        """Hold the lock of ``name`` across this model's instances; yields False when ``wait`` is off and another
        instance holds it. Waiting, for at most :data:`HOLD_S`: then :class:`Unavailable` (the worker asks again)."""
        fd = os.open(self._locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + HOLD_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait:
                        yield False
                        return
                    if time.monotonic() > deadline:
                        raise Unavailable(f"another bind of {name} has been under way for {HOLD_S:g} s; "
                                          "retry") from None
                    time.sleep(0.05)
            yield True
        finally:
            os.close(fd)

    def execute(self, requests):
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        try:
            name = self._serve(request)
        except TridentError as e:
            return pb_utils.InferenceResponse(error=triton_error(e))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("name", np.array([name.encode()], np.object_))])

    def _serve(self, request) -> str:
        data = pb_utils.get_input_tensor_by_name(request, "bind").as_numpy().reshape(-1)
        if data.size != 1 or not isinstance(data[0], bytes) or len(data[0]) > MAX_BIND_BYTES:
            raise InvalidRequest(f"bind: one sealed request of at most {MAX_BIND_BYTES} bytes")
        bind = open_bind(data[0], self._take)  # (sealed with the deployment secret, fresh, not a replay)
        bind.check()
        if bind.name in self._supervised and bind.pid is None:
            raise NameTaken(f"{bind.name} is the launcher's own worker's name; a worker from another host joins as "
                            f"<stage>-<n> (no --name)")
        if not bind.leave:
            self._pace()
            self._proves(bind)
        return self._leave(bind) if bind.leave else self._bind(bind)

    def _take(self, nonce: str) -> bool:
        """Whether ``nonce`` is new to every instance of this model (a file made exclusively); those older than
        :data:`~trident.core.protocol.BIND_FRESH_S` are forgotten (a bind that old is refused anyway)."""
        if not nonce.isalnum() or len(nonce) > 64:
            return False
        now = time.time()
        for old in self._nonces.iterdir():
            with contextlib.suppress(OSError):
                if now - old.stat().st_mtime > BIND_FRESH_S:
                    old.unlink()
        try:
            os.close(os.open(self._nonces / nonce, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return False
        return True

    def _pace(self) -> None:
        """At most :data:`MAX_BINDS` binds per :data:`PACE_S` through this instance: a worker binds once, and again
        only after a restart."""
        now = time.monotonic()
        self._recent = [t for t in self._recent if now - t < PACE_S]
        if len(self._recent) >= MAX_BINDS:
            raise Unavailable(f"{MAX_BINDS} binds in the last {PACE_S:g} s already; retry in a few seconds")
        self._recent.append(now)

    @staticmethod
    def _proves(bind: Bind) -> None:
        """A worker of this deployment listens where the bind says (its stage socket proves the secret), before
        anything is written or loaded: a bare socket, or an address of someone else's, is not bound."""
        try:
            open_stage_socket(bind.worker_file(""))[0].close()
        except Exception as e:  # noqa: BLE001 - refused, no answer, or no proof of the secret
            raise Unavailable(f"no worker of this deployment answers at {list(bind.tcp)} ({type(e).__name__}); "
                              "not bound") from None

    def _bind(self, bind: Bind) -> str:
        if bind.name is not None:
            with self._holding(bind.name):
                return self._load(bind, bind.name)
        with contextlib.ExitStack() as held:
            with self._holding(JOINING):  # the first <stage>-<n> no live worker serves and no other bind holds
                for n in range(2, MAX_JOINED + 2):
                    name = instance_name(bind.stage, n)
                    if name not in self._supervised and not _ready(name) and held.enter_context(
                            self._holding(name, wait=False)):
                        break
                else:
                    raise Unavailable(f"{MAX_JOINED} instances of {bind.stage} serve already")
            return self._load(bind, name)

    def _bound_worker(self, name: str):
        try:
            return json.loads((self._store / name / "1" / WORKER_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _load(self, bind: Bind, name: str) -> str:
        """Write ``name``'s folder and load it (its lock held). A name whose stage model is still loaded is taken over
        when its worker has gone (a restarted worker binding while its predecessor's model is being unloaded). The
        same worker asking again (its answer lost: Triton exited and was started again with the model) gets its name."""
        if _ready(name):
            bound = self._bound_worker(name)
            if bound == json.loads(json.dumps(bind.worker_file(name))):
                return name
            if _answers(bound):
                raise NameTaken(f"another worker serves {name}")
        install_stage_model(self._store, name, bind.stage, bind.instances, bind.worker_file(name))
        try:
            pb_utils.load_model(name)
        except Exception as e:  # noqa: BLE001 - pb_utils.TritonModelException: the load's own message
            raise Unavailable(f"loading {name} failed: {e}") from None
        return name

    def _leave(self, bind: Bind) -> str:
        """Unload ``bind.name`` when it is still the asking worker's (after a head restart a name may be another's)."""
        if bind.name is None:
            raise InvalidRequest("leave: which name")
        with self._holding(bind.name):
            return self._unload(bind)

    def _unload(self, bind: Bind) -> str:
        bound = self._bound_worker(bind.name)
        if not isinstance(bound, dict) or bound.get("tcp") != list(bind.tcp):
            raise NameTaken(f"{bind.name} is not bound to the worker at {list(bind.tcp)}")
        try:
            pb_utils.unload_model(bind.name)
        except Exception as e:  # noqa: BLE001 - the unload's own message
            raise Unavailable(f"unloading {bind.name} failed: {e}") from None
        return bind.name
