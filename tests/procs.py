"""Run a service as a real process on 127.0.0.1 for tests, and stop it cleanly afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


class ServiceProcess:
    """`python -m <module> --port 0 --metrics-port 0 ...` with the bound ports read from stdout."""

    def __init__(self, module: str, *args: str, env: dict | None = None, timeout: float = 180.0):
        cmd = [
            sys.executable,
            "-m",
            module,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.info = self._wait_serving(timeout)
        self.port = self.info["port"]
        self.metrics_port = self.info["metrics_port"]
        self.address = f"127.0.0.1:{self.port}"

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_serving(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "serving":
                threading.Thread(target=lambda: [*self.proc.stdout], daemon=True).start()
                return event
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError("service did not start:\n" + "".join(self.stderr_lines[-40:]))

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def health(self, service: str = "") -> int:
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as r:
            return r.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scrape(proc, name: str, labels: str = "") -> float:
    """One sample from a process's /metrics (anything with a `metrics_port`); 0 when absent."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), name, labels) or 0.0


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.2) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """Value of one sample `name{labels}` in Prometheus text format, or None."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return None
