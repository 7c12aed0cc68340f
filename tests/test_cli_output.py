"""tts-cli's output files and start-up errors, against real services on 127.0.0.1."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import wave

import numpy as np
import pytest
import soundfile

from orchestrator.launcher import LocalDeployment
from tests.voices import make_tts_voice

UNKNOWN = b"\xff\xff\xff\xff"


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


@pytest.fixture(scope="module")
def deployment(voice_dir):
    # fp32: the same speech made twice then differs by a few LSBs at most, however its token
    # stream was chunked (bf16's rounding follows the chunking, by up to ~160 LSBs)
    local = LocalDeployment(
        voice_dir, threads={"text": 1, "vocoder": 1}, vocoder_args=["--backend", "onnx"]
    )
    local.start()
    yield local
    local.stop()


def cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=300,
    )


def say(deployment, *args: str, **kwargs) -> subprocess.CompletedProcess:
    r = cli(
        "synthesize",
        "hello there, how are you",
        "--seed",
        "1",
        "--server",
        deployment.address,
        "-q",
        *args,
        **kwargs,
    )
    assert r.returncode == 0, r.stderr.decode()
    return r


def ffmpeg_samples(path, *fmt: str) -> np.ndarray:
    r = subprocess.run(
        ["ffmpeg", "-v", "error", *fmt, "-i", str(path), "-f", "s16le", "-ac", "1", "pipe:1"],
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode()
    return np.frombuffer(r.stdout, "<i2")


def test_wav_file_carries_its_real_sizes(deployment, tmp_path):
    out = tmp_path / "x.wav"
    say(deployment, "-o", str(out))
    blob = out.read_bytes()
    riff, data = struct.unpack("<I", blob[4:8])[0], struct.unpack("<I", blob[40:44])[0]
    assert riff == len(blob) - 8 and data == len(blob) - 44 > 0
    frames = (len(blob) - 44) // 2
    with wave.open(str(out)) as w:
        assert w.getnframes() == frames
    assert soundfile.info(out).frames == frames
    assert not list(tmp_path.glob("*.part"))


def test_wav_to_a_pipe_keeps_streaming_sizes_and_to_a_file_gets_real_ones(deployment, tmp_path):
    piped = say(deployment, "-o", "-").stdout
    assert piped[4:8] == UNKNOWN and piped[40:44] == UNKNOWN
    with open(tmp_path / "redirected.wav", "wb") as f:  # `tts-cli ... -o - > redirected.wav`
        say(deployment, "-o", "-", stdout=f)
    blob = (tmp_path / "redirected.wav").read_bytes()
    assert len(blob) == len(piped)  # the same speech, only the header differs
    assert struct.unpack("<I", blob[40:44])[0] == len(blob) - 44
    with wave.open(str(tmp_path / "redirected.wav")) as w:
        assert w.getnframes() == (len(blob) - 44) // 2


@pytest.mark.parametrize("to_stdout", [False, True])
def test_flac_file_knows_its_length(deployment, tmp_path, to_stdout):
    say(deployment, "-o", str(tmp_path / "x.wav"))
    if to_stdout:  # `tts-cli ... -o - --format flac > x.flac`: stdout is write-only
        with open(tmp_path / "x.flac", "wb") as f:
            say(deployment, "-o", "-", "--format", "flac", stdout=f)
    else:
        say(deployment, "-o", str(tmp_path / "x.flac"))
    pcm, _ = soundfile.read(tmp_path / "x.wav", dtype="int16")
    assert soundfile.info(tmp_path / "x.flac").frames == len(pcm)
    flac, rate = soundfile.read(tmp_path / "x.flac", dtype="int16")
    # Lossless, every sample there (up to the LSBs by which the vocoder's float maths varies
    # with how the token stream happened to be chunked).
    assert rate == 22050 and len(flac) == len(pcm)
    assert np.abs(flac.astype(int) - pcm.astype(int)).max() <= 4


@pytest.mark.parametrize(
    "name, args, decode, rate",
    [
        ("x.mp3", [], [], 22050),
        ("x.ogg", [], [], 24000),
        ("x.opus", [], [], 24000),
        ("x.aac", [], [], 22050),
        ("x.ul", [], ["-f", "mulaw", "-ar", "8000"], 8000),
        ("x.al", [], ["-f", "alaw", "-ar", "8000"], 8000),
        ("x.bin", ["--format", "mp3"], ["-f", "mp3"], 22050),
        (
            "x.audio",
            ["--format", "mulaw", "--sample-rate", "16000"],
            ["-f", "mulaw", "-ar", "16000"],
            16000,
        ),
    ],
)
def test_format_follows_the_extension_or_the_flag(deployment, tmp_path, name, args, decode, rate):
    out = tmp_path / name
    say(deployment, "-o", str(out), *args)
    say(deployment, "-o", str(tmp_path / "ref.wav"), "--sample-rate", str(rate))
    ref, _ = soundfile.read(tmp_path / "ref.wav", dtype="int16")
    got = ffmpeg_samples(out, *decode)
    # Opus decodes at 48 kHz; the others at their own rate, lossy codecs with added delay.
    expect = len(ref) * (48000 // rate if name.endswith((".ogg", ".opus")) else 1)
    assert expect <= len(got) < expect + 4000
    if "mulaw" in decode or "alaw" in decode:
        assert len(got) == len(ref) and out.stat().st_size == len(ref)  # one byte a sample


def test_a_failed_synthesis_leaves_no_file(deployment, tmp_path):
    out = tmp_path / "never.wav"
    r = cli("synthesize", "hi", "-o", str(out), "--voice", "nobody", "--server", deployment.address)
    assert r.returncode == 2 and b"NOT_FOUND" in r.stderr
    assert list(tmp_path.iterdir()) == []


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_missing_voice_dir_is_one_line_and_exit_2(tmp_path):
    r = cli("synthesize", "hi", "-o", str(tmp_path / "x.wav"), "--voice-dir", "/nonexistent")
    assert r.returncode == 2
    assert one_line(r) == "tts-cli: --voice-dir /nonexistent: no such directory"
    r = cli("synthesize", "hi", "-o", str(tmp_path / "x.wav"), "--voice-dir", str(tmp_path))
    assert r.returncode == 2 and "voice.json is missing" in one_line(r)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--speaking-rate", "9"], "--speaking-rate must be between 0.5 and 2.0 (got 9.0)"),
        (["--speaking-rate", "nan"], "--speaking-rate must be between"),
        (
            ["--sample-rate", "5"],
            "--sample-rate must be between 8000 and 48000 Hz, or 0 for the voice's own (got 5)",
        ),
        (["--format", "aiff"], "--format: unsupported 'aiff'"),
        (["-o", "x.aiff"], "--format: unsupported 'aiff'"),
    ],
)
def test_flags_are_checked_before_any_service_starts(voice_dir, tmp_path, args, match):
    # The services of this voice cannot start: a check made after starting them would say so.
    broken = shutil.copytree(voice_dir, tmp_path / "broken")
    (broken / "lm" / "config.json").unlink()
    out = ["-o", str(tmp_path / "x.wav")] if "-o" not in args else []
    r = cli("synthesize", "hi", *out, "--voice-dir", str(broken), *args)
    assert r.returncode == 2
    line = one_line(r)
    assert match in line and "failed to start" not in line


def test_service_start_up_error_keeps_its_reason(voice_dir, tmp_path):
    broken = shutil.copytree(voice_dir, tmp_path / "broken")
    (broken / "lm" / "config.json").unlink()
    r = cli("synthesize", "hi", "-o", str(tmp_path / "x.wav"), "--voice-dir", str(broken), "-q")
    assert r.returncode == 2  # the service refused its model: a configuration error
    assert one_line(r) == (
        f"tts-cli: text-service failed to start: --model {broken / 'lm'}: no config.json there"
    )
    (broken / "lm" / "config.json").write_text((voice_dir / "lm" / "config.json").read_text())
    (broken / "lm" / "model.safetensors").write_bytes(b"\x00" * 64)
    r = cli("synthesize", "hi", "-o", str(tmp_path / "x.wav"), "--voice-dir", str(broken), "-q")
    assert r.returncode == 2  # a corrupt weights file is a bad model too, named in one line
    line = one_line(r)
    assert (
        line.startswith("tts-cli: text-service failed to start: ") and "model.safetensors" in line
    )
    assert not (tmp_path / "x.wav").exists()
    left = subprocess.run(["pgrep", "-f", str(broken)], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # nothing it started is left running
