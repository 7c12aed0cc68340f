"""Per-stream chunker: streamed audio equals offline synthesis of the whole input.

Two ways to get there:

- windowed: each job vocodes a run of new frames inside a window padded by the generator's
  receptive field (clipped at the stream's true ends, where the generator's own zero padding is
  what offline synthesis sees too), and keeps only the new frames' samples. Jobs of many
  streams batch into one forward, but every job recomputes its context.
- stateful: each job sends only new frames through the stateful generator (`streaming.py`),
  which keeps every layer's input tail in the stream's state. No work is repeated, jobs of one
  stream must run in order, one stream per call. The last ~receptive-field frames of audio come
  out with the next job; the final job pads them with zeros as offline synthesis does.

A stream owns its schedule (which frames went out in which job) and its output (what was handed
back, on its playout clock); the input side is `stream_input.StreamInput`, chunk sizes come from
`chunking.ChunkPolicy`, and jobs run through `jobs.vocode_jobs`. A server drains `ready()` of
many streams, runs `vocode_jobs` once, and hands each result back with `complete()`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from vocoder_service.backends import Backend
from vocoder_service.chunking import ChunkPolicy
from vocoder_service.hifigan import HifiGanConfig
from vocoder_service.jobs import Job, vocode_jobs
from vocoder_service.playout import Pace, PlayoutClock
from vocoder_service.stream_input import StreamInput
from vocoder_service.token_decoder import TokenDecoder

_stream_ids = itertools.count()


@dataclass(frozen=True)
class AudioChunk:
    """Audio for a contiguous run of frames; `first_sample` counts from the stream's start."""

    audio: np.ndarray  # [num_samples] float32 in [-1, 1]
    first_sample: int
    sequence_number: int
    last: bool
    ready_at: float  # when its input had arrived (for latency accounting)

    @property
    def num_samples(self) -> int:
        return int(self.audio.shape[0])

    def pcm16(self) -> bytes:
        """Mono 16-bit little-endian PCM."""
        return (np.clip(self.audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class VocoderStream:
    """Accepts mel frames or speech tokens in any chunk sizes; yields exact audio jobs."""

    def __init__(
        self,
        config: HifiGanConfig,
        *,
        policy: ChunkPolicy | None = None,
        token_decoder: TokenDecoder | None = None,
        stream_id: str | None = None,
        stateful: bool = False,
    ):
        self.config = config
        self.stateful = stateful
        self.state: list | None = (
            None  # stateful: the generator's carried tails (None: a fresh start)
        )
        self.policy = policy or ChunkPolicy()
        self.input = StreamInput(config, token_decoder)
        self.stream_id = stream_id if stream_id is not None else f"stream-{next(_stream_ids)}"
        self.context_left, self.context_right = config.receptive_field
        self.playout = PlayoutClock(config.sampling_rate)
        # the schedule: frames [0, _scheduled) went out in jobs [0, _next_job)
        self._scheduled = 0
        self._next_job = 0
        self._fresh = True  # stateful: no frames sent since the start or the last boundary
        self._tail_pending = False  # stateful: a boundary asked for the held-back tail
        self._final_issued = False
        self._next_complete = 0  # the output: jobs handed back, in order

    @property
    def token_decoder(self) -> TokenDecoder | None:
        return self.input.token_decoder

    @property
    def ended(self) -> bool:
        return self.input.ended

    @property
    def samples_emitted(self) -> int:
        return self.playout.delivered

    # -- input ------------------------------------------------------------------------------
    def push_mel(self, mel: np.ndarray | torch.Tensor) -> None:
        """Append log-mel frames `[num_mels, frames]`."""
        self.input.push_mel(mel)

    def push_tokens(self, codes: np.ndarray | list[int]) -> None:
        """Append speech-token codebook indices (decoded to mel lazily in `ready()`)."""
        self.input.push_tokens(codes)

    def flush(self) -> None:
        """End of input: the tail no longer waits for right context; `ready()` returns it."""
        self.input.flush()

    def mark_boundary(self) -> None:
        """Vocode everything received so far without waiting for right context; input may
        continue afterwards. For pauses in the input (the next sentence's text has not arrived):
        the audio around this point then differs slightly from offline synthesis."""
        self.input.mark_boundary()
        self._tail_pending = self.stateful

    # -- jobs -------------------------------------------------------------------------------
    def pace(self, now: float, seconds_per_frame: float = 0.0) -> Pace | None:
        """The playout clock at `now` for sizing the next job; None before the first audio."""
        if self.playout.started_at is None:
            return None
        return Pace(
            buffered_s=self.playout.buffered(now),
            seconds_per_frame=seconds_per_frame,
            frame_s=self.config.hop_size / self.config.sampling_rate,
            overhead_frames=0 if self.stateful else self.context_left + self.context_right,
        )

    def ready(
        self, shared: bool = False, now: float | None = None, seconds_per_frame: float = 0.0
    ) -> list[Job]:
        """Jobs whose frames and right context have all arrived, in order; each is issued once.

        `shared`: other streams use the same generator now, so jobs keep to the shared cap.
        `now` (perf_counter) and `seconds_per_frame` (the generator's measured speed): size jobs
        against the playout clock (see `ChunkPolicy`); without `now`, by the policy alone.
        """
        pace = None if now is None else self.pace(now, seconds_per_frame)
        if not self._may_be_ready(shared, pace):
            return []  # decoding tokens per message would cost more than vocoding them
        self.input.decode()
        if self.stateful:
            return self._ready_stateful(shared, pace)
        jobs = []
        received, ended = self.input.frames_received, self.input.ended
        while (remaining := received - self._scheduled) > 0:
            forced = self.input.boundary_frames - self._scheduled  # due now, whatever the policy
            schedulable = remaining if ended else max(remaining - self.context_right, forced)
            want = self.policy.min_frames(self._next_job, shared, pace)
            if schedulable < want and not ended and forced <= 0:
                break
            take = (
                want
                if self._next_job == 0
                else max(want, min(schedulable, self.policy.limit(shared, pace)))
            )
            jobs.append(self._make_job(self._scheduled, min(take, schedulable)))
            pace = pace and pace.after(jobs[-1].num_frames)  # a backlog's later jobs run later
        return jobs

    def complete(self, job: Job, audio: np.ndarray, now: float | None = None) -> AudioChunk:
        """Turn a job's window audio `[window_frames * hop]` into its chunk, delivered at `now`
        (default: the time of the call); jobs complete in order."""
        if job.stream is not self:
            raise ValueError(f"job belongs to {job.stream.stream_id}, not {self.stream_id}")
        if job.index != self._next_complete:
            raise ValueError(
                f"job {job.index} completed out of order (expected {self._next_complete})"
            )
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if job.stateful:
            piece = audio  # exactly the samples the state let out
        else:
            if audio.shape[0] != job.window_frames * job.hop_size:
                raise ValueError(
                    f"audio for job {job.index} has {audio.shape[0]} samples, "
                    f"expected {job.window_frames * job.hop_size}"
                )
            start = (job.first_frame - job.window_start) * job.hop_size
            piece = audio[start : start + job.num_samples].copy()
        self._next_complete += 1
        first_sample = self.playout.delivered
        self.playout.deliver(piece.shape[0], time.perf_counter() if now is None else now)
        return AudioChunk(piece, first_sample, job.index, self.done, job.ready_at)

    def step(self, backend: Backend) -> list[AudioChunk]:
        """Vocode whatever is ready on `backend` (single-stream convenience)."""
        jobs = self.ready()
        return [self.complete(j, a) for j, a in zip(jobs, vocode_jobs(backend, jobs))]

    @property
    def done(self) -> bool:
        """Input ended and every frame's audio has been handed out."""
        return (
            self.input.ended
            and self._next_complete == self._next_job
            and self._scheduled == self.input.frames_total
            and (self._final_issued or not self.stateful)
        )

    # -- internals --------------------------------------------------------------------------
    def _may_be_ready(self, shared: bool, pace: Pace | None) -> bool:
        """Whether the next job could be due, judged from counts alone (no decoding)."""
        if (
            self.token_decoder is None
            or self.input.ended
            or self.input.boundary_frames > self._scheduled
            or self._tail_pending
        ):
            return True
        waiting = self.input.decodable_frames() - self._scheduled - self._lag()
        return waiting >= self.policy.min_frames(self._next_job, shared, pace)

    def _lag(self) -> int:
        """Frames beyond a job's own that must have arrived before it can run."""
        return self.context_right if self._fresh or not self.stateful else 0

    def _ready_stateful(self, shared: bool, pace: Pace | None) -> list[Job]:
        jobs = []
        while not self._final_issued:
            limit = self.policy.limit(shared, pace)
            remaining = self.input.frames_received - self._scheduled
            if self.input.ended or self._tail_pending:
                end = self.input.frames_received if self.input.ended else self.input.boundary_frames
                count = end - self._scheduled
                # Jobs before the final one are as long as ever (a fresh stream's first, then
                # whole quanta), and the final one takes under a quantum: so few input shapes
                # meet a backend that compiles each (`ChunkPolicy.stateful_shapes`), at the
                # cost of one more forward per stream. A short input from a fresh state goes in
                # one final job.
                first = self.policy.min_frames(self._next_job, shared, pace) + self._lag()
                body = count - count % self.policy.frame_quantum
                if self._fresh and count > first:
                    jobs.append(self._make_stateful_job(first))
                    pace = pace and pace.after(jobs[-1].num_frames)
                    continue
                if not self._fresh and body:
                    jobs.append(self._make_stateful_job(self.policy.quantised(min(body, limit))))
                    pace = pace and pace.after(jobs[-1].num_frames)
                    continue
                self._tail_pending = False
                if self.input.ended or count or not self._fresh:
                    jobs.append(self._make_stateful_job(count, final=True))
                    self._final_issued = self.input.ended
                continue
            want = self.policy.min_frames(self._next_job, shared, pace) + self._lag()
            if remaining < want:
                break
            # a fresh state's first job stays small: it decides time to first audio
            count = want if self._fresh else self.policy.quantised(min(remaining, limit))
            jobs.append(self._make_stateful_job(min(count, remaining)))
            pace = pace and pace.after(jobs[-1].num_frames)  # a backlog's later jobs run later
        return jobs

    def _make_stateful_job(self, count: int, final: bool = False) -> Job:
        first, end = self._scheduled, self._scheduled + count
        ready_at = (
            self.input.flushed_at if self.input.ended and final else self.input.ready_time(end)
        )
        job = Job(
            stream=self,
            index=self._next_job,
            mel=self.input.frames(first, end),
            window_start=first,
            first_frame=first,
            num_frames=count,
            hop_size=self.config.hop_size,
            pad_left_ok=False,
            pad_right_ok=False,
            ready_at=ready_at,
            final=final,
        )
        self._next_job += 1
        self._scheduled = end
        self._fresh = final  # after a final job the next one starts from a fresh state
        self.input.release(end)
        return job

    def _make_job(self, first: int, count: int) -> Job:
        end = first + count
        ws = max(0, first - self.context_left)
        we = min(self.input.frames_received, end + self.context_right)
        job = Job(
            stream=self,
            index=self._next_job,
            mel=self.input.frames(ws, we),
            window_start=ws,
            first_frame=first,
            num_frames=count,
            hop_size=self.config.hop_size,
            pad_left_ok=first - ws == self.context_left,
            pad_right_ok=we - end == self.context_right,
            ready_at=self.input.ready_time(end + self.context_right),
        )
        self._next_job += 1
        self._scheduled = end
        self.input.release(max(0, end - self.context_left))  # earlier frames are never read again
        return job
