"""Prometheus metrics of the text service, named in vLLM's style."""

import functools
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)

TTFT = Histogram(
    "splittts_text_time_to_first_token_seconds",
    "Request received -> first token sent.",
    buckets=_LATENCY,
)
ITL = Histogram(
    "splittts_text_inter_token_latency_seconds",
    "Gap between consecutive tokens of a request.",
    buckets=_ITL,
)
E2E = Histogram(
    "splittts_text_e2e_request_latency_seconds",
    "Request received -> last message sent.",
    buckets=_LATENCY + (30.0, 60.0),
)
QUEUE = Histogram(
    "splittts_text_request_queue_time_seconds",
    "Request received -> first scheduled.",
    buckets=_LATENCY,
)
PREFILL = Histogram(
    "splittts_text_request_prefill_time_seconds",
    "First scheduled -> prompt fully processed.",
    buckets=_LATENCY,
)
DECODE = Histogram(
    "splittts_text_request_decode_time_seconds",
    "First token -> last token.",
    buckets=_LATENCY + (30.0, 60.0),
)
RUNNING = Gauge("splittts_text_num_requests_running", "Sequences in the running batch.")
WAITING = Gauge("splittts_text_num_requests_waiting", "Sequences waiting to be scheduled.")
KV_USAGE = Gauge("splittts_text_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
KV_BLOCKS = Gauge(
    "splittts_text_num_used_kv_blocks",
    "KV blocks held by sequences (cached blocks no sequence holds are free).",
)
STATE_SLOTS = Gauge(
    "splittts_text_num_used_state_slots",
    "Linear-attention state slots held by sequences (hybrid models).",
)
PREFIX_QUERIES = Gauge(
    "splittts_text_prefix_cache_queries",
    "Prompt tokens looked up in the prefix cache (cumulative).",
)
PREFIX_HITS = Gauge(
    "splittts_text_prefix_cache_hits", "Prompt tokens served from the prefix cache (cumulative)."
)
PREEMPTIONS = Gauge("splittts_text_num_preemptions", "Preemptions so far (cumulative).")
PAUSED = Gauge(
    "splittts_text_num_requests_paused", "Running sequences paused because their reader is behind."
)
PROMPT_TOKENS = Counter("splittts_text_prompt_tokens", "Prompt tokens received.")
GENERATION_TOKENS = Counter("splittts_text_generation_tokens", "Tokens generated.")
REQUESTS = Counter(
    "splittts_text_request_success",
    "Requests by outcome: stop, length, or deadline, cancelled, rejected, failed.",
    ["finished_reason"],
)


def _stat(stats: Callable[[], dict], key: str) -> float:
    return stats().get(key, 0)


def follow_engine_stats(stats: Callable[[], dict]) -> None:
    """Read the gauges from `stats()` (the engine thread's latest) at every scrape."""
    for gauge, key in (
        (RUNNING, "num_running"),
        (WAITING, "num_waiting"),
        (KV_USAGE, "kv_cache_usage"),
        (KV_BLOCKS, "num_used_blocks"),
        (STATE_SLOTS, "num_used_state_slots"),
        (PREFIX_QUERIES, "prefix_cache_queries"),
        (PREFIX_HITS, "prefix_cache_hits"),
        (PREEMPTIONS, "num_preemptions"),
        (PAUSED, "num_paused"),
    ):
        gauge.set_function(functools.partial(_stat, stats, key))
