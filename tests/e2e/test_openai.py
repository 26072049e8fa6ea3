"""The OpenAI-compatible frontend, driven by the official `openai` client against a real `trident serve` (the LLaVA
server this module shares with test_serving.py, test_bad_input.py and test_trust.py: :func:`support.shared_llava_server`)."""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.request

import pytest
import requests

from support import MODES, b64, grpc_generate, make_image, png_bytes, shared_llava_server
from support.server import SHARED_LLAVA_NAME

pytestmark = pytest.mark.slow

NAME = SHARED_LLAVA_NAME
GREEDY = {"max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory, shared_servers):
    return shared_llava_server(shared_servers, demo_models["llava"], tmp_path_factory)


@pytest.fixture(scope="module")
def media_dir(server):
    return server.media_dir  # (it holds ok.png)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def _messages(url: str, text: str = "Describe the picture in detail, please.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def image_png():
    return png_bytes(make_image(224, 224, 1))


@pytest.mark.parametrize("mode", MODES)
def test_chat_with_image_equals_entry_model(server, client, image_png, mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture in detail, please."}]}],
        tokenize=False, add_generation_prompt=True,
    )
    expected = grpc_generate(server.grpc, mode, prompt, [b64(image_png)], GREEDY, stream=True)

    r = client.chat.completions.create(model=f"{NAME}:{mode}", messages=_messages(_data_url(image_png)),
                                       max_tokens=GREEDY["max_tokens"], temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected.num_input_tokens, GREEDY["max_tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = client.chat.completions.create(model=f"{NAME}:{mode}", messages=_messages(_data_url(image_png)),
                                            max_tokens=GREEDY["max_tokens"], temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, usage, reasons, n = "", None, [], 0
    for chunk in stream:
        if chunk.choices:
            n += 1
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage:
            usage = chunk.usage
    assert text == expected.text and n > 1
    assert reasons[-1] == "length"
    assert usage.completion_tokens == GREEDY["max_tokens"] and usage.prompt_tokens == expected.num_input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_entry_model_s(server, client, image_png, stream):
    """Chat ``logprobs`` + ``top_logprobs`` and the legacy ``logprobs``: each generated token's logprob, its top
    alternatives, and the token texts are the entry model's (its ``logprobs`` output, in E/P/D: the first token's
    from the prefill's record), streamed or not."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    text = "Describe the picture in detail, please."
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                                     tokenize=False, add_generation_prompt=True)
    params = {**GREEDY, "logprobs": 3}
    ours = grpc_generate(server.grpc, "e_p_d", prompt, [b64(image_png)], params, stream=True,
                         flags=("return_logprobs", "return_num_output_tokens")).logprobs
    assert len(ours) == GREEDY["max_tokens"]
    kwargs = dict(model=f"{NAME}:e_p_d", max_tokens=GREEDY["max_tokens"], temperature=0, stream=stream)
    r = client.chat.completions.create(messages=_messages(_data_url(image_png), text), logprobs=True, top_logprobs=3,
                                       **kwargs)
    content = [t for chunk in r for t in (chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs
                                          else [])] if stream else r.choices[0].logprobs.content
    assert len(content) == len(ours)
    for got, entry in zip(content, ours):
        sampled, *_ = entry.values()
        assert (got.token, got.logprob, got.bytes) == (sampled["decoded_token"], sampled["logprob"],
                                                       list(sampled["decoded_token"].encode()))
        top = sorted((c for c in entry.values() if c["rank"] <= 3), key=lambda c: c["rank"])
        assert [(t.token, t.logprob) for t in got.top_logprobs] == [(c["decoded_token"], c["logprob"]) for c in top]
        assert len(got.top_logprobs) == 3

    completion = "Once upon a time"
    legacy = grpc_generate(server.grpc, "e_p_d", completion, [], {**GREEDY, "logprobs": 1}, stream=True,
                           flags=("return_logprobs",)).logprobs
    r = client.completions.create(prompt=completion, logprobs=1, **kwargs)
    choices = [chunk.choices[0] for chunk in r if chunk.choices] if stream else r.choices
    tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
    token_logprobs = [t for c in choices if c.logprobs for t in c.logprobs.token_logprobs]
    offsets = [t for c in choices if c.logprobs for t in c.logprobs.text_offset]
    assert tokens == [next(iter(e.values()))["decoded_token"] for e in legacy]
    assert token_logprobs == [next(iter(e.values()))["logprob"] for e in legacy]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("endpoint, mode", [("chat", mode) for mode in MODES] + [("completions", "e_p_d")])
def test_n_choices_are_reproducible_with_a_seed_and_each_is_its_seed_s_answer(client, endpoint, mode):
    """``n=3``: three choices; with a seed, choice i is the answer to the same request with n=1 and seed + i (vLLM's
    rule), the same again on a second request, streamed or not; usage counts the prompt once and every choice's
    tokens. (One generation of three choices: one prefill, its KV forked.)"""
    kwargs = dict(model=f"{NAME}:{mode}", max_tokens=6, temperature=1.0, seed=1234)
    if endpoint == "chat":
        create, body = client.chat.completions.create, {"messages": [{"role": "user", "content": "Tell me a story."}]}
        text_of, delta_of = (lambda c: c.message.content), (lambda c: c.delta.content or "")
    else:
        create, body = client.completions.create, {"prompt": "Once upon a time"}
        text_of = delta_of = lambda c: c.text
    r = create(n=3, **body, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [text_of(c) for c in r.choices]
    assert len(set(texts)) > 1, texts  # three samples, not one answer three times
    singles = [create(**body, **{**kwargs, "seed": 1234 + i}) for i in range(3)]
    assert texts == [text_of(s.choices[0]) for s in singles]
    assert [text_of(c) for c in create(n=3, **body, **kwargs).choices] == texts
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens and r.usage.completion_tokens == 3 * 6
    streamed, usage = ["", "", ""], None
    for chunk in create(n=3, stream=True, stream_options={"include_usage": True}, **body, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += delta_of(c)
        usage = chunk.usage or usage
    assert streamed == texts and usage.completion_tokens == 3 * 6


def test_n_choices_come_from_one_prefill_and_one_kv_read(server, client, image_png):
    """E/P/D with an image (a prompt the decode worker does not prefill itself): ``n=3`` prefills once, the prefill
    hands on one KV cache (its first token per choice in the record) and the decode worker READs it once."""
    def counts() -> tuple[int, int]:
        stats = server.stats(settled=True)
        published = sum(s.get("published", 0) for name, s in stats.items() if name.split("-")[0] == "prefill")
        return published, stats["decode"]["fetched"]

    before = counts()
    r = client.chat.completions.create(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)), n=3,
                                       max_tokens=5, temperature=1.0, seed=7)
    assert len(r.choices) == 3 and r.usage.completion_tokens == 15
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)


def test_a_triton_client_gets_n_choices_in_vectors_as_from_the_vllm_backend(server):
    """Over Triton, ``sampling_parameters.n``: each response has one element per choice (the vLLM backend's shape),
    streamed (one choice's new text per response) and not; choice i is the answer with n=1 and seed + i."""
    import queue

    import tritonclient.grpc as grpcclient

    from support.clients import _grpc_inputs, entry_inputs

    params = {"max_tokens": 5, "temperature": 1.0, "seed": 99}

    def choices(stream: bool) -> tuple[list[str], list[str]]:
        inputs = _grpc_inputs(grpcclient, {name: (arr, dtype) for name, arr, dtype in entry_inputs(
            "USER: Tell me a story. ASSISTANT:", [], {**params, "n": 2}, stream)})
        q: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(server.grpc)
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        texts, reasons = ["", ""], None
        try:
            c.async_stream_infer("e_p_d", inputs, enable_empty_final_response=True)
            while True:
                result, error = q.get(timeout=60)
                assert error is None, error
                out = result.as_numpy("text_output")
                if out is not None and out.size:
                    assert out.shape == (2,), out.shape
                    texts = [t + v.decode() for t, v in zip(texts, out)]
                    reasons = [v.decode() for v in result.as_numpy("finish_reason")]
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return texts, reasons
        finally:
            c.stop_stream()
            c.close()

    singles = [grpc_generate(server.grpc, "e_p_d", "USER: Tell me a story. ASSISTANT:", [],
                             {**params, "seed": 99 + i}, stream=False).text for i in range(2)]
    for stream in (True, False):
        texts, reasons = choices(stream)
        assert texts == singles and reasons == ["length", "length"], (stream, texts, singles, reasons)


def test_response_format_and_guided_fields_constrain_the_answer(client, image_png):
    """``response_format`` (``json_schema``, ``json_object``) and vLLM's ``guided_*`` fields are done, not dropped:
    the answer keeps to them and ends when it is complete."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}
    kwargs = dict(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)), max_tokens=64, temperature=0)
    r = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
                                       **kwargs)
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content)["n"] in (1, 2, 3)
    r = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(extra_body={"guided_choice": ["red", "green", "blue"]}, **kwargs)
    assert (r.choices[0].finish_reason, r.choices[0].message.content in ("red", "green", "blue")) == ("stop", True)
    r = client.completions.create(model=f"{NAME}:e_p_d", prompt="The code is", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{4}"})
    assert re.fullmatch("[A-Z]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}


def _answer(r, stream: bool) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a chat answer, whole or streamed."""
    if not stream:
        m = r.choices[0].message
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or ()], r.choices[0].finish_reason
    content, calls, reason = "", {}, None
    for chunk in r:
        if not chunk.choices:
            continue
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        content += delta.content or ""
        for call in delta.tool_calls or ():
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
    return content or None, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_required_and_auto(client, image_png, stream):
    """A named tool_choice answers that function's arguments, held to its schema (finish ``stop``); ``required`` one
    call or more (``tool_calls``; the demo model lists calls until ``max_tokens``, so its answer is the list so far,
    as text); ``auto`` text where the model writes no call (the demo's template has no tools), streamed or not."""
    kwargs = dict(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)), max_tokens=48, temperature=0,
                  tools=[WEATHER], stream=stream)
    content, calls, reason = _answer(client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kwargs), stream)
    assert (content, reason, len(calls)) == (None, "stop", 1)
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1])["unit"] in ("c", "f")
    content, calls, reason = _answer(client.chat.completions.create(tool_choice="required", **kwargs), stream)
    if reason == "tool_calls":
        assert content is None and calls and all(name == "get_weather" and json.loads(args)["unit"] in ("c", "f")
                                                 for name, args in calls), (content, calls)
    else:  # the demo's random weights go on listing calls: cut off, the list so far is the text, each item whole
        item = r'\{"name":"get_weather","parameters":\{"unit":"[cf]"\}\}'
        assert reason == "length" and not calls and re.match(rf"\[{item}(,{item})*", content), (content, reason)
    content, calls, reason = _answer(client.chat.completions.create(tool_choice="auto", **kwargs), stream)
    plain = client.chat.completions.create(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)),
                                           max_tokens=48, temperature=0)
    assert (content, calls, reason) == (plain.choices[0].message.content, [], plain.choices[0].finish_reason)


def test_bare_model_id_is_the_default_mode_and_models_list(client, image_png):
    ids = {m.id for m in client.models.list().data}
    assert ids == {NAME, *(f"{NAME}:{m}" for m in MODES)}
    a = client.chat.completions.create(model=NAME, messages=_messages(_data_url(image_png)), max_tokens=8, temperature=0)
    b = client.chat.completions.create(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)), max_tokens=8,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_and_local_media(client, media_dir):
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].text
    ok = client.chat.completions.create(model=NAME, messages=_messages(str(media_dir / "ok.png")), max_tokens=4)
    assert ok.usage.completion_tokens == 4


BAD = {
    "invalid base64": (_messages("data:image/png;base64,@@not-base64@@"), {}, 400, "not valid base64"),
    "not an image": (_messages(_data_url(b"hello, not an image")), {}, 400, "could not be decoded as an image"),
    "private url": (_messages("http://127.0.0.1/cat.png"), {}, 400, "non-public address"),
    "a port not allowed": (_messages("http://images.example:9/cat.png"), {}, 400, "names port 9; media URLs may"),
    "outside media dir": (_messages("/etc/hostname"), {}, 400, "outside the allowed media folder"),
    "n=17": (_messages("data:,"), {"n": 17}, 400, "n: Input should be less than or equal to 16"),
    "unknown model": (_messages("data:,"), {"model": "gpt-17"}, 404, "does not exist"),
    "top_logprobs alone": (_messages("data:,"), {"top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
    "21 top_logprobs": (_messages("data:,"), {"logprobs": True, "top_logprobs": 21}, 400,
                        "top_logprobs: Input should be less than or equal to 20"),
    "a schema that does not compile": (_messages("data:,"), {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, 400, 'Unsupported type "objekt"'),
    "two structures": (_messages("data:,"), {"response_format": {"type": "json_object"},
                                             "extra_body": {"guided_regex": "[a-z]+"}}, 400, "give exactly one of"),
    "a tool_choice naming no tool": (_messages("data:,"), {"tools": [{"type": "function", "function": {"name": "f"}}],
                                     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
                                    "'g', which is not one of the tools"),
    "tool_choice without tools": (_messages("data:,"), {"tool_choice": "required"}, 400, "required needs tools"),
    "a penalty": (_messages("data:,"), {"presence_penalty": 0.5}, 400, "presence_penalty (send 0.0 or leave it out)"),
    "a vLLM field": (_messages("data:,"), {"extra_body": {"repetition_penalty": 1.3}}, 400, "repetition_penalty"),
    "seed past 64 bits": (_messages("data:,"), {"seed": 1 << 64}, 400, "seed: Input should be less than or equal"),
    "17 stops": (_messages("data:,"), {"stop": ["x"] * 17}, 400, "stop: List should have at most 16 items"),
    "4097 messages": ([{"role": "user", "content": "hi"}] * 4097, {}, 400, "messages: List should have at most 4096"),
    "4097 parts in all": ([{"role": "user", "content": [{"type": "text", "text": "hi"}] * 17}] * 241, {}, 400,
                          "the messages have 4097 content parts in all; at most 4096"),
    "a prompt longer than the context window holds": ([{"role": "user", "content": "hi " * 30_000}], {}, 400,
                                                      "as rendered: more than any prompt that fits the model's context"),
}


@pytest.mark.parametrize("problem", list(BAD))
def test_errors(client, image_png, problem):
    import openai

    messages, extra, status, message = BAD[problem]
    kwargs = {"model": NAME, "messages": messages, "max_tokens": 4, **extra}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == status
    assert message in info.value.body["message"]
    # still serving
    assert client.chat.completions.create(model=NAME, messages=_messages(_data_url(image_png)), max_tokens=2)


def test_metrics_count_requests(server, client, image_png):
    def scrape() -> str:
        with urllib.request.urlopen(f"http://{server.openai_host}:{server.openai_port}/metrics") as r:
            return r.read().decode()

    def value(text: str, name: str, labels: str) -> float:
        m = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    before = scrape()
    for _ in range(3):
        client.chat.completions.create(model=f"{NAME}:ep_d", messages=_messages(_data_url(image_png)), max_tokens=4)
    with pytest.raises(Exception):
        client.chat.completions.create(model=f"{NAME}:ep_d", messages=_messages(_data_url(image_png)), max_tokens=4,
                                       extra_body={"top_p": 7})
    after = scrape()
    labels = 'endpoint="chat",mode="ep_d"'
    assert value(after, "trident_requests_total", labels) - value(before, "trident_requests_total", labels) == 3
    assert value(after, "trident_generation_tokens_total", 'mode="ep_d"') - value(
        before, "trident_generation_tokens_total", 'mode="ep_d"') == 12
    assert "trident_time_to_first_token_seconds_bucket" in after


VLLM_ONLY = {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"}


def test_every_query_of_the_grafana_dashboard_names_a_metric_the_live_server_exports(server, client, image_png):
    """``deploy/grafana/trident.json``: each metric its queries name is exported by this server, on Triton's metrics
    port (the schedulers' ``trident_*`` and ``vllm:*`` families, Triton's ``nv_*``) or the frontend's ``/metrics``."""
    from pathlib import Path

    import openai

    client.chat.completions.create(model=f"{NAME}:e_p_d", messages=_messages(_data_url(image_png)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context window"):  # (the error counters get a series)
        client.chat.completions.create(model=f"{NAME}:e_p_d", messages=[{"role": "user", "content": "hi " * 20_000}],
                                       max_tokens=2)
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "trident.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {n for q in queries for n in re.findall(r"\b((?:vllm:|trident_|nv_)[A-Za-z0-9_:]*)", q)}
    exported: set[str] = set()
    for url in (f"http://127.0.0.1:{server.metrics_port}/metrics", f"http://{server.openai_host}:{server.openai_port}/metrics"):
        text = requests.get(url, timeout=10).text
        exported |= {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert len(named) >= 15, sorted(named)
    # (what an hf engine does not count, checked on a vLLM server: tests/e2e/test_vllm_serving.py)
    assert not sorted(named - exported - VLLM_ONLY), f"not exported: {sorted(named - exported - VLLM_ONLY)}"
    assert VLLM_ONLY <= named


def test_triton_down_is_503(demo_models):
    from fastapi.testclient import TestClient

    from trident.core.config import FrontendSettings
    from trident.frontend.app import create_app
    from trident.frontend.app import TritonEngine
    from trident.core.netutil import free_ports

    app = create_app(FrontendSettings(model_name=NAME, model_path=demo_models["llava"]),
                     TritonEngine(f"127.0.0.1:{free_ports(1)[0]}"))
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503


def test_http_image_url_fetched_when_private_urls_allowed(server, demo_models, image_png, tmp_path):
    """An http image URL is fetched (here from a local server, so private URLs must be allowed)."""
    import functools
    import http.server
    import threading

    from fastapi.testclient import TestClient

    from trident.core.config import FrontendSettings, MediaPolicy
    from trident.frontend.app import create_app
    from trident.frontend.app import TritonEngine

    (tmp_path / "cat.png").write_bytes(image_png)
    (tmp_path / "big.bin").write_bytes(b"\0" * (2 << 20))
    (tmp_path / "elsewhere").mkdir()  # asked for without its slash, the server redirects (301)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        app = create_app(
            FrontendSettings(model_name=NAME, model_path=server.model_path,
                             media=MediaPolicy(allow_private_urls=True, allowed_ports=None, max_bytes=1 << 20)),
            TritonEngine(server.grpc),
        )
        body = {"model": NAME, "max_tokens": 8, "temperature": 0}
        with TestClient(app) as http_client:
            by_url = http_client.post("/v1/chat/completions", json={**body, "messages": _messages(f"{base}/cat.png")})
            by_data = http_client.post("/v1/chat/completions", json={**body, "messages": _messages(_data_url(image_png))})
            assert by_url.status_code == 200, by_url.text
            assert by_url.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
            too_big = http_client.post("/v1/chat/completions", json={**body, "messages": _messages(f"{base}/big.bin")})
            assert too_big.status_code == 400 and "past 1 MiB together" in too_big.json()["error"]["message"]
            missing = http_client.post("/v1/chat/completions", json={**body, "messages": _messages(f"{base}/none.png")})
            assert missing.status_code == 400 and "HTTP 404" in missing.json()["error"]["message"]
            # a redirect is not followed (it could lead anywhere, a private address included)
            moved = http_client.post("/v1/chat/completions", json={**body, "messages": _messages(f"{base}/elsewhere")})
            assert moved.status_code == 400 and "HTTP 301" in moved.json()["error"]["message"]
    finally:
        httpd.shutdown()


def test_with_an_api_key_file_every_v1_request_needs_a_key(server, tmp_path):
    """``frontend.api_key_file`` (``--api-key-file``): a /v1/ request without one of its keys is a 401 before its body
    is read; with one it is served; /health stays open. A key file others may read is refused at start."""
    import os

    from fastapi.testclient import TestClient

    from trident.core.usage import UsageError
    from trident.core.config import FrontendSettings
    from trident.frontend.app import create_app
    from trident.frontend.app import TritonEngine

    keys = tmp_path / "keys"
    keys.write_text("first-key\nsecond-key\n")
    os.chmod(keys, 0o640)
    settings = FrontendSettings(model_name=NAME, model_path=server.model_path, api_key_file=keys)
    with pytest.raises(UsageError, match="group or others may read or write it"):
        create_app(settings, TritonEngine(server.grpc))
    os.chmod(keys, 0o600)
    body = {"model": NAME, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(settings, TritonEngine(server.grpc))) as http_client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic second-key"}):
            r = http_client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text
        assert http_client.get("/v1/models").status_code == 401
        r = http_client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer second-key"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert http_client.get("/health").status_code == 200


def test_a_lone_surrogate_is_a_400(server, client):
    """JSON can escape a lone surrogate (``\\ud800``), which is no text: a clear 400, not a 500."""
    body = ('{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}' % NAME)
    r = requests.post(f"{server.openai_url}/chat/completions", data=body,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "the prompt is not valid UTF-8 text" in r.json()["error"]["message"]
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize("tail", ["[" * 50_000 + "]" * 50_000, "1" + "0" * 5000], ids=["deep", "huge number"])
def test_a_body_json_cannot_read_is_an_openai_shaped_400(server, client, tail):
    body = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "seed": %s}' % (NAME, tail)
    r = requests.post(f"{server.openai_url}/chat/completions", data=body,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "not JSON that can be read" in r.json()["error"]["message"]
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize("way", ["openai", "generate_stream"])
@pytest.mark.parametrize("mode", ["e_p_d", "epd"])
def test_a_dropped_stream_stops_the_decode_within_a_second(server, client, image_png, mode, way):
    """A client that goes away mid-stream (closes its connection to the OpenAI API's SSE, or to Triton's HTTP
    ``generate_stream``): the request is cancelled, the scheduler stops the stage's stream, and the decode
    leaves the batch within 1 s; every region and lease of the request is freed."""
    import time

    from support import wait_drained

    decode = {"e_p_d": "decode", "epd": "generate"}[mode]
    if way == "openai":
        url = f"{server.openai_url}/chat/completions"
        body = {"model": f"{NAME}:{mode}", "stream": True, "max_tokens": 1000, "ignore_eos": True,
                "messages": _messages(_data_url(image_png))}
    else:
        url = f"http://{server.http}/v2/models/{mode}/generate_stream"
        body = {"text_input": "USER: <image>\nDescribe the picture. ASSISTANT:", "stream": True,
                "image": [base64.b64encode(image_png).decode()],
                "sampling_parameters": json.dumps({"max_tokens": 1000, "ignore_eos": True})}
    with requests.post(url, json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        lines = r.iter_lines()
        events = [line for line in (next(lines) for _ in range(8)) if line.startswith(b"data: ")]
        assert len(events) >= 3
        deadline = time.monotonic() + 5
        while server.stats().get(decode, {}).get("decode_active") != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()[decode]["decode_active"] == 1
        start = time.monotonic()
    # (leaving the ``with`` closed the connection)
    while server.stats()[decode].get("decode_active") and time.monotonic() - start < 5:
        time.sleep(0.05)
    stopped = time.monotonic() - start
    assert server.stats()[decode]["decode_active"] == 0 and stopped < 1.0 + 0.2  # (stats are rewritten every 0.2 s)
    wait_drained(server, {decode})
    assert client.chat.completions.create(model=f"{NAME}:{mode}", messages=_messages(_data_url(image_png)), max_tokens=2)


def test_a_client_gone_from_a_whole_answer_stops_its_decode_within_a_second(server, client, image_png):
    """A non-streaming request whose client disconnects before the answer: its generation is stopped as a dropped
    stream's is (the frontend looks for the disconnect every 0.25 s), not decoded to its end for nobody."""
    import socket
    import time

    from support import wait_drained

    body = json.dumps({"model": f"{NAME}:e_p_d", "max_tokens": 1000, "ignore_eos": True,
                       "messages": _messages(_data_url(image_png))}).encode()
    sock = socket.create_connection((server.openai_host, server.openai_port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while server.stats().get("decode", {}).get("decode_active") != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats()["decode"]["decode_active"] == 1
    sock.close()
    start = time.monotonic()
    while server.stats()["decode"].get("decode_active") and time.monotonic() - start < 5:
        time.sleep(0.05)
    stopped = time.monotonic() - start
    assert server.stats()["decode"]["decode_active"] == 0 and stopped < 1.0 + 0.2, stopped  # (stats: every 0.2 s)
    wait_drained(server, {"decode"})
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_killed_frontend_comes_back(server, client):
    """The OpenAI frontend is supervised like the stage workers: killed, it is started again, and the API
    answers as before (Triton's own endpoints serve throughout)."""
    import signal
    import time

    from support import grpc_generate

    started = [line for line in server.log if line.startswith("[trident] started the OpenAI frontend (pid ")]
    pid = int(started[-1].split("(pid ")[1].split(")")[0])
    os.kill(pid, signal.SIGKILL)
    ok = grpc_generate(server.grpc, "e_p_d", "USER: hi ASSISTANT:", [], {"max_tokens": 2}, stream=True)
    assert ok.num_output_tokens == 2
    deadline = time.monotonic() + 90
    while not any(line.startswith("[trident] the OpenAI frontend is back") for line in server.log):
        assert time.monotonic() < deadline, "the frontend did not come back"
        time.sleep(0.2)
    assert any("the OpenAI frontend exited with code -9" in line for line in server.log)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.usage.completion_tokens == 2
