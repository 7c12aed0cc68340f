"""Time to first audio through OpenAI's `POST /v1/audio/speech` against the gRPC `Synthesize`
API of the same deployment, measured the same way on the client side for both.

A fresh split deployment of the voice (bench/e2e.py `Deployment`, its HTTP port on) serves its
first request through /v1 (pcm), timed against the next five (each text new to it, as the first
was); a second fresh deployment does the same through gRPC. Then, on a third, at concurrency 1,
N pairs: the same sentence through both APIs back to back (which one goes first alternates;
every sentence was spoken once before timing, so both find the same caches), in pcm and in mp3,
both asking for 24 kHz, as /v1 does. The default voice decodes greedily, so no seed is needed
for both APIs to produce the same audio. TTFA here is the client's clock from sending the request
to the first audio byte received (a persistent HTTP/1.1 connection and a persistent gRPC
channel), so the /v1 figure includes the HTTP relay and the gRPC figure does not. Last, the
relay alone: the same pairs against a servicer that answers at once (no pipeline, so no noise
from it), /v1 on a WebDemo in this process.

    python -m bench.openai_api --quick      # 6 pairs per format, a few minutes
    python -m bench.openai_api --json       # 20 pairs per format, one JSON object on stdout
    python -m bench.openai_api --pairs 0 --cold-runs 3   # only first requests, 3 fresh each
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.e2e import Deployment, pick_voice  # noqa: E402
from bench.workload import machine_load, percentile  # noqa: E402
from orchestrator.bench import SENTENCES  # noqa: E402

FORMATS = ("pcm", "mp3")
RATE_HZ = 24000  # what /v1 always sends; the gRPC requests ask for it too
REPEATS = 5  # later requests the first one is compared with
REPORT_FIELDS = (
    "ttfa_ms",
    "frontend_ms",
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "vocoder_compute_ms",
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class GrpcClient:
    """Synthesize over one persistent channel; TTFA from the call to the first audio bytes."""

    def __init__(self, address: str):
        import grpc

        from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        self.stub = tts_pb2_grpc.TextToSpeechStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.report = None  # the last call's LatencyReport (the server's own clock)

    def ttfa_ms(self, text: str, fmt: str) -> float:
        pb = self.pb
        encoding = {"pcm": pb.LINEAR16, "mp3": pb.MP3}[fmt]
        req = pb.SynthesizeRequest(
            text=text, audio_config=pb.AudioConfig(encoding=encoding, sample_rate_hz=RATE_HZ)
        )
        first = None
        started = time.perf_counter()
        for resp in self.stub.Synthesize(req, timeout=600):
            if first is None and resp.HasField("audio") and resp.audio.audio:
                first = time.perf_counter()
            if resp.HasField("report"):
                self.report = resp.report
        if first is None:
            raise RuntimeError(f"gRPC {fmt}: no audio for {text!r}")
        return 1e3 * (first - started)

    def close(self) -> None:
        self.channel.close()


class HttpClient:
    """POST /v1/audio/speech over one keep-alive connection; TTFA to the first body byte."""

    def __init__(self, port: int, voice: str):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.conn.connect()  # as the gRPC channel is connected first: only requests are timed
        self.voice = voice

    def ttfa_ms(self, text: str, fmt: str) -> float:
        body = json.dumps(
            {"model": "tts-1", "voice": self.voice, "input": text, "response_format": fmt}
        )
        started = time.perf_counter()
        self.conn.request(
            "POST", "/v1/audio/speech", body=body, headers={"Content-Type": "application/json"}
        )
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/v1 {fmt}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first = None
        while resp.read1(65536):
            if first is None:
                first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"/v1 {fmt}: no audio for {text!r}")
        return 1e3 * (first - started)

    def close(self) -> None:
        self.conn.close()


def relay_only(n: int = 200) -> dict:
    """The relay's own cost, without the pipeline's noise: a servicer that answers at once,
    reached directly over gRPC and through /v1 of a WebDemo in the same process, in pairs."""
    import asyncio
    import threading

    import grpc

    from orchestrator.web import WebDemo
    from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

    class Instant(tts_pb2_grpc.TextToSpeechServicer):
        async def Synthesize(self, request, context):
            yield pb.SynthesizeResponse(audio=pb.AudioChunk(audio=bytes(4800)))
            yield pb.SynthesizeResponse(report=pb.LatencyReport())

    ports: dict = {}
    ready = threading.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        tts_pb2_grpc.add_TextToSpeechServicer_to_server(Instant(), server)
        ports["grpc"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports["http"] = await WebDemo(f"127.0.0.1:{ports['grpc']}").start("127.0.0.1", 0)
        ready.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True).start()
    ready.wait(30)
    grpc_client = GrpcClient(f"127.0.0.1:{ports['grpc']}")
    http_client = HttpClient(ports["http"], "default")
    times: dict = {"grpc": [], "v1": []}
    for i in range(20 + n):  # the first 20 untimed
        g, v = grpc_client.ttfa_ms("hi", "pcm"), http_client.ttfa_ms("hi", "pcm")
        if i >= 20:
            times["grpc"].append(g)
            times["v1"].append(v)
    grpc_client.close()
    http_client.close()
    diffs = [b - a for a, b in zip(times["grpc"], times["v1"])]
    out = {
        "grpc": summary(times["grpc"]),
        "v1": summary(times["v1"]),
        "v1_minus_grpc_median_ms": round(statistics.median(diffs), 3),
    }
    log(
        f"relay alone: gRPC p50 {out['grpc']['p50_ms']} ms, /v1 p50 {out['v1']['p50_ms']} ms, "
        f"median per-pair difference {out['v1_minus_grpc_median_ms']} ms"
    )
    return out


def voice_name(voice_dir: Path) -> str:
    return json.loads((voice_dir / "voice.json").read_text())["name"]


def summary(values: list[float]) -> dict:
    return {
        "p50_ms": round(percentile(values, 50), 2),
        "p95_ms": round(percentile(values, 95), 2),
        "n": len(values),
    }


def cold_start(voice_dir: Path, api: str) -> dict:
    """A fresh deployment's first request (through `api`, pcm) against the next REPEATS; each
    text is new to the deployment (a repeated one would hit the G2P's cache and the text
    service's prefix cache). Through gRPC also the stages of the server's own reports."""
    client_ms, server = [], []
    with Deployment(voice_dir, "split", http=True) as d:
        client = (
            HttpClient(d.http_port, voice_name(voice_dir)) if api == "v1" else GrpcClient(d.address)
        )
        try:
            for text in SENTENCES[: 1 + REPEATS]:
                client_ms.append(client.ttfa_ms(text, "pcm"))
                if api == "grpc":
                    server.append({k: getattr(client.report, k) for k in REPORT_FIELDS})
        finally:
            client.close()
    first, later = client_ms[0], client_ms[1:]
    median = statistics.median(later)
    out = {
        "first_ms": round(first, 2),
        "later_median_ms": round(median, 2),
        "first_minus_later_ms": round(first - median, 2),
        "later_ms": [round(x, 2) for x in later],
    }
    if server:  # first / median of later, each stage of the server's report
        out["report_first_vs_later_ms"] = {
            k: [round(server[0][k], 2), round(statistics.median(r[k] for r in server[1:]), 2)]
            for k in REPORT_FIELDS
        }
    log(
        f"{api}: first request {first:.1f} ms, later ones {median:.1f} ms (median of {REPEATS})"
        + (f"; server report, first / later: {out['report_first_vs_later_ms']}" if server else "")
    )
    return out


def pairs(voice_dir: Path, n: int) -> dict:
    """`n` pairs per format at concurrency 1, the two APIs back to back in alternating order."""
    out = {}
    with Deployment(voice_dir, "split", http=True) as d:
        grpc_client, http_client = (
            GrpcClient(d.address),
            HttpClient(d.http_port, voice_name(voice_dir)),
        )
        clients = {"grpc": grpc_client.ttfa_ms, "v1": http_client.ttfa_ms}
        try:
            # untimed: every sentence once, so that every timed request finds it in the G2P's
            # and the text service's prefix caches (else the first of a pair would pay for both),
            # and each API and format once
            for text in SENTENCES:
                grpc_client.ttfa_ms(text, "pcm")
            for fmt in FORMATS:
                grpc_client.ttfa_ms(SENTENCES[0], fmt)
                http_client.ttfa_ms(SENTENCES[0], fmt)
            times = {(api, fmt): [] for api in clients for fmt in FORMATS}
            for i in range(n):
                text = SENTENCES[i % len(SENTENCES)]
                for fmt in FORMATS:
                    order = ("grpc", "v1") if i % 2 == 0 else ("v1", "grpc")
                    for api in order:
                        times[api, fmt].append(clients[api](text, fmt))
        finally:
            grpc_client.close()
            http_client.close()
    for fmt in FORMATS:
        g, v = times["grpc", fmt], times["v1", fmt]
        diffs = [b - a for a, b in zip(g, v)]
        out[fmt] = {
            "grpc": summary(g),
            "v1": summary(v),
            "v1_minus_grpc_median_ms": round(statistics.median(diffs), 2),
            "v1_minus_grpc_p95_ms": round(percentile(diffs, 95), 2),
        }
        log(
            f"{fmt}: gRPC p50 {out[fmt]['grpc']['p50_ms']} ms, /v1 p50 {out[fmt]['v1']['p50_ms']} "
            f"ms, median per-pair difference {out[fmt]['v1_minus_grpc_median_ms']} ms"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pairs",
        type=int,
        help="pairs per format (default 20, 6 with --quick; 0: only the first requests)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--voice", help="voice directory (default: voices/default)")
    p.add_argument(
        "--cold-runs",
        type=int,
        default=1,
        help="fresh deployments per API for the first-request figures (medians over "
        "them; 0 skips them)",
    )
    args = p.parse_args()
    n = args.pairs if args.pairs is not None else (6 if args.quick else 20)
    if args.cold_runs < 0:
        p.error(f"--cold-runs: must be >= 0 (got {args.cold_runs})")
    if n < 0:
        p.error(f"--pairs: must be >= 0 (got {n}; 0 runs only the first-request deployments)")
    voice_dir, voice_kind = pick_voice(args.voice)
    # the client is not under test: keep it off the vocoder's core, as bench/e2e.py does
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {0})
    out: dict = {
        "voice": str(voice_dir),
        "voice_kind": voice_kind,
        "pairs": n,
        "sample_rate_hz": RATE_HZ,
        "machine_load_start": machine_load(),
    }
    started = time.perf_counter()
    if args.cold_runs:
        runs = {
            api: [cold_start(voice_dir, api) for _ in range(args.cold_runs)]
            for api in ("v1", "grpc")
        }
        out["first_request"] = {
            api: {
                "first_ms": round(statistics.median(r["first_ms"] for r in rs), 2),
                "later_median_ms": round(statistics.median(r["later_median_ms"] for r in rs), 2),
                "runs": rs,
            }
            for api, rs in runs.items()
        }
    if n:
        out["formats"] = pairs(voice_dir, n)
    # last: its in-process gRPC server would otherwise be running when the deployments fork
    out["relay_only"] = relay_only()
    out["machine_load_end"] = machine_load()
    out["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"voice: {voice_kind} ({voice_dir}); {n} pairs per format, concurrency 1")
    for fmt, r in out.get("formats", {}).items():
        print(
            f"  {fmt}: gRPC p50/p95 {r['grpc']['p50_ms']:.1f}/{r['grpc']['p95_ms']:.1f} ms, "
            f"/v1 {r['v1']['p50_ms']:.1f}/{r['v1']['p95_ms']:.1f} ms, "
            f"/v1 - gRPC per pair: median {r['v1_minus_grpc_median_ms']:.1f} ms"
        )
    r = out["relay_only"]
    print(
        f"  relay alone (a servicer that answers at once): gRPC p50 {r['grpc']['p50_ms']:.2f} ms, "
        f"/v1 {r['v1']['p50_ms']:.2f} ms, per pair: median {r['v1_minus_grpc_median_ms']:.2f} ms"
    )
    for api, r in out.get("first_request", {}).items():
        print(
            f"  first request via {api}: {r['first_ms']:.1f} ms, later ones {r['later_median_ms']:.1f}"
            f" ms (medians over {len(r['runs'])} fresh deployment(s), {REPEATS} later each)"
        )
    print(f"  machine load {out['machine_load_start']} -> {out['machine_load_end']}")
    print("goals: /v1 - gRPC median <= 10 ms; the first request as fast as later ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
