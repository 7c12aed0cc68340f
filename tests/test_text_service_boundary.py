"""The text service's production boundary, as real processes: a dead engine fails fast and loud,
overload and oversize are plain statuses, metrics count what happened."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splittts.text.v1 import text_pb2 as pb, text_pb2_grpc
from tests.hf_models import make_tiny_model
from tests.procs import ServiceProcess, metric_value
from tests.voices import write_char_tokenizer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=240, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("lm"), "qwen3_5", max_position_embeddings=256)
    write_char_tokenizer(folder, extra_tokens=64)
    return folder


def start(model_dir, *args: str, fault_file=None, step_delay_s: float = 0.0) -> ServiceProcess:
    """The text service whose steps take `step_delay_s` and fail once `fault_file` exists."""
    env = {
        "SPLITTTS_TEST_FAULT_FILE": str(fault_file or "/nonexistent/fault"),
        "SPLITTTS_TEST_STEP_DELAY_S": str(step_delay_s),
    }
    return ServiceProcess(
        "tests.faulty_text_service",
        "--model",
        str(model_dir),
        "--kv-cache-memory",
        "32MiB",
        "--threads",
        "1",
        *args,
        env=env,
    )


def stub(channel) -> text_pb2_grpc.TextGenerationStub:
    return text_pb2_grpc.TextGenerationStub(channel)


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def model_info(channel) -> pb.ModelInfo:
    return stub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


def test_engine_loop_death_fails_every_request_turns_not_serving_and_exits(model_dir, tmp_path):
    fault = tmp_path / "fault"
    proc = start(
        model_dir, "--max-num-seqs", "2", "--grace", "5", fault_file=fault, step_delay_s=0.02
    )
    try:
        with proc.channel() as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(), timeout=60
            )
            assert next(watch).status == SERVING
            running = [stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=60) for _ in range(2)]
            for call in running:
                assert next(call).token_ids  # both are in the batch
            queued = stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=60)
            wait_for(lambda: model_info(ch).num_waiting == 1, what="a queued request")
            fault.touch()
            for call in [*running, queued]:
                with pytest.raises(grpc.RpcError) as err:
                    list(call)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                details = err.value.details()
                assert "retry on another" in details
                assert "RuntimeError" not in details and "0x7f00deadbeef" not in details
            assert next(watch).status == NOT_SERVING
            watch.cancel()
        assert proc.proc.wait(timeout=30) == 1
        stderr = "".join(proc.stderr_lines)
        assert "text-service: the engine loop stopped after an internal error" in stderr
        assert "injected device fault" in stderr  # the details are in the log, not the status
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def service(model_dir):
    proc = start(model_dir, "--max-pending", "8")
    yield proc
    assert proc.stop() == 0


@pytest.mark.parametrize(
    "sampling, rule",
    [
        (
            pb.SamplingConfig(repetition_penalty=1e-45, temperature=1),
            "sampling.repetition_penalty: must lie in [0.01, 100]",
        ),
        (
            pb.SamplingConfig(repetition_penalty=1e6),
            "sampling.repetition_penalty: must lie in [0.01, 100]",
        ),
        (pb.SamplingConfig(temperature=1e-40), "sampling.temperature: must be 0 (greedy) or"),
    ],
)
def test_penalties_and_temperatures_that_overflow_logits_are_invalid(service, sampling, rule):
    with service.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub(ch).Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=4, sampling=sampling
                    ),
                    timeout=30,
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rule in err.value.details()
        ok = list(
            stub(ch).Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[1, 2]),
                    max_tokens=3,
                    ignore_eos=True,
                    sampling=pb.SamplingConfig(repetition_penalty=100, temperature=1),
                ),
                timeout=30,
            )
        )
        assert sum(len(r.token_ids) for r in ok) == 3
    assert service.health() == SERVING


def test_a_10_mb_prompt_is_refused_before_tokenising_while_health_answers(service):
    statuses, errors = [], []
    big = "a" * (10 * 1024 * 1024)

    def generate():
        with service.channel() as ch:
            try:
                list(stub(ch).Generate(pb.GenerateRequest(text=big, max_tokens=4), timeout=60))
            except grpc.RpcError as exc:
                errors.append(exc)

    t = threading.Thread(target=generate)
    t.start()
    while t.is_alive():
        statuses.append(service.health())
    t.join()
    assert statuses and all(s == SERVING for s in statuses)
    (err,) = errors
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(
        f"text: {len(big)} bytes cannot fit the model's limit max_model_len=256 tokens"
    ), err.details()
    with service.channel() as ch:  # a normal text prompt still goes through the tokenizer
        ok = list(
            stub(ch).Generate(
                pb.GenerateRequest(text="hello", max_tokens=2, ignore_eos=True), timeout=30
            )
        )
        assert sum(len(r.token_ids) for r in ok) == 2


def test_a_full_waiting_queue_is_resource_exhausted_with_a_retry_hint(model_dir):
    proc = start(
        model_dir,
        "--max-num-seqs",
        "1",
        "--max-num-waiting",
        "1",
        "--max-pending",
        "8",
        step_delay_s=0.02,
    )
    try:
        with proc.channel() as ch:
            running = stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=60)
            next(running)
            waiting = stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=60)
            wait_for(lambda: model_info(ch).num_waiting == 1, what="a waiting request")
            with pytest.raises(grpc.RpcError) as err:
                list(stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert (
                err.value.details()
                == "the waiting queue is full (1 of max_num_waiting=1); retry later"
            )
            assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
            running.cancel()
            waiting.cancel()
        metrics = proc.metrics()
        assert (
            metric_value(
                metrics, "splittts_text_request_success_total", 'finished_reason="rejected"'
            )
            == 1
        )
    finally:
        assert proc.stop() == 0


def test_metrics_count_outcomes_and_gauges_are_live(model_dir):
    proc = start(model_dir, step_delay_s=0.02)
    try:
        with proc.channel() as ch:
            done = list(
                stub(ch).Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=3, ignore_eos=True
                    ),
                    timeout=30,
                )
            )
            assert done[-1].finish_reason == pb.FINISH_REASON_LENGTH
            cancelled = stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=60)
            next(cancelled)
            running = wait_for(
                lambda: metric_value(proc.metrics(), "splittts_text_num_requests_running") == 1,
                what="a live running gauge of 1",
            )
            assert running
            cancelled.cancel()
            with pytest.raises(grpc.RpcError) as err:
                list(stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=1))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        def counted():
            text = proc.metrics()
            return (
                text
                if all(
                    metric_value(
                        text, "splittts_text_request_success_total", f'finished_reason="{r}"'
                    )
                    == 1
                    for r in ("length", "cancelled", "deadline")
                )
                else None
            )

        text = wait_for(counted, what="length, cancelled and deadline counted once each")
        assert (
            metric_value(text, "splittts_text_request_success_total", 'finished_reason="abort"')
            is None
        )
        idle = wait_for(
            lambda: (
                metric_value(proc.metrics(), "splittts_text_num_requests_running") == 0
                and metric_value(proc.metrics(), "splittts_text_num_requests_waiting") == 0
            ),
            what="idle gauges",
        )
        assert idle
    finally:
        assert proc.stop() == 0


def test_an_engine_failure_counts_as_failed_in_process(model_dir, monkeypatch):
    import asyncio

    from prometheus_client import REGISTRY

    from servicekit.server import ErrorInterceptor
    from text_service.async_engine import AsyncEngine
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.server import TextGenerationServicer

    def count(reason: str) -> float:
        return (
            REGISTRY.get_sample_value(
                "splittts_text_request_success_total", {"finished_reason": reason}
            )
            or 0.0
        )

    engine = LLMEngine(EngineArgs(model=str(model_dir), kv_cache_memory_bytes=8 << 20))

    def broken(batch):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine.runner, "execute", broken)

    async def main():
        failures = []
        async_engine = AsyncEngine(engine, on_failure=failures.append)
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        text_pb2_grpc.add_TextGenerationServicer_to_server(
            TextGenerationServicer(async_engine, "tiny"), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async_engine.start()
        before = count("failed"), count("abort")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub(ch).Generate(pb.GenerateRequest(**LONG), timeout=30):
                        pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(failures) == 1
        finally:
            await server.stop(None)
            async_engine.stop()
        assert (count("failed"), count("abort")) == (before[0] + 1, before[1])

    asyncio.run(asyncio.wait_for(main(), timeout=60))


@pytest.mark.parametrize(("remaining", "reason"), [(0.05, "deadline"), (30.0, "cancelled")])
def test_a_stream_closed_at_a_yield_is_counted_and_freed(model_dir, remaining, reason):
    """grpc cancelled while writing a message closes the handler later: GeneratorExit at `yield`."""
    import asyncio

    from prometheus_client import REGISTRY

    from text_service.async_engine import AsyncEngine
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.server import TextGenerationServicer

    def count(r: str) -> float:
        sample = REGISTRY.get_sample_value(
            "splittts_text_request_success_total", {"finished_reason": r}
        )
        return sample or 0.0

    class Context:  # what the handler reads of grpc's context at the end of a stream
        def time_remaining(self) -> float:
            return remaining

        def invocation_metadata(self):
            return ()

    engine = LLMEngine(EngineArgs(model=str(model_dir), kv_cache_memory_bytes=8 << 20))
    blocks = engine.scheduler.block_manager
    free = blocks.num_free_blocks

    async def main():
        async_engine = AsyncEngine(engine, on_failure=lambda exc: None)
        async_engine.start()
        try:
            before = {r: count(r) for r in ("deadline", "cancelled")}
            stream = TextGenerationServicer(async_engine, "tiny").Generate(
                pb.GenerateRequest(**LONG), Context()
            )
            first = await anext(stream)
            assert first.token_ids
            await stream.aclose()
            after = {r: count(r) for r in ("deadline", "cancelled")}
            assert after == {r: before[r] + (r == reason) for r in before}
            for _ in range(200):  # the abort is carried out by the engine thread
                if blocks.num_free_blocks == free:
                    break
                await asyncio.sleep(0.01)
            assert blocks.num_free_blocks == free
        finally:
            async_engine.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
