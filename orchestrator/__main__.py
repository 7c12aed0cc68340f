"""`orchestrator`: serve the public splittts.tts.v1 API over gRPC (and the web demo over HTTP)."""

from __future__ import annotations

import argparse
import os
import sys

# numpy's BLAS runs the duration predictor's small products: a thread per core there only waits
# on the others on a shared host (140 ms a sentence instead of 1.5 ms on 2 busy cores), and
# requests run side by side anyway. Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import servicekit  # noqa: F401
from orchestrator.auth import add_flags as add_auth_flags
from servicekit.cli import run_service
from servicekit.server import Service, serve
from servicekit.tls import add_client_flags, add_server_flags, client_tls, server_tls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrator", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="Prometheus /metrics port (0 picks a free one, -1 disables)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="web demo page and its WebSocket relay (0 picks a free one, -1 disables)",
    )
    p.add_argument(
        "--text-service",
        action="append",
        default=[],
        metavar="ADDR",
        help="text-service replica host:port (repeatable)",
    )
    p.add_argument(
        "--vocoder-service",
        action="append",
        default=[],
        metavar="ADDR",
        help="vocoder-service replica host:port (repeatable)",
    )
    p.add_argument(
        "--voice",
        action="append",
        default=[],
        metavar="DIR",
        help="voice directory (repeatable; default: every voice under voices/)",
    )
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument(
        "--max-audio-ahead",
        type=float,
        default=4.0,
        help="seconds of audio a call may have made ahead of what its caller has read",
    )
    p.add_argument(
        "--pace",
        type=float,
        default=1.25,
        help="while other requests run, a phoneme-synced segment's tokens are generated at "
        "most this many times as fast as its audio plays, after a lead of the first audio's "
        "tokens (0: as fast as possible)",
    )
    p.add_argument(
        "--health-interval", type=float, default=1.0, help="seconds between replica health checks"
    )
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--log-level", default="warning")
    add_server_flags(p)
    add_client_flags(p)
    add_auth_flags(p)
    return p


async def run(args: argparse.Namespace) -> None:
    from orchestrator.auth import BearerTokenInterceptor, load_token
    from orchestrator.frontend import FrontEnd
    from orchestrator.pipeline import Pipeline
    from orchestrator.replicas import ReplicaPool
    from orchestrator.server import TextToSpeechServicer
    from orchestrator.voices import discover
    from splittts.tts.v1 import tts_pb2, tts_pb2_grpc

    voices = discover(args.voice)
    if not voices:
        raise ValueError("no voices: pass --voice DIR or add one under voices/")
    if not args.text_service or not args.vocoder_service:
        raise ValueError("give at least one --text-service and one --vocoder-service address")
    tls, backend_tls, token = server_tls(args), client_tls(args), load_token(args)
    backend_creds = backend_tls.credentials() if backend_tls is not None else None
    # Token messages are tiny: the default 64 KiB stream window (grown by BDP probing) would let
    # the text service run thousands of tokens ahead of a paused call, out of its backlog bound.
    text_pool = ReplicaPool(
        args.text_service,
        "splittts.text.v1.TextGeneration",
        args.health_interval,
        backend_creds,
        channel_options=(("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)),
    )
    vocoder_pool = ReplicaPool(
        args.vocoder_service, "splittts.vocoder.v1.Vocoder", args.health_interval, backend_creds
    )
    frontends = {v.name: FrontEnd(v.text_frontend) for v in voices}
    if not (args.pace == 0 or args.pace >= 1):
        raise ValueError(f"--pace must be 0 (off) or >= 1 (got {args.pace})")
    pipeline = Pipeline(
        text_pool,
        vocoder_pool,
        frontends,
        max_audio_ahead_s=args.max_audio_ahead,
        pace_realtime=args.pace,
    )
    servicer = TextToSpeechServicer(pipeline, voices, max_in_flight=args.max_in_flight)

    async def warmup() -> None:
        await text_pool.start()
        await vocoder_pool.start()
        await pipeline.warmup(voices)

    web = None

    async def start_web(grpc_port: int) -> dict:
        nonlocal web
        if args.http_port < 0:
            return {}
        from orchestrator.web import WebDemo, loopback_target, relay_tls

        web = WebDemo(
            loopback_target(args.host, grpc_port),
            token=token,
            web_auth=args.web_auth,
            allow_origins=args.allow_origin,
            tls=relay_tls(tls, backend_tls),
        )
        try:
            port = await web.start(args.host, args.http_port, https=tls)
        except OSError as exc:
            raise ValueError(f"--http-port {args.http_port}: {exc.strerror or exc}") from None
        await web.warmup()
        return {"http_port": port}

    async def stop() -> None:
        if web is not None:
            await web.stop()
        await text_pool.close()
        await vocoder_pool.close()

    name = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name
    await serve(
        [Service(name, tts_pb2_grpc.add_TextToSpeechServicer_to_server, servicer)],
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        tls=tls,
        reflection_on=args.reflection,
        health_port=args.health_port,
        interceptors=[BearerTokenInterceptor(token)] if token else None,
        warmup=warmup,
        grace_s=args.grace,
        on_stop=stop,
        serving_info=start_web,
        device="cpu",
    )


def main(argv: list[str] | None = None) -> int:
    return run_service("orchestrator", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
