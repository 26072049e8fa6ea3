"""vLLM's NIXL side channel sealed (worker/engines/vllm_side_channel.py), run in the vLLM environment: vLLM's own listener
loop (``NixlBaseConnectorScheduler._nixl_handshake_listener``) serves metadata on a real ZeroMQ socket; a client
without the secret (vLLM's plain ``get_meta_msg``, a malformed message, another deployment's sealed request) gets
nothing and does not end the listener (nor does a request vLLM's loop fails on), and a consumer of this deployment (vLLM's REQ socket through the sealed
``zmq_ctx``) gets the metadata. On the code before, the plain request got the memory keys and the malformed one
ended the listener for good."""

from __future__ import annotations

import os
import subprocess

from support import vllm_python

SCRIPT = r'''
import os, sys, threading, time
import msgspec, zmq
from trident.worker.engines import vllm_side_channel
from trident.core import auth
from trident.core.netutil import free_ports

vllm_side_channel.close()
vllm_side_channel.close()  # (idempotent)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker

port = free_ports(1)[0]
ready, stop = threading.Event(), threading.Event()
listener = threading.Thread(target=base_scheduler.NixlBaseConnectorScheduler._nixl_handshake_listener,
                            args=({(0, 0): b"AGENT-METADATA-WITH-MEMORY-KEYS"}, ready, stop, "127.0.0.1", port),
                            daemon=True)
listener.start()
ready.wait(10)
path = f"tcp://127.0.0.1:{port}"

def plain(message, timeout_ms=1000):
    """What a client without the secret gets for ``message`` (None: no answer)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(path)
    sock.send(message)
    try:
        return sock.recv_multipart()
    except zmq.Again:
        return None
    finally:
        ctx.destroy(linger=0)

def sealed(rank=0):
    with base_worker.zmq_ctx(zmq.REQ, path) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 5000 if rank == 0 else 1000)
        sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, rank)))
        try:
            return sock.recv_multipart()
        except zmq.Again:
            return None

print("plain", plain(msgspec.msgpack.encode((b"get_meta_msg", 0, 0))))
print("malformed", plain(b"\xc1\xff not msgpack"))
print("unknown-rank", plain(msgspec.msgpack.encode((b"get_meta_msg", 7, 7))))
good = os.environ[auth.ENV]
os.environ[auth.ENV] = auth.new_secret()  # another deployment's seal
forged = auth.sign(msgspec.msgpack.encode((os.urandom(16), time.time(), msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))))
os.environ[auth.ENV] = good
print("other-deployment", plain(forged))
stale = auth.sign(msgspec.msgpack.encode((os.urandom(16), time.time() - 3600, msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))))
print("stale", plain(stale))
print("sealed-unknown-rank", sealed(7))  # (one of ours, but vLLM's loop fails on it: the listener starts again)
payload, clock = sealed()
print("sealed", payload, type(msgspec.msgpack.decode(clock)).__name__)
print("alive", listener.is_alive())
stop.set()
listener.join(5)
'''


def test_only_the_deployment_s_consumers_get_the_kv_agent_metadata():
    done = subprocess.run([vllm_python(), "-c", SCRIPT], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                              os.path.join(os.path.dirname(__file__), "..", "..", "server"),
                              os.environ.get("PYTHONPATH")])) ))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["plain"] == "None" and lines["malformed"] == "None" and lines["unknown-rank"] == "None"
    assert lines["other-deployment"] == "None" and lines["stale"] == "None"
    assert lines["sealed-unknown-rank"] == "None"
    assert lines["sealed"] == "b'AGENT-METADATA-WITH-MEMORY-KEYS' float"
    assert lines["alive"] == "True"
    assert "side channel dropped 1 message(s)" in done.stderr  # one line, not one per message
