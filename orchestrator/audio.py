"""Audio out: speaking rate, resampling and encoding of the stream sent to the caller.

Samples go through three streamed stages: tempo change at the voice's rate (`tempo.py`,
skipped at rate 1.0), resampling with `soxr.ResampleStream` (skipped when the rates match),
then encoding:
- LINEAR16: headerless int16 little-endian PCM, emitted as soon as samples are final.
- WAV: the same PCM, with a 44-byte header in front of the first piece. A stream cannot go
  back to fill in sizes, so the RIFF and data sizes are 0xFFFFFFFF ("unknown length", as
  streaming encoders write them); libsndfile, Python's `wave` and browsers then read the data
  up to the end of the file, so the concatenated pieces form one valid file.
- FLAC and OGG_OPUS: whole files written by `soundfile` at `finish()` (no piece at all when
  there was no audio: libsndfile cannot write an empty file of either kind).
Opus codes only 8, 12, 16, 24 and 48 kHz: OGG_OPUS is encoded at the smallest of these that
is not below the requested rate (22050 -> 24000, 44100 -> 48000), so no bandwidth is lost;
`output_rate` and every piece report the rate actually used.
"""

import io
import math
import struct
from dataclasses import dataclass

import numpy as np
import soundfile
import soxr

from orchestrator.tempo import TimeStretch

ENCODINGS = ("LINEAR16", "WAV", "FLAC", "OGG_OPUS")
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000
MIN_SPEAKING_RATE, MAX_SPEAKING_RATE = 0.5, 2.0
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
MEDIA_TYPES = {
    "LINEAR16": "audio/L16",
    "WAV": "audio/wav",
    "FLAC": "audio/flac",
    "OGG_OPUS": "audio/ogg; codecs=opus",
}


@dataclass(frozen=True)
class AudioFormat:
    """A validated audio_config: what comes in, and what goes out."""

    encoding: str
    input_rate: int
    output_rate: int
    speaking_rate: float


@dataclass(frozen=True)
class AudioPiece:
    """Encoded bytes ready to send, and where their samples sit in the output audio."""

    audio: bytes
    first_sample: int
    num_samples: int
    sample_rate_hz: int

    @property
    def duration_s(self) -> float:
        """Seconds of audio in this piece."""
        return self.num_samples / self.sample_rate_hz


def resolve_audio_format(input_rate: int, encoding: str = "LINEAR16", sample_rate_hz: int = 0,
                         speaking_rate: float = 1.0) -> AudioFormat:
    """Checks an audio_config against the rules; ValueError names the field and the rule."""
    if isinstance(input_rate, bool) or not isinstance(input_rate, int) or input_rate <= 0:
        raise ValueError(f"input_rate must be a positive integer (got {input_rate!r})")
    if encoding in ("", "AUDIO_ENCODING_UNSPECIFIED"):
        encoding = "LINEAR16"
    if encoding not in ENCODINGS:
        raise ValueError(f"audio_config.encoding must be one of {', '.join(ENCODINGS)} "
                         f"(got {encoding!r})")
    if sample_rate_hz != 0 and not MIN_SAMPLE_RATE <= sample_rate_hz <= MAX_SAMPLE_RATE:
        raise ValueError(f"audio_config.sample_rate_hz must be 0 or between {MIN_SAMPLE_RATE} "
                         f"and {MAX_SAMPLE_RATE} (got {sample_rate_hz})")
    if speaking_rate == 0:
        speaking_rate = 1.0  # proto3 default: unset
    if not math.isfinite(speaking_rate) or not (
            MIN_SPEAKING_RATE <= speaking_rate <= MAX_SPEAKING_RATE):
        raise ValueError(f"audio_config.speaking_rate must be 0 (unset) or between "
                         f"{MIN_SPEAKING_RATE} and {MAX_SPEAKING_RATE} (got {speaking_rate})")
    output_rate = int(sample_rate_hz) or input_rate
    if encoding == "OGG_OPUS":
        output_rate = min((r for r in OPUS_SAMPLE_RATES if r >= output_rate),
                          default=OPUS_SAMPLE_RATES[-1])
    return AudioFormat(encoding, input_rate, output_rate, float(speaking_rate))


def wav_stream_header(sample_rate: int) -> bytes:
    """A 16-bit mono PCM WAV header whose sizes say 'unknown length' (0xFFFFFFFF)."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    return (b"RIFF" + struct.pack("<I", WAV_UNKNOWN_SIZE) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", WAV_UNKNOWN_SIZE))


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] to little-endian int16 (clipped, rounded)."""
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


class AudioOutput:
    """Turns the vocoder's float32 stream into encoded pieces for one request."""

    def __init__(self, input_rate: int, encoding: str = "LINEAR16", sample_rate_hz: int = 0,
                 speaking_rate: float = 1.0) -> None:
        self.format = resolve_audio_format(input_rate, encoding, sample_rate_hz, speaking_rate)
        self._stretch = TimeStretch(input_rate, self.format.speaking_rate)
        self._resampler = None
        if self.output_rate != input_rate:
            self._resampler = soxr.ResampleStream(input_rate, self.output_rate, 1,
                                                  dtype="float32", quality="HQ")
        self._num_out = 0
        self._header_sent = False
        self._held: list[np.ndarray] = []  # FLAC / OGG_OPUS: encoded at finish()
        self._finished = False

    @property
    def encoding(self) -> str:
        """Output encoding name."""
        return self.format.encoding

    @property
    def output_rate(self) -> int:
        """Sample rate of the output audio."""
        return self.format.output_rate

    @property
    def media_type(self) -> str:
        """MIME type of the output."""
        return MEDIA_TYPES[self.encoding]

    @property
    def num_samples(self) -> int:
        """Output samples emitted so far."""
        return self._num_out

    def push(self, samples: np.ndarray) -> list[AudioPiece]:
        """Adds float32 mono samples at the input rate; returns the pieces ready to send now."""
        if self._finished:
            raise RuntimeError("AudioOutput.push() after finish()")
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"samples must be 1-D mono (got shape {x.shape})")
        y = self._stretch.push(x)
        if self._resampler is not None:
            y = self._resampler.resample_chunk(y)
        return self._encode(y, final=False)

    def finish(self) -> list[AudioPiece]:
        """Flushes everything; returns the last pieces (the whole file for FLAC/OGG_OPUS)."""
        if self._finished:
            raise RuntimeError("AudioOutput.finish() called twice")
        self._finished = True
        y = self._stretch.finish()
        if self._resampler is not None:
            y = self._resampler.resample_chunk(y, last=True)
        return self._encode(y, final=True)

    def _encode(self, y: np.ndarray, final: bool) -> list[AudioPiece]:
        if self.encoding in ("FLAC", "OGG_OPUS"):
            if len(y):
                self._held.append(y)
            # libsndfile writes no readable FLAC or Opus file without samples: send nothing.
            return [self._whole_file()] if final and self._held else []
        data = to_int16(y).tobytes()
        if self.encoding == "WAV" and not self._header_sent and (data or final):
            data = wav_stream_header(self.output_rate) + data
            self._header_sent = True
        if not data:
            return []
        return [self._piece(data, len(y))]

    def _whole_file(self) -> AudioPiece:
        y = np.concatenate(self._held)
        buf = io.BytesIO()
        if self.encoding == "FLAC":
            soundfile.write(buf, to_int16(y), self.output_rate, format="FLAC", subtype="PCM_16")
        else:
            soundfile.write(buf, np.clip(y, -1.0, 1.0), self.output_rate, format="OGG",
                            subtype="OPUS")
        self._held = []
        return self._piece(buf.getvalue(), len(y))

    def _piece(self, data: bytes, num_samples: int) -> AudioPiece:
        piece = AudioPiece(data, self._num_out, num_samples, self.output_rate)
        self._num_out += num_samples
        return piece
