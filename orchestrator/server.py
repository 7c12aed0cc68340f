"""gRPC servicer of splittts.tts.v1: validate, run the pipeline, stream audio, then the report."""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import AsyncIterator

import grpc

from orchestrator import metrics
from orchestrator.audio import ENCODINGS, resolve_audio_format
from orchestrator.frontend import StreamingSegmenter, split_sentences
from orchestrator.latency import LatencyTracker
from orchestrator.pipeline import Pipeline, SynthesisRequest
from orchestrator.voices import VoiceSpec
from servicekit import tracing
from servicekit.errors import InvalidArgument, NotFound, ResourceExhausted, StatusError
from servicekit.logs import log_event
from splittts.tts.v1 import tts_pb2 as pb, tts_pb2_grpc

log = logging.getLogger(__name__)

_SynthesizeContext = grpc.aio.ServicerContext[pb.SynthesizeRequest, pb.SynthesizeResponse]
_StreamingContext = grpc.aio.ServicerContext[pb.StreamingSynthesizeRequest, pb.SynthesizeResponse]
_VoicesContext = grpc.aio.ServicerContext[pb.ListVoicesRequest, pb.ListVoicesResponse]

MAX_TEXT_CHARS = 5000
MAX_STREAMING_TEXT_CHARS = 20000


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServicer):
    """The public TTS API."""

    def __init__(self, pipeline: Pipeline, voices: list[VoiceSpec], max_in_flight: int = 64):
        if not voices:
            raise ValueError("at least one voice is required")
        self.pipeline = pipeline
        self.voices = {v.name: v for v in voices}
        self.default_voice = voices[0].name
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    def ready(self) -> bool:
        """SERVING while each backend (text and vocoder) has a healthy replica."""
        return self.pipeline.text_pool.any_healthy and self.pipeline.vocoder_pool.any_healthy

    # -- validation ---------------------------------------------------------------------------
    def _request(
        self, context, *, voice: str, language_code: str, audio_config, sampling, request_id: str
    ) -> SynthesisRequest:
        name = voice or self.default_voice
        spec = self.voices.get(name)
        if spec is None:
            raise NotFound(f"voice: unknown voice {name!r}; available: {sorted(self.voices)}")
        if language_code:
            language = spec.language_for(language_code)
        elif len(spec.languages) == 1:
            language = spec.languages[0]
        else:
            language = ""  # none given: the front end picks each sentence's language by its script
        if language is None:
            raise InvalidArgument(
                f"language_code: voice {name!r} speaks "
                f"{', '.join(spec.languages)} (got {language_code!r})"
            )
        if audio_config.encoding not in pb.AudioEncoding.values():
            raise InvalidArgument(
                f"audio_config.encoding: unsupported value {audio_config.encoding}; "
                f"use one of {', '.join(ENCODINGS)}"
            )
        encoding = (
            pb.AudioEncoding.Name(audio_config.encoding) if audio_config.encoding else "LINEAR16"
        )
        try:
            fmt = resolve_audio_format(
                spec.sample_rate,
                encoding,
                audio_config.sample_rate_hz,
                audio_config.speaking_rate or 1.0,
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        params = dict(spec.sampling)
        for key in ("temperature", "top_p", "top_k", "seed"):
            if sampling.HasField(key):
                params[key] = getattr(sampling, key)
        if params.get("temperature", 0.0) < 0:
            raise InvalidArgument("sampling.temperature must be >= 0 (0 = greedy)")
        if not 0 < params.get("top_p", 1.0) <= 1:
            raise InvalidArgument("sampling.top_p must lie in (0, 1]")
        if params.get("top_k", 0) < 0:
            raise InvalidArgument("sampling.top_k must be >= 0 (0 = off)")
        return SynthesisRequest(
            request_id=request_id or uuid.uuid4().hex,
            voice=spec,
            language=language,
            encoding=fmt.encoding,
            sample_rate_hz=fmt.output_rate if audio_config.sample_rate_hz else 0,
            speaking_rate=fmt.speaking_rate,
            sampling=params,
            trace_id=tracing.trace_id(context) or secrets.token_hex(16),
        )

    def _admit(self) -> None:
        if self.in_flight >= self.max_in_flight:
            raise ResourceExhausted(
                f"{self.in_flight} syntheses in flight (max_in_flight="
                f"{self.max_in_flight}); retry later"
            )

    # -- RPCs -----------------------------------------------------------------------------------
    async def Synthesize(
        self, request: pb.SynthesizeRequest, context: _SynthesizeContext
    ) -> AsyncIterator[pb.SynthesizeResponse]:
        """Speak a whole text; audio streams back as it is made, then the LatencyReport."""
        tracker = LatencyTracker(request.request_id)
        text = request.text
        if not text.strip():
            raise InvalidArgument("text: must not be empty")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidArgument(
                f"text: {len(text)} characters exceed the limit of "
                f"{MAX_TEXT_CHARS}; split it or use StreamingSynthesize"
            )
        req = self._request(
            context,
            voice=request.voice,
            language_code=request.language_code,
            audio_config=request.audio_config,
            sampling=request.sampling,
            request_id=request.request_id,
        )
        tracker.request_id = req.request_id
        self._admit()

        async def texts() -> AsyncIterator[str]:
            for sentence in split_sentences(text, req.language or None):
                yield sentence

        async for msg in self._run("Synthesize", req, texts(), tracker):
            yield msg

    async def StreamingSynthesize(
        self,
        request_iterator: AsyncIterator[pb.StreamingSynthesizeRequest],
        context: _StreamingContext,
    ) -> AsyncIterator[pb.SynthesizeResponse]:
        """Config first, then text pieces; audio starts at the first sentence or clause."""
        tracker = LatencyTracker("")
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument(
                "config: the first message must be a StreamingSynthesizeConfig "
                "(the stream ended before it)"
            ) from None
        if first.WhichOneof("request") != "config":
            raise InvalidArgument(
                "config: the first message must be a StreamingSynthesizeConfig "
                f"(got {first.WhichOneof('request') or 'an empty message'})"
            )
        c = first.config
        req = self._request(
            context,
            voice=c.voice,
            language_code=c.language_code,
            audio_config=c.audio_config,
            sampling=c.sampling,
            request_id=c.request_id,
        )
        tracker.request_id = req.request_id
        self._admit()

        async def texts() -> AsyncIterator[str]:
            segmenter = StreamingSegmenter(req.language or None)
            total, blank = 0, True
            async for msg in requests:
                kind = msg.WhichOneof("request")
                if kind == "config":
                    raise InvalidArgument("config: sent twice; it must be the first message only")
                if kind != "text":
                    raise InvalidArgument("each message after the config must carry text")
                total += len(msg.text)
                blank = blank and not msg.text.strip()
                if total > MAX_STREAMING_TEXT_CHARS:
                    raise InvalidArgument(
                        f"text: {total} characters exceed the streaming limit "
                        f"of {MAX_STREAMING_TEXT_CHARS}"
                    )
                for segment in segmenter.push(msg.text):
                    yield segment
            if blank:
                raise InvalidArgument("text: no text arrived before the end of input")
            for segment in segmenter.flush():
                yield segment

        async for msg in self._run("StreamingSynthesize", req, texts(), tracker):
            yield msg

    async def _run(self, rpc: str, req: SynthesisRequest, texts, tracker: LatencyTracker):
        tracker.arrival = min(tracker.arrival, req.arrival)
        tracing.annotate(
            **{"splittts.request_id": req.request_id, "splittts.voice": req.voice.name}
        )
        self.in_flight += 1
        metrics.IN_FLIGHT.inc()
        status = "CANCELLED"
        try:
            async for msg in self.pipeline.synthesize(req, texts, tracker):
                yield msg
            report = tracker.report()
            report.trace_id = req.trace_id
            status = "OK"
            metrics.observe_report(report)
            log_event(
                log,
                "synthesis",
                request_id=req.request_id,
                rpc=rpc,
                voice=req.voice.name,
                ttfa_ms=round(report.ttfa_ms, 1),
                ttft_ms=round(report.ttft_ms, 1),
                audio_s=round(report.audio_s, 3),
                rtf=round(report.rtf, 3),
                segments=report.num_segments,
                underruns=report.underruns,
                trace_id=req.trace_id,
            )
            yield pb.SynthesizeResponse(report=report)
        except StatusError as exc:
            status = exc.code.name
            raise
        finally:
            self.in_flight -= 1
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(rpc, status).inc()

    async def ListVoices(
        self, request: pb.ListVoicesRequest, context: _VoicesContext
    ) -> pb.ListVoicesResponse:
        """Voices of this deployment, the default first."""
        voices = []
        for spec in self.voices.values():
            if request.language_code and spec.language_for(request.language_code) is None:
                continue
            voices.append(
                pb.Voice(
                    name=spec.name,
                    language_codes=list(spec.languages),
                    sample_rate_hz=spec.sample_rate,
                    description=spec.description,
                    is_default=spec.name == self.default_voice,
                )
            )
        return pb.ListVoicesResponse(voices=voices)
