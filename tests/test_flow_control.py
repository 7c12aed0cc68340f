"""Flow control end to end over real processes on 127.0.0.1: a caller that stops reading stops
the vocoder and then the text service, holds memory flat, and gets all its audio on resuming."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator.launcher import LocalDeployment
from splittts.text.v1 import text_pb2, text_pb2_grpc
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.procs import rss_bytes, scrape, wait_until
from tests.voices import make_tts_voice, speech_tokens_only

MAX_TOKENS = 2400  # one sentence: about 56 s of audio (512 samples a token at 22050 Hz)
SAMPLES_PER_TOKEN = 2 * 256
RATE = 22050
AUDIO_AHEAD_S = 2.0  # orchestrator --max-audio-ahead
VOCODER_AHEAD_S = 0.5  # vocoder --max-audio-ahead
BACKLOG = 16  # text --max-stream-backlog
# What a client's own transport takes in is the client's choice: with BDP probing its window
# grows while it does not read. These tests pin it at the default 64 KiB (0.7 s of audio).
CLIENT_OPTIONS = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    voice_dir = speech_tokens_only(
        make_tts_voice(
            tmp_path_factory.mktemp("voices"),
            max_tokens=MAX_TOKENS,
            lm_overrides={"max_position_embeddings": 4096},
        )
    )
    local = LocalDeployment(
        voice_dir,
        threads={"text": 1, "vocoder": 1},
        metrics_ports=(0, 0, 0),
        text_args=["--max-stream-backlog", str(BACKLOG)],
        vocoder_args=["--max-audio-ahead", str(VOCODER_AHEAD_S)],
        orchestrator_args=["--max-audio-ahead", str(AUDIO_AHEAD_S)],
    )
    local.start()
    yield local
    local.stop()


def settled(read, timeout: float = 60.0) -> int:
    """`read()` once two readings a second apart agree (within a bounded wait)."""
    deadline, last = time.monotonic() + timeout, read()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        value = read()
        if value == last:
            return value
        last = value
    raise AssertionError(f"still changing after {timeout:.0f} s (last {last})")


class PausedCall:
    """A Synthesize call whose reader takes the first message, then waits for `resume`."""

    def __init__(self, address: str, text: str):
        self.resume = threading.Event()
        self.first = threading.Event()
        self.samples = 0
        self.report: pb.LatencyReport | None = None
        self.error: BaseException | None = None
        self._call = None
        self._thread = threading.Thread(target=self._run, args=(address, text), daemon=True)
        self._thread.start()

    def _run(self, address: str, text: str) -> None:
        try:
            with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as ch:
                self._call = tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text=text), timeout=300
                )
                for resp in self._call:
                    if resp.HasField("audio"):
                        self.samples += len(resp.audio.audio) // 2
                    if resp.HasField("report"):
                        self.report = resp.report
                    if not self.first.is_set():
                        self.first.set()
                        self.resume.wait(300)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc
            self.first.set()

    def cancel(self) -> None:
        self._call.cancel()
        self.resume.set()

    def join(self, timeout: float = 300.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not finish after resuming"


def generated_tokens(text_proc, prompt_len: int) -> int:
    """Tokens in the text service's KV cache beyond the prompt, to within one block."""
    with grpc.insecure_channel(text_proc.address) as ch:
        info = text_pb2_grpc.TextGenerationStub(ch).GetModelInfo(
            text_pb2.GetModelInfoRequest(), timeout=10
        )
    return info.num_used_blocks * info.block_size - prompt_len


def test_a_paused_reader_stops_generation_within_the_bound_then_gets_all_its_audio(deployment):
    text_proc = deployment.by_name("text-service")
    vocoder_proc = deployment.by_name("vocoder-service")
    call = PausedCall(deployment.address, "hello there")
    assert call.first.wait(120) and call.error is None
    # Generation pauses: the text service parks the request, the vocoder's backlog is bounded.
    assert wait_until(lambda: scrape(text_proc, "splittts_text_num_requests_paused") == 1)
    tokens = settled(lambda: generated_tokens(text_proc, prompt_len=len("<bos>hello there<sep>")))
    ahead_s = scrape(vocoder_proc, "splittts_vocoder_audio_ahead_seconds")
    assert ahead_s <= VOCODER_AHEAD_S + 128 * 256 / RATE  # the bound plus one largest chunk
    print(f"paused: {tokens} tokens generated of {MAX_TOKENS}, vocoder {ahead_s:.2f} s ahead")
    assert tokens < MAX_TOKENS // 3  # every hop's bound together: about 13 s of the 56 s
    call.resume.set()
    call.join()
    assert call.error is None and call.report is not None
    assert call.samples == MAX_TOKENS * SAMPLES_PER_TOKEN


def test_memory_and_buffers_stay_flat_with_several_paused_readers(deployment):
    procs = deployment.processes
    text_proc = deployment.by_name("text-service")
    vocoder_proc = deployment.by_name("vocoder-service")
    baseline = {p.name: rss_bytes(p.proc.pid) for p in procs}
    calls = [PausedCall(deployment.address, f"paused reader {i}") for i in range(4)]
    for call in calls:
        assert call.first.wait(120) and call.error is None
    assert wait_until(
        lambda: scrape(text_proc, "splittts_text_num_requests_paused") == len(calls), timeout=120
    )
    ahead_s = scrape(vocoder_proc, "splittts_vocoder_audio_ahead_seconds")
    assert ahead_s <= len(calls) * (VOCODER_AHEAD_S + 128 * 256 / RATE)
    held = {p.name: rss_bytes(p.proc.pid) for p in procs}
    for name in held:
        # unbounded buffering would hold 56 s of audio per call at every hop
        assert held[name] - baseline[name] < 64 * 2**20, (name, baseline[name], held[name])
    for call in calls:  # paused calls cancelled: their requests and cache are freed
        call.cancel()
    for call in calls:
        call.join()
    assert wait_until(
        lambda: (
            scrape(text_proc, "splittts_text_num_requests_running") == 0
            and scrape(text_proc, "splittts_text_num_requests_paused") == 0
            and scrape(vocoder_proc, "splittts_vocoder_active_streams") == 0
        )
    )
    assert scrape(vocoder_proc, "splittts_vocoder_audio_ahead_seconds") == pytest.approx(
        0, abs=1e-6
    )
