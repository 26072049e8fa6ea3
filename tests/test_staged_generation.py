"""Encode, prefill and decode in three OS processes, joined only by trident.transfer, equal model.generate()."""

from __future__ import annotations

import io
import multiprocessing as mp
import time

import pytest
import torch
from PIL import Image

from conftest import chat_prompt, make_image, png_bytes

NEW_TOKENS = 24
GREEDY = '{"max_tokens": %d, "temperature": 0}' % NEW_TOKENS


def _stage(conn, role: str, model_path: str) -> None:
    """Child process serving one role over a pipe."""
    torch.set_num_threads(1)
    from trident.config import MiB, TransferConfig
    from trident.engines.hf import HFDecoder, HFEncoder, HFModel, HFPrefiller
    from trident.processor import SamplingParams
    from trident.stages import decode_stage, encode_stage, prefill_stage
    from trident.transfer import TransferEndpoint

    model = HFModel(model_path)
    endpoint = TransferEndpoint(TransferConfig(send_pool_bytes=64 * MiB, recv_pool_bytes=64 * MiB))
    engine = {"encode": HFEncoder, "prefill": HFPrefiller, "decode": HFDecoder}[role](model)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "encode":
                images = [Image.open(io.BytesIO(b)).convert("RGB") for b in arg]
                out = encode_stage(engine, endpoint, images).encode()
            elif cmd == "prefill":
                text, emb, params = arg
                out = prefill_stage(model.processor, engine, endpoint, text, emb, SamplingParams.from_json(params)).encode()
            elif cmd == "decode":
                kv, params = arg
                tokens, text, reason = [], "", None
                for event in decode_stage(engine, endpoint, kv, SamplingParams.from_json(params)):
                    tokens += event.token_ids
                    text += event.text
                    reason = event.finish_reason
                out = (tokens, text, reason)
            elif cmd == "stats":
                out = endpoint.stats()
            elif cmd == "exit":
                conn.send("bye")
                return
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Stage:
    def __init__(self, role: str, model_path: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_stage, args=(child, role, model_path), daemon=True)
        self.proc.start()

    def wait_ready(self) -> None:
        assert self.conn.poll(120), "stage process did not start"
        assert self.conn.recv() == "ready"

    def __call__(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        assert self.conn.poll(120), f"stage did not answer {cmd}"
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def stop(self) -> None:
        try:
            self.conn.send(("exit", None))
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


@pytest.fixture(scope="module", params=["llava", "qwen2vl"])
def pipeline(request, demo_models):
    path = demo_models[request.param]
    stages = {role: Stage(role, path) for role in ("encode", "prefill", "decode")}
    try:
        for s in stages.values():
            s.wait_ready()
        yield request.param, path, stages
    finally:
        for s in stages.values():
            s.stop()


@pytest.fixture(scope="module")
def references(pipeline):
    """model.generate() on the same checkpoint, in this process."""
    from transformers import AutoProcessor

    from trident.engines.hf import load_model

    arch, path, _ = pipeline
    model, processor = load_model(path, arch), AutoProcessor.from_pretrained(path)

    def generate(text: str, images: list) -> list[int]:
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return processor.tokenizer, generate


CASES = {
    "one-image": [(224, 224, 1)],
    "two-images": [(224, 224, 1), (300, 200, 2)],
    "text-only": [],
}


@pytest.mark.parametrize("case", list(CASES))
def test_three_processes_equal_generate(pipeline, references, case):
    _, _, stages = pipeline
    tokenizer, generate = references
    images = [make_image(*spec) for spec in CASES[case]]
    text = chat_prompt(tokenizer, len(images), "Describe the picture in detail, please.")
    expected = generate(text, images)
    assert len(expected) == NEW_TOKENS

    emb = stages["encode"]("encode", [png_bytes(i) for i in images]) if images else None
    if emb is not None:
        assert len(emb) < 1024
    kv = stages["prefill"]("prefill", (text, emb, GREEDY))
    assert len(kv) < 1024
    tokens, out_text, reason = stages["decode"]("decode", (kv, GREEDY))

    assert tokens == expected
    assert reason == "length"
    assert out_text == tokenizer.decode(expected, skip_special_tokens=True)
    _assert_pools_drained(stages)


def test_placeholder_mismatch_frees_the_embeddings(pipeline, references):
    _, _, stages = pipeline
    tokenizer, _ = references
    emb = stages["encode"]("encode", [png_bytes(make_image(224, 224, 3))])
    text = chat_prompt(tokenizer, 2, "Two placeholders, one image.")
    with pytest.raises(RuntimeError, match="2 image placeholder.*1 image"):
        stages["prefill"]("prefill", (text, emb, GREEDY))
    _assert_pools_drained(stages)


def _assert_pools_drained(stages, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = {role: s("stats") for role, s in stages.items()}
        busy = {r: st for r, st in stats.items() if st["send_regions_in_use"] or st["recv_regions_in_use"]}
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not busy, busy
    assert all(st["expired"] == 0 for st in stats.values()), stats
