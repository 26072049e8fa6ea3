"""Audio clips: decoded with soundfile (wav, flac, ogg, mp3), or with PyAV where soundfile cannot, mixed
down to mono float32 and resampled to the model's rate. The length, the sample rate (at most ``MAX_RATE``) and the
channels (at most ``MAX_CHANNELS``) come from the header and are checked before decoding; decoding stops at the
length limit whatever the header said."""

from __future__ import annotations

import io

import numpy as np

from trident.core.errors import InvalidRequest
from trident.core.media import LIMITS, ffmpeg_reason

MAX_RATE = 384_000  # Hz: the highest rate audio is made at
MAX_CHANNELS = 8  # 7.1


def open_audio(raw: bytes, index: int = 0, sample_rate: int = 16000) -> np.ndarray:
    """A clip's mono waveform at ``sample_rate`` (float32 in [-1, 1])."""
    import soundfile

    name = f"audio {index}"
    try:
        info = soundfile.info(io.BytesIO(raw))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        wave, rate = _decode_av(raw, name, sample_rate)
    else:
        _check_shape(info.samplerate, info.channels, name)
        _check_length(info.frames / info.samplerate if info.samplerate else 0.0, name)
        try:
            data, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
        except (soundfile.LibsndfileError, RuntimeError, ValueError) as e:
            raise InvalidRequest(f"{name} could not be decoded as audio: {e}") from None
        wave = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
        _check_length(len(wave) / rate, name)
    if rate != sample_rate:
        wave = resample(wave, rate, sample_rate)
    if wave.size == 0:
        raise InvalidRequest(f"{name} has no samples")
    return np.ascontiguousarray(wave, dtype=np.float32)


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``wave`` (mono float32) from ``rate`` to ``target`` Hz, with FFmpeg's resampler."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave, dtype=np.float32)[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target)
    out = [f.to_ndarray()[0] for f in resampler.resample(frame)] + [f.to_ndarray()[0] for f in resampler.resample(None)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def _check_shape(rate: int | None, channels: int | None, name: str) -> None:
    """A sample rate and a channel count the clip may have (before any sample is decoded)."""
    if rate is not None and not 0 < rate <= MAX_RATE:
        raise InvalidRequest(f"{name} has a sample rate of {rate} Hz; accepted: 1 to {MAX_RATE} Hz")
    if channels is not None and channels > MAX_CHANNELS:
        raise InvalidRequest(f"{name} has {channels} channels; at most {MAX_CHANNELS} are accepted")


def _check_length(seconds: float, name: str) -> None:
    if seconds > LIMITS.audio_max_seconds:
        raise InvalidRequest(
            f"{name} is {seconds:.1f} s long, more than {LIMITS.audio_max_seconds:g} s (media_limits.audio_max_seconds)"
        )


def _decode_av(raw: bytes, name: str, sample_rate: int) -> tuple[np.ndarray, int]:
    """What soundfile cannot read (aac, opus in webm, ...): PyAV, resampled to mono ``sample_rate`` as it
    decodes."""
    import av

    try:
        container = av.open(io.BytesIO(raw), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as e:
        raise InvalidRequest(f"{name} could not be decoded as audio: {ffmpeg_reason(e)}") from None
    with container:
        if not container.streams.audio:
            raise InvalidRequest(f"{name} has no audio stream (container {container.format.name})")
        stream = container.streams.audio[0]
        _check_shape(stream.codec_context.sample_rate or None, stream.codec_context.channels or None, name)
        if stream.duration is not None and stream.time_base is not None:
            _check_length(float(stream.duration * stream.time_base), name)
        elif container.duration is not None:
            _check_length(container.duration / 1_000_000, name)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        parts: list[np.ndarray] = []
        samples = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray()[0])
                    samples += parts[-1].size
                _check_length(samples / sample_rate, name)
            parts += [out.to_ndarray()[0] for out in resampler.resample(None)]
        except InvalidRequest:
            raise
        except (av.FFmpegError, ValueError, OSError) as e:
            if not parts:
                raise InvalidRequest(f"{name} could not be decoded as audio: {ffmpeg_reason(e)}") from None
    if not parts:
        raise InvalidRequest(f"{name} has no audio samples")
    return np.concatenate(parts), sample_rate


AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
"""What an OpenAI ``input_audio`` part may say its ``format`` is."""


def sniff(raw: bytes) -> str | None:
    """The format audio bytes are in, from their first bytes (None: none of :data:`AUDIO_FORMATS`)."""
    if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
        return "wav"
    if raw[:4] == b"fLaC":
        return "flac"
    if raw[:4] == b"OggS":
        return "ogg"
    if raw[:3] == b"ID3" or (len(raw) > 1 and raw[0] == 0xFF and raw[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def input_audio_to_base64(data: str, fmt: str, index: int = 0) -> str:
    """An OpenAI ``input_audio`` part (base64 ``data`` and its ``format``) as the entry model's base64, after
    checking that the bytes are in the format the part names."""
    from trident.core.media import decode_base64

    fmt = (fmt or "").lower()
    if fmt not in AUDIO_FORMATS:
        raise InvalidRequest(f"input_audio {index} has format {fmt!r}; supported: {', '.join(AUDIO_FORMATS)}")
    raw = decode_base64(data, index, "audio")
    found = sniff(raw)
    if found != fmt:
        raise InvalidRequest(
            f"input_audio {index} says format {fmt!r} but its bytes are "
            + (f"{found!r}" if found else "none of " + ", ".join(AUDIO_FORMATS))
        )
    return data.split(",", 1)[1] if data.startswith("data:") else data
