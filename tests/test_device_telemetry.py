"""Device gauges: npu-smi parsing on hand-written samples, NVML through a stand-in, host /proc."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from servicekit.telemetry import host, npu_smi, nvml
from servicekit.telemetry.collector import DeviceCollector, device_kind, start_device_metrics
from servicekit.telemetry.sample import Sample
from tests.nvml_standin import StandinGpu, StandinNvml

FIXTURES = Path(__file__).parent / "fixtures" / "npu_smi"


def fixture(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


def by_name(samples: list[Sample], name: str) -> dict[str, float]:
    return {
        s.labels.get("device", s.labels.get("gpu", "")): s.value for s in samples if s.name == name
    }


# -- npu-smi ---------------------------------------------------------------------------------


def test_910b3_table_gives_every_chip_with_hbm_and_ai_core():
    chips = npu_smi.parse_info(fixture("info_910b3"))
    assert [(c.npu, c.chip, c.name, c.health) for c in chips] == [
        ("0", "0", "910B3", "OK"),
        ("1", "0", "910B3", "Warning"),
    ]
    assert (chips[0].power_w, chips[0].temp_c, chips[0].aicore_pct) == (181.4, 52.0, 87.0)
    assert chips[0].usage_mb["HBM"] == (51213.0, 65536.0)  # "51213/ 65536": no space before /
    assert chips[1].usage_mb["HBM"] == (3411.0, 65536.0)
    samples = npu_smi.samples(chips, {})
    assert by_name(samples, "npu_chip_info_temperature") == {"0": 52.0, "1": 88.0}
    assert by_name(samples, "npu_chip_info_health_status") == {"0": 1.0, "1": 0.0}
    assert by_name(samples, "npu_chip_info_hbm_used_memory") == {"0": 51213.0, "1": 3411.0}
    assert {s.labels["model"] for s in samples} == {"910B3"}
    assert "npu_chip_info_used_memory" not in {s.name for s in samples}  # 0 / 0 DDR: none


def test_910prob_reports_ddr_and_hbm_columns_apart():
    (chip,) = npu_smi.parse_info(fixture("info_910prob"))
    assert chip.name == "910ProB" and chip.usage_mb == {
        "Memory": (2008.0, 15079.0),
        "HBM": (0.0, 32768.0),
    }
    samples = npu_smi.samples([chip], {})
    assert by_name(samples, "npu_chip_info_total_memory") == {"0": 15079.0}
    assert by_name(samples, "npu_chip_info_hbm_total_memory") == {"0": 32768.0}


def test_310p3_has_a_device_column_and_no_hbm():
    (chip,) = npu_smi.parse_info(fixture("info_310p3"))
    assert (chip.npu, chip.chip, chip.name) == ("4", "0", "310P3")
    assert chip.power_w is None and chip.temp_c == 46.0 and chip.aicore_pct == 23.0
    assert chip.usage_mb == {"Memory": (3021.0, 21527.0)}
    names = {s.name for s in npu_smi.samples([chip], {})}
    assert "npu_chip_info_power" not in names and "npu_chip_info_hbm_used_memory" not in names


def test_card_in_error_is_unhealthy_and_reports_no_made_up_values():
    chips = npu_smi.parse_info(fixture("info_910b3_error"))
    bad = chips[1]
    assert bad.health == "Critical" and bad.temp_c is None and bad.aicore_pct is None
    assert "HBM" not in bad.usage_mb
    fields = {
        ("0", "0"): npu_smi.parse_fields(fixture("health_ok")),
        ("1", "0"): npu_smi.parse_fields(fixture("health_error")),
    }
    samples = npu_smi.samples(chips, fields)
    assert by_name(samples, "npu_chip_info_health_status") == {"0": 1.0, "1": 0.0}
    assert by_name(samples, "npu_chip_info_error_code") == {"0": 0.0, "1": float(0x80E18005)}
    assert by_name(samples, "npu_chip_info_temperature") == {"0": 41.0}


def test_a_chip_row_without_its_own_npu_row_keeps_the_cards():
    # tolerance, not a recorded layout: the 910B3 sample with a second chip row under card 0
    lines = fixture("info_910b3").splitlines()
    second = lines[7].replace(
        "| 0                         | 0000:C1:00.0  | 87 ",
        "| 1                         | 0000:C1:01.0  | 33 ",
    )
    assert second != lines[7]
    chips = npu_smi.parse_info("\n".join(lines[:8] + [second] + lines[8:]))
    assert [(c.npu, c.chip, c.aicore_pct) for c in chips] == [
        ("0", "0", 87.0),
        ("0", "1", 33.0),
        ("1", "0", 12.0),
    ]
    assert chips[1].temp_c == 52.0 and chips[1].name == "910B3"
    assert {s.labels["device"] for s in npu_smi.samples(chips, {})} == {"0", "0-1", "1"}


def test_usages_query_gives_hbm_bandwidth_and_capacity_rates():
    fields = npu_smi.parse_fields(fixture("usages_910b3"))
    chips = npu_smi.parse_info(fixture("info_910b3"))[:1]
    samples = npu_smi.samples(chips, {("0", "0"): fields})
    assert by_name(samples, "npu_chip_info_hbm_bandwidth_utilization") == {"0": 64.0}
    assert by_name(samples, "npu_chip_info_hbm_utilization") == {"0": 78.0}


def test_source_runs_npu_smi_for_the_table_and_each_chip(tmp_path):
    # A shell script that prints the samples in npu-smi's place, recording its arguments.
    log = tmp_path / "calls"
    script = tmp_path / "npu-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        f'case "$*" in *usages*) cat {FIXTURES}/usages_910b3.txt;;\n'
        f"  *health*) cat {FIXTURES}/health_ok.txt;;\n"
        f"  *) cat {FIXTURES}/info_910b3.txt;; esac\n"
    )
    script.chmod(0o755)
    samples = npu_smi.NpuSmiSource(str(script)).read()
    assert log.read_text().splitlines() == [
        "info",
        "info -t usages -i 0 -c 0",
        "info -t health -i 0 -c 0",
        "info -t usages -i 1 -c 0",
        "info -t health -i 1 -c 0",
    ]
    assert by_name(samples, "npu_chip_info_hbm_bandwidth_utilization") == {"0": 64.0, "1": 64.0}
    assert {s.name for s in samples} == set(npu_smi.METRICS) - {
        "npu_chip_info_used_memory",
        "npu_chip_info_total_memory",
    }


def test_source_raises_when_npu_smi_fails(tmp_path):
    script = tmp_path / "npu-smi"
    script.write_text("#!/bin/sh\necho 'dcmi module initialize failed' >&2\nexit 255\n")
    script.chmod(0o755)
    with pytest.raises(subprocess.CalledProcessError):
        npu_smi.NpuSmiSource(str(script)).read()


# -- NVML (stand-in) ---------------------------------------------------------------------------


def test_nvml_gauges_in_dcgm_names():
    fake = StandinNvml(
        [StandinGpu(), StandinGpu(uuid="GPU-standin-1", temp_c=91, util_gpu=5, ecc_uncorrected=3)]
    )
    samples = nvml.NvmlSource(fake).read()
    assert fake.initialised
    assert by_name(samples, "DCGM_FI_DEV_GPU_TEMP") == {"0": 45.0, "1": 91.0}
    assert by_name(samples, "DCGM_FI_DEV_FB_USED") == {"0": 8192.0, "1": 8192.0}
    assert by_name(samples, "DCGM_FI_DEV_FB_FREE") == {"0": 133 * 1024.0, "1": 133 * 1024.0}
    assert by_name(samples, "DCGM_FI_DEV_GPU_UTIL") == {"0": 60.0, "1": 5.0}
    assert by_name(samples, "DCGM_FI_DEV_POWER_USAGE") == {"0": 350.0, "1": 350.0}
    assert by_name(samples, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL") == {"0": 0.0, "1": 3.0}
    assert {s.labels["UUID"] for s in samples} == {"GPU-standin-0", "GPU-standin-1"}
    assert {s.labels["modelName"] for s in samples} == {"NVIDIA H200"}
    assert {s.name for s in samples} == set(nvml.METRICS)


def test_nvml_unsupported_queries_are_left_out_not_zero():
    fake = StandinNvml(
        [StandinGpu(temp_c=None, power_mw=None, ecc_uncorrected=None)], events_supported=False
    )
    names = {s.name for s in nvml.NvmlSource(fake).read()}
    assert "DCGM_FI_DEV_GPU_TEMP" not in names and "DCGM_FI_DEV_POWER_USAGE" not in names
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" not in names and "DCGM_FI_DEV_FB_USED" in names


def test_nvml_xid_events_mark_the_gpu_they_came_from():
    fake = StandinNvml([StandinGpu(), StandinGpu(uuid="GPU-standin-1")])
    source = nvml.NvmlSource(fake)
    assert by_name(source.read(), "DCGM_FI_DEV_XID_ERRORS") == {"0": 0.0, "1": 0.0}
    fake.xids += [(1, 48), (1, 79)]
    assert by_name(source.read(), "DCGM_FI_DEV_XID_ERRORS") == {"0": 0.0, "1": 79.0}
    assert not fake.xids


# -- host ------------------------------------------------------------------------------------

STAT_1 = "cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 50 0 50 350 50 0 0 0 0 0\n"
STAT_2 = "cpu  250 0 150 800 100 0 0 0 0 0\ncpu0 125 0 75 400 50 0 0 0 0 0\n"


def test_host_parsers():
    assert host.parse_proc_stat(STAT_1) == (200.0, 1000.0)
    assert (
        host.parse_pressure(
            "some avg10=12.50 avg60=3.00 avg300=1.00 total=99\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        )
        == 0.125
    )
    assert host.parse_pressure("") is None
    mem = host.parse_meminfo("MemTotal:  2048 kB\nMemAvailable:   1024 kB\nHugePages_Total: 0\n")
    assert mem == {"MemTotal": 2 << 20, "MemAvailable": 1 << 20, "HugePages_Total": 0}


def test_host_source_cores_in_use_from_two_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(host.os, "cpu_count", lambda: 4)
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "cpu").write_text("some avg10=40.00 avg60=0 avg300=0 total=1\n")
    (tmp_path / "meminfo").write_text("MemTotal: 4096 kB\nMemAvailable: 1024 kB\n")
    (tmp_path / "stat").write_text(STAT_1)
    source = host.HostSource(tmp_path)
    first = {s.name: s.value for s in source.read()}
    assert "splittts_device_cpu_cores_in_use" not in first  # no interval yet
    assert first["splittts_device_cpu_pressure_some_ratio"] == 0.4
    assert first["splittts_device_memory_available_bytes"] == 1 << 20
    (tmp_path / "stat").write_text(STAT_2)
    second = {s.name: s.value for s in source.read()}
    assert second["splittts_device_cpu_cores_in_use"] == pytest.approx(4 * 200 / 300)


def test_host_source_on_this_machine_reads_real_proc():
    names = {s.name for s in host.HostSource().read()}
    assert {"splittts_device_cpu_cores", "splittts_device_memory_available_bytes"} <= names
    assert names <= set(host.METRICS)


# -- collector ---------------------------------------------------------------------------------


class BlockingSource:
    """Returns one reading, then blocks inside read() until released."""

    def __init__(self):
        self.calls = 0
        self.entered, self.release = threading.Event(), threading.Event()

    def read(self) -> list[Sample]:
        self.calls += 1
        if self.calls > 1:
            self.entered.set()
            self.release.wait()
        return [
            Sample(
                "npu_chip_info_temperature",
                "t",
                40.0 + self.calls,
                {"device": "0", "model": "910B3"},
            )
        ]


def test_scrape_serves_the_last_reading_while_a_read_is_stuck():
    source = BlockingSource()
    collector = DeviceCollector([source], interval_s=0.01)
    registry = CollectorRegistry()
    registry.register(collector)
    collector.start()
    try:
        assert source.entered.wait(30)  # the thread is now stuck in the second read
        text = generate_latest(registry).decode()  # must not wait for it
        assert 'npu_chip_info_temperature{device="0",model="910B3"} 41.0' in text
    finally:
        source.release.set()
        collector.stop()


def test_a_failing_source_drops_its_gauges_and_spares_the_others():
    class Broken:
        def read(self):
            raise OSError("npu-smi: not found")

    collector = DeviceCollector([Broken(), host.HostSource()])
    collector.refresh()
    names = {f.name for f in collector.collect()}
    assert "splittts_device_memory_available_bytes" in names
    assert not any(n.startswith("npu_") for n in names)


def test_device_kind_and_start():
    assert device_kind("npu:1") == "npu" and device_kind("cuda") == "cuda"
    assert device_kind("CPU") == "cpu"
    registry = CollectorRegistry()
    for _ in range(2):  # a second serve in the same process registers afresh
        collector = start_device_metrics("cpu", registry, interval_s=3600)
        try:
            collector.refresh()
            assert b"splittts_device_memory_total_bytes" in generate_latest(registry)
        finally:
            collector.stop()
        assert b"splittts_device_" not in generate_latest(registry)
