"""Vocodes the ready jobs of many streams together, one batched forward per backend at a time,
the stream whose listener runs out of audio first served first."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from vocoder_service.backends import Backend
from vocoder_service.jobs import Job, vocode_jobs


@dataclass(frozen=True)
class JobResult:
    """A job's window audio and what it cost."""

    audio: np.ndarray
    compute_ms: float  # this job's share of its forward, by frames
    queue_ms: float  # submitted -> its forward started
    batch_size: int
    started: float  # its forward's start and end, time.perf_counter()
    finished: float


@dataclass
class _Pending:
    job: Job
    future: asyncio.Future
    submitted: float

    @property
    def deadline(self) -> float:
        """When the job's stream runs out of audio (its playout deadline); for a stream with no
        audio out yet, when this job was submitted: its listener has been waiting since."""
        runs_out = self.job.stream.playout.runs_out_at
        return self.submitted if runs_out is None else runs_out


_EWMA = 0.2  # weight of the newest forward in the measured speed


class Batcher:
    """Collects jobs while a forward runs; the next forward takes what was collected, earliest
    playout deadline first."""

    def __init__(
        self,
        backend: Backend,
        max_batch: int = 32,
        max_batch_frames: int = 256,
        on_batch=None,
        max_first_batch: int | None = None,
    ):
        max_first_batch = max_batch if max_first_batch is None else max_first_batch
        if min(max_batch, max_batch_frames, max_first_batch) < 1:
            raise ValueError(
                f"max_batch, max_batch_frames and max_first_batch must be >= 1 (got "
                f"{max_batch}, {max_batch_frames}, {max_first_batch})"
            )
        self.backend = backend
        self.max_batch = max_batch
        # Streams per forward while first jobs wait. Where a forward's time grows with its frames
        # (one CPU core), batching first jobs only makes the earliest wait for the later ones.
        self.max_first_batch = max_first_batch
        self.max_batch_frames = max_batch_frames
        self.on_batch = on_batch  # callback(batch_size, seconds) for metrics
        self.seconds_per_frame = 0.0  # measured generator speed per work frame (0: none yet)
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocode")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, job: Job) -> asyncio.Future:
        """Queue `job`; the future resolves to its JobResult. Cancel it to drop the job."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(job, future, time.perf_counter()))
        self._wake.set()
        return future

    def _take(self, live: list[_Pending]) -> tuple[list[_Pending], list[_Pending]]:
        """Earliest deadline first: one job per stream per forward (a stream's jobs run in
        order), up to a frame budget, so a long stream's backlog never holds up the others for
        more than one of its own chunks. While the most urgent job is a stream's first, the
        forward carries first jobs only: a forward cannot be interrupted, and a first chunk's
        wait is time to first audio."""
        live = sorted(live, key=lambda p: (p.deadline, p.submitted))
        firsts = bool(live) and live[0].job.index == 0
        limit = self.max_first_batch if firsts else self.max_batch
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        streams: set[int] = set()
        frames = 0
        for p in live:
            stream = id(p.job.stream)
            fits = frames + p.job.work_frames <= self.max_batch_frames or not batch
            if (firsts and p.job.index > 0) or stream in streams or len(batch) >= limit or not fits:
                rest.append(p)
                continue
            batch.append(p)
            streams.add(stream)
            frames += p.job.work_frames
        return batch, rest

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._take(
                    [p for p in self._pending if not p.future.cancelled()]
                )
                if not batch:
                    break
                started = time.perf_counter()
                try:
                    audio = await loop.run_in_executor(
                        self._executor, vocode_jobs, self.backend, [p.job for p in batch]
                    )
                except Exception as exc:  # noqa: BLE001 - hand the failure to every waiter
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                finished = time.perf_counter()
                seconds = finished - started
                if self.on_batch is not None:
                    self.on_batch(len(batch), seconds)
                frames = sum(p.job.work_frames for p in batch)
                if frames:
                    per_frame = seconds / frames
                    self.seconds_per_frame = (
                        per_frame
                        if not self.seconds_per_frame
                        else (1 - _EWMA) * self.seconds_per_frame + _EWMA * per_frame
                    )
                for p, a in zip(batch, audio):
                    if not p.future.done():
                        p.future.set_result(
                            JobResult(
                                a,
                                1e3 * seconds * p.job.work_frames / max(frames, 1),
                                1e3 * (started - p.submitted),
                                len(batch),
                                started,
                                finished,
                            )
                        )
                # let the streams hand their audio out (their playout clocks move) before the
                # next pick by deadline
                await asyncio.sleep(0)
