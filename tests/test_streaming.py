"""Per-stream chunker: streamed audio equals offline synthesis; token decoder; voices."""

import json

import numpy as np
import pytest
import torch

from kernels import onednn_conv
from vocoder_service.backends import TorchBackend
from vocoder_service.chunking import ChunkPolicy, ForwardShape, frames_to_keep_up, frames_within
from vocoder_service.jobs import vocode_jobs
from vocoder_service.mel import MelSpectrogram
from vocoder_service.playout import Pace, PlayoutClock
from vocoder_service.stream import VocoderStream
from vocoder_service.token_decoder import (
    ConvLayer,
    TokenDecoder,
    TokenDecoderConfig,
    load_token_decoder,
    save_token_decoder,
)
from vocoder_service.voice import load_voice

HOP = 256
# the CPU's bf16 generator runs on oneDNN's bf16 convolutions, which a CPU with AVX2 alone lacks
# (TorchBackend refuses bf16 there: tests/test_vocoder_int8.py)
needs_bf16 = pytest.mark.skipif(
    not onednn_conv.packing_available(torch.bfloat16), reason="oneDNN has no bf16 on this CPU"
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the machine is shared: two OpenMP threads on two busy cores run several times slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend()


@pytest.fixture(scope="module")
def mel(backend) -> np.ndarray:
    """60 frames of log-mel of a voiced harmonic sweep."""
    sr = 22050
    t = np.arange(60 * HOP) / sr
    f0 = 110 + 80 * t
    phase = 2 * np.pi * np.cumsum(f0) / sr
    audio = sum(np.sin(k * phase) / k for k in range(1, 30)) * (
        0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)
    )
    return MelSpectrogram(backend.config)(0.2 * audio / np.abs(audio).max())[0].numpy()


@pytest.fixture(scope="module")
def decoder() -> TokenDecoder:
    """Random decoder: 2 frames per token, 2 tokens of lookahead, 2 of left context."""
    torch.manual_seed(0)
    config = TokenDecoderConfig(
        codebook_size=64,
        frames_per_token=2,
        channels=32,
        layers=(ConvLayer(3, 1), ConvLayer(3, 1), ConvLayer(1, 0)),
    )
    dec = TokenDecoder(config).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0, 0.3)
        dec.codebook.normal_(-5, 1.5)
    return dec


def snr_db(test: np.ndarray, ref: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((test - ref) ** 2), 1e-30)))


def run_stream(stream: VocoderStream, backend, pieces, push) -> list:
    chunks = []
    for piece in pieces:
        push(piece)
        chunks += stream.step(backend)
    stream.flush()
    chunks += stream.step(backend)
    return chunks


def check_contiguous(chunks, total_samples: int) -> np.ndarray:
    starts = [c.first_sample for c in chunks]
    assert starts[0] == 0
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur.first_sample == prev.first_sample + prev.num_samples  # no gap, no overlap
    assert [c.sequence_number for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == (total_samples,)
    return audio


@pytest.mark.parametrize("stateful", [False, True], ids=["windowed", "stateful"])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_mel_equals_offline(piece, stateful, backend, mel):
    offline = backend.run(mel[None])[0]
    stream = VocoderStream(backend.config, stateful=stateful)
    pieces = [mel[:, i : i + piece] for i in range(0, mel.shape[1], piece)]
    chunks = run_stream(stream, backend, pieces, stream.push_mel)
    audio = check_contiguous(chunks, mel.shape[1] * HOP)
    assert snr_db(audio, offline) >= 40
    assert stream.done and stream.samples_emitted == audio.size


@pytest.mark.parametrize("stateful", [False, True], ids=["windowed", "stateful"])
@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_tokens_equal_offline(piece, stateful, backend, decoder):
    codes = np.random.default_rng(1).integers(0, 64, 30)
    offline = backend.run(decoder.decode(codes)[None])[0]
    stream = VocoderStream(backend.config, token_decoder=decoder, stateful=stateful)
    pieces = [codes[i : i + piece] for i in range(0, len(codes), piece)]
    chunks = run_stream(stream, backend, pieces, stream.push_tokens)
    audio = check_contiguous(chunks, 60 * HOP)
    assert snr_db(audio, offline) >= 40


def test_stateful_stream_sends_each_frame_once(backend, mel):
    """No recomputed context: the jobs' frames add up to the input, and only the first waits
    for right context (the first non-final job has to fill every layer)."""
    policy = ChunkPolicy(first_chunk_frames=4, growth=2.0, max_chunk_frames=16)
    stream = VocoderStream(backend.config, policy=policy, stateful=True)
    right = backend.receptive_field[1]
    jobs = []
    for i in range(mel.shape[1]):
        stream.push_mel(mel[:, i : i + 1])
        jobs += stream.ready()
        if i < 4 + right - 1:
            assert jobs == []  # the first job: 4 frames of audio need 13 more of input
    stream.flush()
    jobs += stream.ready()
    assert [j.num_frames for j in jobs] == [4 + right, 8, 16, 16, 3]
    assert [j.final for j in jobs] == [False] * 4 + [True]
    assert sum(j.window_frames for j in jobs) == mel.shape[1]
    chunks = [stream.complete(j, a) for j, a in zip(jobs, vocode_jobs(backend, jobs))]
    assert chunks[0].num_samples == (4 + right) * HOP - stream_lag_samples(backend)
    audio = check_contiguous(chunks, mel.shape[1] * HOP)
    assert snr_db(audio, backend.run(mel[None])[0]) >= 40


def stream_lag_samples(backend) -> int:
    """Samples the stateful generator holds back: each layer's right half-width, at its rate."""
    c = backend.config
    lag, rate = 3, 1  # conv_pre
    for u, k in zip(c.upsample_rates, c.upsample_kernel_sizes):
        rate *= u
        lag = lag * u + (k - u) // 2  # the transposed conv drops its padding on the left only
        widest = max(
            sum((kr - 1) * d // 2 + (kr - 1) // 2 for d in ds)
            for kr, ds in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes)
        )
        lag += widest
    return lag + 3  # conv_post


def test_stateful_boundary_emits_everything_and_the_stream_goes_on(backend, mel):
    """A boundary lets the held-back tail out (with zero right context, as at an end); the
    input after it starts from a fresh state, and the stream keeps its sample count exact."""
    stream = VocoderStream(backend.config, stateful=True)
    stream.push_mel(mel[:, :30])
    chunks = stream.step(backend)
    stream.mark_boundary()
    chunks += stream.step(backend)
    assert sum(c.num_samples for c in chunks) == 30 * HOP
    assert stream.state is None and not stream.done
    stream.push_mel(mel[:, 30:])
    chunks += run_stream(stream, backend, [], stream.push_mel)
    audio = check_contiguous(chunks, mel.shape[1] * HOP)
    offline_halves = np.concatenate(
        [backend.run(mel[None, :, :30])[0], backend.run(mel[None, :, 30:])[0]]
    )
    assert snr_db(audio, offline_halves) >= 40  # two utterances, joined at the boundary


def test_stateful_end_right_after_a_boundary(backend, mel):
    """A boundary let everything out, so the end has no frames and a fresh state: its final
    job carries only the end of the stream, and the generator is not called on nothing."""
    stream = VocoderStream(backend.config, stateful=True)
    stream.push_mel(mel[:, :30])
    chunks = stream.step(backend)
    stream.mark_boundary()
    chunks += stream.step(backend)
    stream.flush()
    chunks += stream.step(backend)
    assert stream.done and chunks[-1].num_samples == 0
    audio = check_contiguous(chunks, 30 * HOP)
    assert snr_db(audio, backend.run(mel[None, :, :30])[0]) >= 40


def test_too_little_context_is_audible(backend, mel):
    """Guards the exactness tests: a window 4 frames short of the receptive field is off."""
    offline = backend.run(mel[None])[0]
    left, right = backend.receptive_field
    chunk = backend.run(mel[None, :, 20 - left + 4 : 40 + right - 4])[0][
        (left - 4) * HOP : (left + 16) * HOP
    ]
    assert snr_db(chunk, offline[20 * HOP : 40 * HOP]) < 40


def test_first_chunk_leaves_before_end_of_stream(backend, mel):
    stream = VocoderStream(backend.config, policy=ChunkPolicy(first_chunk_frames=8))
    needed = 8 + backend.receptive_field[1]
    for i in range(needed - 1):
        stream.push_mel(mel[:, i : i + 1])
        assert stream.ready() == []
    stream.push_mel(mel[:, needed - 1 : needed])
    (job,) = stream.ready()
    assert (job.first_frame, job.num_frames, job.window_frames) == (0, 8, needed)
    chunk = stream.complete(job, backend.run(job.mel[None])[0])
    assert chunk.first_sample == 0 and chunk.num_samples == 8 * HOP and not chunk.last
    assert not stream.ended


def test_first_token_chunk_waits_for_decoder_lookahead(backend, decoder):
    stream = VocoderStream(
        backend.config, token_decoder=decoder, policy=ChunkPolicy(first_chunk_frames=8)
    )
    # 8 frames + 13 frames of right context = 11 tokens of mel, + 2 tokens of decoder lookahead
    codes = np.arange(13) % 64
    stream.push_tokens(codes[:12])
    assert stream.ready() == []
    stream.push_tokens(codes[12:])
    (job,) = stream.ready()
    assert job.num_frames == 8


def test_token_decoder_runs_only_when_a_job_can_be_due(backend, decoder):
    """One token per message must not cost one decoder forward per message."""
    calls = []
    forward = decoder.forward
    decoder.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        codes = np.random.default_rng(2).integers(0, 64, 60)
        offline = backend.run(decoder.decode(codes)[None])[0]
        stream = VocoderStream(backend.config, token_decoder=decoder)
        chunks = run_stream(
            stream, backend, [codes[i : i + 1] for i in range(60)], stream.push_tokens
        )
    finally:
        del decoder.forward
    assert len(calls) <= stream._next_job + 1  # one decode per job issued (+ the flush)
    assert snr_db(check_contiguous(chunks, 120 * HOP), offline) >= 40


def test_shared_streams_keep_to_the_shared_cap(backend, mel):
    policy = ChunkPolicy(
        first_chunk_frames=4, growth=2.0, max_chunk_frames=64, shared_chunk_frames=12
    )
    assert [policy.min_frames(i, shared=True) for i in range(4)] == [4, 8, 12, 12]
    assert policy.cap(shared=True) == 12 and policy.cap() == 64
    stream = VocoderStream(backend.config, policy=policy)
    stream.push_mel(np.concatenate([mel] * 2, axis=1))
    sizes = [j.num_frames for j in stream.ready(shared=True)]
    assert sizes[0] == 4 and max(sizes) == 12 == sizes[1]  # a backlog goes in capped jobs
    assert [j.num_frames for j in stream.ready()] == []  # everything ready was issued
    stream.push_mel(np.concatenate([mel] * 2, axis=1))
    assert max(j.num_frames for j in stream.ready()) > 12  # alone again: bigger jobs
    with pytest.raises(ValueError):
        ChunkPolicy(shared_chunk_frames=0)


def test_flush_emits_the_tail(backend, mel):
    stream = VocoderStream(backend.config, policy=ChunkPolicy(first_chunk_frames=8))
    stream.push_mel(mel[:, :30])
    before = stream.step(backend)
    # 8 frames go at once; the next job waits for 16 more frames plus right context
    assert sum(c.num_samples for c in before) == 8 * HOP
    assert not stream.done
    stream.flush()
    tail = stream.step(backend)
    assert tail and tail[-1].last and stream.done
    pcm = np.frombuffer(tail[-1].pcm16(), "<i2")
    np.testing.assert_allclose(pcm / 32767, tail[-1].audio, atol=1 / 32767)
    check_contiguous(before + tail, 30 * HOP)
    with pytest.raises(ValueError, match="flushed"):
        stream.push_mel(mel[:, :1])


def test_policy_grows_to_its_cap(backend, mel):
    long_mel = np.concatenate([mel] * 3, axis=1)  # 180 frames
    policy = ChunkPolicy(first_chunk_frames=4, growth=2.0, max_chunk_frames=40)
    stream = VocoderStream(backend.config, policy=policy)
    sizes = []
    for i in range(long_mel.shape[1]):
        stream.push_mel(long_mel[:, i : i + 1])
        sizes += [j.num_frames for j in stream.ready()]
    assert sizes[:5] == [4, 8, 16, 32, 40]
    assert max(sizes) == 40
    assert [policy.min_frames(i) for i in range(6)] == [4, 8, 16, 32, 40, 40]
    with pytest.raises(ValueError):
        ChunkPolicy(first_chunk_frames=0)
    with pytest.raises(ValueError):
        ChunkPolicy(first_chunk_frames=16, max_chunk_frames=8)


def test_chunk_schedule_follows_the_buffer():
    """A job takes no more frames than it can vocode, and waits for no more than it can gather
    and vocode, within a share of the audio the listener holds; never below the first chunk."""
    tick = 1 / 128  # exact in binary
    policy = ChunkPolicy(first_chunk_frames=4, growth=2.0, max_chunk_frames=64)

    def pace(buffered_s: float, seconds_per_frame: float = tick) -> Pace:
        return Pace(buffered_s=buffered_s, seconds_per_frame=seconds_per_frame, frame_s=tick)

    # half of 1 s at 1/128 s per frame: 64 frames vocoded, or 32 gathered and vocoded
    assert frames_within(pace(1.0), 0.5) == 64
    assert frames_within(pace(1.0), 0.5, gather=True) == 32
    assert frames_within(Pace(1.0, tick, tick, overhead_frames=8), 0.5, gather=True) == 28
    assert frames_within(pace(1.0, 0.0), 0.5) > 10**6  # speed not measured yet: no bound
    # chunks grow with the buffer, from the first chunk's size up to the cap
    assert [policy.limit(pace=pace(b)) for b in (0.0, 0.25, 1.0, 4.0)] == [4, 16, 64, 64]
    assert [policy.min_frames(i, pace=pace(0.0)) for i in range(3)] == [4, 4, 4]
    assert [policy.min_frames(i, pace=pace(1.0)) for i in range(6)] == [4, 8, 16, 32, 32, 32]
    assert [policy.min_frames(i, pace=pace(4.0)) for i in range(6)] == [4, 8, 16, 32, 64, 64]
    assert [policy.min_frames(i) for i in range(6)] == [4, 8, 16, 32, 64, 64]  # no clock
    assert policy.limit(shared=True, pace=pace(4.0)) == 32
    # windowed jobs also vocode 26 frames of context: a job must at least pay for it, twice
    # over at a share of 0.5, even when the listener has run out
    windowed = Pace(0.0, seconds_per_frame=tick / 4, frame_s=tick, overhead_frames=26)
    assert frames_to_keep_up(windowed, 0.5) == 26
    assert policy.limit(pace=windowed) == policy.min_frames(0, pace=windowed) == 26
    assert frames_to_keep_up(Pace(0.0, tick / 2, tick, overhead_frames=26), 0.5) > 64
    assert policy.limit(pace=Pace(0.0, tick / 2, tick, overhead_frames=26)) == 64  # the cap
    assert frames_to_keep_up(pace(0.0), 0.5) == 0  # stateful jobs have no overhead
    # a job's compute is played out of the buffer, then its audio is in it
    assert pace(0.5, tick / 2).after(16).buffered_s == 0.5 - 16 * tick / 2 + 16 * tick
    assert pace(0.0).after(4).buffered_s == 4 * tick
    with pytest.raises(ValueError, match="buffer_share"):
        ChunkPolicy(buffer_share=0.0)
    with pytest.raises(ValueError, match="buffer_share"):
        ChunkPolicy(buffer_share=1.5)


def test_playout_clock():
    clock = PlayoutClock(22050)
    assert clock.runs_out_at is None and clock.buffered(5.0) == 0.0
    clock.deliver(0, 1.0)  # nothing audible yet: playback has not started
    clock.deliver(22050, 2.0)
    clock.deliver(11025, 2.2)
    assert clock.started_at == 2.0 and clock.runs_out_at == 3.5
    assert clock.buffered(3.0) == 0.5 and clock.buffered(4.0) == 0.0


def test_stream_chunks_follow_its_playout_clock(backend):
    """With a clock, a stream whose listener holds little audio gets a backlog in chunks that
    start small and grow as their audio builds the buffer up; one that holds seconds gets the
    cap; without a clock, the policy alone."""
    policy = ChunkPolicy(first_chunk_frames=4, growth=2.0, max_chunk_frames=64)
    right, speed = backend.receptive_field[1], 1e-3
    silence = np.full((80, 200), -11.0, np.float32)

    def backlog_after_first_chunk(extra_delivered_s: float, clock: bool) -> list[int]:
        stream = VocoderStream(backend.config, policy=policy, stateful=True)
        stream.push_mel(silence[:, : 4 + right])
        (first,) = stream.ready(now=0.0, seconds_per_frame=speed)  # no audio out: the first chunk
        assert first.num_frames == 4 + right
        stream.complete(first, np.zeros(4 * HOP, np.float32), now=100.0)
        stream.playout.deliver(int(extra_delivered_s * 22050), 100.0)
        stream.push_mel(silence[:, 4 + right : 60 + right])
        jobs = stream.ready(now=100.0 if clock else None, seconds_per_frame=speed)
        assert sum(j.num_frames for j in jobs) == 56
        return [j.num_frames for j in jobs]

    low = backlog_after_first_chunk(0.0, clock=True)
    # in whole quanta of frames (fewer shapes for oneDNN to compile)
    expected_first = policy.quantised(frames_within(Pace(4 * HOP / 22050, speed, HOP / 22050), 0.5))
    assert low[0] == expected_first < 56 and low == sorted(low) and len(low) > 1
    assert all(n % policy.frame_quantum == 0 for n in low)
    assert backlog_after_first_chunk(2.0, clock=True) == [56]  # under the cap of 64
    assert backlog_after_first_chunk(0.0, clock=False) == [56]


def test_many_streams_batched_equal_offline(backend, mel):
    calls = []

    class Counting:
        hop_size, num_mels = backend.hop_size, backend.num_mels

        def run(self, batch):
            calls.append(batch.shape[0])
            return backend.run(batch)

    inputs = [mel, mel[:, 5:50], mel[::-1].copy()]
    rates = [4, 4, 7]  # frames per step: two streams in step, one faster
    streams = [VocoderStream(backend.config) for _ in inputs]
    out = [[] for _ in inputs]
    step = 0
    while not all(s.done for s in streams):
        for s, m, rate in zip(streams, inputs, rates):
            lo = step * rate
            if lo < m.shape[1]:
                s.push_mel(m[:, lo : lo + rate])
            elif not s.ended:
                s.flush()
        jobs = [j for s in streams for j in s.ready()]
        for job, audio in zip(jobs, vocode_jobs(Counting(), jobs)):
            out[streams.index(job.stream)].append(job.stream.complete(job, audio))
        step += 1
    assert max(calls) > 1  # some forwards served several streams
    for m, chunks in zip(inputs, out):
        audio = check_contiguous(chunks, m.shape[1] * HOP)
        assert snr_db(audio, backend.run(m[None])[0]) >= 40


def test_stateful_streams_in_step_share_forwards(backend, mel):
    """Stateful streams whose jobs take the same new frames on states of the same shapes run in
    one forward (`run_streams`); the rest, final jobs and a stream's second job, run on their
    own. Every stream still gets its offline audio."""
    forwards = []

    class Counting:
        hop_size, num_mels = backend.hop_size, backend.num_mels

        def run_streams(self, batch, states, final):
            forwards.append((batch.shape[0], batch.shape[2], final))
            return backend.run_streams(batch, states, final)

    inputs = [mel, mel[:, 3:], mel[::-1].copy(), mel[:, :41]]
    streams = [VocoderStream(backend.config, stateful=True) for _ in inputs]
    out = [[] for _ in inputs]
    waiting: list[list] = [[] for _ in inputs]
    step = 0
    while not all(s.done for s in streams):
        for s, m, queue in zip(streams, inputs, waiting):
            lo = step * 4
            if lo < m.shape[1]:
                s.push_mel(m[:, lo : lo + 4])
            elif not s.ended:
                s.flush()
            queue += s.ready()
        # one job per stream per forward, as the batcher takes them
        jobs = [queue.pop(0) for queue in waiting if queue]
        for job, audio in zip(jobs, vocode_jobs(Counting(), jobs)):
            out[streams.index(job.stream)].append(job.stream.complete(job, audio))
        step += 1
    assert max(b for b, _, final in forwards if not final) == len(inputs)  # all four in one
    assert all(b == 1 for b, _, final in forwards if final)
    for m, chunks in zip(inputs, out):
        audio = check_contiguous(chunks, m.shape[1] * HOP)
        assert snr_db(audio, backend.run(m[None])[0]) >= 40

    policy = ChunkPolicy(max_chunk_frames=16)
    stream = VocoderStream(backend.config, policy=policy, stateful=True)
    stream.push_mel(mel)
    stream.flush()
    jobs = stream.ready()
    assert len(jobs) > 1
    forwards.clear()
    chunks = [stream.complete(j, a) for j, a in zip(jobs, vocode_jobs(Counting(), jobs))]
    assert [b for b, _, _ in forwards] == [1] * len(jobs)  # one stream's jobs in order
    assert snr_db(check_contiguous(chunks, mel.shape[1] * HOP), backend.run(mel[None])[0]) >= 40


def test_padding_windows_into_one_forward_keeps_samples(backend, mel):
    calls = []

    class Counting:
        hop_size, num_mels = backend.hop_size, backend.num_mels

        def run(self, batch):
            calls.append(batch.shape)
            return backend.run(batch)

    def stream(first, flush):
        s = VocoderStream(backend.config, policy=ChunkPolicy(first_chunk_frames=first))
        s.push_mel(mel)
        if flush:
            s.flush()
        return s

    a, b = (
        stream(8, False),
        stream(10, False),
    )  # first windows 21 and 23 frames: padded on the right
    c, d = stream(20, True), stream(16, True)  # second windows 53 and 57 frames: padded on the left
    later = []
    for s in (c, d):
        first_job, second_job = s.ready()
        s.complete(first_job, backend.run(first_job.mel[None])[0])
        later.append(second_job)
    jobs = [a.ready()[0], b.ready()[0], *later]
    assert [j.window_frames for j in jobs] == [21, 23, 53, 57]
    assert [(j.pad_left_ok, j.pad_right_ok) for j in jobs[2:]] == [(True, False)] * 2
    batched = vocode_jobs(Counting(), jobs)
    assert sorted(calls) == [(2, 80, 23), (2, 80, 57)]
    for job, audio in zip(jobs, batched):
        start = (job.first_frame - job.window_start) * HOP
        alone = backend.run(job.mel[None])[0][start : start + job.num_samples]
        np.testing.assert_allclose(audio[start : start + job.num_samples], alone, atol=1e-4, rtol=0)


def test_stream_rejects_bad_input(backend, decoder, mel):
    stream = VocoderStream(backend.config)
    with pytest.raises(ValueError, match=r"\[80, frames\]"):
        stream.push_mel(np.zeros((3, 80), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        stream.push_mel(np.full((80, 2), np.nan, np.float32))
    with pytest.raises(ValueError, match="takes mel frames"):
        stream.push_tokens([1, 2])
    token_stream = VocoderStream(backend.config, token_decoder=decoder)
    with pytest.raises(ValueError, match="outside the codebook"):
        token_stream.push_tokens([3, 64])
    stream.push_mel(mel)
    stream.flush()
    first, second, *_ = stream.ready()
    with pytest.raises(ValueError, match="out of order"):
        stream.complete(second, backend.run(second.mel[None])[0])
    with pytest.raises(ValueError, match="samples"):
        stream.complete(first, np.zeros(10, np.float32))


def test_token_decoder_roundtrip_and_codebook_only(tmp_path, decoder):
    save_token_decoder(decoder, tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "token_decoder.json").read_text())
    assert (saved["lookahead"], saved["left_context"]) == (2, 2)
    loaded = load_token_decoder(tmp_path / "a")
    codes = np.array([0, 5, 63, 7, 7])
    np.testing.assert_array_equal(loaded.decode(codes), decoder.decode(codes))

    codebook_only = TokenDecoder(TokenDecoderConfig(codebook_size=4, frames_per_token=2))
    with torch.no_grad():
        codebook_only.codebook.copy_(torch.arange(4 * 160, dtype=torch.float32).reshape(4, 160))
    save_token_decoder(codebook_only, tmp_path / "b")
    cb = load_token_decoder(tmp_path / "b")
    assert cb.lookahead == cb.left_context == 0
    mel = cb.decode(np.array([2, 1]))
    # rows are frame-major: token 2 gives frames 0 and 1, token 1 frames 2 and 3
    np.testing.assert_array_equal(mel[:, 1], np.arange(2 * 160 + 80, 3 * 160))
    np.testing.assert_array_equal(mel[:, 2], np.arange(160, 160 + 80))

    bad = dict(saved, lookahead=3)
    (tmp_path / "a" / "token_decoder.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="lookahead=3"):
        load_token_decoder(tmp_path / "a")
    assert load_token_decoder(tmp_path / "missing") is None


def test_voice_directory(tmp_path, decoder):
    voice_dir = tmp_path / "v"
    save_token_decoder(decoder, voice_dir / "vocoder")
    (voice_dir / "voice.json").write_text(
        json.dumps({"name": "test", "sample_rate": 22050, "hop_size": 256})
    )
    voice = load_voice(voice_dir)
    assert voice.name == "test" and voice.codebook_size == 64 and voice.frames_per_token == 2
    assert voice.generator.path.name == "generator_universal.pth.tar"
    default = load_voice()
    assert default.token_decoder is None and default.codebook_size == 0
    (voice_dir / "voice.json").write_text(json.dumps({"name": "test", "sample_rate": 24000}))
    with pytest.raises(ValueError, match="sample_rate=24000"):
        load_voice(voice_dir)
    with pytest.raises(FileNotFoundError):
        load_voice(tmp_path / "nowhere")


def test_stateful_shapes_cover_first_quantised_and_final_forwards():
    policy = ChunkPolicy(first_chunk_frames=4, shared_chunk_frames=32, frame_quantum=4)
    shapes = policy.stateful_shapes(lag=13, max_batch_frames=64, max_streams=4)
    assert shapes[0] == ForwardShape(1, 17, fresh=True)
    steady = {(s.streams, s.frames) for s in shapes if not (s.final or s.fresh)}
    assert {f for _, f in steady} == set(range(4, 33, 4))
    # stacks of up to 4 streams within the frame budget
    assert max(n for n, f in steady if f == 4) == 4 and max(n for n, f in steady if f == 32) == 2
    assert all(n * f <= 64 for n, f in steady) and all(
        (n - 1, f) in steady for n, f in steady if n > 1
    )
    assert [s.frames for s in shapes if s.final] == [0, 1, 2, 3]
    assert len(set(shapes)) == len(shapes)


def test_a_stream_alone_starts_with_its_own_first_chunk(backend, mel):
    """Alone on the generator a stream's first job takes `first_chunk_frames_alone` new
    frames (heard sooner); shared it takes `first_chunk_frames`; job 1 grows from
    `first_chunk_frames` either way, both first shapes are warmed, and the audio of a stream
    that started alone still equals offline synthesis."""
    policy = ChunkPolicy(first_chunk_frames=4, growth=2.0, first_chunk_frames_alone=1)
    assert [policy.min_frames(i) for i in range(3)] == [1, 8, 16]
    assert [policy.min_frames(i, shared=True) for i in range(3)] == [4, 8, 16]
    assert ChunkPolicy(first_chunk_frames=4).min_frames(0) == 4  # unset: as ever
    right = backend.receptive_field[1]
    fresh = [s.frames for s in policy.stateful_shapes(right, 64) if s.fresh]
    assert fresh == [1 + right, 4 + right]

    def first_job(shared: bool):
        stream = VocoderStream(backend.config, policy=policy, stateful=True)
        jobs = []
        for i in range(mel.shape[1]):
            stream.push_mel(mel[:, i : i + 1])
            jobs += stream.ready(shared=shared)
        return stream, jobs

    assert first_job(shared=True)[1][0].num_frames == 4 + right
    stream, jobs = first_job(shared=False)
    assert [j.num_frames for j in jobs[:3]] == [1 + right, 8, 16]
    stream.flush()
    jobs += stream.ready()
    chunks = [stream.complete(j, a) for j, a in zip(jobs, vocode_jobs(backend, jobs))]
    assert chunks[0].num_samples < 2 * HOP  # about a frame of audio, first
    audio = check_contiguous(chunks, mel.shape[1] * HOP)
    assert snr_db(audio, backend.run(mel[None])[0]) >= 40
    with pytest.raises(ValueError, match="first_chunk_frames_alone must be in"):
        ChunkPolicy(first_chunk_frames_alone=0)


@pytest.mark.parametrize("length", [9, 17, 18, 23, 41, 60])
def test_stream_jobs_keep_to_the_warmed_shapes(backend, mel, length):
    """Whatever the pieces and the end: the first job of a stream long enough is the policy's
    first, later ones whole quanta up to the shared cap, the final one under a quantum; a
    short input goes in one final job. The audio still equals offline synthesis."""
    policy = ChunkPolicy(max_chunk_frames=128, shared_chunk_frames=32)
    right = backend.receptive_field[1]
    warmed = {(s.frames, s.final, s.fresh) for s in policy.stateful_shapes(right, 64)}
    rng = np.random.default_rng(length)
    m = np.tile(mel, (1, 2))[:, :length]
    stream = VocoderStream(backend.config, policy=policy, stateful=True)
    jobs, lo = [], 0
    while lo < length:
        n = int(rng.integers(1, 7))
        stream.push_mel(m[:, lo : lo + n])
        lo += n
        jobs += stream.ready(shared=True)
    stream.flush()
    jobs += stream.ready(shared=True)
    shapes = [(j.num_frames, j.final, j.index == 0) for j in jobs]
    if length < 4 + right:
        assert shapes == [(length, True, True)]  # a short input from a fresh state, at once
    else:
        assert all(shape in warmed for shape in shapes), shapes
    chunks = [stream.complete(j, a) for j, a in zip(jobs, vocode_jobs(backend, jobs))]
    audio = check_contiguous(chunks, length * HOP)
    assert snr_db(audio, backend.run(m[None])[0]) >= 40


@needs_bf16
def test_bf16_stream_keeps_every_convolution_input_channels_last(monkeypatch, mel):
    """The CPU bf16 generator runs channels last: a layer whose input came out in the plain
    layout (an empty buffer or a one-sample state joined in front of it) converts it back
    inside oneDNN on every call, a third of a streamed call's time."""
    import vocoder_service.streaming as streaming

    backend = TorchBackend(bf16=True)
    layouts = []

    def recording(op):
        def run(layer, x, padding):
            layouts.append(x.is_contiguous(memory_format=torch.channels_last))
            return op(layer, x, padding)

        return run

    monkeypatch.setattr(streaming, "conv", recording(streaming.conv))
    monkeypatch.setattr(streaming, "conv_transpose", recording(streaming.conv_transpose))
    right = backend.receptive_field[1]
    _, state = backend.run_stream(mel[None, :, : right + 4], None)
    for frames in (1, 4, 8):  # a state carried from call to call
        _, state = backend.run_stream(mel[None, :, :frames], state)
    stacked, _ = backend.run_streams(np.stack([mel[:, :8]] * 2), [state, state])
    assert len(layouts) > 4 * 80 and all(layouts), [i for i, ok in enumerate(layouts) if not ok]


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)])
def test_carried_state_holds_no_activation_alive(bf16, mel):
    """Every tensor a stream carries to its next call has storage of its own, no larger than
    itself: a tail kept as a view would keep the whole activation it was cut from alive (tens
    of MB a stream for some 400 KB of state), and the forward's memory would not be reused."""
    backend = TorchBackend(bf16=bf16)
    right = backend.receptive_field[1]
    _, state = backend.run_stream(mel[None, :, : right + 4], None)
    for frames in (1, 8, 32):
        _, state = backend.run_stream(mel[None, :, :frames], state)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state)
    _, states = backend.run_streams(np.stack([mel[:, :8]] * 2), [state, state])
    held = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in states[0]}.values())
    assert held <= 2 * sum(t.numel() * t.element_size() for t in state)


@needs_bf16
def test_bf16_stream_reblocks_no_weight_per_call(capfd, mel):
    """Each convolution's weight is packed for the width classes of outputs it meets and the
    call picks the one oneDNN runs, so a streamed call re-blocks no weight (oneDNN's own log of what it
    runs): a weight packed for another width class was reordered on every call, up to a third
    of a 4-frame call's time."""
    backend = TorchBackend(bf16=True)
    right = backend.receptive_field[1]
    _, state = backend.run_stream(mel[None, :, : right + 8], None)
    for frames in (4, 32, 8):
        _, state = backend.run_stream(mel[None, :, :frames], state)  # compiled, not logged
    backend.run_streams(np.stack([mel[:, :8]] * 2), [state, state])
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        for frames in (4, 32):
            _, state = backend.run_stream(mel[None, :, :frames], state)
        backend.run_streams(np.stack([mel[:, :8]] * 2), [state, state])
    log = [line for line in capfd.readouterr().out.splitlines() if ",primitive,exec," in line]
    assert sum(",convolution," in line for line in log) >= 3 * 70, len(log)
    assert not [line for line in log if ",reorder," in line]
