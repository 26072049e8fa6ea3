"""The stage credential and the stage-socket handshake (:mod:`trident.auth`): both ends prove the deployment
secret, a wrong secret on either side is refused, and nothing but the challenge goes to an unproven caller."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from trident import auth


def _pair_with_secrets(monkeypatch, accept_secret: str, connect_secret: str):
    """Run the handshake over a socket pair, each side under its own secret; (acceptor's error, connector's)."""
    a, b = socket.socketpair()
    results: dict = {}

    # one process, one environment: each side's handshake key is derived first, then handed to it by thread
    with monkeypatch.context() as m:
        m.setenv(auth.ENV, accept_secret)
        acc_key = auth.derive(b"trident-stage-hs")
    with monkeypatch.context() as m:
        m.setenv(auth.ENV, connect_secret)
        con_key = auth.derive(b"trident-stage-hs")
    keys = {"accept": acc_key, "connect": con_key}
    local = threading.local()
    real = auth.derive
    monkeypatch.setattr(auth, "derive", lambda label, value=None: keys[local.side] if label == b"trident-stage-hs" else real(label, value))

    def run(name, fn, sock):
        local.side = name
        try:
            fn(sock)
            results[name] = None
        except auth.NotAuthenticated as e:
            results[name] = e
            sock.close()

    t = threading.Thread(target=run, args=("accept", auth.accept, a))
    t.start()
    run("connect", auth.connect, b)
    t.join(10)
    a.close(), b.close()
    return results["accept"], results["connect"]


def test_the_same_secret_passes_both_ways(monkeypatch):
    assert _pair_with_secrets(monkeypatch, "s1", "s1") == (None, None)


def test_another_deployments_secret_is_refused_by_both_ends(monkeypatch):
    accept_error, connect_error = _pair_with_secrets(monkeypatch, "s1", "s2")
    assert isinstance(accept_error, auth.NotAuthenticated) and "did not prove" in str(accept_error)
    assert isinstance(connect_error, auth.NotAuthenticated)


def test_a_connector_that_is_not_a_stage_socket_is_refused():
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 17)
    with pytest.raises(auth.NotAuthenticated, match="not a Trident stage socket"):
        auth.connect(b)
    a.close(), b.close()


def test_the_credential_is_derived_one_way_and_checked_exactly(monkeypatch):
    monkeypatch.setenv(auth.ENV, "the deployment's secret")
    value = auth.credential()
    assert auth.check_credential(value)
    assert "the deployment's secret" not in value and len(value) == 64
    assert not auth.check_credential(value[:-1] + ("0" if value[-1] != "0" else "1"))
    assert not auth.check_credential(None) and not auth.check_credential(b"bytes") and not auth.check_credential("")
    monkeypatch.setenv(auth.ENV, "another deployment's secret")
    assert not auth.check_credential(value)


def test_rotation_opens_records_of_the_previous_key(monkeypatch):
    """The secret may list several keys, one per line: the first seals, each opens (a key id picks it)."""
    monkeypatch.setenv(auth.ENV, "old")
    old = auth.sign(b"payload")
    monkeypatch.setenv(auth.ENV, "new\nold")
    assert auth.verify(old) == b"payload"
    new = auth.sign(b"payload")
    assert new[1:1 + auth.KEY_ID_BYTES] != old[1:1 + auth.KEY_ID_BYTES]
    monkeypatch.setenv(auth.ENV, "new")
    from trident.errors import ForgedRecord
    with pytest.raises(ForgedRecord):
        auth.verify(old)
    assert auth.verify(new) == b"payload"


@pytest.mark.parametrize("argv", [["worker"], ["node", "encode", "--model", "/nonexistent", "--join", "http://127.0.0.1:1",
                                   "--threads", "0"]],
                         ids=["worker", "node"])
def test_a_joining_worker_and_a_node_keep_their_files_their_user_s_alone(argv):
    """``trident worker`` and ``trident node`` start under a 0077 umask, as ``trident serve`` does (their stats, Unix
    socket folders and vLLM IPC folders are then no other user's): set before anything else, so also when they
    then refuse their arguments."""
    import subprocess
    import sys

    probe = ("import os\nfrom trident.cli import main\nos.umask(0o022)\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
             "except Exception:\n    pass\nprint(oct(os.umask(0)))" % argv)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "0o77", done.stdout + done.stderr


def test_the_head_removes_only_a_direct_socket_folder_its_own_worker_made(tmp_path):
    """A worker file is written from what a bind said: the head removes the socket folder it names only when the
    file names the worker the head started (its pid) and the folder is one of this user's trident-calls-* folders
    in the temporary folder; any other folder a worker file names stays."""
    import json
    import tempfile
    from pathlib import Path

    from trident.launcher.processes import remove_direct_socket
    from trident.protocol import WORKER_FILE
    from trident.stagecall.server import DIR_PREFIX, SOCKET_NAME

    def bound(folder: Path, pid: int) -> Path:
        model = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        (model / "1").mkdir(parents=True)
        (model / "1" / WORKER_FILE).write_text(json.dumps({"pid": pid, "direct": str(folder / SOCKET_NAME)}))
        return model

    own = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
    elsewhere = tmp_path / f"{DIR_PREFIX}victim"  # the right name, not in the temporary folder
    elsewhere.mkdir()
    try:
        remove_direct_socket(bound(own, 4242), pid=4343)  # another worker's file
        remove_direct_socket(bound(elsewhere, 4242), pid=4242)
        assert own.exists() and elsewhere.exists()
        remove_direct_socket(bound(own, 4242), pid=4242)
        assert not own.exists()
    finally:
        shutil.rmtree(own, ignore_errors=True)
