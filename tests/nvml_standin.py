"""A stand-in for the `pynvml` module: the NVML calls NvmlSource makes, over scripted GPUs.

Not NVML: it holds plain values so CPU tests can drive the collector through healthy, hot,
erroring and unsupported GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8


class NVMLError(Exception):
    """What pynvml raises; the stand-in raises it for an unsupported query."""


@dataclass
class StandinGpu:
    """One scripted GPU; None for a value makes its query raise NVMLError (unsupported)."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-standin-0"
    temp_c: int | None = 45
    used_bytes: int = 8 << 30
    total_bytes: int = 141 << 30
    util_gpu: int | None = 60
    util_memory: int = 30
    power_mw: int | None = 350_000
    ecc_uncorrected: int | None = 0


@dataclass
class StandinNvml:
    """Module-like object with the pynvml names NvmlSource uses."""

    gpus: list[StandinGpu]
    xids: list[tuple[int, int]] = field(default_factory=list)  # (gpu index, xid) still queued
    events_supported: bool = True
    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    initialised: bool = False

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> StandinGpu:
        return self.gpus[i]

    def nvmlDeviceGetName(self, h: StandinGpu) -> str:
        return h.name

    def nvmlDeviceGetUUID(self, h: StandinGpu) -> bytes:
        return h.uuid.encode()  # older pynvml returns bytes

    @staticmethod
    def _value(value):
        if value is None:
            raise NVMLError("Not Supported")
        return value

    def nvmlDeviceGetTemperature(self, h: StandinGpu, sensor: int) -> int:
        assert sensor == NVML_TEMPERATURE_GPU
        return self._value(h.temp_c)

    def nvmlDeviceGetMemoryInfo(self, h: StandinGpu):
        return SimpleNamespace(
            used=h.used_bytes, free=h.total_bytes - h.used_bytes, total=h.total_bytes
        )

    def nvmlDeviceGetUtilizationRates(self, h: StandinGpu):
        return SimpleNamespace(gpu=self._value(h.util_gpu), memory=h.util_memory)

    def nvmlDeviceGetPowerUsage(self, h: StandinGpu) -> int:
        return self._value(h.power_mw)

    def nvmlDeviceGetTotalEccErrors(self, h: StandinGpu, kind: int, counter: int) -> int:
        assert (kind, counter) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        return self._value(h.ecc_uncorrected)

    def nvmlEventSetCreate(self) -> object:
        if not self.events_supported:
            raise NVMLError("Not Supported")
        return object()

    def nvmlDeviceRegisterEvents(self, h: StandinGpu, kind: int, events: object) -> None:
        assert kind == nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int):
        assert timeout_ms == 0  # the collector must never wait for events
        if not self.xids:
            raise NVMLError("Timeout")
        gpu, xid = self.xids.pop(0)
        return SimpleNamespace(device=self.gpus[gpu], eventData=xid)
