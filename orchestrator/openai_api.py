"""OpenAI-compatible speech on the HTTP port: `POST /v1/audio/speech`, `GET /v1/models`, voices.

Like the web demo, it is a client of the orchestrator's own public gRPC API. A request names
one of this deployment's voices (`GET /v1/audio/voices`; OpenAI's own voice names are not
aliases for them) and a model: `split-tts`, or one of OpenAI's TTS model names, which all mean
the same engine, so code written for OpenAI runs unchanged. `response_format` is mp3 (the
default), opus (Ogg), aac (ADTS), flac, wav or pcm (headerless 16-bit little-endian), all at
24 kHz as OpenAI's are; `speed` is the speaking rate (pitch kept), 0.5 to 2.0 here;
`instructions` is accepted and ignored. The body is sent chunked as the audio is made. An
error before the first byte is an OpenAI-style JSON error with its HTTP status; one after it
aborts the connection, so a cut stream never looks complete.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aiohttp import web

from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

log = logging.getLogger(__name__)

MODELS = ("split-tts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
SAMPLE_RATE_HZ = 24000
MIN_SPEED, MAX_SPEED = 0.5, 2.0
RPC_TIMEOUT_S = 600.0
FORMATS = {  # response_format -> (AudioEncoding, Content-Type)
    "mp3": (pb.MP3, "audio/mpeg"),
    "opus": (pb.OGG_OPUS, "audio/ogg; codecs=opus"),
    "aac": (pb.AAC, "audio/aac"),
    "flac": (pb.FLAC, "audio/flac"),
    "wav": (pb.WAV, "audio/wav"),
    "pcm": (pb.LINEAR16, f"audio/L16; rate={SAMPLE_RATE_HZ}; channels=1"),
}
FIELDS = {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}
# the public API's field names in its messages -> this API's
GRPC_PARAMS = {
    "text": "input",
    "voice": "voice",
    "audio_config.speaking_rate": "speed",
    "audio_config.encoding": "response_format",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
}


class ApiError(Exception):
    """An error as OpenAI's API reports it: HTTP status and {"error": {...}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def response(self) -> web.Response:
        """The JSON error response."""
        return web.json_response(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status=self.status,
        )


def from_grpc(exc: grpc.aio.AioRpcError) -> ApiError:
    """A public-API error in OpenAI's terms; the field it names is renamed to this API's."""
    details = exc.details() or exc.code().name
    field = details.split(":", 1)[0].split(" ", 1)[0]
    param = GRPC_PARAMS.get(field)
    if param and param != field:
        details = param + details[len(field) :]
    code = (
        {"voice": "voice_not_found"}.get(param or "")
        if exc.code() == grpc.StatusCode.NOT_FOUND
        else exc.code().name.lower()
    )
    return ApiError(HTTP_STATUS.get(exc.code(), 500), details, param, code)


@dataclass(frozen=True)
class SpeechRequest:
    """A checked `POST /v1/audio/speech` body."""

    model: str
    input: str
    voice: str
    response_format: str
    speed: float

    def to_grpc(self, request_id: str) -> pb.SynthesizeRequest:
        """The public API's request for it."""
        encoding = FORMATS[self.response_format][0]
        return pb.SynthesizeRequest(
            text=self.input,
            voice=self.voice,
            request_id=request_id,
            audio_config=pb.AudioConfig(
                encoding=encoding, sample_rate_hz=SAMPLE_RATE_HZ, speaking_rate=self.speed
            ),
        )


def _string(body: dict, name: str, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"{name}: this field is required", name, "missing_field")
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ApiError(400, f"{name}: must be a non-empty string", name, "invalid_value")
    return value


def parse_speech_request(body: object) -> SpeechRequest:
    """Checks a speech request body; ApiError names the field and the rule."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    for name in body:
        if name not in FIELDS:
            raise ApiError(
                400, f"Unrecognized request argument supplied: {name}", name, "unknown_parameter"
            )
    model = _string(body, "model")
    if model not in MODELS:
        raise ApiError(
            404,
            f"model: the model {model!r} does not exist; use one of {', '.join(MODELS)}",
            "model",
            "model_not_found",
        )
    text = _string(body, "input")
    voice = body.get("voice")
    if isinstance(voice, dict) and set(voice) == {"id"}:  # a custom voice reference {"id": ...}
        voice = voice["id"]
    if not isinstance(voice, str) or not voice.strip():
        raise ApiError(
            400,
            'voice: must be a voice name (GET /v1/audio/voices) or {"id": name}',
            "voice",
            "missing_field" if voice is None else "invalid_value",
        )
    fmt = body.get("response_format", "mp3")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ApiError(
            400,
            f"response_format: must be one of {', '.join(FORMATS)} (got {fmt!r})",
            "response_format",
            "invalid_value",
        )
    speed = body.get("speed", 1.0)
    if (
        isinstance(speed, bool)
        or not isinstance(speed, (int, float))
        or not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED)
    ):
        raise ApiError(
            400,
            f"speed: must be a number between {MIN_SPEED} and {MAX_SPEED} on "
            f"this server (got {speed!r})",
            "speed",
            "invalid_value",
        )
    _string(body, "instructions", required=False)
    if body.get("stream_format", "audio") != "audio":
        raise ApiError(
            400,
            f"stream_format: only 'audio' is supported (got {body['stream_format']!r})",
            "stream_format",
            "invalid_value",
        )
    assert model is not None and text is not None  # required fields
    return SpeechRequest(model, text, voice, fmt, float(speed))


class OpenAISpeech:
    """The OpenAI-compatible routes, relayed to the public gRPC API."""

    def __init__(self, stub: Callable[[], tts_pb2_grpc.TextToSpeechStub]):
        self.stub = stub
        self.created = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        """Registers the /v1 routes on `app`."""
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/v1/audio/voices", self.voices)

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "split-tts"}

    async def models(self, _request: web.Request) -> web.Response:
        """GET /v1/models: every model name this server answers to."""
        return web.json_response({"object": "list", "data": [self._model(m) for m in MODELS]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}."""
        name = request.match_info["model"]
        if name not in MODELS:
            return ApiError(
                404, f"model: the model {name!r} does not exist", "model", "model_not_found"
            ).response()
        return web.json_response(self._model(name))

    async def voices(self, _request: web.Request) -> web.Response:
        """GET /v1/audio/voices: the deployment's voices, shaped like OpenAI's voice objects."""
        try:
            reply = await self.stub().ListVoices(pb.ListVoicesRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return from_grpc(exc).response()
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": v.name,
                        "object": "audio.voice",
                        "name": v.name,
                        "created_at": self.created,
                        "type": "audio_sample",
                        "language_codes": list(v.language_codes),
                        "sample_rate_hz": v.sample_rate_hz,
                        "description": v.description,
                        "is_default": v.is_default,
                    }
                    for v in reply.voices
                ],
            }
        )

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/audio/speech: the audio, streamed as it is made."""
        try:
            body = await request.json()
        except ValueError:
            return ApiError(
                400, "the request body is not valid JSON", None, "invalid_json"
            ).response()
        try:
            speech = parse_speech_request(body)
        except ApiError as exc:
            return exc.response()
        request_id = (
            request.headers.get("X-Request-Id", "")[:128] or f"openai-{uuid.uuid4().hex[:12]}"
        )
        call = self.stub().Synthesize(speech.to_grpc(request_id), timeout=RPC_TIMEOUT_S)
        response = None
        try:
            # Wait for the first message: until then an error can still be a proper status.
            first = await call.read()
            response = web.StreamResponse(
                headers={
                    "Content-Type": FORMATS[speech.response_format][1],
                    "X-Request-Id": request_id,
                }
            )
            response.enable_chunked_encoding()
            await response.prepare(request)
            message = first
            while message is not grpc.aio.EOF:
                if message.HasField("audio") and message.audio.audio:
                    await response.write(message.audio.audio)
                message = await call.read()
            await response.write_eof()
            return response
        except grpc.aio.AioRpcError as exc:
            if response is None:
                return from_grpc(exc).response()
            log.warning(
                "speech %s failed after its first byte: %s %s",
                request_id,
                exc.code().name,
                exc.details(),
            )
            if request.transport is not None:
                request.transport.close()  # a cut stream must not look complete
            return response
        except ConnectionResetError:  # the client went away
            return response if response is not None else web.Response(status=499)
        finally:
            call.cancel()  # a client that went away cancels the synthesis downstream
