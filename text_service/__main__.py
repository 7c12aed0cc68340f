"""`text-service`: serve splittts.text.v1 (a Qwen3.5 / Qwen3 speech LM) over gRPC."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import servicekit  # noqa: F401  (torch backend auto-loading off before torch loads)
from servicekit.cli import run_service
from servicekit.errors import ServiceFailed
from servicekit.server import Service, serve
from servicekit.tls import add_server_flags, server_tls

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "voices" / "default" / "lm"


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    value, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit else 1
    return int(value * base ** " KMGT".index(unit or " "))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="text-service", description=__doc__)
    p.add_argument(
        "--model",
        default=str(DEFAULT_MODEL_DIR),
        help="HF-format model directory (config.json, safetensors, tokenizer.json)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (npu, then cuda, then cpu), npu, cuda, cpu"
    )
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: config's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9091,
        help="Prometheus /metrics port (0 picks a free one, -1 disables)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=parse_bytes("1GiB"),
        help="memory for KV blocks and linear-attention state slots (e.g. 512MiB)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the memory budget")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-pending", type=int, default=256, help="requests in flight before RESOURCE_EXHAUSTED"
    )
    p.add_argument(
        "--max-num-waiting",
        type=int,
        default=1024,
        help="sequences the scheduler queues before RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-stream-backlog",
        type=int,
        default=64,
        help="tokens a request may have made ahead of its reader before it is paused",
    )
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--decode-graphs",
        type=int,
        default=8,
        help="decode steps of up to this many sequences replay graphs captured at start "
        "(CPU only; 0: every step eager)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = default)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain on SIGTERM")
    p.add_argument("--log-level", default="warning")
    add_server_flags(p)
    return p


async def run(args: argparse.Namespace) -> None:
    import asyncio

    import torch

    from splittts.text.v1 import text_pb2, text_pb2_grpc
    from text_service.async_engine import AsyncEngine
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams
    from text_service.server import TextGenerationServicer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not (Path(args.model) / "config.json").is_file():
        raise FileNotFoundError(f"--model {args.model}: no config.json there")
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_num_waiting=args.max_num_waiting,
            enable_prefix_caching=args.prefix_caching,
            decode_graphs=args.decode_graphs,
        )
    )
    # A dead engine loop stops the server (health NOT_SERVING, in-flight calls already failed)
    # and the process exits non-zero for its supervisor to restart it.
    stop = asyncio.Event()
    async_engine = AsyncEngine(
        engine,
        max_pending=args.max_pending,
        on_failure=lambda exc: stop.set(),
        max_backlog=args.max_stream_backlog,
    )
    model_name = Path(args.model).resolve().name  # noqa: ASYNC240 - once, at start-up
    servicer = TextGenerationServicer(async_engine, model_name)

    def warmup() -> None:  # one short request through every path before SERVING
        engine.generate([[0] * 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        async_engine.start()

    name = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
    await serve(
        [Service(name, text_pb2_grpc.add_TextGenerationServicer_to_server, servicer)],
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        tls=server_tls(args),
        reflection_on=args.reflection,
        health_port=args.health_port,
        warmup=warmup,
        grace_s=args.grace,
        on_stop=async_engine.stop,
        stop_event=stop,
        device=args.device,
    )
    if async_engine.error is not None:
        raise ServiceFailed(
            "the engine loop stopped after an internal error (logged above); "
            "exiting so that a supervisor restarts the service"
        )


def main(argv: list[str] | None = None) -> int:
    return run_service("text-service", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
