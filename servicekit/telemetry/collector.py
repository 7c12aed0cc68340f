"""The device collector: sources for the device kind, read in a background thread, served on scrape."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import REGISTRY, CollectorRegistry, GaugeMetricFamily

from servicekit.telemetry.host import HostSource
from servicekit.telemetry.sample import Sample

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 15.0  # Prometheus' default scrape interval


class Source(Protocol):
    def read(self) -> list[Sample]: ...


def device_kind(name: str) -> str:
    """'npu', 'cuda' or 'cpu' for a --device value; 'auto' probes npu-smi, then NVML."""
    kind = name.lower().split(":")[0]
    if kind != "auto":
        return kind
    if shutil.which("npu-smi"):
        return "npu"
    try:
        import pynvml

        pynvml.nvmlInit()
        return "cuda" if pynvml.nvmlDeviceGetCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no library, no driver or no GPU all mean no CUDA
        return "cpu"


def sources_for(kind: str) -> list[Source]:
    """The host source, plus the accelerator's own when its tool or library is there."""
    sources: list[Source] = [HostSource()]
    try:
        if kind == "npu":
            from servicekit.telemetry.npu_smi import NpuSmiSource

            if shutil.which("npu-smi") is None:
                log.warning("no NPU gauges: npu-smi is not on PATH (mount it from the host)")
            else:
                sources.append(NpuSmiSource())
        elif kind == "cuda":
            from servicekit.telemetry.nvml import NvmlSource

            sources.append(NvmlSource())
    except Exception as exc:  # noqa: BLE001 - telemetry must never stop a service
        log.warning("no %s device gauges: %s", kind, exc)
    return sources


class DeviceCollector:
    """Keeps the latest readings of its sources; `collect()` (the scrape) only copies them."""

    def __init__(self, sources: list[Source], interval_s: float = DEFAULT_INTERVAL_S):
        self.sources, self.interval_s = sources, interval_s
        self._latest: list[list[Sample]] = [[] for _ in sources]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registry: CollectorRegistry | None = None

    def refresh(self) -> None:
        """Read every source once; a failing source keeps no stale values."""
        for i, source in enumerate(self.sources):
            try:
                readings = source.read()
            except Exception as exc:  # noqa: BLE001
                log.debug("device source %s failed: %s", type(source).__name__, exc)
                readings = []
            with self._lock:
                self._latest[i] = readings

    def _run(self) -> None:
        while True:
            self.refresh()
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> DeviceCollector:
        """Start the reading thread (a daemon: it never holds up shutdown)."""
        self._thread = threading.Thread(target=self._run, name="device-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading and leave the registry it was registered in (a later serve may re-add)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """The latest readings as gauge families (called by prometheus_client on each scrape)."""
        with self._lock:
            readings = [s for batch in self._latest for s in batch]
        families: dict[str, GaugeMetricFamily] = {}
        for s in readings:
            family = families.get(s.name)
            if family is None:
                family = families[s.name] = GaugeMetricFamily(
                    s.name, s.help, labels=sorted(s.labels)
                )
            family.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        return list(families.values())


def start_device_metrics(
    device: str, registry: CollectorRegistry = REGISTRY, interval_s: float = DEFAULT_INTERVAL_S
) -> DeviceCollector:
    """Register the gauges of the device named by a --device value ('auto', 'npu:0', 'cpu')."""
    kind = device_kind(device)
    collector = DeviceCollector(sources_for(kind), interval_s)
    registry.register(collector)
    collector._registry = registry
    return collector.start()
