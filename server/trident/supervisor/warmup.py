"""Warm-up: one small request with a media item through each loaded entry model before the server says it is
ready, so that the first client request pays none of the first-call costs."""

from __future__ import annotations

import time
from pathlib import Path

from trident.core.families import family_of
from trident.core.protocol import MODES


def warm_up(http_url: str, model_path: str, modes, instances: dict[str, int], out) -> None:
    """One small request with a media item (of the first kind the model takes: an image, a video clip or an
    audio clip) through each loaded entry model (one per instance of its busiest stage), so that the first
    client request pays none of the first-call costs: NIXL connections between the workers, torch's, PIL's
    and FFmpeg's lazy set-up, Triton's and PyTriton's first call of each model."""
    import json
    import urllib.request
    from types import SimpleNamespace

    t0 = time.monotonic()
    config = json.loads((Path(model_path) / "config.json").read_text())  # (transformers takes seconds to import)
    family = family_of(SimpleNamespace(model_type=config.get("model_type")), model_path)
    kind = family.modalities[0]
    params = json.dumps({"max_tokens": 2, "temperature": 0})
    for mode in modes:
        for i in range(max(1, *(instances.get(stage, 1) for stage in MODES[mode]))):  # (0: they joined)
            body = json.dumps({
                # (no newline after the placeholder: vLLM 0.32's Gemma 3 processor loses an image followed by one)
                "text_input": f"{family.placeholders[kind].text} Warm-up.", kind: [warm_up_item(kind, i)],
                "sampling_parameters": params,
            }).encode()
            request = urllib.request.Request(
                f"{http_url}/v2/models/{mode}/generate", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as reply:
                    reply.read()
            except Exception as e:  # serve anyway: the first request will show what is wrong
                out(f"[trident] warm-up request through {mode} failed: {e}")
                break
    out(f"[trident] warmed up {', '.join(modes)} in {time.monotonic() - t0:.1f} s")


def warm_up_item(kind: str, i: int) -> str:
    """A small base64 item of ``kind``, different for each ``i`` (so that no cache answers the warm-up)."""
    import base64
    import io

    import numpy as np

    buf = io.BytesIO()
    if kind == "audio":
        import soundfile

        t = np.arange(16000) / 16000
        soundfile.write(buf, (0.3 * np.sin(2 * np.pi * (200 + 10 * i) * t)).astype(np.float32), 16000, format="WAV")
    elif kind == "video":
        import av

        with av.open(buf, mode="w", format="mp4") as out:
            stream = out.add_stream("mpeg4", rate=2)
            stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
            for level in (40, 200):
                frame = np.full((64, 64, 3), (17 * i + level) % 256, dtype=np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
    else:
        from PIL import Image

        Image.new("RGB", (64, 64), (17 * i % 256, 80, 160)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
