"""Audio out: validation, streamed resampling, WAV and Ogg Opus, pitch-preserving tempo.

The other encoders are tested in test_encoders.py.
"""

import io
import struct
import wave

import numpy as np
import pytest
import soundfile
import soxr

from orchestrator.audio import AudioOutput, resolve_audio_format, to_int16
from orchestrator.tempo import TimeStretch, time_stretch

SR = 22050


def tone(seconds: float, f0: float = 197.0, sr: int = SR) -> np.ndarray:
    """A harmonic tone (three partials), like a steady voiced vowel."""
    t = np.arange(int(seconds * sr)) / sr
    x = (
        0.3 * np.sin(2 * np.pi * f0 * t)
        + 0.2 * np.sin(2 * np.pi * 2 * f0 * t + 1.0)
        + 0.1 * np.sin(2 * np.pi * 3 * f0 * t + 2.0)
    )
    return x.astype(np.float32)


def speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Tone with a wandering pitch plus noise: no period lines up by accident."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    f = 150 + 60 * np.sin(np.linspace(0, 7, n))
    phase = 2 * np.pi * np.cumsum(f) / SR
    x = 0.4 * np.sin(phase) + 0.2 * np.sin(2 * phase) + 0.05 * rng.standard_normal(n)
    return x.astype(np.float32)


def random_chunks(x: np.ndarray, rng: np.random.Generator, max_len: int = 3000):
    i = 0
    while i < len(x):
        n = int(rng.integers(1, max_len))
        yield x[i : i + n]
        i += n


def run(out: AudioOutput, x: np.ndarray, rng=None) -> list:
    chunks = [x] if rng is None else random_chunks(x, rng)
    pieces = [p for c in chunks for p in out.push(c)]
    return pieces + out.finish()


def joined(pieces) -> bytes:
    return b"".join(p.audio for p in pieces)


def assert_contiguous(pieces) -> None:
    expect = 0
    for p in pieces:
        assert p.first_sample == expect
        expect += p.num_samples


def peak_hz(y: np.ndarray, sr: int) -> float:
    seg = y[sr // 20 : -sr // 20].astype(np.float64)
    spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg)), 8 * len(seg)))
    return float(np.argmax(spec)) * sr / (8 * len(seg))


def harmonic_purity(y: np.ndarray, f0: float, sr: int = SR) -> float:
    """Share of energy within 8 Hz of the tone's partials: broken joins spread it out."""
    seg = y[sr // 20 : -sr // 20].astype(np.float64)
    spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg)))) ** 2
    freqs = np.fft.rfftfreq(len(seg), 1 / sr)
    near = np.zeros(len(spec), bool)
    for h in (1, 2, 3):
        near |= np.abs(freqs - h * f0) < 8
    return float(spec[near].sum() / spec.sum())


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (
            dict(encoding="AIFF"),
            "audio_config.encoding must be one of LINEAR16, WAV, FLAC, OGG_OPUS, "
            "MP3, MULAW, ALAW, AAC",
        ),
        (
            dict(sample_rate_hz=5),
            "audio_config.sample_rate_hz must be 0 or between 8000 and 48000 (got 5)",
        ),
        (dict(sample_rate_hz=96000), "audio_config.sample_rate_hz"),
        (dict(sample_rate_hz=-8000), "audio_config.sample_rate_hz"),
        (
            dict(speaking_rate=0.4),
            "audio_config.speaking_rate must be 0 (unset) or between 0.5 and 2.0",
        ),
        (dict(speaking_rate=2.01), "audio_config.speaking_rate"),
        (dict(speaking_rate=-1.0), "audio_config.speaking_rate"),
        (dict(speaking_rate=float("nan")), "audio_config.speaking_rate"),
    ],
)
def test_bad_config_names_field_and_rule(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        AudioOutput(SR, **{"encoding": "LINEAR16", **kwargs})


def test_defaults_and_limits():
    fmt = resolve_audio_format(SR, "", 0, 0.0)
    assert (fmt.encoding, fmt.output_rate, fmt.speaking_rate) == ("LINEAR16", SR, 1.0)
    assert resolve_audio_format(SR, "WAV", 8000, 0.5).output_rate == 8000
    assert resolve_audio_format(SR, "WAV", 48000, 2.0).speaking_rate == 2.0
    with pytest.raises(ValueError, match="input_rate"):
        AudioOutput(0, "LINEAR16")


@pytest.mark.parametrize(
    "requested, used",
    [(0, 24000), (8000, 8000), (11025, 12000), (16000, 16000), (32000, 48000), (44100, 48000)],
)
def test_opus_rate_is_smallest_supported_not_below_request(requested, used):
    assert AudioOutput(SR, "OGG_OPUS", requested).output_rate == used


def test_push_after_finish_is_an_error():
    out = AudioOutput(SR, "LINEAR16")
    out.finish()
    with pytest.raises(RuntimeError):
        out.push(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        AudioOutput(SR, "LINEAR16").push(np.zeros((10, 2), np.float32))


# --- LINEAR16 and resampling --------------------------------------------------------------


def test_linear16_is_immediate_passthrough():
    x = speechlike(0.5)
    out = AudioOutput(SR, "LINEAR16")
    pieces = []
    for chunk in random_chunks(x, np.random.default_rng(1)):
        got = out.push(chunk)
        # Nothing is held back: each push returns its own samples at once.
        assert len(got) == 1 and got[0].num_samples == len(chunk)
        assert got[0].audio == to_int16(chunk).tobytes()
        pieces += got
    assert out.finish() == []
    assert_contiguous(pieces)
    assert joined(pieces) == to_int16(x).tobytes()
    assert all(p.sample_rate_hz == SR for p in pieces)


@pytest.mark.parametrize("rate", [8000, 16000, 44100, 48000])
def test_streamed_resampling_equals_one_shot(rate):
    x = speechlike(1.0, seed=2)
    pieces = run(AudioOutput(SR, "LINEAR16", rate), x, np.random.default_rng(rate))
    assert_contiguous(pieces)
    assert sum(p.num_samples for p in pieces) == rate
    got = np.frombuffer(joined(pieces), "<i2").astype(np.int32)
    want = to_int16(soxr.resample(x, SR, rate, quality="HQ")).astype(np.int32)
    assert len(got) == len(want)
    assert np.abs(got - want).max() <= 1


def test_resampled_tone_keeps_its_frequency():
    pieces = run(AudioOutput(SR, "LINEAR16", 16000), tone(1.0, f0=440.0))
    y = np.frombuffer(joined(pieces), "<i2") / 32767.0
    assert abs(peak_hz(y, 16000) - 440.0) < 1.0


# --- containers ---------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0, 16000])
def test_wav_pieces_concatenate_into_one_readable_file(rate):
    x = speechlike(0.7, seed=3)
    reference = joined(run(AudioOutput(SR, "LINEAR16", rate), x))
    pieces = run(AudioOutput(SR, "WAV", rate), x, np.random.default_rng(4))
    assert_contiguous(pieces)
    blob = joined(pieces)
    assert blob[:4] == b"RIFF" and blob[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", blob[40:44])[0] == 0xFFFFFFFF  # streamed: size unknown
    assert blob[44:] == reference
    data, sr = soundfile.read(io.BytesIO(blob), dtype="int16")
    assert sr == (rate or SR)
    assert np.array_equal(data, np.frombuffer(reference, "<i2"))
    with wave.open(io.BytesIO(blob)) as w:
        assert (w.getframerate(), w.getsampwidth(), w.getnchannels()) == (rate or SR, 2, 1)
        assert w.readframes(10**9) == reference


def test_empty_wav_is_still_a_header():
    pieces = AudioOutput(SR, "WAV").finish()
    assert len(pieces) == 1 and pieces[0].num_samples == 0
    data, sr = soundfile.read(io.BytesIO(pieces[0].audio))
    assert sr == SR and len(data) == 0


@pytest.mark.parametrize("encoding", ["FLAC", "OGG_OPUS"])
def test_no_audio_gives_no_file(encoding):
    out = AudioOutput(SR, encoding)
    assert out.push(np.zeros(0, np.float32)) == [] and out.finish() == []


@pytest.mark.parametrize("rate, used", [(0, 24000), (16000, 16000)])
def test_ogg_opus_stream_decodes_to_the_same_tone(rate, used):
    x = tone(1.0, f0=330.0)
    out = AudioOutput(SR, "OGG_OPUS", rate)
    pieces = out.push(x)
    assert pieces and pieces[0].audio[:4] == b"OggS"  # pages leave before finish()
    pieces += out.finish()
    assert_contiguous(pieces)
    assert all(p.sample_rate_hz == used for p in pieces)
    data, sr = soundfile.read(io.BytesIO(joined(pieces)), dtype="float32")
    assert sr == used and len(data) == sum(p.num_samples for p in pieces) == used
    assert abs(peak_hz(data, sr) - 330.0) < 2.0
    reference = soxr.resample(x, SR, used)
    mid = slice(used // 10, -used // 10)
    corr = np.corrcoef(data[mid], reference[mid])[0, 1]
    assert corr > 0.95


# --- speaking rate ------------------------------------------------------------------------


def test_rate_one_is_exact_passthrough():
    x = speechlike(0.5)
    stretch = TimeStretch(SR, 1.0)
    y = np.concatenate(
        [stretch.push(c) for c in random_chunks(x, np.random.default_rng(7))] + [stretch.finish()]
    )
    assert np.array_equal(y, x)


@pytest.mark.parametrize("rate", [0.5, 0.8, 1.25, 2.0])
def test_pitch_is_kept(rate):
    f0 = 197.0
    y = time_stretch(tone(1.0, f0), SR, rate)
    assert abs(peak_hz(y, SR) - f0) < 1.0
    # Waveforms joined in phase: energy stays on the partials (unaligned joins score < 0.96).
    assert harmonic_purity(y, f0) > 0.999


def onset_times(y: np.ndarray, sr: int = SR) -> list[float]:
    """Start times of bursts, from a 10 ms RMS envelope crossing half its maximum."""
    win = sr // 100
    env = np.sqrt(np.convolve(y.astype(np.float64) ** 2, np.ones(win) / win, mode="same"))
    on = env > 0.5 * env.max()
    starts = np.flatnonzero(on[1:] & ~on[:-1]) + 1
    return [s / sr for s in starts]


@pytest.mark.parametrize("rate", [0.5, 0.75, 1.5, 2.0])
def test_duration_scales_by_one_over_rate(rate):
    # Silence 0.3 s, burst 0.4 s, silence 0.4 s, burst 0.4 s, silence 0.3 s.
    gap, burst = np.zeros(int(0.4 * SR), np.float32), tone(0.4)
    x = np.concatenate([gap[: int(0.3 * SR)], burst, gap, burst, gap[: int(0.3 * SR)]])
    y = time_stretch(x, SR, rate)
    assert len(y) == round(len(x) / rate)
    onsets = onset_times(y)
    assert len(onsets) == 2
    for got, at in zip(onsets, (0.3, 1.1)):
        assert abs(got - at / rate) < 0.02 + 0.02 * at / rate  # within 20 ms + 2%


@pytest.mark.parametrize("rate", [0.5, 0.73, 1.6, 2.0])
def test_streamed_stretch_equals_offline(rate):
    x = speechlike(1.0, seed=8)
    offline = time_stretch(x, SR, rate)
    stretch = TimeStretch(SR, rate)
    parts = [stretch.push(c) for c in random_chunks(x, np.random.default_rng(9), 1500)]
    # Output flows while input streams in, not all at the end.
    assert sum(len(p) for p in parts) > 0.8 * len(offline)
    streamed = np.concatenate(parts + [stretch.finish()])
    np.testing.assert_allclose(streamed, offline, atol=1e-6)


def test_speaking_rate_with_resampling_through_audio_output():
    x = tone(1.0, f0=220.0)
    pieces = run(AudioOutput(SR, "LINEAR16", 16000, 1.5), x, np.random.default_rng(10))
    assert_contiguous(pieces)
    y = np.frombuffer(joined(pieces), "<i2") / 32767.0
    assert abs(len(y) - 16000 / 1.5) <= 2
    assert abs(peak_hz(y, 16000) - 220.0) < 1.0
