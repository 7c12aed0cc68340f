"""The device collector's cost: CPU seconds per refresh, and its share of a core per scrape interval.

The npu-smi source is timed on a shell script that prints the hand-written samples (no card
here), so its figure is the cost of the process start-ups and the parser, not of a real
npu-smi; on a card, run with `--npu-smi npu-smi`.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

from servicekit.telemetry.collector import DEFAULT_INTERVAL_S, DeviceCollector
from servicekit.telemetry.host import HostSource
from servicekit.telemetry.npu_smi import NpuSmiSource

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "npu_smi"


def sample_npu_smi(folder: Path) -> str:
    """A script that prints the 910B3 samples in npu-smi's place."""
    script = folder / "npu-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *usages*) cat {FIXTURES}/usages_910b3.txt;;\n'
        f"  *health*) cat {FIXTURES}/health_ok.txt;;\n"
        f"  *) cat {FIXTURES}/info_910b3.txt;; esac\n"
    )
    script.chmod(0o755)
    return str(script)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cost(collector: DeviceCollector, rounds: int) -> float:
    """CPU seconds (this process and the tools it runs) per refresh and scrape."""
    start = _cpu_s()
    for _ in range(rounds):
        collector.refresh()
        collector.collect()
    return (_cpu_s() - start) / rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    p.add_argument("--npu-smi", default=None, help="a real npu-smi (default: the samples)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = args.npu_smi or sample_npu_smi(Path(tmp))
        figures = {}
        for name, sources in (
            ("host", [HostSource()]),
            ("npu-smi+host", [HostSource(), NpuSmiSource(binary)]),
        ):
            per_refresh = cost(DeviceCollector(sources), args.rounds)
            figures[name] = {
                "cpu_ms_per_refresh": round(1e3 * per_refresh, 3),
                "core_share_at_interval": round(per_refresh / args.interval, 6),
            }
    print(json.dumps({"interval_s": args.interval, **figures}))


if __name__ == "__main__":
    main()
