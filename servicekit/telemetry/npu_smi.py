"""Ascend NPU gauges from `npu-smi info`, named as the Ascend exporter names them."""

from __future__ import annotations

import logging
import re
import subprocess
from dataclasses import dataclass, field

from servicekit.telemetry.sample import Sample

log = logging.getLogger(__name__)

METRICS = (
    "npu_chip_info_health_status",
    "npu_chip_info_temperature",
    "npu_chip_info_power",
    "npu_chip_info_utilization",
    "npu_chip_info_hbm_used_memory",
    "npu_chip_info_hbm_total_memory",
    "npu_chip_info_hbm_utilization",
    "npu_chip_info_hbm_bandwidth_utilization",
    "npu_chip_info_used_memory",
    "npu_chip_info_total_memory",
    "npu_chip_info_error_code",
)
HEALTHY = {"OK"}  # npu-smi also reports Warning, Alarm, Critical (and UNKNOWN when unreachable)

_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_PAIR = re.compile(r"(\S+)\s*/\s*(\S+)")


@dataclass
class Chip:
    """One chip's row pair of the `npu-smi info` table."""

    npu: str
    chip: str
    name: str
    health: str
    power_w: float | None = None
    temp_c: float | None = None
    aicore_pct: float | None = None
    usage_mb: dict[str, tuple[float, float]] = field(default_factory=dict)  # used, total


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "NA", "-", empty
        return None


def _cells(line: str) -> list[str] | None:
    line = line.strip()
    if not line.startswith("|") or set(line) <= set("|+-= "):
        return None
    return [c.strip() for c in line.strip("|").split("|")]


def _usage_names(header: str) -> list[str]:
    """The `...-Usage(MB)` column names of the second header row, in order."""
    return re.findall(r"([A-Za-z]+)-Usage\(MB\)", header)


def parse_info(text: str) -> list[Chip]:
    """Chips of the first (device) table of `npu-smi info`; process tables are ignored.

    Each chip is two rows: `NPU Name | Health | Power Temp Hugepages` then
    `Chip [Device] | Bus-Id | AICore Memory-Usage [HBM-Usage]`. Unreadable values ("NA") are None.
    """
    chips: list[Chip] = []
    usage_names = ["Memory", "HBM"]
    top: list[str] | None = None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line:
            break
        cells = _cells(line)
        if not cells or len(cells) < 3:
            continue
        if "Bus-Id" in cells[1]:
            usage_names = _usage_names(cells[2]) or usage_names
            continue
        if _BUS_ID.match(cells[1]) and top is not None:
            first, rest = top[0].split(), cells[2].split(maxsplit=1)
            chip = Chip(
                npu=first[0],
                chip=cells[0].split()[0] if cells[0] else "0",
                name=" ".join(first[1:]),
                health=top[1],
            )
            values = top[2].split()
            chip.power_w = _number(values[0]) if values else None
            chip.temp_c = _number(values[1]) if len(values) > 1 else None
            chip.aicore_pct = _number(rest[0]) if rest else None
            pairs = _PAIR.findall(rest[1]) if len(rest) > 1 else []
            for kind, (used, total) in zip(usage_names, pairs):
                if _number(used) is not None and _number(total) is not None:
                    chip.usage_mb[kind] = (float(used), float(total))
            chips.append(chip)  # a chip row with no NPU row of its own keeps the card's
            continue
        if cells[0].split() and cells[0].split()[0].isdigit() and len(cells[0].split()) >= 2:
            top = cells
    return chips


def parse_fields(text: str) -> dict[str, str]:
    """`Key : value` lines of `npu-smi info -t usages|temp|memory|health -i N -c C`."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def _field(fields: dict[str, str], *names: str) -> float | None:
    for name in names:
        if name in fields:
            return _number(fields[name])
    return None


def _error_code(text: str | None) -> float | None:
    """The first hex code of an `Error Code : 80E18005 ...` field, 0 for none."""
    codes = re.findall(r"[0-9A-Fa-f]+", text or "")
    if text is None or not codes:
        return None
    return float(int(codes[0], 16))


def samples(chips: list[Chip], usages: dict[tuple[str, str], dict[str, str]]) -> list[Sample]:
    """Gauges for parsed chips; `usages` holds each chip's `-t usages` and `-t health` fields."""
    out = []
    for c in chips:
        labels = {"device": c.npu if c.chip == "0" else f"{c.npu}-{c.chip}", "model": c.name}

        def add(name: str, help: str, value: float | None) -> None:  # used in this iteration only
            if value is not None:
                out.append(Sample(name, help, value, labels))  # noqa: B023

        add(
            METRICS[0],
            "1 when npu-smi reports the chip's health OK, else 0.",
            1.0 if c.health in HEALTHY else 0.0,
        )
        add(METRICS[1], "Chip temperature (C).", c.temp_c)
        add(METRICS[2], "Chip power draw (W).", c.power_w)
        add(METRICS[3], "AI Core utilisation (%).", c.aicore_pct)
        hbm = c.usage_mb.get("HBM")
        if hbm is not None:
            add(METRICS[4], "HBM in use (MB).", hbm[0])
            add(METRICS[5], "HBM in total (MB).", hbm[1])
        mem = c.usage_mb.get("Memory")
        if mem is not None and mem[1] > 0:
            add(METRICS[8], "Chip DDR memory in use (MB).", mem[0])
            add(METRICS[9], "Chip DDR memory in total (MB).", mem[1])
        fields = usages.get((c.npu, c.chip), {})
        add(METRICS[6], "HBM capacity in use (%).", _field(fields, "HBM Usage Rate(%)"))
        add(METRICS[7], "HBM bandwidth in use (%).", _field(fields, "HBM Bandwidth Usage Rate(%)"))
        add(
            METRICS[10],
            "First error code npu-smi reports for the chip (0 = none).",
            _error_code(fields.get("Error Code")),
        )
    return out


class NpuSmiSource:
    """Runs `npu-smi info`, then `-t usages` and `-t health` per chip, in the caller's thread."""

    def __init__(self, binary: str = "npu-smi", timeout_s: float = 10.0):
        self.binary, self.timeout_s = binary, timeout_s

    def _run(self, *args: str) -> str:
        return subprocess.run(
            [self.binary, "info", *args],
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            check=True,
        ).stdout

    def read(self) -> list[Sample]:
        """Gauges of every chip npu-smi lists; a failed per-chip query drops only its fields."""
        chips = parse_info(self._run())
        usages: dict[tuple[str, str], dict[str, str]] = {}
        for c in chips:
            fields = usages.setdefault((c.npu, c.chip), {})
            for query in ("usages", "health"):
                try:
                    fields.update(parse_fields(self._run("-t", query, "-i", c.npu, "-c", c.chip)))
                except (OSError, subprocess.SubprocessError) as exc:
                    log.debug("npu-smi -t %s of NPU %s chip %s: %s", query, c.npu, c.chip, exc)
        return samples(chips, usages)
