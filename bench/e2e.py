"""End-to-end latency of the whole pipeline: TTFA percentiles, RTF, underruns, hop overhead,
and a split deployment (text and vocoder services in separate processes on separate cores)
against a co-located one (both services in one process sharing the cores).

    python bench/e2e.py --quick          # under 3 minutes on 2 cores
    python bench/e2e.py --json           # one JSON object on stdout
    python bench/e2e.py --layouts --quick   # vocoder precision and core layout, side by side
    python bench/e2e.py --layouts --layout default   # the default and its variants only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import servicekit  # noqa: E402,F401


def serve_colocated(args) -> None:
    """Both backend services in one process and one gRPC server (the co-located baseline)."""
    import torch

    from servicekit.server import Service, serve
    from splittts.text.v1 import text_pb2, text_pb2_grpc
    from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc
    from text_service.async_engine import AsyncEngine
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams
    from text_service.server import TextGenerationServicer
    from vocoder_service.backends import OnnxBackend
    from vocoder_service.server import VocoderServicer
    from vocoder_service.voice import load_voice

    torch.set_num_threads(args.threads)
    voice = load_voice(args.voice)
    engine = LLMEngine(
        EngineArgs(model=str(Path(args.voice) / "lm"), kv_cache_memory_bytes=256 << 20)
    )
    async_engine = AsyncEngine(engine)
    backend = OnnxBackend(voice.generator, intra_op_threads=args.threads)

    async def main() -> None:
        vocoder = VocoderServicer([voice], {voice.name: backend})
        vocoder.start()

        def warmup() -> None:
            engine.generate(
                [[1] * 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            )
            backend.warmup()
            async_engine.start()

        async def stop() -> None:
            async_engine.stop()
            await vocoder.close()

        await serve(
            [
                Service(
                    text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name,
                    text_pb2_grpc.add_TextGenerationServicer_to_server,
                    TextGenerationServicer(async_engine, "lm"),
                ),
                Service(
                    vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name,
                    vocoder_pb2_grpc.add_VocoderServicer_to_server,
                    vocoder,
                ),
            ],
            host="127.0.0.1",
            port=args.port,
            metrics_port=None,
            warmup=warmup,
            on_stop=stop,
        )

    asyncio.run(main())


# How a split deployment shares the machine's two cores (`--layouts` measures each in turn):
# the vocoder's flags, and each service's cores ({} pins nothing; None: the local deployment's
# default, `orchestrator.launcher.default_cpus`, with one vocoder worker per core).
PINNED = {"text": {0}, "orchestrator": {0}, "vocoder": {1}}
MACHINE_CORES = frozenset(os.sched_getaffinity(0))
SHARED = {name: set(MACHINE_CORES) for name in ("text", "orchestrator", "vocoder")}
AUTO = ["--threads", "1"]  # the vocoder picks its precision by the CPU (`auto_backend`)
BF16 = ["--backend", "torch", "--bf16", "--threads", "1"]
INT8 = ["--backend", "onnx", "--int8", "--threads", "1"]
INT8_TORCH = ["--backend", "torch", "--int8", "--threads", "1"]
LAYOUTS: dict[str, tuple[list[str], dict[str, set[int]] | None]] = {
    "the CPU's precision, vocoder on both cores, 2 workers (default)": (AUTO, None),
    "as the default, at Python's 5 ms GIL switch interval": ([*AUTO, "--gil-switch-ms", "5"], None),
    "the CPU's precision, every service on both cores, vocoder niced, 2 workers": (AUTO, SHARED),
    "bf16 torch, vocoder on both cores, 2 workers": (BF16, None),
    "bf16 torch, pinned": (BF16, PINNED),
    "bf16 torch, 2 threads, unpinned": (["--backend", "torch", "--bf16", "--threads", "2"], {}),
    "int8 onnxruntime, vocoder on both cores, 2 workers": (INT8, None),
    "int8 onnxruntime, pinned": (INT8, PINNED),
    "int8 torch (bf16 elsewhere), vocoder on both cores, 2 workers": (INT8_TORCH, None),
    "fp32 onnxruntime, vocoder on both cores, 2 workers": (
        ["--backend", "onnx", "--threads", "1"],
        None,
    ),
    "fp32 onnxruntime, pinned": (["--backend", "onnx", "--threads", "1"], PINNED),
}


class Deployment:
    """Start a split or co-located set of processes; `address` is the orchestrator's."""

    def __init__(
        self,
        voice_dir: Path,
        mode: str,
        http: bool = False,
        vocoder_args: list[str] | None = None,
        cpus: dict[str, set[int]] | None = None,
    ):
        self.voice_dir, self.mode, self.procs = voice_dir, mode, []
        self.http = http  # the orchestrator's HTTP port (web demo, /v1) on a free port
        self.http_port: int | None = None
        self.vocoder_args = vocoder_args if vocoder_args is not None else ["--threads", "1"]
        from orchestrator.launcher import default_cpus

        # by service ({}: none pinned); the default from all the machine's cores, not the load
        # generator's own (main() keeps it on core 0)
        self.cpus = default_cpus(set(MACHINE_CORES)) if cpus is None else cpus

    def __enter__(self):
        from orchestrator.launcher import start_service, vocoder_nice, vocoder_workers

        try:
            if self.mode == "split":
                text = start_service(
                    "text",
                    "text_service",
                    [
                        "--model",
                        str(self.voice_dir / "lm"),
                        "--threads",
                        "1",
                        "--kv-cache-memory",
                        "256MiB",
                    ],
                    cpus=self.cpus.get("text"),
                )
                voc_cpus = self.cpus.get("vocoder")
                voc = start_service(
                    "vocoder",
                    "vocoder_service",
                    [
                        "--voice",
                        str(self.voice_dir),
                        *vocoder_workers(voc_cpus),
                        *self.vocoder_args,
                    ],
                    cpus=voc_cpus,
                    nice=vocoder_nice(self.cpus),
                )
                self.procs += [text, voc]
                text_addr, voc_addr = text.address, voc.address
            else:
                both = start_service(
                    "colocated",
                    "bench.e2e",
                    ["--serve-colocated", "--voice", str(self.voice_dir), "--threads", "2"],
                    metrics_port=-1,
                )
                self.procs.append(both)
                text_addr = voc_addr = both.address
            orch = start_service(
                "orchestrator",
                "orchestrator",
                [
                    "--voice",
                    str(self.voice_dir),
                    "--text-service",
                    text_addr,
                    "--vocoder-service",
                    voc_addr,
                    "--http-port",
                    "0" if self.http else "-1",
                ],
                cpus=self.cpus.get("orchestrator") if self.mode == "split" else None,
            )
            self.procs.append(orch)
            self.address, self.http_port = orch.address, orch.http_port
            self.vocoder_address = voc_addr
        except BaseException:
            self.__exit__()
            raise
        return self

    def vocoder(self) -> str:
        """The vocoder's backend and precision, as it reports them ("onnxruntime int8")."""
        import grpc

        from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc

        with grpc.insecure_channel(self.vocoder_address) as ch:
            stub = vocoder_pb2_grpc.VocoderStub(ch)
            info = stub.GetInfo(vocoder_pb2.GetInfoRequest(), timeout=10)
        return f"{info.backend} {info.precision}"

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            p.proc.terminate()
        for p in reversed(self.procs):
            p.proc.wait(30)


def pick_voice(arg: str | None) -> tuple[Path, str]:
    if arg:
        return Path(arg), "given"
    default = ROOT / "voices" / "default"
    if (default / "voice.json").is_file():
        return default, "default voice"
    from tests.voices import make_tts_voice

    tmp = Path(tempfile.mkdtemp(prefix="e2e-voice-"))
    return make_tts_voice(tmp, max_tokens=96), "random tiny model (no default voice yet)"


def _pressure() -> str:
    return Path("/proc/pressure/cpu").read_text().splitlines()[0]


def real_time_streams(levels: list[dict], max_rtf: float = 0.9) -> int:
    """The highest concurrency measured at which every stream ran at RTF <= max_rtf with no
    error and no underrun for a listener with a `CLIENT_BUFFER_MS` jitter buffer (0 when even
    one stream did not)."""
    ok = [
        lv["concurrency"]
        for lv in levels
        if lv["rtf_max"] <= max_rtf and lv["underruns_client_buffered"] == 0 and not lv["errors"]
    ]
    return max(ok, default=0)


def compare_layouts(
    voice_dir: Path, n1: int, n4: int, n8: int, only: list[str] | None = None
) -> dict:
    from orchestrator.bench import run_level

    keys = (
        "ttfa_p50_ms",
        "ttfa_p95_ms",
        "rtf_mean",
        "rtf_max",
        "underruns",
        "underruns_client",
        "underruns_client_buffered",
        "audio_s_per_wall_s",
    )
    result = {}
    for name, (vocoder_args, cpus) in LAYOUTS.items():
        if only and not any(word in name for word in only):
            continue
        print(f"layout: {name}", file=sys.stderr, flush=True)
        with Deployment(voice_dir, "split", vocoder_args=vocoder_args, cpus=cpus) as d:
            run_level(d.address, 1, 2)  # warm-up
            plan = ((1, n1), (2, n1), (4, n4), (8, n8))
            levels = [run_level(d.address, c, n) for c, n in plan]
            vocoder = d.vocoder()
        result[name] = {
            "vocoder": vocoder,
            "levels": [
                {"concurrency": lv["concurrency"], "errors": len(lv["errors"])}
                | {k: lv[k] for k in keys}
                for lv in levels
            ],
            "real_time_streams": real_time_streams(levels),
        }
        print(json.dumps(result[name]), file=sys.stderr, flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--voice", help="voice directory (default: voices/default, else a random model)")
    p.add_argument(
        "--layouts",
        action="store_true",
        help="instead: each vocoder precision and core layout of the split deployment in turn "
        "(LAYOUTS), and the most streams each serves in real time",
    )
    p.add_argument(
        "--layout",
        action="append",
        metavar="WORDS",
        help="with --layouts: only the layouts whose names contain WORDS (repeatable)",
    )
    p.add_argument("--serve-colocated", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_colocated:
        serve_colocated(args)
        return 0

    from orchestrator.bench import run_level

    voice_dir, voice_kind = pick_voice(args.voice)
    # the load generator is not the system under test: keep it off the vocoder's core
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {0})
    from bench.workload import machine_load

    n1, n4, n8, ncmp = (6, 8, 8, 6) if args.quick else (20, 24, 32, 20)
    out: dict = {
        "voice": str(voice_dir),
        "voice_kind": voice_kind,
        "quick": args.quick,
        "cpus": os.cpu_count(),
    }
    started = time.perf_counter()
    out["machine_load_start"] = machine_load()
    if args.layouts:
        out["pressure_cpu_start"] = _pressure()
        out["layouts"] = compare_layouts(voice_dir, n1, n4, n8, args.layout)
        out["pressure_cpu_end"] = _pressure()
        out["machine_load_end"] = machine_load()
        out["wall_s"] = time.perf_counter() - started
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return 0
    with Deployment(voice_dir, "split") as d:
        run_level(d.address, 1, 2)  # warm-up
        c1 = run_level(d.address, 1, n1)
        c4 = run_level(d.address, 4, n4)
        c8 = run_level(d.address, 8, n8)
        out["vocoder"] = d.vocoder()
    with Deployment(voice_dir, "colocated") as d:
        run_level(d.address, 1, 2)
        colo = run_level(d.address, 1, ncmp)
    hops = c1["hop_overhead_ms"]
    out.update(
        {
            "ttfa_p50_ms": c1["ttfa_p50_ms"],
            "ttfa_p95_ms": c1["ttfa_p95_ms"],
            "ttfa_p95_c4_ms": c4["ttfa_p95_ms"],
            "ttfa_p95_c8_ms": c8["ttfa_p95_ms"],
            "ttfa_p95_c4_vs_p50_c1": c4["ttfa_p95_ms"] / c1["ttfa_p50_ms"]
            if c1["ttfa_p50_ms"]
            else None,
            "ttft_p50_ms": c1["ttft_p50_ms"],
            **{k: v for k, v in c1.items() if k.startswith("first_chunk_")},
            "rtf": c1["rtf_mean"],
            "rtf_c4": c4["rtf_mean"],
            "rtf_c8": c8["rtf_mean"],
            # the slowest stream's: the goal is every stream in real time, not the mean
            "rtf_max": {f"c{lv['concurrency']}": lv["rtf_max"] for lv in (c1, c4, c8)},
            "underruns": {"c1": c1["underruns"], "c4": c4["underruns"], "c8": c8["underruns"]},
            "underruns_150ms_buffer": {
                f"c{lv['concurrency']}": lv["underruns_client_buffered"] for lv in (c1, c4, c8)
            },
            "audio_s_per_wall_s": {
                "c1": c1["audio_s_per_wall_s"],
                "c4": c4["audio_s_per_wall_s"],
                "c8": c8["audio_s_per_wall_s"],
            },
            "hop_overhead_ms": max(hops.values()) if hops else None,
            "hop_overhead_by_service_ms": hops,
            "colocated_ttfa_p50_ms": colo["ttfa_p50_ms"],
            "split_vs_colocated_ttfa": c1["ttfa_p50_ms"] / colo["ttfa_p50_ms"]
            if colo["ttfa_p50_ms"]
            else None,
            "errors": c1["errors"] + c4["errors"] + c8["errors"] + colo["errors"],
            "wall_s": time.perf_counter() - started,
            "machine_load_end": machine_load(),
        }
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(f"voice: {voice_kind} ({voice_dir})")
        for k, v in out.items():
            if k not in ("voice", "voice_kind"):
                print(f"  {k:28s} {v:.3f}" if isinstance(v, float) else f"  {k:28s} {v}")
        print(
            "goals: hop_overhead_ms <= 2, ttfa_p95_c4_vs_p50_c1 <= 2.5 "
            "(split_vs_colocated_ttfa < 1 means the split deployment is faster)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
