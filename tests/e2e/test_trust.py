"""The closed trust boundary on a live server (docs/security.md): what a client that talks to Triton and to NIXL
itself can and cannot do, and where the server listens.

The LLaVA server shared with test_serving.py, test_openai.py and test_bad_input.py
(:func:`support.shared_llava_server`), this module last:

- a client calling a stage model without the stage credential is refused and gets no record;
- a client holding a record (leaked, say) reads nothing useful out of it: no agent metadata, no regions, no lease
  id, so its own NIXL agent (the project's :class:`~trident.core.transfer.agent.NixlAgent`) can neither READ, WRITE
  nor release anything of the producer's;
- a party that knows a lease's id and the producer's agent (as one that can read the producer's stamp table
  would) still cannot end the lease: the release needs the key that only the record carries;
- every TCP/UDP listener of the server's processes is on loopback;
- no HTTP request ends Triton or makes it read an unbounded body (the bounded front before it);
- Triton killed under load comes back within seconds with the same workers (before the last test);
- the server's files are its user's alone;
- last, the server stopped with SIGTERM: a stream in flight runs to its end, new requests are refused at once, and
  the BLS entry model's python-backend stub exits cleanly (gdb attached to it says how it ended).

The attack is written as a client would run it, against whatever the server gives: on the code before the trust
boundary it succeeds (the stage answered any client, records were signed but readable, a notification naming the
lease id released it, UCX listened on every interface).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest
import requests
import torch

from support import (
    b64, cancellable_stream, descendants, drain_kv, grpc_generate, http_generate, make_image, png_bytes, shared_llava_server,
    stage_output, strings,
)
from support.server import SHARED_LLAVA_NAME

pytestmark = pytest.mark.slow

PROMPT = "USER: <image>\nWhat is it? ASSISTANT:"


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory, shared_servers):
    """The LLaVA server shared with test_serving.py, test_openai.py and test_bad_input.py (:func:`support.shared_llava_server`:
    Triton on loopback, the OpenAI API on an address of its own, a request sent at the first READY of the entry
    model and of the server); this module is its last user: its last test stops it."""
    return shared_llava_server(shared_servers, demo_models["llava"], tmp_path_factory)


def test_readiness_tells_the_truth(server):
    """From the first moment Triton reports the entry model READY, and the server READY, a request is served."""
    for key in ("model", "server"):
        status, body = server.first_ready[key]
        assert status == 200 and body.get("text_output"), (key, status, body)


@pytest.fixture(scope="module")
def ref():
    return {"text": PROMPT, "images": [b64(png_bytes(make_image(64, 48, 5)))]}


def _prefill_inputs(server, ref) -> dict:
    record = stage_output(server.grpc, "encode", {"image": strings(*ref["images"])})
    return {"text_input": strings(ref["text"]), "embedding_meta": strings(record),
            "sampling_parameters": strings(json.dumps({"max_tokens": 4, "temperature": 0}))}


def _client_prefill(server, inputs: dict) -> tuple[bytes | None, str]:
    """``prefill`` called as a client: no stage credential. (record or None, error message)."""
    import tritonclient.grpc as grpcclient

    from support.clients import _grpc_inputs

    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        result = client.infer("prefill", _grpc_inputs(grpcclient, inputs))
    except Exception as e:  # noqa: BLE001 - the refusal is what is checked
        return None, e.message()
    finally:
        client.close()
    return result.as_numpy("kv_meta").reshape(-1)[0], ""


def attacker_view(data: bytes) -> dict | None:
    """What a client reads out of record bytes without the deployment's key: the producer's agent, its metadata,
    the regions and the lease, when the bytes are msgpack (alone, or followed by a MAC of 16 or 32 bytes)."""
    for cut in (data, data[:-32], data[:-16]):
        try:
            head = msgspec.msgpack.decode(cut)
        except (msgspec.DecodeError, ValueError):
            continue
        if isinstance(head, list) and len(head) > 1 and isinstance(head[1], list) and len(head[1]) >= 8:
            agent, meta, pool, regions, _tensors, lease_id, _expires, stamp = head[1][:8]
            return {"agent": agent, "meta": meta, "regions": [tuple(r) for r in regions], "lease_id": lease_id,
                    "stamp": stamp}
    return None


def _attack(view: dict) -> dict[str, bool]:
    """READ the producer's region, WRITE into it, and release its lease, with an agent of our own."""
    from trident.core.transfer.agent import NixlAgent

    agent = NixlAgent(name="attacker")
    addr, length = view["regions"][0]
    buf = torch.zeros(length + 256, dtype=torch.uint8)
    agent.register(buf)
    done = {"read": False, "write": False, "release": False}
    try:
        agent.read(view["agent"], view["meta"], [(addr, length)], buf.data_ptr(), b"", 10.0)
        done["read"] = bool(buf[:length].any())
    except Exception:  # noqa: BLE001 - a refused READ is the point
        pass
    try:
        raw = agent._agent
        marker = torch.full((16,), 0x5A, dtype=torch.uint8)
        agent.register(marker)
        handle = raw.initialize_xfer("WRITE", raw.get_xfer_descs([(marker.data_ptr(), 16, 0)], "DRAM"),
                                     raw.get_xfer_descs([(addr, 16, 0)], "DRAM"), view["agent"], b"")
        state = raw.transfer(handle)
        while state == "PROC":
            state = raw.check_xfer_state(handle)
        done["write"] = state == "DONE"
    except Exception:  # noqa: BLE001
        pass
    try:
        agent.notify(view["agent"], view["meta"], view["lease_id"].encode())
        done["release"] = True  # (sent: whether it released is checked by reading the record afterwards)
    except Exception:  # noqa: BLE001
        pass
    return done


def test_a_client_gets_no_record_and_a_leaked_one_opens_nothing(server, ref):
    inputs = _prefill_inputs(server, ref)
    # 1. the stage model, called as any client can: refused before any work, no record
    record, error = _client_prefill(server, inputs)
    # 2. a record in a client's hands all the same (leaked from a deployment process)
    leaked = record if record is not None else stage_output(server.grpc, "prefill", inputs)
    view = attacker_view(leaked)
    done = _attack(view) if view is not None else {}
    released_by_attacker = False
    try:
        drain_kv(server.grpc, leaked)  # the deployment's own decode still reads it: nothing was taken from it
    except Exception as e:  # noqa: BLE001
        released_by_attacker = "ReplayedRecord" in str(e) or "lease" in str(e)
    assert record is None, f"a client without the stage credential got a record; its attack did {done}"
    assert "Unauthenticated: stage model prefill answers only the deployment's own callers" in error
    assert view is None and not released_by_attacker, f"a leaked record opened the producer's memory: {done}"


def test_a_lease_id_alone_does_not_end_a_lease(server, ref):
    """A party that knows the producer's agent and a lease's id (what the stamp table holds) sends the release
    notification: the lease stays open and the record's consumer reads it as if nothing happened."""
    from trident.core.protocol import decode_record
    from trident.core.transfer.agent import NixlAgent

    kv = stage_output(server.grpc, "prefill", _prefill_inputs(server, ref))
    t = decode_record(kv).transfer  # (with the deployment's key: the most an insider of the stamp table knows)
    released = server.stats(settled=True)["prefill"]["released"]
    NixlAgent(name="stamp-reader").notify(t.agent, t.agent_meta, t.lease_id.encode())
    assert server.stats(settled=True)["prefill"]["released"] == released, "a lease id alone released the lease"
    drain_kv(server.grpc, kv)  # the decode reads its record: the lease was still open
    assert server.stats(settled=True)["prefill"]["released"] == released + 1


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address:port, process) of every TCP and UDP listener of ``pids``."""
    out = subprocess.run(["ss", "-H", "-ltunp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            fields = line.split()
            found.append((fields[4], ",".join(re.findall(r'"([^"]+)"', line))))
    return found


def test_every_listener_is_on_loopback(server):
    """Every listener is on loopback; the OpenAI API on its own address (``openai_host``), Triton's on ``--host``."""
    from support import descendants

    pids = {server.proc.pid, *descendants(server.proc.pid)}
    found = _listeners(pids)
    assert len(found) >= 5, found  # Triton's HTTP, gRPC and metrics ports, the OpenAI port, UCX's listeners
    outside = [(addr, who) for addr, who in found if not addr.startswith(("127.", "[::1]:", "[::ffff:127."))]
    assert not outside, f"listeners outside loopback: {outside}"
    by_port = {addr.rsplit(":", 1)[1]: addr.rsplit(":", 1)[0].removeprefix("[::ffff:").removesuffix("]")
               for addr, _ in found}
    assert by_port[str(server.openai_port)] == server.openai_host != "127.0.0.1", found
    assert {by_port[str(p)] for p in (server.http_port, server.grpc_port, server.metrics_port)} == {"127.0.0.1"}


def test_the_server_s_files_are_its_user_s_alone(server):
    """``trident serve`` starts everything under a 0077 umask: no folder of its workspace (worker files, stats,
    Triton's log, the model store; not the copy of Triton's own binaries) is open to other users, and no file the
    server writes there is (a file copied from a package, e.g. a stub's model.py, keeps its 0644 behind a 0700
    folder). Nor are the python backend's /dev/shm regions, which carry every prompt and output: the backend sets
    them 0644 itself, the shim Triton runs with (supervisor/triton_shim.c) keeps them 0600."""
    import stat

    binaries = server.workspace / "triton" / "tritonserver"  # Triton itself, copied by PyTriton with its modes
    paths = [server.workspace, *(p for p in server.workspace.rglob("*") if not p.is_relative_to(binaries))]
    open_to_others = [str(p) for p in paths if not p.is_symlink() and p.exists() and stat.S_IMODE(p.stat().st_mode) & 0o077
                      and (p.is_dir() or p.suffix != ".py")]
    assert not open_to_others, open_to_others[:10]
    regions = list(Path("/dev/shm").glob(f"pytrtion{server.proc.pid}-*"))
    assert regions and {oct(stat.S_IMODE(r.stat().st_mode)) for r in regions} == {"0o600"}, regions


def test_no_secret_in_an_argv_and_none_in_the_frontend(server):
    """Neither the deployment secret nor the repository-API token is in the command line of any process the server
    started (readable by every local user from /proc), Triton's included: Triton 2.51 takes its token only there,
    so its command line holds a placeholder that the shim it runs with swaps for the token (supervisor/triton_shim.c).
    The OpenAI frontend, which needs neither, is not given them."""
    import os

    from support import descendants

    secrets = {os.environ["TRIDENT_TRANSFER_SECRET"].encode(), server.token.encode()}
    argvs = {}
    for pid in {server.proc.pid, *descendants(server.proc.pid)}:
        try:
            argvs[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
    shown = [argv[:60] for argv in argvs.values() if any(secret in argv for secret in secrets)]
    assert len(argvs) >= 10 and not shown, shown
    triton = [argv for argv in argvs.values() if argv.split(b"\0")[0].endswith(b"/tritonserver")]
    assert len(triton) == 1 and b"triton-access-token=@TRIDENT_ACCESS_TOKEN@" in triton[0], triton
    started = [line for line in server.log if line.startswith("[trident] started the OpenAI frontend (pid ")]
    frontend = int(started[-1].split("(pid ")[1].split(")")[0])
    environ = Path(f"/proc/{frontend}/environ").read_bytes()
    assert b"HF_HUB_OFFLINE=1" in environ  # (what it is given)
    assert not [secret for secret in secrets if secret in environ]


UPLOADED = b"from pathlib import Path\nPath(%r).write_text('ran')\n"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_load_that_uploads_model_files_is_refused_even_with_the_token(server, tmp_path, protocol):
    """A repository-API ``load`` with model files (``file:`` parameters) would run their code as the server's user.
    With the operator's own token it is still refused (HTTP 501 / gRPC UNIMPLEMENTED, naming the setting that allows
    it), nothing of it runs, and the server serves on."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    marker = tmp_path / "ran"
    config = json.dumps({"name": "uploaded", "backend": "python",
                         "input": [{"name": "x", "data_type": "TYPE_STRING", "dims": [1]}],
                         "output": [{"name": "y", "data_type": "TYPE_STRING", "dims": [1]}]})
    files = {"file:1/model.py": UPLOADED % str(marker)}
    if protocol == "http":
        client, headers, wanted = httpclient.InferenceServerClient(server.http), {"triton-access-token": server.token}, "501"
    else:
        client, wanted = grpcclient.InferenceServerClient(server.grpc), "StatusCode.UNIMPLEMENTED"
        headers = {"triton-grpc-protocol-triton-access-token": server.token}
    try:
        with pytest.raises(Exception) as refused:
            client.load_model("uploaded", config=config, files=files, headers=headers)
        assert str(refused.value.status()) == wanted, refused.value
        assert "model-file uploads" in str(refused.value) and "allow_code_upload" in str(refused.value)
        assert not client.is_model_ready("uploaded")
    finally:
        client.close()
    assert not marker.exists()
    text = grpc_generate(server.grpc, "e_p_d", PROMPT, [b64(png_bytes(make_image(64, 48, 5)))],
                         {"max_tokens": 4, "temperature": 0}, stream=False).text
    assert text


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_load_whose_config_names_a_host_file_is_refused_even_with_the_token(server, tmp_path, protocol):
    """A ``load`` whose config override names a file on the host (``default_model_filename`` as a path, the python
    backend's ``EXECUTION_ENV_PATH``, which it hands to ``bash -c``; or either key spelled with a JSON ``\\u``
    escape) is refused (HTTP 501 / gRPC UNIMPLEMENTED, naming them) with the operator's own token; the server serves
    on. (A plain name, as in the BLS config Triton gives back, loads: the scheduler swaps of test_media_serving.)"""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    marker = tmp_path / "ran"
    base = {"name": "e_p_d", "backend": "python", "max_batch_size": 0}
    overrides = [
        {**base, "default_model_filename": "../../../../" + str(marker)},
        {**base, "defaultModelFilename": ".."},  # (protobuf's JSON name for it)
        {**base, "parameters": {"EXECUTION_ENV_PATH": {"string_value": str(tmp_path / "env.tar.gz")}}},
    ]
    texts = [json.dumps(o) for o in overrides] + [json.dumps(overrides[2]).replace("EXECUTION_ENV", "EXECUTION\\u005fENV")]
    if protocol == "http":
        client, headers, wanted = httpclient.InferenceServerClient(server.http), {"triton-access-token": server.token}, "501"
    else:
        client, wanted = grpcclient.InferenceServerClient(server.grpc), "StatusCode.UNIMPLEMENTED"
        headers = {"triton-grpc-protocol-triton-access-token": server.token}
    try:
        for text in texts:
            with pytest.raises(Exception) as refused:
                client.load_model("e_p_d", config=text, headers=headers)
            assert str(refused.value.status()) == wanted, refused.value
            assert "may not set default_model_filename to a path or set EXECUTION_ENV_PATH" in str(refused.value), refused.value
        assert client.is_model_ready("e_p_d")
    finally:
        client.close()
    assert not marker.exists()
    text = grpc_generate(server.grpc, "e_p_d", PROMPT, [b64(png_bytes(make_image(64, 48, 5)))],
                         {"max_tokens": 4, "temperature": 0}, stream=False).text
    assert text


AUTO_COMPLETING = """
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        Path(%r).write_text("auto-completed")
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", np.array([b"ok"], np.object_))]) for _ in requests]
"""


def test_no_model_load_starts_a_python_process_to_complete_its_config(server, tmp_path):
    """Trident writes every model config whole, and the shim turns Triton's auto-completion off: the python backend
    no longer starts a stub process at each load only to call the model's ``auto_complete_config`` (half of a stage
    model's load time). A model whose ``auto_complete_config`` would leave a mark loads and serves without leaving it."""
    import numpy as np
    import tritonclient.http as httpclient

    marker = tmp_path / "auto-completed"
    folder = server.workspace / "triton" / "model-store" / "auto_completing"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(AUTO_COMPLETING % str(marker))
    (folder / "config.pbtxt").write_text('backend: "python"\ninput [{ name: "x", data_type: TYPE_STRING, dims: [1] }]\n'
                                         'output [{ name: "y", data_type: TYPE_STRING, dims: [1] }]\n')
    client = httpclient.InferenceServerClient(server.http)
    headers = {"triton-access-token": server.token}
    try:
        client.load_model("auto_completing", headers=headers)
        given = httpclient.InferInput("x", [1], "BYTES")
        given.set_data_from_numpy(np.array([b"hi"], np.object_))
        assert client.infer("auto_completing", [given]).as_numpy("y").tolist() == [b"ok"]
        assert not marker.exists()
    finally:
        client.unload_model("auto_completing", headers=headers)
        client.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_model_configs_show_nothing_of_the_host_or_the_scheduler(server):
    """What any client reads of every model's config: no path of the host (the workspace, the checkpoint), no
    scheduler setting; an entry model's parameters are its mode, a stage model's none."""
    import requests

    base = f"http://{server.http}/v2"
    index = requests.post(f"{base}/repository/index", json={"ready": True},
                          headers={"triton-access-token": server.token}, timeout=10).json()
    names = {m["name"] for m in index}
    assert {"e_p_d", "encode", "prefill", "decode", "trident_bind"} <= names, names
    for name in names:
        text = requests.get(f"{base}/models/{name}/config", timeout=10).text
        assert str(server.workspace) not in text and server.model_path not in text and "/tmp" not in text, name
        parameters = json.loads(text).get("parameters", {})
        assert set(parameters) == ({"mode"} if name in ("epd", "e_pd", "e_p_d", "ep_d") else
                                   {"supervised"} if name == "trident_bind" else set()), (name, parameters)


def _raw_http(server, head: bytes, parts=()) -> bytes:
    """A request written by hand to Triton's public HTTP port, and the answer's status line and headers."""
    import socket

    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as s:
        s.sendall(head)
        for part in parts:
            s.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := s.recv(65536)):
            answer += chunk
    return answer


def test_no_http_request_ends_triton_or_makes_it_read_an_unbounded_body(server):
    """Triton 2.51's HTTP server ended (SIGSEGV) on a chunked body of 2,000,000 one-byte chunks, from anyone, and read
    bodies of any size. Behind the launcher's bounded front (supervisor/http_front.py) the chunked request is the
    client's 400 (it is not JSON), a body declared over the limit is a 413 at once, the server serves on with the
    same answer, and Triton itself listens for HTTP and metrics only on Unix sockets its user alone can reach."""
    params = {"max_tokens": 8, "temperature": 0}
    before = http_generate(server.http, "epd", "USER: Say something. ASSISTANT:", [], params)
    assert before[0] == 200, before
    head = (b"POST /v2/models/epd/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\n\r\n")
    answer = _raw_http(server, head, [b"1\r\na\r\n" * 100_000] * 20 + [b"0\r\n\r\n"])
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    declared = _raw_http(server, b"POST /v2/models/epd/generate HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                 b"100000000000\r\n\r\n")
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
    assert http_generate(server.http, "epd", "USER: Say something. ASSISTANT:", [], params) == before
    triton = [pid for pid in descendants(server.proc.pid)
              if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"]
    assert len(triton) == 1
    ports = {addr.rsplit(":", 1)[1] for addr, _ in _listeners(set(triton))}
    assert ports == {str(server.grpc_port)}, ports  # (HTTP and metrics: the head's front listens)
    sockets = server.workspace / "sockets"
    assert oct(sockets.stat().st_mode & 0o777) == "0o700" and {p.name for p in sockets.iterdir()} == {
        "http.sock", "metrics.sock"}
    assert requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).status_code == 200


def _sealed(request: dict, sent_at: float | None = None, secret: bool = True) -> bytes:
    """A bind request as the deployment's workers seal it (protocol.seal_bind), whatever its fields; ``secret``
    off: MAC'd with the stage credential, all a stage's caller holds."""
    import hashlib
    import hmac
    import os

    from trident.core import auth
    from trident.core.protocol import BIND_KEY

    body = json.dumps({"bind": request, "sent_at": time.time() if sent_at is None else sent_at,
                       "nonce": os.urandom(16).hex()}).encode()
    key = auth.derive(BIND_KEY) if secret else auth.credential().encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b"." + body


def _bind(server, request: dict | bytes, credential: bool = True):
    """Call the head's bind model as a client would, with ``request`` sealed (or bytes as they are), and the stage
    credential as a parameter when ``credential``: (name, error)."""
    import numpy as np
    import tritonclient.http as httpclient

    from trident.core import auth
    from trident.core.protocol import BIND_MODEL

    client = httpclient.InferenceServerClient(server.http)
    given = httpclient.InferInput("bind", [1], "BYTES")
    data = request if isinstance(request, bytes) else _sealed(request)
    given.set_data_from_numpy(np.array([data], dtype=np.object_))
    try:
        answer = client.infer(BIND_MODEL, [given], parameters={auth.CREDENTIAL: auth.credential()} if credential else None)
        return answer.as_numpy("name").reshape(-1)[0].decode(), None
    except Exception as e:  # noqa: BLE001 - the refusal is what is checked
        return None, e
    finally:
        client.close()


def test_the_bind_model_binds_nothing_for_a_stranger_or_a_wrong_request(server):
    """The head's bind model answers the deployment's own workers alone: a request not sealed with the secret is
    refused (Unauthenticated), even from a holder of the stage credential, and so are a stale and a replayed one; a
    bind to an address where no worker of the deployment listens (a bare socket) is refused before anything is
    loaded; a wrong request gets a 400 naming its fault, a worker cannot unbind a stage model bound for another
    worker's socket, and a worker from another host cannot take the launcher's own workers' names. The stage
    models stay as they were."""
    import socket

    bare = socket.create_server(("127.0.0.1", 0))
    stage = {"stage": "prefill", "tcp": ["127.0.0.1", bare.getsockname()[1]]}
    try:
        plain = json.dumps(stage).encode()
        for request, why in [(plain, "not sealed"), (_sealed(stage, secret=False), "MAC'd with the credential"),
                             (_sealed(stage, sent_at=time.time() - 600), "stale")]:
            name, error = _bind(server, request)
            assert name is None and "Unauthenticated" in str(error), (why, error)
        once = _sealed({**stage, "name": "prefill", "leave": True})
        assert "NameTaken" in str(_bind(server, once)[1])  # (taken: not the prefill worker's socket)
        name, error = _bind(server, once)
        assert name is None and "already taken (a replay)" in str(error), error
        name, error = _bind(server, {**stage, "name": "prefill-7"})
        assert name is None and "no worker of this deployment answers at" in str(error), error
        assert not server.ready("prefill-7")
        name, error = _bind(server, {**stage, "name": "decode"} | {"stage": "decode"})
        assert name is None and "the launcher's own worker's name" in str(error), error
        for request, fault in [({**stage, "stage": "decoder"}, "unknown stage 'decoder'"),
                               ({**stage, "tcp": ["127.0.0.1", 0]}, "tcp must be a host and a port"),
                               ({**stage, "instances": 17}, "instances must be 1-16"),
                               ({**stage, "name": "decode-2"}, "not an instance name of stage prefill"),
                               ({**stage, "pid": 1}, "pid and direct go together"),
                               ({**stage, "exec": "x"}, "unknown field")]:
            name, error = _bind(server, request)
            assert name is None and "InvalidRequest" in str(error) and fault in str(error) and error.status() == "400", (
                request, error)
        name, error = _bind(server, {**stage, "name": "prefill", "leave": True, "pid": 1, "direct": "/tmp/x.sock"})
        assert name is None and "NameTaken" in str(error) and "is not bound to the worker at" in str(error), error
    finally:
        bare.close()
    assert server.ready("prefill")


def test_a_name_whose_worker_has_gone_is_bound_again(server):
    """A name whose stage model is still loaded is refused while its worker listens (NameTaken), and taken over once
    nothing listens there: a restarted worker binds while Triton is still unloading its predecessor's model (an
    unload finishes in the background; under load the launcher's restart came first, and the worker stayed down).
    The workers are stage servers of the deployment (the test holds its secret), answering nothing else."""
    from trident.core.stagecall.server import StageServer

    old, new = (StageServer(lambda call: {}, lambda message: None, "127.0.0.1") for _ in range(2))
    for w in (old, new):
        w.start()
    at = {w: list(w.address) for w in (old, new)}
    stage = {"stage": "prefill", "name": "prefill-9"}
    try:
        name, error = _bind(server, {**stage, "tcp": at[old]})
        assert (name, error) == ("prefill-9", None) and server.ready("prefill-9")
        name, error = _bind(server, {**stage, "tcp": at[new]})
        assert name is None and "another worker serves prefill-9" in str(error), error
        old.stop(drain_s=0)  # its worker dies; its model is still loaded
        name, error = _bind(server, {**stage, "tcp": at[new]})
        assert (name, error) == ("prefill-9", None) and server.ready("prefill-9")
        name, error = _bind(server, {**stage, "tcp": at[old], "leave": True})
        assert name is None and "is not bound to the worker at" in str(error), error  # the name is the new one's
    finally:
        _bind(server, {**stage, "tcp": at[new], "leave": True})
        new.stop(drain_s=0)


class _Gdb:
    """gdb attached to a process in batch mode (``script``); its output is collected by a thread."""

    def __init__(self, gdb: str, pid: int, script: Path) -> None:
        self.proc = subprocess.Popen([gdb, "-p", str(pid), "-batch", "-x", str(script)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._attached = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ATTACHED"):  # the script prints it once it has attached
                self._attached.set()

    def wait_attached(self) -> None:
        assert self._attached.wait(60), "\n".join(self.lines[-20:])

    def finish(self, log: Path) -> None:
        """Wait for gdb to end (killed after 60 s), and keep its output in ``log``."""
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        log.write_text("\n".join(self.lines))


def _entry_stub(server, mode: str) -> int:
    for pid in descendants(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmdline and f"/{mode}/1/model.py" in cmdline:
            return pid
    raise AssertionError(f"no python-backend stub runs the {mode} entry model")


EXIT_SCRIPT = """\
set pagination off
set confirm off
set print thread-events off
handle SIGPIPE SIGUSR1 SIGUSR2 SIGTERM SIGINT SIG32 SIG33 SIG34 SIG35 SIG36 nostop noprint pass
printf "ATTACHED\\n"
continue
bt 6
quit
"""


def _refused_at_once(server) -> None:
    """A draining server (SIGTERM, a stream still in flight): within seconds it is not READY (Triton's readiness
    and the OpenAI frontend's /health answer 503), and a new request on every way in is refused at once with
    ``Unavailable`` naming the shutdown (the OpenAI API: 503 with Retry-After; Triton's generate endpoint answers
    400 for every error of a decoupled model)."""
    import tritonclient.grpc as grpcclient

    t0 = time.monotonic()
    while requests.get(f"http://{server.http}/v2/health/ready", timeout=2).status_code == 200:
        assert time.monotonic() - t0 < 3, "Triton still READY 3 s after SIGTERM"
        time.sleep(0.02)
    assert requests.get(f"{server.openai_url.removesuffix('/v1')}/health", timeout=2).status_code == 503
    says = "the server is shutting down"
    t0 = time.monotonic()
    with pytest.raises(grpcclient.InferenceServerException, match=f"Unavailable: {says}"):  # (a stream's error: no code)
        grpc_generate(server.grpc, "e_p_d", "Hi.", [], {"max_tokens": 2}, stream=True, timeout=10)
    r = requests.post(f"http://{server.http}/v2/models/e_p_d/generate",
                      json={"text_input": "Hi.", "sampling_parameters": json.dumps({"max_tokens": 2})}, timeout=10)
    assert r.status_code == 400 and says in r.json()["error"], r.text  # (Triton's generate: 400 for every error)
    r = requests.post(f"{server.openai_url}/completions",
                      json={"model": f"{SHARED_LLAVA_NAME}:e_p_d", "prompt": "Hi.", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and says in r.json()["error"]["message"] and r.headers["Retry-After"], r.text
    assert time.monotonic() - t0 < 5, "the refusals were not at once"  # (three requests, on a busy 2-core machine)


def _workers(server) -> dict[str, int]:
    """The server's stage workers: pid by name."""
    found = {}
    for pid in descendants(server.proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if args.startswith("trident worker "):
            found[args.split("\0")[0].split()[2]] = pid
    return found


def _http_stream(server, prompt: str, params: dict, first: threading.Event, out: list) -> None:
    """A generate_stream over HTTP; what it ends with: ("whole", text) or ("error", what)."""
    body = {"text_input": f"USER: {prompt} ASSISTANT:", "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(params), "return_finish_reason": True}
    text, finish = "", None
    try:
        with requests.post(f"http://{server.http}/v2/models/e_p_d/generate_stream", json=body, stream=True,
                           timeout=60) as answer:
            if answer.status_code != 200:
                out.append(("error", answer.status_code))
                return
            for line in answer.iter_lines():
                if line.startswith(b"data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        out.append(("error", event["error"]))
                        return
                    text += event.get("text_output", "")
                    finish = event.get("finish_reason", finish)
                    first.set()
        out.append(("whole", text, finish))
    except requests.RequestException as e:
        out.append(("error", type(e).__name__))
    finally:
        first.set()


def test_triton_killed_under_load_comes_back_with_the_same_workers(server):
    """kill -9 tritonserver while four streams are in flight: each stream ends whole or with an error, never cut
    short and ended as if whole; readiness is false until the server serves again, with the same worker processes
    (their engines kept) and the same answers, on HTTP and gRPC (``Launcher._triton_back``). How soon is printed:
    about 9 s on 2 idle cores (docs/reliability.md); the wait allows 90 s, as the suite runs another lane beside it
    (there the entry models' loads took 11 s and more, and 15 s was once too short)."""
    prompt, params = "Count from one to one hundred, in words, please.", {"max_tokens": 200, "temperature": 0}
    reference = grpc_generate(server.grpc, "e_p_d", prompt, [], params, stream=True)
    workers = _workers(server)
    assert {"encode", "prefill", "decode"} <= set(workers), workers
    (triton,) = [pid for pid in descendants(server.proc.pid)
                 if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver"]
    ends: list = []
    firsts = [threading.Event() for _ in range(4)]
    streams = [threading.Thread(target=_http_stream, args=(server, prompt, params, f, ends)) for f in firsts]
    for t in streams:
        t.start()
    for f in firsts:
        assert f.wait(60)
    os.kill(triton, signal.SIGKILL)
    t0, seen = time.monotonic(), set()
    while time.monotonic() - t0 < 90:
        try:
            status = requests.get(f"http://{server.http}/v2/health/ready", timeout=2).status_code
        except requests.RequestException:
            status = None
        seen.add(status)
        if status == 200 and seen != {200}:
            break
        time.sleep(0.1)
    assert status == 200 and seen - {200}, (seen, "\n".join(server.log[-20:]))
    print(f"READY again {time.monotonic() - t0:.1f} s after the kill (pytest -s)")
    for t in streams:
        t.join(60)
    assert len(ends) == 4
    for end in ends:  # (a whole one finished before the kill: the reference's text, to its length)
        assert end[0] == "error" or (end[1] == reference.text and end[2] == "length"), end
    assert _workers(server) == workers  # the same processes: no engine loaded again
    assert grpc_generate(server.grpc, "e_p_d", prompt, [], params, stream=True).text == reference.text
    assert http_generate(server.http, "epd", f"USER: {prompt} ASSISTANT:", [], params)[0] == 200
    chat = requests.post(f"{server.openai_url}/chat/completions", timeout=60, json={
        "model": f"{SHARED_LLAVA_NAME}:e_p_d", "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]})
    assert chat.status_code == 200, chat.text  # (the OpenAI frontend's gRPC channel to the new Triton)
    assert any("Triton is back in" in line for line in server.log)


def test_a_stopping_server_finishes_its_streams_refuses_new_requests_and_exits_cleanly(server, tmp_path):
    """The module's last test: it stops the server (SIGTERM, as Kubernetes does). It drains: not READY at once, new
    requests answered 503 at once on every way in, a stream in flight runs to its end, whole; the server exits 0.

    And the BLS entry model's stub exits cleanly, as gdb attached to it sees: the BLS's Prometheus metric families
    are never deleted (``scheduler.metrics.keep_past_exit``); left to the interpreter's exit, their destructors
    ran after the stub had freed its shared memory, and every entry model's stub segfaulted as the server stopped
    (``Metric::SaveToSharedMemory``)."""
    gdb = shutil.which("gdb")
    assert gdb, "this test needs gdb (`make test` installs it)"
    script = tmp_path / "exit.gdb"
    script.write_text(EXIT_SCRIPT)
    prompt, params = "Count from one to one hundred, in words, please.", {"max_tokens": 300, "temperature": 0}
    whole = grpc_generate(server.grpc, "e_p_d", prompt, [], params, stream=True)  # (also creates the metrics)
    assert whole.num_output_tokens > 100
    stub = _entry_stub(server, "e_p_d")
    gdb_run = _Gdb(gdb, stub, script)
    gdb_run.wait_attached()
    with cancellable_stream(server.grpc, "e_p_d", prompt, [], params, timeout=30) as next_response:
        text = [next_response().as_numpy("text_output").reshape(-1)[0].decode()]
        server.proc.send_signal(signal.SIGTERM)
        _refused_at_once(server)
        while len("".join(text)) < len(whole.text):
            text.append(next_response().as_numpy("text_output").reshape(-1)[0].decode())
    assert "".join(text) == whole.text
    assert server.proc.wait(60) == 0, "\n".join(server.log[-30:])
    assert not list(Path("/dev/shm").glob(f"pytrtion{server.proc.pid}-*"))  # the python backend's regions: removed
    # the stub has exited (or crashed, and gdb printed where)
    gdb_run.finish(tmp_path / "gdb.log")
    lines = gdb_run.lines
    crashed = [i for i, line in enumerate(lines) if "received signal" in line]
    assert not crashed, "\n".join(lines[crashed[0]:crashed[0] + 8])
    assert any(f"process {stub}) exited" in line for line in lines), "\n".join(lines[-10:])
