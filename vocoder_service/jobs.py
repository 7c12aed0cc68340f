"""Jobs: runs of one stream's mel frames to vocode, and running many streams' jobs on a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vocoder_service.backends import Backend

if TYPE_CHECKING:
    from vocoder_service.stream import VocoderStream


@dataclass(eq=False)
class Job:
    """One window of mel to vocode for one stream."""

    stream: VocoderStream
    index: int
    mel: np.ndarray  # [num_mels, window_frames] float32
    window_start: int  # absolute frame of mel[:, 0]
    first_frame: int  # first frame whose audio this job emits
    num_frames: int
    hop_size: int
    pad_left_ok: bool  # full left context: frames added on the left change nothing kept
    pad_right_ok: bool
    ready_at: float  # perf_counter() of the input that made this job ready
    final: bool = False  # stateful: end of input (or a boundary): the held-back tail comes out

    @property
    def stateful(self) -> bool:
        """New frames only, through the stream's state."""
        return self.stream.stateful

    @property
    def window_frames(self) -> int:
        return self.mel.shape[1]

    @property
    def work_frames(self) -> int:
        """Frames of generator work: the window, or the new frames plus a final call's tail."""
        tail = self.stream.context_right if self.final else 0
        return self.window_frames + tail

    @property
    def num_samples(self) -> int:
        return self.num_frames * self.hop_size


def vocode_jobs(
    backend: Backend, jobs: list[Job], *, max_batch: int = 64, max_pad_ratio: float = 1.25
) -> list[np.ndarray]:
    """Run jobs of many streams; returns each job's audio: a windowed job's whole window, a
    stateful job's emitted samples.

    Stateful jobs run one by one in list order, each on its stream's state. Windowed jobs go in
    as few forwards as possible: windows of equal length share a forward; a shorter one joins a
    longer group when it may be padded on a side where it already has full context (which
    leaves its kept samples unchanged) and the padding wastes at most `max_pad_ratio` of its
    length.
    """
    out: list[np.ndarray | None] = [None] * len(jobs)
    for i, job in enumerate(jobs):  # in order: a stream's jobs build on each other's state
        if job.stateful and job.final and job.window_frames == 0 and job.stream.state is None:
            out[i] = np.zeros(0, np.float32)  # a fresh state holds nothing back
        elif job.stateful:
            out[i], state = backend.run_stream(job.mel[None], job.stream.state, job.final)
            job.stream.state = None if job.final else state
    groups: list[tuple[int, list[int]]] = []  # (window length, job indices)
    order = sorted(
        (i for i in range(len(jobs)) if not jobs[i].stateful), key=lambda i: -jobs[i].window_frames
    )
    for i in order:
        w, job = jobs[i].window_frames, jobs[i]
        for length, members in groups:
            fits = w == length or (
                (job.pad_left_ok or job.pad_right_ok) and w * max_pad_ratio >= length
            )
            if fits and len(members) < max_batch:
                members.append(i)
                break
        else:
            groups.append((w, [i]))
    hop = backend.hop_size
    for length, members in groups:
        batch = np.empty((len(members), backend.num_mels, length), np.float32)
        for row, i in enumerate(members):
            mel, pad = jobs[i].mel, length - jobs[i].window_frames
            # edge values keep padded activations ordinary; they never reach kept samples
            batch[row] = (
                mel
                if pad == 0
                else np.pad(
                    mel, ((0, 0), (0, pad) if jobs[i].pad_right_ok else (pad, 0)), mode="edge"
                )
            )
        audio = backend.run(batch)
        for row, i in enumerate(members):
            pad = (length - jobs[i].window_frames) * hop
            left = 0 if pad == 0 or jobs[i].pad_right_ok else pad
            out[i] = audio[row, left : left + jobs[i].window_frames * hop]
    return out  # type: ignore[return-value]
