"""The web demo's download in other formats: the page's WAV in, the same audio encoded out.

The page builds a WAV of exactly the samples it received and played; `POST /api/encode?format=`
mp3, flac, opus (Ogg) or aac turns it into that format with the streaming encoders of the API,
so the download holds the audio that was heard, not a new synthesis of the same text.
"""

from __future__ import annotations

import asyncio
import io
import struct
import wave

import numpy as np
from aiohttp import web

from orchestrator.audio import MAX_SAMPLE_RATE, MEDIA_TYPES, MIN_SAMPLE_RATE, AudioOutput

FORMATS = {"mp3": "MP3", "flac": "FLAC", "opus": "OGG_OPUS", "aac": "AAC"}
MAX_WAV_BYTES = 64 << 20  # ten minutes at 48 kHz, and then some


def encode_wav(wav_bytes: bytes, encoding: str) -> bytes:
    """A 16-bit mono WAV's samples in `encoding`; ValueError says what is wrong with the WAV."""
    try:
        with wave.open(io.BytesIO(wav_bytes)) as w:
            if (w.getnchannels(), w.getsampwidth()) != (1, 2):
                raise ValueError("the WAV must be 16-bit mono")
            rate = w.getframerate()
            pcm = w.readframes(w.getnframes())
    except (wave.Error, EOFError, RuntimeError, struct.error) as exc:  # wave's ways of failing
        raise ValueError(f"the body is not a WAV file ({exc or type(exc).__name__})") from None
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(
            f"the WAV's rate must be between {MIN_SAMPLE_RATE} and "
            f"{MAX_SAMPLE_RATE} Hz (got {rate})"
        )
    out = AudioOutput(rate, encoding)
    samples = np.frombuffer(pcm[: len(pcm) // 2 * 2], "<i2").astype(np.float32) / 32767.0
    return b"".join(p.audio for p in out.push(samples) + out.finish())


async def encode(request: web.Request) -> web.Response:
    """POST /api/encode?format=mp3|flac|opus|aac with a WAV body."""
    fmt = request.query.get("format", "")
    if fmt not in FORMATS:
        return web.json_response(
            {"error": f"format must be one of {', '.join(FORMATS)} (got {fmt!r})"}, status=400
        )
    if (request.content_length or 0) > MAX_WAV_BYTES:
        return web.json_response(
            {"error": f"the WAV exceeds {MAX_WAV_BYTES >> 20} MiB"}, status=413
        )
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_WAV_BYTES:
            return web.json_response(
                {"error": f"the WAV exceeds {MAX_WAV_BYTES >> 20} MiB"}, status=413
            )
    try:
        data = await asyncio.to_thread(encode_wav, bytes(body), FORMATS[fmt])
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.Response(body=data, headers={"Content-Type": MEDIA_TYPES[FORMATS[fmt]]})
