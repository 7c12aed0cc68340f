"""The shipped default voice through the real pipeline (three server processes)."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from orchestrator.launcher import LocalDeployment
from orchestrator.voices import VOICES_DIR
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc
from vocoder_service.backends import OnnxBackend, TorchBackend
from vocoder_service.voice import load_voice

VOICE = VOICES_DIR / "default"
SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def deployment():
    if not (VOICE / "voice.json").is_file():
        pytest.fail("voices/default is missing: the default voice must ship with the repository")
    with LocalDeployment(VOICE, threads={"text": 1, "vocoder": 1}) as local:
        yield local


def synthesize(address: str, text: str, seed: int, language: str = "", temperature=None):
    sampling = pb.SamplingConfig(seed=seed)
    if temperature is not None:
        sampling.temperature = temperature
    with grpc.insecure_channel(address) as ch:
        responses = list(
            tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text=text, language_code=language, sampling=sampling),
                timeout=300,
            )
        )
    audio = (
        np.frombuffer(
            b"".join(r.audio.audio for r in responses if r.HasField("audio")), dtype="<i2"
        ).astype(np.float32)
        / 32767
    )
    return audio, responses[-1].report


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-20)))


def vocoder_info(deployment) -> tuple[str, str]:
    """The vocoder service's (backend, precision)."""
    with grpc.insecure_channel(deployment.by_name("vocoder-service").address) as ch:
        info = vocoder_pb2_grpc.VocoderStub(ch).GetInfo(vocoder_pb2.GetInfoRequest(), timeout=10)
    return info.backend, info.precision


# How far apart the same codes come out of the service when only the chunk boundaries differ
# (they follow token arrival times): a last bit in fp32; about 50 dB in bf16; in int8 a value
# rounded the other way onto the 8-bit grid carries through the later layers (31-36 dB on the
# voice's mels). A broken stream state gives noise near 0 dB.
SAME_CODES_DB = {"int8": 25.0}


def test_seeded_synthesis_is_reproducible(deployment):
    a, report = synthesize(deployment.address, SENTENCE, seed=11, temperature=0.8)
    b, _ = synthesize(deployment.address, SENTENCE, seed=11, temperature=0.8)
    c, _ = synthesize(deployment.address, SENTENCE, seed=12, temperature=0.8)
    assert report.audio_s > 1.0 and report.num_speech_tokens > 40
    # same seed, same tokens: compare as audio, not bytes
    bound = SAME_CODES_DB.get(vocoder_info(deployment)[1], 40.0)
    assert len(a) == len(b) and snr_db(a, b) >= bound
    assert len(a) != len(c) or snr_db(a, c) < 20.0


def test_stream_equals_offline_vocoding(deployment):
    """Speech tokens from the text service, vocoded offline, equal what the pipeline streamed."""
    from orchestrator.frontend import FrontEnd
    from splittts.text.v1 import text_pb2, text_pb2_grpc

    manifest = json.loads((VOICE / "voice.json").read_text())
    lo, hi = manifest["speech_token_range"]
    audio, report = synthesize(deployment.address, SENTENCE, seed=5)
    segment = FrontEnd(manifest["text_frontend"]).process(SENTENCE, "en-US")
    assert len(segment) == 1 and report.num_segments == 1
    s = manifest["sampling"]
    # the voice is decoded phoneme by phoneme: the same plan the orchestrator makes
    from orchestrator.phoneme_sync import SyncPlanner

    plan = SyncPlanner.for_voice(VOICE, manifest["prompt_template"], manifest["phoneme_sync"]).plan(
        segment[0].model_input
    )
    request = text_pb2.GenerateRequest(
        token_ids=text_pb2.TokenIds(ids=plan.prompt_ids),
        sampling=text_pb2.SamplingConfig(
            temperature=s["temperature"],
            top_k=s["top_k"],
            top_p=s.get("top_p", 1.0),
            seed=5,
            repetition_penalty=s.get("repetition_penalty", 1.0),
        ),
        stop_token_ids=[manifest["end_token_id"]],
        max_tokens=plan.max_output_tokens,
        phoneme_sync=text_pb2.PhonemeSync(
            phoneme_ids=plan.phoneme_ids,
            speech_tokens=text_pb2.TokenRange(start=lo, end=hi),
            end_token_id=manifest["end_token_id"],
            min_tokens=plan.min_tokens,
            max_tokens=plan.max_tokens,
        ),
    )
    with grpc.insecure_channel(deployment.by_name("text-service").address) as ch:
        ids = [
            t
            for r in text_pb2_grpc.TextGenerationStub(ch).Generate(request, timeout=300)
            for t in r.token_ids
        ]
    codes = np.array([t - lo for t in ids if lo <= t <= hi])
    assert len(codes) == report.num_speech_tokens
    voice = load_voice(VOICE)
    runtime, precision = vocoder_info(deployment)
    mel = voice.token_decoder.decode(codes)[None]
    # offline in the runtime and precision the service runs; ONNX Runtime's int8 streaming
    # graphs are quantised apart from its offline graph, so it runs them in one call here
    if precision == "int8" and runtime == "onnxruntime":
        backend = OnnxBackend(
            voice.generator, intra_op_threads=1, int8=True, calibration=voice.calibration_mels()
        )
        head, state = backend.run_stream(mel, None)
        offline = np.concatenate([head, backend.run_stream(mel[:, :, :0], state, final=True)[0]])
    else:
        backend = (
            TorchBackend(
                voice.generator,
                bf16=True,
                int8=precision == "int8",
                calibration=voice.calibration_mels() if precision == "int8" else None,
            )
            if precision in ("bf16", "int8")
            else OnnxBackend(voice.generator, intra_op_threads=1)
        )
        offline = backend.run(mel)[0]
    assert len(offline) == len(audio)
    print(f"streamed against offline {precision}: {snr_db(offline, audio):.1f} dB")
    assert snr_db(offline, audio) >= SAME_CODES_DB.get(precision, 40.0)


def test_mandarin_speaks(deployment):
    audio, report = synthesize(deployment.address, "今天天气很好。", seed=1)
    assert report.audio_s > 0.5 and np.abs(audio).max() > 0.05


def test_word_timings_of_the_default_voice(deployment):
    with grpc.insecure_channel(deployment.address) as ch:
        responses = list(
            tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text=SENTENCE), timeout=300
            )
        )
    words = [w for r in responses if r.HasField("words") for w in r.words.words]
    audio_s = sum(r.audio.duration_s for r in responses if r.HasField("audio"))
    assert [w.word for w in words] == SENTENCE.rstrip(".").split()
    assert all(a.start_ms <= a.end_ms <= b.start_ms for a, b in zip(words, words[1:]))
    assert sum(w.end_ms > w.start_ms for w in words) >= len(words) - 1
    assert 0 <= words[0].start_ms and words[-1].end_ms <= 1e3 * audio_s + 1e-6


def test_planned_segments_are_paced_from_their_plan():
    """The orchestrator asks the text service for a planned segment's tokens at `pace_realtime`
    times the rate its audio plays (phonemes, planned speech and end over the speech's
    seconds), after a lead; a pace of 0 leaves generation unpaced."""
    from orchestrator.frontend import FrontEnd
    from orchestrator.pipeline import Pipeline
    from orchestrator.voices import VoiceSpec

    voice = VoiceSpec.load(VOICE)
    segment = FrontEnd(voice.text_frontend).process(SENTENCE, "en-US")[0]
    pipeline = Pipeline(None, None, {}, pace_realtime=1.25)
    plan = pipeline.planner(voice).plan(segment.model_input)
    pace = pipeline._pace(voice, plan)
    speech = (sum(plan.min_tokens) + sum(plan.max_tokens)) / 2
    seconds = speech * 512 / 22050  # 2 frames of 256 samples a token at 22.05 kHz
    assert voice.samples_per_token == 512 and voice.sample_rate == 22050
    expected = 1.25 * (len(plan.phoneme_ids) + speech + 1) / seconds
    assert pace.tokens_per_second == pytest.approx(expected, rel=1e-6)
    assert 1.25 * 43 < pace.tokens_per_second < 1.25 * 43 * 3  # phonemes ride on the speech
    assert pace.lead_tokens == 64
    assert Pipeline(None, None, {}, pace_realtime=0)._pace(voice, plan) is None
    with pytest.raises(ValueError, match="pace_realtime must be 0"):
        Pipeline(None, None, {}, pace_realtime=0.5)
