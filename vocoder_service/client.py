"""A small client of splittts.vocoder.v1 for the demo, tests and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from splittts.vocoder.v1 import vocoder_pb2 as pb, vocoder_pb2_grpc


@dataclass
class VocodeResult:
    """Audio of one stream and when each chunk arrived (perf_counter seconds)."""

    audio: np.ndarray
    sample_rate: int
    chunks: list[pb.AudioChunk] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    timings: list[pb.ChunkTimings] = field(default_factory=list)
    summary: pb.VocodeSummary | None = None


def mel_requests(
    mel: np.ndarray, chunk_frames: int, voice: str = "", end: bool = True
) -> Iterator[pb.VocodeRequest]:
    """Config, then `[num_mels, frames]` mel in chunks of `chunk_frames`, then end of stream."""
    yield pb.VocodeRequest(config=pb.VocodeConfig(voice=voice, input_kind=pb.INPUT_KIND_MEL))
    for start in range(0, mel.shape[1], chunk_frames):
        part = np.ascontiguousarray(mel[:, start : start + chunk_frames].T, dtype=np.float32)
        yield pb.VocodeRequest(mel=pb.MelChunk(num_mels=mel.shape[0], values=part.reshape(-1)))
    if end:
        yield pb.VocodeRequest(end_of_stream=True)


def token_requests(
    ids: Iterable[int], chunk_tokens: int, voice: str = "", end: bool = True
) -> Iterator[pb.VocodeRequest]:
    """Config, then speech-token ids in chunks of `chunk_tokens`, then end of stream."""
    ids = list(ids)
    yield pb.VocodeRequest(
        config=pb.VocodeConfig(voice=voice, input_kind=pb.INPUT_KIND_SPEECH_TOKENS)
    )
    for start in range(0, len(ids), chunk_tokens):
        yield pb.VocodeRequest(tokens=pb.TokenChunk(ids=ids[start : start + chunk_tokens]))
    if end:
        yield pb.VocodeRequest(end_of_stream=True)


def vocode(
    channel: grpc.Channel, requests: Iterable[pb.VocodeRequest], timeout: float | None = 120.0
) -> VocodeResult:
    """Run one Vocode stream to the end and join its audio (checking chunks are contiguous)."""
    stub = vocoder_pb2_grpc.VocoderStub(channel)
    pieces, result = [], VocodeResult(np.zeros(0, np.float32), 0)
    expected = 0
    for resp in stub.Vocode(iter(requests), timeout=timeout):
        if resp.HasField("summary"):
            result.summary = resp.summary
            continue
        chunk = resp.audio
        if chunk.first_sample != expected:
            raise RuntimeError(
                f"chunk {chunk.sequence_number} starts at sample "
                f"{chunk.first_sample}, expected {expected}"
            )
        expected += chunk.num_samples
        result.arrivals.append(time.perf_counter())
        result.chunks.append(chunk)
        result.timings.append(resp.timings)
        result.sample_rate = chunk.sample_rate_hz
        pieces.append(np.frombuffer(chunk.pcm, dtype="<i2"))
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
    result.audio = pcm.astype(np.float32) / 32767.0
    return result
