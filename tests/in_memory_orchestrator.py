"""`python -m tests.in_memory_orchestrator`: the orchestrator with its spans kept by the SDK's
InMemorySpanExporter, written as JSON lines to `SPLITTTS_TEST_SPANS_FILE` once it has stopped.

The provider is installed before `main`, so `servicekit.tracing.setup` keeps it.
"""

from __future__ import annotations

import json
import os
import sys

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import servicekit  # noqa: F401  (torch backend auto-loading off before torch loads)
from orchestrator.__main__ import main


def as_dict(span) -> dict:
    """A finished span in the shape tests/test_tracing.py reads (OTLP's kind and status codes)."""
    ctx = span.get_span_context()
    return {
        "service": span.resource.attributes["service.name"],
        "name": span.name,
        "kind": span.kind.value + 1,
        "trace": trace.format_trace_id(ctx.trace_id),
        "id": trace.format_span_id(ctx.span_id),
        "parent": trace.format_span_id(span.parent.span_id) if span.parent else "",
        "start": span.start_time,
        "end": span.end_time,
        "status": span.status.status_code.value,
        "attrs": dict(span.attributes),
    }


if __name__ == "__main__":
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "orchestrator"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    code = main()
    with open(os.environ["SPLITTTS_TEST_SPANS_FILE"], "w") as f:
        f.writelines(json.dumps(as_dict(span)) + "\n" for span in exporter.get_finished_spans())
    sys.exit(code)
