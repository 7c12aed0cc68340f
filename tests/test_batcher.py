"""The vocoder batcher: earliest playout deadline first, one job per stream per forward, a frame
budget, cancelled jobs dropped."""

import asyncio
import threading
import time

import numpy as np

from vocoder_service.batcher import Batcher
from vocoder_service.chunking import ChunkPolicy
from vocoder_service.stream import VocoderStream


class RecordingBackend:
    """A stand-in generator that records batch shapes (the batching policy is under test)."""

    hop_size, num_mels, name, device = 4, 80, "recording", "cpu"

    def __init__(self):
        self.batches = []

    def run(self, mel):
        self.batches.append(mel.shape)
        return np.zeros((mel.shape[0], mel.shape[2] * self.hop_size), np.float32)


def stream_with_jobs(config, frames: int):
    s = VocoderStream(
        config, policy=ChunkPolicy(first_chunk_frames=8, growth=1.0, max_chunk_frames=8)
    )
    s.push_mel(np.zeros((80, frames), np.float32))
    s.flush()
    return s, s.ready()


def playing(stream, runs_out_in_s: float):
    """Give `stream` a listener whose audio runs out `runs_out_in_s` from now (negative: ran out
    that long ago): one second of audio delivered at the right moment."""
    stream.playout.deliver(stream.config.sampling_rate, time.perf_counter() + runs_out_in_s - 1.0)
    return stream


def test_fair_batches_and_frame_budget():
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        backend, sizes = RecordingBackend(), []
        batcher = Batcher(backend, max_batch_frames=25, on_batch=lambda n, s: sizes.append(n))
        batcher.start()
        long_stream, long_jobs = stream_with_jobs(config, 80)  # ten jobs of one stream
        playing(long_stream, 30.0)  # its listener holds plenty of audio
        short_stream, short_jobs = stream_with_jobs(config, 8)  # one job
        futures = [batcher.submit(j) for j in long_jobs]
        await asyncio.sleep(0)  # the long stream's first forward starts
        futures.append(batcher.submit(short_jobs[0]))
        futures[5].cancel()
        await asyncio.gather(*[f for i, f in enumerate(futures) if i != 5])
        await batcher.close()
        assert batcher.seconds_per_frame > 0  # the generator's speed is measured as it runs
        return sizes, backend.batches, len(long_jobs)

    sizes, shapes, n_long = asyncio.run(main())
    assert all(n == 1 for n in sizes)  # a 25-frame budget: one window per forward
    assert shapes[1][2] == 8  # the new stream's first job is due now: it jumps the backlog
    assert sum(sizes) == n_long + 1 - 1  # the cancelled job never ran
    assert sum(b[0] for b in shapes) == sum(sizes)


def test_first_jobs_get_forwards_of_their_own():
    """A stream's first chunk decides time to first audio: while one waits, no forward carries
    other streams' later chunks (a forward cannot be interrupted once it runs)."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        backend, batches = RecordingBackend(), []
        batcher = Batcher(backend, max_batch_frames=1000)
        batcher.start()
        busy = [stream_with_jobs(config, 40) for _ in range(2)]  # two streams with backlogs
        for stream, _ in busy:
            playing(stream, 30.0)
        futures = [batcher.submit(j) for _, jobs in busy for j in jobs[1:]]  # later chunks
        new = [stream_with_jobs(config, 8)[1][0] for _ in range(2)]  # two first chunks
        futures += [batcher.submit(j) for j in new]
        taken, rest = batcher._take(list(batcher._pending))
        batches.append({p.job.index for p in taken})
        await asyncio.gather(*futures)
        await batcher.close()
        return taken, batches

    taken, batches = asyncio.run(main())
    assert batches[0] == {0} and len(taken) == 2  # both first chunks, nothing else


def test_first_jobs_one_per_forward_where_batching_only_delays():
    """With max_first_batch=1 (the CPU default), first chunks that arrive together run one after
    another, oldest first, so the earliest is not held back by the others' frames."""
    from vocoder_service.checkpoint import resolve_checkpoint
    from vocoder_service.server import default_first_batch

    config = resolve_checkpoint().config

    async def main():
        backend = RecordingBackend()
        batcher = Batcher(backend, max_batch_frames=1000, max_first_batch=1)
        firsts = [stream_with_jobs(config, 8)[1][0] for _ in range(3)]
        stream, jobs = stream_with_jobs(config, 40)
        playing(stream, 30.0)
        later = jobs[1]
        futures = [batcher.submit(later)] + [batcher.submit(j) for j in firsts]
        order = []
        for _ in range(4):
            taken, batcher._pending = batcher._take(list(batcher._pending))
            order.append([p.job for p in taken])
        for f in futures:
            f.cancel()
        await batcher.close()
        return firsts, later, order

    firsts, later, order = asyncio.run(main())
    assert order == [[firsts[0]], [firsts[1]], [firsts[2]], [later]]
    assert default_first_batch(RecordingBackend()) == 1


def test_earliest_playout_deadline_first():
    """Jobs go by when each stream's listener runs out of audio, not by arrival: a stream that
    already ran out first, then a new stream (due since it asked), then the playing streams,
    nearest deadline first. A stream's own jobs keep their order."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        batcher = Batcher(RecordingBackend(), max_batch=1, max_batch_frames=1000)
        streams = {}
        for name, runs_out_in in (("relaxed", 60.0), ("soon", 20.0), ("underrun", -20.0)):
            stream, jobs = stream_with_jobs(config, 24)
            streams[name] = (playing(stream, runs_out_in), jobs)
        streams["fresh"] = stream_with_jobs(config, 8)
        for name, index in [
            ("relaxed", 0),
            ("soon", 0),
            ("fresh", 0),
            ("underrun", 0),
            ("underrun", 1),
            ("relaxed", 1),
        ]:  # arrival order
            batcher.submit(streams[name][1][index])
        order = []
        while batcher._pending:
            taken, batcher._pending = batcher._take(list(batcher._pending))
            order += [
                (name, p.job.index)
                for p in taken
                for name, (stream, _) in streams.items()
                if p.job.stream is stream
            ]
        await batcher.close()
        return order

    assert asyncio.run(main()) == [
        ("underrun", 0),
        ("underrun", 1),
        ("fresh", 0),
        ("soon", 0),
        ("relaxed", 0),
        ("relaxed", 1),
    ]


def test_a_batch_is_filled_in_deadline_order():
    """Where forwards batch (accelerators), the most urgent jobs fill the frame budget first;
    a new stream's first job then comes before listeners that are still playing."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        later = []
        for runs_out_in in (30.0, 10.0, -5.0):
            stream, jobs = stream_with_jobs(config, 40)
            playing(stream, runs_out_in)
            later.append(jobs[1])
        budget = later[0].work_frames + 1  # one window per forward
        batcher = Batcher(RecordingBackend(), max_batch=8, max_batch_frames=budget)
        for job in later:
            batcher.submit(job)
        taken, rest = batcher._take(list(batcher._pending))
        first = stream_with_jobs(config, 8)[1][0]
        batcher.submit(first)
        next_taken, _ = batcher._take(rest + [batcher._pending[-1]])
        wide = Batcher(RecordingBackend(), max_batch=8, max_batch_frames=10 * budget)
        for job in later:
            wide.submit(job)
        together, _ = wide._take(list(wide._pending))
        await batcher.close()
        await wide.close()
        return later, first, [p.job for p in taken], [p.job for p in next_taken], together

    later, first, taken, next_taken, together = asyncio.run(main())
    assert taken == [later[2]]  # the stream that ran out of audio
    assert next_taken == [first]  # a new stream is due now, ahead of listeners still playing
    assert [p.job for p in together] == [later[2], later[1], later[0]]


class StatefulRecordingBackend:
    """A stand-in generator for stateful jobs: records each forward (streams, new frames) and
    how many ran at once; emits each stream's new frames' samples (the policy is under test)."""

    hop_size, num_mels, name, device = 4, 80, "recording", "cpu"

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.forwards, self.at_once, self.max_at_once = seconds, [], 0, 0
        self.lock = threading.Lock()

    def run_streams(self, mel, states, final):
        with self.lock:
            self.forwards.append((mel.shape[0], mel.shape[2]))
            self.at_once += 1
            self.max_at_once = max(self.max_at_once, self.at_once)
        time.sleep(self.seconds)
        with self.lock:
            self.at_once -= 1
        audio = np.ones((mel.shape[0], mel.shape[2] * self.hop_size), np.float32)
        return list(audio), [[np.zeros((1, 2), np.float32)] for _ in states]


def stateful_jobs(config, frames: int):
    """A stateful stream with `frames` frames in (no end yet): its first job, then 8-frame ones."""
    s = VocoderStream(
        config,
        policy=ChunkPolicy(first_chunk_frames=8, growth=1.0, max_chunk_frames=8),
        stateful=True,
    )
    s.push_mel(np.zeros((80, frames), np.float32))
    return s, s.ready()


def test_a_streams_waiting_chunks_join_its_forward_as_its_listener_allows():
    """A stream's later chunks that wait behind the one taken join its forward (one fixed cost),
    within the frame budget; while its listener is playing, only as many frames as can be
    vocoded before the audio runs out; once it will run out anyway, up to the budget. A
    stream's first chunk (time to first audio) and final chunks never take others."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        stream, jobs = stateful_jobs(config, 80)
        assert jobs[0].index == 0 and [j.num_frames for j in jobs[1:4]] == [8, 8, 8]
        batcher = Batcher(StatefulRecordingBackend(), max_batch_frames=30)
        batcher.seconds_per_frame = 0.002
        futures = [batcher.submit(j) for j in jobs]

        def joined_now(runs_out_in_s):
            if runs_out_in_s is not None:
                stream.playout.started_at = None
                stream.playout.delivered = 0
                playing(stream, runs_out_in_s)
            taken, rest = batcher._take(list(batcher._pending))
            runs, _ = batcher._join(taken, rest, time.perf_counter())
            return [[p.job.index for p in run] for run in runs]

        first = joined_now(None)
        batcher._pending = [p for p in batcher._pending if p.job.index > 0]
        nothing_out = joined_now(None)  # no audio out yet: no listener to keep
        plenty = joined_now(0.05)  # 25 frames' compute in the buffer
        little = joined_now(0.02)  # 10 frames' worth: only the taken chunk
        late = joined_now(0.01)  # not even that: it waits a little longer for more
        batcher.max_join_frames = 16  # what a new stream's first chunk may wait behind
        capped = joined_now(0.01)
        for f in futures:
            f.cancel()
        await batcher.close()
        return first, nothing_out, plenty, little, late, capped

    first, nothing_out, plenty, little, late, capped = asyncio.run(main())
    assert first == [[0]]
    assert nothing_out == plenty == late == [[1, 2, 3]]  # 24 frames; a fourth would pass 30
    assert little == [[1]]
    assert capped == [[1, 2]]


def test_joined_chunks_get_the_audio_each_would_have_had():
    """Through the real generator: a backlog vocoded in joined forwards comes back chunk by
    chunk, in order, and together equals offline synthesis."""
    import torch

    from vocoder_service.backends import TorchBackend

    async def main(backend, mel):
        stream = VocoderStream(
            backend.config,
            policy=ChunkPolicy(first_chunk_frames=4, growth=1.0, max_chunk_frames=4),
            stateful=True,
        )
        stream.push_mel(mel)
        jobs = stream.ready()  # the first chunk, then 4-frame ones
        stream.flush()
        jobs += stream.ready()  # the held-back tail
        batcher = Batcher(backend, max_batch_frames=64, on_batch=lambda n, s: None)
        batcher.start()
        results = await asyncio.gather(*[batcher.submit(j) for j in jobs])
        await batcher.close()
        chunks = [stream.complete(j, r.audio) for j, r in zip(jobs, results)]
        return jobs, chunks

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        backend = TorchBackend()
        t = np.arange(60)[None, :]
        mel = (-5 + 2 * np.sin(0.3 * t + 0.1 * np.arange(80)[:, None])).astype(np.float32)
        jobs, chunks = asyncio.run(main(backend, mel))
        offline = backend.run(mel[None])[0]
    finally:
        torch.set_num_threads(before)
    assert len(jobs) > 10
    assert [c.num_samples for c in chunks[1:-1]] == [j.num_samples for j in jobs[1:-1]]
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == offline.shape
    assert np.abs(audio - offline).max() <= 1e-4


def test_workers_run_forwards_of_different_streams_at_once():
    """With two workers two streams' forwards run at the same time; a stream's own jobs still
    run one after another, in order."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main(workers):
        backend = StatefulRecordingBackend(seconds=0.05)
        batcher = Batcher(backend, max_batch_frames=8, workers=workers)
        batcher.start()
        streams = [stateful_jobs(config, 40) for _ in range(3)]
        order: dict[int, list[int]] = {}

        async def submit(stream, job):
            await batcher.submit(job)
            order.setdefault(id(stream), []).append(job.index)

        await asyncio.gather(*[submit(s, j) for s, jobs in streams for j in jobs])
        await batcher.close()
        return backend.max_at_once, [order[id(s)] for s, _ in streams], streams

    at_once, orders, streams = asyncio.run(main(2))
    assert at_once == 2
    assert all(o == list(range(len(jobs))) for o, (_, jobs) in zip(orders, streams))
    assert asyncio.run(main(1))[0] == 1


def test_a_stream_whose_chunk_does_not_fit_keeps_its_later_ones_back():
    """When a stream's next chunk does not fit the forward's frame budget, its later chunks wait
    too: they build on its state, so taking one would run the stream out of order."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        urgent, urgent_jobs = stateful_jobs(config, 40)
        playing(urgent, -5.0)
        _, jobs = stateful_jobs(config, 40)  # a first chunk with its lookahead, then 8 frames
        assert jobs[0].work_frames > jobs[1].work_frames == 8
        budget = urgent_jobs[1].work_frames + jobs[0].work_frames - 1
        batcher = Batcher(StatefulRecordingBackend(), max_batch_frames=budget)
        for job in (urgent_jobs[1], jobs[0], jobs[1]):
            batcher.submit(job)
        taken, rest = batcher._take(list(batcher._pending))
        await batcher.close()
        return [p.job for p in taken], urgent_jobs[1]

    taken, urgent_job = asyncio.run(main())
    assert taken == [urgent_job]


def test_streams_that_do_not_stack_go_to_different_workers():
    """A forward carries the most urgent stream and the streams whose chunks stack with it
    (equal new frames); the others wait for the next free worker instead of running after them
    in the same forward, which would hold them all until the last is done."""
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    def later_job(frames_per_job: int, runs_out_in_s: float):
        s = VocoderStream(
            config,
            policy=ChunkPolicy(
                first_chunk_frames=frames_per_job, growth=1.0, max_chunk_frames=frames_per_job
            ),
            stateful=True,
        )
        s.push_mel(np.zeros((80, 200), np.float32))
        playing(s, runs_out_in_s)
        return s.ready()[1]

    async def main(workers):
        backend = StatefulRecordingBackend(seconds=0.05)
        batcher = Batcher(backend, max_batch_frames=64, workers=workers)
        urgent, a, b = later_job(16, 0.1), later_job(8, 0.2), later_job(8, 0.3)
        batcher.start()
        await asyncio.gather(*[batcher.submit(j) for j in (urgent, a, b)])
        await batcher.close()
        return backend

    # two workers: the two forwards run at once, so which thread records first is the OS's call
    backend = asyncio.run(main(2))
    assert sorted(backend.forwards) == [(1, 16), (2, 8)] and backend.max_at_once == 2
    backend = asyncio.run(main(1))
    assert backend.forwards == [(1, 16), (2, 8)] and backend.max_at_once == 1
