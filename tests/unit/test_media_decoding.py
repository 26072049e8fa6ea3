"""Video and audio decoding, sampling and limits; Qwen2-VL video patches; prompts with several kinds of media."""

from __future__ import annotations

import numpy as np
import pytest

from support import audio_bytes, frameless_video, long_header_video, make_frames, make_image, make_wave, video_bytes
from trident.core.errors import InvalidRequest
from trident.core.media import MediaItem, content_id
from trident.core.media.audio import input_audio_to_base64, sniff
from trident.core.media.video import sample_times


def test_sample_times_follow_the_fps_up_to_the_frame_limit():
    assert sample_times(3.0, 2.0, 32) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert sample_times(0.2, 2.0, 32) == [0.0]  # a clip shorter than one interval still gives a frame
    long = sample_times(100.0, 2.0, 32)
    assert len(long) == 32 and long[1] == pytest.approx(100 / 32)


@pytest.mark.parametrize("fmt", ["mp4", "webm", "mkv"])
def test_a_clip_is_sampled_at_the_fps(fmt):
    frames = make_frames(12, 64, 48, 1)
    video = MediaItem(video_bytes(frames, fps=4, fmt=fmt), 0, "video").open()
    assert video.times == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]  # every second frame of a 4 fps clip, at 2 fps
    assert video.frames[0].shape == (48, 64, 3)
    # each sampled frame is the source frame of its time (lossy codecs: nearer to it than to the next one)
    def distance(a, b):
        return np.abs(a.astype(int) - b.astype(int)).mean()

    for i, got in enumerate(video.frames):
        assert distance(got, frames[2 * i]) < distance(got, frames[2 * i + 1])


def test_a_long_clip_is_sampled_evenly_to_the_frame_limit():
    video = MediaItem(video_bytes(make_frames(200, 32, 32, 1), fps=4), 0, "video").open()
    assert len(video.frames) == 32 and video.duration == pytest.approx(50.0)
    assert video.times[:3] == [0.0, 1.5, 3.0]


@pytest.mark.parametrize("raw, message", [
    (lambda: video_bytes(make_frames(12, 64, 48, 1))[:2000], "video 0 could not be decoded as a video"),
    (frameless_video, "video 0 has no frames"),
    (lambda: long_header_video(4), "video 0 is 14400.0 s long, more than 600 s (media_limits.video_max_seconds)"),
    (lambda: audio_bytes(make_wave(1.0)), "video 0 has no video stream (it holds audio"),
])
def test_bad_video_is_refused_with_its_problem(raw, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        MediaItem(raw(), 0, "video").open()


def test_a_request_s_media_decode_within_its_pixel_budget(monkeypatch):
    """Images and sampled video frames together spend the request's budget (media_limits.max_request_pixels), each
    item's share read from its header: the item that would go past it is refused before it is decoded."""
    import trident.core.media

    from support import png_bytes

    monkeypatch.setattr(trident.core.media, "LIMITS", trident.core.media.LIMITS.model_copy(update={"max_request_pixels": 10_000}))
    budget = trident.core.media.PixelBudget()
    for i, (w, h) in enumerate([(64, 48), (80, 80)]):  # 3072 + 6400 pixels
        assert MediaItem(png_bytes(make_image(w, h, 1)), i, "image").open(budget=budget).size == (w, h)
    with pytest.raises(InvalidRequest, match=r"image 2 \(32x32\) would bring the request's decoded media to 10496 "
                       r"pixels, more than 10000 \(media_limits.max_request_pixels\)"):
        MediaItem(png_bytes(make_image(32, 32, 1)), 2, "image").open(budget=budget)
    clip = video_bytes(make_frames(12, 64, 48, 1), fps=4)  # 6 frames sampled at 2 fps: 18432 pixels
    with pytest.raises(InvalidRequest, match=r"video 0 \(6 frames of 64x48\) would bring the request's decoded media "
                       r"to 18432 pixels"):
        MediaItem(clip, 0, "video").open(budget=trident.core.media.PixelBudget())
    monkeypatch.undo()
    assert len(MediaItem(clip, 0, "video").open().frames) == 6  # (within the default budget)


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3"])
def test_audio_decodes_to_mono_at_the_rate(fmt):
    wave = make_wave(2.0, seed=1)
    got = MediaItem(audio_bytes(wave, fmt=fmt), 0, "audio").open(16000)
    assert got.dtype == np.float32 and abs(got.size - 32000) < 1200  # mp3 pads a frame or so
    if fmt == "wav":
        assert np.array_equal(got, wave)  # float samples: exact
    assert sniff(audio_bytes(wave, fmt=fmt)) == fmt


def test_audio_is_resampled_and_mixed_down():
    import io

    import soundfile

    stereo = np.stack([make_wave(1.0, 44100, 1), make_wave(1.0, 44100, 2)], axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, stereo, 44100, format="WAV", subtype="FLOAT")
    got = MediaItem(buf.getvalue(), 0, "audio").open(16000)
    assert got.ndim == 1 and abs(got.size - 16000) <= 32


def test_bad_audio_is_refused_with_its_problem():
    with pytest.raises(InvalidRequest, match=r"audio 0 is 40.0 s long, more than 30 s \(media_limits.audio_max_seconds\)"):
        MediaItem(audio_bytes(make_wave(40.0)), 0, "audio").open()
    with pytest.raises(InvalidRequest, match="audio 1 could not be decoded as audio"):
        MediaItem(b"garbage" * 20, 1, "audio").open()


def test_audio_at_an_absurd_rate_or_with_many_channels_is_refused_before_decoding():
    """A clip whose header claims 50 MHz, or 12 channels: refused before a sample is decoded or resampled."""
    import io

    import soundfile

    for rate, channels, message in ((50_000_000, 1, "audio 0 has a sample rate of 50000000 Hz; accepted: 1 to 384000"),
                                    (16000, 12, "audio 0 has 12 channels; at most 8 are accepted")):
        buf = io.BytesIO()
        soundfile.write(buf, np.zeros((64, channels), np.float32), rate, format="WAV", subtype="FLOAT")
        with pytest.raises(InvalidRequest, match=message):
            MediaItem(buf.getvalue(), 0, "audio").open()


def test_input_audio_format_must_match_its_bytes():
    import base64

    wav = base64.b64encode(audio_bytes(make_wave(0.5))).decode()
    assert input_audio_to_base64(wav, "WAV") == wav
    with pytest.raises(InvalidRequest, match="says format 'mp3' but its bytes are 'wav'"):
        input_audio_to_base64(wav, "mp3")
    with pytest.raises(InvalidRequest, match="has format 'pcm16'"):
        input_audio_to_base64(wav, "pcm16")


def test_content_ids_tell_kinds_apart():
    raw = b"same bytes"
    assert len({content_id(raw, kind) for kind in ("image", "video", "audio")}) == 3


@pytest.fixture(scope="module")
def qwen2vl(demo_models):
    from trident.core.processor import Processor

    return Processor(demo_models["qwen2vl"])


def test_two_equal_frames_patch_like_the_image(qwen2vl):
    """A clip of one frame twice is, in Qwen2-VL's layout, the image of that frame (the image processor repeats
    an image over the temporal patch): the video patches follow the video processor's layout."""
    from trident.core.families.qwen2vl import video_patches

    image = make_image(200, 150, 3)
    frame = np.asarray(image)
    patches, grid = video_patches(qwen2vl, [frame, frame])
    want = qwen2vl.image_processor(images=[image], return_tensors="np")
    assert grid == want["image_grid_thw"][0].tolist()
    assert np.array_equal(patches, want["pixel_values"])
    # an odd frame count is padded with the last frame, as the video processor pads
    odd, grid3 = video_patches(qwen2vl, [frame, frame, frame])
    assert grid3[0] == 2 and np.array_equal(odd[: len(patches)], patches)


def test_prompt_ids_expand_each_kind_in_order(qwen2vl):
    text = qwen2vl.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = qwen2vl.prompt_ids(text, [4, 6], ["image", "video"])
    image, video = qwen2vl.token_ids["image"], qwen2vl.token_ids["video"]
    assert ids.count(image) == 4 and ids.count(video) == 6
    assert ids.index(video) < ids.index(image)  # the prompt's own order, whatever the items' order
    with pytest.raises(InvalidRequest, match="the prompt has 1 video placeholder"):
        qwen2vl.prompt_ids(text, [4], ["image"])
    with pytest.raises(InvalidRequest, match="takes image, video only"):
        qwen2vl.check_placeholders(text, {"image": 1, "video": 1, "audio": 1})


def test_records_check_their_media_kinds():
    from trident.core.errors import MalformedRecord
    from trident.core.protocol import _check_kinds

    _check_kinds(["image", "video", "video", "audio"], 4)
    with pytest.raises(MalformedRecord, match="out of order"):
        _check_kinds(["video", "image"], 2)
    with pytest.raises(MalformedRecord, match="unknown media kinds"):
        _check_kinds(["smell"], 1)
    with pytest.raises(MalformedRecord, match="numbers"):
        _check_kinds(["image"], 2)


def test_qwen2_5vl_positions_follow_the_clip_s_time(demo_models):
    """A clip longer than media_limits.video_max_frames allows at 2 fps is sampled evenly (here 2.5 s per temporal patch):
    the staged prefill, given the seconds the encoder measured, continues as model.generate() given them."""
    import torch

    from trident.worker.engines.hf.stage import HFEncoder, HFModel, HFPrefiller
    from trident.core.processor import SamplingParams

    m = HFModel(demo_models["qwen2_5vl"])
    p = m.processor
    item = MediaItem(video_bytes(make_frames(40, 64, 64, 4), fps=1), 0, "video")
    video, = p.open([item])
    assert len(video.frames) == 32
    emb = HFEncoder(m).encode([("video", video)])
    assert emb.seconds == [pytest.approx(2 / video.fps)] and emb.seconds[0] > 2
    text = p.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]}],
                                           tokenize=False, add_generation_prompt=True)
    ids = p.prompt_ids(text, emb.token_counts, emb.kinds)
    inputs = p.media_inputs("video", [video])
    tids = torch.tensor([ids])
    types = (tids == p.token_ids["video"]).int() * 2
    with torch.inference_mode():
        out = m.model.generate(input_ids=tids, attention_mask=torch.ones_like(tids), mm_token_type_ids=types,
                               pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"],
                               second_per_grid_ts=torch.tensor(inputs["second_per_grid_ts"]), max_new_tokens=1, do_sample=False)
    params = SamplingParams(max_tokens=1, temperature=0)
    first = HFPrefiller(m).prefill(ids, emb, params, 0)
    assert first.first_token == int(out[0, -1])
    # without the seconds the positions (and the rope delta the decode side continues with) differ
    emb.seconds = None
    assert HFPrefiller(m).prefill(ids, emb, params, 0).rope_delta != first.rope_delta
