"""The streaming web demo: a page plus a WebSocket that relays the public gRPC API to the browser.

The relay is an ordinary gRPC client of the orchestrator's own public port, so the page exercises
exactly what any other caller gets. Protocol on `/ws` (one socket per tab, one synthesis at a time):

client -> server, JSON text frames
  {"type": "speak", "text", "voice", "language_code", "speaking_rate", "request_id"}  Synthesize
  {"type": "stream", "voice", "language_code", "speaking_rate", "request_id"}  StreamingSynthesize
  {"type": "text", "text"}  a piece of text for the open StreamingSynthesize
  {"type": "end"}           end of input (half-close)
  {"type": "stop"}          cancel the call: the orchestrator cancels both downstream streams

server -> client
  binary frames: a 16-byte little-endian header (int32 sequence number, int32 sample rate,
    float64 first sample) followed by the chunk's LINEAR16 PCM
  {"type": "started", "request_id"}, {"type": "words", "words": [{word, start_ms, end_ms, segment}]},
  {"type": "report", "report": {...}},
  {"type": "stopped"}, {"type": "error", "code", "message", "detail"}

The same port serves the OpenAI-compatible speech API (`openai_api.py`) and `/metrics`. With an
API token, `/v1/*` needs it and, with `--web-auth`, everything else too (`auth.py`). `/ws` refuses
(HTTP 403) a browser page whose Origin is neither the demo's own nor one `--allow-origin` lists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import struct
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import WSMsgType, web
from google.protobuf import json_format
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.auth import COOKIE, check_bearer, token_interceptors
from orchestrator.openai_api import ApiError, OpenAISpeech
from orchestrator.web_download import encode as encode_download
from servicekit.tls import ClientTLS, ServerTLS
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "web"
CHUNK_HEADER = struct.Struct("<iid")
RPC_TIMEOUT_S = 600.0


def plain_error(code: grpc.StatusCode, details: str) -> str:
    """A gRPC error in words a person at the page understands."""
    details = details or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if "must not be empty" in details or "no text arrived" in details:
            return "There is nothing to speak: type some text first."
        if "exceed" in details and "text" in details:
            return f"That text is too long for one request ({details.split(': ', 1)[-1]})."
        return f"The server refused the request: {details}"
    if code == grpc.StatusCode.NOT_FOUND:
        return f"That voice is not available on this server ({details})."
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "The server is busy with other requests right now; try again in a moment."
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            "The speech service is down or unreachable right now; "
            "try again in a moment, or check that all services are running."
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "Speaking took too long and was stopped."
    return f"Something went wrong on the server ({code.name}): {details}"


def _audio_config(msg: dict) -> pb.AudioConfig:
    rate = float(msg.get("speaking_rate") or 0.0)
    return pb.AudioConfig(encoding=pb.LINEAR16, speaking_rate=rate)


def _request_id(msg: dict) -> str:
    return str(msg.get("request_id") or f"web-{uuid.uuid4().hex[:12]}")


class _Session:
    """One WebSocket: at most one call in flight, relayed frame by frame."""

    def __init__(self, ws: web.WebSocketResponse, stub: tts_pb2_grpc.TextToSpeechStub):
        self.ws, self.stub = ws, stub
        self.call: Any = None  # the Synthesize or StreamingSynthesize call in flight
        self.task: asyncio.Task | None = None
        self.streaming = False
        self._send_lock = asyncio.Lock()

    async def send_json(self, obj: dict) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            await self.ws.send_str(json.dumps(obj))

    async def send_bytes(self, data: bytes) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            await self.ws.send_bytes(data)

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    async def handle(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "stop":
            await self.stop()
            await self.send_json({"type": "stopped"})
        elif kind in ("speak", "stream"):
            await self.stop()  # a new utterance replaces the one playing
            request_id = _request_id(msg)
            if kind == "speak":
                req = pb.SynthesizeRequest(
                    text=str(msg.get("text") or ""),
                    voice=str(msg.get("voice") or ""),
                    language_code=str(msg.get("language_code") or ""),
                    audio_config=_audio_config(msg),
                    request_id=request_id,
                )
                self.call = self.stub.Synthesize(req, timeout=RPC_TIMEOUT_S)
            else:
                self.call = self.stub.StreamingSynthesize(timeout=RPC_TIMEOUT_S)
                config = pb.StreamingSynthesizeConfig(
                    voice=str(msg.get("voice") or ""),
                    language_code=str(msg.get("language_code") or ""),
                    audio_config=_audio_config(msg),
                    request_id=request_id,
                )
                try:
                    await self.call.write(pb.StreamingSynthesizeRequest(config=config))
                except grpc.aio.AioRpcError:
                    pass  # the relay below reads the call's status and reports it
            self.streaming = kind == "stream"
            await self.send_json({"type": "started", "request_id": request_id})
            self.task = asyncio.create_task(self._relay(self.call))
        elif kind in ("text", "end"):
            if not (self.streaming and self.busy):
                await self.send_json(
                    {
                        "type": "error",
                        "code": "FAILED_PRECONDITION",
                        "message": "No chatbot stream is open: press Speak first.",
                    }
                )
                return
            try:
                if kind == "text":
                    await self.call.write(
                        pb.StreamingSynthesizeRequest(text=str(msg.get("text") or ""))
                    )
                else:
                    self.streaming = False
                    await self.call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass  # the call already ended; its reader reports why
        else:
            await self.send_json(
                {
                    "type": "error",
                    "code": "INVALID_ARGUMENT",
                    "message": f"The page sent an unknown message type {kind!r}.",
                }
            )

    async def _relay(self, call) -> None:
        try:
            async for resp in call:
                if resp.HasField("audio"):
                    a = resp.audio
                    await self.send_bytes(
                        CHUNK_HEADER.pack(
                            a.sequence_number, a.sample_rate_hz, float(a.first_sample)
                        )
                        + a.audio
                    )
                elif resp.HasField("words"):
                    await self.send_json(
                        {
                            "type": "words",
                            "words": [
                                {
                                    "word": w.word,
                                    "start_ms": w.start_ms,
                                    "end_ms": w.end_ms,
                                    "segment": w.segment,
                                }
                                for w in resp.words.words
                            ],
                        }
                    )
                else:
                    report = json_format.MessageToDict(
                        resp.report,
                        preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True,
                    )
                    await self.send_json({"type": "report", "report": report})
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                await self.send_json(
                    {
                        "type": "error",
                        "code": exc.code().name,
                        "message": plain_error(exc.code(), exc.details() or ""),
                        "detail": exc.details() or "",
                    }
                )
        except ConnectionResetError:
            call.cancel()
        finally:
            self.streaming = False

    async def stop(self) -> None:
        """Cancel the call in flight, if any, and wait until its relay has ended."""
        if self.call is not None:
            self.call.cancel()
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being torn down
                pass
        self.call, self.task, self.streaming = None, None, False


class WebDemo:
    """aiohttp app: the page, /api/voices, /api/status, /api/encode, the /ws relay, OpenAI's /v1."""

    def __init__(
        self,
        grpc_target: str,
        *,
        token: str | None = None,
        web_auth: bool = False,
        allow_origins: Iterable[str] = (),
        tls: ClientTLS | None = None,
    ):
        self.grpc_target = grpc_target
        self.token, self.web_auth, self.tls = token, web_auth, tls
        self.allow_origins = {o.rstrip("/").lower() for o in allow_origins}
        self.channel: grpc.aio.Channel | None = None
        self.sessions: set[_Session] = set()
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    def _stub(self) -> tts_pb2_grpc.TextToSpeechStub:
        if self.channel is None:
            interceptors = token_interceptors(self.token)
            self.channel = (
                grpc.aio.secure_channel(
                    self.grpc_target, self.tls.credentials(), interceptors=interceptors
                )
                if self.tls is not None
                else grpc.aio.insecure_channel(self.grpc_target, interceptors=interceptors)
            )
        return tts_pb2_grpc.TextToSpeechStub(self.channel)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_get("/", self.index)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/voices", self.voices)
        app.router.add_get("/api/status", self.status)
        app.router.add_post("/api/encode", encode_download)
        app.router.add_get("/ws", self.websocket)
        app.router.add_static("/static/", STATIC_DIR, follow_symlinks=False)
        OpenAISpeech(self._stub).add_routes(app)
        app.on_shutdown.append(self._close_sockets)
        return app

    async def start(self, host: str, port: int, https: ServerTLS | None = None) -> int:
        """Bind host:port (0 picks a free one), HTTPS with `https`'s files; return the port."""
        context = None
        if https is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            if https.cert_path is None or https.key_path is None:
                raise ValueError("HTTPS needs the certificate and key as files")
            context.load_cert_chain(https.cert_path, https.key_path)
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self.port

    async def warmup(self) -> None:
        """Connect the relay's channel to our own port and make one call on it (ListVoices), so
        the first page or /v1 request does not pay for the connection (and its TLS handshake)."""
        try:
            await self._stub().ListVoices(pb.ListVoicesRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:  # the requests that follow will report it
            log.warning(
                "the web relay could not reach %s at start-up: %s %s",
                self.grpc_target,
                exc.code().name,
                exc.details(),
            )

    async def stop(self) -> None:
        """Close every socket (cancelling its call) and the HTTP server."""
        if self.runner is not None:
            await self.runner.cleanup()
        if self.channel is not None:
            await self.channel.close()

    async def _close_sockets(self, _app) -> None:
        for session in list(self.sessions):
            await session.stop()
            await session.ws.close(code=1001, message=b"server shutting down")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """The token on /v1/* (OpenAI's header); with --web-auth on every path (or its cookie)."""
        openai = request.path.startswith("/v1/")
        if self.token is None or not (openai or self.web_auth):
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is None and not openai:
            if "token" in request.query and request.path == "/":
                problem = check_bearer(f"Bearer {request.query['token']}", self.token)
                if problem is None:  # remember it and take it out of the address bar
                    found = web.HTTPFound("/")
                    found.set_cookie(
                        COOKIE, self.token, httponly=True, samesite="Strict", secure=request.secure
                    )
                    return found
                return web.Response(status=401, text=f"{problem}\n")
            if COOKIE in request.cookies:
                header = f"Bearer {request.cookies[COOKIE]}"
        problem = check_bearer(header, self.token)
        if problem is None:
            return await handler(request)
        if openai:
            response = ApiError(401, problem, code="invalid_api_key").response()
        else:
            response = web.Response(status=401, text=f"{problem}; open the page as /?token=TOKEN\n")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def origin_allowed(self, request: web.Request) -> bool:
        """No Origin (not a browser), the page's own origin (the Host it asked), or an allowed."""
        origin = request.headers.get("Origin")
        if origin is None or "*" in self.allow_origins:
            return True
        if origin.rstrip("/").lower() in self.allow_origins:
            return True
        return urlsplit(origin).netloc.lower() == request.host.lower()

    async def metrics(self, _request: web.Request) -> web.Response:
        """Prometheus metrics of this process (behind the token with --web-auth)."""
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def index(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def voices(self, _request: web.Request) -> web.Response:
        try:
            reply = await self._stub().ListVoices(pb.ListVoicesRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return web.json_response(
                {"error": plain_error(exc.code(), exc.details() or ""), "code": exc.code().name},
                status=503,
            )
        return web.json_response(
            {
                "voices": [
                    {
                        "name": v.name,
                        "language_codes": list(v.language_codes),
                        "sample_rate_hz": v.sample_rate_hz,
                        "description": v.description,
                        "is_default": v.is_default,
                    }
                    for v in reply.voices
                ]
            }
        )

    async def status(self, _request: web.Request) -> web.Response:
        """Open sockets and calls this relay has in flight."""
        return web.json_response(
            {"sockets": len(self.sessions), "calls_in_flight": sum(s.busy for s in self.sessions)}
        )

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        if not self.origin_allowed(request):
            log.warning("refused a WebSocket from Origin %s", request.headers.get("Origin"))
            return web.Response(
                status=403,
                text=f"Origin {request.headers.get('Origin')} may not "
                "open this socket: only the page's own origin and those given "
                "with --allow-origin may\n",
            )
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        session = _Session(ws, self._stub())
        self.sessions.add(session)
        try:
            async for frame in ws:
                if frame.type != WSMsgType.TEXT:
                    continue
                try:
                    msg = json.loads(frame.data)
                    if not isinstance(msg, dict):
                        raise ValueError("not an object")
                except ValueError:
                    await session.send_json(
                        {
                            "type": "error",
                            "code": "INVALID_ARGUMENT",
                            "message": "The page sent a message that is not JSON.",
                        }
                    )
                    continue
                await session.handle(msg)
        finally:
            await session.stop()  # a closed tab cancels its synthesis downstream
            self.sessions.discard(session)
        return ws


def loopback_target(host: str, port: int) -> str:
    """Address of our own gRPC port as a local client reaches it."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def relay_tls(server: ServerTLS | None, backends: ClientTLS | None) -> ClientTLS | None:
    """How the relay reaches our own TLS port: trusting --tls-ca (else our own certificate) and,
    if the port asks for one, presenting the backends' client certificate."""
    if server is None:
        return None
    ca = backends.ca if backends is not None and backends.ca else server.cert
    if server.mutual and (backends is None or backends.cert is None):
        raise ValueError(
            "--tls-client-ca on the orchestrator with --http-port needs "
            "--tls-client-cert and --tls-client-key for the web relay"
        )
    client = backends if server.mutual else None
    return ClientTLS(ca, client.cert if client else None, client.key if client else None)
