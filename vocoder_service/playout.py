"""The listener's clock: how much audio a stream has delivered, and when it runs out."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Pace:
    """What bounds a stream's next chunk: the audio its listener still holds and the generator's
    measured speed."""

    buffered_s: float  # audio delivered and not yet played (0 when it has run out)
    seconds_per_frame: float  # generator compute per mel frame (0: not measured yet)
    frame_s: float  # audio per mel frame: hop_size / sample rate
    overhead_frames: int = 0  # frames of compute a job costs beyond its own (a window's context)

    def after(self, frames: int) -> Pace:
        """The pace once a job of `frames` already-arrived frames has been vocoded: the listener
        played on while it ran, then holds its audio too."""
        compute_s = (frames + self.overhead_frames) * self.seconds_per_frame
        return replace(
            self, buffered_s=max(0.0, self.buffered_s - compute_s) + frames * self.frame_s
        )


class PlayoutClock:
    """Playback starts when the first audio leaves and then runs in real time, so the listener
    runs out of audio at `first audio time + audio delivered`: the stream's playout deadline."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate
        self.started_at: float | None = None  # when the first audio left
        self.delivered = 0  # samples handed out

    def deliver(self, samples: int, now: float) -> None:
        """Audio left for the listener at `now`."""
        if self.started_at is None and samples > 0:
            self.started_at = now
        self.delivered += samples

    @property
    def runs_out_at(self) -> float | None:
        """When the listener has played everything delivered; None before the first audio."""
        if self.started_at is None:
            return None
        return self.started_at + self.delivered / self.sample_rate

    def buffered(self, now: float) -> float:
        """Seconds of delivered audio not yet played at `now`."""
        end = self.runs_out_at
        return 0.0 if end is None else max(0.0, end - now)
