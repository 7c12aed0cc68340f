"""tts-cli: synthesize, serve, voices and bench against split-tts.

Without --server, `synthesize`, `voices` and `bench` start an embedded deployment (the three
services as local processes on free ports) and tear it down afterwards.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import servicekit  # noqa: F401
from orchestrator.voices import VOICES_DIR

# --format names and file extensions (raw G.711 takes sox's .ul / .al as well)
ENCODINGS = {
    "pcm": "LINEAR16",
    "linear16": "LINEAR16",
    "raw": "LINEAR16",
    "wav": "WAV",
    "flac": "FLAC",
    "ogg": "OGG_OPUS",
    "opus": "OGG_OPUS",
    "ogg_opus": "OGG_OPUS",
    "mp3": "MP3",
    "mulaw": "MULAW",
    "ulaw": "MULAW",
    "ul": "MULAW",
    "alaw": "ALAW",
    "al": "ALAW",
    "aac": "AAC",
}
FORMAT_CHOICES = "wav, flac, ogg (Opus), mp3, aac, mulaw, alaw or pcm"
EXIT_BAD_INPUT, EXIT_FAILURE = 2, 1


class BadInput(Exception):
    """A user mistake: one line on stderr, exit code 2."""


def default_voice_dir() -> Path:
    default = VOICES_DIR / "default"
    if (default / "voice.json").is_file():
        return default
    raise BadInput(f"no default voice in {default}; pass --voice-dir DIR or --server ADDR")


def voice_dir_for(args) -> Path:
    """The embedded pipeline's voice directory, checked before any service starts."""
    if not args.voice_dir:
        return default_voice_dir()
    from orchestrator.voices import VoiceSpec

    path = Path(args.voice_dir)
    if not path.is_dir():
        raise BadInput(f"--voice-dir {path}: no such directory")
    try:
        VoiceSpec.load(path)
    except (ValueError, FileNotFoundError) as exc:
        raise BadInput(f"--voice-dir {path}: {exc}") from None
    return path


@contextmanager
def deployment(args):
    """The address to talk to: --server, or an embedded deployment started for this command."""
    if args.server:
        yield args.server
        return
    from orchestrator.launcher import LocalDeployment

    voice_dir = voice_dir_for(args)
    if not args.quiet:
        print(
            "starting the embedded pipeline (text-service, vocoder-service, orchestrator) ...",
            file=sys.stderr,
            flush=True,
        )
    with LocalDeployment(voice_dir) as local:
        yield local.address


def format_for(args) -> str:
    if args.format:
        key = args.format.lower()
    elif args.output not in (None, "-") and Path(args.output).suffix:
        key = Path(args.output).suffix.lstrip(".").lower()
    else:
        key = "wav"
    if key not in ENCODINGS:
        raise BadInput(f"--format: unsupported {key!r}; choose {FORMAT_CHOICES}")
    return ENCODINGS[key]


def check_audio_flags(args) -> None:
    """The audio flags against the API's rules, so a mistake costs no service start-up."""
    from orchestrator.audio import (
        MAX_SAMPLE_RATE,
        MAX_SPEAKING_RATE,
        MIN_SAMPLE_RATE,
        MIN_SPEAKING_RATE,
    )

    rate = args.sample_rate
    if rate is not None and rate != 0 and not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise BadInput(
            f"--sample-rate must be between {MIN_SAMPLE_RATE} and {MAX_SAMPLE_RATE} "
            f"Hz, or 0 for the voice's own (got {rate})"
        )
    speed = args.speaking_rate
    if (
        speed is not None
        and speed != 0
        and not (math.isfinite(speed) and MIN_SPEAKING_RATE <= speed <= MAX_SPEAKING_RATE)
    ):
        raise BadInput(
            f"--speaking-rate must be between {MIN_SPEAKING_RATE} and "
            f"{MAX_SPEAKING_RATE} (got {speed})"
        )


def build_request(args, text: str):
    from splittts.tts.v1 import tts_pb2 as pb

    req = pb.SynthesizeRequest(text=text, voice=args.voice or "", language_code=args.language or "")
    # protoc's stubs type Value() as a plain int
    req.audio_config.encoding = pb.AudioEncoding.Value(format_for(args))  # type: ignore[assignment]
    req.audio_config.sample_rate_hz = args.sample_rate or 0
    req.audio_config.speaking_rate = args.speaking_rate or 0.0
    if args.seed is not None:
        req.sampling.seed = args.seed
    return req


def latency_table(report) -> str:
    rows = [
        ("TTFA (first audio)", f"{report.ttfa_ms:8.1f} ms"),
        ("TTFT (first token)", f"{report.ttft_ms:8.1f} ms"),
        ("front end", f"{report.frontend_ms:8.1f} ms"),
        ("text queue", f"{report.queue_ms:8.1f} ms"),
        ("text prefill", f"{report.prefill_ms:8.1f} ms"),
        ("text decode", f"{report.decode_ms:8.1f} ms"),
        ("vocoder compute", f"{report.vocoder_compute_ms:8.1f} ms"),
        ("first chunk: input sent", f"{report.first_chunk_input_ms:8.1f} ms"),
        (
            "first chunk: vocoder",
            f"{report.first_chunk_vocoder_ms:8.1f} ms ({report.first_chunk_compute_ms:.1f} compute)",
        ),
    ]
    rows += [
        (
            f"hop {h.service} (transit)",
            f"{h.mean_overhead_ms:8.2f} ms mean, {h.max_overhead_ms:.2f} max",
        )
        for h in report.hops
    ]
    rows += [
        ("total", f"{report.total_ms:8.1f} ms"),
        ("audio", f"{report.audio_s:8.2f} s in {report.num_chunks} chunks"),
        ("RTF", f"{report.rtf:8.3f}"),
        ("underruns", f"{report.underruns:8d}"),
        ("speech tokens", f"{report.num_speech_tokens:8d} in {report.num_segments} segments"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


class AudioSink:
    """Where the chunks go as they arrive: a file (renamed into place when complete) or stdout.

    Streamed WAV and FLAC headers say "length unknown"; once the stream has ended, a seekable
    output gets its real sizes (`fill_in_sizes`), so tools that trust the header read it all.
    A pipe keeps the streaming header.
    """

    def __init__(self, output: str, encoding: str):
        self.encoding, self.num_samples = encoding, 0
        self.head = b""  # the header's bytes, for an output that cannot be read back
        if output == "-":
            self.path: Path | None = None
            self.part: Path | None = None
            self.file: BinaryIO = sys.stdout.buffer
        else:
            self.path = Path(output)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.part = self.path.with_name(self.path.name + ".part")
            self.file = open(self.part, "w+b")
        self.start = self.file.tell() if self._can_go_back() else None

    def _can_go_back(self) -> bool:
        try:
            appending = fcntl.fcntl(self.file.fileno(), fcntl.F_GETFL) & os.O_APPEND
            return self.file.seekable() and not appending
        except (OSError, ValueError):
            return False

    def write(self, chunk) -> None:
        if len(self.head) < 64:
            self.head += chunk.audio[: 64 - len(self.head)]
        self.file.write(chunk.audio)
        self.file.flush()
        self.num_samples = chunk.first_sample + round(chunk.duration_s * chunk.sample_rate_hz)

    def close(self, complete: bool) -> None:
        """Finishes the output; an incomplete file is removed rather than left half-written."""
        if complete and self.start is not None:
            from orchestrator.encoders import fill_in_sizes

            fill_in_sizes(self.file, self.start, self.encoding, self.num_samples, self.head)
        if self.path is None or self.part is None:
            self.file.flush()
            return
        self.file.close()
        if complete:
            os.replace(self.part, self.path)
        else:
            self.part.unlink(missing_ok=True)


def open_channel(args, address: str):
    """A channel to the orchestrator: TLS trusting --tls-ca when given, else plaintext."""
    import grpc

    if not getattr(args, "tls_ca", None):
        return grpc.insecure_channel(address)
    try:
        ca = Path(args.tls_ca).read_bytes()
    except OSError as exc:
        raise BadInput(f"--tls-ca {args.tls_ca}: cannot read it ({exc.strerror or exc})") from None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))


def call_metadata(args) -> tuple:
    """The bearer token from --api-token-file or $SPLITTTS_API_TOKEN, as call metadata."""
    token = os.environ.get("SPLITTTS_API_TOKEN", "").strip()
    if getattr(args, "api_token_file", None):
        try:
            token = Path(args.api_token_file).read_text().strip()
        except OSError as exc:
            raise BadInput(
                f"--api-token-file {args.api_token_file}: cannot read it ({exc.strerror or exc})"
            ) from None
    return (("authorization", f"Bearer {token}"),) if token else ()


def cmd_synthesize(args) -> int:

    from splittts.tts.v1 import tts_pb2_grpc

    check_audio_flags(args)
    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        raise BadInput("TEXT is empty")
    request = build_request(args, text)
    if args.output is None:
        raise BadInput("-o/--output is required (a file, or - for stdout)")
    if args.timings and not Path(args.timings).resolve().parent.is_dir():
        raise BadInput(f"--timings {args.timings}: its folder does not exist")
    metadata = call_metadata(args)
    with deployment(args) as address, open_channel(args, address) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        sink = AudioSink(args.output, format_for(args))
        chunks, report, audio_s, complete, words = 0, None, 0.0, False, []
        try:
            for resp in stub.Synthesize(request, timeout=args.timeout, metadata=metadata):
                if resp.HasField("words"):
                    words += [
                        {
                            "word": w.word,
                            "start_ms": round(w.start_ms, 1),
                            "end_ms": round(w.end_ms, 1),
                            "segment": w.segment,
                        }
                        for w in resp.words.words
                    ]
                elif resp.HasField("audio"):
                    sink.write(resp.audio)
                    chunks += 1
                    audio_s += resp.audio.duration_s
                    if not args.quiet:
                        print(
                            f"\r  streaming: {chunks:4d} chunks, {audio_s:6.2f} s of audio",
                            end="",
                            file=sys.stderr,
                            flush=True,
                        )
                else:
                    report = resp.report
            complete = True
        finally:
            sink.close(complete)
    if args.timings:
        Path(args.timings).write_text(
            json.dumps({"words": words}, indent=1, ensure_ascii=False) + "\n"
        )
    if not args.quiet:
        print(file=sys.stderr)
        if sink.path is not None:
            print(f"wrote {args.output} ({audio_s:.2f} s)", file=sys.stderr)
        if report is not None:
            print(latency_table(report), file=sys.stderr)
    return 0


def cmd_voices(args) -> int:

    from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

    if not args.server:  # no need to start services to read manifests
        from orchestrator.voices import discover

        voices = [
            (v.name, v.languages, v.sample_rate, v.description, i == 0)
            for i, v in enumerate(discover([args.voice_dir] if args.voice_dir else None))
        ]
    else:
        with open_channel(args, args.server) as channel:
            reply = tts_pb2_grpc.TextToSpeechStub(channel).ListVoices(
                pb.ListVoicesRequest(language_code=args.language or ""),
                timeout=args.timeout,
                metadata=call_metadata(args),
            )
        voices = [
            (v.name, v.language_codes, v.sample_rate_hz, v.description, v.is_default)
            for v in reply.voices
        ]
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": n,
                        "languages": list(langs),
                        "sample_rate_hz": r,
                        "description": d,
                        "default": dflt,
                    }
                    for n, langs, r, d, dflt in voices
                ]
            )
        )
    else:
        for name, langs, rate, desc, dflt in voices:
            print(f"{name}{' (default)' if dflt else ''}\t{', '.join(langs)}\t{rate} Hz\t{desc}")
    return 0


def cmd_serve(args) -> int:
    from orchestrator.launcher import LocalDeployment

    voice_dir = voice_dir_for(args)
    local = LocalDeployment(
        voice_dir,
        ports=(args.port, args.text_port, args.vocoder_port),
        metrics_ports=(
            args.metrics_port,
            args.metrics_port + 1 if args.metrics_port > 0 else -1,
            args.metrics_port + 2 if args.metrics_port > 0 else -1,
        ),
        host=args.host,
        quiet=False,
        http_port=args.http_port,
        tls_dir=args.tls_dir,
        orchestrator_args=[
            *(["--api-token-file", args.api_token_file] if args.api_token_file else []),
            *(["--web-auth"] if args.web_auth else []),
        ],
    )
    local.start()
    scheme = "https" if args.tls_dir else "http"
    web = (
        f"; web demo {scheme}://{args.host}:{local.processes[-1].http_port}/"
        if local.processes[-1].http_port
        else ""
    )
    print(
        f"serving splittts.tts.v1 on {args.host}:{local.processes[-1].port} "
        f"(text-service :{local.processes[0].port}, vocoder-service :{local.processes[1].port})"
        f"{web}{f'; TLS with the CA {args.tls_dir}/ca.pem' if args.tls_dir else ''}"
        "; Ctrl-C drains and stops",
        file=sys.stderr,
        flush=True,
    )
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and all(p.proc.poll() is None for p in local.processes):
            time.sleep(0.2)
    finally:
        print("draining ...", file=sys.stderr, flush=True)
        local.stop()
    return 0


def cmd_bench(args) -> int:
    from orchestrator.bench import run_sweep, sweep_table

    levels = [int(x) for x in args.concurrency.split(",")]
    if any(c < 1 for c in levels):
        raise BadInput("--concurrency: levels must be positive integers, e.g. 1,2,4,8")
    if args.tls_ca or args.api_token_file:
        raise BadInput(
            "bench dials plaintext without a token: bench the embedded deployment or "
            "a --server on 127.0.0.1 without --tls-ca and --api-token-file"
        )
    with deployment(args) as address:
        result = run_sweep(
            address, levels, requests_per_level=args.requests, voice=args.voice or ""
        )
    print(json.dumps(result) if args.json else sweep_table(result))
    return 0


class Parser(argparse.ArgumentParser):
    """Usage errors are one line and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tts-cli", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, server=True):
        if server:
            sp.add_argument("--server", help="orchestrator address host:port (default: embedded)")
            sp.add_argument(
                "--tls-ca",
                metavar="PEM",
                help="reach --server over TLS, trusting this CA (e.g. a --tls-dir's ca.pem)",
            )
            sp.add_argument(
                "--api-token-file",
                metavar="FILE",
                help="send this file's bearer token (default: $SPLITTTS_API_TOKEN)",
            )
        sp.add_argument("--voice-dir", help="voice directory for the embedded pipeline")
        sp.add_argument("--timeout", type=float, default=600.0, help="seconds")
        sp.add_argument("-q", "--quiet", action="store_true")

    s = sub.add_parser("synthesize", help="speak TEXT (or - for stdin) into a file or stdout")
    s.add_argument("text", metavar="TEXT")
    s.add_argument("-o", "--output", metavar="FILE", help="output file, or - for stdout")
    s.add_argument("--voice")
    s.add_argument("--language", help="BCP-47 code, e.g. en-US or cmn-CN (default: detected)")
    s.add_argument(
        "--format",
        help="wav (default), flac, ogg (Opus), mp3, aac, mulaw, alaw "
        "(headerless G.711, 8 kHz) or pcm (raw LINEAR16); default: from -o's extension",
    )
    s.add_argument("--sample-rate", type=int, help="output rate in Hz (default: the voice's)")
    s.add_argument("--speaking-rate", type=float, help="0.5 to 2.0, pitch kept")
    s.add_argument("--seed", type=int)
    s.add_argument(
        "--timings",
        metavar="FILE",
        help="write word timings (JSON: word, start_ms, end_ms, segment) to FILE",
    )
    common(s)
    s.set_defaults(func=cmd_synthesize)

    v = sub.add_parser("voices", help="list voices")
    v.add_argument("--language")
    v.add_argument("--json", action="store_true")
    common(v)
    v.set_defaults(func=cmd_voices)

    sv = sub.add_parser("serve", help="run all three services in the foreground")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=50050)
    sv.add_argument("--text-port", type=int, default=50051)
    sv.add_argument("--vocoder-port", type=int, default=50052)
    sv.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="orchestrator metrics; the text and vocoder services use the next two",
    )
    sv.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="web demo port (0 picks a free one, -1 disables)",
    )
    sv.add_argument("--voice-dir")
    sv.add_argument(
        "--tls-dir",
        metavar="DIR",
        help="mutual TLS between the services and TLS on the public port, with a "
        "private CA and certificates made in DIR when missing (clients trust "
        "DIR/ca.pem)",
    )
    sv.add_argument(
        "--api-token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <the file's token>' on the public API",
    )
    sv.add_argument(
        "--web-auth",
        action="store_true",
        help="the web demo needs the token too (open it once as /?token=TOKEN)",
    )
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="concurrency sweep: TTFA percentiles, RTF, underruns")
    b.add_argument("--concurrency", default="1,2,4,8")
    b.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    b.add_argument("--voice")
    b.add_argument("--json", action="store_true")
    common(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    import grpc

    from orchestrator.launcher import StartupError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its usage line
        return EXIT_BAD_INPUT if exc.code else 0
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"tts-cli: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StartupError as exc:  # the service's own reason, on one line
        print(
            f"tts-cli: {exc.name} failed to start: {' '.join(exc.reason.split())}", file=sys.stderr
        )
        return EXIT_BAD_INPUT if exc.bad_config else EXIT_FAILURE
    except grpc.RpcError as exc:
        bad = exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        print(f"tts-cli: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_BAD_INPUT if bad else EXIT_FAILURE
    except (RuntimeError, OSError) as exc:
        print(
            f"tts-cli: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
