"""CPU seconds each service spends per second of audio, with TTFA and RTF, at one concurrency.

CPU time moves far less than wall time when the machine is shared, so two checkouts can be
compared on one machine by running this from each in turn:

    python -m bench.e2e_cpu [--voice DIR] [--requests 8] [--concurrency 1]   # one JSON line

At a concurrency above 1 it also gives each service's share of the wall time in cores, which
at 8 streams says which stage takes the machine (the vocoder's forwards, the text service's
decode steps, or the orchestrator).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import grpc

from bench.e2e import ROOT, Deployment
from orchestrator.bench import SENTENCES, one_request, run_level
from splittts.tts.v1 import tts_pb2_grpc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--voice", default=str(ROOT / "voices" / "default"))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    args = p.parse_args()
    with Deployment(Path(args.voice), "split") as d, grpc.insecure_channel(d.address) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        for i in range(2):  # warm-up
            one_request(stub, SENTENCES[i], "", i)
        if args.concurrency > 1:
            run_level(d.address, args.concurrency, args.concurrency)  # warm every batch size
        before = [cpu_seconds(proc.proc.pid) for proc in d.procs]
        if args.concurrency == 1:
            reports = [
                one_request(stub, SENTENCES[i % len(SENTENCES)], "", i)
                for i in range(args.requests)
            ]
            level = None
        else:
            level = run_level(d.address, args.concurrency, args.requests)
        after = [cpu_seconds(proc.proc.pid) for proc in d.procs]
    names = ("text", "vocoder", "orchestrator")
    if level is None:
        audio = sum(r.audio_s for r in reports)
        out = {
            f"{name}_cpu_s_per_audio_s": round((a - b) / audio, 3)
            for name, a, b in zip(names, after, before)
        }
        out.update(
            audio_s=round(audio, 2),
            speech_tokens=sum(r.num_speech_tokens for r in reports),
            ttfa_p50_ms=round(statistics.median(r.ttfa_ms for r in reports), 1),
            rtf_mean=round(statistics.mean(r.rtf for r in reports), 3),
            chunks=sum(r.num_chunks for r in reports),
            underruns=sum(r.underruns for r in reports),
        )
    else:
        audio = level["audio_s_per_wall_s"] * level["wall_s"]
        out = {
            f"{name}_cpu_s_per_audio_s": round((a - b) / audio, 3)
            for name, a, b in zip(names, after, before)
        }
        out |= {
            f"{name}_cores": round((a - b) / level["wall_s"], 3)
            for name, a, b in zip(names, after, before)
        }
        out.update(
            concurrency=args.concurrency,
            audio_s=round(audio, 2),
            audio_s_per_wall_s=round(level["audio_s_per_wall_s"], 2),
            ttfa_p95_ms=round(level["ttfa_p95_ms"], 1),
            rtf_mean=round(level["rtf_mean"], 3),
            rtf_max=round(level["rtf_max"], 3),
            underruns_client_buffered=level["underruns_client_buffered"],
            errors=len(level["errors"]),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
