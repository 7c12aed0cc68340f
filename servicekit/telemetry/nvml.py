"""NVIDIA GPU gauges through NVML (`nvidia-ml-py`), named as DCGM's exporter names them."""

from __future__ import annotations

import logging
from typing import Any

from servicekit.telemetry.sample import Sample

log = logging.getLogger(__name__)

METRICS = (
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_XID_ERRORS",
)
_MIB = 1024 * 1024


class NvmlSource:
    """Every GPU NVML sees; `nvml` is the `pynvml` module (or a stand-in in tests)."""

    def __init__(self, nvml: Any = None):
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.labels = [self._labels(i, h) for i, h in enumerate(self.handles)]
        self.last_xid = [0.0] * len(self.handles)
        self.events = self._xid_events()

    def _labels(self, index: int, handle: Any) -> dict[str, str]:
        name = self.nvml.nvmlDeviceGetName(handle)
        uuid = self.nvml.nvmlDeviceGetUUID(handle)
        return {"gpu": str(index), "UUID": _text(uuid), "modelName": _text(name)}

    def _xid_events(self) -> Any:
        """An event set for critical XIDs, None where the driver or GPU does not offer one."""
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
            for handle in self.handles:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            return events
        except nvml.NVMLError as exc:
            log.info("XID events unavailable: %s", exc)
            return None

    def _drain_xids(self) -> None:
        """Record the latest XID per GPU from events queued since the last read (never waits)."""
        nvml = self.nvml
        while self.events is not None:
            try:
                data = nvml.nvmlEventSetWait_v2(self.events, 0)
            except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing queued
                return
            for i, handle in enumerate(self.handles):
                if data.device == handle:
                    self.last_xid[i] = float(data.eventData)

    def _optional(self, call, *args) -> Any:
        try:
            return call(*args)
        except self.nvml.NVMLError:  # not supported on this GPU (e.g. ECC off, no power sensor)
            return None

    def read(self) -> list[Sample]:
        """Temperature, framebuffer, utilisation, power, ECC and XID gauges of each GPU."""
        nvml = self.nvml
        self._drain_xids()
        out = []
        for i, (handle, labels) in enumerate(zip(self.handles, self.labels)):

            def add(name: str, help: str, value: float | None) -> None:  # this iteration only
                if value is not None:
                    out.append(Sample(name, help, float(value), labels))  # noqa: B023

            add(
                METRICS[0],
                "GPU temperature (C).",
                self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            )
            mem = self._optional(nvml.nvmlDeviceGetMemoryInfo, handle)
            if mem is not None:
                add(METRICS[1], "Framebuffer memory used (MiB).", mem.used / _MIB)
                add(METRICS[2], "Framebuffer memory free (MiB).", mem.free / _MIB)
            util = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            if util is not None:
                add(METRICS[3], "GPU utilisation (%).", util.gpu)
                add(METRICS[4], "Memory utilisation (%).", util.memory)
            power = self._optional(nvml.nvmlDeviceGetPowerUsage, handle)
            add(METRICS[5], "Power draw (W).", None if power is None else power / 1000.0)
            add(
                METRICS[6],
                "Uncorrectable (double-bit) ECC errors since the driver loaded.",
                self._optional(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    handle,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
            )
            add(
                METRICS[7],
                "Value of the last XID error seen (0 = none since start).",
                self.last_xid[i],
            )
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
