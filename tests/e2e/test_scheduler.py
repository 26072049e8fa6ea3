"""The BLS scheduler on a real server: encode skipped without images, the embedding cache and encode-once,
routing over two prefill instances, a killed and a joining instance, fallback when a stage is gone.

One server (LLaVA demo, E/P/D with two prefill instances, E/PD and EPD for fallback, a 1 MiB embedding
cache: two LLaVA images) serves the whole module; the tests run in order and the last ones take stages
away. Outputs are always checked against ``model.generate()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import build_reference, cancellable_stream, credential, grpc_generate, http_generate, serving
from support.otlp import Collector

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0}
CACHE_MIB = 1
UNIQUE = 8  # distinct images with the same prompt
CASES = {
    "one-image": [(224, 224, 1)],
    "two-images": [(224, 224, 1), (300, 200, 2)],
    "text-only": [],
    "same-twice": [(224, 224, 7), (224, 224, 7)],
    "fresh": [(224, 224, 50)],
    **{f"unique-{i}": [(224, 224, 100 + i)] for i in range(UNIQUE)},
    **{f"spread-{i}": [(224, 224, 200 + i)] for i in range(4)},
    "traced": [(224, 224, 300)],
    "early": [(224, 224, 400)],
}


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory):
    """(Its spans go over OTLP to a collector of the test's: Triton's own and Trident's, batched for 0.1 s.)"""
    collector = Collector()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with serving(
            demo_models["llava"], tmp_path_factory.mktemp("sched") / "ws", modes=["e_p_d", "e_pd", "epd"],
            extra=["--instances", "prefill=2"],
            config={"embedding_cache_mib": CACHE_MIB, "tracing": {"exporter": "otlp"}},
        ) as srv:
            srv.collector = collector
            yield srv
    collector.close()


@pytest.fixture(scope="module")
def ref(server):
    return build_reference(server.model_path, CASES, NEW_TOKENS)


def _encode(server) -> dict:
    return server.stats(settled=True)["encode"]


def _settled(server, name: str, key: str, want, timeout: float = 5.0) -> dict:
    """Worker stats once ``stats[name][key]`` satisfies ``want`` (a value or a predicate); stats files
    are rewritten every 0.2 s."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats().get(name, {})
        value = stats.get(key)
        if (want(value) if callable(want) else value == want) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def _generate(server, c, mode="e_p_d", stream=True):
    return grpc_generate(server.grpc, mode, c["text"], c["images"], GREEDY, stream=stream).text


def _metric(server, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in server.metrics().items() if n == name and want <= set(ls))


def test_instances_are_named_models_with_their_own_stats(server, admin):
    assert admin.is_model_ready("prefill") and admin.is_model_ready("prefill-2")
    assert {"prefill", "prefill-2", "encode", "decode"} <= set(server.stats())
    assert server.stats()["prefill"]["pid"] != server.stats()["prefill-2"]["pid"]


def test_a_record_replayed_to_a_second_instance_is_refused(server, ref):
    """A record read by ``prefill`` is replayed to ``prefill-2``, which has never seen it: the lease ended with
    the first read, so the second's claim at the encode worker is refused (its regions could hold another request's
    data by then)."""
    import tritonclient.grpc as grpcclient

    from support import drain_kv, stage_output, strings

    c = ref["one-image"]
    record = stage_output(server.grpc, "encode", {"image": strings(*c["images"])})
    inputs = {"text_input": strings(c["text"]), "embedding_meta": strings(record)}
    drain_kv(server.grpc, stage_output(server.grpc, "prefill", inputs))  # the first use, then its KV decoded
    before = server.stats()["prefill-2"]["fetched"]
    from support.clients import _grpc_inputs

    client = grpcclient.InferenceServerClient(server.grpc)
    with pytest.raises(Exception) as info:
        client.infer("prefill-2", _grpc_inputs(grpcclient, inputs), parameters=credential())
    assert str(info.value.status()) == "StatusCode.INVALID_ARGUMENT"
    assert "ReplayedRecord: record of lease" in info.value.message()  # (claimed at the encode worker: refused)
    assert "already used (claimed by a consumer), or its lease has ended" in info.value.message()
    assert server.stats()["prefill-2"]["fetched"] == before  # (a refused read is not counted as fetched)
    assert _generate(server, c) == c["expected"]


def test_one_record_sent_to_two_instances_at_once_is_read_by_one(server, ref):
    """The same embeddings record sent to ``prefill`` and ``prefill-2`` at the same moment: each claims its lease at
    the encode worker before its READ, and the first claim alone is granted, so exactly one prefills and the other is
    refused (a record is good for one read, however many hold it). Without the claim both READs ran while the lease
    was open, and both were served."""
    import tritonclient.grpc as grpcclient

    from support import drain_kv, stage_output, strings
    from support.clients import _grpc_inputs

    c = ref["one-image"]
    before = _encode(server)
    for _ in range(3):  # (three races: whichever instance wins, one answer and one refusal each time)
        record = stage_output(server.grpc, "encode", {"image": strings(*c["images"])})
        inputs = {"text_input": strings(c["text"]), "embedding_meta": strings(record)}
        barrier = threading.Barrier(2)

        def prefill(instance: str):
            client = grpcclient.InferenceServerClient(server.grpc)
            barrier.wait()
            try:
                result = client.infer(instance, _grpc_inputs(grpcclient, inputs), parameters=credential())
                return result.as_numpy("kv_meta").reshape(-1)[0]
            except Exception as e:  # noqa: BLE001 - the refusal, looked at below
                return e
            finally:
                client.close()

        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(prefill, ["prefill", "prefill-2"]))
        served = [o for o in outcomes if isinstance(o, bytes)]
        refused = [o for o in outcomes if not isinstance(o, bytes)]
        assert len(served) == 1 and len(refused) == 1, outcomes
        assert str(refused[0].status()) == "StatusCode.INVALID_ARGUMENT", refused[0]
        assert "ReplayedRecord" in refused[0].message() and "good for one read" in refused[0].message()
        drain_kv(server.grpc, served[0], c["text"])
    after = _settled(server, "encode", "claims_refused", before["claims_refused"] + 3)
    # each refusal came from the encode worker's claim, before any READ (not from the stamp, after one)
    assert after["claims_refused"] - before["claims_refused"] == 3 and after["claimed"] - before["claimed"] == 3, after
    assert _generate(server, c) == c["expected"]


def _trace(collector, trace_id: str, *until: str, timeout: float = 20.0) -> dict[str, list[dict]]:
    """The spans of one trace, by ``<process>/<name>`` (the second prefill instance's as ``prefill``'s; Triton's
    as ``triton``'s), once the spans ``until`` have come (the scheduler's ends after its last response)."""
    def by_name(spans: list[dict]) -> dict[str, list[dict]]:
        named: dict[str, list[dict]] = {}
        for span in spans:
            process = span["service"].removeprefix("trident-")
            named.setdefault(f"{'prefill' if process == 'prefill-2' else process}/{span['name']}", []).append(span)
        return named

    return by_name(collector.trace(trace_id, lambda spans: all(k in by_name(spans) for k in until), timeout))


def _under_triton(server, trace_id: str, parent: str, spans: dict) -> tuple[dict, str]:
    """The trace with Triton's spans once they have come (their batch, up to Triton's 5 s), and the span the
    scheduler's should continue: Triton's span of the entry model, under its ``InferRequest`` under ``parent``; or
    ``parent`` where Triton began a trace of its own (it does not continue every request's header: the scheduler then
    continues the request's parameter)."""
    spans = _trace(server.collector, trace_id, *spans, "triton/InferRequest", "triton/e_p_d", "triton/compute",
                   timeout=8.0)
    if "triton/InferRequest" not in spans:
        return spans, parent
    infer, model = spans["triton/InferRequest"][0], spans["triton/e_p_d"][0]
    assert infer["parent_id"] == parent and model["parent_id"] == infer["span_id"]
    assert spans["triton/compute"][0]["parent_id"] == model["span_id"]
    return spans, model["span_id"]


def test_one_trace_per_request_spans_the_frontend_the_scheduler_and_every_stage_worker(server, ref):
    """OpenTelemetry tracing (OTLP to a collector): a request that carries a ``traceparent`` gets one trace whose spans
    come from the BLS and each stage worker (and Triton's own, where Triton continued the request's header), nested as
    the calls are, with the steps ``make bench-hops`` reads; the
    stages are called straight at their workers (their stubs see nothing of it). Through the OpenAI API, the
    client's ``traceparent`` header is the parent of the frontend's span, and the trace goes on to the stages."""
    import requests

    c = ref["traced"]
    assert any(line.endswith("tracing every request with OpenTelemetry: spans to otlp") for line in server.log)
    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
    traceparent = {"traceparent": f"00-{trace_id}-{caller}-01"}  # (as header and parameter: as the frontend sends it)
    assert grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True, headers=traceparent,
                         parameters=traceparent).text == c["expected"]
    want = {
        "bls-e_p_d": ["request", "execute", "inputs", "call:encode", "call:prefill", "call:decode", "first_send"],
        "encode": ["stage_call", "inputs", "media_decode", "image_preprocess", "vision_tower", "publish",
                   "record_encode", "hand_on", "infer"],
        "prefill": ["stage_call", "await_record", "inputs", "record_decode", "nixl_read", "prefill", "publish",
                    "record_encode", "infer"],
        "decode": ["stage_call", "inputs", "record_decode", "nixl_read", "decode_admit", "decode", "infer_first",
                   "infer"],
    }
    # (each process sends its spans in batches of its own: the trace is whole once every one has come)
    spans = _trace(server.collector, trace_id, *(f"{p}/{s}" for p, names in want.items() for s in names))
    missing = [f"{p}/{s}" for p, names in want.items() for s in names if f"{p}/{s}" not in spans]
    assert not missing and not server.collector.errors, \
        f"spans not written: {missing}; written: {sorted(spans)}; exports not read: {server.collector.errors}"
    assert {k.split("/")[0] for k in spans} - {"triton"} == set(want), sorted(spans)  # (no stage stub's)
    # one tree: the scheduler's span continues Triton's span of its model (which continues the client's) or, where
    # Triton began a trace of its own, the client's; each stage call continues the scheduler's call of it
    request = spans["bls-e_p_d/request"][0]
    spans, joined = _under_triton(server, trace_id, caller, spans)
    assert request["parent_id"] == joined and request["attributes"] == {"mode": "e_p_d"}
    for stage in ("encode", "prefill"):
        assert spans[f"{stage}/stage_call"][0]["parent_id"] == spans[f"bls-e_p_d/call:{stage}"][0]["span_id"], stage
    assert spans["decode/stage_call"][0]["parent_id"] == request["span_id"]
    ids = {s["span_id"] for group in spans.values() for s in group}
    assert all(s["parent_id"] in ids for k, group in spans.items() for s in group
               if k not in ("triton/InferRequest", "bls-e_p_d/request"))
    assert spans["decode/decode"][0]["attributes"] == {"tokens": len(c["ids"])}
    one = {k: (v[0]["start"], v[0]["end"]) for k, v in spans.items()}
    # each stage's work lies inside the BLS's call of it, and the calls follow each other
    for stage in ("encode", "prefill"):
        call, work = one[f"bls-e_p_d/call:{stage}"], one[f"{stage}/infer"]
        assert call[0] <= work[0] <= work[1] <= call[1], stage
    # the prefill call is posted beside the encode call; it runs once the encode worker has handed its record on
    assert one["bls-e_p_d/call:prefill"][0] <= one["prefill/await_record"][0]
    # (the prefill worker may have it before the encode worker's step ends: on 2 cores the writer can be preempted)
    assert one["encode/hand_on"][0] <= one["prefill/await_record"][1] <= one["prefill/infer"][0]
    assert one["encode/hand_on"][1] <= one["bls-e_p_d/call:encode"][1]
    assert one["bls-e_p_d/call:prefill"][1] <= one["decode/infer"][0] <= one["decode/infer_first"][1]
    if _first_text(server, c):  # sent as soon as the prefill returned, before the decode call
        assert one["bls-e_p_d/call:prefill"][1] <= one["bls-e_p_d/first_send"][0]
        assert one["bls-e_p_d/first_send"][1] <= one["bls-e_p_d/call:decode"][0]
    else:
        assert one["decode/infer_first"][1] <= one["bls-e_p_d/first_send"][0]
    assert one["encode/vision_tower"][0] >= one["encode/infer"][0] and one["encode/vision_tower"][1] <= one["encode/infer"][1]

    trace_id = os.urandom(16).hex()
    r = requests.post(f"{server.openai_url}/chat/completions", timeout=60,
                      headers={"traceparent": f"00-{trace_id}-{caller}-01"},
                      json={"model": f"{os.path.basename(server.model_path)}:e_p_d", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    spans = _trace(server.collector, trace_id, "bls-e_p_d/request", "frontend/openai", "decode/stage_call")
    frontend = spans["frontend/openai"][0]
    assert frontend["parent_id"] == caller and frontend["attributes"] == {"endpoint": "chat", "mode": "e_p_d"}
    spans, joined = _under_triton(server, trace_id, frontend["span_id"], spans)
    assert spans["bls-e_p_d/request"][0]["parent_id"] == joined
    assert "decode/stage_call" in spans, sorted(spans)  # (a prompt this short is prefilled on the decode worker)

    # a Triton client's traceparent parameter (Triton continues headers only): the scheduler continues it
    trace_id = os.urandom(16).hex()
    grpc_generate(server.grpc, "e_p_d", "hello", [], {"max_tokens": 2}, stream=False,
                  parameters={"traceparent": f"00-{trace_id}-{caller}-01"})
    spans = _trace(server.collector, trace_id, "bls-e_p_d/request", "decode/infer")
    assert spans["bls-e_p_d/request"][0]["parent_id"] == caller
    assert "triton/InferRequest" not in spans  # (Triton's span of it began a trace of its own)


def _first_text(server, c) -> str:
    """The text of the reference's first token alone (empty: held back until the next one)."""
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(server.model_path).decode(c["ids"][:1], skip_special_tokens=True)
    return "" if text.endswith("\ufffd") else text


def _responses(server, c) -> int:
    """How many responses a stream of the reference's tokens has: one per token that adds text, and the last."""
    from transformers import AutoTokenizer

    from trident.core.output import TextStream

    stream = TextStream(AutoTokenizer.from_pretrained(server.model_path), [])
    deltas = [stream.push(token) for token in c["ids"]]
    return sum(1 for d in deltas[:-1] if d) + 1


def test_first_response_leaves_with_the_prefill(server, ref):
    """E/P/D, streamed: the prefill's kv_meta carries the first token's text, and the entry model sends it as
    soon as the prefill returns, not after the decode call's round trip. The client gets every token's text
    once, in as many responses as the decode alone sends. Not streamed, or with a first token whose text a stop
    string holds back, the decode's own first response is the first."""
    c = ref["early"]
    assert _first_text(server, c), "the reference's first token has no text of its own: pick another case"
    early = {"decision": "first_text_from_prefill", "mode": "e_p_d"}
    before = _metric(server, "trident_decisions_total", **early)
    streamed = grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True)
    assert streamed.text == c["expected"]
    assert streamed.responses == _responses(server, c)
    assert (streamed.finish_reason, streamed.num_output_tokens) == ("length", NEW_TOKENS)
    time.sleep(0.3)
    assert _metric(server, "trident_decisions_total", **early) == before + 1

    assert _generate(server, c, stream=False) == c["expected"]
    held = {**GREEDY, "stop": [_first_text(server, c) + "\u0000"]}  # never matched, but the first text may start it
    assert grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], held, stream=True).text == c["expected"]
    time.sleep(0.3)
    assert _metric(server, "trident_decisions_total", **early) == before + 1


def _handoff(server) -> dict[str, int]:
    """The prefill instances' record inbox counters, summed."""
    stats = server.stats(settled=True)
    keys = ("delivered", "withdrawn", "discarded", "waiting_calls", "early_records")
    return {k: sum(stats[n].get(f"handoff_{k}", 0) for n in ("prefill", "prefill-2") if n in stats) for k in keys}


def _inbox_empty(server, timeout: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while (counts := _handoff(server))["waiting_calls"] or counts["early_records"]:
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)
    return counts


def test_the_encode_worker_hands_its_record_to_the_prefill_worker(server, ref):
    """E/P/D: the BLS posts the prefill call beside the encode call, and the encode worker hands its record straight
    to that prefill worker: one delivery per request, read by the call (nothing discarded or left waiting), the
    reference answer, streamed or not."""
    c = ref["one-image"]
    before = _handoff(server)
    assert _generate(server, c) == c["expected"]
    assert _generate(server, c, stream=False) == c["expected"]
    after = _inbox_empty(server)
    assert after["delivered"] == before["delivered"] + 2 and after["discarded"] == before["discarded"], after
    assert after["withdrawn"] == before["withdrawn"]


def test_a_prompt_short_enough_for_the_decode_worker_is_not_handed_on(server, ref):
    """A prompt the decode worker prefills itself (``scheduling.local_prefill_tokens``): the encode worker keeps its record
    (the BLS gives it to the decode stage), and the BLS withdraws the prefill call it posted, which ends at once.
    An encode that fails (an image that does not decode) withdraws it too: the client gets the encode's 400."""
    c = ref["one-image"]
    prefills = sum(_published(server).values())
    local = _metric(server, "trident_decisions_total", mode="e_p_d", decision="local_prefill")
    before = _handoff(server)
    _reload(server, local_prefill_tokens=4096)  # the prompt and its 576 image rows are shorter
    try:
        assert _generate(server, c) == c["expected"]
    finally:
        _reload(server, local_prefill_tokens=128)
    after = _inbox_empty(server)
    assert after["delivered"] == before["delivered"] and after["withdrawn"] == before["withdrawn"] + 1, after
    assert _metric(server, "trident_decisions_total", mode="e_p_d", decision="local_prefill") == local + 1
    assert sum(_published(server).values()) == prefills  # no prefill ran

    from support import bad_request

    text, images, params, message = bad_request(c, "undecodable image", GREEDY)
    with pytest.raises(Exception, match=message):
        grpc_generate(server.grpc, "e_p_d", text, images, params, stream=True)
    assert _inbox_empty(server)["withdrawn"] == after["withdrawn"] + 1
    assert _generate(server, c) == c["expected"]


def test_a_client_cannot_use_the_record_hand_off_through_triton(server, ref):
    """The hand-off's parameters are the scheduler's: through Triton they are dropped. A prefill call that names a
    token does not wait for a record (it prefills what it brought), and an encode call that names a prefill
    instance hands nothing to it."""
    import tritonclient.grpc as grpcclient

    from support import drain_kv, strings
    from support.clients import _grpc_inputs

    c = ref["one-image"]
    client = grpcclient.InferenceServerClient(server.grpc)
    before = _handoff(server)
    hand_to = json.dumps({"instance": "prefill", "token": "client-token", "above": -1})
    encoded = client.infer("encode", _grpc_inputs(grpcclient, {"image": strings(*c["images"])}),
                           parameters={"trident_hand_to": hand_to, **credential()})
    record = encoded.as_numpy("embedding_meta").reshape(-1)[0]
    assert "handed" not in json.loads(encoded.as_numpy("encode_report").reshape(-1)[0])
    start = time.monotonic()
    inputs = {"text_input": strings(c["text"]), "embedding_meta": strings(record)}
    kv = client.infer("prefill", _grpc_inputs(grpcclient, inputs), parameters={"trident_await_record": "client-token", **credential()})
    assert time.monotonic() - start < 10  # it did not wait (the backstop is 300 s)
    drain_kv(server.grpc, kv.as_numpy("kv_meta").reshape(-1)[0])
    assert _inbox_empty(server) == before


def test_text_only_skips_the_vision_tower(server, ref):
    c = ref["text-only"]
    runs = _encode(server)["vision_runs"]
    skipped = _metric(server, "trident_decisions_total", decision="skip_encode")
    for mode in ("e_p_d", "e_pd"):
        assert _generate(server, c, mode) == c["expected"]
        status, body = http_generate(server.http, mode, c["text"], [], GREEDY)
        assert status == 200 and body["text_output"] == c["expected"]
    time.sleep(0.3)
    assert _encode(server)["vision_runs"] == runs
    assert _metric(server, "trident_decisions_total", decision="skip_encode") == skipped + 4


def test_eight_concurrent_requests_with_one_new_image_encode_it_once(server, ref):
    c = ref["fresh"]
    before = _encode(server)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: _generate(server, c), range(8)))
    assert texts == [c["expected"]] * 8
    after = _settled(server, "encode", "published", before["published"] + 8)
    assert after["vision_runs"] - before["vision_runs"] == 1
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["cache_misses"] - before["cache_misses"] == 1
    # the other seven waited on that encode or found it cached
    saved = (after["encodes_shared"] - before["encodes_shared"]) + (after["cache_hits"] - before["cache_hits"])
    assert saved == 7


def test_the_same_image_twice_in_one_request_is_encoded_once(server, ref):
    c = ref["same-twice"]
    before = _encode(server)
    assert _generate(server, c) == c["expected"]
    after = _settled(server, "encode", "published", before["published"] + 1)
    assert after["vision_runs"] - before["vision_runs"] == 1
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["encodes_shared"] - before["encodes_shared"] == 1


def test_a_repeated_image_is_a_cache_hit(server, ref):
    c = ref["one-image"]
    assert _generate(server, c) == c["expected"]
    before = _settled(server, "encode", "leases", 0)
    hits = _metric(server, "trident_embedding_cache_hits_total")
    for mode in ("e_p_d", "e_pd"):
        assert _generate(server, c, mode) == c["expected"]
    after = _settled(server, "encode", "published", before["published"] + 2)
    assert after["vision_runs"] == before["vision_runs"]
    assert after["cache_hits"] - before["cache_hits"] == 2
    assert _metric(server, "trident_embedding_cache_hits_total") == hits + 2
    # a cached image next to a new one: still exact
    assert _generate(server, ref["two-images"]) == ref["two-images"]["expected"]


def test_distinct_images_never_share_an_entry_and_eviction_keeps_the_cap(server, ref):
    cap = CACHE_MIB << 20
    cases = [ref[f"unique-{i}"] for i in range(UNIQUE)]
    assert len({c["text"] for c in cases}) == 1  # the same prompt, different images
    before = _encode(server)
    for c in cases + cases[::-1]:  # then again, the last ones from the cache
        assert _generate(server, c) == c["expected"]
        assert _encode(server)["cache_bytes"] <= cap
    after = _settled(server, "encode", "leases", 0)
    assert after["cache_misses"] - before["cache_misses"] >= UNIQUE
    assert after["cache_evictions"] - before["cache_evictions"] >= UNIQUE - 2
    assert 0 < after["cache_bytes"] <= cap and after["cache_entries"] <= 2
    assert after["send_regions_in_use"] == after["cache_entries"]  # nothing but the cache is held


def _reload(server, mode: str = "e_p_d", **scheduling) -> None:
    """Change an entry model's scheduler settings while serving (Triton's config override: a ``scheduler`` parameter
    naming the fields to change; its config as served names none)."""
    import tritonclient.http as httpclient

    admin = httpclient.InferenceServerClient(server.http)
    try:
        config = admin.get_model_config(mode)
        assert set(config["parameters"]) <= {"mode", "scheduler"}
        config["parameters"]["scheduler"] = {"string_value": json.dumps(scheduling)}
        admin.load_model(mode, config=json.dumps(config), headers={"triton-access-token": server.token})
    finally:
        admin.close()


def test_embedding_cache_scope_request_encodes_each_request_s_image_for_it_and_keeps_none(server, ref):
    """``scheduling.embedding_cache_scope: request`` (here as a config override of e_p_d): an image already in the
    cache is encoded again for each request, exactly, and none of those encodes is kept (no hit for the next
    request, the cache's entries as they were, every region freed once read); e_pd, still shared, hits it."""
    c = ref["one-image"]
    assert _generate(server, c) == c["expected"]  # (in the cache now)
    _reload(server, "e_p_d", embedding_cache_scope="request")
    try:
        before = _settled(server, "encode", "leases", 0)
        for _ in range(2):
            assert _generate(server, c) == c["expected"]
        after = _settled(server, "encode", "leases", 0)
        assert after["published"] - before["published"] == 2
        assert (after["vision_runs"] - before["vision_runs"], after["cache_misses"] - before["cache_misses"]) == (2, 2)
        assert after["cache_hits"] == before["cache_hits"] and after["cache_entries"] == before["cache_entries"]
        assert after["send_regions_in_use"] == after["cache_entries"]  # nothing but the cache is held
        assert _generate(server, c, "e_pd") == c["expected"]
        assert _settled(server, "encode", "cache_hits", before["cache_hits"] + 1)["cache_hits"] == before["cache_hits"] + 1
    finally:
        _reload(server, "e_p_d", embedding_cache_scope="shared")


def test_local_encode_runs_few_images_on_a_worker_that_encodes_and_prefills(server, ref):
    c = ref["one-image"]
    _reload(server, "e_pd", local_encode_images=1)
    try:
        runs = _settled(server, "encode", "leases", 0)["published"]
        local = _metric(server, "trident_requests_total", mode="e_pd", path="generate")
        assert _generate(server, c, "e_pd") == c["expected"]  # one image: on the generate worker
        assert _generate(server, ref["two-images"], "e_pd") == ref["two-images"]["expected"]  # two: encode stage
        assert _metric(server, "trident_requests_total", mode="e_pd", path="generate") == local + 1
        assert _metric(server, "trident_decisions_total", mode="e_pd", decision="local_encode") >= 1
        assert _settled(server, "encode", "published", runs + 1)["published"] == runs + 1
    finally:
        _reload(server, "e_pd", local_encode_images=0)


def test_a_cancelled_stream_stops_its_decode_within_a_second(server, ref):
    c = ref["one-image"]
    params = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with cancellable_stream(server.grpc, "e_p_d", c["text"], c["images"], params, timeout=60) as next_response:
        for _ in range(3):
            next_response()
        assert _settled(server, "decode", "decode_active", 1)["decode_active"] == 1
    start = time.monotonic()
    stats = _settled(server, "decode", "decode_active", 0, timeout=5)
    assert stats["decode_active"] == 0 and time.monotonic() - start < 1.0
    assert _generate(server, c) == c["expected"]


def test_a_request_cancelled_during_its_prefill_frees_the_prefill_s_kv_at_once(server, ref):
    """A client gone while its prefill runs, on a request with no early text (not streamed): the BLS still calls
    the decode with the prefill's record, and the decode's stop frees the prefill's region at once, rather than
    the record being dropped and the region waiting for its lease (60 s)."""
    from support.reference import PROMPT

    c = ref["one-image"]
    text = c["text"].replace(PROMPT, "Describe the picture in great detail, every part of it. " * 220)  # ~3k tokens
    before, encoded = _published(server), _encode(server)["published"]
    with cancellable_stream(server.grpc, "e_p_d", text, c["images"], GREEDY, timeout=60, stream=False):
        _settled(server, "encode", "published", encoded + 1, timeout=30)  # the prefill (~0.5 s for this prompt) runs
    deadline = time.monotonic() + 30
    while sum(_published(server).values()) == sum(before.values()):  # the prefill ran and published its KV
        assert time.monotonic() < deadline, "the prefill never published (the cancel came before it)"
        time.sleep(0.05)
    after = _published(server)
    (name,) = [n for n in after if after[n] != before.get(n)]
    start = time.monotonic()
    stats = _settled(server, name, "send_regions_in_use", 0, timeout=5)
    assert stats["send_regions_in_use"] == 0 and stats["leases"] == 0, stats
    assert time.monotonic() - start < 2.0 and stats["expired"] == 0
    assert _generate(server, c) == c["expected"]


def _published(server) -> dict[str, int]:
    stats = server.stats(settled=True)
    return {name: stats[name]["published"] for name in ("prefill", "prefill-2") if name in stats}


def test_least_loaded_spreads_requests_over_both_instances(server, ref):
    """Repeats of one image (affinity would send them all to one instance): one after another, the idle instances
    take turns, exactly; eight at once use both (how many each takes follows how long each holds its calls, which a
    loaded machine varies: the policy's choices under load are unit-tested in test_scheduling.py)."""
    _reload(server, routing="least_loaded")
    try:
        c = ref["one-image"]
        before = _published(server)
        for _ in range(4):
            assert _generate(server, c) == c["expected"]
        time.sleep(0.5)
        after = _published(server)
        assert {name: after[name] - before[name] for name in after} == {"prefill": 2, "prefill-2": 2}
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda _: _generate(server, c), range(8)))
        assert texts == [c["expected"]] * 8
        time.sleep(0.5)
        spread = {name: n - after[name] for name, n in _published(server).items()}
        assert sum(spread.values()) == 8 and min(spread.values()) >= 1, spread
        assert _metric(server, "trident_routed_total", instance="prefill-2", mode="e_p_d") > 0
    finally:
        _reload(server, routing="affinity")


def test_affinity_sends_repeats_of_an_image_to_one_instance(server, ref):
    for case in ("spread-0", "spread-1", "spread-2"):
        c = ref[case]
        assert _generate(server, c) == c["expected"]  # first seen: the least-loaded instance
        time.sleep(0.3)
        before = _published(server)
        for _ in range(4):
            assert _generate(server, c) == c["expected"]
        time.sleep(0.3)
        after = _published(server)
        assert sorted(after[n] - before[n] for n in after) == [0, 4], (case, before, after)


def test_a_killed_prefill_instance_leaves_the_other_serving(server, ref, admin):
    os.kill(server.worker_pid("prefill-2"), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while admin.is_model_ready("prefill-2") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not admin.is_model_ready("prefill-2")
    assert any("worker prefill-2 exited" in line for line in server.log)
    before = _published(server)["prefill"]
    for case in ("spread-0", "spread-1", "spread-2", "unique-0"):  # some had affinity to prefill-2
        assert _generate(server, ref[case]) == ref[case]["expected"]
    assert _settled(server, "prefill", "published", before + 4)["published"] == before + 4
    assert server.proc.poll() is None


def _worker_env() -> dict[str, str]:
    """A worker's environment: the deployment secret, no repository-API token (workers bind through the head)."""
    return {**{k: v for k, v in os.environ.items() if k != "TRIDENT_ACCESS_TOKEN"}, "HF_HUB_OFFLINE": "1"}


def test_a_worker_that_joins_later_gets_traffic(server, ref, admin):
    """It joins while the supervisor has the killed prefill-2 coming back: it takes the next free name, and
    the restarted prefill-2, the joiner and prefill all serve. The restarted prefill-2 is called on its new Unix
    socket; the joiner (bound as from elsewhere: by the head's bind model, its worker file naming only its TCP
    socket, without the repository-API token) over TCP, found in the stage directory like any other."""
    stats_dir = server.workspace / "stats"
    cmd = [sys.executable, "-m", "trident.cli", "worker", "prefill", "--model", server.model_path,
           "--join", f"http://{server.http}", "--stats-dir", str(stats_dir)]
    joiner = subprocess.Popen(cmd, env=_worker_env())
    try:
        deadline = time.monotonic() + 120

        def back() -> bool:  # the supervisor says so on its own round, which may come after Triton's readiness
            return any(line.endswith("worker prefill-2 is back: stage model prefill-2 is ready") for line in server.log)

        while not (admin.is_model_ready("prefill-3") and admin.is_model_ready("prefill-2") and back()):
            assert joiner.poll() is None and time.monotonic() < deadline, (
                "the joiner did not bind, or prefill-2 did not come back, or the supervisor did not say so")
            time.sleep(0.2)
        time.sleep(1.0)  # the scheduler looks for instances every 0.5 s
        before = _published(server)
        routed = {n: _metric(server, "trident_routed_total", instance=n) for n in ("prefill-2", "prefill-3")}
        cases = [ref[f"unique-{i}"] for i in range(1, 7)]  # prefixes it has not seen on any live instance
        for c in cases:
            assert _generate(server, c) == c["expected"]
        joined = _settled(server, "prefill-3", "published", lambda v: (v or 0) > 0)
        assert joined.get("published", 0) > 0 and joined["pid"] == joiner.pid
        after = _published(server)
        assert after["prefill-2"] > before["prefill-2"] and server.stats()["prefill-2"]["pid"] != joiner.pid
        time.sleep(0.3)
        assert _metric(server, "trident_routed_total", instance="prefill-2") > routed["prefill-2"]
        assert _metric(server, "trident_routed_total", instance="prefill-3") > routed["prefill-3"]
    finally:
        joiner.send_signal(signal.SIGTERM)
        assert joiner.wait(60) == 0
    deadline = time.monotonic() + 10
    while admin.is_model_ready("prefill-3") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert admin.is_model_ready("prefill-2")
    assert _generate(server, ref["unique-1"]) == ref["unique-1"]["expected"]  # it left cleanly


def test_a_worker_cannot_bind_over_a_live_instance(server):
    """``--name`` of a stage model another worker serves: the worker refuses (exit 3) and the live one keeps it."""
    pid = server.stats()["prefill-2"]["pid"]
    cmd = [sys.executable, "-m", "trident.cli", "worker", "prefill", "--model", server.model_path,
           "--url", f"http://{server.http}", "--name", "prefill-2"]
    done = subprocess.run(cmd, env=_worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "another worker already serves stage model prefill-2" in done.stderr
    assert server.worker_pid("prefill-2") == pid and server.ready("prefill-2")


def test_without_prefill_e_p_d_falls_back_then_answers_503_at_once(server, ref, admin):
    import requests
    headers = {"triton-access-token": server.token}
    for name in ("prefill", "prefill-2"):
        admin.unload_model(name, headers=headers)
    deadline = time.monotonic() + 10
    while (admin.is_model_ready("prefill") or admin.is_model_ready("prefill-2")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (admin.is_model_ready("prefill") or admin.is_model_ready("prefill-2"))
    time.sleep(1.0)  # the scheduler looks for instances every 0.5 s (till then it calls their workers' sockets on)
    fallbacks = _metric(server, "trident_fallbacks_total", to="e_pd")
    for case in ("one-image", "two-images"):
        assert _generate(server, ref[case]) == ref[case]["expected"]
    assert _metric(server, "trident_fallbacks_total", to="e_pd") == fallbacks + 2
    for stage in ("prefill_decode", "generate"):
        admin.unload_model(stage, headers=headers)
    while (admin.is_model_ready("prefill_decode") or admin.is_model_ready("generate")) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    assert not (admin.is_model_ready("prefill_decode") or admin.is_model_ready("generate"))
    time.sleep(1.0)
    c = ref["one-image"]
    start = time.monotonic()
    with pytest.raises(Exception, match="no live stage instances"):
        grpc_generate(server.grpc, "e_p_d", c["text"], c["images"], GREEDY, stream=True, timeout=5)
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    r = requests.post(f"{server.openai_url}/chat/completions", timeout=5, json={
        "model": f"{os.path.basename(server.model_path)}:e_p_d", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
    })
    assert r.status_code == 503 and "no live stage instances" in r.json()["error"]["message"], r.text
    assert r.headers.get("retry-after") and time.monotonic() - start < 1.0
