"""A gauge of each gRPC service's health, so alerts see an engine that is up but not serving."""

from prometheus_client import Gauge

SERVING = Gauge(
    "splittts_service_serving",
    "1 while the service's grpc.health.v1 status is SERVING, else 0.",
    ["service"],
)


def record_health(state: dict[str, bool]) -> None:
    """Set the gauge from a {service name: serving} map ("" is the whole process)."""
    for name, ok in state.items():
        SERVING.labels(name or "process").set(1.0 if ok else 0.0)
