"""CPU seconds each service spends per second of audio, with TTFA and RTF, at concurrency 1.

CPU time moves far less than wall time when the machine is shared, so two checkouts can be
compared on one machine by running this from each in turn:

    python -m bench.e2e_cpu [--voice DIR] [--requests 8]     # one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import grpc

from bench.e2e import ROOT, Deployment
from orchestrator.bench import SENTENCES, one_request
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
    args = p.parse_args()
    with Deployment(Path(args.voice), "split") as d, grpc.insecure_channel(d.address) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        for i in range(2):  # warm-up
            one_request(stub, SENTENCES[i], "", i)
        before = [cpu_seconds(proc.proc.pid) for proc in d.procs]
        reports = [
            one_request(stub, SENTENCES[i % len(SENTENCES)], "", i) for i in range(args.requests)
        ]
        after = [cpu_seconds(proc.proc.pid) for proc in d.procs]
    audio = sum(r.audio_s for r in reports)
    out = {
        f"{name}_cpu_s_per_audio_s": round((a - b) / audio, 3)
        for name, a, b in zip(("text", "vocoder", "orchestrator"), after, before)
    }
    out.update(
        audio_s=round(audio, 2),
        speech_tokens=sum(r.num_speech_tokens for r in reports),
        ttfa_p50_ms=round(statistics.median(r.ttfa_ms for r in reports), 1),
        rtf_mean=round(statistics.mean(r.rtf for r in reports), 3),
        chunks=sum(r.num_chunks for r in reports),
        underruns=sum(r.underruns for r in reports),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
