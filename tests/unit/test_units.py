"""Fast unit tests: sampling parameters, text streaming, image decoding, the repository files, the demo weights."""

from __future__ import annotations

import base64
import os

import pytest

from support import make_image, png_bytes
from trident.core.errors import InvalidRequest
from trident.core.media import decode_base64_image
from trident.core.output import TextStream
from trident.core.processor import SamplingParams
from trident.core.repository import REPOSITORY, write_repository


def test_sampling_params_parse_and_errors():
    p = SamplingParams.from_json('{"max_tokens": 5, "temperature": 0, "stop": "x", "presence_penalty": 0}')
    assert (p.max_tokens, p.greedy, p.stop) == (5, True, ["x"])  # vLLM's other names are accepted
    with pytest.raises(InvalidRequest, match="unknown sampling parameter\\(s\\) 'max_tokenz', 'unknown_field'$"):
        SamplingParams.from_json('{"max_tokenz": 5, "unknown_field": 1}')  # a typo is not ignored
    assert SamplingParams.from_json(None) == SamplingParams() == SamplingParams.from_json(b"")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        SamplingParams.from_json("{nope")
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        SamplingParams.from_json("[1, 2]")
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams.from_json('{"top_p": 1.5}')


@pytest.mark.parametrize("text, message", [
    ('{"seed": 18446744073709551615}', r"seed: Input should be less than or equal to 9223372036854775807"),
    ('{"seed": -9223372036854775809}', r"seed: Input should be greater than or equal to -9223372036854775808"),
    ('{"max_tokens": 4294967296}', r"max_tokens: Input should be less than or equal to 2147483647"),
    ('{"seed": 1%s}' % ("0" * 5000), r"not valid JSON: Exceeds the limit"),  # (Python's own digit limit)
    ('{"a":' * 100_000 + "1" + "}" * 100_000, r"sampling_parameters has 600001 bytes; at most 65536"),
    ('[' * 20_000 + ']' * 20_000, r"nested too deeply"),
    ('{"stop": [%s]}' % ", ".join(['"x"'] * 17), r"stop: List should have at most 16 items"),
    ('{"stop": "%s"}' % ("y" * 257), r"stop string 0 has 257 characters; at most 256"),
    ('{"presence_penalty": 0.5, "best_of": 2, "logit_bias": {"1": 5}}',
     r"not supported by Trident's engines: best_of \(send 1 or leave it out\), logit_bias \(send None or leave it "
     r"out\), presence_penalty \(send 0.0 or leave it out\)"),
    ('{"n": 17}', r"n: Input should be less than or equal to 16"),
    ('{"n": 0}', r"n: Input should be greater than or equal to 1"),
    ('{"skip_special_tokens": false}', r"skip_special_tokens \(send True"),
    ('{"guided_decoding": {"regex": "a+"}}', r"guided_decoding"),
])
def test_sampling_params_out_of_range_or_not_honoured_are_400s_before_any_work(text, message):
    """vLLM's server bounds these before it does any work; a field the engines would ignore is refused, never
    answered as if it had been honoured. A deep or huge JSON is a 400, not a 500."""
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams.from_json(text)


def test_vllm_names_at_their_defaults_are_accepted():
    """What clients of Triton's vLLM backend send by habit: vLLM's defaults, nulls and empties."""
    p = SamplingParams.from_json('{"n": 1, "best_of": null, "presence_penalty": 0, "repetition_penalty": 1.0, '
                                 '"stop_token_ids": [], "skip_special_tokens": true, "logprobs": null, "seed": '
                                 '9223372036854775807, "stop": ["%s"]}' % ("z" * 256))
    assert p.seed == (1 << 63) - 1 and p.stop == ["z" * 256]


class _ByteTokenizer:
    """Each token id is one byte; decoding replaces broken UTF-8 like real tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class _PieceTokenizer:
    """SentencePiece's way: word pieces carry their leading space as "▁", and a decoding drops the space its first
    piece starts with (so a token's text depends on the tokens before it)."""

    pieces = ["▁Hello", ",", "▁world", "▁", "!", "▁a", "b", "▁c"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


def _stream(text: str, stop: list[str]) -> tuple[str, bool]:
    ts = TextStream(_ByteTokenizer(), stop)
    out = "".join(ts.push(b) for b in text.encode())
    return out + ts.flush(), ts.stopped


def test_text_stream_stop_strings_and_partial_characters():
    assert _stream("hello world", []) == ("hello world", False)
    assert _stream("hello world. more", ["."]) == ("hello world", True)
    assert _stream("abcSTOPdef", ["STOP"]) == ("abc", True)
    assert _stream("abcSTdef", ["STOP"]) == ("abcSTdef", False)  # held back, then released
    ts = TextStream(_ByteTokenizer(), [])
    assert [ts.push(b) for b in "é!".encode()] == ["", "é", "!"]  # no half character is emitted
    ts = TextStream(_PieceTokenizer(), [])
    ids = [0, 1, 2, 3, 4, 5, 6, 7] * 3
    assert "".join(ts.push(i) for i in ids) + ts.flush() == _PieceTokenizer().decode(ids)


@pytest.mark.parametrize("arch", ["llava", "qwen2vl", "qwen2audio"])
def test_text_stream_gives_what_the_tokenizer_gives_for_the_whole_output(demo_models, arch):
    """Token by token, the stream's text is the tokenizer's decoding of all of them at once: for text in several
    scripts (multi-byte characters split over tokens), and for random ids, special tokens included."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_models[arch])
    rng = random.Random(7)
    text = "Hello, world! Ünïcödé 😀🎉 naïve café — 日本語のテキスト, 中文 , don't . Ok ?\n\n  two  spaces"
    runs = [tok.encode(text, add_special_tokens=False)]
    runs += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))] for _ in range(300)]
    for ids in runs:
        ts = TextStream(tok, [])
        out = "".join(ts.push(i) for i in ids) + ts.flush()
        assert out == tok.decode(ids, skip_special_tokens=True), ids


def test_decode_base64_image_forms_and_errors():
    png = png_bytes(make_image(32, 16, 0))
    raw = base64.b64encode(png)
    assert decode_base64_image(raw).size == (32, 16)
    assert decode_base64_image("data:image/png;base64," + raw.decode()).size == (32, 16)
    with pytest.raises(InvalidRequest, match="image 2 is not valid base64"):
        decode_base64_image("%%%", 2)
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        decode_base64_image(base64.b64encode(b"plain text"))
    with pytest.raises(InvalidRequest, match="not base64-encoded"):
        decode_base64_image("data:image/png,rawbytes")


@pytest.mark.parametrize("text", ["YWJjZA==", "YWJjZA=", "YWJjZA===", "YWJjZA", "YWJj\nZA==", "YW Jj", "YWJj!A==",
                                  "YWJjZA==YWJj", "=YWJj", "YQ", "YR==", "Y", "", "éèà"])
def test_base64_is_accepted_as_binascii_strict_mode_accepts_it(text):
    """The SIMD decoder takes what binascii's strict mode takes, and a refusal gives binascii's reason."""
    import binascii

    from trident.core.media import decode_base64

    try:
        expected = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        expected = e
    if isinstance(expected, bytes) and expected:
        assert decode_base64(text) == expected
        return
    with pytest.raises(InvalidRequest) as refused:
        decode_base64(text)
    reason = "is empty" if isinstance(expected, bytes) or not text.strip() else str(expected)
    assert reason in str(refused.value)


def test_repository_is_in_step_with_protocol(tmp_path):
    """model_repository/ is what `python -m trident.core.repository` renders from the protocol, file for file."""
    written = write_repository(tmp_path)
    assert {p.relative_to(tmp_path) for p in written} == {
        p.relative_to(REPOSITORY) for p in REPOSITORY.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    for path in written:
        assert (REPOSITORY / path.relative_to(tmp_path)).read_text() == path.read_text(), path


def test_ensembles_chain_records_and_bls_models_are_decoupled_python():
    from trident.core.repository import bls_config, ensemble_config

    steps = ensemble_config("e_p_d").ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["encode", "prefill", "decode"]
    assert "encode_report" not in steps[0].output_map  # the scheduler's, not the chain's
    assert dict(steps[2].input_map)["kv_meta"] == "_kv_meta" and "embedding_meta" not in steps[2].input_map
    bls = bls_config("e_p_d")
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    assert bls.parameters["mode"].string_value == "e_p_d"
    assert set(bls.parameters) == {"mode"}  # clients read it: no path of the host's, no scheduler settings
    assert [i.name for i in bls.input] == [i.name for i in ensemble_config("e_p_d").input]


def test_llava_demo_weights_use_the_hub_layout_and_load(demo_models):
    """vLLM reads LLaVA's CLIP weights only as vision_tower.vision_model.*; transformers must load them too."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    saved = load_file(f"{demo_models['llava']}/model.safetensors")
    assert not [k for k in saved if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")]
    model = LlavaForConditionalGeneration.from_pretrained(demo_models["llava"], dtype=torch.float32)
    params = dict(model.named_parameters())
    for key, value in saved.items():
        if key.startswith("vision_tower.vision_model."):
            loaded = params["model.vision_tower." + key[len("vision_tower.vision_model."):]]
            assert torch.equal(loaded, value), key


def test_a_stage_server_runs_every_caller_s_calls_on_one_loop_at_once(tmp_path, monkeypatch):
    """Calls from several connections (the stub's instances, the schedulers) and the control messages all run on
    the stage server's one loop (the engine's), the calls overlapping there up to ``calls_at_once``."""
    import asyncio
    import threading

    import numpy as np

    from trident.core.stagecall import StageClient, StageServer, directory
    from trident.core.stagecall.server import at_most

    loops: set = set()
    inside, peak = 0, 0
    all_in = threading.Event()

    async def infer(call):
        nonlocal inside, peak
        loops.add(asyncio.get_running_loop())
        inside += 1
        peak = max(peak, inside)
        if inside == 3:
            all_in.set()
        await asyncio.get_running_loop().run_in_executor(None, all_in.wait, 5)
        inside -= 1
        return {"n": call.inputs["n"]}

    control_loops: set = set()
    server = StageServer(at_most(infer, 3), lambda message: control_loops.add(asyncio.get_running_loop()), "127.0.0.1")
    server.start()
    monkeypatch.setenv(directory.ENV, str(tmp_path))
    directory.enter("prefill", server.worker_file(1, "prefill"))

    def caller(i: int):
        async def go():
            client = StageClient()  # a connection of its own
            try:
                return await client.call("prefill", {"n": np.array([i])}, ["n"])
            finally:
                client.close()
        return asyncio.run(go())

    try:
        results: list = []
        threads = [threading.Thread(target=lambda i=i: results.append(caller(i))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(int(r["n"][0]) for r in results) == [0, 1, 2]
        assert len(loops) == 1 and peak == 3

        async def send_control():
            client = StageClient()
            assert await client.withdraw("prefill", "tok")
            await asyncio.sleep(0.2)
            client.close()

        asyncio.run(send_control())
        assert control_loops == loops
    finally:
        server.stop(drain_s=1)


def test_stage_messages_carry_their_tensors_and_round_trip():
    """:data:`trident.core.protocol.StageMessage`: every dtype the stage models use comes back equal, shapes included,
    with the parameters and the scheduler's fields; a frame that is not a message is refused by name."""
    import numpy as np

    from trident.core.errors import InvalidRequest, MalformedRecord
    from trident.core.protocol import FRAME, Call, Deliver, Failure, HandTo, Reply, decode_message, encode_message, error_of, failure

    data = {
        "text_input": np.array([b"USER: <image>\nhi"], dtype=np.object_),
        "image": np.array([b"\x00\xffpng" * 1000, b""], dtype=np.object_),
        "stream": np.array([True]),
        "max": np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint32),
        "f": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    }
    frame = encode_message(Call(3, data, ["kv_meta"], {"trident_request": "r1"}, HandTo("prefill-2", "tok", 9)))
    (size,) = FRAME.unpack(frame[:FRAME.size])
    assert size == len(frame) - FRAME.size and size > 4000  # the image bytes are in the message
    back = decode_message(frame[FRAME.size:])
    assert isinstance(back, Call) and back.id == 3 and back.outputs == ["kv_meta"]
    assert back.parameters == {"trident_request": "r1"} and back.hand_to == HandTo("prefill-2", "tok", 9)
    assert back.await_record is None and set(back.inputs) == set(data)
    for name, tensor in data.items():
        assert back.inputs[name].dtype == tensor.dtype and back.inputs[name].shape == tensor.shape, name
        assert np.array_equal(back.inputs[name], tensor), name
    assert back.inputs["max"].flags.writeable
    out = {"kv_meta": np.array([b"\x01record"], dtype=np.object_), "num_output_tokens": np.array([7], np.uint32)}
    reply = decode_message(encode_message(Reply(4, out))[FRAME.size:])
    assert reply.end and reply.outputs["kv_meta"].tolist() == [b"\x01record"] and reply.outputs["num_output_tokens"].tolist() == [7]
    assert decode_message(encode_message(Deliver(5, "tok", b"rec"))[FRAME.size:]) == Deliver(5, "tok", b"rec")
    error = error_of(decode_message(encode_message(failure(6, InvalidRequest("no")))[FRAME.size:]))
    assert isinstance(error, InvalidRequest) and error.message == "no"
    assert error_of(Failure(7, "NoSuchClass", "x")).message == "x"
    for bad in (b"\xc1", b"\x92\xa4nope\x01", encode_message(Reply(1, {"x": np.array([1])}))[FRAME.size:].replace(b"<i8", b"|O8")):
        with pytest.raises(MalformedRecord, match="not a stage message"):
            decode_message(bad)


def test_a_stage_model_is_trident_s_stub_with_the_worker_file_its_worker_asked_for(tmp_path):
    """What the head's bind model writes for a worker: the stage's config (its tensors, decoupled or not, the
    instances asked for), a ``model.py`` that runs Trident's stub, and the worker file naming the sockets the worker
    asked for, as its stage server says them: the Unix socket with the pid for a worker on the head's host, the TCP
    socket alone for one from another host (a pid and a Unix socket mean nothing there). Nothing of PyTriton's."""
    import json

    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as pb

    from trident.core.protocol import STAGES, WORKER_FILE, Bind
    from trident.core.repository import install_stage_model
    from trident.core.stagecall import StageServer

    server = StageServer(lambda call: None, lambda message: None, "127.0.0.1")
    try:
        for pid, stage in ((os.getpid(), "decode"), (None, "prefill")):
            bind = Bind(stage=stage, tcp=server.address, instances=3, pid=pid, direct=server.path if pid else None)
            bind.check()
            assert bind.worker_file(f"{stage}-2") == server.worker_file(pid, f"{stage}-2")
            folder = install_stage_model(tmp_path, f"{stage}-2", stage, 3, bind.worker_file(f"{stage}-2"))
            config = text_format.Parse((folder / "config.pbtxt").read_text(), pb.ModelConfig())
            assert config.name == f"{stage}-2" and config.backend == "python" and not config.parameters
            assert [t.name for t in config.input] == [t.name for t in STAGES[stage].inputs]
            assert [t.name for t in config.output] == [t.name for t in STAGES[stage].outputs]
            assert config.model_transaction_policy.decoupled == STAGES[stage].decoupled
            assert config.instance_group[0].count == 3
            assert "from trident.in_triton.proxy_model import TritonPythonModel" in (folder / "1" / "model.py").read_text()
            assert json.loads((folder / "1" / WORKER_FILE).read_text()) == server.worker_file(pid, f"{stage}-2")
            assert (folder / "1" / "__pycache__").is_file()  # (the stub writes no bytecode there)
    finally:
        server.stop()


def test_worker_stats_outlive_a_disk_that_cannot_be_written(tmp_path, caplog):
    """The stats thread of a worker whose folder cannot be written (full disk, gone) keeps going, warns once, and
    writes as soon as it can."""
    import json
    import threading
    import time

    from trident.worker.bind import _write_stats

    class Engine:
        n = 0

        def stats(self):
            self.n += 1
            return {"ticks": self.n}

    folder = tmp_path / "stats"  # not there yet: every write fails
    stop = threading.Event()
    thread = threading.Thread(target=_write_stats, args=(Engine().stats, folder / "w.json", stop), daemon=True)
    with caplog.at_level("WARNING", logger="trident.worker"):
        thread.start()
        time.sleep(0.5)
        assert thread.is_alive() and not folder.exists()
        folder.mkdir()
        deadline = time.monotonic() + 5
        while not (folder / "w.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join(5)
    assert json.loads((folder / "w.json").read_text())["ticks"] > 1
    assert sum("worker stats: cannot write" in r.getMessage() for r in caplog.records) == 1


def test_no_process_the_launcher_starts_inherits_the_repository_token(monkeypatch, tmp_path):
    """The token given by environment is taken out of it at once: the workers (forked from the zygote) bind through
    the head's bind model and get none, nor does the frontend; Triton gets it by the shim alone."""
    from trident.core.config import ServeSettings
    from trident.supervisor import Launcher, worker_pool

    monkeypatch.setenv("TRIDENT_ACCESS_TOKEN", "tok-from-env-123")
    given = {}

    class Zygote:
        def __init__(self, python, env, backend, model):
            given["env"] = env

    monkeypatch.setattr(worker_pool, "Zygote", Zygote)
    launcher = Launcher(ServeSettings(workspace=str(tmp_path), access_token="tok-from-env-123"))
    assert launcher.token == "tok-from-env-123" and "TRIDENT_ACCESS_TOKEN" not in os.environ  # (serve's CLI read it)
    pool = worker_pool.WorkerPool(launcher.s, str(tmp_path), launcher.http_url, launcher.grpc_url, tmp_path / "stats",
                                  tmp_path / "store", unload=lambda name: None, out=print)
    pool.start_zygote()
    assert "tok-from-env-123" not in given["env"].values() and "TRIDENT_ACCESS_TOKEN" not in given["env"]
