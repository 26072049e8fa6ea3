"""The vllm engine's encode stage is vLLM's own encoder: an encode-only vLLM engine in the encode worker, no
transformers model in the worker, none in its engine but what vLLM's own model implementation builds, and embeddings that match transformers' encoder.

The engine runs in the vLLM environment (a subprocess of ``TRIDENT_VLLM_PYTHON``); transformers' reference runs
here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from support import audio_bytes, make_frames, make_image, make_wave, png_bytes, video_bytes, vllm_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# In the vLLM environment: transformers' models made impossible before the engine starts (its engine-core
# process is forked from this one, so the ban holds there too), then one encode of the items, one of the first item
# again, the stats, and each item's rows as the cache holds them.
ENCODE = textwrap.dedent('''
    import asyncio, json, sys
    import torch, transformers
    from trident.core.config import TransferConfig, VLLMConfig
    from trident.worker.engines.vllm_encoder import VLLMEncodeEngine
    from trident.core.media import MediaItem
    from trident.core.protocol import STAGES

    model, inputs, out, allowed = sys.argv[1:5]
    built = transformers.PreTrainedModel.__init__

    def banned(self, *args, **kwargs):
        if type(self).__name__ not in allowed.split(","):
            raise RuntimeError(f"transformers model {type(self).__name__} built in the vllm encode worker")
        built(self, *args, **kwargs)
    transformers.PreTrainedModel.__init__ = banned

    items = [MediaItem(open(path, "rb").read(), index, kind) for kind, path, index in json.load(open(inputs))]

    async def main():
        engine = VLLMEncodeEngine(STAGES["encode"], model, VLLMConfig(), TransferConfig(), 1, 64 << 20)
        try:
            first = await engine.encode(items)
            again = await engine.encode(items[:1])
            rows = []
            for item in items:
                claim = engine.cache.claim(engine.cache.key(item.content_id), asyncio.get_running_loop())
                entry = claim.entry
                flat = engine.cache.pool.view(entry.region)
                rows.append(flat.view(getattr(torch, entry.dtype)).view(entry.shape).clone())
                engine.cache.release(entry)
            torch.save(rows, out)
            print(json.dumps({"first": first.report, "again": again.report, "stats": engine.stats()}))
        finally:
            engine.close()

    asyncio.run(main())
''')

# (kind, size: px or seconds, seed, the greatest relative difference from transformers' encoder). An item the
# image processor resizes differs a little: vLLM preprocesses with its own resize (a 300 px image to LLaVA's 224:
# 9e-4); the others match to float32 rounding.
CASES = {
    "llava": [("image", 224, 1, 1e-5), ("image", 300, 2, 5e-3)],
    "qwen2vl": [("image", 112, 1, 1e-5), ("video", 56, 3, 1e-5)],
    "qwen2audio": [("audio", 2, 4, 1e-5)],
}


# transformers classes vLLM's own model implementation builds: its Qwen2-Audio runs transformers' audio encoder
# (vllm/model_executor/models/qwen2_audio.py); no vision class is built anywhere
VLLM_BUILDS = {"qwen2audio": ["Qwen2AudioEncoder"]}


def _media(kind: str, size: int, seed: int) -> bytes:
    if kind == "image":
        return png_bytes(make_image(size, size, seed))
    if kind == "video":
        return video_bytes(make_frames(4, size, size, seed))
    return audio_bytes(make_wave(size, seed=seed))


@pytest.mark.parametrize("arch", list(CASES))
def test_the_vllm_encode_stage_is_vllm_s_encoder(arch, demo_models, tmp_path):
    from trident.worker.engines.hf.stage import HFEncoder, HFModel
    from trident.core.media import MediaItem

    model = demo_models[arch]
    listed = []
    for index, (kind, size, seed, _) in enumerate(CASES[arch]):
        path = tmp_path / f"{index}.{kind}"
        path.write_bytes(_media(kind, size, seed))
        listed.append([kind, str(path), index])
    (tmp_path / "inputs.json").write_text(json.dumps(listed))
    ipc = tempfile.mkdtemp(prefix="vllm-ipc-")  # (short: a Unix socket's path has at most 107 bytes)
    run = subprocess.run(
        [vllm_python(), "-c", ENCODE, model, str(tmp_path / "inputs.json"), str(tmp_path / "rows.pt"),
         ",".join(VLLM_BUILDS.get(arch, []))],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        # (vLLM's ZeroMQ IPC socket files go in a folder of the test's, as a server's go in its workspace)
        env={**os.environ, "PYTHONPATH": str(REPO / "server"), "VLLM_RPC_BASE_PATH": ipc},
    )
    shutil.rmtree(ipc, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    n = len(CASES[arch])
    assert result["first"]["misses"] == n and result["first"]["vision_runs"] == 1, result
    assert result["again"] == dict(result["again"], hits=1, misses=0, vision_runs=0), result  # the one cache
    assert result["stats"]["encoder"] == "vllm" and result["stats"]["images_encoded"] == n, result["stats"]

    rows = torch.load(tmp_path / "rows.pt")
    items = [MediaItem(Path(path).read_bytes(), index, kind) for kind, path, index in listed]
    hf = HFModel(model)
    expected = HFEncoder(hf).encode(list(zip([i.kind for i in items], hf.processor.open(items))))
    for got, want, case in zip(rows, expected.embeddings.split(expected.token_counts), CASES[arch]):
        assert got.shape == want.shape
        difference = float((got - want).norm() / want.norm())
        assert difference < case[3], (case, difference)
