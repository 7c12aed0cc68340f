"""Streaming audio encoders: float samples in, encoded bytes out as soon as the codec has them.

Each encoder takes mono float32 samples in [-1, 1] at its sample rate through `encode()` and
returns the bytes the codec has finished; `finish()` flushes the rest. Concatenated, the bytes
of one encoder form one valid stream or file:
- LINEAR16 and WAV: int16 PCM, passed straight through (WAV puts its header first, with
  "unknown length" sizes: see `wav_stream_header`).
- MULAW and ALAW: headerless 8-bit G.711 (as telephony and Twilio-style media streams carry
  it), one byte per sample, so nothing is ever held back.
- MP3: LAME (`lameenc`), MPEG frame by frame; a frame is 1152 samples (576 below 32 kHz).
- OGG_OPUS: libopus in Ogg (PyAV), one Ogg page per 20 ms Opus packet.
- FLAC: FFmpeg's FLAC encoder (PyAV), frame by frame. A stream cannot go back, so STREAMINFO
  says "total samples unknown" (0) and carries no MD5; `fill_in_sizes` writes them into a
  seekable file.
- AAC: FFmpeg's AAC-LC encoder in ADTS (PyAV), frame by frame (1024 samples).
Compressed encoders write nothing, not even a header, when no samples came at all.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Any, BinaryIO, Protocol

import numpy as np

# every encoding there is an encoder for, in splittts.tts.v1.AudioEncoding's names and order
ENCODINGS = ("LINEAR16", "WAV", "FLAC", "OGG_OPUS", "MP3", "MULAW", "ALAW", "AAC")
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
WAV_HEADER_BYTES = 44
BIT_RATES = {"MP3": 64_000, "OGG_OPUS": 48_000, "AAC": 64_000}
OGG_PAGE_US = 20_000  # one page per Opus packet: the stream goes out as it is coded


class Encoder(Protocol):
    """Float32 mono samples in, encoded bytes out."""

    def encode(self, samples: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] to little-endian int16 (clipped, rounded)."""
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


def wav_stream_header(sample_rate: int, data_bytes: int = WAV_UNKNOWN_SIZE) -> bytes:
    """A 16-bit mono PCM WAV header; without `data_bytes` its sizes say 'unknown length'."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)
    riff = WAV_UNKNOWN_SIZE if data_bytes == WAV_UNKNOWN_SIZE else data_bytes + 36
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_bytes)
    )


class PcmEncoder:
    """LINEAR16, or WAV when `header` is set: int16 PCM, nothing held back."""

    def __init__(self, sample_rate: int, header: bool = False):
        self._header = wav_stream_header(sample_rate) if header else b""

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def encode(self, samples: np.ndarray) -> bytes:
        return self._take_header() + to_int16(samples).tobytes() if len(samples) else b""

    def finish(self) -> bytes:
        return self._take_header()  # an empty WAV is still a header


@lru_cache(maxsize=2)
def _g711_table(law: str) -> np.ndarray:
    """Code byte for every int16 value (ITU-T G.711, the reference segment search)."""
    x = np.arange(-32768, 32768, dtype=np.int32)
    if law == "MULAW":
        v = x >> 2  # 14-bit
        mask = np.where(v < 0, 0x7F, 0xFF)
        v = np.minimum(np.abs(v), 8159) + (0x84 >> 2)
        ends = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
        seg = np.searchsorted(ends, v)
        code = (seg << 4) | ((v >> (seg + 1)) & 0xF)
    else:
        v = x >> 3  # 13-bit
        mask = np.where(v >= 0, 0xD5, 0x55)
        v = np.where(v >= 0, v, -v - 1)
        ends = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
        seg = np.searchsorted(ends, v)
        code = (seg << 4) | ((v >> np.maximum(seg, 1)) & 0xF)
    code = np.where(seg >= 8, 0x7F, code)
    table = (code ^ mask).astype(np.uint8)
    return np.roll(table, -32768)  # index by the int16's bits read as uint16


class G711Encoder:
    """MULAW or ALAW: one code byte per sample."""

    def __init__(self, law: str):
        self._table = _g711_table(law)

    def encode(self, samples: np.ndarray) -> bytes:
        return self._table[to_int16(samples).view(np.uint16)].tobytes()

    def finish(self) -> bytes:
        return b""


class Mp3Encoder:
    """MP3 at a constant bit rate through LAME."""

    def __init__(self, sample_rate: int, bit_rate: int = BIT_RATES["MP3"]):
        import lameenc

        self._lame = lameenc.Encoder()
        self._lame.set_in_sample_rate(sample_rate)
        self._lame.set_channels(1)
        self._lame.set_bit_rate(bit_rate // 1000)
        self._lame.set_quality(2)  # 2 = high quality, 7 = fastest
        self._started = False

    def encode(self, samples: np.ndarray) -> bytes:
        if not len(samples):
            return b""
        self._started = True
        return bytes(self._lame.encode(to_int16(samples).tobytes()))

    def finish(self) -> bytes:
        return bytes(self._lame.flush()) if self._started else b""


class _Sink:
    """A write-only file for the muxer: not seekable, so it never goes back over sent bytes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self.data)
        self.data.clear()
        return data


class AvEncoder:
    """OGG_OPUS, FLAC or AAC (ADTS) through FFmpeg's encoders and muxers (PyAV)."""

    FORMATS = {"OGG_OPUS": ("ogg", "libopus"), "FLAC": ("flac", "flac"), "AAC": ("adts", "aac")}

    def __init__(self, encoding: str, sample_rate: int):
        self.container_format, self.codec = self.FORMATS[encoding]
        self.encoding, self.sample_rate = encoding, sample_rate
        self._sink = _Sink()
        self._container: Any = None  # av's output container and audio stream, opened lazily
        self._stream: Any = None
        self._pts = 0

    def _open(self) -> None:
        import av

        options = {"page_duration": str(OGG_PAGE_US)} if self.container_format == "ogg" else {}
        self._container = av.open(
            self._sink, mode="w", format=self.container_format, options=options
        )
        self._stream = self._container.add_stream(self.codec, rate=self.sample_rate, layout="mono")
        if self.encoding in BIT_RATES:
            self._stream.codec_context.bit_rate = BIT_RATES[self.encoding]

    def _frame(self, samples: np.ndarray):
        import av

        fmt = self._stream.codec_context.format.name
        data = (
            to_int16(samples)
            if fmt.startswith("s16")
            else np.clip(samples, -1.0, 1.0).astype(np.float32)
        )
        frame = av.AudioFrame.from_ndarray(data[None, :], format=fmt, layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self._pts
        self._pts += len(samples)
        return frame

    def encode(self, samples: np.ndarray) -> bytes:
        if not len(samples):
            return b""
        if self._container is None:
            self._open()
        for packet in self._stream.encode(self._frame(samples)):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self._container is None:
            return b""
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


def make_encoder(encoding: str, sample_rate: int) -> Encoder:
    """The streaming encoder for a validated encoding name."""
    if encoding in ("LINEAR16", "WAV"):
        return PcmEncoder(sample_rate, header=encoding == "WAV")
    if encoding in ("MULAW", "ALAW"):
        return G711Encoder(encoding)
    if encoding == "MP3":
        return Mp3Encoder(sample_rate)
    return AvEncoder(encoding, sample_rate)


def fill_in_sizes(
    f: BinaryIO, start: int, encoding: str, num_samples: int, head: bytes | None = None
) -> None:
    """Writes a finished stream's real sizes into its header in the seekable file `f`.

    `start` is where the stream begins in `f`; `head`, its first bytes, stands in for reading
    them back when `f` is write-only (a redirected standard output).
    """
    end = f.seek(0, 2)
    if encoding == "WAV" and end - start >= WAV_HEADER_BYTES:
        data_bytes = end - start - WAV_HEADER_BYTES
        if data_bytes + 36 < WAV_UNKNOWN_SIZE:  # past 4 GiB it stays 'unknown'
            f.seek(start + 4)
            f.write(struct.pack("<I", data_bytes + 36))
            f.seek(start + 40)
            f.write(struct.pack("<I", data_bytes))
    elif encoding == "FLAC" and end - start >= 42 and num_samples < 1 << 36:
        # "fLaC", a 4-byte block header, then STREAMINFO; total samples are its bits 108-143.
        at = start + 8 + 13
        if head is None:
            f.seek(at)
            field = f.read(5)
        else:
            field = head[at - start : at - start + 5]
        if len(field) == 5:
            packed = (int.from_bytes(field, "big") & ~((1 << 36) - 1)) | num_samples
            f.seek(at)
            f.write(packed.to_bytes(5, "big"))
    f.seek(end)
