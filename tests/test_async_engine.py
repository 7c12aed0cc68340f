"""AsyncEngine's hand-off between the event loop and the engine thread, with a stand-in engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from text_service.async_engine import AsyncEngine
from text_service.engine import StepOutput
from text_service.errors import EngineDeadError
from text_service.sampling_params import SamplingParams
from text_service.sequence import Sequence


class FakeEngine:
    """Emits one token per unpaused request per step; `step` raises once `fail` is set."""

    def __init__(self):
        self.seqs: dict[str, Sequence] = {}
        self.paused: set[str] = set()
        self.fail = threading.Event()
        self.aborted: list[str] = []
        self.steps = 0

    def stats(self) -> dict:
        return {"num_running": len(self.seqs)}

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.seqs[rid] = Sequence(rid, list(prompt), params, arrival_time or 0.0)

    def abort_request(self, rid):
        self.aborted.append(rid)
        return self.seqs.pop(rid, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def pause_request(self, rid) -> bool:
        self.paused.add(rid)
        return rid in self.seqs

    def resume_request(self, rid) -> None:
        self.paused.discard(rid)

    def has_runnable_requests(self) -> bool:
        return bool(self.seqs.keys() - self.paused)

    def step(self) -> list[StepOutput]:
        self.steps += 1
        if self.fail.is_set():
            raise RuntimeError("device lost at 0xdeadbeef")
        threading.Event().wait(0.005)
        outs = []
        for rid, seq in list(self.seqs.items()):
            if rid in self.paused:
                continue
            seq.token_ids.append(7)
            done = seq.num_output_tokens >= seq.sampling_params.max_tokens
            if done:
                del self.seqs[rid]
            outs.append(StepOutput(seq, [7], done))
        return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_tokens_stream_and_finish_without_sharing_the_stream_map():
    async def main():
        engine = FakeEngine()
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.add("a", [1, 2], SamplingParams(max_tokens=5))
        tokens, finished = [], False
        while not finished:
            for ev in await stream.next_events():
                tokens += ev.token_ids
                finished = ev.finished
        assert tokens == [7] * 5 and stream.finished
        ae.release("a")
        assert ae.num_pending == 0
        ae.stop()

    run(main())


def test_one_event_loop_wake_up_per_step_whatever_the_batch():
    """A step's tokens for every request reach the event loop in one hand-off."""

    async def main():
        loop = asyncio.get_running_loop()
        wake_ups = 0
        handoff = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            nonlocal wake_ups
            wake_ups += 1
            return handoff(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        engine = FakeEngine()
        ae = AsyncEngine(engine)
        ae.start()
        streams = [ae.add(rid, [1], SamplingParams(max_tokens=20)) for rid in "abcd"]
        for stream in streams:
            tokens: list[int] = []
            finished = False
            while not finished:
                for ev in await stream.next_events():
                    tokens += ev.token_ids
                    finished = ev.finished
            assert tokens == [7] * 20
        ae.stop()
        assert engine.steps >= 20 and wake_ups <= engine.steps  # not 4 a step

    run(main())


def test_abort_before_the_engine_saw_the_request_frees_it():
    async def main():
        engine = FakeEngine()
        ae = AsyncEngine(engine)
        ae.start()
        ae.add("a", [1], SamplingParams(max_tokens=10_000))
        ae.abort("a")  # the add and the abort reach the engine thread in that order
        for _ in range(200):
            if not engine.seqs and "a" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert not engine.seqs and engine.aborted == ["a"]
        ae.stop()

    run(main())


def test_a_dead_engine_loop_fails_every_request_and_refuses_new_ones():
    async def main():
        engine = FakeEngine()
        failures = []
        ae = AsyncEngine(engine, on_failure=failures.append)
        ae.start()
        running = ae.add("running", [1], SamplingParams(max_tokens=10_000))
        await running.next_events()  # it is in the engine and producing
        assert ae.ready()
        engine.fail.set()
        queued = ae.add("queued", [1], SamplingParams(max_tokens=10_000))
        for stream in (running, queued):
            with pytest.raises(EngineDeadError) as err:
                while True:
                    await stream.next_events()
            assert err.value.status_code == "UNAVAILABLE"
            assert "RuntimeError" not in str(err.value) and "0xdeadbeef" not in str(err.value)
        assert len(failures) == 1 and isinstance(failures[0], RuntimeError)
        assert not ae.ready() and ae.error is failures[0]
        with pytest.raises(EngineDeadError):
            ae.add("late", [1], SamplingParams())
        ae.stop()

    run(main())


def test_a_reader_that_falls_behind_pauses_only_its_own_request_until_it_catches_up():
    async def main():
        engine = FakeEngine()
        ae = AsyncEngine(engine, max_backlog=4)
        ae.start()
        slow = ae.add("slow", [1], SamplingParams(max_tokens=50))
        fast = ae.add("fast", [1], SamplingParams(max_tokens=50))
        fast_tokens = []
        while len(fast_tokens) < 50:  # the other request runs to the end meanwhile
            for ev in await fast.next_events():
                fast_tokens += ev.token_ids
        assert engine.paused == {"slow"} and engine.seqs["slow"].num_output_tokens == 4
        assert slow.queue.qsize() == 4
        tokens, finished = [], False
        while not finished:  # catching up resumes it, a backlog at a time
            for ev in await slow.next_events():
                tokens += ev.token_ids
                finished = ev.finished
            assert slow.queue.qsize() <= 4
        assert tokens == [7] * 50 and "slow" not in engine.seqs
        ae.stop()

    run(main())


def test_max_backlog_must_be_positive():
    with pytest.raises(ValueError, match="max_backlog"):
        AsyncEngine(FakeEngine(), max_backlog=0)


def test_a_paced_request_waits_while_ahead_and_makes_the_same_tokens():
    """Through the real engine (the default voice's LM): beside other requests, one with a Pace
    has at most lead + rate * t output tokens t seconds after its first (one step's token over,
    as the check follows the step), resumes at the ticks and ends with the tokens it makes
    unpaced; the unpaced request beside it is never held; aborting a held request frees it; a
    paced request alone is never held."""
    import time
    from pathlib import Path

    from text_service.async_engine import Pace
    from text_service.engine import EngineArgs, LLMEngine

    lm = Path(__file__).resolve().parents[1] / "voices" / "default" / "lm"
    engine = LLMEngine(
        EngineArgs(model=str(lm), device="cpu", max_num_seqs=4, kv_cache_memory_bytes=1 << 26)
    )
    held: list[str] = []
    pause = engine.pause_request
    engine.pause_request = lambda rid: held.append(rid) or pause(rid)  # type: ignore[method-assign]
    prompt = [1, 40, 41, 42, 43, 44, 2]
    # Slow enough that the paced requests get ahead of it even on a slow, shared machine: at 100
    # tokens/s a stall of a few tenths of a second while the three ran gave the companion enough
    # allowance never to be held, and once alone it never could be (the wait below then hung).
    pace = Pace(tokens_per_second=20.0, lead_tokens=10)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    async def read(stream):
        tokens, times, finished = [], [], False
        while not finished:
            for ev in await stream.next_events():
                tokens += ev.token_ids
                times += [(time.perf_counter(), len(tokens))]
                finished = ev.finished
        return tokens, times

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            companion = ae.add("companion", prompt, params(1000), pace)  # runs throughout
            paced = ae.add("paced", prompt, params(60), pace)
            free = ae.add("free", prompt, params(60))
            (paced_tokens, times), (free_tokens, _) = await asyncio.gather(read(paced), read(free))
            while "companion" not in held:
                await companion.next_events()
            ae.abort("companion")  # held by its pace: its blocks and slot are freed
            for rid in ("paced", "free"):
                ae.release(rid)
            await asyncio.sleep(0.3)
            after_abort = (dict(ae._held), engine.has_unfinished_requests(), set(held))
            held.clear()
            solo_tokens, _ = await read(ae.add("solo", prompt, params(60), pace))
            return paced_tokens, times, free_tokens, after_abort, solo_tokens
        finally:
            ae.stop()

    paced_tokens, times, free_tokens, after_abort, solo_tokens = run(main())
    assert paced_tokens == free_tokens == solo_tokens and len(paced_tokens) == 60
    first = times[0][0]
    assert all(n <= pace.lead_tokens + pace.tokens_per_second * (t - first) + 1 for t, n in times)
    assert times[-1][0] - first >= (60 - 1 - pace.lead_tokens) / pace.tokens_per_second
    assert after_abort == ({}, False, {"companion", "paced"})  # the unpaced one never held
    assert held == []  # alone, the paced request ran flat out
