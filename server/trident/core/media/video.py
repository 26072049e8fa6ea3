"""Video clips: decoded with PyAV and sampled to frames.

Frames are taken at ``LIMITS.video_fps`` from the start, at most ``LIMITS.video_max_frames`` (a longer clip
is sampled evenly over its length). The clip's length and frame size come from its header and are checked
before anything is decoded; decoding then streams, keeping only the sampled frames, and stops at the
length limit whatever the header said. A frame's time never goes back, nor stands still: timestamps that do are
taken as the nominal rate's (at most ``MAX_FPS``), and no clip decodes more frames than ``MAX_FPS`` per second of
its length.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from trident.core.errors import InvalidRequest
from trident.core.media import LIMITS, ffmpeg_reason

MAX_FPS = 240.0  # frames per second a clip is decoded at, at most


@dataclass(frozen=True)
class Video:
    """A sampled clip: RGB frames ``(height, width, 3)`` uint8 and the time of each, in seconds."""

    frames: list[np.ndarray]
    times: list[float]
    duration: float  # seconds, as the header (or the last frame) says

    @property
    def fps(self) -> float:
        """Frames per second of the sampling (what a model with timed positions needs)."""
        if len(self.times) < 2:
            return LIMITS.video_fps
        return (len(self.times) - 1) / max(self.times[-1] - self.times[0], 1e-6)


def sample_times(duration: float, fps: float, max_frames: int) -> list[float]:
    """When to take frames: every ``1/fps`` s from 0, or ``max_frames`` evenly over a longer clip."""
    count = max(1, int(duration * fps))
    if count <= max_frames:
        return [i / fps for i in range(count)]
    return [i * duration / max_frames for i in range(max_frames)]


def open_video(raw: bytes, index: int = 0, budget=None) -> Video:
    """Decode a clip's bytes (mp4, webm, mkv, ...) into its sampled frames; a clip that cannot be decoded,
    has no frames or is over a limit is an :class:`InvalidRequest` naming it. The pixels of the frames it will
    sample are spent from ``budget`` (a :class:`~trident.core.media.PixelBudget`, the request's) first."""
    import av

    name = f"video {index}"
    try:
        container = av.open(io.BytesIO(raw), mode="r", metadata_errors="ignore")
    except av.error.EOFError:
        raise InvalidRequest(f"{name} has no frames (it ends before its first one)") from None
    except (av.FFmpegError, ValueError, OSError) as e:
        raise InvalidRequest(f"{name} could not be decoded as a video: {ffmpeg_reason(e)}") from None
    with container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["no streams"]
            raise InvalidRequest(f"{name} has no video stream (it holds {', '.join(kinds)}; "
                                 f"container {container.format.name})")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > LIMITS.max_pixels:
            raise InvalidRequest(
                f"{name} has {width}x{height} pixels per frame, more than {LIMITS.max_pixels} (media_limits.max_pixels)"
            )
        duration = _header_duration(container, stream)
        if duration is not None and duration > LIMITS.video_max_seconds:
            raise InvalidRequest(
                f"{name} is {duration:.1f} s long, more than {LIMITS.video_max_seconds:g} s (media_limits.video_max_seconds)"
            )
        if duration is None or duration <= 0:  # unknown length: sample at the fps up to the frame limit
            duration = LIMITS.video_max_frames / LIMITS.video_fps
        targets = sample_times(duration, LIMITS.video_fps, LIMITS.video_max_frames)
        if budget is not None:
            budget.spend(len(targets) * width * height, f"{name} ({len(targets)} frames of {width}x{height})")
        return _sample(container, stream, duration, targets, (width, height), name)


def _sample(container, stream, duration: float, targets: list[float], size: tuple[int, int], name: str) -> Video:
    import av

    rate = min(float(stream.average_rate or stream.guessed_rate or 25), MAX_FPS)
    most = int(min(duration, LIMITS.video_max_seconds) * MAX_FPS) + LIMITS.video_max_frames  # frames decoded
    frames: list[np.ndarray] = []
    times: list[float] = []
    half = 0.5 / rate
    decoded = 0
    last = -1.0
    try:
        for frame in container.decode(stream):
            t = float(frame.time) if frame.time is not None else decoded / rate
            if decoded and t <= last:  # a time that goes back or stands still: the nominal rate's
                t = last + 1 / rate
            decoded += 1
            if decoded > most:
                raise InvalidRequest(f"{name} holds more than {most} frames for its {duration:g} s, past {MAX_FPS:g} "
                                     "frames per second")
            if t > LIMITS.video_max_seconds:
                raise InvalidRequest(
                    f"{name} runs past {LIMITS.video_max_seconds:g} s (media_limits.video_max_seconds) although its header "
                    "says otherwise"
                )
            if (frame.width, frame.height) != size:  # (what the limits and the request's budget were checked on)
                raise InvalidRequest(f"{name} has a frame of {frame.width}x{frame.height} pixels where its header "
                                     f"says {size[0]}x{size[1]}")
            last = max(last, t)
            taken = None
            while len(times) < len(targets) and t + half >= targets[len(times)]:
                taken = taken if taken is not None else frame.to_ndarray(format="rgb24")
                frames.append(taken)
                times.append(t)
            if len(times) == len(targets):
                break
    except InvalidRequest:
        raise
    except av.error.EOFError:  # the stream ends early (or holds no packets at all)
        pass
    except (av.FFmpegError, ValueError, OSError, MemoryError) as e:
        if not frames:
            raise InvalidRequest(f"{name} could not be decoded as a video: {ffmpeg_reason(e)}") from None
        # a clip cut short: the frames before the damage are kept (as ffmpeg and vLLM do)
    if not frames:
        raise InvalidRequest(f"{name} has no frames")
    return Video(frames, times, max(duration, last))


def _header_duration(container, stream) -> float | None:
    """The clip's length in seconds as its header says: the stream's, else the container's."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    if stream.frames and stream.average_rate:
        return stream.frames / float(stream.average_rate)
    return None
