"""How many mel frames each of a stream's jobs takes: small first, then as the buffer allows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from vocoder_service.playout import Pace


class ForwardShape(NamedTuple):
    """A stateful forward's input shape: streams stacked, new frames each, and whether it ends
    the streams (final) or starts them (fresh: no carried state)."""

    streams: int
    frames: int
    final: bool = False
    fresh: bool = False


@dataclass(frozen=True)
class ChunkPolicy:
    """Minimum new frames per job: `first_chunk_frames`, then times `growth`, up to the cap.

    After the first job a stream also takes whatever more has become ready, up to the cap, so a
    backlog is vocoded in fewer, cheaper jobs. While other streams share the generator the cap is
    `shared_chunk_frames`: a forward cannot be interrupted, so a new stream's first chunk waits
    for at most one such job instead of one of `max_chunk_frames`.

    Once a stream's audio is playing, its jobs also follow the playout clock (`Pace`), so that a
    job is vocoded before the listener runs out, using at most `buffer_share` of the audio it
    still holds: a job takes no more frames than it can vocode in that time (at the measured
    speed), and waits for no more than it can gather (at the playout rate) and vocode in it.
    Never fewer than `first_chunk_frames`, nor than a job needs for its audio to outlast its
    compute (a window's context makes small windowed jobs cost more than they play): chunks
    grow as the buffer grows and shrink when it runs low.
    """

    first_chunk_frames: int = 4
    growth: float = 2.0
    max_chunk_frames: int = 256
    shared_chunk_frames: int = 32
    buffer_share: float = 0.5
    # stateful jobs after a stream's first take new frames in multiples of this: oneDNN
    # compiles its convolutions once per input shape (tens of ms to hundreds, bench/README.md),
    # and streams whose jobs are equally long share a forward
    frame_quantum: int = 4
    # new frames in a stream's first job while no other stream shares the generator (None: as
    # `first_chunk_frames`). Alone, a stream's next job is not held up behind others', so its
    # first chunk can be a single frame, heard a few speech tokens sooner; under load more small
    # forwards at each stream's start made chunks late (bench/README.md). Job 1 grows from
    # `first_chunk_frames` as ever.
    first_chunk_frames_alone: int | None = None

    def __post_init__(self) -> None:
        if self.first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames must be >= 1 (got {self.first_chunk_frames})")
        alone = self.first_chunk_frames_alone
        if alone is not None and not 1 <= alone <= self.max_chunk_frames:
            raise ValueError(
                f"first_chunk_frames_alone must be in [1, max_chunk_frames={self.max_chunk_frames}]"
                f" (got {alone})"
            )
        if self.growth < 1.0:
            raise ValueError(f"growth must be >= 1 (got {self.growth})")
        if self.max_chunk_frames < self.first_chunk_frames:
            raise ValueError(
                f"max_chunk_frames ({self.max_chunk_frames}) must be >= "
                f"first_chunk_frames ({self.first_chunk_frames})"
            )
        if self.shared_chunk_frames < 1:
            raise ValueError(f"shared_chunk_frames must be >= 1 (got {self.shared_chunk_frames})")
        if self.frame_quantum < 1:
            raise ValueError(f"frame_quantum must be >= 1 (got {self.frame_quantum})")
        if not 0.0 < self.buffer_share <= 1.0:
            raise ValueError(f"buffer_share must be in (0, 1] (got {self.buffer_share})")

    def cap(self, shared: bool = False) -> int:
        """Most new frames in one job, whatever the buffer."""
        return (
            min(self.shared_chunk_frames, self.max_chunk_frames)
            if shared
            else self.max_chunk_frames
        )

    def limit(self, shared: bool = False, pace: Pace | None = None) -> int:
        """Most new frames in one job: the cap, and what can be vocoded in time under `pace`."""
        cap = self.cap(shared)
        if pace is None:
            return cap
        return max(self._floor(shared, pace), min(cap, frames_within(pace, self.buffer_share)))

    def min_frames(self, job_index: int, shared: bool = False, pace: Pace | None = None) -> int:
        """Fewest new frames job `job_index` waits for (the end of stream excepted)."""
        if job_index == 0 and not shared and self.first_chunk_frames_alone is not None:
            return self.first_chunk_frames_alone
        size = round(self.first_chunk_frames * self.growth ** min(job_index, 64))
        if pace is not None:  # wait no longer than the buffer allows
            size = min(size, frames_within(pace, self.buffer_share, gather=True))
        return int(max(self._floor(shared, pace), min(self.limit(shared, pace), size)))

    def quantised(self, frames: int) -> int:
        """`frames` rounded down to a multiple of `frame_quantum` (never below one quantum)."""
        return max(self.frame_quantum, frames - frames % self.frame_quantum)

    def stateful_shapes(
        self, lag: int, max_batch_frames: int, max_streams: int = 4
    ) -> list[ForwardShape]:
        """The stateful forwards this policy's streams mostly make, for warming a backend whose
        library compiles each input shape on first use (oneDNN: 40-350 ms a shape on the
        project's CPU): a fresh stream's first job (its own frames, alone or shared, and `lag`
        of right context), later jobs in whole quanta up to the shared cap, stacked up to
        `max_streams` streams within `max_batch_frames`, and final jobs (always under a
        quantum, see `VocoderStream`). Longer jobs (a stream alone), larger stacks and a short
        input's only job compile when they first come."""
        firsts = {self.first_chunk_frames, self.first_chunk_frames_alone or self.first_chunk_frames}
        shapes = [ForwardShape(1, first + lag, fresh=True) for first in sorted(firsts)]
        for frames in range(self.frame_quantum, self.cap(shared=True) + 1, self.frame_quantum):
            stack = max(1, min(max_streams, max_batch_frames // frames))
            shapes += [ForwardShape(n, frames) for n in range(1, stack + 1)]
        return shapes + [ForwardShape(1, n, final=True) for n in range(self.frame_quantum)]

    def _floor(self, shared: bool, pace: Pace | None) -> int:
        """Fewest frames a job takes: the first chunk's, and enough to keep up; at most the cap."""
        keep_up = 0 if pace is None else frames_to_keep_up(pace, self.buffer_share)
        return min(self.cap(shared), max(self.first_chunk_frames, keep_up))


def frames_within(pace: Pace, share: float, gather: bool = False) -> int:
    """Most frames n a job can vocode, in (n + overhead) * seconds_per_frame, and with `gather`
    first gather at the playout rate, in n * frame_s, within `share` of the buffered audio."""
    budget = share * pace.buffered_s - pace.overhead_frames * pace.seconds_per_frame
    per_frame = pace.seconds_per_frame + (pace.frame_s if gather else 0.0)
    if per_frame <= 0:
        return 1 << 30  # nothing measured: no bound
    return max(0, math.floor(budget / per_frame))


def frames_to_keep_up(pace: Pace, share: float) -> int:
    """Fewest frames n whose audio outlasts their compute `1 / share` times over: below that a
    job spends more of the generator on its overhead (a window's context) than the listener
    gains, and a stream that is short of audio falls further behind."""
    if pace.overhead_frames == 0 or pace.seconds_per_frame == 0:
        return 0
    gain = share * pace.frame_s - pace.seconds_per_frame  # per frame of the job
    if gain <= 0:
        return 1 << 30  # the generator cannot keep up at all: the largest jobs waste least
    return math.ceil(pace.overhead_frames * pace.seconds_per_frame / gain)
