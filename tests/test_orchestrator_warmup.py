"""The orchestrator warms up before it says it is serving: its front end, planner and encoders,
and one short synthesis through the backends, so the first caller does not pay for any of it
(real processes on 127.0.0.1)."""

from __future__ import annotations

import json
import shutil
import socket
import urllib.request

import grpc
import pytest

from orchestrator.launcher import start_service
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.procs import metric_value
from tests.voices import make_tts_voice, speech_tokens_only

STREAMS_OK = 'splittts_vocoder_streams_total{outcome="ok"}'


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return metric_value(text, name) or 0.0


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    # an LM that never ends a sentence: each synthesis runs to the voice's max_tokens (48)
    voice_dir = speech_tokens_only(make_tts_voice(tmp_path_factory.mktemp("voices")))
    text = start_service(
        "text-service",
        "text_service",
        ["--model", str(voice_dir / "lm"), "--threads", "1", "--kv-cache-memory", "32MiB"],
        metrics_port=0,
    )
    vocoder = start_service(
        "vocoder-service",
        "vocoder_service",
        ["--voice", str(voice_dir), "--threads", "1"],
        metrics_port=0,
    )
    yield voice_dir, text, vocoder
    for p in (text, vocoder):
        p.proc.terminate()
        p.proc.wait(30)


def orchestrator(voice_dir, text, vocoder):
    """An orchestrator on the two backends; it returns once it is serving (warm-up done)."""
    return start_service(
        "orchestrator",
        "orchestrator",
        ["--voice", str(voice_dir), "--text-service", text.address]
        + ["--vocoder-service", vocoder.address, "--http-port", "0"],
    )


def test_start_up_runs_one_synthesis_through_both_backends(backends):
    voice_dir, text, vocoder = backends
    generated = "splittts_text_time_to_first_token_seconds_count"
    before = scrape(text.metrics_port, generated), scrape(vocoder.metrics_port, STREAMS_OK)
    orch = orchestrator(voice_dir, text, vocoder)
    try:
        # serving, and nobody has called it yet: the backends' work is the warm-up's
        assert scrape(text.metrics_port, generated) > before[0]
        assert scrape(vocoder.metrics_port, STREAMS_OK) == before[1] + 1
        with grpc.insecure_channel(orch.address) as ch:  # and it still serves callers as ever
            replies = list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text="Hello there."), timeout=120
                )
            )
        assert replies[-1].HasField("report") and replies[-1].report.audio_s > 0
    finally:
        orch.proc.terminate()
        assert orch.proc.wait(30) == 0


def test_the_warm_up_synthesis_stops_at_its_own_bound(backends, tmp_path):
    """A voice may allow far longer sentences than a warm-up needs, and a random LM never ends
    one: the warm-up still stops after about 3 s of speech a sentence, and succeeds."""
    voice_dir, text, vocoder = backends
    rambling = tmp_path / "rambling"
    shutil.copytree(voice_dir, rambling)
    manifest = json.loads((rambling / "voice.json").read_text())
    manifest["max_tokens"] = 400
    (rambling / "voice.json").write_text(json.dumps(manifest))
    generated = "splittts_text_generation_tokens_total"
    before = scrape(text.metrics_port, generated), scrape(vocoder.metrics_port, STREAMS_OK)
    orch = orchestrator(rambling, text, vocoder)
    try:
        assert scrape(vocoder.metrics_port, STREAMS_OK) == before[1] + 1  # it ran to its end
        warm_tokens = scrape(text.metrics_port, generated) - before[0]
        # a sentence in each of the voice's languages, each stopped at 128 tokens, not 400
        assert 0 < warm_tokens <= 128 * len(manifest["languages"]), warm_tokens
    finally:
        orch.proc.terminate()
        assert orch.proc.wait(30) == 0


def test_start_up_does_not_wait_for_a_backend_that_is_down(backends):
    voice_dir, text, _ = backends
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        unused_port = s.getsockname()[1]
    orch = start_service(
        "orchestrator",
        "orchestrator",
        [
            "--voice",
            str(voice_dir),
            "--text-service",
            text.address,
            "--vocoder-service",
            f"127.0.0.1:{unused_port}",
            "--http-port",
            "-1",
        ],
        timeout_s=60,
    )
    try:
        assert orch.proc.poll() is None  # serving (NOT_SERVING in health until it comes up)
    finally:
        orch.proc.terminate()
        assert orch.proc.wait(30) == 0
