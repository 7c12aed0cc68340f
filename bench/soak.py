"""Soak and fault checks over a real split deployment of the default voice: two replicas each
of the text and vocoder services and one orchestrator, all processes on 127.0.0.1.

1. cancels: random cancels at concurrency 8 (before the first audio, mid-stream, near the end,
   short deadlines; Synthesize and StreamingSynthesize), then every cache and stream gauge
   once idle: all must be 0;
2. soak: 32 streams synthesising sentences for --soak-s; errors by status, each process's RSS
   every 2 s (start, middle, end, slope over the second half);
3. faults: kill -9 of a text replica mid-stream, then of a vocoder replica: the caller's
   UNAVAILABLE must come within 1 s of the kill, new calls go to the survivor, and the killed
   replica, restarted on its port, serves again with the same orchestrator.

    python -m bench.soak --json      # 7 minutes on a busy 2-core machine, most of it the cancels
    python -m bench.soak --quick     # 40 cancels, a 20 s soak

Exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.bench import SENTENCES  # noqa: E402
from orchestrator.launcher import Process, start_service  # noqa: E402
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc  # noqa: E402
from tests.procs import rss_bytes, scrape, wait_until  # noqa: E402

TEXT_GAUGES = (
    "splittts_text_num_used_kv_blocks",
    "splittts_text_num_used_state_slots",
    "splittts_text_num_requests_running",
    "splittts_text_num_requests_waiting",
    "splittts_text_num_requests_paused",
)
VOCODER_GAUGES = ("splittts_vocoder_active_streams", "splittts_vocoder_audio_ahead_seconds")
ORCH_GAUGES = ("splittts_tts_requests_in_flight",)
LONG_TEXT = " ".join(SENTENCES)  # about 25 s of audio: still streaming when a replica dies


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Cluster:
    """text-a, text-b, voc-a, voc-b and an orchestrator over all four."""

    def __init__(self, voice_dir: Path):
        self.voice_dir = voice_dir
        self.procs: dict[str, Process] = {}

    def start_backend(self, name: str, port: int = 0) -> Process:
        if name.startswith("text"):
            args = [
                "--model",
                str(self.voice_dir / "lm"),
                "--threads",
                "1",
                "--kv-cache-memory",
                "256MiB",
            ]
            module = "text_service"
        else:
            args, module = ["--voice", str(self.voice_dir), "--threads", "1"], "vocoder_service"
        self.procs[name] = start_service(name, module, args, port=port, metrics_port=0)
        return self.procs[name]

    def __enter__(self) -> Cluster:
        try:
            for name in ("text-a", "text-b", "voc-a", "voc-b"):
                self.start_backend(name)
            p = self.procs
            self.procs["orch"] = start_service(
                "orch",
                "orchestrator",
                [
                    "--voice",
                    str(self.voice_dir),
                    "--http-port",
                    "-1",
                    "--text-service",
                    p["text-a"].address,
                    "--text-service",
                    p["text-b"].address,
                    "--vocoder-service",
                    p["voc-a"].address,
                    "--vocoder-service",
                    p["voc-b"].address,
                ],
                metrics_port=0,
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in self.procs.values():
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:  # stuck in its drain
                p.proc.kill()
                p.proc.wait()

    @property
    def address(self) -> str:
        return self.procs["orch"].address

    def gauges(self) -> dict[str, dict[str, float]]:
        """Every cache, queue and stream gauge that a finished or cancelled call must return to 0."""
        out = {}
        for name, p in self.procs.items():
            names = (
                TEXT_GAUGES
                if name.startswith("text")
                else VOCODER_GAUGES
                if name.startswith("voc")
                else ORCH_GAUGES
            )
            out[name] = {g.removeprefix("splittts_"): round(scrape(p, g), 6) for g in names}
        return out


def leftovers(cluster: Cluster, timeout: float = 30.0) -> dict:
    """The gauges once they are all 0 (or after `timeout`), and how long that took."""
    started = time.monotonic()
    wait_until(
        lambda: not any(v for g in cluster.gauges().values() for v in g.values()),
        timeout=timeout,
        interval=0.5,
    )
    gauges = cluster.gauges()
    return {
        "gauges": gauges,
        "settle_s": round(time.monotonic() - started, 2),
        "nonzero": sum(1 for g in gauges.values() for v in g.values() if v),
    }


def request(i: int, seed: int | None = None) -> pb.SynthesizeRequest:
    req = pb.SynthesizeRequest(text=SENTENCES[i % len(SENTENCES)])
    req.sampling.seed = i if seed is None else seed
    return req


def streamed(req: pb.SynthesizeRequest, rng: random.Random):
    """The same request as StreamingSynthesize: config, then the text in word pieces."""
    config = pb.StreamingSynthesizeConfig(sampling=req.sampling)
    words = req.text.split(" ")
    pause = rng.uniform(0.0, 0.03)

    def pieces():
        yield pb.StreamingSynthesizeRequest(config=config)
        for k, word in enumerate(words):
            time.sleep(pause)
            yield pb.StreamingSynthesizeRequest(text=word + (" " if k < len(words) - 1 else ""))

    return pieces()


def one_cancel(stub, rng: random.Random, audio_s: list[float]) -> tuple[str, str]:
    """A call cancelled at a random point; (where, status it ended with)."""
    i = rng.randrange(len(SENTENCES))
    req = request(i)
    where = rng.choice(("before_audio", "mid_stream", "near_end", "deadline"))
    timeout = rng.uniform(0.05, 1.5) if where == "deadline" else 300.0
    streaming = rng.random() < 0.3
    call = (
        stub.StreamingSynthesize(streamed(req, rng), timeout=timeout)
        if streaming
        else stub.Synthesize(req, timeout=timeout)
    )
    stop_at = {"mid_stream": rng.uniform(0.05, 0.6), "near_end": rng.uniform(0.8, 0.99)}.get(where)
    try:
        if where == "before_audio":
            time.sleep(rng.uniform(0.0, 0.1))
            call.cancel()
        got = 0.0
        for resp in call:
            if resp.HasField("audio"):
                got += resp.audio.duration_s
                if stop_at is not None and got >= stop_at * audio_s[i]:
                    call.cancel()
        return where, "OK"
    except grpc.RpcError as exc:
        return where, exc.code().name


def run_cancels(cluster: Cluster, n: int, concurrency: int, seed: int) -> dict:
    audio_s = [0.0] * len(SENTENCES)  # each sentence's length (same seed), to cancel near its end

    def measure(i: int) -> None:
        with grpc.insecure_channel(cluster.address) as ch:
            stub = tts_pb2_grpc.TextToSpeechStub(ch)
            audio_s[i] = list(stub.Synthesize(request(i), timeout=300))[-1].report.audio_s

    measuring = [threading.Thread(target=measure, args=(i,)) for i in range(len(SENTENCES))]
    for t in measuring:
        t.start()
    for t in measuring:
        t.join()
    outcomes: Counter = Counter()
    lock, left = threading.Lock(), iter(range(n))

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        with grpc.insecure_channel(cluster.address) as ch:
            stub = tts_pb2_grpc.TextToSpeechStub(ch)
            while True:
                with lock:
                    if next(left, None) is None:
                        return
                where, code = one_cancel(stub, rng, audio_s)
                with lock:
                    outcomes[f"{where}:{code}"] += 1

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = {"CANCELLED", "DEADLINE_EXCEEDED", "OK"}
    return {
        "calls": n,
        "concurrency": concurrency,
        "wall_s": round(time.monotonic() - started, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "unexpected": sum(v for k, v in outcomes.items() if k.split(":")[1] not in expected),
        "after": leftovers(cluster),
    }


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes) samples, in MiB per minute."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt, mb = sum(t for t, _ in samples) / n, sum(b for _, b in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if var == 0 else sum((t - mt) * (b - mb) for t, b in samples) / var * 60 / 2**20


def run_soak(cluster: Cluster, streams: int, seconds: float) -> dict:
    errors: Counter = Counter()
    done, audio = [0], [0.0]
    lock, stop, all_done = threading.Lock(), threading.Event(), threading.Event()
    rss: dict[str, list[tuple[float, float]]] = {name: [] for name in cluster.procs}
    started = time.monotonic()

    def worker(k: int) -> None:
        with grpc.insecure_channel(cluster.address) as ch:
            stub = tts_pb2_grpc.TextToSpeechStub(ch)
            i = k
            while not stop.is_set():
                try:
                    got = sum(r.audio.duration_s for r in stub.Synthesize(request(i), timeout=300))
                    with lock:
                        done[0] += 1
                        audio[0] += got
                except grpc.RpcError as exc:
                    with lock:
                        errors[exc.code().name] += 1
                i += streams

    def sample() -> None:
        while not all_done.wait(2.0 - (time.monotonic() - started) % 2.0):
            for name, p in cluster.procs.items():
                rss[name].append((time.monotonic() - started, rss_bytes(p.proc.pid)))

    for name, p in cluster.procs.items():
        rss[name].append((0.0, rss_bytes(p.proc.pid)))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    sampler = threading.Thread(target=sample)
    for t in [*threads, sampler]:
        t.start()
    stop.wait(seconds)
    stop.set()  # calls in flight finish; none starts
    for t in threads:
        t.join()
    all_done.set()
    sampler.join()
    for name, p in cluster.procs.items():
        rss[name].append((time.monotonic() - started, rss_bytes(p.proc.pid)))
    span = time.monotonic() - started  # memory over the whole phase: load lasts until here

    def mib(b: float) -> float:
        return round(b / 2**20, 1)

    memory = {}
    for name, s in rss.items():
        mid = min(s, key=lambda x: abs(x[0] - span / 2))
        memory[name] = {
            "start_mib": mib(s[0][1]),
            "middle_mib": mib(mid[1]),
            "end_mib": mib(s[-1][1]),
            "slope_second_half_mib_per_min": round(
                slope_mib_per_min([x for x in s if x[0] >= span / 2]), 2
            ),
        }
    return {
        "streams": streams,
        "seconds": seconds,
        "wall_s": round(span, 1),
        "completed": done[0],
        "audio_s": round(audio[0], 1),
        "errors": dict(errors),
        "error_count": sum(errors.values()),
        "rss": memory,
        "after": leftovers(cluster),
    }


class LongCall:
    """A Synthesize of LONG_TEXT read as fast as it comes, on its own thread."""

    def __init__(self, address: str):
        self.first = threading.Event()
        self.code, self.details, self.failed_at = "OK", "", None
        self.thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self.thread.start()

    def _run(self, address: str) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                for _ in tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text=LONG_TEXT), timeout=300
                ):
                    self.first.set()
        except grpc.RpcError as exc:
            self.failed_at = time.monotonic()
            self.code, self.details = exc.code().name, exc.details()
        finally:
            self.first.set()


def served_by(address: str, service: str) -> str | None:
    """One short call; the replica of `service` that served it (None if the call failed)."""
    try:
        with grpc.insecure_channel(address) as ch:
            report = list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text="Yes."), timeout=120
                )
            )[-1].report
        return next(h.address for h in report.hops if h.service == service)
    except grpc.RpcError:
        return None


def kill_and_recover(cluster: Cluster, kind: str) -> dict:
    service, names = (
        ("text", ("text-a", "text-b")) if kind == "text" else ("vocoder", ("voc-a", "voc-b"))
    )
    gauge = (
        "splittts_text_num_requests_running"
        if kind == "text"
        else "splittts_vocoder_active_streams"
    )
    call = LongCall(cluster.address)
    call.first.wait(120)

    def busy() -> list[str]:
        return [n for n in names if scrape(cluster.procs[n], gauge) >= 1]

    wait_until(lambda: bool(busy()), timeout=30, interval=0.05)
    on = busy()
    if not on or call.code != "OK":
        return {
            "ok": False,
            "why": f"no call in flight on a {kind} replica ({call.code} {call.details})",
        }
    victim = cluster.procs[on[0]]
    survivor = cluster.procs[next(n for n in names if n != on[0])]
    killed_at = time.monotonic()
    victim.proc.kill()
    call.thread.join(60)
    victim.proc.wait()
    out: dict = {
        "killed": victim.name,
        "caller_status": call.code,
        "caller_details": call.details,
        "kill_to_error_s": round(call.failed_at - killed_at, 3) if call.failed_at else None,
    }
    after = [served_by(cluster.address, service) for _ in range(4)]
    out["calls_after_kill_on_survivor"] = sum(a == survivor.address for a in after)
    out["calls_after_kill"] = len(after)
    restarted_at = time.monotonic()
    fresh = cluster.start_backend(victim.name, port=victim.port)
    serving_at = time.monotonic()
    out["restart_to_serving_s"] = round(serving_at - restarted_at, 2)
    first_success: list[float] = []

    def pair_reaches_restarted() -> bool:  # two at once: the idle replica gets one of them
        hits: list[str | None] = []
        ts = [
            threading.Thread(target=lambda: hits.append(served_by(cluster.address, service)))
            for _ in range(2)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if fresh.address in hits:
            first_success.append(time.monotonic())
        return bool(first_success)

    wait_until(pair_reaches_restarted, timeout=60, interval=0.1)
    out["serving_to_first_success_s"] = (
        round(first_success[0] - serving_at, 2) if first_success else None
    )
    out["ok"] = (
        call.code == "UNAVAILABLE"
        and out["kill_to_error_s"] is not None
        and out["kill_to_error_s"] <= 1.0
        and all(a == survivor.address for a in after)
        and bool(first_success)
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--quick", action="store_true", help="40 cancels and a 20 s soak")
    p.add_argument("--voice", default=str(ROOT / "voices" / "default"))
    p.add_argument("--cancels", type=int, default=None, help="default 200 (40 with --quick)")
    p.add_argument("--soak-s", type=float, default=None, help="default 60 (20 with --quick)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cancels = args.cancels if args.cancels is not None else (40 if args.quick else 200)
    soak_s = args.soak_s if args.soak_s is not None else (20.0 if args.quick else 60.0)
    with open("/proc/pressure/cpu") as f:
        out: dict = {
            "voice": args.voice,
            "cpus": os.cpu_count(),
            "pressure_cpu_before": f.read().strip(),
        }
    started = time.monotonic()
    log("starting 2 text + 2 vocoder replicas and the orchestrator")
    with Cluster(Path(args.voice)) as cluster:
        out["startup_s"] = round(time.monotonic() - started, 1)
        log(f"{cancels} random cancels at concurrency 8")
        out["cancels"] = run_cancels(cluster, cancels, 8, args.seed)
        log(f"{args.streams} streams for {soak_s:.0f} s")
        out["soak"] = run_soak(cluster, args.streams, soak_s)
        for kind in ("text", "vocoder"):
            log(f"kill -9 of a {kind} replica mid-stream")
            out[f"kill_{kind}"] = kill_and_recover(cluster, kind)
        out["after_faults"] = leftovers(cluster)
    with open("/proc/pressure/cpu") as f:
        out["pressure_cpu_after"] = f.read().strip()
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["checks"] = {
        "no_leaks_after_cancels": out["cancels"]["after"]["nonzero"] == 0,
        "no_unexpected_status_in_cancels": out["cancels"]["unexpected"] == 0,
        "no_errors_in_soak": out["soak"]["error_count"] == 0,
        "no_leaks_after_soak": out["soak"]["after"]["nonzero"] == 0,
        "text_kill_and_recovery": out["kill_text"]["ok"],
        "vocoder_kill_and_recovery": out["kill_vocoder"]["ok"],
    }
    ok = all(out["checks"].values())
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    log(
        "all checks passed"
        if ok
        else "FAILED: " + ", ".join(k for k, v in out["checks"].items() if not v)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
