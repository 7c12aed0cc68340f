"""The whole pipeline over three real server processes on 127.0.0.1 (a tiny random voice)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from orchestrator.launcher import LocalDeployment, default_cpus, start_service, vocoder_nice
from splittts.text.v1 import text_pb2, text_pb2_grpc
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc
from tests.procs import metric_value
from tests.voices import make_tts_voice
from vocoder_service.backends import OnnxBackend
from vocoder_service.voice import load_voice

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


@pytest.fixture(scope="module")
def deployment(voice_dir):
    local = LocalDeployment(
        voice_dir,
        threads={"text": 1, "vocoder": 1},
        metrics_ports=(0, 0, 0),
        text_args=["--log-level", "info"],
        # synthesis is compared with offline fp32 vocoding of the same tokens
        vocoder_args=["--backend", "onnx"],
    )
    local.start()
    yield local
    local.stop()


def test_services_run_on_the_default_cores(deployment):
    """With no `cpus`, a local deployment pins each service where `default_cpus` says."""
    layout = default_cpus()
    for service, name in (
        ("text", "text-service"),
        ("vocoder", "vocoder-service"),
        ("orchestrator", "orchestrator"),
    ):
        pid = deployment.by_name(name).proc.pid
        assert os.sched_getaffinity(pid) == layout.get(service, os.sched_getaffinity(0)), name
    # the vocoder runs one worker per core it may use
    vocoder = deployment.by_name("vocoder-service").proc.pid
    argv = Path(f"/proc/{vocoder}/cmdline").read_bytes().decode().split("\0")
    workers = argv[argv.index("--workers") + 1] if "--workers" in argv else "1"
    assert workers == (str(len(layout["vocoder"])) if layout else "1")
    nice = os.getpriority(os.PRIO_PROCESS, vocoder) - os.getpriority(os.PRIO_PROCESS, 0)
    assert nice == vocoder_nice(layout)


def tts(address: str) -> tuple[grpc.Channel, tts_pb2_grpc.TextToSpeechStub]:
    ch = grpc.insecure_channel(address)
    return ch, tts_pb2_grpc.TextToSpeechStub(ch)


def synthesize(address: str, **kwargs) -> tuple[list[pb.AudioChunk], pb.LatencyReport]:
    ch, stub = tts(address)
    with ch:
        responses = list(stub.Synthesize(pb.SynthesizeRequest(**kwargs), timeout=120))
    chunks = [r.audio for r in responses if r.HasField("audio")]
    assert responses[-1].HasField("report")
    return chunks, responses[-1].report


def pcm(chunks) -> np.ndarray:
    return np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2").astype(np.float32) / 32767


def snr_db(ref, test) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-20)))


def test_synthesize_equals_offline_vocoding_of_the_same_tokens(deployment, voice_dir):
    text = "hello there. this is a test"
    chunks, report = synthesize(deployment.address, text=text, sampling=pb.SamplingConfig(seed=3))
    audio = pcm(chunks)
    # The same two sentences straight through the text service, then vocoded offline.
    voice = load_voice(voice_dir)
    import json

    manifest = json.loads((voice_dir / "voice.json").read_text())
    lo = manifest["speech_token_range"][0]
    tokens = []
    with grpc.insecure_channel(deployment.by_name("text-service").address) as ch:
        for i, sentence in enumerate(["hello there.", "this is a test"]):
            req = text_pb2.GenerateRequest(
                text=f"<bos>{sentence}<sep>",
                max_tokens=48,
                stop_token_ids=[3],
                sampling=text_pb2.SamplingConfig(seed=3 + i),
                allowed_tokens=text_pb2.TokenRange(start=lo, end=lo + 63),
            )
            for r in text_pb2_grpc.TextGenerationStub(ch).Generate(req, timeout=60):
                tokens += [t - lo for t in r.token_ids if lo <= t <= lo + 63]
    mel = voice.token_decoder.decode(np.array(tokens))
    offline = OnnxBackend(intra_op_threads=1).run(mel[None])[0]
    assert len(audio) == len(offline) == len(tokens) * 2 * 256
    assert snr_db(offline, audio) >= 40.0
    assert [c.sequence_number for c in chunks] == list(range(len(chunks)))
    assert all(
        b.first_sample == a.first_sample + len(a.audio) // 2 for a, b in zip(chunks, chunks[1:])
    )
    assert report.num_segments == 2 and report.num_speech_tokens == len(tokens)
    assert 0 < report.ttft_ms and 0 < report.ttfa_ms <= report.total_ms
    # the first audio, accounted for: its input reached the vocoder after the first token and
    # was vocoded within the time to first audio
    first = report.first_chunk_input_ms
    assert report.ttft_ms < first < first + report.first_chunk_vocoder_ms <= report.ttfa_ms
    assert 0 < report.first_chunk_compute_ms <= report.first_chunk_vocoder_ms
    assert report.audio_s == pytest.approx(len(audio) / 22050, rel=1e-6)
    assert report.rtf == pytest.approx(report.total_ms / 1e3 / report.audio_s, rel=1e-3)
    assert report.vocoder_compute_ms > 0 and report.decode_ms > 0
    assert {h.service for h in report.hops} == {"text", "vocoder"}
    assert all(h.mean_overhead_ms >= 0 and h.address for h in report.hops)


def test_streaming_synthesize_starts_audio_before_the_last_piece(deployment):
    pieces = ["hello wor", "ld. this ", "is the sec", "ond sentence", " and the last."]
    sent, first_audio = [], []
    release = threading.Event()

    def requests():
        yield pb.StreamingSynthesizeRequest(config=pb.StreamingSynthesizeConfig())
        for i, p in enumerate(pieces):
            if i == len(pieces) - 1:
                release.wait(60)  # hold the last piece until audio has come back
            sent.append(i)
            yield pb.StreamingSynthesizeRequest(text=p)

    ch, stub = tts(deployment.address)
    with ch:
        responses = []
        for r in stub.StreamingSynthesize(requests(), timeout=120):
            if r.HasField("audio") and not first_audio:
                first_audio.append(len(sent))
                release.set()
            responses.append(r)
    assert first_audio and first_audio[0] < len(pieces)
    report = responses[-1].report
    assert report.num_segments >= 2 and report.audio_s > 0


@pytest.mark.parametrize(
    "encoding,rate,used",
    [
        (pb.WAV, 0, 22050),
        (pb.FLAC, 16000, 16000),
        (pb.OGG_OPUS, 0, 24000),
        (pb.MP3, 0, 22050),
        (pb.MULAW, 0, 8000),
        (pb.ALAW, 16000, 16000),
        (pb.AAC, 0, 22050),
    ],
)
def test_encodings(deployment, encoding, rate, used):
    import io

    import soundfile as sf

    from orchestrator.encoders import fill_in_sizes

    chunks, report = synthesize(
        deployment.address,
        text="hi there",
        audio_config=pb.AudioConfig(encoding=encoding, sample_rate_hz=rate),
    )
    assert all(c.sample_rate_hz == used for c in chunks)
    blob = io.BytesIO(b"".join(c.audio for c in chunks))
    samples = sum(round(c.duration_s * used) for c in chunks)
    assert abs(samples - report.audio_s * used) <= len(chunks)
    if encoding == pb.AAC:  # libsndfile has no AAC: FFmpeg decodes it
        import subprocess

        r = subprocess.run(
            ["ffmpeg", "-v", "error", "-i", "pipe:0", "-f", "s16le", "pipe:1"],
            input=blob.getvalue(),
            capture_output=True,
            timeout=60,
        )
        assert r.returncode == 0 and len(r.stdout) // 2 >= samples > 0
        return
    if encoding == pb.FLAC:  # streamed FLAC says "length unknown"; as tts-cli does for a file
        fill_in_sizes(blob, 0, "FLAC", samples)
    raw = (
        dict(
            samplerate=used,
            channels=1,
            format="RAW",
            subtype=pb.AudioEncoding.Name(encoding).replace("MU", "U"),
        )
        if encoding in (pb.MULAW, pb.ALAW)
        else {}
    )
    data, sr = sf.read(io.BytesIO(blob.getvalue()), **raw)
    assert sr == used and len(data) >= samples > 0


def test_speaking_rate_changes_duration(deployment):
    _, normal = synthesize(
        deployment.address, text="a quick test", sampling=pb.SamplingConfig(seed=1)
    )
    _, fast = synthesize(
        deployment.address,
        text="a quick test",
        sampling=pb.SamplingConfig(seed=1),
        audio_config=pb.AudioConfig(speaking_rate=2.0),
    )
    assert fast.audio_s == pytest.approx(normal.audio_s / 2, rel=0.05)


def test_list_voices(deployment):
    ch, stub = tts(deployment.address)
    with ch:
        voices = stub.ListVoices(pb.ListVoicesRequest(), timeout=10).voices
        zh = stub.ListVoices(pb.ListVoicesRequest(language_code="zh-CN"), timeout=10).voices
        fr = stub.ListVoices(pb.ListVoicesRequest(language_code="fr-FR"), timeout=10).voices
    assert [v.name for v in voices] == ["tiny"] and voices[0].is_default
    assert [v.name for v in zh] == ["tiny"] and not fr


BAD = {
    "empty text": (dict(text="  "), INVALID, "text: must not be empty"),
    "nothing to say": (dict(text="... !!"), INVALID, "nothing to speak"),
    "text too long": (dict(text="a" * 5001), INVALID, "exceed the limit of 5000"),
    "unknown voice": (dict(text="hi", voice="nobody"), grpc.StatusCode.NOT_FOUND, "unknown voice"),
    "unsupported encoding": (
        dict(text="hi", audio_config=pb.AudioConfig(encoding=99)),
        INVALID,
        "audio_config.encoding: unsupported value 99; use one of "
        + ", ".join(pb.AudioEncoding.keys()[1:]),
    ),  # all but UNSPECIFIED
    "bad sample rate": (
        dict(text="hi", audio_config=pb.AudioConfig(sample_rate_hz=5)),
        INVALID,
        "audio_config.sample_rate_hz",
    ),
    "speaking rate too fast": (
        dict(text="hi", audio_config=pb.AudioConfig(speaking_rate=3.0)),
        INVALID,
        "speaking_rate",
    ),
    "language not spoken": (dict(text="hi", language_code="fr-FR"), INVALID, "language_code"),
    "negative temperature": (
        dict(text="hi", sampling=pb.SamplingConfig(temperature=-1)),
        INVALID,
        "sampling.temperature",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(deployment, case):
    kwargs, code, match = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        synthesize(deployment.address, **kwargs)
    assert err.value.code() == code, err.value.details()
    assert match in err.value.details()


@pytest.mark.parametrize(
    "messages,match",
    [
        (
            [pb.StreamingSynthesizeRequest(text="hello")],
            "first message must be a StreamingSynthesizeConfig",
        ),
        ([], "first message must be a StreamingSynthesizeConfig"),
        (
            [
                pb.StreamingSynthesizeRequest(config=pb.StreamingSynthesizeConfig()),
                pb.StreamingSynthesizeRequest(config=pb.StreamingSynthesizeConfig()),
            ],
            "config: sent twice",
        ),
        ([pb.StreamingSynthesizeRequest(config=pb.StreamingSynthesizeConfig())], "no text arrived"),
        (
            [pb.StreamingSynthesizeRequest(config=pb.StreamingSynthesizeConfig(voice="nobody"))],
            "unknown voice",
        ),
    ],
)
def test_malformed_streaming_synthesize(deployment, messages, match):
    ch, stub = tts(deployment.address)
    with ch, pytest.raises(grpc.RpcError) as err:
        list(stub.StreamingSynthesize(iter(messages), timeout=60))
    assert err.value.code() in (INVALID, grpc.StatusCode.NOT_FOUND)
    assert match in err.value.details()


def backends_idle(deployment, timeout: float = 20.0) -> tuple[int, int, int]:
    deadline = time.monotonic() + timeout
    while True:
        with grpc.insecure_channel(deployment.by_name("text-service").address) as ch:
            mi = text_pb2_grpc.TextGenerationStub(ch).GetModelInfo(
                text_pb2.GetModelInfoRequest(), timeout=5
            )
        with grpc.insecure_channel(deployment.by_name("vocoder-service").address) as ch:
            vi = vocoder_pb2_grpc.VocoderStub(ch).GetInfo(vocoder_pb2.GetInfoRequest(), timeout=5)
        state = (
            mi.num_used_blocks + mi.num_running + mi.num_waiting,
            mi.num_used_state_slots,
            vi.active_streams,
        )
        if state == (0, 0, 0) or time.monotonic() > deadline:
            return state


def test_cancel_releases_both_downstream_streams(deployment):
    ch, stub = tts(deployment.address)
    long_text = ". ".join(["this sentence keeps the pipeline busy for a while"] * 6)
    with ch:
        call = stub.Synthesize(pb.SynthesizeRequest(text=long_text), timeout=120)
        next(call)  # audio is flowing: both downstream streams are open
        call.cancel()
    assert backends_idle(deployment) == (0, 0, 0)
    text = (
        __import__("urllib.request")
        .request.urlopen(
            f"http://127.0.0.1:{deployment.by_name('orchestrator').metrics_port}/metrics", timeout=5
        )
        .read()
        .decode()
    )
    assert metric_value(text, "splittts_tts_requests_in_flight") == 0.0


def test_concurrent_calls_with_the_same_request_id_both_complete(deployment):
    results, errors = [], []

    def call():
        try:
            results.append(
                synthesize(
                    deployment.address, text="the same id twice, at once", request_id="same-id"
                )
            )
        except grpc.RpcError as exc:  # pragma: no cover - the failure this test guards against
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2
    assert all(report.request_id == "same-id" and chunks for chunks, report in results)


def test_metrics_and_trace_propagation(deployment):
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    ch, stub = tts(deployment.address)
    with ch:
        list(
            stub.Synthesize(
                pb.SynthesizeRequest(text="trace me", request_id="traced"),
                metadata=(("traceparent", f"00-{trace}-00f067aa0ba902b7-01"),),
                timeout=60,
            )
        )
    import urllib.request

    text = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{deployment.by_name('orchestrator').metrics_port}/metrics", timeout=5
        )
        .read()
        .decode()
    )
    for name in (
        "splittts_tts_ttfa_seconds_count",
        "splittts_tts_rtf_count",
        "splittts_tts_time_to_first_token_seconds_count",
    ):
        assert (metric_value(text, name) or 0) > 0, name
    deadline = time.monotonic() + 10
    log = deployment.by_name("text-service").stderr_tail
    while trace not in "".join(log) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trace in "".join(log)  # the text service saw the caller's trace id


def test_dead_replica_is_skipped(voice_dir):
    """Two text-service replicas; one is killed between requests; requests keep succeeding."""
    a = start_service(
        "text-a", "text_service", ["--model", str(voice_dir / "lm"), "--threads", "1"]
    )
    b = start_service(
        "text-b", "text_service", ["--model", str(voice_dir / "lm"), "--threads", "1"]
    )
    v = start_service("vocoder", "vocoder_service", ["--voice", str(voice_dir), "--threads", "1"])
    o = start_service(
        "orchestrator",
        "orchestrator",
        [
            "--voice",
            str(voice_dir),
            "--text-service",
            a.address,
            "--text-service",
            b.address,
            "--vocoder-service",
            v.address,
            "--health-interval",
            "30",
            "--http-port",
            "-1",
        ],
    )
    try:
        for _ in range(2):
            synthesize(o.address, text="both alive")
        a.proc.kill()
        a.proc.wait()
        for _ in range(3):
            chunks, report = synthesize(o.address, text="one replica left")
            assert chunks and report.audio_s > 0
            assert [h.address for h in report.hops if h.service == "text"] == [b.address]
    finally:
        for p in (o, v, b, a):
            if p.proc.poll() is None:
                p.proc.terminate()
                p.proc.wait(30)


# -- tts-cli -----------------------------------------------------------------------------------
def cli(*args: str, stdin: str | None = None):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_synthesize_against_server(deployment, tmp_path):
    import soundfile as sf

    out = tmp_path / "hello.wav"
    r = cli(
        "synthesize",
        "hello from the command line",
        "-o",
        str(out),
        "--server",
        deployment.address,
        "--seed",
        "4",
    )
    assert r.returncode == 0, r.stderr
    audio, rate = sf.read(out)
    assert rate == 22050 and len(audio) > 0
    assert "TTFA" in r.stderr and "RTF" in r.stderr and "TTFT" in r.stderr
    flac = tmp_path / "x.flac"
    r = cli(
        "synthesize",
        "-",
        "-o",
        str(flac),
        "--server",
        deployment.address,
        "--sample-rate",
        "16000",
        stdin="read from stdin",
    )
    assert r.returncode == 0, r.stderr
    assert sf.info(flac).samplerate == 16000 and sf.info(flac).format == "FLAC"


@pytest.mark.parametrize(
    "args,match",
    [
        (["synthesize", "", "-o", "x.wav"], "TEXT is empty"),
        (["synthesize", "hi", "-o", "x.wav", "--voice", "nobody"], "NOT_FOUND"),
        (["synthesize", "hi", "-o", "x.wav", "--speaking-rate", "9"], "--speaking-rate"),
        (["synthesize", "hi", "-o", "x.wav", "--format", "aiff"], "--format"),
        (["synthesize", "hi", "-o", "x.wav", "--sample-rate", "5"], "--sample-rate"),
        (["synthesize", "hi", "-o", "x.wav", "--bogus"], "unrecognized arguments"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(deployment, tmp_path, args, match):
    r = cli(*args, "--server", deployment.address)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr


def test_cli_service_failure_exits_1(tmp_path):
    r = cli(
        "synthesize",
        "hi",
        "-o",
        str(tmp_path / "x.wav"),
        "--server",
        "127.0.0.1:1",
        "--timeout",
        "5",
    )
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_cli_voices_and_bench(deployment):
    import json

    r = cli("voices", "--server", deployment.address, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)[0]["name"] == "tiny"
    r = cli(
        "bench", "--server", deployment.address, "--concurrency", "1,2", "--requests", "2", "--json"
    )
    assert r.returncode == 0, r.stderr
    levels = json.loads(r.stdout)["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert all(lv["requests"] == 2 and not lv["errors"] and lv["ttfa_p50_ms"] > 0 for lv in levels)


def test_cli_embedded_pipeline(voice_dir, tmp_path):
    """Without --server, one command starts the three services, speaks, and tears them down."""
    import shutil
    import subprocess

    import soundfile as sf

    own = shutil.copytree(voice_dir, tmp_path / "embedded-voice")
    out = tmp_path / "embedded.wav"
    r = cli("synthesize", "embedded run", "-o", str(out), "--voice-dir", str(own))
    assert r.returncode == 0, r.stderr
    assert sf.info(out).frames > 0
    left = subprocess.run(["pgrep", "-f", str(own)], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # every service it started is gone


def test_token_backlog_goes_to_the_vocoder_in_one_message():
    import asyncio

    from orchestrator.pipeline import _coalesced

    async def main():
        q: asyncio.Queue = asyncio.Queue()
        for item in ([1, 2], [3], [4, 5], None):
            q.put_nowait(item)
        first = await _coalesced(q)
        return first, await _coalesced(q)

    assert asyncio.run(main()) == ([1, 2, 3, 4, 5], None)
