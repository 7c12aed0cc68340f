"""Vocodes the ready jobs of many streams together, one batched forward per backend at a time,
the stream whose listener runs out of audio first served first, each stream's waiting chunks
joined into one job where its listener can afford the wait."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from vocoder_service.backends import Backend
from vocoder_service.jobs import Job, can_extend, joined, split_joined, stack_key, vocode_jobs


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
    """Collects jobs while forwards run; each free worker's next forward takes what was
    collected, earliest playout deadline first, from streams with no forward in flight."""

    def __init__(
        self,
        backend: Backend,
        max_batch: int = 32,
        max_batch_frames: int = 256,
        on_batch=None,
        max_first_batch: int | None = None,
        workers: int = 1,
        max_join_frames: int | None = None,
    ):
        max_first_batch = max_batch if max_first_batch is None else max_first_batch
        if min(max_batch, max_batch_frames, max_first_batch, workers) < 1:
            raise ValueError(
                f"max_batch, max_batch_frames, max_first_batch and workers must be >= 1 (got "
                f"{max_batch}, {max_batch_frames}, {max_first_batch}, {workers})"
            )
        # forwards in flight at once, each on its own thread and streams (a stream's jobs run
        # in order): on a CPU, one per core the generator may use
        self.workers = workers
        # most frames in one stream's joined chunks: a forward cannot be interrupted, so this
        # bounds how long a new stream's first chunk waits behind another's backlog
        self.max_join_frames = max_batch_frames if max_join_frames is None else max_join_frames
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
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vocode")
        self._task: asyncio.Task | None = None
        self._forwards: set[asyncio.Task] = set()
        self._busy: set[int] = set()  # streams with a forward in flight

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._forwards) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
            else:
                batch.append(p)
                frames += p.job.work_frames
            streams.add(stream)  # its later jobs wait for this one, taken or not
        return batch, rest

    def _join(
        self, batch: list[_Pending], rest: list[_Pending], now: float
    ) -> tuple[list[list[_Pending]], list[_Pending]]:
        """Each taken job with the same stream's next waiting jobs that join it (`can_extend`),
        in deadline order, within the frame budget: a stateful forward's fixed cost is paid
        once for all of them. A listener that is still playing gets no more frames than can be
        vocoded before its audio runs out; one whose audio runs out before even the taken job is
        vocoded waits a little longer for every frame joined, and then holds more."""
        frames = sum(p.job.work_frames for p in batch)
        waiting: dict[tuple[int, int], _Pending] = {
            (id(p.job.stream), p.job.index): p for p in rest
        }
        runs: list[list[_Pending]] = []
        for p in batch:
            run, own = [p], p.job.work_frames
            pace = p.job.stream.pace(now, self.seconds_per_frame)
            in_time = (
                None
                if pace is None or not self.seconds_per_frame
                else int(pace.buffered_s / self.seconds_per_frame)
            )
            cap = min(
                self.max_join_frames,
                self.max_batch_frames if in_time is None or in_time < own else in_time,
            )
            while can_extend(run[-1].job) and (
                nxt := waiting.get((id(p.job.stream), run[-1].job.index + 1))
            ):
                n = nxt.job.work_frames
                if nxt.job.final or frames + n > self.max_batch_frames or own + n > cap:
                    break
                run.append(waiting.pop((id(p.job.stream), nxt.job.index)))
                frames, own = frames + n, own + n
            runs.append(run)
        joined_ids = {id(p) for run in runs for p in run[1:]}
        return runs, [p for p in rest if id(p) not in joined_ids]

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and len(self._forwards) < self.workers:
                live = [p for p in self._pending if not p.future.cancelled()]
                busy = [p for p in live if id(p.job.stream) in self._busy]
                batch, rest = self._take([p for p in live if id(p.job.stream) not in self._busy])
                if not batch:
                    self._pending = live
                    break
                started = time.perf_counter()
                runs, rest = self._join(batch, rest, started)
                runs, joints, later = self._one_stack(runs)
                self._pending = rest + busy + later
                streams = {id(run[0].job.stream) for run in runs}
                self._busy |= streams
                task = asyncio.get_running_loop().create_task(self._forward(runs, joints, started))
                self._forwards.add(task)
                task.add_done_callback(partial(self._forward_done, streams))

    @staticmethod
    def _one_stack(
        runs: list[list[_Pending]],
    ) -> tuple[list[list[_Pending]], list[Job], list[_Pending]]:
        """The runs (each joined into one job) that share the most urgent run's forward, and
        the jobs of the others, which wait for the next free worker. Stateful runs share a
        forward only when they stack (`stack_key`); run one after another in one forward they
        would hold every stream in it until the last is done, while another worker could have
        taken them. Windowed runs all go (they batch with padding)."""
        joints = [joined([p.job for p in run]) for run in runs]
        if not joints[0].stateful:
            return runs, joints, []
        key = stack_key(joints[0])
        keep = [i for i, joint in enumerate(joints) if stack_key(joint) == key]
        later = [p for i, run in enumerate(runs) if i not in keep for p in run]
        return [runs[i] for i in keep], [joints[i] for i in keep], later

    def _forward_done(self, streams: set[int], task: asyncio.Task) -> None:
        self._forwards.discard(task)
        self._busy -= streams
        self._wake.set()  # the streams' next jobs may go, and a worker is free

    async def _forward(self, runs: list[list[_Pending]], joints: list[Job], started: float) -> None:
        """One forward over the runs' jobs (each run joined into `joints`) on a worker thread;
        each job's future gets its audio."""
        batch = [p for run in runs for p in run]
        try:
            run_audio = await asyncio.get_running_loop().run_in_executor(
                self._executor, vocode_jobs, self.backend, joints
            )
            audio = [
                a
                for run, joint in zip(runs, run_audio)
                for a in split_joined(joint, [p.job for p in run])
            ]
        except Exception as exc:  # noqa: BLE001 - hand the failure to every waiter
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        finished = time.perf_counter()
        seconds = finished - started
        if self.on_batch is not None:
            self.on_batch(len(runs), seconds)
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
                        len(runs),
                        started,
                        finished,
                    )
                )
