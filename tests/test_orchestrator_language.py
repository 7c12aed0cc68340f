"""With no language_code, each sentence is read in the language its script shows (real processes)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from orchestrator.launcher import LocalDeployment
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.voices import make_tts_voice

MANDARIN = "我有3个苹果。"  # the digit reads as 三 in Mandarin, "three" in English
ENGLISH = "I have 3 apples."


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    local = LocalDeployment(
        make_tts_voice(tmp_path_factory.mktemp("voices")), threads={"text": 1, "vocoder": 1}
    )
    local.start()
    yield local
    local.stop()


def streamed(deployment, text: str, language_code: str = "") -> bytes:
    """PCM of a StreamingSynthesize call (the tiny voice samples greedily: same input, same audio)."""
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # as a chatbot streams it
    requests = [
        pb.StreamingSynthesizeRequest(
            config=pb.StreamingSynthesizeConfig(language_code=language_code)
        )
    ] + [pb.StreamingSynthesizeRequest(text=p) for p in pieces]
    with grpc.insecure_channel(deployment.address) as ch:
        responses = list(
            tts_pb2_grpc.TextToSpeechStub(ch).StreamingSynthesize(iter(requests), timeout=120)
        )
    assert responses[-1].HasField("report")
    return b"".join(r.audio.audio for r in responses if r.HasField("audio"))


def whole(deployment, text: str, language_code: str = "") -> bytes:
    with grpc.insecure_channel(deployment.address) as ch:
        responses = list(
            tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text=text, language_code=language_code), timeout=120
            )
        )
    return b"".join(r.audio.audio for r in responses if r.HasField("audio"))


def same_speech(a: bytes, b: bytes, min_snr_db: float = 40.0) -> bool:
    """The same speech tokens through the streamed vocoder: equal length, and samples equal up
    to rounding. Chunk boundaries follow the timing of each run, and the bf16 generator rounds
    a little differently for different chunk widths (up to about 7e-4 of full scale), so two
    runs of one request need not agree bit for bit."""
    if len(a) != len(b):
        return False
    x = np.frombuffer(a, "<i2").astype(np.float64)
    y = np.frombuffer(b, "<i2").astype(np.float64)
    noise = float(((x - y) ** 2).sum())
    return noise == 0 or 10 * np.log10(float((x**2).sum()) / noise) >= min_snr_db


def test_streamed_mandarin_without_a_language_code_is_read_as_mandarin(deployment):
    as_mandarin = streamed(deployment, MANDARIN, "cmn-CN")
    assert not same_speech(as_mandarin, streamed(deployment, MANDARIN, "en-US"))  # audible
    assert same_speech(streamed(deployment, MANDARIN), as_mandarin)


def test_each_sentence_gets_its_own_language(deployment):
    english, mandarin = whole(deployment, ENGLISH, "en-US"), whole(deployment, MANDARIN, "cmn-CN")
    mixed = f"{ENGLISH} {MANDARIN}"
    auto = whole(deployment, mixed)
    # One vocoder stream spans both sentences, so only the samples near the join may differ;
    # the length is the sum of each sentence's speech tokens, read in its own language.
    assert len(auto) == len(english) + len(mandarin)
    assert same_speech(auto[: len(english) // 2], english[: len(english) // 2])
    assert not same_speech(auto, whole(deployment, mixed, "en-US"))
    assert not same_speech(auto, whole(deployment, mixed, "cmn-CN"))
    assert len(streamed(deployment, f"{MANDARIN}{ENGLISH}")) == len(mandarin) + len(english)
