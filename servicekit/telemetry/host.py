"""Host gauges (`splittts_device_*`): CPU cores in use, CPU pressure, memory available."""

from __future__ import annotations

import os
from pathlib import Path

from servicekit.telemetry.sample import Sample

METRICS = (
    "splittts_device_cpu_cores",
    "splittts_device_cpu_cores_in_use",
    "splittts_device_cpu_pressure_some_ratio",
    "splittts_device_memory_available_bytes",
    "splittts_device_memory_total_bytes",
)


def parse_proc_stat(text: str) -> tuple[float, float]:
    """(busy, total) jiffies summed over all CPUs from the `cpu` line of /proc/stat."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [float(v) for v in fields[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
            # guest times are already counted in user and nice
            total = sum(values[:8])
            return total - idle, total
    raise ValueError("/proc/stat has no aggregate 'cpu' line")


def parse_pressure(text: str) -> float | None:
    """The `some avg10` share (0-1) of /proc/pressure/cpu, None when the line is missing."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for item in fields[1:]:
                key, _, value = item.partition("=")
                if key == "avg10":
                    return float(value) / 100.0
    return None


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes by field name."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


class HostSource:
    """Reads /proc; cores in use is the busy share since the previous read times the core count."""

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self._last: tuple[float, float] | None = None

    def _read(self, name: str) -> str | None:
        try:
            return (self.proc / name).read_text()
        except OSError:
            return None

    def read(self) -> list[Sample]:
        """Current host gauges; any file the kernel does not offer is skipped."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        online = os.cpu_count() or 1
        out = [Sample(METRICS[0], "CPU cores this process may run on.", float(cores or 1))]
        stat = self._read("stat")
        if stat is not None:
            busy, total = parse_proc_stat(stat)
            if self._last is not None and total > self._last[1]:
                share = (busy - self._last[0]) / (total - self._last[1])
                out.append(
                    Sample(
                        METRICS[1], "Host CPU cores busy since the previous read.", share * online
                    )
                )
            self._last = (busy, total)
        pressure = self._read("pressure/cpu")
        some = parse_pressure(pressure) if pressure is not None else None
        if some is not None:
            out.append(
                Sample(
                    METRICS[2],
                    "Share of the last 10 s some task waited for a CPU (/proc/pressure/cpu).",
                    some,
                )
            )
        mem = parse_meminfo(self._read("meminfo") or "")
        if "MemAvailable" in mem:
            out.append(
                Sample(
                    METRICS[3],
                    "Host memory available for new allocations.",
                    float(mem["MemAvailable"]),
                )
            )
        if "MemTotal" in mem:
            out.append(Sample(METRICS[4], "Host memory in total.", float(mem["MemTotal"])))
        return out
