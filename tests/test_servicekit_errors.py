"""servicekit's error interceptor on a real gRPC server on 127.0.0.1: statuses, never class names."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.errors import InvalidArgument
from servicekit.server import ErrorInterceptor

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = (("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01"),)


class QueueFull(Exception):
    """A core error that names its gRPC code, as the engine's errors do."""

    status_code = "RESOURCE_EXHAUSTED"


class Faulty(health_pb2_grpc.HealthServicer):
    """Check raises what the request's service name asks for; Watch fails after one message."""

    async def Check(self, request, context):
        if request.service == "bug":
            raise KeyError("slot 0x7f3a in table")
        if request.service == "full":
            raise QueueFull("12 requests are already waiting; retry later")
        if request.service == "bad":
            raise InvalidArgument("service: must be a known name")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request, context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        raise ZeroDivisionError("division by zero in step 3")


async def call(method: str, service: str):
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(Faulty(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            request = health_pb2.HealthCheckRequest(service=service)
            try:
                if method == "Check":
                    await stub.Check(request, metadata=TRACEPARENT, timeout=10)
                else:
                    async for _ in stub.Watch(request, metadata=TRACEPARENT, timeout=10):
                        pass
            except grpc.aio.AioRpcError as exc:
                return exc
    finally:
        await server.stop(None)
    raise AssertionError("the call succeeded")


@pytest.mark.parametrize(
    "method, service, secret",
    [
        ("Check", "bug", ("KeyError", "0x7f3a")),
        ("Watch", "", ("ZeroDivisionError", "step 3")),
    ],
)
def test_unexpected_errors_are_internal_with_a_trace_id_and_logged(method, service, secret, caplog):
    with caplog.at_level(logging.ERROR, logger="servicekit.server"):
        err = asyncio.run(call(method, service))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == (
        f"internal error in /grpc.health.v1.Health/{method}; logged with trace id {TRACE}"
    )
    assert not any(s in err.details() for s in secret)
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.fields["trace_id"] == TRACE and isinstance(record.exc_info[1], Exception)
    assert secret[1] in str(record.exc_info[1])


def test_core_errors_map_by_their_status_code_with_a_retry_hint():
    err = asyncio.run(call("Check", "full"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "12 requests are already waiting; retry later"
    assert dict(err.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"


def test_status_errors_keep_their_code_and_message():
    err = asyncio.run(call("Check", "bad"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "service: must be a known name"
    assert "grpc-retry-pushback-ms" not in dict(err.trailing_metadata())
