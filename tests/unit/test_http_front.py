"""The bounded front of Triton's HTTP port (supervisor/http_front.py) before an upstream on a Unix socket that writes
down each request as it arrived on the wire (its chunks included) and answers as Triton would. The live check
against Triton itself (the chunked request that ended Triton 2.51) is tests/e2e/test_trust.py's."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time

import pytest
import requests

from trident.core.config import MediaLimits, MiB
from trident.supervisor.entry_credential import CredentialForEntries
from trident.supervisor.http_front import PIECE, TEXT_ALLOWANCE, HttpFront, Route, max_body_bytes
from trident.supervisor.startup import StartupError
from trident.core.netutil import free_ports

LIMIT = 8 * MiB
CREDENTIAL = "c" * 64


class Upstream:
    """A Unix-socket HTTP/1.1 server: ``/stream`` answers three events, the second once :attr:`go` is set;
    ``/bad-json`` answers as Triton 2.51 answers a body that is not JSON; anything else, 200 with what it read."""

    def __init__(self, path) -> None:
        self.path = path
        self.seen: list[dict] = []
        self.go = threading.Event()
        self.quiet_closed: list[tuple[float, bytes]] = []  # when the front closed a /quiet connection, and what came
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._answer(conn)
        except (OSError, ValueError):  # (a request cut off by the front)
            pass

    def _answer(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        with conn, reader:
            while True:
                line = reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    k, v = line.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                chunks, body = [], b""
                if headers.get("transfer-encoding") == "chunked":
                    while (size := int(reader.readline().split(b";")[0], 16)) > 0:
                        chunks.append(size)
                        body += reader.read(size)
                        reader.readline()
                    reader.readline()
                else:
                    body = reader.read(int(headers.get("content-length", 0)))
                self.seen.append({"target": target, "headers": headers, "chunks": chunks, "body": body})
                if target == "/stream":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(3):
                        if i == 1:
                            self.go.wait(10)
                        event = b"data: {\"n\": %d}\n\n" % i
                        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                    conn.sendall(b"0\r\n\r\n")
                    continue
                if target == "/quiet":  # one event, then nothing until the front closes the connection (a long prefill)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                                 b"\r\n10\r\ndata: {\"n\": 0}\n\n\r\n")
                    conn.settimeout(30)
                    rest = reader.read(1)  # (b"" when the front closed it)
                    self.quiet_closed.append((time.monotonic(), rest))
                    return
                if target == "/dies":  # (as a Triton killed mid-stream)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                                 b"\r\n10\r\ndata: {\"n\": 0}\n\n\r\n")
                    return
                if target == "/bad-json":
                    status, answer = b"500 Internal Server Error", b'{"error":"failed to parse the request JSON buffer: x"}'
                elif target == "/unhealthy-stub":  # (Triton 2.51's generate, when the stub missed its health window)
                    status, answer = b"400 Bad Request", b'{"error":"Stub process \'epd_0_0\' is not healthy."}'
                elif target == "/bad-request":
                    status, answer = b"400 Bad Request", b'{"error":"video 0 could not be decoded as a video"}'
                else:
                    status, answer = b"200 OK", json.dumps({"bytes": len(body)}).encode()
                conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, len(answer), answer))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front")
    upstream = Upstream(folder / "http.sock")
    port, gone = free_ports(2)
    front = HttpFront([Route("HTTP", "127.0.0.1", port, folder / "http.sock"),
                       Route("metrics", "127.0.0.1", gone, folder / "nothing.sock")], LIMIT,
                      CredentialForEntries(frozenset({"e_p_d"}), CREDENTIAL, "trident_stage_key"))
    front.start()
    yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gone}", upstream
    front.stop()
    upstream.close()


def _raw(url: str, head: bytes, body_parts=(), read_until_close=True) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
            if not read_until_close and b"\r\n\r\n" in answer:
                break
        return answer


def test_an_entry_model_s_inference_requests_alone_carry_the_credential(served):
    """An entry model's inference request reaches Triton with the server's credential as a request parameter (a
    Triton ensemble forwards it to its steps), in place of the client's: a generate request's top-level key, an
    infer request's ``parameters`` (before its binary tensors too); every other request passes as it came."""
    url, _, upstream = served
    mine = {"trident_stage_key": "mine", "other": 1}
    for path in ("/v2/models/e_p_d/generate", "/v2/models/e_p_d/generate_stream", "/v2/models/e_p_d/versions/1/generate"):
        assert requests.post(url + path, json={"text_input": "x", **mine}, timeout=10).status_code == 200
        assert json.loads(upstream.seen[-1]["body"]) == {"text_input": "x", "trident_stage_key": CREDENTIAL, "other": 1}
    for path in ("/v2/models/e_p_d/infer", "/v2/models/e_p_d/infer?x=1"):
        for given in ({"inputs": []}, {"inputs": [], "parameters": mine}):
            assert requests.post(url + path, json=given, timeout=10).status_code == 200
            assert json.loads(upstream.seen[-1]["body"])["parameters"] == \
                {**given.get("parameters", {}), "trident_stage_key": CREDENTIAL}, (path, given)
    head, tail = json.dumps({"inputs": [{"name": "x", "parameters": {"binary_data_size": 4}}]}).encode(), b"\x00\xff\x01\x02"
    assert requests.post(url + "/v2/models/e_p_d/infer", data=head + tail, timeout=10,
                         headers={"Inference-Header-Content-Length": str(len(head))}).status_code == 200
    seen = upstream.seen[-1]
    size = int(seen["headers"]["inference-header-content-length"])
    assert json.loads(seen["body"][:size])["parameters"] == {"trident_stage_key": CREDENTIAL}
    assert seen["body"][size:] == tail
    for path, body in (("/v2/models/encode/infer", b'{"inputs": [], "parameters": {"trident_stage_key": "mine"}}'),
                       ("/v2/models/e_p_d/config", b"{}"), ("/v2/models/e_p_d/infer/extra", b"{}"),
                       ("/v2/models/e_p_d%2F/infer", b"{}"), ("/v2/models/e_p_d/infer", b"[1, 2]"),
                       ("/v2/models/e_p_d/generate", b"not json")):
        assert requests.post(url + path, data=body, timeout=10).status_code == 200
        assert upstream.seen[-1]["body"] == body, path


def test_many_small_chunks_reach_triton_as_a_few_large_ones(served):
    url, _, upstream = served
    n = 2_000_000  # the request that ended Triton 2.51, 12 MB on the wire
    head = b"POST /v2/models/epd/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    answer = _raw(url, head, [b"1\r\na\r\n" * 100_000] * (n // 100_000) + [b"0\r\n\r\n"])
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"bytes": 2000000}')
    seen = upstream.seen[-1]
    assert sum(seen["chunks"]) == n and len(seen["chunks"]) <= n // PIECE + 1
    assert all(size >= PIECE for size in seen["chunks"][:-1])


def test_a_body_over_the_limit_is_refused_413_before_triton_sees_it(served):
    url, _, upstream = served
    before = len(upstream.seen)
    declared = requests.post(f"{url}/v2/repository/index", data=b"x" * (LIMIT + 1), timeout=20)
    assert declared.status_code == 413 and f"larger than {LIMIT} bytes" in declared.json()["error"]
    chunked = requests.post(f"{url}/v2/repository/index", data=iter([b"x" * MiB] * 9), timeout=20)
    assert chunked.status_code == 413
    assert len(upstream.seen) == before
    # (a body at the limit passes)
    assert requests.post(f"{url}/v2/repository/index", data=b"x" * LIMIT, timeout=20).json() == {"bytes": LIMIT}


def test_a_compressed_body_reaches_triton_inflated_and_bounded(served):
    url, _, upstream = served
    body = json.dumps({"ready": True}).encode() * 1000
    ok = requests.post(f"{url}/v2/repository/index", data=gzip.compress(body), headers={"Content-Encoding": "gzip"},
                       timeout=20)
    assert ok.json() == {"bytes": len(body)}
    assert upstream.seen[-1]["body"] == body and "content-encoding" not in upstream.seen[-1]["headers"]
    bomb = gzip.compress(b"\0" * (LIMIT + 1))  # (about 8 KiB)
    refused = requests.post(f"{url}/v2/repository/index", data=bomb, headers={"Content-Encoding": "gzip"}, timeout=20)
    assert refused.status_code == 413


def test_a_stream_is_passed_on_event_by_event(served):
    url, _, upstream = served
    upstream.go.clear()
    with requests.post(f"{url}/stream", data=b"{}", stream=True, timeout=20) as answer:
        events = answer.iter_lines()
        assert answer.status_code == 200 and next(events) == b'data: {"n": 0}'  # (before the upstream goes on)
        upstream.go.set()
        assert [e for e in events if e] == [b'data: {"n": 1}', b'data: {"n": 2}']


def test_an_answer_triton_breaks_off_is_cut_off_never_ended_as_whole(served):
    url, _, _ = served
    with requests.post(f"{url}/dies", data=b"{}", stream=True, timeout=20) as answer:
        events = answer.iter_lines()
        assert next(events) == b'data: {"n": 0}'
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            list(events)


def test_a_client_that_goes_away_closes_its_connection_to_triton_at_once(served):
    """Also while Triton writes nothing (a prefill, the stage calls before the first token): Triton learns that the
    client left when the client does, not at its next write, and cancels the request."""
    url, _, upstream = served
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /quiet HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        answer = b""
        while b'data: {"n": 0}' not in answer:
            answer += s.recv(65536)
        left = time.monotonic()
    deadline = time.monotonic() + 5
    while not upstream.quiet_closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream.quiet_closed, "the front kept Triton's connection open after its client left"
    closed_at, rest = upstream.quiet_closed[-1]
    assert rest == b"" and closed_at - left < 0.5


def test_triton_s_json_errors_are_the_client_s_400(served):
    url, _, _ = served
    answer = requests.post(f"{url}/bad-json", data=b"aaaa", timeout=20)
    assert answer.status_code == 400 and answer.json()["error"].startswith("failed to parse the request JSON")


def test_a_stub_that_missed_its_health_window_is_a_503_to_try_again_not_the_client_s_400(served):
    url, _, _ = served
    answer = requests.post(f"{url}/unhealthy-stub", data=b"{}", timeout=20)
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
    assert answer.json()["error"] == "Stub process 'epd_0_0' is not healthy."
    answer = requests.post(f"{url}/bad-request", data=b"{}", timeout=20)  # (the client's own error stays its 400)
    assert answer.status_code == 400 and "Retry-After" not in answer.headers
    assert answer.json()["error"] == "video 0 could not be decoded as a video"


def test_expect_100_continue_is_answered(served):
    url, _, _ = served
    head = (b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n")
    t0 = time.monotonic()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head)
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(b"abcd")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"bytes": 4}') and time.monotonic() - t0 < 1


def test_without_triton_every_request_is_a_503(served):
    _, gone, _ = served
    answer = requests.get(f"{gone}/metrics", timeout=20)
    assert answer.status_code == 503 and "Triton is not answering" in answer.json()["error"]


def test_a_taken_port_is_named(served, tmp_path):
    url, _, _ = served
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(StartupError, match=f"HTTP port 127.0.0.1:{port}"):
        HttpFront([Route("HTTP", "127.0.0.1", port, tmp_path / "x.sock")], LIMIT).start()


def test_the_limit_is_what_the_media_limits_let_one_request_carry():
    media = MediaLimits(max_images=2, max_bytes=3 * MiB, max_videos=1, video_max_bytes=6 * MiB, max_audios=1,
                        audio_max_bytes=3 * MiB)
    assert max_body_bytes(media) == 20 * MiB + TEXT_ALLOWANCE  # (2*3 + 6 + 3 MiB, base64)
