"""The vocoder batcher: one job per stream per forward, a frame budget, cancelled jobs dropped."""

import asyncio

import numpy as np

from vocoder_service.batcher import Batcher
from vocoder_service.stream import ChunkPolicy, VocoderStream


class RecordingBackend:
    """A stand-in generator that records batch shapes (the batching policy is under test)."""

    hop_size, num_mels, name, device = 4, 80, "recording", "cpu"

    def __init__(self):
        self.batches = []

    def run(self, mel):
        self.batches.append(mel.shape)
        return np.zeros((mel.shape[0], mel.shape[2] * self.hop_size), np.float32)


def stream_with_jobs(config, frames: int):
    s = VocoderStream(config, policy=ChunkPolicy(first_chunk_frames=8, growth=1.0, max_chunk_frames=8))
    s.push_mel(np.zeros((80, frames), np.float32))
    s.flush()
    return s, s.ready()


def test_fair_batches_and_frame_budget():
    from vocoder_service.checkpoint import resolve_checkpoint

    config = resolve_checkpoint().config

    async def main():
        backend, sizes = RecordingBackend(), []
        batcher = Batcher(backend, max_batch_frames=25, on_batch=lambda n, s: sizes.append(n))
        batcher.start()
        long_stream, long_jobs = stream_with_jobs(config, 80)   # ten jobs of one stream
        short_stream, short_jobs = stream_with_jobs(config, 8)  # one job
        futures = [batcher.submit(j) for j in long_jobs]
        await asyncio.sleep(0)  # the long stream's first forward starts
        futures.append(batcher.submit(short_jobs[0]))
        futures[5].cancel()
        await asyncio.gather(*[f for i, f in enumerate(futures) if i != 5])
        await batcher.close()
        return sizes, backend.batches, len(long_jobs)

    sizes, shapes, n_long = asyncio.run(main())
    assert all(n == 1 for n in sizes)  # a 25-frame budget: one window per forward
    assert shapes[1][2] == 8  # the late stream's first job jumps the long stream's backlog
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
        later = stream_with_jobs(config, 40)[1][1]
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
