"""OpenTelemetry tracing: one tracer provider per process, a span on each side of every gRPC hop.

Spans leave the process over OTLP/gRPC only when OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set. Without either there is no exporter and no span
records anything, yet trace ids are still made and travel in `traceparent` metadata, so every
log line and LatencyReport of a call names one trace. OTEL_SDK_DISABLED=true installs nothing:
a caller's `traceparent` is then passed on as it came.
"""

from __future__ import annotations

import os
import time

import grpc
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import any_of, negate, service_name, service_prefix

# probes and reflection would be most of the spans and say nothing about a request
_TRACED = negate(any_of(service_name("grpc.health.v1.Health"), service_prefix("grpc.reflection.")))
_tracer = trace.get_tracer("splittts")  # follows the provider that setup() installs


def exporting() -> bool:
    """Whether an OTLP endpoint for traces is configured."""
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def build_provider(service: str):
    """The TracerProvider for `service` (OTEL_SERVICE_NAME overrides it); None when
    OTEL_SDK_DISABLED is true."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service})
    if not exporting():
        return TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # OTEL_EXPORTER_OTLP_*
    return provider


def setup(service: str) -> None:
    """Install this process's tracer provider, before any server or channel is made; a process
    that has one keeps it (a provider cannot be replaced)."""
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    provider = build_provider(service)
    if provider is not None:
        trace.set_tracer_provider(provider)  # flushed and shut down at exit


def server_interceptor() -> grpc.aio.ServerInterceptor:
    """A SERVER span around each call, the child of the caller's `traceparent` when it sent one."""
    return aio_server_interceptor(filter_=_TRACED)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """A CLIENT span around each outgoing call; its `traceparent` goes in the call's metadata."""
    return aio_client_interceptors(filter_=_TRACED)


def span(name: str, **attributes):
    """A child span of the current one, current itself while the `with` block runs."""
    return _tracer.start_as_current_span(name, attributes=attributes)


def annotate(**attributes) -> None:
    """Set attributes on the current span (a no-op when it does not record)."""
    trace.get_current_span().set_attributes(attributes)


def record_span(name: str, start: float, end: float, **attributes) -> None:
    """A finished child span of the current one between two `time.perf_counter()` readings;
    nothing unless the current span records."""
    if not trace.get_current_span().is_recording():
        return
    now_ns, now = time.time_ns(), time.perf_counter()
    s = _tracer.start_span(
        name, start_time=now_ns - round(1e9 * (now - start)), attributes=attributes
    )
    s.end(end_time=now_ns - round(1e9 * (now - end)))


def trace_id(context: grpc.aio.ServicerContext | None = None) -> str | None:
    """The W3C trace id (32 hex digits) of the call being served: its span's, else that of the
    `traceparent` in the call's metadata; None when there is neither."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid and context is not None:
        carrier = dict(context.invocation_metadata() or ())
        ctx = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None
