"""Vocoder throughput and latency: torch eager vs ONNX Runtime, streamed vs offline, batching.

All figures come from one run on one input (espeak-ng speech when installed, else a voiced
harmonic signal), with the pretrained universal HiFi-GAN:
- offline throughput (audio s per wall s) of each backend, and `ort_vs_torch`;
- `stream_overhead`: wall time of the chunked stream (input pushed two frames at a time, one
  43 Hz token's worth) over one offline forward, same backend;
- `first_audio_ms`: from the arrival of the input that makes a stream's first chunk ready
  (its frames and right context) to its audio leaving the chunker + backend;
- the same two for stateful streaming (`_stateful`: new frames only, each layer's tail carried
  in the stream's state), and `stateful_vs_windowed_stream` (windowed wall / stateful wall);
- throughput of 1, 4 and 8 concurrent streams: windowed jobs batched into shared forwards,
  stateful ones run one after another.
Repetitions alternate the variants so drifting machine load hits them alike; medians reported.

    python -m bench.vocoder [--quick] [--json] [--threads 2] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from servicekit.memory import keep_onednn_primitives, retain_freed_memory
from vocoder_service.backends import Backend, OnnxBackend, TorchBackend
from vocoder_service.checkpoint import resolve_checkpoint
from vocoder_service.chunking import ChunkPolicy
from vocoder_service.jobs import vocode_jobs
from vocoder_service.mel import MelSpectrogram
from vocoder_service.stream import VocoderStream

GOALS = {
    "ort_vs_torch": (">=", 1.5),
    "stream_overhead": ("<=", 1.3),
    "first_audio_ms": ("<=", 100.0),
}
TEXT = (
    "Streaming speech synthesis sends the first audio while the rest of the sentence is still "
    "being written, so every millisecond counts."
)
PUSH_FRAMES = 2  # one 43 Hz speech token of stacked frame pairs


def input_mel(config, seconds: float) -> tuple[np.ndarray, str]:
    """Log-mel `[num_mels, frames]` of about `seconds` of speech-like audio."""
    sr = config.sampling_rate
    audio, source = None, "harmonic"
    if shutil.which("espeak-ng"):
        with tempfile.TemporaryDirectory() as tmp:
            wav = Path(tmp) / "s.wav"
            subprocess.run(
                ["espeak-ng", "-v", "en-us", "-w", str(wav), TEXT], check=True, capture_output=True
            )
            import soundfile as sf

            audio, got = sf.read(wav, dtype="float32")
            if got == sr:
                source = "espeak-ng"
                audio = np.tile(audio, int(np.ceil(seconds * sr / len(audio))))[: int(seconds * sr)]
            else:
                audio = None
    if audio is None:
        t = np.arange(int(seconds * sr)) / sr
        f0 = 120 * (1 + 0.4 * np.sin(2 * np.pi * 0.7 * t))
        phase = 2 * np.pi * np.cumsum(f0) / sr
        audio = sum(np.sin(k * phase) / k * (k * f0 < 5000) for k in range(1, 40))
        audio = 0.3 * audio * (0.55 + 0.45 * np.sin(2 * np.pi * 3 * t)) / np.abs(audio).max()
    return MelSpectrogram(config)(audio)[0].numpy(), source


class _Counted:
    """Counts the forwards `vocode_jobs` makes."""

    def __init__(self, backend: Backend):
        self.backend, self.calls, self.frames = backend, 0, 0
        self.hop_size, self.num_mels = backend.hop_size, backend.num_mels

    def run(self, mel: np.ndarray) -> np.ndarray:
        self.calls += 1
        self.frames += mel.shape[0] * mel.shape[2]
        return self.backend.run(mel)

    def run_stream(self, mel: np.ndarray, state, final: bool = False):
        self.calls += 1
        self.frames += mel.shape[2]
        return self.backend.run_stream(mel, state, final)


def offline(backend: Backend, mel: np.ndarray) -> float:
    t = time.perf_counter()
    backend.run(mel[None])
    return time.perf_counter() - t


def streamed(
    backend: Backend, mel: np.ndarray, policy: ChunkPolicy, stateful: bool = False
) -> tuple[float, float, int]:
    """(wall seconds for the whole stream, first-audio ms, mel frames vocoded incl. context)."""
    stream = VocoderStream(backend.config, policy=policy, stateful=stateful)
    backend = _Counted(backend)
    first_ms = None
    t0 = time.perf_counter()
    for lo in range(0, mel.shape[1], PUSH_FRAMES):
        stream.push_mel(mel[:, lo : lo + PUSH_FRAMES])
        for chunk in stream.step(backend):
            if first_ms is None:
                first_ms = (time.perf_counter() - chunk.ready_at) * 1e3
    stream.flush()
    stream.step(backend)
    return time.perf_counter() - t0, first_ms, backend.frames


def concurrent(
    backend: Backend, mel: np.ndarray, policy: ChunkPolicy, n: int, stateful: bool = False
) -> tuple[float, int]:
    """(wall seconds, forwards) for n streams of the same input arriving together: windowed
    jobs batched, stateful ones one after another."""
    streams = [VocoderStream(backend.config, policy=policy, stateful=stateful) for _ in range(n)]
    counted = _Counted(backend)
    t0 = time.perf_counter()
    for lo in range(0, mel.shape[1] + PUSH_FRAMES, PUSH_FRAMES):
        for s in streams:
            if lo < mel.shape[1]:
                s.push_mel(mel[:, lo : lo + PUSH_FRAMES])
            else:
                s.flush()
        jobs = [j for s in streams for j in s.ready()]
        for job, audio in zip(jobs, vocode_jobs(counted, jobs)):
            job.stream.complete(job, audio)
    assert all(s.done for s in streams)
    return time.perf_counter() - t0, counted.calls


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads and ORT intra-op threads"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="input length in seconds (default 5)"
    )
    parser.add_argument("--first-chunk", type=int, default=ChunkPolicy.first_chunk_frames)
    parser.add_argument("--growth", type=float, default=ChunkPolicy.growth)
    parser.add_argument("--cap", type=int, default=ChunkPolicy.max_chunk_frames)
    parser.add_argument(
        "--no-spin", action="store_true", help="ORT workers sleep instead of spinning"
    )
    parser.add_argument(
        "--cache-dir", default=None, help="ONNX cache (default $SPLITTTS_CACHE/onnx)"
    )
    args = parser.parse_args(argv)
    seconds = args.seconds or 5.0
    reps = 3 if args.quick else 5
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as vocoder-service does: torch is not timed paying page faults
    keep_onednn_primitives()
    policy = ChunkPolicy(args.first_chunk, args.growth, args.cap)

    ckpt = resolve_checkpoint()
    t = time.perf_counter()
    backends = {
        "torch": TorchBackend(ckpt),
        "ort": OnnxBackend(
            ckpt,
            cache_dir=args.cache_dir,
            intra_op_threads=args.threads,
            allow_spinning=not args.no_spin,
        ),
    }
    setup_s = time.perf_counter() - t
    mel, source = input_mel(ckpt.config, seconds)
    audio_s = mel.shape[1] * ckpt.config.hop_size / ckpt.config.sampling_rate
    for b in backends.values():
        b.warmup(mel.shape[1], stateful=True)
        streamed(b, mel[:, :40], policy)

    off = {k: [] for k in backends}
    st = {k: [] for k in backends}
    first = {k: [] for k in backends}
    st_stateful, first_stateful = [], []
    for _ in range(reps):
        for k, b in backends.items():  # alternate so load drift hits both alike
            off[k].append(offline(b, mel))
            wall, ms, window_frames = streamed(b, mel, policy)
            st[k].append(wall)
            first[k].append(ms)
        wall, ms, stateful_frames = streamed(backends["ort"], mel, policy, stateful=True)
        st_stateful.append(wall)
        first_stateful.append(ms)
    med = statistics.median
    conc, conc_stateful = {}, {}
    for n in (1, 4, 8):
        wall, forwards = concurrent(backends["ort"], mel, policy, n)
        conc[n] = {"audio_s_per_s": round(n * audio_s / wall, 2), "forwards": forwards}
        wall, _ = concurrent(backends["ort"], mel, policy, n, stateful=True)
        conc_stateful[n] = round(n * audio_s / wall, 2)

    result = {
        "input": {"source": source, "frames": int(mel.shape[1]), "audio_s": round(audio_s, 2)},
        "threads": args.threads,
        "ort_spinning": not args.no_spin,
        "policy": {
            "first_chunk_frames": policy.first_chunk_frames,
            "growth": policy.growth,
            "max_chunk_frames": policy.max_chunk_frames,
        },
        "receptive_field_frames": list(ckpt.config.receptive_field),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "setup_s": round(setup_s, 2),
        "offline_audio_s_per_s": {k: round(audio_s / med(v), 2) for k, v in off.items()},
        "ort_vs_torch": round(med(off["torch"]) / med(off["ort"]), 3),
        "stream_overhead": round(med(st["ort"]) / med(off["ort"]), 3),
        "stream_window_frames_ratio": round(window_frames / mel.shape[1], 3),
        "stream_overhead_torch": round(med(st["torch"]) / med(off["torch"]), 3),
        "stream_overhead_stateful": round(med(st_stateful) / med(off["ort"]), 3),
        "stateful_vs_windowed_stream": round(med(st["ort"]) / med(st_stateful), 3),
        "stream_frames_ratio_stateful": round(stateful_frames / mel.shape[1], 3),
        "first_audio_ms": round(med(first["ort"]), 1),
        "first_audio_ms_torch": round(med(first["torch"]), 1),
        "first_audio_ms_stateful": round(med(first_stateful), 1),
        "concurrent_streams_audio_s_per_s": {str(n): v["audio_s_per_s"] for n, v in conc.items()},
        "concurrent_streams_forwards": {str(n): v["forwards"] for n, v in conc.items()},
        "concurrent_streams_audio_s_per_s_stateful": {str(n): v for n, v in conc_stateful.items()},
    }
    result["goals"] = {
        k: {"goal": f"{op} {v}", "met": (result[k] >= v) if op == ">=" else (result[k] <= v)}
        for k, (op, v) in GOALS.items()
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36s} {value}")
    return result


if __name__ == "__main__":
    main()
