"""TLS, mutual TLS, the bearer token and the web socket's Origin check, on real processes.

One deployment runs as `tts-cli serve --tls-dir` does: a private CA made here, mutual TLS from
the orchestrator to both backends, TLS (and a token) on the public port and on HTTPS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import aiohttp
import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.__main__ import main as orchestrator_main
from orchestrator.launcher import LocalDeployment
from servicekit.certs import make_all
from servicekit.tls import is_loopback, warn_if_exposed
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc
from tests.procs import ServiceProcess
from tests.voices import make_tts_voice

TOKEN = "test-token-0123456789abcdef"
ALLOWED = "https://allowed.example"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_all(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Another CA with its own certificates: trusted by nobody here."""
    return make_all(tmp_path_factory.mktemp("foreign-tls"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def voice(tmp_path_factory):
    return make_tts_voice(tmp_path_factory.mktemp("voices"))


@pytest.fixture(scope="module")
def deployment(voice, certs, token_file):
    local = LocalDeployment(
        voice,
        threads={"text": 1, "vocoder": 1},
        http_port=0,
        tls_dir=certs,
        orchestrator_args=["--api-token-file", str(token_file), "--allow-origin", ALLOWED],
    )
    local.start()
    yield local
    local.stop()


def creds(directory, client: str | None = None) -> grpc.ChannelCredentials:
    """Trust `directory`'s CA; present its `client` certificate when named."""
    key = cert = None
    if client is not None:
        key = (directory / f"{client}-key.pem").read_bytes()
        cert = (directory / f"{client}.pem").read_bytes()
    return grpc.ssl_channel_credentials((directory / "ca.pem").read_bytes(), key, cert)


def health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


def bearer(token: str = TOKEN) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def synthesize(channel: grpc.Channel, metadata=None) -> list:
    return list(
        tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(
            pb.SynthesizeRequest(text="hello over tls", voice="tiny"),
            timeout=120,
            metadata=metadata,
        )
    )


def test_full_synthesis_over_tls_and_mutual_tls_to_both_backends(deployment, certs):
    with grpc.secure_channel(deployment.address, creds(certs)) as ch:
        responses = synthesize(ch, bearer())
    audio = b"".join(r.audio.audio for r in responses if r.HasField("audio"))
    assert len(audio) > 1000
    assert responses[-1].HasField("report") and responses[-1].report.audio_s > 0


def test_a_plaintext_client_cannot_talk_to_a_tls_port(deployment):
    for process in deployment.processes:
        with grpc.insecure_channel(process.address) as ch, pytest.raises(grpc.RpcError) as err:
            health(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, process.name


def test_a_client_of_another_ca_does_not_trust_the_server(deployment, foreign):
    with (
        grpc.secure_channel(deployment.address, creds(foreign)) as ch,
        pytest.raises(grpc.RpcError) as err,
    ):
        health(ch)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("backend", ["text-service", "vocoder-service"])
def test_backends_require_a_client_certificate_of_their_ca(deployment, certs, foreign, backend):
    address = deployment.by_name(backend).address
    with grpc.secure_channel(address, creds(certs, "orchestrator")) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
    for refused in (
        creds(certs),
        grpc.ssl_channel_credentials(
            (certs / "ca.pem").read_bytes(),
            (foreign / "orchestrator-key.pem").read_bytes(),
            (foreign / "orchestrator.pem").read_bytes(),
        ),
    ):
        with grpc.secure_channel(address, refused) as ch, pytest.raises(grpc.RpcError) as err:
            health(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "metadata, words",
    [
        (None, "missing credentials"),
        (bearer("not-the-token-at-all-0000"), "invalid credentials"),
        ((("authorization", TOKEN),), "malformed credentials"),
    ],
)
def test_calls_without_the_right_token_are_unauthenticated(deployment, certs, metadata, words):
    with grpc.secure_channel(deployment.address, creds(certs)) as ch:
        stub = tts_pb2_grpc.TextToSpeechStub(ch)
        for call in (
            lambda: synthesize(ch, metadata),
            lambda: stub.ListVoices(pb.ListVoicesRequest(), timeout=10, metadata=metadata),
            lambda: list(
                stub.StreamingSynthesize(
                    iter(
                        [
                            pb.StreamingSynthesizeRequest(
                                config=pb.StreamingSynthesizeConfig(voice="tiny")
                            )
                        ]
                    ),
                    timeout=30,
                    metadata=metadata,
                )
            ),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert words in err.value.details()
        # probes carry no token: health stays open
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING


def list_services(channel: grpc.Channel, metadata=None) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        timeout=10,
        metadata=metadata,
    )
    return [s.name for r in replies for s in r.list_services_response.service]


def test_reflection_is_on_behind_the_token(deployment, certs):
    with grpc.secure_channel(deployment.address, creds(certs)) as ch:
        assert "splittts.tts.v1.TextToSpeech" in list_services(ch, bearer())
        with pytest.raises(grpc.RpcError) as err:
            list_services(ch)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def https_context(certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs / "ca.pem"))


def test_openai_endpoint_needs_the_token_over_https(deployment, certs):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=deployment.http_url + "v1",
            api_key=key,
            max_retries=0,
            timeout=120,
            http_client=httpx2.Client(verify=https_context(certs)),
        )

    assert deployment.http_url.startswith("https://")
    with pytest.raises(openai.AuthenticationError) as err:
        client("wrong-token-0123456789").audio.speech.create(
            model="tts-1", voice="tiny", input="hello"
        )
    assert err.value.status_code == 401 and "invalid credentials" in str(err.value)
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(deployment.http_url + "v1/models", context=https_context(certs))
    assert missing.value.code == 401
    speech = client(TOKEN).audio.speech.create(
        model="tts-1", voice="tiny", input="hello", response_format="wav"
    )
    assert speech.content[:4] == b"RIFF" and len(speech.content) > 1000
    # without --web-auth the page itself stays open
    with urllib.request.urlopen(deployment.http_url, context=https_context(certs)) as page:
        assert page.status == 200


async def open_socket(url: str, certs, origin: str | None) -> dict:
    """Open /ws with `origin` and speak; the kinds of frames until the report, or the refusal."""
    headers = {"Origin": origin} if origin else {}
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(
                url.replace("https", "wss") + "ws", headers=headers, ssl=https_context(certs)
            ) as ws:
                await ws.send_str(json.dumps({"type": "speak", "text": "hi", "voice": "tiny"}))
                kinds = []
                while not kinds or kinds[-1] not in ("report", "error"):
                    frame = await ws.receive(timeout=60)
                    kinds.append(
                        "audio"
                        if frame.type == aiohttp.WSMsgType.BINARY
                        else json.loads(frame.data)["type"]
                    )
                return {"frames": kinds}
        except aiohttp.WSServerHandshakeError as exc:
            return {"refused": exc.status}


def test_websocket_refuses_a_foreign_origin(deployment, certs):
    url = deployment.http_url
    own = url.rstrip("/")
    assert asyncio.run(open_socket(url, certs, "http://evil.example")) == {"refused": 403}
    assert asyncio.run(open_socket(url, certs, "https://allowed.example.evil.example")) == {
        "refused": 403
    }
    for origin in (own, ALLOWED, None):  # its own page, an allowed one, a non-browser client
        frames = asyncio.run(open_socket(url, certs, origin))["frames"]
        assert frames[0] == "started" and "audio" in frames and frames[-1] == "report", origin


@pytest.fixture(scope="module")
def web_auth_orchestrator(deployment, voice, certs, token_file):
    """A second orchestrator (mutual TLS to the same backends) with --web-auth, without
    reflection, and with a plaintext health port."""
    proc = ServiceProcess(
        "orchestrator",
        "--voice",
        str(voice),
        "--http-port",
        "0",
        "--no-reflection",
        "--health-port",
        "0",
        "--tls-cert",
        str(certs / "orchestrator.pem"),
        "--tls-key",
        str(certs / "orchestrator-key.pem"),
        "--text-service",
        deployment.by_name("text-service").address,
        "--vocoder-service",
        deployment.by_name("vocoder-service").address,
        "--tls-ca",
        str(certs / "ca.pem"),
        "--tls-client-cert",
        str(certs / "orchestrator.pem"),
        "--tls-client-key",
        str(certs / "orchestrator-key.pem"),
        "--api-token-file",
        str(token_file),
        "--web-auth",
        "--log-level",
        "info",
    )
    yield proc
    proc.stop()


def test_web_auth_guards_the_page_and_metrics(web_auth_orchestrator, certs):
    base = f"https://127.0.0.1:{web_auth_orchestrator.info['http_port']}"
    https = urllib.request.HTTPSHandler(context=https_context(certs))
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(), https)
    for path in ("/", "/api/voices", "/metrics", "/?token=wrong-token-0123456789"):
        with pytest.raises(urllib.error.HTTPError) as err:
            opener.open(base + path)
        assert err.value.code == 401, path
    with opener.open(f"{base}/?token={TOKEN}") as page:  # sets the cookie, then redirects to /
        assert page.status == 200 and page.url == base + "/"
    with opener.open(base + "/api/voices") as r:
        assert [v["name"] for v in json.load(r)["voices"]] == ["tiny"]
    request = urllib.request.Request(
        base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, context=https_context(certs)) as r:
        assert b"splittts_tts_requests_in_flight" in r.read()


def test_reflection_can_be_switched_off(web_auth_orchestrator, certs):
    with grpc.secure_channel(web_auth_orchestrator.address, creds(certs)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list_services(ch, bearer())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert synthesize(ch, bearer())[-1].HasField("report")
    assert any("over TLS" in line for line in web_auth_orchestrator.stderr_lines)


def test_the_health_port_answers_probes_in_plaintext_and_nothing_else(web_auth_orchestrator):
    address = f"127.0.0.1:{web_auth_orchestrator.info['health_port']}"
    with grpc.insecure_channel(address) as ch:
        assert health(ch) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            tts_pb2_grpc.TextToSpeechStub(ch).ListVoices(
                pb.ListVoicesRequest(), timeout=10, metadata=bearer()
            )
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_beyond_loopback_is_a_loud_warning(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    with caplog.at_level(logging.INFO, logger="servicekit.tls"):
        warn_if_exposed("0.0.0.0", 50051, None)
        warn_if_exposed("127.0.0.1", 50051, None)
    levels = [(r.levelno, "PLAINTEXT" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, False)]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
        (["--tls-client-cert", "c.pem", "--tls-client-key", "k.pem"], "needs --tls-ca"),
        (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: cannot read it"),
        (["--web-auth"], "--web-auth needs --api-token-file"),
        (["--api-token", "short"], "at least 16 characters"),
    ],
)
def test_bad_security_flags_are_one_line_and_exit_2(voice, capsys, flags, words):
    code = orchestrator_main(
        [
            "--voice",
            str(voice),
            "--text-service",
            "127.0.0.1:1",
            "--vocoder-service",
            "127.0.0.1:2",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--http-port",
            "-1",
            *flags,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err


def test_tts_cli_reaches_a_tls_server_with_the_token(deployment, certs, token_file, tmp_path):
    def cli(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "orchestrator.cli",
                "synthesize",
                "hello",
                "--voice",
                "tiny",
                "--server",
                deployment.address,
                "-q",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env={k: v for k, v in os.environ.items() if k != "SPLITTTS_API_TOKEN"},
        )

    out = tmp_path / "hello.wav"
    done = cli(
        "--tls-ca", str(certs / "ca.pem"), "--api-token-file", str(token_file), "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:4] == b"RIFF"
    refused = cli("--tls-ca", str(certs / "ca.pem"), "-o", str(tmp_path / "no.wav"))
    assert refused.returncode != 0 and "missing credentials" in refused.stderr, refused.stderr


def test_the_metrics_port_is_https_with_the_server_certificate(web_auth_orchestrator, certs):
    url = f"127.0.0.1:{web_auth_orchestrator.metrics_port}/metrics"
    with urllib.request.urlopen("https://" + url, context=https_context(certs), timeout=10) as r:
        assert b"splittts_tts_requests_in_flight" in r.read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen("http://" + url, timeout=10).read()
