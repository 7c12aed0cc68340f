"""The text service as a real process on 127.0.0.1: streaming, cancellation, limits, bad input."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from splittts.text.v1 import text_pb2 as pb, text_pb2_grpc
from tests.hf_models import make_tiny_model
from tests.procs import ServiceProcess, metric_value
from text_service.server import StreamChunks

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lm"), "qwen3_5", max_position_embeddings=256)


@pytest.fixture(scope="module")
def service(model_dir):
    proc = ServiceProcess(
        "text_service",
        "--model",
        str(model_dir),
        "--kv-cache-memory",
        "32MiB",
        "--threads",
        "1",
        "--max-pending",
        "8",
    )
    yield proc
    assert proc.stop() == 0


def stub(channel) -> text_pb2_grpc.TextGenerationStub:
    return text_pb2_grpc.TextGenerationStub(channel)


def generate(service, **kwargs) -> tuple[list[int], pb.GenerateResponse, list[pb.GenerateResponse]]:
    with service.channel() as ch:
        responses = list(stub(ch).Generate(pb.GenerateRequest(**kwargs), timeout=60))
    tokens = [t for r in responses for t in r.token_ids]
    return tokens, responses[-1], responses


def info(service) -> pb.ModelInfo:
    with service.channel() as ch:
        return stub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)


def test_health_and_model_info(service):
    assert (
        service.health("splittts.text.v1.TextGeneration") == health_pb2.HealthCheckResponse.SERVING
    )
    mi = info(service)
    assert mi.model_type == "qwen3_5_text" and mi.vocab_size == VOCAB
    assert mi.max_model_len == 256 and mi.device == "cpu" and mi.num_kv_blocks > 0


def test_greedy_stream_equals_offline_engine(service, model_dir):
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams

    prompt = [5, 17, 42, 99, 3, 8, 120]
    tokens, last, responses = generate(
        service, token_ids=pb.TokenIds(ids=prompt), max_tokens=24, ignore_eos=True
    )
    engine = LLMEngine(EngineArgs(model=str(model_dir), kv_cache_memory_bytes=8 << 20))
    offline = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )
    assert tokens == offline[0]
    assert len(responses) > 2  # streamed as sampled, not in one message
    indices = [r.first_token_index for r in responses[:-1]]
    assert indices == sorted(indices) and indices[0] == 0
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 24
    t = last.timings
    assert 0 < t.ttft_ms <= t.total_ms and t.decode_ms > 0 and t.mean_itl_ms > 0


def test_stream_chunks_ramp_up_after_an_immediate_first_token(service):
    prompt = pb.TokenIds(ids=[5, 17, 42, 99])
    plain, _, _ = generate(service, token_ids=prompt, max_tokens=40, ignore_eos=True)
    tokens, last, responses = generate(
        service, token_ids=prompt, max_tokens=40, ignore_eos=True, stream_chunk_tokens=20
    )
    sizes = [len(r.token_ids) for r in responses[:-1]]
    assert tokens == plain and sum(sizes) == 40
    # the first message leaves with whatever the first step(s) made, not after 20 tokens; then
    # messages wait for at least 2, 4, 4, 4, 4, then 20 tokens (the last takes what is left)
    ramp = [*StreamChunks.RAMP[1:], *[20] * len(sizes)]
    assert sizes[0] < 20 and len(sizes) >= 2
    assert all(n >= ramp[i] for i, n in enumerate(sizes[1:-1]))
    assert [r.first_token_index for r in responses[:-1]] == [
        sum(sizes[:i]) for i in range(len(sizes))
    ]


def test_stream_chunk_sizes_ramp_from_one_token_to_the_most():
    chunks, sizes, pending = StreamChunks(8), [], 0
    for _ in range(40):  # one token per engine step
        pending += 1
        if chunks.ready(pending, done=False):
            sizes.append(pending)
            pending = 0
            chunks.sent()
    assert sizes == [1, 2, 4, 4, 4, 4, 8, 8] and pending == 5
    assert chunks.ready(1, done=True) and not chunks.ready(0, done=True)
    assert [StreamChunks(n).most for n in (0, 1, -3)] == [1, 1, 1]
    three = StreamChunks(3)
    targets = []
    for _ in range(8):
        targets.append(three.target)
        three.sent()
    assert targets == [1, 2, 3, 3, 3, 3, 3, 3]  # never above `most`


def test_stop_ids_allowed_range_and_seed(service):
    tokens, last, _ = generate(
        service,
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        max_tokens=40,
        ignore_eos=True,
        allowed_tokens=pb.TokenRange(start=100, end=140),
        sampling=pb.SamplingConfig(temperature=1.0, seed=7),
    )
    assert all(100 <= t <= 140 for t in tokens)
    again, _, _ = generate(
        service,
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        max_tokens=40,
        ignore_eos=True,
        allowed_tokens=pb.TokenRange(start=100, end=140),
        sampling=pb.SamplingConfig(temperature=1.0, seed=7),
    )
    assert again == tokens
    stop = tokens[5]
    stopped, last, _ = generate(
        service,
        token_ids=pb.TokenIds(ids=[1, 2, 3]),
        max_tokens=40,
        ignore_eos=True,
        allowed_tokens=pb.TokenRange(start=100, end=140),
        sampling=pb.SamplingConfig(temperature=1.0, seed=7),
        stop_token_ids=[stop],
    )
    assert stopped == tokens[: tokens.index(stop) + 1]
    assert last.finish_reason == pb.FINISH_REASON_STOP


BAD = {
    "empty text": (dict(text="", max_tokens=4), "text: must not be empty"),
    "empty ids": (
        dict(token_ids=pb.TokenIds(ids=[]), max_tokens=4),
        "token_ids.ids: must not be empty",
    ),
    "no prompt": (dict(max_tokens=4), "prompt: set either text or token_ids"),
    "id outside vocab": (
        dict(token_ids=pb.TokenIds(ids=[1, VOCAB]), max_tokens=4),
        f"token_ids.ids: id {VOCAB} is outside the vocabulary",
    ),
    "prompt too long": (
        dict(token_ids=pb.TokenIds(ids=[1] * 300), max_tokens=4),
        "longer than the model's limit max_model_len=256",
    ),
    "max_tokens zero": (dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=0), "max_tokens"),
    "max_tokens beyond limit": (
        dict(token_ids=pb.TokenIds(ids=[1] * 10), max_tokens=250),
        "max_tokens: prompt (10) + max_tokens (250) exceeds",
    ),
    "negative temperature": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=4,
            sampling=pb.SamplingConfig(temperature=-0.5),
        ),
        "sampling.temperature",
    ),
    "top_p above one": (
        dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=4, sampling=pb.SamplingConfig(top_p=1.5)),
        "sampling.top_p: must lie in (0, 1]",
    ),
    "negative top_k": (
        dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=4, sampling=pb.SamplingConfig(top_k=-1)),
        "sampling.top_k",
    ),
    "stop id outside vocab": (
        dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=4, stop_token_ids=[VOCAB + 5]),
        "stop_token_ids: id",
    ),
    "bad allowed range": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=4,
            allowed_tokens=pb.TokenRange(start=10, end=5),
        ),
        "allowed_tokens",
    ),
    "phoneme sync without phonemes": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=40,
            phoneme_sync=pb.PhonemeSync(
                speech_tokens=pb.TokenRange(start=100, end=255),
                end_token_id=3,
                max_tokens_per_phoneme=4,
            ),
        ),
        "phoneme_sync.phoneme_ids: must not be empty",
    ),
    "phoneme id outside vocab": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=40,
            phoneme_sync=pb.PhonemeSync(
                phoneme_ids=[5, VOCAB + 1],
                speech_tokens=pb.TokenRange(start=100, end=255),
                end_token_id=3,
                max_tokens_per_phoneme=4,
            ),
        ),
        "phoneme_sync.phoneme_ids: id 257 is outside the vocabulary",
    ),
    "phoneme sync budget zero": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=40,
            phoneme_sync=pb.PhonemeSync(
                phoneme_ids=[5, 6], speech_tokens=pb.TokenRange(start=100, end=255), end_token_id=3
            ),
        ),
        "phoneme_sync.max_tokens_per_phoneme: must be > 0",
    ),
    "phoneme sync without speech range": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=40,
            phoneme_sync=pb.PhonemeSync(
                phoneme_ids=[5, 6], end_token_id=3, max_tokens_per_phoneme=4
            ),
        ),
        "phoneme_sync.speech_tokens: is required",
    ),
    "phoneme sync beyond max_tokens": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=5,
            phoneme_sync=pb.PhonemeSync(
                phoneme_ids=[5, 6],
                speech_tokens=pb.TokenRange(start=100, end=255),
                end_token_id=3,
                min_tokens=[4, 4],
                max_tokens=[4, 4],
            ),
        ),
        "max_tokens: 5 cannot hold the constrained output",
    ),
    "pace without a rate": (
        dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=5, pace=pb.Pace(lead_tokens=8)),
        "pace.tokens_per_second: must be > 0 and finite",
    ),
    "pace at an infinite rate": (
        dict(
            token_ids=pb.TokenIds(ids=[1]),
            max_tokens=5,
            pace=pb.Pace(tokens_per_second=float("inf"), lead_tokens=8),
        ),
        "pace.tokens_per_second: must be > 0 and finite",
    ),
    "pace without a lead": (
        dict(token_ids=pb.TokenIds(ids=[1]), max_tokens=5, pace=pb.Pace(tokens_per_second=50)),
        "pace.lead_tokens: must be >= 1",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_and_harms_nothing(service, case):
    kwargs, match = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        generate(service, **kwargs)
    assert err.value.code() == INVALID, err.value.details()
    assert match in err.value.details()
    tokens, _, _ = generate(
        service, token_ids=pb.TokenIds(ids=[4, 5]), max_tokens=3, ignore_eos=True
    )
    assert len(tokens) == 3
    assert wait_idle(service).num_used_blocks == 0


def wait_idle(service, timeout: float = 20.0) -> pb.ModelInfo:
    deadline = time.monotonic() + timeout
    while True:
        mi = info(service)
        idle = (
            mi.num_used_blocks == 0
            and mi.num_running == 0
            and mi.num_waiting == 0
            and mi.num_used_state_slots == 0
        )
        if idle or time.monotonic() > deadline:
            return mi
        time.sleep(0.05)


def test_phoneme_sync_streams_the_phonemes_in_order(service):
    sync = pb.PhonemeSync(
        phoneme_ids=[5, 9, 5, 12],
        speech_tokens=pb.TokenRange(start=100, end=255),
        end_token_id=3,
        min_tokens=[2, 0, 1, 3],
        max_tokens=[2, 4, 5, 3],
    )
    for sampling in (pb.SamplingConfig(temperature=0), pb.SamplingConfig(temperature=1.0, seed=4)):
        tokens, last, _ = generate(
            service,
            token_ids=pb.TokenIds(ids=[1, 7, 9, 2]),
            max_tokens=60,
            phoneme_sync=sync,
            sampling=sampling,
        )
        assert last.finish_reason == pb.FINISH_REASON_STOP and tokens[-1] == 3
        assert [t for t in tokens if t < 100] == [5, 9, 5, 12, 3]
        runs = [len(r) for r in "".join("s" if t >= 100 else "|" for t in tokens[1:-1]).split("|")]
        assert runs[0] == 2 and runs[3] == 3 and runs[1] <= 4 and 1 <= runs[2] <= 5


def test_cancel_mid_stream_frees_blocks_and_slots(service):
    with service.channel() as ch:
        call = stub(ch).Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(1, 60))), max_tokens=180, ignore_eos=True
            ),
            timeout=60,
        )
        next(call)
        busy = info(service)
        assert busy.num_used_blocks > 0 and busy.num_used_state_slots > 0
        call.cancel()
    mi = wait_idle(service)
    assert (mi.num_used_blocks, mi.num_running, mi.num_used_state_slots) == (0, 0, 0)


def test_many_concurrent_streams_and_cancellations(service):
    results, errors = [], []

    def run(i):
        try:
            with service.channel() as ch:
                call = stub(ch).Generate(
                    pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=[i + 1] * (5 + i)), max_tokens=30, ignore_eos=True
                    ),
                    timeout=60,
                )
                got = []
                for r in call:
                    got.extend(r.token_ids)
                    if i % 2 and len(got) >= 3:
                        call.cancel()
                        break
                results.append((i, len(got)))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(n for i, n in results if i % 2 == 0) == [30] * 4
    assert wait_idle(service).num_used_blocks == 0


def test_metrics_exported(service):
    text = service.metrics()
    for name in (
        "splittts_text_time_to_first_token_seconds_count",
        "splittts_text_inter_token_latency_seconds_count",
        "splittts_text_e2e_request_latency_seconds_count",
        "splittts_text_request_queue_time_seconds_count",
    ):
        assert (metric_value(text, name) or 0) > 0, name
    for name in (
        "splittts_text_num_requests_running",
        "splittts_text_num_requests_waiting",
        "splittts_text_kv_cache_usage_perc",
        "splittts_text_prefix_cache_queries",
        "splittts_text_prefix_cache_hits",
    ):
        assert metric_value(text, name) is not None, name


def test_cache_gauges_follow_a_request_and_return_to_zero_when_it_is_cancelled(service):
    assert wait_idle(service).num_used_blocks == 0
    with service.channel() as ch:
        call = stub(ch).Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(1, 40))), max_tokens=200, ignore_eos=True
            ),
            timeout=60,
        )
        next(call)  # admitted: it holds its blocks and a state slot until it ends
        held = service.metrics()
        mi = info(service)
        assert mi.num_used_blocks >= 3 and mi.num_used_state_slots == 1
        assert metric_value(held, "splittts_text_num_used_kv_blocks") >= 3
        assert metric_value(held, "splittts_text_num_used_state_slots") == 1
        call.cancel()
    assert wait_idle(service).num_used_blocks == 0
    text = service.metrics()
    assert metric_value(text, "splittts_text_num_used_kv_blocks") == 0
    assert metric_value(text, "splittts_text_num_used_state_slots") == 0


def test_admission_cap(model_dir):
    proc = ServiceProcess(
        "text_service",
        "--model",
        str(model_dir),
        "--kv-cache-memory",
        "32MiB",
        "--threads",
        "1",
        "--max-pending",
        "1",
    )
    try:
        with proc.channel() as ch:
            first = stub(ch).Generate(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=200, ignore_eos=True
                ),
                timeout=60,
            )
            next(first)
            with pytest.raises(grpc.RpcError) as err:
                list(
                    stub(ch).Generate(
                        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), max_tokens=2), timeout=30
                    )
                )
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_pending=1" in err.value.details()
            first.cancel()
    finally:
        assert proc.stop() == 0
