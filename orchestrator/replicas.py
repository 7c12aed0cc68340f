"""Replicas of a backend service: least-in-flight choice, health checks, skip the unhealthy."""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servicekit.errors import Unavailable
from servicekit.tracing import client_interceptors

log = logging.getLogger(__name__)

_DOWN_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


class Replica:
    """One address of a backend, its channel and its load."""

    def __init__(
        self,
        address: str,
        credentials: grpc.ChannelCredentials | None = None,
        options: tuple[tuple[str, int], ...] = (),
    ):
        self.address = address
        channel_options: list[tuple[str, str | int]] = [
            *options,
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.enable_retries", 0),
            # reconnect soon after a replica comes back (the default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # a DNS name with several addresses (a headless Service) spreads calls over them
            ("grpc.lb_policy_name", "round_robin"),
        ]
        traced = client_interceptors()  # a CLIENT span and `traceparent` on each call
        self.channel = (
            grpc.aio.secure_channel(
                address, credentials, options=channel_options, interceptors=traced
            )
            if credentials is not None
            else grpc.aio.insecure_channel(address, options=channel_options, interceptors=traced)
        )
        self.in_flight = 0
        self.healthy = True

    def __repr__(self) -> str:
        return f"Replica({self.address}, in_flight={self.in_flight}, healthy={self.healthy})"


class ReplicaPool:
    """Requests go to the healthy replica with the fewest in flight; checks run in the background.

    With `credentials` every replica is dialled over TLS (mutual when they hold a certificate);
    `channel_options` are added to every replica's channel.
    """

    def __init__(
        self,
        addresses: list[str],
        service: str,
        check_interval_s: float = 1.0,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: tuple[tuple[str, int], ...] = (),
    ):
        if not addresses:
            raise ValueError(f"at least one {service} address is required")
        self.service = service
        self.replicas = [Replica(a, credentials, channel_options) for a in addresses]
        self.check_interval_s = check_interval_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for r in self.replicas:
            await r.channel.close()

    @property
    def any_healthy(self) -> bool:
        """True while at least one replica passed its latest health check."""
        return any(r.healthy for r in self.replicas)

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def pick(self, exclude: tuple[Replica, ...] = ()) -> Replica:
        """The healthy replica with the fewest requests in flight."""
        candidates = [
            r
            for r in self.replicas
            if r.healthy
            and r not in exclude
            and r.channel.get_state(try_to_connect=True) not in _DOWN_STATES
        ]
        if not candidates:
            raise Unavailable(
                f"no healthy {self.service} replica ("
                + ", ".join(r.address for r in self.replicas)
                + ")"
            )
        return min(candidates, key=lambda r: r.in_flight)

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("%s replica %s marked down: %s", self.service, replica.address, reason)
        replica.healthy = False

    @contextmanager
    def lease(self, replica: Replica):
        """Count a request against `replica` while it runs."""
        replica.in_flight += 1
        try:
            yield replica
        finally:
            replica.in_flight -= 1

    async def check(self, replica: Replica) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=1.0
            )
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            ok = False
            reason = exc.code().name
        else:
            reason = "NOT_SERVING"
        if ok and not replica.healthy:
            log.warning("%s replica %s is healthy again", self.service, replica.address)
        elif not ok:
            self.mark_down(replica, reason)
        replica.healthy = ok
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            await self.check_all()
