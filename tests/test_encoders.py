"""Streaming encoders: each stream decodes, by a decoder of its own, to the audio that went in."""

from __future__ import annotations

import io
import subprocess

import numpy as np
import pytest
import soundfile

from orchestrator.audio import AudioOutput
from orchestrator.encoders import ENCODINGS, fill_in_sizes, make_encoder
from splittts.tts.v1 import tts_pb2 as pb

SR = 22050
LOSSY = ("MP3", "OGG_OPUS", "AAC")
FFMPEG_RAW = {"MULAW": "mulaw", "ALAW": "alaw"}


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """A tone with a wandering pitch plus a little noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    phase = 2 * np.pi * np.cumsum(150 + 60 * np.sin(np.linspace(0, 7, n))) / SR
    x = 0.4 * np.sin(phase) + 0.2 * np.sin(2 * phase) + 0.02 * rng.standard_normal(n)
    return x.astype(np.float32)


def stream(encoding: str, x: np.ndarray, seed: int | None = 0, rate: int = 0):
    """Pieces pushed before finish(), the final pieces, and the AudioOutput."""
    out = AudioOutput(SR, encoding, rate)
    chunks, i = [], 0
    rng = np.random.default_rng(seed) if seed is not None else None
    while i < len(x):
        n = len(x) if rng is None else int(rng.integers(50, 3000))
        chunks.append(x[i : i + n])
        i += n
    early = [p for c in chunks for p in out.push(c)]
    return early, out.finish(), out


def reference(x: np.ndarray, rate: int) -> np.ndarray:
    """What LINEAR16 carries at `rate`: the encoders' input, as int16 scaled to [-1, 1]."""
    early, final, _ = stream("LINEAR16", x, seed=None, rate=rate)
    return np.frombuffer(b"".join(p.audio for p in early + final), "<i2") / 32767.0


def ffmpeg_decode(blob: bytes, encoding: str, rate: int) -> np.ndarray:
    fmt = ["-f", FFMPEG_RAW[encoding], "-ar", str(rate)] if encoding in FFMPEG_RAW else []
    r = subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            *fmt,
            "-i",
            "pipe:0",
            "-f",
            "f32le",
            "-ac",
            "1",
            "-ar",
            str(rate),
            "pipe:1",
        ],
        input=blob,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    return np.frombuffer(r.stdout, "<f4")


def soundfile_decode(blob: bytes, encoding: str, rate: int) -> tuple[np.ndarray, int]:
    if encoding in FFMPEG_RAW:
        return soundfile.read(
            io.BytesIO(blob),
            samplerate=rate,
            channels=1,
            format="RAW",
            subtype={"MULAW": "ULAW", "ALAW": "ALAW"}[encoding],
            dtype="float32",
        )
    return soundfile.read(io.BytesIO(blob), dtype="float32")


def aligned_snr_db(ref: np.ndarray, got: np.ndarray, max_lag: int = 4000) -> float:
    """SNR of `got` against `ref` after the best shift of at most `max_lag` samples (codec delay)."""
    n = len(ref) - 2 * max_lag
    mid = ref[max_lag : max_lag + n]
    best = max(
        range(min(2 * max_lag, len(got) - n) + 1),
        key=lambda lag: float(np.dot(mid, got[lag : lag + n])),
    )
    err = mid - got[best : best + n]
    return float(10 * np.log10(np.sum(mid**2) / max(np.sum(err**2), 1e-20)))


@pytest.mark.parametrize(
    "encoding, rate",
    [
        ("MP3", 22050),
        ("OGG_OPUS", 24000),
        ("FLAC", 22050),
        ("AAC", 22050),
        ("MULAW", 8000),
        ("ALAW", 8000),
    ],
)
def test_stream_goes_out_as_it_is_coded(encoding, rate):
    x = speechlike(1.5, seed=1)
    early, final, out = stream(encoding, x)
    assert out.output_rate == rate
    # Most of the audio left before finish(): the encoder did not hold the stream back.
    assert sum(p.num_samples for p in early) > 0.8 * sum(p.num_samples for p in early + final)
    assert len(early) >= 5
    expect = 0
    for p in early + final:
        assert p.first_sample == expect and p.sample_rate_hz == rate and p.audio
        expect += p.num_samples
    assert expect == len(reference(x, rate))


@pytest.mark.parametrize("encoding", ["MP3", "OGG_OPUS", "FLAC", "AAC", "MULAW", "ALAW"])
def test_streamed_bytes_equal_the_whole_file(encoding):
    """Chunking changes nothing: the stream is byte for byte the file coded in one go."""
    x = speechlike(1.0, seed=2)
    streamed = b"".join(p.audio for p in sum(stream(encoding, x, seed=3)[:2], []))
    whole = b"".join(p.audio for p in sum(stream(encoding, x, seed=None)[:2], []))
    if encoding == "OGG_OPUS":  # each Ogg stream has a random serial number: compare the audio
        streamed, whole = (soundfile.read(io.BytesIO(b))[0] for b in (streamed, whole))
        assert len(streamed) == len(whole) > 0 and np.array_equal(streamed, whole)
    else:
        assert streamed == whole


@pytest.mark.parametrize("encoding", ["MP3", "OGG_OPUS", "FLAC", "AAC", "MULAW", "ALAW"])
def test_ffmpeg_decodes_the_stream_to_the_input(encoding):
    x = speechlike(1.5, seed=4)
    early, final, out = stream(encoding, x, seed=5)
    blob = b"".join(p.audio for p in early + final)
    ref = reference(x, out.output_rate)
    got = ffmpeg_decode(blob, encoding, out.output_rate)
    if encoding == "FLAC":  # lossless
        assert len(got) == len(ref) and np.abs(got - ref).max() < 1e-4
    elif encoding in FFMPEG_RAW:  # G.711: one byte per sample, ~38 dB on a loud signal
        assert len(got) == len(ref) and aligned_snr_db(ref, got, max_lag=0) > 30
    else:
        assert len(got) >= len(ref) and aligned_snr_db(ref, got) > 12


@pytest.mark.parametrize("encoding", ["MP3", "OGG_OPUS", "FLAC", "MULAW", "ALAW"])
def test_libsndfile_decodes_the_stream_to_the_input(encoding):
    x = speechlike(1.5, seed=6)
    early, final, out = stream(encoding, x, seed=7)
    blob = b"".join(p.audio for p in early + final)
    ref = reference(x, out.output_rate)
    if encoding == "FLAC":  # a stream's STREAMINFO has no length: libsndfile needs it filled in
        f = io.BytesIO(blob)
        fill_in_sizes(f, 0, "FLAC", len(ref))
        blob = f.getvalue()
    got, rate = soundfile_decode(blob, encoding, out.output_rate)
    assert rate == out.output_rate
    if encoding == "FLAC":
        assert np.array_equal(np.rint(got * 32768), np.rint(ref * 32767))
    elif encoding == "OGG_OPUS":  # Ogg Opus trims pre-skip and end padding: same length
        assert len(got) == len(ref) and aligned_snr_db(ref, got) > 12
    elif encoding in FFMPEG_RAW:
        assert len(got) == len(ref)
        assert np.array_equal(got, ffmpeg_decode(blob, encoding, rate))  # decoders agree
        assert aligned_snr_db(ref, got, max_lag=0) > 30
    else:
        assert len(got) >= len(ref) and aligned_snr_db(ref, got) > 12


def test_every_encoding_of_the_public_api_has_an_encoder():
    names = [n for n in pb.AudioEncoding.keys() if n != "AUDIO_ENCODING_UNSPECIFIED"]
    assert list(ENCODINGS) == names
    for name in ENCODINGS:
        encoder = make_encoder(name, 24000)
        assert encoder.encode(speechlike(0.2)) + encoder.finish(), name


def test_g711_rates_default_to_telephony_and_follow_a_request():
    assert AudioOutput(SR, "MULAW").output_rate == 8000
    assert AudioOutput(SR, "ALAW", 16000).output_rate == 16000


@pytest.mark.parametrize(
    "encoding, requested, used",
    [
        ("MP3", 0, 22050),
        ("MP3", 8000, 8000),
        ("MP3", 10000, 11025),
        ("MP3", 46000, 48000),
        ("AAC", 0, 22050),
        ("AAC", 30000, 32000),
    ],
)
def test_mpeg_rate_is_smallest_supported_not_below_request(encoding, requested, used):
    assert AudioOutput(SR, encoding, requested).output_rate == used


@pytest.mark.parametrize("encoding", ["MP3", "OGG_OPUS", "FLAC", "AAC"])
def test_no_audio_gives_no_bytes(encoding):
    out = AudioOutput(SR, encoding)
    assert out.push(np.zeros(0, np.float32)) == [] and out.finish() == []


def test_fill_in_sizes_makes_a_streamed_wav_exact():
    early, final, _ = stream("WAV", speechlike(0.5), seed=8)
    f = io.BytesIO(b"".join(p.audio for p in early + final))
    assert f.getvalue()[4:8] == b"\xff\xff\xff\xff"
    fill_in_sizes(f, 0, "WAV", 0)
    blob = f.getvalue()
    assert int.from_bytes(blob[4:8], "little") == len(blob) - 8
    assert int.from_bytes(blob[40:44], "little") == len(blob) - 44
    assert soundfile.info(io.BytesIO(blob)).frames == (len(blob) - 44) // 2
