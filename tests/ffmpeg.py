"""ffmpeg as the tests' independent decoder of the audio formats we encode."""

from __future__ import annotations

import subprocess


def ffmpeg_pcm(blob: bytes, rate: int = 24000) -> bytes:
    """Any audio file ffmpeg can read, as mono 16-bit PCM at `rate`."""
    r = subprocess.run(
        [
            "ffmpeg",
            "-v",
            "error",
            "-i",
            "pipe:0",
            "-f",
            "s16le",
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
    return r.stdout
