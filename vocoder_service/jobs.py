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


def can_extend(job: Job) -> bool:
    """Whether a stateful job may take its stream's next jobs into its forward: not a stream's
    first (its size decides time to first audio) nor a final one (its tail ends the state)."""
    return job.stateful and not job.final and job.index > 0


def joined(jobs: list[Job]) -> Job:
    """One stream's consecutive non-final stateful jobs as one job: a forward's fixed cost
    (hundreds of small operators) is paid once for all their frames."""
    first = jobs[0]
    if len(jobs) == 1:
        return first
    for a, b in zip(jobs, jobs[1:]):
        if (
            a.final
            or b.final
            or not a.stateful
            or b.stream is not a.stream
            or b.index != a.index + 1
        ):
            raise ValueError("only a stream's consecutive non-final stateful jobs join")
    return Job(
        stream=first.stream,
        index=first.index,
        mel=np.concatenate([j.mel for j in jobs], axis=1),
        window_start=first.window_start,
        first_frame=first.first_frame,
        num_frames=sum(j.num_frames for j in jobs),
        hop_size=first.hop_size,
        pad_left_ok=False,
        pad_right_ok=False,
        ready_at=jobs[-1].ready_at,
    )


def split_joined(audio: np.ndarray, jobs: list[Job]) -> list[np.ndarray]:
    """A joined job's audio, shared out as the jobs one by one would have emitted it: a
    non-final call after a stream's first lets out exactly its new frames' samples, so every
    job but the first gets its own; the first keeps the rest (a fresh state's lag)."""
    later = [j.num_samples for j in jobs[1:]]
    first = audio.shape[0] - sum(later)
    if first < 0:
        raise ValueError(f"{audio.shape[0]} samples cannot hold jobs of {later} samples")
    return np.split(audio, np.cumsum([first, *later[:-1]])) if later else [audio]


def vocode_jobs(
    backend: Backend, jobs: list[Job], *, max_batch: int = 64, max_pad_ratio: float = 1.25
) -> list[np.ndarray]:
    """Run jobs of many streams; returns each job's audio: a windowed job's whole window, a
    stateful job's emitted samples.

    Stateful jobs run on their streams' states: jobs of different streams with the same number
    of new frames and state shapes share a forward (`Backend.run_streams`); a stream's own jobs
    run in list order, each on the state the one before left. Windowed jobs go in
    as few forwards as possible: windows of equal length share a forward; a shorter one joins a
    longer group when it may be padded on a side where it already has full context (which
    leaves its kept samples unchanged) and the padding wastes at most `max_pad_ratio` of its
    length.
    """
    out: list[np.ndarray | None] = [None] * len(jobs)
    for members in _stateful_groups(jobs):
        first = jobs[members[0]]
        if first.final and first.window_frames == 0 and first.stream.state is None:
            out[members[0]] = np.zeros(0, np.float32)  # a fresh state holds nothing back
            continue
        mel = np.stack([jobs[i].mel for i in members])
        pieces, states = backend.run_streams(
            mel, [jobs[i].stream.state for i in members], first.final
        )
        for i, a, state in zip(members, pieces, states):
            out[i] = a
            jobs[i].stream.state = None if jobs[i].final else state
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


def stack_key(job: Job) -> object:
    """What stateful jobs of different streams share when they run in one forward: their new
    frames and a fresh or a carried state of the same shapes. A final job (its tail ends the
    state) and a windowed job have keys of their own."""
    if job.final or not job.stateful:
        return ("alone", id(job))
    state = job.stream.state
    return (job.window_frames, None if state is None else tuple(tuple(t.shape[1:]) for t in state))


def _stateful_groups(jobs: list[Job]) -> list[list[int]]:
    """Stateful job indices in forwards: all in list order, one at a time, when a stream has
    more than one job here; else grouped by what lets streams stack (new frames, a fresh or a
    carried state and its shapes, final or not), final jobs alone."""
    stateful = [i for i, job in enumerate(jobs) if job.stateful]
    if len({id(jobs[i].stream) for i in stateful}) < len(stateful):
        return [[i] for i in stateful]
    groups: dict[object, list[int]] = {}
    for i in stateful:
        groups.setdefault(stack_key(jobs[i]), []).append(i)
    return list(groups.values())
