"""gRPC servicer of splittts.text.v1: request message -> validated params -> engine -> stream."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from servicekit import tracing
from servicekit.errors import InvalidArgument, ResourceExhausted
from servicekit.logs import log_event
from splittts.text.v1 import text_pb2 as pb, text_pb2_grpc
from text_service import metrics
from text_service.async_engine import AsyncEngine, Pace
from text_service.constraints import PhonemeSync
from text_service.errors import CapacityError, InvalidRequestError
from text_service.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# SamplingParams field -> request field, so errors name what the caller sent.
_FIELD_NAMES = {
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "repetition_window": "sampling.repetition_window",
    "seed": "sampling.seed",
    "allowed_token_range": "allowed_tokens",
}

_GenerateContext = grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse]
_InfoContext = grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo]

# A client's own deadline expires a transit time before ours, and its cancel can arrive first.
_DEADLINE_SLACK_S = 0.5


def _stop_reason(context: grpc.aio.ServicerContext) -> str:
    """Why a stream stopped without an error: its deadline, or the client's cancel."""
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining < _DEADLINE_SLACK_S else "cancelled"


def max_bytes_per_token(tokenizer) -> int:
    """A bound on the UTF-8 bytes of text one token can cover, from the longest vocabulary entry.

    Byte-level and SentencePiece vocabularies spell a byte with at least one character; the
    factor 4 leaves room for normalisers that fold several input characters into one.
    """
    if tokenizer is None:
        return 0
    return 4 * max(len(t.encode()) for t in tokenizer.get_vocab())


def _ms(a: float | None, b: float | None) -> float:
    return 1e3 * (b - a) if a is not None and b is not None else 0.0


def _phoneme_sync(request: pb.GenerateRequest) -> PhonemeSync | None:
    """The request's PhonemeSync message as the engine's constraint (validated later)."""
    if not request.HasField("phoneme_sync"):
        return None
    m = request.phoneme_sync
    if not m.HasField("speech_tokens"):
        raise InvalidRequestError("phoneme_sync.speech_tokens", "is required")
    n = len(m.phoneme_ids)
    if not m.max_tokens and m.max_tokens_per_phoneme == 0:
        raise InvalidRequestError(
            "phoneme_sync.max_tokens_per_phoneme", "must be > 0 when max_tokens is empty"
        )
    return PhonemeSync(
        phoneme_ids=tuple(m.phoneme_ids),
        speech_token_range=(m.speech_tokens.start, m.speech_tokens.end),
        end_token_id=m.end_token_id,
        min_tokens=tuple(m.min_tokens) if m.min_tokens else (0,) * n,
        max_tokens=tuple(m.max_tokens) if m.max_tokens else (m.max_tokens_per_phoneme,) * n,
    )


class StreamChunks:
    """When a Generate stream's pending tokens leave: the first token at once (it is the TTFT),
    then messages of at least 2 tokens, then 4 (four of those), then `most`.

    A speech stream's first audio waits for about a dozen speech tokens and the phonemes
    written between them: 13-19 tokens on the default voice's natural held-out sentences.
    Messages of 4 deliver the token that completes them at most 3 tokens late (1.5 on average);
    doubling straight to 8 left 4 on average, 3.6 ms of time to first audio at one stream
    (bench/README.md). Later tokens travel in few messages.
    """

    RAMP = (1, 2, 4, 4, 4, 4)  # least tokens in each of the first messages (at most `most`)

    def __init__(self, most: int):
        self.most = max(1, most)
        self.sent_messages = 0

    @property
    def target(self) -> int:
        ramp = self.RAMP[self.sent_messages] if self.sent_messages < len(self.RAMP) else self.most
        return min(self.most, ramp)

    def ready(self, pending: int, done: bool) -> bool:
        return pending > 0 and (pending >= self.target or done)

    def sent(self) -> None:
        self.sent_messages += 1


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    """Generate streams token chunks as they are sampled; cancelling the call aborts it."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        core = engine.engine
        self.vocab_size = core.config.vocab_size
        self.max_model_len = core.config.max_model_len
        self.max_prompt_bytes = self.max_model_len * max_bytes_per_token(core.tokenizer)
        metrics.follow_engine_stats(lambda: self.engine.stats)

    def ready(self) -> bool:
        """SERVING while the engine loop runs."""
        return self.engine.ready()

    async def _prompt(self, request: pb.GenerateRequest) -> tuple[str, list[int]]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text.strip():
                raise InvalidArgument("text: must not be empty")
            tokenizer = self.engine.engine.tokenizer
            if tokenizer is None:
                raise InvalidArgument("text: this model has no tokenizer.json; send token_ids")
            # Sizes first: a text this long cannot fit, and tokenising it would take a while.
            size = len(request.text.encode())
            if size > self.max_prompt_bytes:
                raise InvalidArgument(
                    f"text: {size} bytes cannot fit the model's limit max_model_len="
                    f"{self.max_model_len} tokens (at most {self.max_prompt_bytes} bytes)"
                )
            encoding = await asyncio.to_thread(
                tokenizer.encode, request.text, add_special_tokens=False
            )
            return "text", encoding.ids
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidArgument("token_ids.ids: must not be empty")
            if len(ids) > self.max_model_len:
                raise InvalidArgument(
                    f"token_ids.ids: prompt of {len(ids)} tokens is longer than "
                    f"the model's limit max_model_len={self.max_model_len}"
                )
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(
                    f"token_ids.ids: id {bad} is outside the vocabulary [0, {self.vocab_size})"
                )
            return "token_ids", ids
        raise InvalidArgument("prompt: set either text or token_ids")

    @staticmethod
    def _pace(request: pb.GenerateRequest) -> Pace | None:
        if not request.HasField("pace"):
            return None
        rate, lead = request.pace.tokens_per_second, request.pace.lead_tokens
        if not (math.isfinite(rate) and rate > 0):
            raise InvalidArgument("pace.tokens_per_second: must be > 0 and finite")
        if lead < 1:
            raise InvalidArgument("pace.lead_tokens: must be >= 1")
        return Pace(rate, lead)

    def _params(self, request: pb.GenerateRequest, field: str, prompt_len: int) -> SamplingParams:
        s = request.sampling
        if prompt_len > self.max_model_len:
            raise InvalidArgument(
                f"{field}: prompt of {prompt_len} tokens is longer than the "
                f"model's limit max_model_len={self.max_model_len}"
            )
        allowed = None
        if request.HasField("allowed_tokens"):
            allowed = (request.allowed_tokens.start, request.allowed_tokens.end)
        try:
            params = SamplingParams(
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p or 1.0,
                repetition_penalty=s.repetition_penalty or 1.0,
                repetition_window=s.repetition_window,
                seed=s.seed if s.HasField("seed") else None,
                max_tokens=request.max_tokens,
                stop_token_ids=tuple(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
                allowed_token_range=allowed,
                phoneme_sync=_phoneme_sync(request),
            )
            params.validate(
                self.vocab_size,
                self.max_model_len,
                prompt_len,
                self.engine.engine.config.eos_token_ids,
            )
        except InvalidRequestError as exc:
            name = {"prompt_token_ids": field}.get(
                exc.field, _FIELD_NAMES.get(exc.field, exc.field)
            )
            raise InvalidArgument(f"{name}: {exc.rule}") from None
        return params

    async def Generate(
        self, request: pb.GenerateRequest, context: _GenerateContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the sampled token ids; the last message has finish reason, usage, timings."""
        field, prompt = await self._prompt(request)
        params = self._params(request, field, len(prompt))
        pace = self._pace(request)
        request_id = request.request_id or uuid.uuid4().hex
        tracing.annotate(**{"splittts.request_id": request_id})
        try:
            stream = self.engine.add(request_id, prompt, params, pace)
        except CapacityError as exc:
            raise ResourceExhausted(str(exc)) from None
        except ValueError as exc:
            raise InvalidArgument(f"request_id: {exc}") from None
        metrics.PROMPT_TOKENS.inc(len(prompt))
        chunks = StreamChunks(request.stream_chunk_tokens)
        sent, pending, token_times = 0, [], []
        first_sent = last_event = None
        seq = None
        outcome = None  # set by an error; a stream that just stops was cancelled or timed out
        try:
            while True:
                events = await stream.next_events()
                for ev in events:
                    pending.extend(ev.token_ids)
                    token_times.extend([ev.time] * len(ev.token_ids))
                    seq, last_event = ev.seq, ev
                done = last_event is not None and last_event.finished
                if chunks.ready(len(pending), done):
                    yield pb.GenerateResponse(token_ids=pending, first_token_index=sent)
                    if first_sent is None:
                        first_sent = time.perf_counter()
                    sent += len(pending)
                    pending = []
                    chunks.sent()
                if done:
                    break
        except Exception as exc:  # counted, then mapped to a status by servicekit
            outcome = "rejected" if isinstance(exc, CapacityError) else "failed"
            raise
        finally:
            # A cancel reaches this generator as CancelledError at an await, or as GeneratorExit
            # at a yield when grpc was cancelled while writing the message and closes us later.
            if last_event is None or not last_event.finished:
                self.engine.abort(request_id)  # cancelled or failed: free its cache now
                metrics.REQUESTS.labels(outcome or _stop_reason(context)).inc()
            else:
                self.engine.release(request_id)
        end = time.perf_counter()
        assert seq is not None  # the loop ends only on a finished event, which carries it
        usage = pb.Usage(
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            preemptions=seq.num_preemptions,
        )
        decode_ms = _ms(token_times[0], token_times[-1]) if token_times else 0.0
        timings = pb.GenerateTimings(
            queue_ms=_ms(stream.arrival_time, seq.first_scheduled_time),
            prefill_ms=_ms(seq.first_scheduled_time, getattr(seq, "prefill_done_time", None)),
            ttft_ms=_ms(stream.arrival_time, first_sent),
            decode_ms=decode_ms,
            mean_itl_ms=decode_ms / (len(token_times) - 1) if len(token_times) > 1 else 0.0,
            total_ms=_ms(stream.arrival_time, end),
        )
        self._observe(seq, timings, token_times)
        self._trace(stream.arrival_time, seq, token_times)
        log_event(
            log,
            "request finished",
            request_id=request_id,
            prompt_tokens=len(prompt),
            completion_tokens=sent,
            finish=seq.finish_reason,
            ttft_ms=round(timings.ttft_ms, 2),
            total_ms=round(timings.total_ms, 2),
            trace_id=tracing.trace_id(context),
        )
        yield pb.GenerateResponse(
            first_token_index=sent,
            finish_reason=_FINISH.get(seq.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
            usage=usage,
            timings=timings,
        )

    @staticmethod
    def _trace(arrival: float, seq, token_times: list[float]) -> None:
        """Queue, prefill and decode as child spans of the call's, on the engine's own clock."""
        scheduled, prefilled = seq.first_scheduled_time, seq.prefill_done_time
        if scheduled is not None:
            tracing.record_span("queue", arrival, scheduled)
            if prefilled is not None:
                tracing.record_span(
                    "prefill",
                    scheduled,
                    prefilled,
                    **{
                        "splittts.prompt_tokens": seq.num_prompt_tokens,
                        "splittts.cached_prompt_tokens": seq.num_cached_tokens,
                    },
                )
        if token_times:
            tracing.record_span(
                "decode",
                token_times[0],
                token_times[-1],
                **{
                    "splittts.completion_tokens": len(token_times),
                    "splittts.preemptions": seq.num_preemptions,
                },
            )

    def _observe(self, seq, timings: pb.GenerateTimings, token_times: list[float]) -> None:
        metrics.TTFT.observe(timings.ttft_ms / 1e3)
        metrics.QUEUE.observe(timings.queue_ms / 1e3)
        metrics.PREFILL.observe(timings.prefill_ms / 1e3)
        metrics.DECODE.observe(timings.decode_ms / 1e3)
        metrics.E2E.observe(timings.total_ms / 1e3)
        for a, b in zip(token_times, token_times[1:]):
            metrics.ITL.observe(b - a)
        metrics.GENERATION_TOKENS.inc(len(token_times))
        metrics.REQUESTS.labels(seq.finish_reason or "unknown").inc()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: _InfoContext
    ) -> pb.ModelInfo:
        """The loaded model and the engine's limits and load."""
        core, stats = self.engine.engine, self.engine.stats
        return pb.ModelInfo(
            model=self.model_name,
            model_type=core.model_config.model_type,
            vocab_size=core.config.vocab_size,
            max_model_len=core.config.max_model_len,
            eos_token_ids=list(core.config.eos_token_ids),
            device=str(core.device),
            dtype=str(core.dtype).removeprefix("torch."),
            block_size=core.config.block_size,
            num_kv_blocks=core.config.num_kv_blocks,
            num_used_blocks=int(stats.get("num_used_blocks", 0)),
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
            num_used_state_slots=int(stats.get("num_used_state_slots", 0)),
            max_pending_requests=self.engine.max_pending,
        )
