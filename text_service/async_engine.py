"""Runs the LLMEngine on its own thread; each request reads its tokens from an asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from text_service.engine import LLMEngine
from text_service.errors import CapacityError, EngineDeadError
from text_service.sampling_params import SamplingParams
from text_service.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """Tokens sampled for one request in one engine step (stamped on the engine thread)."""

    token_ids: list[int]
    finished: bool
    seq: Sequence
    time: float


@dataclass
class RequestStream:
    """What a caller holds for one request: its id, arrival time and output queue.

    The queue holds at most `max_backlog` tokens plus one step: past that the engine pauses
    the request until the caller takes them (`on_taken` tells it how many were taken).
    """

    request_id: str
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    on_taken: Callable[[int], None] | None = None

    async def next_events(self) -> list[TokenEvent]:
        """Wait for at least one event, then take every event already queued."""
        item = await self.queue.get()
        items = [item]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise item
        taken = sum(len(item.token_ids) for item in items)
        if taken and self.on_taken is not None:
            self.on_taken(taken)
        return items


@dataclass(frozen=True)
class Pace:
    """A request that needs its tokens no faster than they are used (a speech stream's play as
    audio): by t seconds after its first token it has at most `lead_tokens` +
    `tokens_per_second` * t output tokens; past that it waits."""

    tokens_per_second: float
    lead_tokens: int

    def ahead(self, seq: Sequence, now: float) -> bool:
        """Whether `seq` has used up its allowance at `now`."""
        if seq.first_token_time is None:
            return False
        allowed = self.lead_tokens + self.tokens_per_second * (now - seq.first_token_time)
        return seq.num_output_tokens >= allowed


# Requests held by their pace resume together, at most this often, so that they share steps: a
# step of 8 sequences of the default voice's LM costs 1.3x a step of one, so each stream running
# whenever its own allowance grows makes steps of one or two and spends the CPU the vocoder needs.
PACE_TICK_S = 0.1


class AsyncEngine:
    """Owns the engine thread. `add` and `abort` may be called from the event loop at any time.

    The event loop owns `_streams`; the engine thread keeps its own map of the requests it runs
    and hands every result back through `call_soon_threadsafe`, so neither reads what the other
    mutates. A request with `max_backlog` tokens delivered but not yet taken is paused (kept in
    the cache, not decoded) until its caller catches up: a slow reader slows its own request
    only, and its queue stays bounded. A request with a `Pace` is also paused while it is ahead
    of it and others run, until the next of the ticks at which every such request whose
    allowance has grown resumes (`PACE_TICK_S`). If the loop dies, every request fails at once,
    `error` is set, `add` refuses work and `on_failure` is called on the event loop.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_pending: int = 256,
        on_failure: Callable[[BaseException], None] | None = None,
        max_backlog: int = 64,
    ):
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be >= 1 (got {max_backlog})")
        self.engine = engine
        self.max_pending = max_pending
        self.max_backlog = max_backlog
        self.on_failure = on_failure
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._running: dict[str, RequestStream] = {}  # engine thread only
        self._backlog: dict[str, int] = {}  # engine thread only: tokens delivered, not taken
        self._paces: dict[str, Pace] = {}  # engine thread only: the paced running requests
        self._held: dict[str, Sequence] = {}  # engine thread only: paused by their pace
        self._next_tick = 0.0  # engine thread only: when held requests may resume
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.stats: dict = engine.stats()  # replaced whole by the engine thread
        self.error: BaseException | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    def ready(self) -> bool:
        """True while the engine loop runs."""
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        pace: Pace | None = None,
    ) -> RequestStream:
        """Admit a request (already validated); raises CapacityError past `max_pending`."""
        if self.error is not None:
            raise EngineDeadError
        if len(self._streams) >= self.max_pending:
            raise CapacityError(
                f"{len(self._streams)} requests in flight (max_pending="
                f"{self.max_pending}); retry later"
            )
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream = RequestStream(
            request_id, time.perf_counter(), on_taken=lambda n: self._taken(request_id, n)
        )
        self._streams[request_id] = stream
        self._commands.put(("add", stream, prompt_token_ids, params, pace))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op once finished); its blocks and state slot are freed."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._commands.put(("abort", request_id))
            self._wake.set()

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._streams.pop(request_id, None)

    def _taken(self, request_id: str, n: int) -> None:
        self._commands.put(("taken", request_id, n))
        self._wake.set()

    # -- event loop, called from the engine thread ----------------------------------------------
    @staticmethod
    def _push(stream: RequestStream, item) -> None:
        if isinstance(item, TokenEvent) and item.finished:
            stream.finished = True
        stream.queue.put_nowait(item)

    @classmethod
    def _push_all(cls, items: list[tuple[RequestStream, TokenEvent]]) -> None:
        for stream, item in items:
            cls._push(stream, item)

    def _fail_all(self, exc: BaseException) -> None:
        self.error = exc
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError())
        if self.on_failure is not None:
            self.on_failure(exc)

    # -- engine thread ----------------------------------------------------------------------
    def _deliver(self, stream: RequestStream, item) -> None:
        assert self._loop is not None, "start() first"
        self._loop.call_soon_threadsafe(self._push, stream, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, stream, prompt, params, pace = cmd
                try:
                    self.engine.add_request(
                        stream.request_id, prompt, params, arrival_time=stream.arrival_time
                    )
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    self._deliver(stream, exc)
                else:
                    self._running[stream.request_id] = stream
                    self._backlog[stream.request_id] = 0
                    if pace is not None:
                        self._paces[stream.request_id] = pace
            elif cmd[0] == "taken":
                _, rid, n = cmd
                if rid in self._backlog:
                    self._backlog[rid] -= n
                    if self._backlog[rid] < self.max_backlog and rid not in self._held:
                        self.engine.resume_request(rid)
            elif self._running.pop(cmd[1], None) is not None:
                self._forget(cmd[1])
                self.engine.abort_request(cmd[1])

    def _forget(self, rid: str) -> None:
        self._backlog.pop(rid, None)
        self._paces.pop(rid, None)
        self._held.pop(rid, None)

    def _resume_paced(self, now: float) -> None:
        """At a tick, resume every held request whose allowance has grown (its reader allowing);
        at once, every held request when it is alone: pacing is how requests share steps and
        CPU, and a lone request's caller (a whole file, say) should not wait for its pace."""
        if not self._held:
            return
        alone = len(self._running) <= 1
        if now < self._next_tick and not alone:
            return
        self._next_tick = now + PACE_TICK_S
        for rid, seq in list(self._held.items()):
            if alone or not self._paces[rid].ahead(seq, now):
                del self._held[rid]
                if self._backlog[rid] < self.max_backlog:
                    self.engine.resume_request(rid)

    def _hold_paced(self, outputs, now: float) -> None:
        if len(self._running) <= 1:
            return  # alone: nothing to share with
        for out in outputs:
            if out.finished:
                continue
            rid = str(out.seq.seq_id)
            pace = self._paces.get(rid)
            if pace is not None and rid not in self._held and pace.ahead(out.seq, now):
                if self.engine.pause_request(rid):
                    self._held[rid] = out.seq

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                self._resume_paced(time.perf_counter())
                if not self.engine.has_runnable_requests():  # idle, or every request paused
                    self.stats = self.engine.stats()
                    wait = 0.5
                    if self._held:  # until the next tick
                        wait = min(wait, max(0.0, self._next_tick - time.perf_counter()))
                    self._wake.wait(wait)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                now = time.perf_counter()
                self._hold_paced(outputs, now)
                events: list[tuple[RequestStream, TokenEvent]] = []
                for out in outputs:
                    if out.new_token_ids or out.finished:
                        rid = str(out.seq.seq_id)
                        stream = self._running.pop(rid) if out.finished else self._running.get(rid)
                        if stream is None:
                            continue
                        events.append(
                            (
                                stream,
                                TokenEvent(list(out.new_token_ids), out.finished, out.seq, now),
                            )
                        )
                        if out.finished:
                            self._forget(rid)
                            continue
                        self._backlog[rid] += len(out.new_token_ids)
                        if self._backlog[rid] >= self.max_backlog:
                            self.engine.pause_request(rid)
                if events:  # one wake-up of the event loop per step, not one per request
                    assert self._loop is not None, "start() first"
                    self._loop.call_soon_threadsafe(self._push_all, events)
                self.stats = self.engine.stats()
        except BaseException as exc:  # fail every waiter instead of hanging them
            log.exception("engine loop crashed; failing every request")
            self._running.clear()
            self._backlog.clear()
            self._paces.clear()
            self._held.clear()
            try:
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._fail_all, exc)
            except RuntimeError:  # the event loop is already closed
                pass
