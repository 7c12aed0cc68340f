"""`vocoder-service`: serve splittts.vocoder.v1 over gRPC."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import servicekit  # noqa: F401  (torch backend auto-loading off before torch loads)
from servicekit.cli import run_service
from servicekit.server import Service, serve
from servicekit.tls import add_server_flags, server_tls

DEFAULT_VOICE_DIR = Path(__file__).resolve().parents[1] / "voices" / "default"

# The GIL switch interval of the vocoder's process. Between two operators a forward's worker
# thread waits for the GIL while the event loop runs Python (gRPC, token decoding, job sizing),
# up to the interval each time: a 16-frame forward beside a thread running Python took 1.29 s
# at Python's 5 ms and 0.17 s at 0.5 ms, 14-15 ms alone (`bench.vocoder_gil`). At 8 streams the
# gain was within run-to-run noise (bench/README.md, "The vocoder's forwards and the GIL").
GIL_SWITCH_MS = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vocoder-service", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9092,
        help="Prometheus /metrics port (0 picks a free one, -1 disables)",
    )
    p.add_argument(
        "--voice",
        action="append",
        default=[],
        metavar="DIR",
        help="voice directory (repeatable; the first is the default). Default: "
        "voices/default when present, else the pretrained universal HiFi-GAN",
    )
    p.add_argument(
        "--checkpoint",
        help="a HiFi-GAN generator checkpoint (file or folder) to "
        "serve as a mel-only voice instead of --voice",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "onnx", "torch"),
        default="auto",
        help="auto: on a CPU with AVX-512 VNNI or AVX2 alone, and no AMX, int8 where the voices "
        "bring their "
        "calibration (on torch where its bf16 convolutions are fast, else ONNX Runtime); else "
        "torch in bf16 on a CPU with AMX or an AMD CPU with "
        "AVX-512 BF16, else ONNX Runtime (fp16 on CUDA); torch in fp16 on an NPU",
    )
    p.add_argument("--device", default="auto", help="torch backend device: auto, npu, cuda, cpu")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument(
        "--fp16", action="store_true", help="run the generator in fp16 (GPU/NPU)"
    )
    precision.add_argument(
        "--bf16",
        action="store_true",
        help="run the generator in bf16 (torch backend; on the CPU through oneDNN, fastest "
        "where the CPU has AMX or is an AMD CPU with AVX-512 BF16)",
    )
    precision.add_argument(
        "--int8",
        action="store_true",
        help="run the generator's residual blocks in int8, but the last stage's, on the CPU, "
        "calibrated on the voice's vocoder/calibration_codes.npz: on torch (oneDNN, the rest in "
        "bf16) or ONNX Runtime (the rest in fp32); auto picks torch where the CPU's bf16 "
        "convolutions are fast",
    )
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = library default)")
    p.add_argument(
        "--spin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let ONNX Runtime's idle workers spin (faster on dedicated cores; steals "
        "CPU from other services on shared ones)",
    )
    p.add_argument(
        "--first-chunk-frames",
        type=int,
        default=4,
        help="new frames in a stream's first job (its time to first audio)",
    )
    p.add_argument(
        "--first-chunk-frames-alone",
        type=int,
        default=1,
        help="new frames in a stream's first job while no other stream shares the generator "
        "(0: as --first-chunk-frames)",
    )
    p.add_argument("--chunk-growth", type=float, default=2.0)
    p.add_argument(
        "--max-chunk-frames",
        type=int,
        default=128,
        help="most new frames in one job while a stream has the generator to itself",
    )
    p.add_argument(
        "--shared-chunk-frames",
        type=int,
        default=32,
        help="most new frames in one job while other streams are open",
    )
    p.add_argument(
        "--buffer-share",
        type=float,
        default=0.5,
        help="share of a listener's buffered audio that gathering and vocoding its "
        "next chunk may take (bounds chunk sizes by the playout clock)",
    )
    p.add_argument(
        "--max-batch-frames",
        type=int,
        default=0,
        help="window frames in one forward (0: 64 on CPU, 1024 on accelerators)",
    )
    p.add_argument(
        "--max-first-batch",
        type=int,
        default=0,
        help="streams' first chunks in one forward while any waits (0: 1 on CPU, "
        "32 on accelerators)",
    )
    p.add_argument(
        "--streaming",
        choices=("auto", "stateful", "windowed"),
        default="auto",
        help="stateful: each layer keeps its input tail, no work repeated, streams with "
        "equally long chunks share a forward; windowed: each chunk recomputes its context, "
        "many streams per forward (auto: stateful on CPU, windowed on accelerators)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="forwards in flight at once, each on its own thread and streams: on a CPU, "
        "one per core the service may use (with --threads 1)",
    )
    p.add_argument(
        "--gil-switch-ms",
        type=float,
        default=GIL_SWITCH_MS,
        help="how long a thread running Python keeps the GIL while another waits for it "
        "(Python's default: 5): each of a forward's hundreds of operators takes it back "
        "from the event loop",
    )
    p.add_argument("--max-streams", type=int, default=64)
    p.add_argument(
        "--max-audio-ahead",
        type=float,
        default=2.0,
        help="seconds of audio a stream may have in the making ahead of its reader",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain on SIGTERM")
    p.add_argument("--log-level", default="warning")
    add_server_flags(p)
    return p


def load(args: argparse.Namespace):
    """Voices and one backend per distinct generator."""
    import torch

    from servicekit.device import select_device
    from servicekit.memory import keep_onednn_primitives, retain_freed_memory
    from vocoder_service.backends import (
        Backend,
        OnnxBackend,
        TorchBackend,
        auto_backend,
        int8_runtime,
    )
    from vocoder_service.checkpoint import resolve_checkpoint
    from vocoder_service.voice import VocoderVoice, load_voice

    if args.checkpoint:
        ckpt = resolve_checkpoint(args.checkpoint)
        voices = [VocoderVoice(Path(args.checkpoint).stem, ckpt)]
    else:
        dirs = args.voice or (
            [DEFAULT_VOICE_DIR] if (DEFAULT_VOICE_DIR / "voice.json").is_file() else [None]
        )
        voices = [load_voice(d) for d in dirs]
    if args.bf16 and args.backend == "onnx":
        raise ValueError("--bf16 runs on the torch backend: use --backend torch or auto")
    device = select_device(args.device)
    if args.int8 and device.type != "cpu":
        raise ValueError(f"--int8 runs on the CPU (got --device {args.device})")
    calibrated = all(v.int8_calibrated for v in voices)
    auto = auto_backend(device, int8_calibrated=calibrated)
    kind, precision = auto if args.backend == "auto" else (args.backend, "fp32")
    if args.bf16:
        kind, precision = "torch", "bf16"
    elif args.int8:
        kind = int8_runtime() if args.backend == "auto" else args.backend
        precision = "int8"
    elif args.fp16:
        precision = "fp16"
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    retain_freed_memory()  # torch eager reuses its large buffers instead of faulting them in
    keep_onednn_primitives()  # a stream's chunk widths vary from call to call
    backends: dict[str, Backend] = {}
    by_generator: dict[str, Backend] = {}
    for voice in voices:
        key = voice.generator.fingerprint
        if key not in by_generator:
            if kind == "onnx":
                int8 = precision == "int8"
                by_generator[key] = OnnxBackend(
                    voice.generator,
                    intra_op_threads=args.threads,
                    fp16=True if precision == "fp16" else None,
                    allow_spinning=args.spin,
                    int8=int8,
                    calibration=voice.calibration_mels() if int8 else None,
                )
            else:
                int8 = precision == "int8"
                by_generator[key] = TorchBackend(
                    voice.generator,
                    fp16=precision == "fp16",
                    bf16=precision in ("bf16", "int8"),
                    device=device,
                    int8=int8,
                    calibration=voice.calibration_mels() if int8 else None,
                )
        backends[voice.name] = by_generator[key]
    return voices, backends


def set_gil_switch(ms: float) -> None:
    if not 0 < ms <= 1000:  # also refuses nan and inf
        raise ValueError(f"--gil-switch-ms must be in (0, 1000] (got {ms})")
    sys.setswitchinterval(ms / 1e3)


async def run(args: argparse.Namespace) -> None:
    from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc
    from vocoder_service.chunking import ChunkPolicy
    from vocoder_service.server import VocoderLimits, VocoderServicer

    set_gil_switch(args.gil_switch_ms)
    voices, backends = load(args)
    servicer = VocoderServicer(
        voices,
        backends,
        policy=ChunkPolicy(
            args.first_chunk_frames,
            args.chunk_growth,
            args.max_chunk_frames,
            args.shared_chunk_frames,
            args.buffer_share,
            first_chunk_frames_alone=args.first_chunk_frames_alone or None,
        ),
        limits=VocoderLimits(max_streams=args.max_streams, max_audio_ahead_s=args.max_audio_ahead),
        max_batch_frames=None if args.max_batch_frames == 0 else args.max_batch_frames,
        max_first_batch=None if args.max_first_batch == 0 else args.max_first_batch,
        streaming=args.streaming,
        workers=args.workers,
    )
    servicer.start()

    name = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name
    await serve(
        [Service(name, vocoder_pb2_grpc.add_VocoderServicer_to_server, servicer)],
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        tls=server_tls(args),
        reflection_on=args.reflection,
        health_port=args.health_port,
        warmup=servicer.warmup,
        grace_s=args.grace,
        on_stop=servicer.close,
        # the ONNX backend's card is found the same way: npu-smi, then NVML
        device=args.device,
    )


def main(argv: list[str] | None = None) -> int:
    return run_service("vocoder-service", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
