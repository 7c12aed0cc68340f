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

A server drains `ready()` of many streams, runs `vocode_jobs` once, and hands each result back
with `complete()`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from vocoder_service.backends import Backend
from vocoder_service.hifigan import HifiGanConfig
from vocoder_service.token_decoder import TokenDecoder

_stream_ids = itertools.count()


@dataclass(frozen=True)
class ChunkPolicy:
    """Minimum new frames per job: `first_chunk_frames`, then times `growth`, up to the cap.

    After the first job a stream also takes whatever more has become ready, up to the cap, so a
    backlog is vocoded in fewer, cheaper jobs. While other streams share the generator the cap is
    `shared_chunk_frames`: a forward cannot be interrupted, so a new stream's first chunk waits
    for at most one such job instead of one of `max_chunk_frames`.
    """

    first_chunk_frames: int = 4
    growth: float = 2.0
    max_chunk_frames: int = 256
    shared_chunk_frames: int = 32

    def __post_init__(self) -> None:
        if self.first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames must be >= 1 (got {self.first_chunk_frames})")
        if self.growth < 1.0:
            raise ValueError(f"growth must be >= 1 (got {self.growth})")
        if self.max_chunk_frames < self.first_chunk_frames:
            raise ValueError(f"max_chunk_frames ({self.max_chunk_frames}) must be >= "
                             f"first_chunk_frames ({self.first_chunk_frames})")
        if self.shared_chunk_frames < 1:
            raise ValueError(f"shared_chunk_frames must be >= 1 (got {self.shared_chunk_frames})")

    def cap(self, shared: bool = False) -> int:
        """Most new frames in one job."""
        return min(self.shared_chunk_frames, self.max_chunk_frames) if shared else self.max_chunk_frames

    def min_frames(self, job_index: int, shared: bool = False) -> int:
        """Fewest new frames job `job_index` waits for (the end of stream excepted)."""
        size = self.first_chunk_frames * self.growth ** min(job_index, 64)
        return int(min(self.cap(shared), round(size)))


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

    def __init__(self, config: HifiGanConfig, *, policy: ChunkPolicy | None = None,
                 token_decoder: TokenDecoder | None = None, stream_id: str | None = None,
                 stateful: bool = False):
        self.config = config
        self.stateful = stateful
        self.state: list | None = None  # stateful: the generator's carried tails (None: a fresh start)
        self.policy = policy or ChunkPolicy()
        self.token_decoder = token_decoder
        self.stream_id = stream_id if stream_id is not None else f"stream-{next(_stream_ids)}"
        if token_decoder is not None and token_decoder.config.num_mels != config.num_mels:
            raise ValueError(f"token decoder makes {token_decoder.config.num_mels} mels but the "
                             f"generator takes {config.num_mels}")
        self.context_left, self.context_right = config.receptive_field
        self._mel = np.zeros((config.num_mels, 0), np.float32)
        self._mel_base = 0  # absolute frame index of self._mel[:, 0]
        self.frames_received = 0
        self._scheduled = 0  # frames handed out in jobs
        self._tokens = np.zeros(0, np.int64)
        self._tok_base = 0
        self.tokens_received = 0
        self._tok_decoded = 0
        self._arrivals: deque[tuple[int, float]] = deque()  # (frames available, time)
        self.ended = False
        self._boundary_frames = 0  # frames that go out without waiting for right context
        self._boundary_tokens = 0
        self._flushed_at = 0.0
        self._next_job = 0
        self._next_complete = 0
        self.samples_emitted = 0
        self._fresh = True  # stateful: no frames sent since the start or the last boundary
        self._tail_pending = False  # stateful: a boundary asked for the held-back tail
        self._final_issued = False

    # -- input ------------------------------------------------------------------------------
    def push_mel(self, mel: np.ndarray | torch.Tensor) -> None:
        """Append log-mel frames `[num_mels, frames]`."""
        if self.token_decoder is not None:
            raise ValueError("this stream takes speech tokens, not mel frames")
        self._check_open()
        mel = np.asarray(mel.detach().cpu() if isinstance(mel, torch.Tensor) else mel, dtype=np.float32)
        if mel.ndim != 2 or mel.shape[0] != self.config.num_mels:
            raise ValueError(f"mel chunk must be [{self.config.num_mels}, frames] (got {mel.shape})")
        if not np.isfinite(mel).all():
            raise ValueError("mel chunk holds NaN or infinite values")
        self._append_mel(mel)
        self._note_arrival(self.frames_received)

    def push_tokens(self, codes: np.ndarray | list[int]) -> None:
        """Append speech-token codebook indices (decoded to mel lazily in `ready()`)."""
        if self.token_decoder is None:
            raise ValueError("this stream takes mel frames; load a voice with a token decoder for tokens")
        self._check_open()
        codes = self.token_decoder.check_codes(np.asarray(codes).reshape(-1))
        self._tokens = np.concatenate([self._tokens, codes])
        self.tokens_received += codes.size
        decodable = max(0, self.tokens_received - self.token_decoder.lookahead)
        self._note_arrival(decodable * self.token_decoder.config.frames_per_token)

    def flush(self) -> None:
        """End of input: the tail no longer waits for right context; `ready()` returns it."""
        self.ended = True
        self._flushed_at = time.perf_counter()
        total = (self.tokens_received * self.token_decoder.config.frames_per_token
                 if self.token_decoder is not None else self.frames_received)
        self._note_arrival(total)

    def mark_boundary(self) -> None:
        """Vocode everything received so far without waiting for right context; input may
        continue afterwards. For pauses in the input (the next sentence's text has not arrived):
        the audio around this point then differs slightly from offline synthesis."""
        self._check_open()
        if self.token_decoder is not None:
            self._boundary_tokens = self.tokens_received
            self._decode_tokens()
        self._boundary_frames = self.frames_received
        self._tail_pending = self.stateful
        self._note_arrival(self.frames_received)

    # -- jobs -------------------------------------------------------------------------------
    def ready(self, shared: bool = False) -> list[Job]:
        """Jobs whose frames and right context have all arrived, in order; each is issued once.

        `shared`: other streams use the same generator now, so jobs keep to the shared cap.
        """
        if not self._may_be_ready(shared):
            return []  # decoding tokens per message would cost more than vocoding them
        self._decode_tokens()
        if self.stateful:
            return self._ready_stateful(shared)
        jobs = []
        cap = self.policy.cap(shared)
        while (remaining := self.frames_received - self._scheduled) > 0:
            forced = self._boundary_frames - self._scheduled  # due now, whatever the policy
            schedulable = remaining if self.ended else max(remaining - self.context_right, forced)
            want = self.policy.min_frames(self._next_job, shared)
            if schedulable < want and not self.ended and forced <= 0:
                break
            take = want if self._next_job == 0 else max(want, min(schedulable, cap))
            jobs.append(self._make_job(self._scheduled, min(take, schedulable)))
        return jobs

    def complete(self, job: Job, audio: np.ndarray) -> AudioChunk:
        """Turn a job's window audio `[window_frames * hop]` into its chunk; jobs complete in order."""
        if job.stream is not self:
            raise ValueError(f"job belongs to {job.stream.stream_id}, not {self.stream_id}")
        if job.index != self._next_complete:
            raise ValueError(f"job {job.index} completed out of order (expected {self._next_complete})")
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        if job.stateful:
            piece = audio  # exactly the samples the state let out
        else:
            if audio.shape[0] != job.window_frames * job.hop_size:
                raise ValueError(f"audio for job {job.index} has {audio.shape[0]} samples, "
                                 f"expected {job.window_frames * job.hop_size}")
            start = (job.first_frame - job.window_start) * job.hop_size
            piece = audio[start:start + job.num_samples].copy()
        self._next_complete += 1
        first_sample = self.samples_emitted
        self.samples_emitted += piece.shape[0]
        return AudioChunk(piece, first_sample, job.index, self.done, job.ready_at)

    def step(self, backend: Backend) -> list[AudioChunk]:
        """Vocode whatever is ready on `backend` (single-stream convenience)."""
        jobs = self.ready()
        return [self.complete(j, a) for j, a in zip(jobs, vocode_jobs(backend, jobs))]

    @property
    def done(self) -> bool:
        """Input ended and every frame's audio has been handed out."""
        frames = self.frames_received
        if self.token_decoder is not None:
            frames = self.tokens_received * self.token_decoder.config.frames_per_token
        return (self.ended and self._next_complete == self._next_job and self._scheduled == frames
                and (self._final_issued or not self.stateful))

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.ended:
            raise ValueError(f"{self.stream_id} was flushed; no more input is accepted")

    def _note_arrival(self, frames_available: int) -> None:
        if not self._arrivals or frames_available > self._arrivals[-1][0]:
            self._arrivals.append((frames_available, time.perf_counter()))

    def _ready_time(self, frames_needed: int) -> float:
        """When the input that made `frames_needed` frames available arrived."""
        if self.ended and frames_needed > self._arrivals[-1][0]:
            return self._flushed_at  # only the end of stream made these ready
        while len(self._arrivals) > 1 and self._arrivals[0][0] < frames_needed:
            self._arrivals.popleft()  # later jobs need at least as many frames
        return self._arrivals[0][1]

    def _append_mel(self, mel: np.ndarray) -> None:
        self._mel = np.concatenate([self._mel, mel], axis=1)
        self.frames_received += mel.shape[1]

    def _may_be_ready(self, shared: bool) -> bool:
        """Whether the next job could be due, judged from counts alone (no decoding)."""
        dec = self.token_decoder
        if (dec is None or self.ended or self._boundary_frames > self._scheduled
                or self._tail_pending):
            return True
        decodable = max(self.tokens_received - dec.lookahead, self._boundary_tokens)
        frames = decodable * dec.config.frames_per_token
        return frames - self._scheduled - self._lag() >= self.policy.min_frames(self._next_job, shared)

    def _lag(self) -> int:
        """Frames beyond a job's own that must have arrived before it can run."""
        return self.context_right if self._fresh or not self.stateful else 0

    def _decode_tokens(self) -> None:
        dec = self.token_decoder
        if dec is None:
            return
        end = self.tokens_received if self.ended else max(self.tokens_received - dec.lookahead,
                                                          self._boundary_tokens)
        a = self._tok_decoded
        if end <= a:
            return
        ws = max(0, a - dec.left_context)
        we = min(self.tokens_received, end + dec.lookahead)
        window = self._tokens[ws - self._tok_base:we - self._tok_base]
        with torch.inference_mode():
            mel = dec(torch.from_numpy(window)[None])[0].float().numpy()
        fpt = dec.config.frames_per_token
        self._append_mel(mel[:, (a - ws) * fpt:(end - ws) * fpt])
        self._tok_decoded = end
        keep_from = max(0, end - dec.left_context)  # tokens older than this are never read again
        self._tokens = self._tokens[keep_from - self._tok_base:]
        self._tok_base = keep_from

    def _ready_stateful(self, shared: bool) -> list[Job]:
        jobs = []
        cap = self.policy.cap(shared)
        while not self._final_issued:
            remaining = self.frames_received - self._scheduled
            if self.ended or self._tail_pending:
                end = self.frames_received if self.ended else self._boundary_frames
                count = end - self._scheduled
                if count > max(cap, self.context_right + 1):  # long input: capped jobs first
                    jobs.append(self._make_stateful_job(max(cap, self.context_right + 1)))
                    continue
                self._tail_pending = False
                if self.ended or count or not self._fresh:
                    jobs.append(self._make_stateful_job(count, final=True))
                    self._final_issued = self.ended
                continue
            want = self.policy.min_frames(self._next_job, shared) + self._lag()
            if remaining < want:
                break
            # a fresh state's first job stays small: it decides time to first audio
            jobs.append(self._make_stateful_job(want if self._fresh else min(remaining, cap)))
        return jobs

    def _make_stateful_job(self, count: int, final: bool = False) -> Job:
        first, end = self._scheduled, self._scheduled + count
        mel = self._mel[:, first - self._mel_base:end - self._mel_base]
        job = Job(stream=self, index=self._next_job, mel=mel, window_start=first,
                  first_frame=first, num_frames=count, hop_size=self.config.hop_size,
                  pad_left_ok=False, pad_right_ok=False,
                  ready_at=self._flushed_at if self.ended and final else self._ready_time(end),
                  final=final)
        self._next_job += 1
        self._scheduled = end
        self._fresh = final  # after a final job the next one starts from a fresh state
        self._mel = self._mel[:, end - self._mel_base:]
        self._mel_base = end
        return job

    def _make_job(self, first: int, count: int) -> Job:
        end = first + count
        ws = max(0, first - self.context_left)
        we = min(self.frames_received, end + self.context_right)
        mel = self._mel[:, ws - self._mel_base:we - self._mel_base]
        job = Job(stream=self, index=self._next_job, mel=mel, window_start=ws, first_frame=first,
                  num_frames=count, hop_size=self.config.hop_size,
                  pad_left_ok=first - ws == self.context_left, pad_right_ok=we - end == self.context_right,
                  ready_at=self._ready_time(end + self.context_right))
        self._next_job += 1
        self._scheduled = end
        keep_from = max(0, end - self.context_left)  # frames before this are never read again
        self._mel = self._mel[:, keep_from - self._mel_base:]
        self._mel_base = keep_from
        return job


def vocode_jobs(backend: Backend, jobs: list[Job], *, max_batch: int = 64,
                max_pad_ratio: float = 1.25) -> list[np.ndarray]:
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
        if job.stateful:
            out[i], state = backend.run_stream(job.mel[None], job.stream.state, job.final)
            job.stream.state = None if job.final else state
    groups: list[tuple[int, list[int]]] = []  # (window length, job indices)
    order = sorted((i for i in range(len(jobs)) if not jobs[i].stateful),
                   key=lambda i: -jobs[i].window_frames)
    for i in order:
        w, job = jobs[i].window_frames, jobs[i]
        for length, members in groups:
            fits = w == length or ((job.pad_left_ok or job.pad_right_ok) and w * max_pad_ratio >= length)
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
            batch[row] = (mel if pad == 0 else np.pad(mel, ((0, 0), (0, pad) if jobs[i].pad_right_ok
                                                               else (pad, 0)), mode="edge"))
        audio = backend.run(batch)
        for row, i in enumerate(members):
            pad = (length - jobs[i].window_frames) * hop
            left = 0 if pad == 0 or jobs[i].pad_right_ok else pad
            out[i] = audio[row, left:left + jobs[i].window_frames * hop]
    return out  # type: ignore[return-value]
