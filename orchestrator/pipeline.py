"""One synthesis: text segments -> Generate streams -> speech tokens -> one Vocode stream -> audio.

Tokens are forwarded to the vocoder as they arrive, never waiting for a whole sentence. The next
segment is generated while the current one is still being forwarded and vocoded, and all
segments share one Vocode stream, so the caller hears one continuous stream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc
import numpy as np

from orchestrator.audio import AudioOutput, warm_encoders
from orchestrator.latency import LatencyTracker
from orchestrator.phoneme_sync import SyncPlan, SyncPlanner
from orchestrator.replicas import Replica, ReplicaPool
from orchestrator.voices import VoiceSpec
from orchestrator.word_timings import word_spans
from servicekit import tracing
from servicekit.errors import InvalidArgument, StatusError
from servicekit.flow import AheadBudget
from splittts.text.v1 import text_pb2, text_pb2_grpc
from splittts.tts.v1 import tts_pb2
from splittts.vocoder.v1 import vocoder_pb2, vocoder_pb2_grpc

log = logging.getLogger(__name__)

_VocodeCall = grpc.aio.StreamStreamCall[vocoder_pb2.VocodeRequest, vocoder_pb2.VocodeResponse]

_END = object()
# token chunks a segment may hold for the vocoder: past it its Generate stream is not read, and
# gRPC flow control, then the text service's backlog bound, pause its generation
_MAX_QUEUED_CHUNKS = 8
# speech sent to the vocoder whose audio has not come back: the vocoder's own receive window
# would otherwise take thousands of tokens. It must exceed what the vocoder holds back for its
# next chunk (--max-chunk-frames 128 plus context, about 1.6 s), or both sides would wait.
_MAX_IN_VOCODER_S = 3.0
# speech tokens of each warm-up sentence (about 3 s of audio): past the vocoder's first job and
# its first growing chunks. A voice whose LM does not end a sentence (or a test voice with a
# random one) would otherwise hold start-up for up to `max_tokens` or the warm-up's timeout.
_WARMUP_MAX_TOKENS = 128
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass(frozen=True)
class SynthesisRequest:
    """A validated request, whatever RPC it came from."""

    request_id: str  # the caller's (or a made-up) id: a label in logs and traces only
    voice: VoiceSpec
    language: str  # "" = each sentence's language from its script (FrontEnd.process)
    encoding: str
    sample_rate_hz: int
    speaking_rate: float
    sampling: dict
    trace_id: str
    arrival: float = field(default_factory=time.perf_counter)
    # unique per call: the downstream services key their work by it, so two calls that carry
    # the same caller id never collide
    call_id: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def downstream_id(self) -> str:
        return f"{self.request_id}.{self.call_id}"


def downstream_error(
    service: str, replica: Replica | None, exc: grpc.aio.AioRpcError
) -> StatusError:
    """The caller's status for a failed downstream call; the replica's address goes to the log only."""
    code = exc.code() if exc.code() in _PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
    address = replica.address if replica is not None else "(none picked)"
    log.warning("%s replica %s failed: %s: %s", service, address, exc.code().name, exc.details())
    return StatusError(f"{service} service: {exc.code().name}: {exc.details()}", code)


class _Segment:
    def __init__(
        self, text: str, model_input: str, normalized: str = "", plan: SyncPlan | None = None
    ):
        self.text = text
        self.model_input = model_input
        self.normalized = normalized or text
        self.plan = plan  # phoneme-synchronous decoding, when the voice declares it
        self.phoneme_starts: list[int] = []  # speech tokens before each emitted phoneme
        self.num_speech = 0
        self.tokens: asyncio.Queue = asyncio.Queue(maxsize=_MAX_QUEUED_CHUNKS)
        self.task: asyncio.Task | None = None

    def count(self, ids, voice: VoiceSpec) -> None:
        """Account for generated ids: speech tokens, and where each phoneme started."""
        for t in ids:
            if voice.is_speech(t):
                self.num_speech += 1
            elif t != voice.end_token_id:
                self.phoneme_starts.append(self.num_speech)

    def word_timings(
        self, index: int, base_tokens: int, ms_per_token: float
    ) -> tts_pb2.WordTimings:
        assert self.plan is not None, "word timings come from phoneme-synchronous segments"
        spans = word_spans(
            self.normalized, self.plan.phoneme_chars, self.phoneme_starts, self.num_speech
        )
        return tts_pb2.WordTimings(
            words=[
                tts_pb2.WordTiming(
                    word=w.word,
                    start_ms=(base_tokens + w.start) * ms_per_token,
                    end_ms=(base_tokens + w.end) * ms_per_token,
                    segment=index,
                )
                for w in spans
            ]
        )


class VocodeSession:
    """The request's one Vocode stream, with send times kept for per-hop transit."""

    def __init__(self, pool: ReplicaPool, voice: VoiceSpec, request_id: str):
        self.pool, self.voice, self.request_id = pool, voice, request_id
        self.replica: Replica | None = None
        self.call: _VocodeCall | None = None
        self.sent_at: list[float] = []
        self._counted = False  # whether this session is counted in replica.in_flight

    async def open(self) -> None:
        self.replica = await pick_ready(self.pool)
        self.replica.in_flight += 1
        self._counted = True
        stub = vocoder_pb2_grpc.VocoderStub(self.replica.channel)
        self.call = stub.Vocode()  # the channel's interceptor adds the call's traceparent
        await self.write(
            vocoder_pb2.VocodeRequest(
                config=vocoder_pb2.VocodeConfig(
                    voice=self.voice.name,
                    input_kind=vocoder_pb2.INPUT_KIND_SPEECH_TOKENS,
                    request_id=self.request_id,
                )
            )
        )

    async def write(self, message: vocoder_pb2.VocodeRequest) -> None:
        assert self.call is not None, "open() first"
        self.sent_at.append(time.perf_counter())
        try:
            await self.call.write(message)
        except asyncio.InvalidStateError:
            # The stream ended before this write (its replica failed or went away): the
            # caller sees the stream's own status, as a read would have.
            if not self.call.done():
                raise
            code, details = await self.call.code(), await self.call.details()
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), details
            ) from None

    async def end(self) -> None:
        await self.write(vocoder_pb2.VocodeRequest(end_of_stream=True))
        assert self.call is not None
        await self.call.done_writing()

    def close(self) -> None:
        if self.call is not None and not self.call.done():
            self.call.cancel()
        if self._counted and self.replica is not None:
            self.replica.in_flight -= 1
            self._counted = False


async def _coalesced(queue: asyncio.Queue):
    """The next item of a segment's token queue, with every token list queued behind it merged
    in: when the model runs ahead of the vocoder, one message carries the backlog instead of one
    message per decode step."""
    item = await queue.get()
    if not isinstance(item, list):
        return item
    item = list(item)
    while not queue.empty() and isinstance(queue._queue[0], list):  # type: ignore[attr-defined]  # peek
        item.extend(queue.get_nowait())
    return item


async def pick_ready(pool: ReplicaPool) -> Replica:
    """A replica whose connection is up; others are health-checked first and skipped if down."""
    tried: tuple[Replica, ...] = ()
    while True:
        replica = pool.pick(exclude=tried)
        if replica.channel.get_state() == grpc.ChannelConnectivity.READY or await pool.check(
            replica
        ):
            return replica
        tried += (replica,)


class Pipeline:
    """Runs syntheses against pools of text-service and vocoder-service replicas."""

    def __init__(
        self,
        text_pool: ReplicaPool,
        vocoder_pool: ReplicaPool,
        frontends: dict,
        lookahead_segments: int = 1,
        stream_chunk_tokens: int = 8,
        max_audio_ahead_s: float = 4.0,
        pace_realtime: float = 1.25,
        pace_lead_tokens: int = 64,
    ):
        if max_audio_ahead_s <= 0:
            raise ValueError(f"max_audio_ahead_s must be > 0 (got {max_audio_ahead_s})")
        if not (pace_realtime == 0 or pace_realtime >= 1) or pace_lead_tokens < 1:
            raise ValueError(
                f"pace_realtime must be 0 (off) or >= 1 and pace_lead_tokens >= 1 (got "
                f"{pace_realtime}, {pace_lead_tokens})"
            )
        self.text_pool = text_pool
        self.vocoder_pool = vocoder_pool
        self.frontends = frontends  # voice name -> FrontEnd
        self.lookahead_segments = lookahead_segments
        # the model outruns real time many times over: after the first token, tokens travel in
        # eights, so every hop handles an eighth of the messages (each costs the vocoder's core
        # more than the audio of one token) for a few milliseconds of delay
        self.stream_chunk_tokens = stream_chunk_tokens
        # audio made ahead of what the caller has taken: past it the Vocode stream is not read,
        # so a paused caller backs up to the vocoder and from there to the text service
        self.max_audio_ahead_s = max_audio_ahead_s
        # While other requests run, a planned segment's tokens are generated at most this many
        # times as fast as its audio plays, after a lead of about the first audio's tokens and a
        # second of speech: run flat out, each stream's tokens came in a burst of a few hundred
        # ms, so at 8 streams the text service stepped 1-2 sequences at a time, in bursts that
        # took the vocoder's CPU (bench/README.md). 0: flat out.
        self.pace_realtime = pace_realtime
        self.pace_lead_tokens = pace_lead_tokens
        self._planners: dict[str, SyncPlanner | None] = {}

    def planner(self, voice: VoiceSpec) -> SyncPlanner | None:
        """The voice's phoneme-sync planner (None when it does not declare phoneme_sync)."""
        if voice.name not in self._planners:
            self._planners[voice.name] = (
                SyncPlanner.for_voice(voice.directory, voice.prompt_template, voice.phoneme_sync)
                if voice.phoneme_sync
                else None
            )
        return self._planners[voice.name]

    async def warmup(self, voices: list[VoiceSpec], timeout_s: float = 60.0) -> None:
        """Load now what a first request would otherwise load: each voice's front end (G2P
        voices, number readers, pinyin), its phoneme-sync planner and every audio encoder; then
        one short synthesis per voice through the backends, which warms what only a real request
        reaches (the streams on each channel, the text service's constrained decoding of a full
        prompt, the vocoder's first stream). A backend that is not up yet is not waited for."""
        texts = await asyncio.to_thread(self._load, voices)
        for voice in voices:
            voice = replace(voice, max_tokens=min(voice.max_tokens, _WARMUP_MAX_TOKENS))
            language = voice.languages[0] if len(voice.languages) == 1 else ""
            req = SynthesisRequest(
                request_id="warmup",
                voice=voice,
                language=language,
                encoding="LINEAR16",
                sample_rate_hz=0,
                speaking_rate=1.0,
                sampling=dict(voice.sampling),
                trace_id=secrets.token_hex(16),
            )

            async def pieces(texts=texts[voice.name]):
                for text in texts:
                    yield text

            async def run(req=req, pieces=pieces) -> None:
                async for _ in self.synthesize(req, pieces(), LatencyTracker(req.request_id)):
                    pass

            try:
                await asyncio.wait_for(run(), timeout_s)
            except (TimeoutError, StatusError, grpc.aio.AioRpcError) as exc:
                log.warning(
                    "warm-up synthesis of voice %s failed (the first request will be slower): %s",
                    voice.name,
                    exc,
                )

    def _load(self, voices: list[VoiceSpec]) -> dict[str, list[str]]:
        """The blocking part of warmup(); returns the warm-up sentences of each voice."""
        texts = {}
        for voice in voices:
            segments = self.frontends[voice.name].warmup()
            planner = self.planner(voice)
            if planner is not None:
                for segment in segments:
                    planner.plan(segment.model_input)
            warm_encoders(voice.sample_rate)
            texts[voice.name] = [segment.text for segment in segments]
        return texts

    def _stretch(self, req: SynthesisRequest) -> float:
        """The tempo change left to the audio: none where the durations already carry the rate."""
        planner = self.planner(req.voice)
        return 1.0 if planner is not None and planner.schedules_rate else req.speaking_rate

    def _prepare(self, frontend, text: str, req: SynthesisRequest) -> list[_Segment]:
        """Front end and phoneme-sync plans of one text piece (run off the event loop); with a
        forced duration schedule the speaking rate scales the durations before synthesis."""
        planner = self.planner(req.voice)
        return [
            _Segment(
                s.text,
                s.model_input,
                s.normalized,
                planner.plan(s.model_input, req.speaking_rate if planner.schedules_rate else 1.0)
                if planner
                else None,
            )
            for s in frontend.process(text, req.language)
        ]

    async def synthesize(
        self, req: SynthesisRequest, texts: AsyncIterator[str], tracker: LatencyTracker
    ) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """Audio chunks as they are made; the caller appends tracker.report().

        The work runs in one task group (`_run`) beside this generator, never inside it: a
        generator suspended at `yield` must not own tasks whose failure would cancel its
        consumer instead of itself. The group hands over its outcome once, at the end."""
        outbox: asyncio.Queue = asyncio.Queue()  # bounded by `ahead` (audio) and the segments
        ahead = AheadBudget(self.max_audio_ahead_s)
        runner = asyncio.create_task(self._run(req, texts, tracker, outbox, ahead))
        try:
            seq = 0
            while True:
                item = await outbox.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tts_pb2.WordTimings):
                    yield tts_pb2.SynthesizeResponse(words=item)
                    continue
                for piece in item:
                    yield tts_pb2.SynthesizeResponse(
                        audio=tts_pb2.AudioChunk(
                            audio=piece.audio,
                            sequence_number=seq,
                            first_sample=piece.first_sample,
                            duration_s=piece.duration_s,
                            sample_rate_hz=piece.sample_rate_hz,
                        )
                    )
                    tracker.on_audio_sent(piece.duration_s)
                    ahead.taken(piece.duration_s)
                    seq += 1
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    async def _run(
        self,
        req: SynthesisRequest,
        texts: AsyncIterator[str],
        tracker: LatencyTracker,
        outbox: asyncio.Queue,
        ahead: AheadBudget,
    ) -> None:
        """Every task of one synthesis in one group: the first failure cancels the rest, and the
        outcome (the end, or the one error the caller should see) goes to the outbox."""
        out = AudioOutput(
            req.voice.sample_rate, req.encoding, req.sample_rate_hz, self._stretch(req)
        )
        vocoder = VocodeSession(self.vocoder_pool, req.voice, req.downstream_id)
        in_vocoder = AheadBudget(_MAX_IN_VOCODER_S)
        try:
            await vocoder.open()
            async with asyncio.TaskGroup() as group:
                group.create_task(
                    self._feed(req, texts, vocoder, tracker, outbox, group, in_vocoder)
                )
                group.create_task(
                    self._read_audio(vocoder, out, tracker, outbox, ahead, in_vocoder)
                )
            outbox.put_nowait(_END)
        except grpc.aio.AioRpcError as exc:  # opening the Vocode stream
            outbox.put_nowait(downstream_error("vocoder", vocoder.replica, exc))
        except BaseExceptionGroup as failed:
            outbox.put_nowait(_first_cause(failed))
        except Exception as exc:  # noqa: BLE001 - e.g. no healthy vocoder replica
            outbox.put_nowait(exc)
        finally:
            vocoder.close()

    # -- text side ----------------------------------------------------------------------------
    async def _feed(self, req, texts, vocoder, tracker, outbox, group, in_vocoder) -> None:
        """Segments in order: each one's speech tokens go to the vocoder as they arrive, while
        the audio in the making there is under its bound."""
        ready: asyncio.Queue = asyncio.Queue(maxsize=self.lookahead_segments)
        awaiting_text = asyncio.Event()  # set while the caller has not sent the next text

        async def next_text(it):
            awaiting_text.set()
            try:
                return await it.__anext__()
            finally:
                awaiting_text.clear()

        async def produce() -> None:
            frontend = self.frontends[req.voice.name]
            index = 0
            it = texts.__aiter__()
            while True:
                try:
                    text = await next_text(it)
                except StopAsyncIteration:
                    break
                started = time.perf_counter()
                with tracing.span("frontend"):
                    segments = await asyncio.to_thread(self._prepare, frontend, text, req)
                tracker.frontend_ms += 1e3 * (time.perf_counter() - started)
                for seg in segments:
                    await ready.put(seg)  # at most lookahead_segments wait ahead
                    group.create_task(self._generate(req, seg, tracker, index))
                    index += 1
            await ready.put(None)

        group.create_task(produce())
        lo = req.voice.speech_token_range[0]
        ms_per_token = (
            1e3 * req.voice.samples_per_token / req.voice.sample_rate / self._stretch(req)
        )
        s_per_token = req.voice.samples_per_token / req.voice.sample_rate
        index = 0
        while (seg := await ready.get()) is not None:
            base_tokens = tracker.num_speech_tokens
            while True:
                await in_vocoder.room()  # the tokens wait here, coalescing, meanwhile
                ids = await _coalesced(seg.tokens)
                if ids is None:
                    break
                tracker.num_speech_tokens += len(ids)
                in_vocoder.add(len(ids) * s_per_token)
                await self._to_vocoder(
                    vocoder,
                    vocoder_pb2.VocodeRequest(
                        tokens=vocoder_pb2.TokenChunk(ids=[t - lo for t in ids])
                    ),
                )
            if seg.plan is not None:
                outbox.put_nowait(seg.word_timings(index, base_tokens, ms_per_token))
            index += 1
            if ready.empty() and awaiting_text.is_set() and tracker.num_speech_tokens:
                # The caller is still writing: let the vocoder finish this sentence now
                # rather than hold its tail back until more text arrives.
                await self._to_vocoder(vocoder, vocoder_pb2.VocodeRequest(flush=True))
        if tracker.num_segments == 0:
            raise InvalidArgument(
                "text: nothing to speak after normalisation (only punctuation or symbols)"
            )
        if tracker.num_speech_tokens == 0:
            raise StatusError(
                "the speech model produced no speech tokens for this text", grpc.StatusCode.INTERNAL
            )
        try:
            await vocoder.end()
        except grpc.aio.AioRpcError as exc:
            raise downstream_error("vocoder", vocoder.replica, exc) from None

    @staticmethod
    async def _to_vocoder(vocoder: VocodeSession, message: vocoder_pb2.VocodeRequest) -> None:
        try:
            await vocoder.write(message)
        except grpc.aio.AioRpcError as exc:
            raise downstream_error("vocoder", vocoder.replica, exc) from None

    def _generate_request(self, req: SynthesisRequest, seg: _Segment, index: int):
        voice = req.voice
        max_tokens = voice.max_tokens
        if voice.max_tokens_per_char > 0:
            max_tokens = min(max_tokens, int(64 + voice.max_tokens_per_char * len(seg.model_input)))
        s = req.sampling
        sampling = text_pb2.SamplingConfig(
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            top_k=s.get("top_k", 0),
            repetition_penalty=s.get("repetition_penalty", 1.0),
            repetition_window=s.get("repetition_window", 0),
        )
        if s.get("seed") is not None:
            sampling.seed = (int(s["seed"]) + index) % (1 << 64)
        if seg.plan is not None:
            p, (lo, hi) = seg.plan, voice.speech_token_range
            return text_pb2.GenerateRequest(
                request_id=f"{req.downstream_id}-{index}",
                token_ids=text_pb2.TokenIds(ids=p.prompt_ids),
                sampling=sampling,
                max_tokens=p.max_output_tokens,  # the plan bounds the output
                stop_token_ids=[voice.end_token_id],
                stream_chunk_tokens=self.stream_chunk_tokens,
                phoneme_sync=text_pb2.PhonemeSync(
                    phoneme_ids=p.phoneme_ids,
                    speech_tokens=text_pb2.TokenRange(start=lo, end=hi),
                    end_token_id=voice.end_token_id,
                    min_tokens=p.min_tokens,
                    max_tokens=p.max_tokens,
                ),
                pace=self._pace(voice, p),
            )
        allowed = voice.allowed_token_range or voice.speech_token_range
        return text_pb2.GenerateRequest(
            request_id=f"{req.downstream_id}-{index}",
            text=voice.prompt_template.replace("{text}", seg.model_input),
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=[voice.end_token_id],
            stream_chunk_tokens=self.stream_chunk_tokens,
            allowed_tokens=text_pb2.TokenRange(start=allowed[0], end=allowed[1]),
        )

    def _pace(self, voice: VoiceSpec, plan: SyncPlan) -> text_pb2.Pace | None:
        """`pace_realtime` times the rate at which the plan's output is used: its LM tokens
        (phonemes, the planned speech tokens, the end) over its speech's seconds."""
        speech = sum(lo + hi for lo, hi in zip(plan.min_tokens, plan.max_tokens)) / 2
        if self.pace_realtime == 0 or speech <= 0:
            return None
        seconds = speech * voice.samples_per_token / voice.sample_rate
        tokens = len(plan.phoneme_ids) + speech + 1
        return text_pb2.Pace(
            tokens_per_second=self.pace_realtime * tokens / seconds,
            lead_tokens=self.pace_lead_tokens,
        )

    async def _generate(
        self, req: SynthesisRequest, seg: _Segment, tracker: LatencyTracker, index: int
    ) -> None:
        """Stream one segment's tokens into seg.tokens; retried once if a replica is gone."""
        request = self._generate_request(req, seg, index)
        tried: tuple[Replica, ...] = ()
        while True:
            replica = await pick_ready(self.text_pool) if not tried else self.text_pool.pick(tried)
            received = False
            try:
                with self.text_pool.lease(replica):
                    stub = text_pb2_grpc.TextGenerationStub(replica.channel)
                    sent = time.perf_counter()
                    first_ms = None
                    call = stub.Generate(request)
                    try:
                        async for resp in call:
                            if not received:
                                first_ms = 1e3 * (time.perf_counter() - sent)
                                received = True
                            seg.count(resp.token_ids, req.voice)
                            ids = [t for t in resp.token_ids if req.voice.is_speech(t)]
                            if ids:
                                await seg.tokens.put(ids)
                            if resp.HasField("timings"):
                                tracker.text_hop.address = replica.address
                                tracker.on_segment_done(
                                    resp.timings, first_ms, 1e3 * (time.perf_counter() - sent)
                                )
                    finally:
                        # a call left unread (cancelled, failed) would stay paused on
                        # its replica, holding its cache: end it there
                        call.cancel()
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and not received:
                    self.text_pool.mark_down(replica, exc.details() or "unavailable")
                    tried += (replica,)
                    continue
                raise downstream_error("text", replica, exc) from None
        await seg.tokens.put(None)

    # -- vocoder side -------------------------------------------------------------------------
    async def _read_audio(
        self,
        vocoder: VocodeSession,
        out: AudioOutput,
        tracker: LatencyTracker,
        outbox: asyncio.Queue,
        ahead: AheadBudget,
        in_vocoder: AheadBudget,
    ) -> None:
        assert vocoder.replica is not None and vocoder.call is not None, "open() first"
        tracker.vocoder_hop.address = vocoder.replica.address
        while True:
            await ahead.room()  # the caller has taken enough of what was made
            try:
                resp = await vocoder.call.read()
            except grpc.aio.AioRpcError as exc:
                raise downstream_error("vocoder", vocoder.replica, exc) from None
            if not isinstance(resp, vocoder_pb2.VocodeResponse):  # grpc.aio.EOF
                break
            now = time.perf_counter()
            if resp.HasField("summary"):
                tracker.vocoder_compute_ms = resp.summary.compute_ms
                continue
            t = resp.timings
            if 0 <= t.trigger_message < len(vocoder.sent_at):
                sent = vocoder.sent_at[t.trigger_message]
                tracker.vocoder_hop.add(1e3 * (now - sent) - t.service_ms)
                tracker.on_first_chunk(sent, t.service_ms, t.compute_ms)
            in_vocoder.taken(resp.audio.num_samples / vocoder.voice.sample_rate)
            pcm = np.frombuffer(resp.audio.pcm, dtype="<i2").astype(np.float32) / 32767.0
            pieces = out.push(pcm)
            if pieces:
                ahead.add(sum(piece.duration_s for piece in pieces))
                outbox.put_nowait(pieces)
        tail = out.finish()
        if tail:
            outbox.put_nowait(tail)


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    """The failure that ended a synthesis: the group's first exception other than a
    cancellation (the tasks it cancelled), searched through nested groups."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_cause(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
