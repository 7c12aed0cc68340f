"""Where the time of one request went: the LatencyReport, built as the request runs.

TTFA is measured on the orchestrator's clock alone; service timings come from each service's
own clock; a hop's transit is the round trip seen here minus the compute the far side reports,
so clocks of different hosts are never compared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from splittts.tts.v1 import tts_pb2 as pb


@dataclass
class HopStats:
    service: str
    address: str = ""
    samples: list[float] = field(default_factory=list)  # transit overhead per exchange, ms

    def add(self, overhead_ms: float) -> None:
        self.samples.append(max(0.0, overhead_ms))

    def to_proto(self) -> pb.HopTiming:
        s = self.samples
        return pb.HopTiming(
            service=self.service,
            address=self.address,
            mean_overhead_ms=sum(s) / len(s) if s else 0.0,
            max_overhead_ms=max(s) if s else 0.0,
        )


@dataclass
class LatencyTracker:
    """Accumulates one request's timings; `report()` builds the final message."""

    request_id: str
    arrival: float = field(default_factory=time.perf_counter)
    ttft_ms: float | None = None
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    vocoder_compute_ms: float = 0.0
    frontend_ms: float = 0.0
    num_speech_tokens: int = 0
    num_segments: int = 0
    text_hop: HopStats = field(default_factory=lambda: HopStats("text"))
    vocoder_hop: HopStats = field(default_factory=lambda: HopStats("vocoder"))
    first_audio: float | None = None
    last_audio: float | None = None
    audio_s: float = 0.0
    num_chunks: int = 0
    underruns: int = 0
    max_gap_ms: float = 0.0
    # the first audio chunk's input and the vocoder's time on it (`on_first_chunk`)
    first_chunk_input_ms: float | None = None
    first_chunk_vocoder_ms: float = 0.0
    first_chunk_compute_ms: float = 0.0

    def on_segment_done(
        self, timings, client_first_ms: float | None, client_total_ms: float
    ) -> None:
        """Fold in one Generate call: the service's timings and our own round trip."""
        if self.ttft_ms is None and timings.ttft_ms > 0:
            self.ttft_ms = timings.ttft_ms
        self.queue_ms += timings.queue_ms
        self.prefill_ms += timings.prefill_ms
        self.decode_ms += timings.decode_ms
        if client_first_ms is not None and timings.ttft_ms > 0:
            self.text_hop.add(client_first_ms - timings.ttft_ms)
        self.text_hop.add(client_total_ms - timings.total_ms)
        self.num_segments += 1

    def on_first_chunk(self, input_sent: float, service_ms: float, compute_ms: float) -> None:
        """The vocoder's first audio chunk: `input_sent` is when the message that completed its
        input left here; the vocoder reported `service_ms` from that input's arrival to the
        chunk leaving, `compute_ms` of it in its forward. Later chunks change nothing."""
        if self.first_chunk_input_ms is None:
            self.first_chunk_input_ms = 1e3 * (input_sent - self.arrival)
            self.first_chunk_vocoder_ms = service_ms
            self.first_chunk_compute_ms = compute_ms

    def on_audio_sent(self, duration_s: float, now: float | None = None) -> None:
        """Count a chunk leaving us; an underrun is a chunk later than the audio already out."""
        now = time.perf_counter() if now is None else now
        if self.first_audio is None or self.last_audio is None:
            self.first_audio = now
        else:
            played_until = self.first_audio + self.audio_s
            if now > played_until:
                self.underruns += 1
            self.max_gap_ms = max(self.max_gap_ms, 1e3 * (now - self.last_audio))
        self.last_audio = now
        self.audio_s += duration_s
        self.num_chunks += 1

    @property
    def ttfa_ms(self) -> float:
        return 1e3 * (self.first_audio - self.arrival) if self.first_audio is not None else 0.0

    def report(self) -> pb.LatencyReport:
        total_ms = 1e3 * (time.perf_counter() - self.arrival)
        return pb.LatencyReport(
            request_id=self.request_id,
            ttft_ms=self.ttft_ms or 0.0,
            ttfa_ms=self.ttfa_ms,
            queue_ms=self.queue_ms,
            prefill_ms=self.prefill_ms,
            decode_ms=self.decode_ms,
            vocoder_compute_ms=self.vocoder_compute_ms,
            frontend_ms=self.frontend_ms,
            hops=[self.text_hop.to_proto(), self.vocoder_hop.to_proto()],
            total_ms=total_ms,
            audio_s=self.audio_s,
            rtf=total_ms / 1e3 / self.audio_s if self.audio_s else 0.0,
            num_chunks=self.num_chunks,
            underruns=self.underruns,
            max_chunk_gap_ms=self.max_gap_ms,
            num_speech_tokens=self.num_speech_tokens,
            num_segments=self.num_segments,
            first_chunk_input_ms=self.first_chunk_input_ms or 0.0,
            first_chunk_vocoder_ms=self.first_chunk_vocoder_ms,
            first_chunk_compute_ms=self.first_chunk_compute_ms,
        )
