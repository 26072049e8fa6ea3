"""No request lost when a stage worker dies (shared by tests/e2e/test_migration.py, the hf engine, and
test_vllm_migration.py): E/P/D and EP/D with two decode instances, eight streams at once (gRPC and OpenAI), and the
decode worker that serves some of them killed with SIGKILL mid-stream. Every stream ends whole, with the text it gets
uninterrupted (greedy, and two seeded samples), and the migrations are counted (Dynamo's request-migration check).
Past ``scheduling.migration_limit`` the request ends with today's clean error."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

NAME = "demo"
LONG = {"max_tokens": 240, "temperature": 0, "ignore_eos": True}
# a stream that is still going when its decode worker is killed, however loaded the machine (160 tokens ran out
# before the kill once, in CI): it ends with the kill
UNENDING = {**LONG, "max_tokens": 3000}
PROMPTS = [f"USER: Tell me story number {i} about the sea, please. ASSISTANT:" for i in range(8)]
SEEDED = {6: 1006, 7: 1007}  # these sample (temperature 0.9) with a seed: the move must continue them exactly too


def _params(i: int) -> dict:
    return {**LONG, "temperature": 0.9, "seed": SEEDED[i]} if i in SEEDED else LONG


def migration_server(pool, model: str, engine: str, workspace, extra: list[str]):
    """The module's server (from the lane's ``pool``, so that no other server of the lane runs beside it): E/P/D and
    EP/D, two decode instances, every prompt prefilled by the prefill stage (its KV crosses to the decode)."""
    from .served import Server

    def start():
        srv = Server(model, workspace, modes=["e_p_d", "ep_d"], extra=["--served-model-name", NAME, *extra],
                     config={"instances": {"decode": 2}, "scheduling": {"local_prefill_tokens": 0}}).started(600)
        srv.engine = engine
        return srv

    return pool.get(("migration", engine), start, lambda srv: srv.stop())


def _migrations(server) -> dict:
    return {labels: v for (name, labels), v in server.metrics("trident_migrations").items() if name.endswith("_total")}


def _decoding(server, mode: str) -> dict[str, float]:
    """Each decode instance's streams of ``mode`` in flight, as its stage model last published them (every second)."""
    out = {}
    for (_name, labels), value in server.metrics("trident_stage_inflight").items():
        found = dict(labels)
        if found.get("mode") == mode and found.get("stage") == "decode":
            out[found["instance"]] = value
    return out


def _decode_idle(server, mode: str) -> None:
    """Until no decode instance shows a stream of ``mode`` in flight: the gauge, published every second, no longer
    shows an earlier pass's streams (a stream's first text comes from the prefill, before its decode starts, so a
    stale gauge would name an instance that serves none of the next streams)."""
    deadline = time.monotonic() + 30
    while any(_decoding(server, mode).values()):
        assert time.monotonic() < deadline, f"decode streams of {mode} still in flight: {_decoding(server, mode)}"
        time.sleep(0.05)


def _serving_decode(server, mode: str) -> str:
    """A decode instance with streams of ``mode`` in flight."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for instance, value in _decoding(server, mode).items():
            if value > 0:
                return instance
        time.sleep(0.05)
    raise AssertionError("no decode instance has a stream in flight")


def _openai_stream(server, mode: str, prompt: str, first: threading.Event, params: dict = LONG) -> str:
    import openai

    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=300)
    text = ""
    for chunk in client.completions.create(model=f"{NAME}:{mode}", prompt=prompt, stream=True,
                                           max_tokens=params["max_tokens"], temperature=params["temperature"],
                                           seed=params.get("seed"), extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            first.set()
    return text


def _grpc_stream(server, mode: str, prompt: str, first: threading.Event, params: dict = LONG) -> str:
    """A gRPC stream's text, as support.grpc_generate reads it, ``first`` set at its first text; an error raised."""
    import queue

    import tritonclient.grpc as grpcclient

    from .clients import _grpc_inputs, entry_inputs

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    text = ""
    try:
        client.async_stream_infer(mode, _grpc_inputs(grpcclient, {n: (a, d) for n, a, d in
                                                                   entry_inputs(prompt, [], params, True)}),
                                  enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=300)
            if error is not None:
                raise error
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                text += out.reshape(-1)[0].decode()
                first.set()
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return text
    finally:
        client.stop_stream()
        client.close()


def check_no_request_lost(server, mode: str) -> None:
    def client(i: int):
        return _openai_stream if i % 2 else _grpc_stream

    # what each stream gets uninterrupted, through its own client (greedy; the last two seeded samples), all at once
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        expected = dict(zip(PROMPTS, pool.map(lambda i: client(i)(server, mode, PROMPTS[i], threading.Event(),
                                                                  _params(i)), range(len(PROMPTS)))))
    before = _migrations(server)
    _decode_idle(server, mode)
    results: dict = {}
    firsts = [threading.Event() for _ in PROMPTS]

    def run(i: int, prompt: str) -> None:
        try:
            results[prompt] = client(i)(server, mode, prompt, firsts[i], _params(i))
        except Exception as e:  # noqa: BLE001 - what the client got
            results[prompt] = e
        finally:
            firsts[i].set()

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(120)
    victim = _serving_decode(server, mode)
    pid, folder = server.worker_pid(victim), server.socket_folders()[victim]
    if server.engine == "vllm":  # (its engine core's torch.distributed file: in the worker's folder, not in /tmp)
        assert any(name.startswith("vllm_dist_") for name in os.listdir(folder)), os.listdir(folder)
    os.killpg(os.getpgid(pid), signal.SIGKILL)  # (the worker and, on vllm, its engine's processes)
    for t in threads:
        t.join(300)
    wrong = {p: r for p, r in results.items() if r != expected[p]}
    assert not wrong, {p: (str(r)[:300], expected[p][:60]) for p, r in wrong.items()}
    after = _migrations(server)
    moved = sum(after.values()) - sum(before.values())
    assert moved >= 1, (before, after)
    assert any(dict(labels).get("stage") == "decode" for labels in after)
    print(f"{server.engine} {mode}: {moved:.0f} stream(s) moved after {victim} was killed")
    _wait_back(server, victim, pid)
    assert not os.path.exists(folder)  # (removed by the head: the killed worker could not)


def _wait_back(server, name: str, pid: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if server.ready(name) and server.worker_pid(name) != pid:
            return
        time.sleep(0.3)
    raise AssertionError(f"{name} did not come back")


def check_the_limit(server) -> None:
    """``scheduling.migration_limit: 0`` (an entry model's config override): a stream whose decode worker is killed
    ends with today's 503 naming the instance, never a success."""
    import tritonclient.http as httpclient

    admin = httpclient.InferenceServerClient(server.http)
    config = json.loads(json.dumps(admin.get_model_config("e_p_d")))
    config.setdefault("parameters", {})["scheduler"] = {"string_value": json.dumps({"migration_limit": 0})}
    admin.load_model("e_p_d", config=json.dumps(config), headers={"triton-access-token": server.token})
    try:
        first = threading.Event()
        outcome: dict = {}

        def stream() -> None:
            try:
                outcome["text"] = _grpc_stream(server, "e_p_d", PROMPTS[0], first, UNENDING)
            except Exception as e:  # noqa: BLE001 - what the client gets
                outcome["error"] = str(e)
            first.set()

        _decode_idle(server, "e_p_d")
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120)
        victim = _serving_decode(server, "e_p_d")
        pid = server.worker_pid(victim)
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        t.join(120)
        assert "error" in outcome, outcome
        assert "Unavailable" in outcome["error"] and "stopped before the end of the answer" in outcome["error"], outcome
        assert "scheduling.migration_limit" in outcome["error"]
        _wait_back(server, victim, pid)
    finally:
        admin.load_model("e_p_d", headers={"triton-access-token": server.token})  # (its own config again)
        admin.close()
