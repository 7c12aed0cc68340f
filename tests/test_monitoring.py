"""docker/monitoring: promtool checks and tests the rules; every metric the rules and the
dashboard query is one the real services export (or a documented device collector's gauge)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servicekit.telemetry import host, npu_smi, nvml
from tests.procs import ROOT, ServiceProcess
from tests.voices import make_tts_voice

MONITORING = ROOT / "docker" / "monitoring"
RULES = sorted((MONITORING / "rules").glob("*.yml"))
DASHBOARD = MONITORING / "grafana" / "dashboards" / "split-tts.json"
DEVICE_METRICS = {*npu_smi.METRICS, *nvml.METRICS, *host.METRICS}
PROMETHEUS_OWN = {"up"}  # written by Prometheus itself for every scrape target


def promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: `make sysdeps` installs it (Debian package prometheus)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


# -- PromQL metric names ---------------------------------------------------------------------

_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and strings removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", expr):
        rest = expr[m.end() :].lstrip()
        if m.group() in _KEYWORDS or rest.startswith("("):
            continue
        names.add(m.group())
    return names


def test_metric_names_reads_selectors_not_functions_labels_or_numbers():
    expr = (
        'histogram_quantile(0.95, sum by (le, service) (rate(a_bucket{status=~"x|y"}[5m])))'
        " / on (instance) group_left b_total > 1e3 and c:rec:ratio offset 5m or vector(0)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c:rec:ratio"}
    assert metric_names('up{job="text-service"} == 0') == {"up"}


def rule_groups() -> list[dict]:
    return [g for path in RULES for g in yaml.safe_load(path.read_text())["groups"]]


def recorded() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def rule_exprs() -> dict[str, str]:
    return {r.get("alert") or r["record"]: r["expr"] for g in rule_groups() for r in g["rules"]}


def dashboard_exprs() -> dict[str, str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {f"{p['title']} / {t['refId']}": t["expr"] for p in panels for t in p.get("targets", [])}


# -- promtool --------------------------------------------------------------------------------


def test_promtool_checks_the_rules():
    result = promtool("check", "rules", *map(str, RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_fire_and_spare_every_alert():
    tests = MONITORING / "tests" / "alerts_test.yml"
    result = promtool("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {n for g in rule_groups() for r in g["rules"] if (n := r.get("alert"))}
    cases = yaml.safe_load(tests.read_text())["tests"]
    checks = [c for t in cases for c in t.get("alert_rule_test", [])]
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == alerts, "each alert fires"
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == alerts, "each stays quiet"


def test_promtool_tests_fail_when_a_threshold_moves(tmp_path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    for path in RULES:
        text = path.read_text()
        if path.name == "alerts.yml":
            assert "npu_chip_info_temperature >= 85" in text
            text = text.replace(
                "npu_chip_info_temperature >= 85", "npu_chip_info_temperature >= 95"
            )
        (tmp_path / "rules" / path.name).write_text(text)
    shutil.copy(MONITORING / "tests" / "alerts_test.yml", tmp_path / "tests")
    result = promtool("test", "rules", str(tmp_path / "tests" / "alerts_test.yml"))
    assert result.returncode != 0 and "NpuTemperatureCritical" in result.stdout + result.stderr


def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs.values())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_scrapes_the_compose_services_metrics_ports():
    result = promtool("check", "config", "--syntax-only", str(MONITORING / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {
        j["job_name"]: t
        for j in config["scrape_configs"]
        for s in j["static_configs"]
        for t in s["targets"]
    }
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    for name in ("text-service", "vocoder-service", "orchestrator"):
        command = compose[name]["command"]
        port = command[command.index("--metrics-port") + 1]
        assert targets[name] == f"{name}:{port}"
    for name in ("prometheus", "grafana"):
        assert compose[name]["profiles"] == ["monitoring"]
        for volume in compose[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / "docker" / source).exists(), volume
    assert any(v.startswith("./monitoring/rules:") for v in compose["prometheus"]["volumes"])


# -- the names the services really export ------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def exported_names(exposition: str) -> set[str]:
    """Sample names of a /metrics page, including those of labelled families with no child yet."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def service_metrics(tmp_path_factory) -> dict[str, set[str]]:
    """The /metrics names of a real text-service, vocoder-service and orchestrator."""
    voice = make_tts_voice(tmp_path_factory.mktemp("voices"))
    procs = {}
    try:
        procs["text-service"] = ServiceProcess(
            "text_service",
            "--model",
            str(voice / "lm"),
            "--kv-cache-memory",
            "32MiB",
            "--threads",
            "1",
            "--device",
            "cpu",
        )
        procs["vocoder-service"] = ServiceProcess(
            "vocoder_service", "--voice", str(voice), "--threads", "1", "--device", "cpu"
        )
        procs["orchestrator"] = ServiceProcess(
            "orchestrator",
            "--voice",
            str(voice),
            "--http-port",
            "-1",
            "--text-service",
            procs["text-service"].address,
            "--vocoder-service",
            procs["vocoder-service"].address,
        )
        yield {name: exported_names(p.metrics()) for name, p in procs.items()}
    finally:
        for p in procs.values():
            assert p.stop() == 0


def test_every_service_exports_its_host_gauges_and_serving_state(service_metrics):
    for name, names in service_metrics.items():
        assert {
            "splittts_device_cpu_cores",
            "splittts_device_memory_available_bytes",
            "splittts_service_serving",
        } <= names, name
        assert not any(n.startswith(("npu_", "DCGM_")) for n in names), name  # --device cpu


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_queried_metric_exists(service_metrics, source):
    exprs = rule_exprs() if source == "rules" else dashboard_exprs()
    exported = set().union(*service_metrics.values())
    known = exported | DEVICE_METRICS | recorded() | PROMETHEUS_OWN
    missing = {
        where: sorted(metric_names(e) - known)
        for where, e in exprs.items()
        if metric_names(e) - known
    }
    assert not missing, missing
    used = set().union(*(metric_names(e) for e in exprs.values()))
    assert used & exported, "queries must reach the services' own metrics"
