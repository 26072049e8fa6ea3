"""Test images and prompts."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB test image."""
    rng = np.random.default_rng(seed)
    base = np.fromfunction(lambda y, x, c: (x * (seed + 1) + y * 3 + c * 50) % 256, (height, width, 3))
    noise = rng.integers(0, 32, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def chat_prompt(tokenizer, n_images: int, text: str) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def make_frames(count: int, width: int, height: int, seed: int) -> list[np.ndarray]:
    """Deterministic RGB frames that change over time (so a sampled frame is told from its neighbours)."""
    return [np.asarray(make_image(width, height, seed + 7 * i)) for i in range(count)]


def video_bytes(frames: list[np.ndarray], fps: int = 4, fmt: str = "mp4", codec: str | None = None) -> bytes:
    """A clip of ``frames`` encoded with PyAV (mp4: mpeg4, webm: vp8, mkv: ffv1)."""
    import io as _io
    from fractions import Fraction

    import av

    codec = codec or {"mp4": "mpeg4", "webm": "libvpx", "mkv": "ffv1"}[fmt]
    buf = _io.BytesIO()
    with av.open(buf, mode="w", format={"mkv": "matroska"}.get(fmt, fmt)) as out:
        stream = out.add_stream(codec, rate=Fraction(fps))
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv444p" if codec == "ffv1" else "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "2"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_wave(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A deterministic mono clip: two tones and a little noise, float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.4 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)
    return (wave + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def audio_bytes(wave: np.ndarray, rate: int = 16000, fmt: str = "wav") -> bytes:
    """``wave`` written as wav (float samples: decodes back exactly), flac, ogg or mp3 with soundfile (long ogg
    clips crashed libsndfile's Vorbis encoder here: keep them short)."""
    import io as _io

    import soundfile

    buf = _io.BytesIO()
    subtype = {"wav": "FLOAT", "flac": "PCM_16", "ogg": "VORBIS", "mp3": "MPEG_LAYER_III"}[fmt]
    soundfile.write(buf, wave, rate, format=fmt.upper() if fmt != "ogg" else "OGG", subtype=subtype)
    return buf.getvalue()


def media_prompt(tokenizer, kinds: list[str], text: str) -> str:
    """A chat prompt with one content part per media item (``image``, ``video``, ``audio``), then ``text``."""
    content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def decoded_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of a clip, decoded with PyAV (the test clips are made at the server's sampling rate)."""
    import io as _io

    import av

    with av.open(_io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def long_header_video(hours: int = 4) -> bytes:
    """A small mp4 whose frames are an hour apart: its header says ``hours`` hours."""
    import io as _io
    from fractions import Fraction

    import av

    buf = _io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=Fraction(1, 3600))
        stream.height, stream.width, stream.pix_fmt = 48, 64, "yuv420p"
        for f in make_frames(hours, 64, 48, 3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def frameless_video() -> bytes:
    """A Matroska file with a video stream and no frames."""
    import io as _io

    import av

    buf = _io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        stream = out.add_stream("ffv1", rate=4)
        stream.height, stream.width, stream.pix_fmt = 48, 64, "yuv420p"
        out.start_encoding()
    return buf.getvalue()


def media_cases() -> dict:
    """The media end-to-end cases by family: ``case -> [(kind, bytes)]``. Clips are made at the servers'
    sampling rate (media_limits.video_fps 2), so every frame is sampled. ``short-video`` has fewer temporal patches than
    its frames' larger side has merged patches; the other clips have more, where transformers 5.19's Qwen2-VL
    positions after a clip differ from Qwen's (and vLLM's): see the vLLM media test."""
    video = ("video", video_bytes(make_frames(10, 96, 64, 2), fps=2))
    short_video = ("video", video_bytes(make_frames(4, 224, 168, 6), fps=2))
    image_and_video = [("image", png_bytes(make_image(200, 150, 3))),
                       # 7 frames: the last temporal patch is padded with the last frame
                       ("video", video_bytes(make_frames(7, 80, 80, 5), fps=2, fmt="webm"))]
    return {
        "qwen2vl": {
            "one-video": [video], "image-and-video": image_and_video,
            "short-video": [short_video],
        },
        "qwen2_5vl": {
            "one-video": [video],
            "image-and-video": [image_and_video[0], ("video", video_bytes(make_frames(7, 80, 80, 5), fps=2, fmt="mkv"))],
            "short-video": [short_video],
        },
        "qwen3vl": {
            "one-video": [video], "image-and-video": image_and_video,  # (7 frames: the last patch's time is its one frame's)
            "short-video": [short_video],
        },
        "qwen2_5omni": {  # (one request with an image, a clip and an audio clip; each kind alone)
            "image-video-audio": [image_and_video[0], image_and_video[1], ("audio", audio_bytes(make_wave(2.0, seed=1)))],
            "one-video": [video],
            "two-audio": [("audio", audio_bytes(make_wave(1.5, seed=2))),
                          ("audio", audio_bytes(make_wave(3.2, seed=3), fmt="flac"))],
        },
        "qwen2audio": {
            "one-audio": [("audio", audio_bytes(make_wave(2.0, seed=1)))],
            "two-audio": [("audio", audio_bytes(make_wave(1.5, seed=2))),
                          ("audio", audio_bytes(make_wave(3.2, seed=3), fmt="flac"))],
            "text-only": [],
        },
    }


def bad_media(arch: str, prompt) -> dict:
    """Bad media for a family: problem -> (text, media, what the 400 must say); ``prompt(kinds)`` writes a
    chat prompt with those placeholders."""
    from trident.core.families import FAMILIES

    video = video_bytes(make_frames(10, 96, 64, 2), fps=2)
    one_video, one_audio = prompt(["video"]), prompt(["audio"])
    if arch == "qwen2_5omni":  # (it takes audio too: the vision cases, less a modality it does not take, and a long clip)
        cases = bad_media("qwen2vl", prompt)
        del cases["audio to a vision model"]
        image = FAMILIES[arch].placeholders["image"].text
        cases["placeholder mismatch"] = (prompt(["image"]), {"video": [b64(video)]},
                                         f"the prompt has 1 image placeholder(s) {image!r} but the request carries 0 image(s)")
        cases["10-minute clip"] = bad_media("qwen2audio", prompt)["10-minute clip"]
        return cases
    if arch != "qwen2audio":
        return {
            "truncated mp4": (one_video, {"video": [b64(video[: len(video) // 3])]}, "video 0 could not be decoded as a video"),
            "zero frames": (one_video, {"video": [b64(frameless_video())]}, "video 0 has no frames"),
            "4-hour header": (one_video, {"video": [b64(long_header_video(4))]},
                              "video 0 is 14400.0 s long, more than 600 s (media_limits.video_max_seconds)"),
            "audio as video": (one_video, {"video": [b64(audio_bytes(make_wave(1.0)))]}, "video 0 has no video stream"),
            "placeholder mismatch": (prompt(["image"]), {"video": [b64(video)]},
                                     "the prompt has 1 image placeholder(s) '<|vision_start|><|image_pad|><|vision_end|>' "
                                     "but the request carries 0 image(s)"),
            "audio to a vision model": (one_video, {"video": [b64(video)], "audio": [b64(audio_bytes(make_wave(1.0)))]},
                                        f"the request carries audio but this model ({arch}) takes image, video only"),
            "too many videos": (one_video, {"video": [b64(video)] * 5}, "carries 5 videos; at most 4 are accepted"),
        }
    return {
        "10-minute clip": (one_audio, {"audio": [b64(audio_bytes(make_wave(600.0, seed=4), fmt="mp3"))]},
                           "audio 0 is 600.0 s long, more than 30 s (media_limits.audio_max_seconds)"),
        "not audio": (one_audio, {"audio": [b64(b"RIFF but not really a wave file at all")]},
                      "audio 0 could not be decoded as audio"),
        "placeholder mismatch": (one_audio, {"audio": [b64(audio_bytes(make_wave(1.0)))] * 2},
                                 "the prompt has 1 audio placeholder(s)"),
        "video to an audio model": (one_audio, {"audio": [b64(audio_bytes(make_wave(1.0)))], "video": [b64(video)]},
                                    "the request carries video but this model (qwen2audio) takes audio only"),
    }
