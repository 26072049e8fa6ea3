"""The stage credential and the stage-socket handshake (:mod:`trident.core.auth`): both ends prove the deployment
secret, a wrong secret on either side is refused, and nothing but the challenge goes to an unproven caller."""

from __future__ import annotations

import shutil
import socket
import threading

import pytest

from trident.core import auth


def _pair_with_secrets(monkeypatch, accept_secret: str, connect_secret: str):
    """Run the handshake over a socket pair, each side under its own secret; (acceptor's error, connector's)."""
    a, b = socket.socketpair()
    results: dict = {}

    # one process, one environment: each side reads its own secret's keys, by thread
    secrets_of = {"accept": accept_secret, "connect": connect_secret}
    local = threading.local()
    real = auth.key_lines
    patched = monkeypatch.context()
    patched.__enter__().setattr(auth, "key_lines", lambda value=None: real(
        value if value is not None else secrets_of[local.side]))

    def run(name, fn, sock):
        local.side = name
        try:
            fn(sock)
            results[name] = None
        except auth.NotAuthenticated as e:
            results[name] = e
            sock.close()

    where = auth.identity("/the/socket")
    t = threading.Thread(target=run, args=("accept", lambda sock: auth.accept(sock, where), a))
    t.start()
    run("connect", lambda sock: auth.connect(sock, where), b)
    t.join(10)
    a.close(), b.close()
    patched.__exit__(None, None, None)
    return results["accept"], results["connect"]


def test_the_same_secret_passes_both_ways(monkeypatch):
    assert _pair_with_secrets(monkeypatch, "s1", "s1") == (None, None)


def test_during_a_rotation_every_listed_key_is_accepted(monkeypatch):
    """A second key line rolls out first (everyone still calls with the old one), then the order is swapped: a
    process with either order and one with the other key alone still handshake, and credentials pass."""
    assert _pair_with_secrets(monkeypatch, "new\nold", "old") == (None, None)
    assert _pair_with_secrets(monkeypatch, "old\nnew", "new\nold") == (None, None)
    monkeypatch.setenv(auth.ENV, "old")
    old_credential = auth.credential()
    monkeypatch.setenv(auth.ENV, "new\nold")
    assert auth.credential() != old_credential and auth.check_credential(old_credential)
    monkeypatch.setenv(auth.ENV, "new")
    assert not auth.check_credential(old_credential)


def test_a_weak_secret_is_refused_where_it_comes_in():
    auth.check_secret(auth.new_secret(), "TRIDENT_TRANSFER_SECRET")  # 64 hex digits: 256 bits
    auth.check_secret("new-" + auth.new_secret() + "\n" + auth.new_secret(), "f")
    for weak in ("s3cret", "the deployment's secret", "a" * 200, "0123456789abcdef" * 1, "Password1!" * 3):
        with pytest.raises(ValueError, match="at least 128 are needed"):
            auth.check_secret(weak, "TRIDENT_TRANSFER_SECRET")
    with pytest.raises(ValueError, match="key on line 2"):
        auth.check_secret(auth.new_secret() + "\nshort", "f")
    assert all(auth.strength(auth.new_secret()) >= 192 for _ in range(50))  # (256 by its alphabet; zlib bounds it too)


def test_another_deployments_secret_is_refused_by_both_ends(monkeypatch):
    accept_error, connect_error = _pair_with_secrets(monkeypatch, "s1", "s2")
    assert isinstance(accept_error, auth.NotAuthenticated) and "did not prove" in str(accept_error)
    assert isinstance(connect_error, auth.NotAuthenticated)


def test_a_connector_that_is_not_a_stage_socket_is_refused():
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 17)
    with pytest.raises(auth.NotAuthenticated, match="not a Trident stage socket"):
        auth.connect(b, auth.identity("/the/socket"))
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
    from trident.core.errors import ForgedRecord
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

    from trident.supervisor.processes import remove_direct_socket
    from trident.core.protocol import WORKER_FILE
    from trident.core.stagecall.server import DIR_PREFIX, SOCKET_NAME

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


def test_serve_and_a_joining_worker_refuse_a_weak_secret(tmp_path):
    import os
    import subprocess
    import sys

    from trident.core.config import ServeSettings
    from trident.supervisor import Launcher
    from trident.supervisor.startup import StartupError

    with pytest.raises(StartupError, match="transfer_secret: the deployment secret's key on line 1 has about"):
        Launcher(ServeSettings(workspace=str(tmp_path), transfer_secret="correct horse"))
    env = dict(os.environ, **{auth.ENV: "correct horse battery"})
    done = subprocess.run([sys.executable, "-m", "trident.cli", "worker", "prefill", "--model", str(tmp_path),
                           "--join", "http://127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "TRIDENT_TRANSFER_SECRET: the deployment secret's key on line 1" in done.stderr, \
        done.stderr[-500:]


def _sessions(accept_where: bytes, connect_where: bytes):
    """A handshake over a socket pair, the acceptor naming itself ``accept_where``, the connector asking for
    ``connect_where``: (acceptor's session or error, connector's session or error, the pair)."""
    a, b = socket.socketpair()
    out: dict = {}

    def run(name, fn, sock):
        try:
            out[name] = fn(sock)
        except auth.NotAuthenticated as e:
            out[name] = e
            sock.close()

    t = threading.Thread(target=run, args=("accept", lambda s: auth.accept(s, accept_where), a))
    t.start()
    run("connect", lambda s: auth.connect(s, connect_where), b)
    t.join(10)
    return out["accept"], out["connect"], (a, b)


def test_a_connection_relayed_to_another_socket_fails_the_handshake():
    """The proofs name the socket the connector meant (its worker file's address): a relay that hands a connection
    meant for one worker to another (or a socket posing as one it is not) fails on both ends."""
    accepted, connected, pair = _sessions(auth.identity(("10.0.0.5", 4100)), auth.identity(("10.0.0.6", 4100)))
    assert isinstance(accepted, auth.NotAuthenticated) and isinstance(connected, auth.NotAuthenticated)
    for s in pair:
        s.close()


def test_every_frame_after_the_handshake_is_sealed_in_order():
    """After the handshake each side's frames are sealed under keys of the connection: readable by the other end
    alone, and one altered, replayed, dropped or sent by a third party (who saw the handshake) fails to open."""
    from trident.core.errors import MalformedRecord

    where = auth.identity(("10.0.0.5", 4100))
    accepted, connected, pair = _sessions(where, where)
    assert isinstance(accepted, auth.Session) and isinstance(connected, auth.Session)
    first, second = connected.seal(b"a prompt, an image"), connected.seal(b"the next call")
    assert b"a prompt" not in first
    assert accepted.open(first) == b"a prompt, an image"
    with pytest.raises(MalformedRecord):
        accepted.open(first)  # a replay of the first: not the next frame
    tampered = bytearray(second)
    tampered[3] ^= 1
    with pytest.raises(MalformedRecord):
        accepted.open(bytes(tampered))
    assert accepted.open(second) == b"the next call"
    assert connected.open(accepted.seal(b"the answer")) == b"the answer"  # (each direction its own key)
    with pytest.raises(MalformedRecord):
        connected.open(connected.seal(b"my own frame, reflected back"))
    for s in pair:
        s.close()


def test_a_frame_over_the_deployment_s_media_limits_ends_the_connection_before_its_body(monkeypatch):
    """A stage frame's size is bounded by what one call may carry: the deployment's media limits
    (``TRIDENT_MEDIA_LIMITS``, as the head hands them on) plus FRAME_ALLOWANCE. A larger one, even from a peer holding
    the secret, is refused from its 4-byte header, with nothing of its body read; and the largest request the default
    limits allow fits (every item at its largest, and the prompt)."""
    import socket
    import struct

    from trident.core.config import MEDIA_LIMITS_ENV, MediaLimits
    from trident.core.errors import MalformedRecord
    from trident.core.stagecall import frames

    MiB = 1 << 20
    frames.frame_limit.cache_clear()
    try:
        assert frames.frame_limit() == MediaLimits().request_bytes + frames.FRAME_ALLOWANCE > 1 << 30
        small = MediaLimits(max_images=2, max_bytes=MiB, max_videos=1, video_max_bytes=3 * MiB, max_audios=1,
                            audio_max_bytes=MiB)
        monkeypatch.setenv(MEDIA_LIMITS_ENV, small.model_dump_json())
        frames.frame_limit.cache_clear()
        limit = frames.frame_limit()
        assert limit == 6 * MiB + frames.FRAME_ALLOWANCE
        a, b = socket.socketpair()
        with a, b:
            a.sendall(struct.pack("!I", limit + 1))  # (and no body: a read of it would block)
            b.settimeout(5)
            with pytest.raises(MalformedRecord, match=f"a stage frame of {limit + 1} bytes; at most {limit}"):
                frames.recv_message(b, session=None)
    finally:
        frames.frame_limit.cache_clear()


def test_a_stage_model_s_stub_takes_the_frame_limit_the_head_hands_on_and_imports_no_settings():
    """The head hands its frame limit to the processes it starts (``TRIDENT_FRAME_LIMIT``, :func:`frames.limit_for` its
    media limits): a stage model's stub takes it as given, and imports nothing of the settings (pydantic: a third of
    a CPU second of each stub's start)."""
    import os
    import subprocess
    import sys

    from trident.core.config import MediaLimits
    from trident.core.stagecall import frames

    limit = frames.limit_for(MediaLimits(max_images=2))
    assert limit == 2 * MediaLimits().max_bytes + 4 * (64 << 20) + 8 * (32 << 20) + frames.FRAME_ALLOWANCE
    code = ("import sys, types; sys.modules['triton_python_backend_utils'] = types.ModuleType('pb_utils'); "
            "import trident.in_triton.proxy_model; from trident.core.stagecall import frames; "
            "print(frames.frame_limit(), sorted(k for k in ('pydantic', 'trident.core.config') if k in sys.modules))")
    env = dict(os.environ, **{frames.FRAME_LIMIT_ENV: str(limit)})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split(maxsplit=1) == [str(limit), "[]\n"]
