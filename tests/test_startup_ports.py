"""Start-up refusals are one line and exit code 2 (real processes): a second server on a busy port
names the port; a corrupt checkpoint names the file."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.hf_models import make_tiny_model
from tests.procs import ROOT, ServiceProcess
from tests.voices import make_tts_voice


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lm"), "qwen3_5", max_position_embeddings=256)


@pytest.fixture(scope="module")
def voice_dir(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


def second(
    module: str, *args: str, port: int = 0, metrics_port: int = -1
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


def orchestrator_args(voice_dir) -> tuple[str, ...]:
    """An orchestrator's voice and backends: they need not be up for it to bind its ports."""
    return (
        "--voice",
        str(voice_dir),
        "--text-service",
        "127.0.0.1:1",
        "--vocoder-service",
        "127.0.0.1:1",
    )


def assert_refused(result: subprocess.CompletedProcess, line: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in result.stderr and '"event": "serving"' not in result.stdout


def test_text_service_refuses_a_busy_grpc_or_metrics_port(model_dir):
    args = ("--model", str(model_dir), "--kv-cache-memory", "32MiB", "--threads", "1")
    first = ServiceProcess("text_service", *args)
    try:
        assert_refused(
            second("text_service", *args, port=first.port),
            f"text-service: gRPC port 127.0.0.1:{first.port} is already in use by another process",
        )
        assert_refused(
            second("text_service", *args, metrics_port=first.metrics_port),
            f"text-service: metrics port 127.0.0.1:{first.metrics_port} is already in "
            "use by another process",
        )
        assert first.alive() and first.health() == 1  # SERVING, untouched
    finally:
        assert first.stop() == 0


def test_text_service_refuses_a_truncated_checkpoint(model_dir, tmp_path):
    broken = tmp_path / "lm"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a cut-off download
    result = second(
        "text_service", "--model", str(broken), "--kv-cache-memory", "32MiB", "--threads", "1"
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"text-service: {weights} is not a readable safetensors file ("), line
    assert "Traceback" not in result.stderr and '"event": "serving"' not in result.stdout


def test_text_service_refuses_a_negative_decode_graph_count(model_dir):
    result = second(
        "text_service",
        "--model",
        str(model_dir),
        "--kv-cache-memory",
        "32MiB",
        "--decode-graphs",
        "-1",
    )
    assert_refused(result, "text-service: decode_graphs must be >= 0, got -1")


def test_vocoder_service_refuses_a_busy_grpc_port(voice_dir):
    args = ("--voice", str(voice_dir), "--threads", "1")
    first = ServiceProcess("vocoder_service", *args)
    try:
        assert_refused(
            second("vocoder_service", *args, port=first.port),
            f"vocoder-service: gRPC port 127.0.0.1:{first.port} is already in use by "
            "another process",
        )
    finally:
        assert first.stop() == 0


def test_orchestrator_refuses_a_busy_grpc_or_http_port(voice_dir):
    args = orchestrator_args(voice_dir)
    first = ServiceProcess("orchestrator", *args, "--http-port", "0")
    try:
        assert_refused(
            second("orchestrator", *args, "--http-port", "-1", port=first.port),
            f"orchestrator: gRPC port 127.0.0.1:{first.port} is already in use by another process",
        )
        http_port = first.info["http_port"]
        result = second("orchestrator", *args, "--http-port", str(http_port))
        assert result.returncode == 2 and str(http_port) in result.stderr.strip().splitlines()[-1]
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize("pace", ["0.5", "-1"])
def test_orchestrator_refuses_a_pace_below_real_time(voice_dir, pace):
    """`--pace` is 0 (off) or at least real time: a slower pace would starve its listeners."""
    result = second(
        "orchestrator", *orchestrator_args(voice_dir), "--http-port", "-1", "--pace", pace
    )
    assert_refused(result, f"orchestrator: --pace must be 0 (off) or >= 1 (got {float(pace)})")


def test_a_service_silent_past_its_start_up_timeout_is_stopped(tmp_path):
    """A child that never says it is serving and prints nothing at all (stuck importing, or on a
    lock) fails the launcher's start at its deadline and is stopped, instead of holding the
    launcher for as long as it stays silent."""
    from orchestrator.launcher import StartupError, start_service

    (tmp_path / "silent_child.py").write_text("import time\ntime.sleep(300)\n")
    with pytest.raises(StartupError, match="not serving after 1 s") as failed:
        start_service(
            "silent", "silent_child", [], env={"PYTHONPATH": str(tmp_path)}, timeout_s=1.0
        )
    assert failed.value.returncode is None  # it was still running, and was killed
