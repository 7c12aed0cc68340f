"""Concurrency sweep against a running orchestrator (tts-cli bench and bench/e2e.py)."""

from __future__ import annotations

import statistics
import threading
import time

import grpc

from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech starts playing before the sentence is finished.",
    "Please call me back at five thirty this afternoon.",
    "A small model can still speak clearly if it is trained well.",
    "Every millisecond of latency is accounted for in the report.",
    "The weather today is cool and bright with a light breeze.",
    "Turn left at the second light, then keep going for two miles.",
    "Good morning, and welcome to the demonstration.",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# the LatencyReport's parts of the first chunk (`first_chunk_<part>_ms`)
FIRST_CHUNK_PARTS = ("input", "vocoder", "compute")

# A listener's jitter buffer: playback starts this long after the first audio arrives. The
# report counts underruns with none; the capacity goal allows this much.
CLIENT_BUFFER_MS = 150.0


def one_request(
    stub, text: str, voice: str, seed: int, arrivals: list[tuple[float, float]] | None = None
) -> pb.LatencyReport:
    """One Synthesize call; `arrivals` collects (arrival time, seconds of audio) per chunk."""
    req = pb.SynthesizeRequest(text=text, voice=voice)
    req.sampling.seed = seed
    report = None
    for resp in stub.Synthesize(req, timeout=600):
        if resp.HasField("audio") and arrivals is not None:
            arrivals.append((time.perf_counter(), resp.audio.duration_s))
        if resp.HasField("report"):
            report = resp.report
    if report is None:
        raise RuntimeError("the stream ended without its LatencyReport")
    return report


def late_chunks(arrivals: list[tuple[float, float]], buffer_ms: float) -> int:
    """Chunks the client received after its listener had played everything before them, when
    playback starts `buffer_ms` after the first audio and then runs in real time: the report's
    underrun count, on the client's clock and with a jitter buffer."""
    if not arrivals:
        return 0
    start = arrivals[0][0] + buffer_ms / 1e3
    late, played = 0, 0.0
    for arrived, seconds in arrivals:
        late += arrived > start + played
        played += seconds
    return late


def run_level(
    address: str,
    concurrency: int,
    requests: int,
    voice: str = "",
    sentences: list[str] | None = None,
) -> dict:
    """`requests` syntheses, `concurrency` at a time; figures from the LatencyReports."""
    sentences = sentences or SENTENCES
    reports: list[pb.LatencyReport] = []
    arrivals: list[list[tuple[float, float]]] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))

    def worker() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    chunks: list[tuple[float, float]] = []
                    r = one_request(stub, sentences[i % len(sentences)], voice, i, chunks)
                    with lock:
                        reports.append(r)
                        arrivals.append(chunks)
                except grpc.RpcError as exc:
                    with lock:
                        errors.append(f"{exc.code().name}: {exc.details()}")

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ttfa = [r.ttfa_ms for r in reports]
    audio = sum(r.audio_s for r in reports)
    hops: dict[str, list[float]] = {h.service: [] for r in reports for h in r.hops}
    for r in reports:
        for h in r.hops:
            hops[h.service].append(h.mean_overhead_ms)
    return {
        "concurrency": concurrency,
        "requests": len(reports),
        "errors": errors,
        "ttfa_p50_ms": percentile(ttfa, 50),
        "ttfa_p95_ms": percentile(ttfa, 95),
        "ttfa_p99_ms": percentile(ttfa, 99),
        "ttft_p50_ms": percentile([r.ttft_ms for r in reports], 50),
        # where the median first audio went: its input sent to the vocoder, the vocoder's time
        **{
            f"first_chunk_{part}_p50_ms": percentile(
                [getattr(r, f"first_chunk_{part}_ms") for r in reports], 50
            )
            for part in FIRST_CHUNK_PARTS
        },
        "rtf_mean": statistics.fmean([r.rtf for r in reports]) if reports else 0.0,
        "rtf_max": max((r.rtf for r in reports), default=0.0),
        "underruns": sum(r.underruns for r in reports),
        # on the client's clock: with no jitter buffer, and with CLIENT_BUFFER_MS of one
        "underruns_client": sum(late_chunks(a, 0.0) for a in arrivals),
        "underruns_client_buffered": sum(late_chunks(a, CLIENT_BUFFER_MS) for a in arrivals),
        "audio_s_per_wall_s": audio / wall if wall else 0.0,
        "hop_overhead_ms": {k: statistics.fmean(v) for k, v in hops.items() if v},
        "wall_s": wall,
    }


def run_sweep(
    address: str, levels: list[int], requests_per_level: int = 8, voice: str = ""
) -> dict:
    """One warm-up request, then each concurrency level."""
    with grpc.insecure_channel(address) as channel:
        one_request(tts_pb2_grpc.TextToSpeechStub(channel), SENTENCES[0], voice, 0)
    return {"levels": [run_level(address, c, max(requests_per_level, c), voice) for c in levels]}


def sweep_table(result: dict) -> str:
    head = (
        f"{'conc':>4} {'reqs':>4} {'TTFA p50':>9} {'p95':>8} {'p99':>8} {'RTF':>6} "
        f"{'underruns':>9} {'audio s/s':>9} {'errors':>6}"
    )
    lines = [head, "-" * len(head)]
    for lv in result["levels"]:
        lines.append(
            f"{lv['concurrency']:>4} {lv['requests']:>4} {lv['ttfa_p50_ms']:>7.0f}ms "
            f"{lv['ttfa_p95_ms']:>6.0f}ms {lv['ttfa_p99_ms']:>6.0f}ms {lv['rtf_mean']:>6.3f} "
            f"{lv['underruns']:>9} {lv['audio_s_per_wall_s']:>9.2f} {len(lv['errors']):>6}"
        )
    return "\n".join(lines)
