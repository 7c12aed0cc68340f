"""Start a grpc.aio server with health, reflection, Prometheus metrics and a SIGTERM drain."""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import logging
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from servicekit.errors import StartupError, as_status_error
from servicekit.telemetry.collector import start_device_metrics
from servicekit.telemetry.serving import record_health
from servicekit.tls import ServerTLS, warn_if_exposed
from servicekit.tracing import server_interceptor, trace_id

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Service:
    """One gRPC service to host: its full name, the generated add function and the servicer.

    A servicer with a `ready() -> bool` method has its service's health follow it once warm.
    """

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    status = as_status_error(exc)
    if status is not None:
        trailers: tuple[tuple[str, str], ...] = ()
        if status.retry_after_s is not None:
            trailers = (("grpc-retry-pushback-ms", str(round(1e3 * status.retry_after_s))),)
        await context.abort(status.code, str(status), trailing_metadata=trailers)
    # The caller learns only that it failed and the id to quote; the details stay in the log.
    error_id = trace_id(context) or secrets.token_hex(16)
    log.error(
        "unhandled error in %s",
        method,
        exc_info=exc,
        extra={"fields": {"method": method, "trace_id": error_id}},
    )
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}; logged with trace id {error_id}"
    )


def _guard(behavior: Callable, method: str) -> Callable:
    """Wrap a handler so StatusError maps to its code and anything else to INTERNAL."""
    passthrough = (asyncio.CancelledError, grpc.aio.AbortError)
    if inspect.isasyncgenfunction(behavior):

        async def stream_wrapper(request, context):
            try:
                async for item in behavior(request, context):
                    yield item
            except passthrough:
                raise
            except Exception as exc:  # noqa: BLE001 - the whole point of the guard
                await _abort(context, method, exc)

        return stream_wrapper

    async def unary_wrapper(request, context):
        try:
            return await behavior(request, context)
        except passthrough:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method, exc)

    return unary_wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns StatusError into its status and unexpected exceptions into INTERNAL, logged."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        for kind, factory in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return factory(
                    _guard(behavior, method),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def _check_port_free(host: str, port: int, what: str) -> None:
    """Raise StartupError when another socket already listens on host:port (0 is always free)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise StartupError(
            f"{what} {host}:{port}: cannot resolve the host ({exc.strerror})"
        ) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise StartupError(
                        f"{what} {host}:{port} is already in use by another process"
                    ) from None


async def _set_health(
    health_servicer, services: list[Service], last: dict[str, bool] | None = None
) -> dict[str, bool]:
    """Each service SERVING while its servicer is ready (one without `ready()` always is).

    The server's own entry, "", stays SERVING until the drain: it says the process is alive
    (a liveness probe), the service names say whether to send it calls (a readiness probe).
    """
    state = {
        s.name: bool(s.servicer.ready()) if callable(getattr(s.servicer, "ready", None)) else True
        for s in services
    }
    state[""] = True
    record_health(state)
    for name, ok in state.items():
        if last is None or last.get(name) != ok:
            if last is not None:
                log.warning("health of %s is now %s", name, "SERVING" if ok else "NOT_SERVING")
            await health_servicer.set(
                name,
                health_pb2.HealthCheckResponse.SERVING
                if ok
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
    return state


async def _follow_readiness(
    health_servicer, services: list[Service], state: dict[str, bool], interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        state = await _set_health(health_servicer, services, state)


async def serve(
    services: list[Service],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = 0,
    warmup: Callable[[], Awaitable[None] | None] | None = None,
    grace_s: float = 10.0,
    on_stop: Callable[[], Awaitable[None] | None] | None = None,
    stop_event: asyncio.Event | None = None,
    serving_info: Callable[[int], Awaitable[dict] | dict] | None = None,
    ready_interval_s: float = 0.5,
    device: str | None = None,
    tls: ServerTLS | None = None,
    reflection_on: bool = True,
    health_port: int | None = None,
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop_event`), then drain in-flight calls for `grace_s`.

    Health reports NOT_SERVING until `warmup` returns and again while draining. Once serving, one
    JSON line `{"event": "serving", "port": ..., "metrics_port": ...}` goes to stdout so a parent
    process that asked for port 0 learns the bound ports. `serving_info`, called with the bound
    gRPC port once warm, returns extra fields for that line (e.g. another port it bound).
    A servicer's `ready()` is polled every `ready_interval_s` once warm. A busy port raises
    StartupError before anything starts. With metrics, `device` (a --device value) adds the gauges
    of the card or host the service runs on. With `tls` the gRPC port (and the metrics port, with
    the same certificate) is TLS, mutual when it has a client CA; `interceptors` run inside the
    call's OpenTelemetry server span and before the error guard (e.g. authentication).
    `health_port` (0 picks one) serves grpc.health.v1 alone in plaintext, for probes that cannot
    speak TLS; the serving line reports it.
    """
    if metrics_port is not None and metrics_port < 0:
        metrics_port = None
    _check_port_free(host, port, "gRPC port")
    if metrics_port is not None:
        _check_port_free(host, metrics_port, "metrics port")
    # the span first, so that it sees every outcome: a refused token, a mapped error
    server = grpc.aio.server(
        interceptors=[server_interceptor(), *(interceptors or ()), ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # gRPC sets SO_REUSEPORT by default, which lets a second server share a busy port
            ("grpc.so_reuseport", 0),
        ],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    for s in services:
        s.add_to_server(s.servicer, server)
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    record_health(dict.fromkeys(["", *names], False))
    if reflection_on:
        reflection.enable_server_reflection(
            [
                *names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
    try:
        bound_port = (
            server.add_secure_port(f"{host}:{port}", tls.credentials())
            if tls
            else server.add_insecure_port(f"{host}:{port}")
        )
    except RuntimeError:  # grpcio >= 1.50 raises where older versions returned 0
        bound_port = 0
    if bound_port == 0:
        raise StartupError(
            f"gRPC port {host}:{port} could not be bound (in use, or not an address of this host)"
        )
    warn_if_exposed(host, bound_port, tls)
    health_server, bound_health = None, None
    if health_port is not None and health_port >= 0:
        _check_port_free(host, health_port, "health port")
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        bound_health = health_server.add_insecure_port(f"{host}:{health_port}")
        await health_server.start()
    await server.start()

    bound_metrics, telemetry = None, None
    if metrics_port is not None:
        try:
            httpd, _ = start_http_server(
                metrics_port,
                addr=host,
                certfile=tls.cert_path if tls else None,
                keyfile=tls.key_path if tls else None,
            )
        except OSError as exc:
            await server.stop(None)
            if health_server is not None:
                await health_server.stop(None)
            raise StartupError(
                f"metrics port {host}:{metrics_port} could not be bound: {exc.strerror or exc}"
            ) from None
        bound_metrics = httpd.server_port
        if device is not None:
            # NVML's set-up and npu-smi probing stay off the event loop too
            telemetry = await asyncio.to_thread(start_device_metrics, device)

    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass

    if warmup is not None:
        result = warmup()
        if inspect.isawaitable(result):
            await result
    try:
        extra = serving_info(bound_port) if serving_info is not None else {}
        if inspect.isawaitable(extra):
            extra = await extra
    except BaseException:
        await server.stop(None)
        if health_server is not None:
            await health_server.stop(None)
        raise
    state = await _set_health(health_servicer, services)
    readiness = loop.create_task(
        _follow_readiness(health_servicer, services, state, ready_interval_s)
    )
    print(
        json.dumps(
            {
                "event": "serving",
                "services": names,
                "host": host,
                "port": bound_port,
                "metrics_port": bound_metrics,
                **({"health_port": bound_health} if health_server else {}),
                **(extra or {}),
            }
        ),
        flush=True,
    )

    await stop.wait()
    readiness.cancel()
    await asyncio.gather(readiness, return_exceptions=True)
    await health_servicer.enter_graceful_shutdown()
    record_health(dict.fromkeys(state, False))
    log.info("draining for up to %.1f s", grace_s)
    await server.stop(grace_s)
    if telemetry is not None:
        await asyncio.to_thread(telemetry.stop)  # joins a read that may still be running
    if health_server is not None:
        await health_server.stop(None)
    if on_stop is not None:
        result = on_stop()
        if inspect.isawaitable(result):
            await result
    print(json.dumps({"event": "stopped", "port": bound_port}), flush=True)
    sys.stdout.flush()
