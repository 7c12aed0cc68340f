"""Prometheus metrics of the public API, named in vLLM's style."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)

TTFA = Histogram(
    "splittts_tts_ttfa_seconds", "Request received -> first audio byte sent.", buckets=_LATENCY
)
TTFT = Histogram(
    "splittts_tts_time_to_first_token_seconds",
    "Text service's time to first speech token, as it reports it.",
    buckets=_LATENCY,
)
E2E = Histogram(
    "splittts_tts_e2e_request_latency_seconds",
    "Request received -> last byte.",
    buckets=_LATENCY + (30.0, 60.0),
)
RTF = Histogram(
    "splittts_tts_rtf",
    "Wall time / audio duration.",
    buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0),
)
QUEUE = Histogram("splittts_tts_queue_time_seconds", "Text-service queue time.", buckets=_LATENCY)
PREFILL = Histogram(
    "splittts_tts_prefill_time_seconds", "Text-service prefill time.", buckets=_LATENCY
)
DECODE = Histogram(
    "splittts_tts_decode_time_seconds", "Text-service decode time.", buckets=_LATENCY + (30.0,)
)
VOCODER = Histogram(
    "splittts_tts_vocoder_compute_seconds",
    "Vocoder compute per request.",
    buckets=_LATENCY + (30.0,),
)
HOP = Histogram(
    "splittts_tts_hop_overhead_seconds",
    "Per-hop transit: round trip minus the far side's reported compute.",
    ["service"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
)
UNDERRUNS = Counter("splittts_tts_underruns", "Audio chunks that arrived after playback ran dry.")
AUDIO_SECONDS = Counter("splittts_tts_audio_seconds", "Seconds of audio produced.")
IN_FLIGHT = Gauge("splittts_tts_requests_in_flight", "Synthesis requests in flight.")
REQUESTS = Counter("splittts_tts_requests", "Finished requests by gRPC status.", ["rpc", "status"])


def observe_report(report) -> None:
    """Record one LatencyReport."""
    TTFA.observe(report.ttfa_ms / 1e3)
    TTFT.observe(report.ttft_ms / 1e3)
    E2E.observe(report.total_ms / 1e3)
    if report.rtf:
        RTF.observe(report.rtf)
    QUEUE.observe(report.queue_ms / 1e3)
    PREFILL.observe(report.prefill_ms / 1e3)
    DECODE.observe(report.decode_ms / 1e3)
    VOCODER.observe(report.vocoder_compute_ms / 1e3)
    for hop in report.hops:
        HOP.labels(hop.service).observe(hop.mean_overhead_ms / 1e3)
    UNDERRUNS.inc(report.underruns)
    AUDIO_SECONDS.inc(report.audio_s)
