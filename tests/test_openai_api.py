"""The OpenAI-compatible endpoint, driven by the official `openai` client against real services."""

from __future__ import annotations

import io
import json
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import openai
import pytest
import soundfile

from orchestrator.launcher import LocalDeployment
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.ffmpeg import ffmpeg_pcm
from tests.procs import metric_value
from tests.voices import make_tts_voice

TEXT = "hello there, this is the speech endpoint"
LONG_TEXT = " ".join(
    f"this is sentence number {i} and it keeps the pipeline busy." for i in range(12)
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    local = LocalDeployment(
        make_tts_voice(tmp_path_factory.mktemp("voices")),
        threads={"text": 1, "vocoder": 1},
        metrics_ports=(0, -1, -1),
        http_port=0,
        # fp32: the same speech made twice then differs by a few LSBs at most, however its
        # token stream was chunked (bf16's rounding follows the chunking)
        vocoder_args=["--backend", "onnx"],
    )
    local.start()
    yield local
    local.stop()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(
        base_url=deployment.http_url + "v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def reference(deployment) -> bytes:
    """The same speech through the gRPC API: LINEAR16 at 24 kHz."""
    with grpc.insecure_channel(deployment.address) as ch:
        responses = tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
            pb.SynthesizeRequest(
                text=TEXT,
                voice="tiny",
                audio_config=pb.AudioConfig(encoding=pb.LINEAR16, sample_rate_hz=24000),
            ),
            timeout=120,
        )
        pcm = b"".join(r.audio.audio for r in responses if r.HasField("audio"))
    assert len(pcm) > 2000
    return pcm


def probe(blob: bytes) -> dict:
    r = subprocess.run(
        [
            "ffprobe",
            "-v",
            "error",
            "-print_format",
            "json",
            "-show_format",
            "-show_streams",
            "pipe:0",
        ],
        input=blob,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def same_audio(a: bytes, b: bytes) -> bool:
    """The same int16 samples, up to the few LSBs by which the vocoder's float maths varies
    with how the token stream happened to be chunked."""
    x, y = np.frombuffer(a, "<i2").astype(int), np.frombuffer(b, "<i2").astype(int)
    return len(x) == len(y) > 0 and int(np.abs(x - y).max()) <= 4


def speak(client, **kwargs) -> bytes:
    args = dict(model="tts-1", voice="tiny", input=TEXT) | kwargs
    return client.audio.speech.create(**args).read()


@pytest.mark.parametrize(
    "fmt, codec",
    [("mp3", "mp3"), ("opus", "opus"), ("aac", "aac"), ("flac", "flac"), ("wav", "pcm_s16le")],
)
def test_each_format_decodes_to_the_speech(client, reference, fmt, codec):
    blob = speak(client, response_format=fmt)
    stream = probe(blob)["streams"][0]
    assert stream["codec_name"] == codec and stream["channels"] == 1
    pcm = ffmpeg_pcm(blob)
    if fmt in ("flac", "wav"):  # lossless: the very samples of the gRPC API
        assert same_audio(pcm, reference)
    else:  # lossy, with the codec's delay and padding
        assert len(reference) <= len(pcm) < len(reference) + 2 * 4096
    if fmt == "wav":
        data, rate = soundfile.read(io.BytesIO(blob), dtype="int16")
        assert rate == 24000 and data.tobytes() == pcm


def test_mp3_is_the_default_and_pcm_is_raw_24khz(client, reference):
    assert probe(speak(client))["streams"][0]["codec_name"] == "mp3"
    assert same_audio(speak(client, response_format="pcm"), reference)


def test_speed_changes_the_duration(client, reference):
    fast = speak(client, response_format="pcm", speed=2.0)
    assert abs(len(fast) / len(reference) - 0.5) < 0.05


def test_streaming_response_arrives_while_the_speech_is_made(client, deployment):
    port = deployment.by_name("orchestrator").metrics_port

    def in_flight() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return metric_value(r.read().decode(), "splittts_tts_requests_in_flight")

    with client.audio.speech.with_streaming_response.create(
        model="split-tts", voice="tiny", input=LONG_TEXT, response_format="wav"
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in response.headers
        chunks = response.iter_bytes()
        first = next(chunks)
        assert first[:4] == b"RIFF"
        # Audio is here, and the synthesis is still going (a reader that waits holds it).
        assert in_flight() == 1.0
    # Leaving the block closes the connection: the synthesis is cancelled downstream.
    deadline = time.monotonic() + 30
    while in_flight() != 0.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight() == 0.0


def test_streamed_body_equals_the_whole_one(client):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1-hd", voice={"id": "tiny"}, input=TEXT, response_format="flac"
    ) as r:
        streamed = b"".join(r.iter_bytes(1000))
    assert same_audio(ffmpeg_pcm(streamed), ffmpeg_pcm(speak(client, response_format="flac")))


def test_models_and_voices(client):
    models = [m.id for m in client.models.list()]
    assert "split-tts" in models and "tts-1" in models
    assert client.models.retrieve("tts-1").owned_by == "split-tts"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("whisper-1")
    voices = client.get("/audio/voices", cast_to=object)
    assert voices["object"] == "list"
    (voice,) = voices["data"]
    assert voice["id"] == "tiny" and voice["object"] == "audio.voice" and voice["is_default"]
    assert voice["language_codes"] == ["en-US", "cmn-CN"]


@pytest.mark.parametrize(
    "kwargs, error, status, param",
    [
        (dict(voice="alloy"), openai.NotFoundError, 404, "voice"),
        (dict(model="whisper-1"), openai.NotFoundError, 404, "model"),
        (dict(input=""), openai.BadRequestError, 400, "input"),
        (dict(input="a" * 5001), openai.BadRequestError, 400, "input"),
        (dict(speed=4.0), openai.BadRequestError, 400, "speed"),
        (dict(response_format="ogg"), openai.BadRequestError, 400, "response_format"),
        (dict(stream_format="sse"), openai.BadRequestError, 400, "stream_format"),
        (dict(extra_body={"sampling": 1}), openai.BadRequestError, 400, "sampling"),
    ],
)
def test_errors_are_openai_style(client, kwargs, error, status, param):
    with pytest.raises(error) as info:
        speak(client, **kwargs)
    assert info.value.status_code == status
    body = info.value.response.json()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert param in body["message"] and body["code"]


def test_malformed_bodies_are_400_and_the_server_stays_up(deployment, client, reference):
    url = deployment.http_url + "v1/audio/speech"
    malformed = (
        b"{not json",
        b"[1, 2]",
        json.dumps({"input": "hi", "voice": "tiny"}).encode(),
        json.dumps(
            {"model": "tts-1", "input": "hi", "voice": "tiny", "response_format": ["mp3"]}
        ).encode(),
        json.dumps({"model": "tts-1", "input": ["hi"], "voice": {"id": 3}}).encode(),
    )
    for data in malformed:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 400
        assert set(json.loads(info.value.read())["error"]) == {"message", "type", "param", "code"}
    assert same_audio(speak(client, response_format="pcm"), reference)


def test_a_stream_cut_by_a_failure_does_not_look_complete(tmp_path):
    """Once audio has gone out, an error cannot be a status: the connection is cut instead."""
    local = LocalDeployment(
        make_tts_voice(tmp_path), threads={"text": 1, "vocoder": 1}, http_port=0
    )
    local.start()
    try:
        client = openai.OpenAI(
            base_url=local.http_url + "v1", api_key="unused", max_retries=0, timeout=120
        )
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="tiny", input=LONG_TEXT, response_format="pcm"
        ) as response:
            chunks = response.iter_bytes()
            assert next(chunks)
            local.by_name("vocoder-service").proc.kill()  # the only vocoder replica dies
            with pytest.raises(Exception, match="incomplete chunked read"):
                for _ in chunks:
                    pass
    finally:
        local.stop()
