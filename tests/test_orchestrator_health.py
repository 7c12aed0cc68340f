"""The orchestrator's health follows its backends: NOT_SERVING with no healthy text or vocoder
replica left, SERVING again when one returns (real processes on 127.0.0.1)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.launcher import start_service
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.voices import make_tts_voice

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TTS = "splittts.tts.v1.TextToSpeech"


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            .status
        )


def wait_health(address: str, want: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health(address, TTS) == want:
            assert health(address) == SERVING  # the process itself is alive (liveness)
            return
        time.sleep(0.1)
    raise AssertionError(f"orchestrator health did not become {want} within {timeout} s")


def test_health_follows_the_backends(voice_dir):
    def text(port: int = 0):
        return start_service(
            "text-service",
            "text_service",
            ["--model", str(voice_dir / "lm"), "--threads", "1", "--kv-cache-memory", "32MiB"],
            port=port,
        )

    def vocoder(port: int = 0):
        return start_service(
            "vocoder-service",
            "vocoder_service",
            ["--voice", str(voice_dir), "--threads", "1"],
            port=port,
        )

    procs = [text(), vocoder()]
    try:
        orch = start_service(
            "orchestrator",
            "orchestrator",
            [
                "--voice",
                str(voice_dir),
                "--text-service",
                procs[0].address,
                "--vocoder-service",
                procs[1].address,
                "--health-interval",
                "0.2",
            ],
        )
        procs.append(orch)
        wait_health(orch.address, SERVING)
        for i, restart in ((0, text), (1, vocoder)):
            down = procs[i]
            down.proc.send_signal(signal.SIGKILL)
            down.proc.wait(10)
            wait_health(orch.address, NOT_SERVING)
            procs[i] = restart(port=down.port)
            wait_health(orch.address, SERVING)
        with grpc.insecure_channel(orch.address) as ch:  # and it routes to the new replicas
            responses = list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text="hello there"), timeout=120
                )
            )
        assert responses[-1].HasField("report") and responses[0].HasField("audio")
    finally:
        for p in reversed(procs):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
                p.proc.wait(30)
