"""Start the three services as local processes on free ports (tts-cli's embedded pipeline)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class StartupError(RuntimeError):
    """A service that exited, or never said it was serving; `reason` is its own last word."""

    def __init__(self, name: str, reason: str, returncode: int | None, log_tail: list[str]):
        super().__init__(f"{name} failed to start: {reason}")
        self.name, self.reason, self.returncode = name, reason, returncode
        self.log_tail = log_tail

    @property
    def bad_config(self) -> bool:
        """The service refused its flags, model or voice (its exit code 2), as opposed to failing."""
        return self.returncode == 2


def last_words(lines: list[str]) -> str:
    """The reason a dying service gave: its last stderr line, or the message of a JSON log line."""
    for line in reversed(lines):
        line = line.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            return line
        if isinstance(entry, dict) and entry.get("msg"):
            exc = str(entry.get("exc") or "").strip().splitlines()
            return f"{entry['msg']} ({exc[-1]})" if exc else str(entry["msg"])
        return line
    return "it exited without saying why"


@dataclass
class Process:
    """A started service and the ports it reported."""

    name: str
    proc: subprocess.Popen
    port: int
    metrics_port: int | None
    stderr_tail: list[str] = field(default_factory=list)
    http_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def _place(cpus: set[int] | None, nice: int) -> None:
    """In the child, before it runs Python: its cores and its priority."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)


def start_service(
    name: str,
    module: str,
    args: list[str],
    *,
    port: int = 0,
    metrics_port: int = -1,
    host: str = "127.0.0.1",
    env: dict | None = None,
    timeout_s: float = 300.0,
    quiet: bool = True,
    cpus: set[int] | None = None,
    nice: int = 0,
) -> Process:
    """Run `python -m module` and wait for its `serving` line; `cpus` pins it to those cores and
    `nice` lowers its priority (it yields the cores it shares)."""
    cmd = [
        sys.executable,
        "-m",
        module,
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        preexec_fn=partial(_place, cpus, nice) if cpus or nice else None,
    )
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None  # both piped
    tail: list[str] = []

    def drain_stderr() -> None:
        for line in stderr:
            tail.append(line)
            del tail[:-50]
            if not quiet:
                sys.stderr.write(f"[{name}] {line}")

    drainer = threading.Thread(target=drain_stderr, daemon=True)
    drainer.start()
    # The child's stdout is read on a thread of its own, so that the deadline holds while the
    # child prints nothing (stuck importing, or waiting on a lock); once it serves, the rest of
    # its output is read and dropped, so that it never blocks on a full pipe.
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    serving = threading.Event()

    def read_stdout() -> None:
        for line in stdout:
            if not serving.is_set():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    hung = False
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            hung = True
            break
        if line is None:
            break  # the child closed its output: it is exiting
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "serving":
            serving.set()
            return Process(
                name, proc, event["port"], event.get("metrics_port"), tail, event.get("http_port")
            )
    try:
        returncode = None if hung else proc.wait(10)
    except subprocess.TimeoutExpired:
        returncode = None
    if returncode is None:
        proc.kill()
        proc.wait()
    drainer.join(5)  # its last lines are the reason
    reason = f"not serving after {timeout_s:.0f} s" if hung else last_words(tail)
    reason = reason.removeprefix(f"{name}: ")  # services print "prog: reason"
    raise StartupError(name, reason, returncode, tail[-20:])


def default_cpus(available: set[int] | None = None) -> dict[str, set[int]]:
    """Where each service of a local deployment runs: the text service and the orchestrator on
    the lower half of the cores this process may use; the vocoder on all of them, with one
    worker per core (`vocoder_workers`), so it takes whatever the text service leaves idle;
    nothing pinned on one core. On the project's 2-core machine this made 5.6-6.1 audio s per
    wall s at 2 to 8 streams, against 4.2-4.8 with the vocoder on core 1 alone
    (`python -m bench.e2e --layouts`, bench/README.md)."""
    cores = sorted(os.sched_getaffinity(0) if available is None else available)
    if len(cores) < 2:
        return {}
    front = set(cores[: len(cores) // 2])
    return {"text": front, "orchestrator": front, "vocoder": set(cores)}


def vocoder_workers(cores: set[int] | None) -> list[str]:
    """The vocoder's flag for forwards in flight at once: one per core it runs on."""
    return ["--workers", str(len(cores))] if cores else []


# The vocoder's priority where it shares the text service's cores: the speech LM's steps feed
# every stream, so they go first and the vocoder takes the rest. At 4 streams starting together
# (2 cores, three runs each) this cut the chunks that arrived after a 150 ms buffer ran dry from
# 154-200 to 104-136 and the slowest stream's RTF from 1.20-1.28 to 1.05-1.10.
VOCODER_NICE = 10


def vocoder_nice(cpus: dict[str, set[int]]) -> int:
    """`VOCODER_NICE` where the vocoder shares a core with the text service, else 0."""
    shared = cpus.get("vocoder", set()) & cpus.get("text", set())
    return VOCODER_NICE if shared else 0


class LocalDeployment:
    """text-service + vocoder-service + orchestrator on 127.0.0.1; `stop()` drains all three.

    `cpus` pins each service to cores by name; None picks `default_cpus()`, {} pins nothing.
    """

    def __init__(
        self,
        voice_dir: str | Path,
        *,
        threads: dict[str, int] | None = None,
        ports: tuple[int, int, int] = (0, 0, 0),
        metrics_ports: tuple[int, int, int] = (-1, -1, -1),
        host: str = "127.0.0.1",
        quiet: bool = True,
        text_args: list[str] | None = None,
        vocoder_args: list[str] | None = None,
        cpus: dict[str, set[int]] | None = None,
        http_port: int = -1,
        tls_dir: str | Path | None = None,
        orchestrator_args: list[str] | None = None,
        env: dict | None = None,
    ):
        self.voice_dir = Path(voice_dir)
        self.env = env  # added to every service's environment (e.g. OTEL_EXPORTER_OTLP_ENDPOINT)
        # mutual TLS between the services and TLS on the public port, with a private CA and
        # certificates made in tls_dir when missing (servicekit.certs)
        self.tls_dir = Path(tls_dir) if tls_dir is not None else None
        self.orchestrator_args = orchestrator_args or []
        self.http_port = http_port  # the orchestrator's web demo: 0 picks a free port, -1 is off
        # One intra-op thread each by default: on a small CPU host the services share the cores,
        # and oversubscribed OpenMP / ORT pools stall each other (and the event loops).
        self.threads = threads if threads is not None else {"text": 1, "vocoder": 1}
        self.ports, self.metrics_ports, self.host, self.quiet = ports, metrics_ports, host, quiet
        self.text_args, self.vocoder_args = text_args or [], vocoder_args or []
        self.cpus = default_cpus() if cpus is None else cpus
        self.processes: list[Process] = []

    def _threads(self, name: str) -> list[str]:
        n = self.threads.get(name, 0)
        return ["--threads", str(n)] if n else []

    def _tls(self, name: str) -> list[str]:
        """A service's TLS flags: its own certificate, and for the internal ones mutual TLS."""
        if self.tls_dir is None:
            return []
        d = self.tls_dir
        own = ["--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}-key.pem")]
        if name != "orchestrator":
            return [*own, "--tls-client-ca", str(d / "ca.pem")]
        return [
            *own,
            "--tls-ca",
            str(d / "ca.pem"),
            "--tls-client-cert",
            str(d / f"{name}.pem"),
            "--tls-client-key",
            str(d / f"{name}-key.pem"),
        ]

    def start(self) -> LocalDeployment:
        if self.tls_dir is not None:
            from servicekit.certs import make_all

            make_all(
                self.tls_dir,
                [] if self.host in ("127.0.0.1", "localhost", "0.0.0.0", "::") else [self.host],
            )
        try:
            text = start_service(
                "text-service",
                "text_service",
                [
                    "--model",
                    str(self.voice_dir / "lm"),
                    *self._threads("text"),
                    *self._tls("text-service"),
                    *self.text_args,
                ],
                port=self.ports[1],
                metrics_port=self.metrics_ports[1],
                host=self.host,
                quiet=self.quiet,
                env=self.env,
                cpus=self.cpus.get("text"),
            )
            self.processes.append(text)
            vocoder = start_service(
                "vocoder-service",
                "vocoder_service",
                [
                    "--voice",
                    str(self.voice_dir),
                    *self._threads("vocoder"),
                    *self._tls("vocoder-service"),
                    *vocoder_workers(self.cpus.get("vocoder")),
                    *self.vocoder_args,
                ],
                port=self.ports[2],
                metrics_port=self.metrics_ports[2],
                host=self.host,
                quiet=self.quiet,
                env=self.env,
                cpus=self.cpus.get("vocoder"),
                nice=vocoder_nice(self.cpus),
            )
            self.processes.append(vocoder)
            orch = start_service(
                "orchestrator",
                "orchestrator",
                [
                    "--voice",
                    str(self.voice_dir),
                    "--text-service",
                    text.address,
                    "--vocoder-service",
                    vocoder.address,
                    "--http-port",
                    str(self.http_port),
                    *self._tls("orchestrator"),
                    *self.orchestrator_args,
                ],
                port=self.ports[0],
                metrics_port=self.metrics_ports[0],
                host=self.host,
                quiet=self.quiet,
                env=self.env,
                cpus=self.cpus.get("orchestrator"),
            )
            self.processes.append(orch)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def address(self) -> str:
        return self.processes[-1].address

    @property
    def http_url(self) -> str | None:
        """The web demo's URL, when started with an HTTP port."""
        port = self.processes[-1].http_port
        scheme = "http" if self.tls_dir is None else "https"
        return None if port is None else f"{scheme}://127.0.0.1:{port}/"

    def by_name(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, timeout_s: float = 30.0) -> None:
        for p in reversed(self.processes):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in reversed(self.processes):
            try:
                p.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        self.processes.clear()

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
