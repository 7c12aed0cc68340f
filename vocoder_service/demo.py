"""`make demo` (until the orchestrator lands): stream a bundled sentence through a real
vocoder-service process and write what comes back to a WAV file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import servicekit  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = ROOT / "assets" / "demo_sentence.wav"


def start_service(*args: str) -> tuple[subprocess.Popen, str]:
    """Start `vocoder-service` on free ports; returns the process and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "vocoder_service", "--port", "0",
                             "--metrics-port", "-1", *args], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "serving":
            return proc, f"{event['host']}:{event['port']}"
    raise RuntimeError(f"vocoder-service exited with {proc.wait()} before serving")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="out/demo.wav")
    p.add_argument("--input", default=str(SENTENCE), help="speech to re-synthesise (WAV)")
    p.add_argument("--chunk-frames", type=int, default=4, help="mel frames per message")
    args = p.parse_args(argv)

    import grpc
    import numpy as np
    import soundfile as sf
    import soxr

    from vocoder_service.checkpoint import resolve_checkpoint
    from vocoder_service.client import mel_requests, vocode
    from vocoder_service.mel import MelSpectrogram

    config = resolve_checkpoint().config
    audio, rate = sf.read(args.input, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if rate != config.sampling_rate:
        audio = soxr.resample(audio, rate, config.sampling_rate)
    mel = MelSpectrogram(config)(audio)[0].numpy()

    print(f"starting vocoder-service ...", flush=True)
    proc, address = start_service()
    try:
        with grpc.insecure_channel(address) as channel:
            sent = time.perf_counter()
            result = vocode(channel, mel_requests(mel, args.chunk_frames))
    finally:
        proc.terminate()
        proc.wait(30)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, result.audio, result.sample_rate, subtype="PCM_16")
    seconds = len(result.audio) / result.sample_rate
    wall = result.arrivals[-1] - sent
    print(f"wrote {out}: {seconds:.2f} s of audio in {len(result.chunks)} streamed chunks; "
          f"first audio after {1e3 * (result.arrivals[0] - sent):.0f} ms, RTF {wall / seconds:.2f}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
