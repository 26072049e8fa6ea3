"""The head's bind model (:data:`~trident.protocol.BIND_MODEL`): it binds every worker's stage model.

A worker, on the head's host or joining from another, sends it a :class:`~trident.protocol.Bind` with the
deployment's stage credential. The model checks it, chooses the instance name (the one asked for, or for a joining
worker the first ``<stage>-<n>``, n >= 2, that no live worker serves and the launcher's own workers do not bind as),
writes the stage model's folder into this server's model store (config, the stub :mod:`.proxy_model`, and the worker
file saying where the worker listens) and loads it by name. So workers need neither Triton's repository API nor its
token, and nothing of a stage model's code travels with a load request: Triton refuses any model-file upload
(``launcher/triton_shim.c``) unless the operator turns it on.

It runs inside Triton's python-backend stub, one instance: binds happen one at a time.
"""

import json
from pathlib import Path

import msgspec
import numpy as np
import triton_python_backend_utils as pb_utils  # type: ignore  # provided by the python-backend stub

from trident import auth
from trident.errors import InvalidRequest, NameTaken, TridentError, Unauthenticated, Unavailable
from trident.protocol import WORKER_FILE, Bind, instance_name
from trident.repository import install_stage_model
from trident.workers.proxy_model import triton_error

MAX_BIND_BYTES = 4096
MAX_JOINED = 1024  # <stage>-<n> names a joining worker may take, per stage


def _ready(name: str) -> bool:
    try:
        return bool(pb_utils.is_model_ready(name))
    except Exception:  # noqa: BLE001 - a name the server does not know
        return False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self._store = Path(args["model_repository"]).parent
        self._supervised = set(json.loads(config["parameters"]["supervised"]["string_value"]))

    def execute(self, requests):
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        try:
            name = self._serve(request)
        except TridentError as e:
            return pb_utils.InferenceResponse(error=triton_error(e))
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("name", np.array([name.encode()], np.object_))])

    def _serve(self, request) -> str:
        try:
            parameters = json.loads(request.parameters() or "{}")
        except ValueError:
            parameters = None
        if not isinstance(parameters, dict) or not auth.check_credential(parameters.get(auth.CREDENTIAL)):
            raise Unauthenticated("the bind model answers only the deployment's own workers (the request carries no "
                                  f"valid {auth.CREDENTIAL})")
        data = pb_utils.get_input_tensor_by_name(request, "bind").as_numpy().reshape(-1)
        if data.size != 1 or not isinstance(data[0], bytes) or len(data[0]) > MAX_BIND_BYTES:
            raise InvalidRequest(f"bind: one JSON object of at most {MAX_BIND_BYTES} bytes")
        try:
            bind = msgspec.json.decode(data[0], type=Bind)
        except msgspec.DecodeError as e:
            raise InvalidRequest(f"bind: {e}") from None
        bind.check()
        return self._leave(bind) if bind.leave else self._bind(bind)

    def _bind(self, bind: Bind) -> str:
        name = bind.name or self._free_name(bind.stage)
        if _ready(name):
            raise NameTaken(f"another worker serves {name}")
        install_stage_model(self._store, name, bind.stage, bind.instances, bind.worker_file(name))
        try:
            pb_utils.load_model(name)
        except Exception as e:  # noqa: BLE001 - pb_utils.TritonModelException: the load's own message
            raise Unavailable(f"loading {name} failed: {e}") from None
        return name

    def _free_name(self, stage: str) -> str:
        for n in range(2, MAX_JOINED + 2):
            name = instance_name(stage, n)
            if name not in self._supervised and not _ready(name):
                return name
        raise Unavailable(f"{MAX_JOINED} instances of {stage} serve already")

    def _leave(self, bind: Bind) -> str:
        """Unload ``bind.name`` when it is still the asking worker's (after a head restart a name may be another's)."""
        if bind.name is None:
            raise InvalidRequest("leave: which name")
        try:
            bound = json.loads((self._store / bind.name / "1" / WORKER_FILE).read_text())
        except (OSError, ValueError):
            bound = None
        if not isinstance(bound, dict) or bound.get("tcp") != list(bind.tcp):
            raise NameTaken(f"{bind.name} is not bound to the worker at {list(bind.tcp)}")
        try:
            pb_utils.unload_model(bind.name)
        except Exception as e:  # noqa: BLE001 - the unload's own message
            raise Unavailable(f"unloading {bind.name} failed: {e}") from None
        return bind.name
