"""gRPC servicer of splittts.vocoder.v1: many concurrent streams, one batcher per generator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np

from servicekit import tracing
from servicekit.errors import InvalidArgument, NotFound, ResourceExhausted
from servicekit.flow import AheadBudget
from servicekit.logs import log_event
from splittts.vocoder.v1 import vocoder_pb2 as pb, vocoder_pb2_grpc
from vocoder_service import metrics
from vocoder_service.backends import Backend
from vocoder_service.batcher import Batcher
from vocoder_service.chunking import ChunkPolicy
from vocoder_service.stream import VocoderStream
from vocoder_service.voice import VocoderVoice

log = logging.getLogger(__name__)

_VocodeContext = grpc.aio.ServicerContext[pb.VocodeRequest, pb.VocodeResponse]
_InfoContext = grpc.aio.ServicerContext[pb.GetInfoRequest, pb.VocoderInfo]

_END = object()


@dataclass(frozen=True)
class VocoderLimits:
    """Admission and input limits."""

    max_streams: int = 64
    max_chunk_frames: int = 4096  # tokens or mel frames in one message
    max_stream_frames: int = 22050 * 600 // 256  # ten minutes of audio
    # audio submitted for vocoding but not yet taken by the reader; past it the stream's input
    # is not read, so a slow reader backs up to its sender instead of filling memory
    max_audio_ahead_s: float = 2.0


def _on_cpu(backend: Backend) -> bool:
    return "cpu" in backend.device.lower()


def default_batch_frames(backend: Backend) -> int:
    """Window frames per forward. A forward cannot be interrupted, so this bounds how long a new
    stream's first chunk waits: 64 frames of HiFi-GAN V1 take about 0.18 s on one CPU core.
    Accelerators batch far more for about the same time."""
    return 64 if _on_cpu(backend) else 1024


STREAMING_MODES = ("auto", "stateful", "windowed")


def default_stateful(backend: Backend) -> bool:
    """Stateful streaming on CPU, where work saved is time saved; windowed on accelerators,
    where one batched forward over many streams' windows costs about as much as one."""
    return _on_cpu(backend)


def default_first_batch(backend: Backend) -> int:
    """Streams' first jobs per forward while any waits. One CPU core takes as long for four
    first chunks in one forward as for four in a row, so batching them only delays the first
    three; accelerators run a batch in about the time of one job."""
    return 1 if _on_cpu(backend) else 32


class VocoderServicer(vocoder_pb2_grpc.VocoderServicer):
    """Vocode: config first, then token or mel chunks, then end of stream; audio as it is ready."""

    def __init__(
        self,
        voices: list[VocoderVoice],
        backends: dict[str, Backend],
        *,
        policy: ChunkPolicy | None = None,
        limits: VocoderLimits | None = None,
        max_batch_frames: int | None = None,
        max_first_batch: int | None = None,
        streaming: str = "auto",
        workers: int = 1,
    ):
        if not voices:
            raise ValueError("at least one voice is required")
        self.voices = {v.name: v for v in voices}
        self.default_voice = voices[0].name
        self.backends = backends  # voice name -> backend (voices may share one)
        self.policy = policy or ChunkPolicy()
        self.limits = limits or VocoderLimits()
        if self.limits.max_audio_ahead_s <= 0:
            raise ValueError(f"max_audio_ahead_s must be > 0 (got {self.limits.max_audio_ahead_s})")
        if max_batch_frames is not None and max_batch_frames < 1:
            raise ValueError(f"max_batch_frames must be >= 1 (got {max_batch_frames})")
        if streaming not in STREAMING_MODES:
            raise ValueError(f"streaming must be one of {STREAMING_MODES} (got {streaming!r})")
        self.streaming = streaming
        if max_first_batch is not None and max_first_batch < 1:
            raise ValueError(f"max_first_batch must be >= 1 (got {max_first_batch})")
        self.max_batch_frames = max_batch_frames  # None: by the backend's device
        self.max_first_batch = max_first_batch  # None: by the backend's device
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (got {workers})")
        self.workers = workers  # forwards in flight at once per backend
        self.active_streams = 0
        self._batchers: dict[int, Batcher] = {}

    def start(self) -> None:
        """Start one batcher per distinct backend (call inside the running event loop)."""
        for backend in self.backends.values():
            if id(backend) not in self._batchers:
                budget = self.max_batch_frames or default_batch_frames(backend)
                firsts = self.max_first_batch or default_first_batch(backend)
                batcher = Batcher(
                    backend,
                    max_batch=32,
                    max_batch_frames=budget,
                    max_first_batch=firsts,
                    on_batch=metrics.observe_batch,
                    workers=self.workers,
                    # joined chunks no longer than the policy's chunks while streams share
                    max_join_frames=self.policy.cap(shared=True),
                )
                batcher.start()
                self._batchers[id(backend)] = batcher

    def stateful(self, backend: Backend) -> bool:
        """Whether streams on `backend` use the stateful generator."""
        return self.streaming == "stateful" or (
            self.streaming == "auto" and default_stateful(backend)
        )

    def warmup(self) -> None:
        """A throw-away forward on each backend, in the mode its streams will use; where the
        backend compiles each input shape, one of each shape its streams mostly use, spread
        over the workers (so that the first streams do not wait for the compiler)."""
        for backend in {id(b): b for b in self.backends.values()}.values():
            stateful = self.stateful(backend)
            backend.warmup(stateful=stateful)
            if not (stateful and backend.compiles_per_shape):
                continue
            shapes = self.policy.stateful_shapes(
                backend.receptive_field[1],
                self.max_batch_frames or default_batch_frames(backend),
            )
            with ThreadPoolExecutor(self.workers) as pool:
                list(
                    pool.map(
                        backend.warmup_shapes,
                        [shapes[i :: self.workers] for i in range(self.workers)],
                    )
                )

    async def close(self) -> None:
        for batcher in self._batchers.values():
            await batcher.close()

    async def GetInfo(self, request: pb.GetInfoRequest, context: _InfoContext) -> pb.VocoderInfo:
        """Voices, backend and streams in flight."""
        backend = self.backends[self.default_voice]
        return pb.VocoderInfo(
            voices=[
                pb.VocoderVoice(
                    name=v.name,
                    sample_rate_hz=v.config.sampling_rate,
                    hop_size=v.config.hop_size,
                    num_mels=v.config.num_mels,
                    codebook_size=v.codebook_size,
                    frames_per_token=v.frames_per_token,
                )
                for v in self.voices.values()
            ],
            backend=backend.name,
            device=backend.device,
            precision=backend.precision,
            active_streams=self.active_streams,
            max_streams=self.limits.max_streams,
            receptive_field_frames=max(backend.receptive_field),
            max_chunk_frames=self.limits.max_chunk_frames,
        )

    async def Vocode(
        self, request_iterator: AsyncIterator[pb.VocodeRequest], context: _VocodeContext
    ) -> AsyncIterator[pb.VocodeResponse]:
        """Stream audio for a stream of speech tokens or mel frames."""
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument(
                "stream ended before its config: the first message must be a VocodeConfig"
            ) from None
        voice, stream = self._open(first)
        tracing.annotate(**{"splittts.request_id": first.config.request_id})
        if self.active_streams >= self.limits.max_streams:
            metrics.STREAMS.labels("rejected").inc()
            raise ResourceExhausted(
                f"{self.active_streams} streams already open (max_streams="
                f"{self.limits.max_streams}); retry later"
            )
        self.active_streams += 1
        metrics.ACTIVE_STREAMS.inc()
        batcher = self._batchers[id(self.backends[voice.name])]
        outbox: asyncio.Queue = asyncio.Queue()  # bounded by `ahead`
        ahead = AheadBudget(self.limits.max_audio_ahead_s * voice.config.sampling_rate)
        reader = asyncio.create_task(self._read(requests, stream, batcher, outbox, ahead))
        started = time.perf_counter()
        outcome = "cancelled"
        summary = pb.VocodeSummary()
        try:
            while True:
                item = await outbox.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                job, future, trigger = item
                result = await future
                chunk = stream.complete(job, result.audio)
                now = time.perf_counter()
                if chunk.sequence_number == 0:
                    metrics.FIRST_AUDIO.observe(now - chunk.ready_at)
                metrics.CHUNK_COMPUTE.observe(result.compute_ms / 1e3)
                tracing.record_span(
                    "compute",
                    result.started,
                    result.finished,
                    **{
                        "splittts.frames": job.num_frames,
                        "splittts.batch_size": result.batch_size,
                        "splittts.compute_ms": result.compute_ms,
                        "splittts.queue_ms": result.queue_ms,
                    },
                )
                summary.num_samples += chunk.num_samples
                summary.num_frames += job.num_frames
                summary.compute_ms += result.compute_ms
                summary.num_chunks += 1
                yield pb.VocodeResponse(
                    audio=pb.AudioChunk(
                        pcm=chunk.pcm16(),
                        sample_rate_hz=voice.config.sampling_rate,
                        first_sample=chunk.first_sample,
                        num_samples=chunk.num_samples,
                        sequence_number=chunk.sequence_number,
                    ),
                    timings=pb.ChunkTimings(
                        compute_ms=result.compute_ms,
                        queue_ms=result.queue_ms,
                        service_ms=1e3 * (now - chunk.ready_at),
                        trigger_message=trigger,
                    ),
                )
                ahead.taken(job.num_samples)
                metrics.AUDIO_AHEAD.dec(job.num_samples / voice.config.sampling_rate)
            audio_s = summary.num_samples / voice.config.sampling_rate
            if audio_s > 0:
                metrics.RTF.observe((time.perf_counter() - started) / audio_s)
                metrics.AUDIO_SECONDS.inc(audio_s)
            outcome = "ok"
            tracing.annotate(
                **{
                    "splittts.chunks": summary.num_chunks,
                    "splittts.audio_s": audio_s,
                    "splittts.compute_ms": summary.compute_ms,
                }
            )
            yield pb.VocodeResponse(summary=summary)
        except InvalidArgument:
            outcome = "invalid"
            raise
        finally:
            reader.cancel()
            metrics.AUDIO_AHEAD.dec(ahead.ahead / voice.config.sampling_rate)
            while not outbox.empty():  # drop queued work of a stream nobody will read
                item = outbox.get_nowait()
                if isinstance(item, tuple):
                    item[1].cancel()
            self.active_streams -= 1
            metrics.ACTIVE_STREAMS.dec()
            metrics.STREAMS.labels(outcome).inc()
            log_event(
                log,
                "stream closed",
                stream=stream.stream_id,
                outcome=outcome,
                samples=summary.num_samples,
                chunks=summary.num_chunks,
                audio_ahead_peak_s=round(ahead.peak / voice.config.sampling_rate, 3),
                trace_id=tracing.trace_id(context),
            )

    def _open(self, first: pb.VocodeRequest) -> tuple[VocoderVoice, VocoderStream]:
        if first.WhichOneof("payload") != "config":
            raise InvalidArgument(
                "the first message must be a VocodeConfig (got "
                f"{first.WhichOneof('payload') or 'an empty message'})"
            )
        cfg = first.config
        name = cfg.voice or self.default_voice
        voice = self.voices.get(name)
        if voice is None:
            raise NotFound(f"config.voice: unknown voice {name!r}; known: {sorted(self.voices)}")
        if cfg.input_kind == pb.INPUT_KIND_UNSPECIFIED:
            raise InvalidArgument(
                "config.input_kind must be INPUT_KIND_SPEECH_TOKENS or INPUT_KIND_MEL"
            )
        tokens = cfg.input_kind == pb.INPUT_KIND_SPEECH_TOKENS
        if tokens and voice.token_decoder is None:
            raise InvalidArgument(
                f"config.input_kind: voice {name!r} has no speech-token "
                "decoder; send INPUT_KIND_MEL"
            )
        stream = VocoderStream(
            voice.config,
            policy=self.policy,
            token_decoder=voice.token_decoder if tokens else None,
            stream_id=cfg.request_id or None,
            stateful=self.stateful(self.backends[name]),
        )
        return voice, stream

    async def _read(
        self,
        requests,
        stream: VocoderStream,
        batcher: Batcher,
        outbox: asyncio.Queue,
        ahead: AheadBudget,
    ) -> None:
        """Feed input into the stream and submit ready jobs, in order, to the batcher, while
        the audio ahead of the reader is under its bound."""

        async def submit(index: int) -> None:
            # chunks sized against the stream's playout clock and the generator's measured speed
            for job in stream.ready(
                shared=self.active_streams > 1,
                now=time.perf_counter(),
                seconds_per_frame=batcher.seconds_per_frame,
            ):
                await ahead.room()
                ahead.add(job.num_samples)
                metrics.AUDIO_AHEAD.inc(job.num_samples / stream.config.sampling_rate)
                outbox.put_nowait((job, batcher.submit(job), index))

        try:
            received, index = 0, 0
            async for req in requests:
                index += 1
                kind = req.WhichOneof("payload")
                if kind == "config":
                    raise InvalidArgument("config: sent twice; it must be the first message only")
                if kind == "end_of_stream":
                    if not req.end_of_stream:
                        raise InvalidArgument("end_of_stream must be true when set")
                    break
                if kind == "flush":
                    if not req.flush:
                        raise InvalidArgument("flush must be true when set")
                    if received:
                        stream.mark_boundary()
                else:
                    received += self._push(stream, req, kind)
                if received > self.limits.max_stream_frames:
                    raise InvalidArgument(
                        f"stream exceeds {self.limits.max_stream_frames} "
                        "frames (about ten minutes of audio)"
                    )
                await submit(index)
            if received == 0:
                raise InvalidArgument("empty stream: no tokens or mel frames before the end")
            stream.flush()  # half-close without end_of_stream also ends the stream
            await submit(index)
            outbox.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except InvalidArgument as exc:
            outbox.put_nowait(exc)
        except Exception as exc:  # noqa: BLE001 - surfaced by the writer as INTERNAL
            outbox.put_nowait(exc)

    def _push(self, stream: VocoderStream, req: pb.VocodeRequest, kind: str | None) -> int:
        limit = self.limits.max_chunk_frames
        if kind == "tokens":
            ids = np.asarray(req.tokens.ids, dtype=np.int64)
            if stream.token_decoder is None:
                raise InvalidArgument("tokens: this stream was configured for INPUT_KIND_MEL")
            if ids.size > limit:
                raise InvalidArgument(
                    f"tokens.ids: {ids.size} ids in one message exceed the limit of {limit}"
                )
            size = stream.token_decoder.config.codebook_size
            bad = ids[ids >= size]
            if bad.size:
                raise InvalidArgument(
                    f"tokens.ids: id {int(bad[0])} is outside the codebook [0, {size})"
                )
            stream.push_tokens(ids)
            return int(ids.size) * stream.token_decoder.config.frames_per_token
        if kind == "mel":
            if stream.token_decoder is not None:
                raise InvalidArgument(
                    "mel: this stream was configured for INPUT_KIND_SPEECH_TOKENS"
                )
            n_mels = stream.config.num_mels
            if req.mel.num_mels != n_mels:
                raise InvalidArgument(f"mel.num_mels must be {n_mels} (got {req.mel.num_mels})")
            values = np.asarray(req.mel.values, dtype=np.float32)
            if values.size % n_mels:
                raise InvalidArgument(
                    f"mel.values: {values.size} values is not a whole number "
                    f"of {n_mels}-wide frames"
                )
            frames = values.size // n_mels
            if frames > limit:
                raise InvalidArgument(
                    f"mel.values: {frames} frames in one message exceed the limit of {limit}"
                )
            if not np.isfinite(values).all():
                raise InvalidArgument("mel.values: must be finite (found NaN or infinity)")
            stream.push_mel(values.reshape(frames, n_mels).T)
            return frames
        raise InvalidArgument(
            "each message after the config must carry tokens, mel or end_of_stream"
        )
