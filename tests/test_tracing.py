"""OpenTelemetry spans of one request across the three real service processes.

The services export over OTLP/gRPC to a small collector run here (the OTLP protobuf messages
of opentelemetry-proto), as a deployment would to a real one; the deployment runs with TLS, mutual
TLS on the internal hops and a bearer token, as `tts-cli serve --tls-dir` does.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from orchestrator.launcher import LocalDeployment, start_service
from servicekit.certs import make_all
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.voices import make_tts_voice

TOKEN = "trace-token-0123456789abcdef"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SERVER, CLIENT, INTERNAL = (
    trace_pb2.Span.SPAN_KIND_SERVER,
    trace_pb2.Span.SPAN_KIND_CLIENT,
    trace_pb2.Span.SPAN_KIND_INTERNAL,
)
SYNTHESIZE = "/splittts.tts.v1.TextToSpeech/Synthesize"
GENERATE = "/splittts.text.v1.TextGeneration/Generate"
VOCODE = "/splittts.vocoder.v1.Vocoder/Vocode"
OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_SAMPLER",
    "OTEL_SERVICE_NAME",
)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on 127.0.0.1 that keeps every span it is sent."""

    def __init__(self, port: int = 0):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        self.spans.append(
                            {
                                "service": attrs.get("service.name"),
                                "name": s.name,
                                "kind": s.kind,
                                "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "status": s.status.code,
                                "attrs": {
                                    a.key: getattr(a.value, a.value.WhichOneof("value"))
                                    for a in s.attributes
                                },
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def take(self) -> list[dict]:
        with self.lock:
            spans, self.spans = self.spans, []
        return spans

    def stop(self) -> None:
        self.server.stop(None)


def wait_for(collector: Collector, done, timeout: float = 30.0, trace: str = "") -> list[dict]:
    """Spans received until `done(spans)` holds (the batch processors export every 50 ms); with
    `trace`, only that trace's (the orchestrator's start-up warm-up makes traces of its own)."""
    spans: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans += [s for s in collector.take() if not trace or s["trace"] == trace]
        if done(spans):
            time.sleep(0.3)  # anything that was still in flight
            return spans + [s for s in collector.take() if not trace or s["trace"] == trace]
        time.sleep(0.05)
    raise AssertionError(
        f"spans incomplete after {timeout} s: {sorted((s['service'], s['name']) for s in spans)}"
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_all(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def voice(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def deployment(voice, certs, collector, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN)
    with pytest.MonkeyPatch.context() as mp:
        for name in OTEL_VARS:
            mp.delenv(name, raising=False)
        info = ["--log-level", "info"]
        local = LocalDeployment(
            voice,
            tls_dir=certs,
            text_args=info,
            vocoder_args=info,
            orchestrator_args=["--api-token-file", str(token_file), *info],
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
                "OTEL_BSP_SCHEDULE_DELAY": "50",
            },
        )
        local.start()
    yield local
    local.stop()


def synthesize(deployment, certs, metadata=()) -> pb.LatencyReport:
    creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    with grpc.secure_channel(deployment.address, creds) as ch:
        responses = list(
            tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text="hello there. this is a test", request_id="traced"),
                metadata=(("authorization", f"Bearer {TOKEN}"), *metadata),
                timeout=120,
            )
        )
    assert any(r.HasField("audio") for r in responses)
    return responses[-1].report


def one(spans: list[dict], **match) -> dict:
    (found,) = [s for s in spans if all(s[k] == v for k, v in match.items())]
    return found


def complete(spans: list[dict]) -> bool:
    """The whole request is in: every span of the orchestrator's call and of both backends."""

    def count(service, name):
        return len([s for s in spans if s["service"] == service and s["name"] == name])

    return (
        count("orchestrator", SYNTHESIZE)
        == count("orchestrator", VOCODE)
        == count("vocoder-service", VOCODE)
        == 1
        and count("orchestrator", GENERATE)
        == count("text-service", GENERATE)
        == count("text-service", "decode")
        > 0
    )


def check_tree(spans: list[dict], report: pb.LatencyReport) -> dict:
    """Assert the span tree of one Synthesize call; returns the orchestrator's server span."""
    spans = [s for s in spans if s["trace"] == report.trace_id]  # not the start-up warm-up's
    assert {s["service"] for s in spans} == {"orchestrator", "text-service", "vocoder-service"}
    root = one(spans, service="orchestrator", name=SYNTHESIZE, kind=SERVER)
    assert root["attrs"]["splittts.request_id"] == "traced"
    children = [s for s in spans if s["parent"] == root["id"]]
    frontend = [s for s in children if s["name"] == "frontend"]
    assert frontend and all(
        s["kind"] == INTERNAL and s["service"] == "orchestrator" for s in frontend
    )

    # orchestrator -> text service: one Generate per sentence, each with its engine phases
    generate = [s for s in children if s["name"] == GENERATE]
    assert len(generate) == report.num_segments == 2 and all(s["kind"] == CLIENT for s in generate)
    text_side = [s for s in spans if s["service"] == "text-service" and s["name"] == GENERATE]
    assert sorted(s["parent"] for s in text_side) == sorted(s["id"] for s in generate)
    slack = 2_000_000  # 2 ms: each span's clock offset is read at its own moment
    for server in text_side:
        assert server["kind"] == SERVER
        phases = {s["name"]: s for s in spans if s["parent"] == server["id"]}
        assert set(phases) == {"queue", "prefill", "decode"}
        q, p, d = phases["queue"], phases["prefill"], phases["decode"]
        assert server["start"] - slack <= q["start"] <= q["end"] <= p["start"] + slack
        assert p["start"] <= p["end"] <= d["start"] + slack and d["start"] <= d["end"]
        assert d["end"] <= server["end"] + slack
        assert d["attrs"]["splittts.completion_tokens"] > 0
    # orchestrator -> vocoder: one stream, its compute spans
    client = one(children, name=VOCODE)
    assert client["kind"] == CLIENT
    vocoder = one(spans, service="vocoder-service", name=VOCODE)
    assert vocoder["kind"] == SERVER and vocoder["parent"] == client["id"]
    compute = [s for s in spans if s["parent"] == vocoder["id"]]
    assert compute and {s["name"] for s in compute} == {"compute"}
    assert len(compute) == vocoder["attrs"]["splittts.chunks"]
    assert all(vocoder["start"] <= s["start"] <= s["end"] <= vocoder["end"] for s in compute)
    total = sum(s["attrs"]["splittts.compute_ms"] for s in compute)
    assert total == pytest.approx(report.vocoder_compute_ms, rel=1e-6)
    return root


def test_one_request_is_one_trace_across_the_three_services(deployment, certs, collector):
    collector.take()
    report = synthesize(deployment, certs)
    spans = wait_for(collector, complete, trace=report.trace_id)
    assert len(report.trace_id) == 32 and int(report.trace_id, 16)
    root = check_tree(spans, report)
    assert root["parent"] == ""  # the call came without a traceparent: the trace starts here
    for name in ("orchestrator", "text-service", "vocoder-service"):  # their logs name that trace
        assert report.trace_id in "".join(deployment.by_name(name).stderr_tail), name
    assert all(s["status"] != trace_pb2.Status.STATUS_CODE_ERROR for s in spans)


def test_the_callers_traceparent_is_honoured(deployment, certs, collector):
    collector.take()
    report = synthesize(
        deployment, certs, (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),)
    )
    assert report.trace_id == CALLER_TRACE
    spans = wait_for(collector, complete, trace=CALLER_TRACE)
    root = check_tree(spans, report)  # every span in the caller's trace
    assert root["parent"] == CALLER_SPAN


def test_the_span_tree_with_the_sdks_in_memory_exporter(deployment, certs, collector, tmp_path):
    """The caller's client span -> an orchestrator whose spans the SDK's InMemorySpanExporter
    keeps (tests/in_memory_orchestrator.py) -> the same backends, exporting over OTLP."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans_file = tmp_path / "spans.jsonl"
    backends = [
        a
        for name in ("text-service", "vocoder-service")
        for a in (f"--{name}", deployment.by_name(name).address)
    ]
    orchestrator = start_service(
        "in-memory-orchestrator",
        "tests.in_memory_orchestrator",
        [
            "--voice",
            str(deployment.voice_dir),
            "--http-port",
            "-1",
            *backends,
            "--tls-ca",
            str(certs / "ca.pem"),
            "--tls-client-cert",
            str(certs / "orchestrator.pem"),
            "--tls-client-key",
            str(certs / "orchestrator-key.pem"),
        ],
        env={"SPLITTTS_TEST_SPANS_FILE": str(spans_file)},
    )
    caller = InMemorySpanExporter()  # the caller's own SDK, apart from this process's global one
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(caller))

    async def call() -> pb.LatencyReport:
        async with grpc.aio.insecure_channel(
            orchestrator.address, interceptors=aio_client_interceptors(provider)
        ) as ch:
            stream = tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                pb.SynthesizeRequest(text="hello there. this is a test", request_id="traced"),
                timeout=120,
            )
            return [r async for r in stream][-1].report

    collector.take()
    try:
        report = asyncio.run(call())
        backend_spans = wait_for(
            collector,
            lambda spans: (
                len([s for s in spans if s["name"] in (GENERATE, "decode")]) == 4
                and any(s["service"] == "vocoder-service" and s["name"] == VOCODE for s in spans)
            ),
            trace=report.trace_id,
        )
    finally:
        orchestrator.proc.send_signal(signal.SIGTERM)
        assert orchestrator.proc.wait(30) == 0
    (client,) = caller.get_finished_spans()
    assert client.kind == SpanKind.CLIENT and client.name == SYNTHESIZE
    assert format_trace_id(client.context.trace_id) == report.trace_id
    in_memory = [json.loads(line) for line in spans_file.read_text().splitlines()]
    root = check_tree(in_memory + backend_spans, report)
    assert root["parent"] == format_span_id(client.context.span_id)


def test_a_refused_token_is_on_the_server_span(deployment, certs, collector):
    collector.take()
    creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    with grpc.secure_channel(deployment.address, creds) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text="hello"),
                    timeout=30,
                    metadata=(("authorization", "Bearer wrong-token-0123456789"),),
                )
            )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    spans = wait_for(collector, lambda spans: any(s["name"] == SYNTHESIZE for s in spans))
    span = one(spans, name=SYNTHESIZE)  # the caller's fault: the status stays unset (semconv)
    assert span["attrs"]["rpc.grpc.status_code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert [s["name"] for s in spans] == [SYNTHESIZE]  # nothing went downstream


def test_health_checks_make_no_spans(deployment, collector):
    # the orchestrator checks both backends every second; none of that is traced
    collector.take()
    time.sleep(1.5)
    assert collector.take() == []


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_without_an_endpoint_nothing_is_exported_and_trace_ids_still_travel(voice, monkeypatch):
    # A collector on the exporter's default port would receive anything sent without the variable.
    default = Collector(4317) if _free(4317) else None
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    local = LocalDeployment(
        voice,
        text_args=["--log-level", "info"],
        vocoder_args=["--log-level", "info"],
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    try:
        local.start()
        with grpc.insecure_channel(local.address) as ch:
            responses = list(
                tts_pb2_grpc.TextToSpeechStub(ch).Synthesize(
                    pb.SynthesizeRequest(text="no collector here"), timeout=120
                )
            )
        report = responses[-1].report
        assert report.audio_s > 0 and len(report.trace_id) == 32
        deadline = time.monotonic() + 10

        def logs() -> str:
            return "".join(
                local.by_name("text-service").stderr_tail
                + local.by_name("vocoder-service").stderr_tail
            )

        while logs().count(report.trace_id) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert logs().count(report.trace_id) >= 2  # both backends logged the call's trace id
    finally:
        local.stop()  # each process flushes its spans at exit, were there any
        if default is not None:
            default.stop()
    if default is not None:
        assert default.take() == []


def test_without_an_endpoint_spans_record_nothing_and_no_exporter_loads():
    code = """
import sys
from opentelemetry import trace
from servicekit import tracing
tracing.setup("probe")
with tracing.span("frontend") as span:
    ctx = span.get_span_context()
    print(span.is_recording(), ctx.is_valid, tracing.trace_id() == trace.format_trace_id(ctx.trace_id))
print(any(m.startswith("opentelemetry.exporter") for m in sys.modules))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k not in OTEL_VARS}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out == ["False", "True", "True", "False"]
    disabled = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "OTEL_SDK_DISABLED": "true"},
        timeout=60,
        check=True,
    ).stdout.split()
    assert disabled == ["False", "False", "False", "False"]  # nothing at all: the API's no-op
