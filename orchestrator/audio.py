"""Audio out: speaking rate, resampling and encoding of the stream sent to the caller.

Samples go through three streamed stages: tempo change at the voice's rate (`tempo.py`,
skipped at rate 1.0), resampling with `soxr.ResampleStream` (skipped when the rates match),
then a streaming encoder (`encoders.py`): LINEAR16, WAV, MULAW, ALAW, MP3, OGG_OPUS, FLAC and
AAC all leave as soon as the codec has finished a frame. A piece's samples are those fed to
the encoder since the previous piece; a codec that codes whole frames (MP3, Opus, FLAC, AAC)
lags them by up to one frame, and its last frames come at `finish()`.

Output rates: 0 means the voice's rate, except where a codec codes only some rates, where
the smallest of those not below the requested rate is used, so no bandwidth is lost (Opus:
8, 12, 16, 24 and 48 kHz, so 22050 -> 24000; MP3 and AAC: the MPEG rates 8 to 48 kHz), and
MULAW / ALAW, which default to 8 kHz (telephony). `output_rate` and every piece report the
rate actually used.
"""

import math
from dataclasses import dataclass

import numpy as np
import soxr

from orchestrator.encoders import ENCODINGS, make_encoder, to_int16, wav_stream_header  # noqa: F401
from orchestrator.tempo import TimeStretch

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 48000
MIN_SPEAKING_RATE, MAX_SPEAKING_RATE = 0.5, 2.0
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
MPEG_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
CODEC_SAMPLE_RATES = {
    "OGG_OPUS": OPUS_SAMPLE_RATES,
    "MP3": MPEG_SAMPLE_RATES,
    "AAC": MPEG_SAMPLE_RATES,
}
G711_DEFAULT_RATE = 8000
MEDIA_TYPES = {
    "LINEAR16": "audio/L16",
    "WAV": "audio/wav",
    "FLAC": "audio/flac",
    "OGG_OPUS": "audio/ogg; codecs=opus",
    "MP3": "audio/mpeg",
    "MULAW": "audio/basic",
    "ALAW": "audio/x-alaw-basic",
    "AAC": "audio/aac",
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


def resolve_audio_format(
    input_rate: int, encoding: str = "LINEAR16", sample_rate_hz: int = 0, speaking_rate: float = 1.0
) -> AudioFormat:
    """Checks an audio_config against the rules; ValueError names the field and the rule."""
    if isinstance(input_rate, bool) or not isinstance(input_rate, int) or input_rate <= 0:
        raise ValueError(f"input_rate must be a positive integer (got {input_rate!r})")
    if encoding in ("", "AUDIO_ENCODING_UNSPECIFIED"):
        encoding = "LINEAR16"
    if encoding not in ENCODINGS:
        raise ValueError(
            f"audio_config.encoding must be one of {', '.join(ENCODINGS)} (got {encoding!r})"
        )
    if sample_rate_hz != 0 and not MIN_SAMPLE_RATE <= sample_rate_hz <= MAX_SAMPLE_RATE:
        raise ValueError(
            f"audio_config.sample_rate_hz must be 0 or between {MIN_SAMPLE_RATE} "
            f"and {MAX_SAMPLE_RATE} (got {sample_rate_hz})"
        )
    if speaking_rate == 0:
        speaking_rate = 1.0  # proto3 default: unset
    if not math.isfinite(speaking_rate) or not (
        MIN_SPEAKING_RATE <= speaking_rate <= MAX_SPEAKING_RATE
    ):
        raise ValueError(
            f"audio_config.speaking_rate must be 0 (unset) or between "
            f"{MIN_SPEAKING_RATE} and {MAX_SPEAKING_RATE} (got {speaking_rate})"
        )
    output_rate = int(sample_rate_hz) or (
        G711_DEFAULT_RATE if encoding in ("MULAW", "ALAW") else input_rate
    )
    if encoding in CODEC_SAMPLE_RATES:
        rates = CODEC_SAMPLE_RATES[encoding]
        output_rate = min((r for r in rates if r >= output_rate), default=rates[-1])
    return AudioFormat(encoding, input_rate, output_rate, float(speaking_rate))


def warm_encoders(input_rate: int, output_rate: int = 24000) -> None:
    """Code a little silence in every encoding, resampled (to OpenAI's rate by default), so the
    codec libraries (LAME, PyAV and FFmpeg's codecs) and soxr load at start-up, not on a request."""
    for encoding in ENCODINGS:
        out = AudioOutput(input_rate, encoding, output_rate)
        out.push(np.zeros(input_rate // 10, dtype=np.float32))
        out.finish()


class AudioOutput:
    """Turns the vocoder's float32 stream into encoded pieces for one request."""

    def __init__(
        self,
        input_rate: int,
        encoding: str = "LINEAR16",
        sample_rate_hz: int = 0,
        speaking_rate: float = 1.0,
    ) -> None:
        self.format = resolve_audio_format(input_rate, encoding, sample_rate_hz, speaking_rate)
        self._stretch = TimeStretch(input_rate, self.format.speaking_rate)
        self._resampler = None
        if self.output_rate != input_rate:
            self._resampler = soxr.ResampleStream(
                input_rate, self.output_rate, 1, dtype="float32", quality="HQ"
            )
        self._encoder = make_encoder(self.encoding, self.output_rate)
        self._num_out = 0
        self._unsent = 0  # samples fed to the encoder whose bytes have not gone out yet
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
        """Flushes everything, the encoder included; returns the last pieces."""
        if self._finished:
            raise RuntimeError("AudioOutput.finish() called twice")
        self._finished = True
        y = self._stretch.finish()
        if self._resampler is not None:
            y = self._resampler.resample_chunk(y, last=True)
        return self._encode(y, final=True)

    def _encode(self, y: np.ndarray, final: bool) -> list[AudioPiece]:
        data = self._encoder.encode(y)
        if final:
            data += self._encoder.finish()
        self._unsent += len(y)
        if not data:
            return []
        piece = AudioPiece(data, self._num_out, self._unsent, self.output_rate)
        self._num_out += self._unsent
        self._unsent = 0
        return [piece]
