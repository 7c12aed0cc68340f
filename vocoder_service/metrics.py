"""Prometheus metrics of the vocoder service (vLLM-style names)."""

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

ACTIVE_STREAMS = Gauge("splittts_vocoder_active_streams", "Vocode streams open now.")
STREAMS = Counter("splittts_vocoder_streams", "Vocode streams by outcome.", ["outcome"])
FIRST_AUDIO = Histogram(
    "splittts_vocoder_first_audio_seconds",
    "First chunk ready (its frames and context arrived) -> first audio sent.",
    buckets=_LATENCY,
)
CHUNK_COMPUTE = Histogram(
    "splittts_vocoder_chunk_compute_seconds",
    "Generator compute per audio chunk (its share of a batched forward).",
    buckets=_LATENCY,
)
BATCH_SIZE = Histogram(
    "splittts_vocoder_batch_size", "Jobs per batched forward.", buckets=(1, 2, 4, 8, 16, 32, 64)
)
FORWARD = Histogram(
    "splittts_vocoder_forward_seconds", "Wall time of one batched forward.", buckets=_LATENCY
)
RTF = Histogram(
    "splittts_vocoder_rtf",
    "Stream wall time / audio duration.",
    buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0),
)
AUDIO_SECONDS = Counter("splittts_vocoder_audio_seconds", "Seconds of audio produced.")
AUDIO_AHEAD = Gauge(
    "splittts_vocoder_audio_ahead_seconds",
    "Audio submitted for vocoding but not yet taken by its stream's reader.",
)


def observe_batch(size: int, seconds: float) -> None:
    BATCH_SIZE.observe(size)
    FORWARD.observe(seconds)
