"""The vocoder service as a real process on 127.0.0.1: streaming, health, metrics, bad input."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splittts.vocoder.v1 import vocoder_pb2 as pb, vocoder_pb2_grpc
from tests.procs import ROOT, ServiceProcess, metric_value
from tests.voices import make_random_voice
from vocoder_service.backends import OnnxBackend, cpu_runs_bf16_convs_fast
from vocoder_service.checkpoint import resolve_checkpoint
from vocoder_service.client import mel_requests, token_requests, vocode
from vocoder_service.mel import MelSpectrogram
from vocoder_service.voice import load_voice

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-20)))


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return make_random_voice(tmp_path_factory.mktemp("voices"))


def vocoder_process(voice_dir, cache, *flags: str) -> ServiceProcess:
    """A vocoder service on one thread over `voice_dir`, its ONNX exports cached in `cache`."""
    return ServiceProcess(
        "vocoder_service",
        "--voice",
        str(voice_dir),
        "--threads",
        "1",
        *flags,
        env={"SPLITTTS_CACHE": str(cache)},
    )


def info_and_audio(proc: ServiceProcess, requests=None):
    """The service's GetInfo and, given requests, what it vocodes for them; then it stops."""
    try:
        with proc.channel() as ch:
            info = vocoder_pb2_grpc.VocoderStub(ch).GetInfo(pb.GetInfoRequest(), timeout=10)
            result = None if requests is None else vocode(ch, requests)
    finally:
        assert proc.stop() == 0
    return info, result


@pytest.fixture(scope="module")
def service(voice_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # streaming's exact arithmetic is checked in fp32; the default has its own test
    proc = vocoder_process(voice_dir, cache, "--backend", "onnx", "--max-streams", "8")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def speech_mel():
    config = resolve_checkpoint().config
    audio, rate = sf.read(ROOT / "assets" / "demo_sentence.wav", dtype="float32")
    assert rate == config.sampling_rate
    return MelSpectrogram(config)(audio[: rate * 1])[0].numpy()  # one second of real speech


@pytest.fixture(scope="module")
def offline_backend(service):
    return OnnxBackend(intra_op_threads=1, cache_dir=None)


def stub(service) -> vocoder_pb2_grpc.VocoderStub:
    return vocoder_pb2_grpc.VocoderStub(service.channel())


def test_health_reflection_and_info(service, voice_dir):
    assert service.health() == health_pb2.HealthCheckResponse.SERVING
    assert service.health("splittts.vocoder.v1.Vocoder") == health_pb2.HealthCheckResponse.SERVING
    with service.channel() as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"splittts.vocoder.v1.Vocoder", "grpc.health.v1.Health"} <= names
        info = vocoder_pb2_grpc.VocoderStub(ch).GetInfo(pb.GetInfoRequest(), timeout=10)
    assert [v.name for v in info.voices] == ["testvoice"]
    assert info.voices[0].codebook_size == 64 and info.voices[0].frames_per_token == 2
    assert info.backend == "onnxruntime" and info.precision == "fp32"
    assert info.receptive_field_frames >= 10


def test_default_backend_follows_the_cpu(voice_dir, tmp_path, speech_mel, offline_backend):
    """With no --backend the service picks by the CPU: torch in bf16 where it runs bf16
    convolutions fast (AMX, or AVX-512 BF16 on AMD), else ONNX Runtime in fp32; either way its
    audio is the fp32 audio to within bf16's rounding."""
    info, result = info_and_audio(vocoder_process(voice_dir, tmp_path), mel_requests(speech_mel, 3))
    expected = ("torch", "bf16") if cpu_runs_bf16_convs_fast() else ("onnxruntime", "fp32")
    assert (info.backend, info.precision) == expected
    offline = offline_backend.run(speech_mel[None])[0]
    assert len(result.audio) == len(offline) == speech_mel.shape[1] * 256
    # bf16 gives 24 dB here and 37 dB on the default voice's mels; its WER and DNSMOS equal
    # fp32's on the natural held-out set (bench/README.md). A broken path gives noise, near 0 dB.
    assert snr_db(offline, result.audio) >= 18.0


@pytest.mark.parametrize("chunk_frames", [1, 3, 1000])
def test_mel_stream_equals_offline(service, speech_mel, offline_backend, chunk_frames):
    offline = offline_backend.run(speech_mel[None])[0]
    with service.channel() as ch:
        result = vocode(ch, mel_requests(speech_mel, chunk_frames))
    assert result.sample_rate == 22050
    assert len(result.audio) == speech_mel.shape[1] * 256  # no gap, no duplicate
    assert [c.sequence_number for c in result.chunks] == list(range(len(result.chunks)))
    assert snr_db(offline, result.audio) >= 40.0
    assert result.summary.num_samples == len(result.audio)
    assert result.summary.num_chunks == len(result.chunks)
    n_messages = 2 + -(-speech_mel.shape[1] // chunk_frames)  # config, chunks, end
    assert all(1 <= t.trigger_message < n_messages for t in result.timings)
    assert all(t.service_ms >= t.compute_ms > 0 for t in result.timings)
    if chunk_frames == 1:
        assert len(result.chunks) > 2  # streamed, not one block at the end


def test_workers_serve_concurrent_streams_each_equal_to_offline(
    voice_dir, tmp_path, speech_mel, offline_backend
):
    """Two workers on the torch backend: streams in flight at once, stacked and joined in
    forwards of their own, each still gets its offline audio."""
    proc = vocoder_process(voice_dir, tmp_path, "--backend", "torch", "--workers", "2")
    try:
        mels = [speech_mel[:, i * 7 : i * 7 + 60] for i in range(4)]
        results: list = [None] * len(mels)

        def one(i: int) -> None:
            with proc.channel() as ch:
                results[i] = vocode(ch, mel_requests(mels[i], 2 + i % 2))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(mels))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        assert proc.stop() == 0
    for mel, result in zip(mels, results):
        offline = offline_backend.run(mel[None])[0]
        assert result is not None and len(result.audio) == mel.shape[1] * 256
        assert snr_db(offline, result.audio) >= 40.0


def test_token_stream_equals_offline(service, voice_dir, offline_backend):
    voice = load_voice(voice_dir)
    ids = np.random.default_rng(0).integers(0, 64, size=40)
    offline = offline_backend.run(voice.token_decoder.decode(ids)[None])[0]
    with service.channel() as ch:
        result = vocode(ch, token_requests(ids.tolist(), 3))
    assert len(result.audio) == 40 * 2 * 256
    assert snr_db(offline, result.audio) >= 40.0


def test_first_audio_arrives_before_end_of_stream(service, speech_mel):
    """Audio for the first frames comes back while the client still holds back its end."""
    release = threading.Event()
    first_audio = []

    def requests():
        yield from mel_requests(speech_mel, 8, end=False)
        release.wait(30)
        yield pb.VocodeRequest(end_of_stream=True)

    with service.channel() as ch:
        for resp in vocoder_pb2_grpc.VocoderStub(ch).Vocode(requests(), timeout=60):
            if resp.HasField("audio") and not first_audio:
                first_audio.append(resp.audio.num_samples)
                release.set()
    assert first_audio and first_audio[0] > 0


def expect_status(service, requests, code, match):
    with pytest.raises(grpc.RpcError) as err:
        with service.channel() as ch:
            list(vocoder_pb2_grpc.VocoderStub(ch).Vocode(iter(requests), timeout=30))
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()


def cfg(kind=pb.INPUT_KIND_MEL, voice=""):
    return pb.VocodeRequest(config=pb.VocodeConfig(voice=voice, input_kind=kind))


TOKENS = pb.INPUT_KIND_SPEECH_TOKENS
BAD_INPUTS = {
    "no config": ([pb.VocodeRequest(tokens=pb.TokenChunk(ids=[1]))], INVALID, "first message"),
    "nothing at all": ([], INVALID, "before its config"),
    "two configs": ([cfg(), cfg()], INVALID, "config: sent twice"),
    "unknown voice": ([cfg(voice="nobody")], grpc.StatusCode.NOT_FOUND, "unknown voice"),
    "no input kind": ([cfg(kind=pb.INPUT_KIND_UNSPECIFIED)], INVALID, "input_kind"),
    "token outside codebook": (
        [cfg(TOKENS), pb.VocodeRequest(tokens=pb.TokenChunk(ids=[3, 64]))],
        INVALID,
        "id 64 is outside the codebook [0, 64)",
    ),
    "mel wrong width": (
        [cfg(), pb.VocodeRequest(mel=pb.MelChunk(num_mels=40, values=[0.0] * 40))],
        INVALID,
        "mel.num_mels must be 80",
    ),
    "mel ragged": (
        [cfg(), pb.VocodeRequest(mel=pb.MelChunk(num_mels=80, values=[0.0] * 81))],
        INVALID,
        "whole number",
    ),
    "nan": (
        [cfg(), pb.VocodeRequest(mel=pb.MelChunk(num_mels=80, values=[float("nan")] * 80))],
        INVALID,
        "must be finite",
    ),
    "inf": (
        [cfg(), pb.VocodeRequest(mel=pb.MelChunk(num_mels=80, values=[float("inf")] * 80))],
        INVALID,
        "must be finite",
    ),
    "empty stream": ([cfg(), pb.VocodeRequest(end_of_stream=True)], INVALID, "empty stream"),
    "chunk over limit": (
        [cfg(TOKENS), pb.VocodeRequest(tokens=pb.TokenChunk(ids=[1] * 5000))],
        INVALID,
        "exceed the limit of 4096",
    ),
    "tokens on a mel stream": (
        [cfg(), pb.VocodeRequest(tokens=pb.TokenChunk(ids=[1]))],
        INVALID,
        "configured for INPUT_KIND_MEL",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_clear_status_and_service_keeps_serving(service, case):
    requests, code, match = BAD_INPUTS[case]
    expect_status(service, requests, code, match)
    assert service.alive()
    with service.channel() as ch:  # the next good stream still works
        result = vocode(ch, token_requests([1, 2, 3, 4, 5, 6], 6))
    assert len(result.audio) == 6 * 2 * 256


def wait_for_streams(service, n: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        with service.channel() as ch:
            active = (
                vocoder_pb2_grpc.VocoderStub(ch)
                .GetInfo(pb.GetInfoRequest(), timeout=5)
                .active_streams
            )
        if active == n or time.monotonic() > deadline:
            return active
        time.sleep(0.05)


def test_vanished_client_frees_its_stream(service, speech_mel):
    stop = threading.Event()

    def requests():
        yield from mel_requests(speech_mel, 4, end=False)
        stop.wait(30)

    with service.channel() as ch:
        call = vocoder_pb2_grpc.VocoderStub(ch).Vocode(requests(), timeout=60)
        next(call)  # the stream is open and producing audio
        assert wait_for_streams(service, 1) == 1
        call.cancel()
    stop.set()
    assert wait_for_streams(service, 0) == 0
    text = service.metrics()
    assert metric_value(text, "splittts_vocoder_active_streams") == 0.0
    assert (metric_value(text, "splittts_vocoder_streams_total", 'outcome="cancelled"') or 0) >= 1


def test_metrics_exported(service):
    text = service.metrics()
    for name in (
        "splittts_vocoder_first_audio_seconds_count",
        "splittts_vocoder_rtf_count",
        "splittts_vocoder_chunk_compute_seconds_count",
        "splittts_vocoder_batch_size_count",
    ):
        assert (metric_value(text, name) or 0) > 0, name


def test_admission_cap_and_sigterm_drain(voice_dir, tmp_path, speech_mel):
    proc = vocoder_process(voice_dir, tmp_path, "--max-streams", "1", "--grace", "20")
    release = threading.Event()

    def slow_requests():
        yield from mel_requests(speech_mel[:, :40], 4, end=False)
        release.wait(30)
        yield pb.VocodeRequest(end_of_stream=True)

    try:
        with proc.channel() as ch:
            first = vocoder_pb2_grpc.VocoderStub(ch).Vocode(slow_requests(), timeout=60)
            next(first)
            expect_status(proc, [cfg()], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_streams=1")
            proc.proc.send_signal(15)  # SIGTERM: drain the open stream, refuse new work
            time.sleep(0.5)
            assert proc.alive()
            release.set()
            rest = list(first)
            assert rest[-1].HasField("summary")
            assert rest[-1].summary.num_samples == 40 * 256
        assert proc.proc.wait(30) == 0
    finally:
        release.set()
        proc.stop()


def test_flush_emits_everything_received_and_keeps_the_stream_open(service):
    """A flush is a pause point: all audio so far comes out now; the stream then continues."""
    got_all = threading.Event()
    ids = list(range(10))

    def requests():
        yield cfg(TOKENS)
        yield pb.VocodeRequest(tokens=pb.TokenChunk(ids=ids))
        yield pb.VocodeRequest(flush=True)
        got_all.wait(30)
        yield pb.VocodeRequest(tokens=pb.TokenChunk(ids=ids))
        yield pb.VocodeRequest(end_of_stream=True)

    samples = 0
    with service.channel() as ch:
        for resp in vocoder_pb2_grpc.VocoderStub(ch).Vocode(requests(), timeout=60):
            if resp.HasField("audio"):
                samples += resp.audio.num_samples
                if samples == 10 * 2 * 256:
                    got_all.set()  # every frame before the flush, with no right context waited for
            else:
                assert resp.summary.num_samples == 20 * 2 * 256
    assert got_all.is_set()


@pytest.mark.parametrize(
    "flags,match",
    [
        (("--shared-chunk-frames", "0"), "shared_chunk_frames must be >= 1"),
        (("--max-batch-frames", "-5"), "max_batch_frames must be >= 1"),
        (("--max-first-batch", "-1"), "max_first_batch must be >= 1"),
        (("--first-chunk-frames", "0"), "first_chunk_frames must be >= 1"),
        (("--first-chunk-frames-alone", "-1"), "first_chunk_frames_alone must be in [1, "),
        (("--backend", "onnx", "--bf16"), "--bf16 runs on the torch backend"),
        (("--workers", "0"), "workers must be >= 1"),
        (("--gil-switch-ms", "0"), "--gil-switch-ms must be in (0, 1000]"),
        (("--gil-switch-ms", "nan"), "--gil-switch-ms must be in (0, 1000]"),
    ],
)
def test_bad_flags_exit_2_with_one_line(voice_dir, flags, match):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "vocoder_service",
            "--voice",
            str(voice_dir),
            "--port",
            "0",
            "--metrics-port",
            "-1",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr


def test_the_service_hands_the_gil_on_sooner_than_python_does() -> None:
    """The vocoder's process switches threads at `--gil-switch-ms` (default 0.5 ms), not at
    Python's 5 ms: a forward's operators wait that long for the GIL behind the event loop."""
    import sys

    from vocoder_service.__main__ import GIL_SWITCH_MS, build_parser, set_gil_switch

    before = sys.getswitchinterval()
    try:
        set_gil_switch(build_parser().parse_args([]).gil_switch_ms)
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_MS / 1e3)
        assert sys.getswitchinterval() < before
    finally:
        sys.setswitchinterval(before)


def test_warmup_runs_each_stateful_shape_once_over_the_workers(voice_dir):
    """Before it serves, a CPU vocoder runs one stateful forward of every shape its streams
    mostly use (oneDNN compiles each shape on first use), spread over its workers."""
    from vocoder_service.backends import TorchBackend
    from vocoder_service.server import VocoderServicer

    voice = load_voice(voice_dir)
    seen: list[tuple[tuple[int, int, bool, bool], str]] = []

    class Recording(TorchBackend):
        def run_streams(self, mel, states, final=False):
            shape = (mel.shape[0], mel.shape[2], final, states[0] is None)
            seen.append((shape, threading.current_thread().name))
            return super().run_streams(mel, states, final)

    backend = Recording(voice.generator)
    assert backend.compiles_per_shape
    servicer = VocoderServicer([voice], {voice.name: backend}, workers=2)
    servicer.warmup()
    expected = servicer.policy.stateful_shapes(backend.receptive_field[1], 64)
    ran = [shape for shape, _ in seen]
    assert sorted(ran[-len(expected) :]) == sorted(tuple(s) for s in expected)
    assert len({thread for _, thread in seen[-len(expected) :]}) == 2
