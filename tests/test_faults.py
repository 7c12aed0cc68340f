"""Faults over real processes on 127.0.0.1: two replicas of each backend, one killed with
SIGKILL mid-stream. The call on it fails UNAVAILABLE, the call on the other completes, new calls
go to the survivor, and the killed replica serves again once restarted on its port."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from orchestrator.launcher import Process, start_service
from orchestrator.pipeline import Pipeline, VocodeSession
from orchestrator.replicas import ReplicaPool
from orchestrator.voices import VoiceSpec
from servicekit.errors import StatusError
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from splittts.vocoder.v1 import vocoder_pb2
from tests.procs import scrape, wait_until
from tests.voices import make_tts_voice, speech_tokens_only

MAX_TOKENS = 800  # about 19 s of audio a call: a paused call is mid-stream at both backends
SAMPLES = MAX_TOKENS * 2 * 256


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return speech_tokens_only(
        make_tts_voice(
            tmp_path_factory.mktemp("voices"),
            max_tokens=MAX_TOKENS,
            lm_overrides={"max_position_embeddings": 4096},
        )
    )


def text_replica(voice_dir, name: str, port: int = 0) -> Process:
    return start_service(
        name,
        "text_service",
        ["--model", str(voice_dir / "lm"), "--threads", "1", "--max-stream-backlog", "16"],
        port=port,
        metrics_port=0,
    )


def vocoder_replica(voice_dir, name: str, port: int = 0) -> Process:
    return start_service(
        name,
        "vocoder_service",
        ["--voice", str(voice_dir), "--threads", "1", "--max-audio-ahead", "0.5"],
        port=port,
        metrics_port=0,
    )


@pytest.fixture(scope="module")
def cluster(voice_dir):
    procs = {
        "text-a": text_replica(voice_dir, "text-a"),
        "text-b": text_replica(voice_dir, "text-b"),
        "voc-a": vocoder_replica(voice_dir, "voc-a"),
        "voc-b": vocoder_replica(voice_dir, "voc-b"),
    }
    procs["orch"] = start_service(
        "orchestrator",
        "orchestrator",
        [
            "--voice",
            str(voice_dir),
            "--text-service",
            procs["text-a"].address,
            "--text-service",
            procs["text-b"].address,
            "--vocoder-service",
            procs["voc-a"].address,
            "--vocoder-service",
            procs["voc-b"].address,
            "--health-interval",
            "0.5",
            "--max-audio-ahead",
            "1.0",
            "--http-port",
            "-1",
        ],
    )
    yield procs
    for p in procs.values():
        if p.proc.poll() is None:
            p.proc.terminate()
            p.proc.wait(30)


class Call:
    """A Synthesize call on its own thread that takes one message, then waits for `go`."""

    def __init__(self, address: str, text: str):
        self.go = threading.Event()
        self.first = threading.Event()
        self.samples = 0
        self.report: pb.LatencyReport | None = None
        self.code = grpc.StatusCode.OK
        self.details = ""
        self._thread = threading.Thread(target=self._run, args=(address, text), daemon=True)
        self._thread.start()

    def _run(self, address: str, text: str) -> None:
        try:
            # no BDP probing: the window stays at 64 KiB, so a paused call stays mid-stream
            with grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
                for resp in tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text=text), timeout=240
                ):
                    if resp.HasField("audio"):
                        self.samples += len(resp.audio.audio) // 2
                    if resp.HasField("report"):
                        self.report = resp.report
                    self.first.set()
                    self.go.wait(240)
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()
        finally:
            self.first.set()

    def finish(self, timeout: float = 120.0) -> Call:
        self.go.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call neither finished nor failed in time"
        return self

    def hop(self, service: str) -> str:
        return next(h.address for h in self.report.hops if h.service == service)


def one_call_each(cluster, gauge: str, names: tuple[str, str]) -> dict[str, Call]:
    """Two paused calls, one on each replica of a kind (the second goes to the idle one)."""
    calls, orch = {}, cluster["orch"].address
    for i in range(2):
        call = Call(orch, f"fault test call {i}")
        assert call.first.wait(120) and call.code == grpc.StatusCode.OK, call.details
        assert wait_until(
            lambda: any(scrape(cluster[n], gauge) >= 1 for n in names if n not in calls)
        )
        busy = [n for n in names if n not in calls and scrape(cluster[n], gauge) >= 1]
        calls[busy[0]] = call
    return calls


def check_kill_and_recovery(cluster, voice_dir, kind: str, gauge: str, restart) -> None:
    a, b = f"{kind}-a", f"{kind}-b"
    service = "text" if kind == "text" else "vocoder"
    calls = one_call_each(cluster, gauge, (a, b))
    victim = cluster[a]
    victim.proc.kill()  # SIGKILL mid-stream
    victim.proc.wait()
    failed, survived = calls[a].finish(), calls[b].finish()
    assert failed.code == grpc.StatusCode.UNAVAILABLE, (failed.code, failed.details)
    assert f"{service} service" in failed.details and victim.address not in failed.details
    assert survived.code == grpc.StatusCode.OK, survived.details
    assert survived.samples == SAMPLES and survived.hop(service) == cluster[b].address
    call = Call(cluster["orch"].address, "after the kill").finish()  # new calls: the survivor
    assert call.code == grpc.StatusCode.OK, call.details
    assert call.samples == SAMPLES and call.hop(service) == cluster[b].address
    cluster[a] = restart(voice_dir, a, port=victim.port)  # same address: the orchestrator keeps it

    def served_by_restarted() -> bool:
        call = Call(cluster["orch"].address, "after the restart").finish()
        assert call.code == grpc.StatusCode.OK, call.details
        return call.hop(service) == cluster[a].address

    assert wait_until(served_by_restarted, timeout=60, interval=0.5)


def test_text_replica_killed_mid_stream(cluster, voice_dir):
    check_kill_and_recovery(
        cluster, voice_dir, "text", "splittts_text_num_requests_running", text_replica
    )


def test_vocoder_replica_killed_mid_stream(cluster, voice_dir):
    check_kill_and_recovery(
        cluster, voice_dir, "voc", "splittts_vocoder_active_streams", vocoder_replica
    )


def test_write_after_the_vocoder_stream_ended_fails_with_its_status(voice_dir):
    """The token feed can find the Vocode stream already ended by its replica's death (the read
    side saw it first): that write fails with the stream's own status, UNAVAILABLE for the
    caller, never a client-library state error reported as INTERNAL."""
    replica = vocoder_replica(voice_dir, "voc-lone")

    async def write_after_kill() -> StatusError:
        pool = ReplicaPool([replica.address], "splittts.vocoder.v1.Vocoder")
        session = VocodeSession(pool, VoiceSpec.load(voice_dir), "lone")
        try:
            await session.open()
            replica.proc.kill()
            replica.proc.wait()
            assert session.call is not None
            # the stream ends: UNAVAILABLE, or INTERNAL "Internal error from Core" when the
            # client library's own send hit the dead connection first
            assert await session.call.code() != grpc.StatusCode.OK
            with pytest.raises(StatusError) as failed:
                await Pipeline._to_vocoder(session, vocoder_pb2.VocodeRequest(flush=True))
            return failed.value
        finally:
            session.close()
            await pool.close()

    error = asyncio.run(write_after_kill())
    assert error.code == grpc.StatusCode.UNAVAILABLE, error
    assert str(error).startswith("vocoder service") and replica.address not in str(error)
