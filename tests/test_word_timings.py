"""Word timings: the alignment of spoken words to phoneme words, and the timings the public API
returns for a voice decoded phoneme by phoneme (three real processes, a tiny random voice)."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from orchestrator.launcher import LocalDeployment
from orchestrator.word_timings import align, spoken_units, word_spans
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.voices import make_tts_voice

TEXT = "hello there, my friend. this is a test"
WORDS = ["hello", "there", "my", "friend", "this", "is", "a", "test"]


def test_spoken_units_split_words_and_han_characters():
    assert spoken_units("He said: \"it's 'fine'\" -- ok.") == ["He", "said", "it's", "fine", "ok"]
    assert spoken_units("今天天气很好，我们去 park 吧。") == [
        "今",
        "天",
        "天",
        "气",
        "很",
        "好",
        "我",
        "们",
        "去",
        "park",
        "吧",
    ]


def test_alignment_joins_and_splits_words():
    # espeak-ng writes "of the" as one word: two units share its span, split by length
    units = ["one", "of", "the", "best"]
    chars = "w'Vn VvD@2 b'Est"
    starts = list(range(len(chars)))  # one speech token per character
    spans = word_spans("one of the best", chars, starts, len(chars))
    assert [s.word for s in spans] == units
    assert spans[1].start == 5 and spans[2].end == 10 and spans[1].end == spans[2].start
    assert align(["twentyfive"], [6, 4]) == [(0, 1, 0, 2)]  # one word, two phoneme words
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


def test_spans_stop_at_the_tokens_generated():
    spans = word_spans("a b c", "a b c", [0, 2, 2], 3)  # stopped after "a b"
    assert [(s.start, s.end) for s in spans] == [(0, 2), (2, 3), (3, 3)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    voice = make_tts_voice(
        tmp_path_factory.mktemp("voices"),
        max_tokens=400,
        phoneme_sync={"max_tokens_per_phoneme": 3, "min_tokens_per_phoneme": 1},
    )
    local = LocalDeployment(voice, threads={"text": 1, "vocoder": 1}, metrics_ports=(0, 0, 0))
    local.start()
    yield local
    local.stop()


def collect(responses) -> tuple[list[pb.WordTiming], float]:
    words, audio_s = [], 0.0
    for r in responses:
        if r.HasField("words"):
            words += list(r.words.words)
        elif r.HasField("audio"):
            audio_s += r.audio.duration_s
    return words, audio_s


def unary(address: str, **kwargs):
    with grpc.insecure_channel(address) as ch:
        return collect(
            tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text=TEXT, **kwargs), timeout=120
            )
        )


def test_word_timings_are_ordered_and_inside_the_audio(deployment):
    words, audio_s = unary(deployment.address)
    assert [w.word for w in words] == WORDS
    assert [w.segment for w in words] == [0, 0, 0, 0, 1, 1, 1, 1]
    for a, b in zip(words, words[1:]):
        assert a.start_ms <= a.end_ms <= b.start_ms
    assert words[0].start_ms >= 0 and words[-1].end_ms <= 1e3 * audio_s + 1e-6
    assert words[4].start_ms >= words[3].end_ms > words[3].start_ms  # sentence two follows one


def test_streamed_and_unary_timings_are_equal(deployment):
    words, _ = unary(deployment.address)
    pieces = ["hello there, ", "my fri", "end. this is ", "a test"]

    def requests():
        yield pb.StreamingSynthesizeRequest(
            config=pb.StreamingSynthesizeConfig(language_code="en-US")
        )
        for p in pieces:
            yield pb.StreamingSynthesizeRequest(text=p)

    with grpc.insecure_channel(deployment.address) as ch:
        streamed, _ = collect(
            tts_pb2_grpc.TextToSpeechStub(ch).StreamingSynthesize(requests(), timeout=120)
        )
    assert [(w.word, w.start_ms, w.end_ms) for w in streamed] == [
        (w.word, w.start_ms, w.end_ms) for w in words
    ]


def test_speaking_rate_scales_the_timings(deployment):
    words, audio_s = unary(deployment.address)
    fast, fast_s = unary(deployment.address, audio_config=pb.AudioConfig(speaking_rate=2.0))
    assert [w.word for w in fast] == WORDS
    for a, b in zip(words, fast):
        assert b.start_ms == pytest.approx(a.start_ms / 2) and b.end_ms == pytest.approx(
            a.end_ms / 2
        )
    assert fast[-1].end_ms <= 1e3 * fast_s + 1e-6


def test_cli_writes_word_timings(deployment, tmp_path):
    out, timings = tmp_path / "x.wav", tmp_path / "t.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "synthesize",
            TEXT,
            "-o",
            str(out),
            "--server",
            deployment.address,
            "--timings",
            str(timings),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(timings.read_text())["words"]
    words, _ = unary(deployment.address)
    assert [(w["word"], w["start_ms"]) for w in got] == [
        (w.word, round(w.start_ms, 1)) for w in words
    ]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    voice = make_tts_voice(
        tmp_path_factory.mktemp("voices"),
        max_tokens=400,
        phoneme_sync={"max_tokens_per_phoneme": 12, "durations": "random", "band": [1.0, 1.0]},
    )
    local = LocalDeployment(voice, threads={"text": 1, "vocoder": 1}, metrics_ports=(0, 0, 0))
    local.start()
    yield local
    local.stop()


def test_speaking_rate_scales_predicted_durations_before_synthesis(predicted):
    def run(rate: float):
        with grpc.insecure_channel(predicted.address) as ch:
            responses = list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(
                        text=TEXT, audio_config=pb.AudioConfig(speaking_rate=rate)
                    ),
                    timeout=120,
                )
            )
        words, audio_s = collect(responses)
        return words, audio_s, responses[-1].report.num_speech_tokens

    words, audio_s, tokens = run(1.0)
    fast, fast_s, fast_tokens = run(2.0)
    assert [w.word for w in fast] == [w.word for w in words] == WORDS
    # the schedule, not a time stretch, makes it faster: half the speech tokens, audio to match
    assert fast_tokens == pytest.approx(tokens / 2, rel=0.15)
    assert fast_s == pytest.approx(fast_tokens * 512 / 22050, rel=1e-3)
    assert audio_s == pytest.approx(tokens * 512 / 22050, rel=1e-3)
    assert fast[-1].end_ms <= 1e3 * fast_s + 1e-6 and words[-1].end_ms <= 1e3 * audio_s + 1e-6


def test_cli_refuses_a_timings_file_in_a_missing_folder(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "synthesize",
            "hi",
            "-o",
            str(tmp_path / "x.wav"),
            "--server",
            "127.0.0.1:1",
            "--timings",
            str(tmp_path / "no" / "t.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--timings" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
