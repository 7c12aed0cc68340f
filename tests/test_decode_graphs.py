"""Decode steps replayed from captured graphs give the eager steps' logits bit for bit, leave the
cache pools as they were when captured, and are refused where a graph could not stand for the
step (a host read of tensor values, a tensor that is neither an input nor the model's)."""

import pytest
import torch
from hf_models import make_tiny_model

from kernels import ops as ops_table
from text_service.decode_graphs import CaptureRefused, capture
from text_service.engine import EngineArgs, LLMEngine
from text_service.models.cache import kv_pools, state_pools
from text_service.sampling_params import SamplingParams

LIN = "linear_attention"
KINDS = {
    "hybrid": ("qwen3_5", {}),
    "dense": ("qwen3", {}),
    "all_linear": ("qwen3_5", dict(layer_types=[LIN, LIN])),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}

    def get(name: str):
        if name not in built:
            kind, overrides = KINDS[name]
            built[name] = make_tiny_model(tmp_path_factory.mktemp(name), kind, **overrides)
        return built[name]

    return get


def engine(path, graphs: int, **kwargs) -> LLMEngine:
    args = dict(
        model=str(path),
        device="cpu",
        kv_cache_memory_bytes=1 << 24,
        max_num_seqs=6,
        max_num_batched_tokens=256,
        num_snapshot_slots=16,
        decode_graphs=graphs,
    )
    return LLMEngine(EngineArgs(**{**args, **kwargs}))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def record(e: LLMEngine) -> tuple[list[torch.Tensor], dict[int, int]]:
    """Every step's logits as the sampler gets them, and how many steps each graph replayed."""
    runner, logits, replays = e.runner, [], {}
    sampler = runner.sampler

    def sample(step_logits, *args):
        logits.append(step_logits.clone())
        return sampler(step_logits, *args)

    runner.sampler = sample
    for n, graph in runner.graphs.graphs.items():
        forward = graph.module.forward

        def counted(*args, n=n, forward=forward):
            replays[n] = replays.get(n, 0) + 1
            return forward(*args)

        graph.module.forward = counted
    return logits, replays


def drive(e: LLMEngine) -> dict[str, list[int]]:
    """Six requests of different lengths (the batch shrinks 5 -> 1 as they end), two arriving
    late (steps mixing their prefill with decodes), greedy and seeded sampling both."""
    out: dict[str, list[int]] = {}
    requests = [
        (
            f"r{i}",
            prompt(7 + 5 * i, i),
            SamplingParams(
                temperature=0.8 if i % 2 else 0, seed=i, max_tokens=12 + 9 * i, ignore_eos=True
            ),
        )
        for i in range(6)
    ]
    for request in requests[:4]:
        e.add_request(*request)
    step = 0
    while e.has_unfinished_requests():
        if step == 5:
            for request in requests[4:]:
                e.add_request(*request)
        for o in e.step():
            out.setdefault(o.seq.seq_id, []).extend(o.new_token_ids)
        step += 1
    return out


@pytest.mark.parametrize(
    "name, dtype", [(name, "float32") for name in KINDS] + [("hybrid", "bfloat16")]
)
def test_replayed_steps_give_the_eager_logits_bit_for_bit(models, name, dtype):
    path = models(name)
    graphed, eager = engine(path, graphs=6, dtype=dtype), engine(path, graphs=0, dtype=dtype)
    assert graphed.runner.graphs.sizes == [1, 2, 3, 4, 5, 6]
    assert eager.runner.graphs.sizes == []
    graph_logits, replays = record(graphed)
    eager_logits, _ = record(eager)
    assert drive(graphed) == drive(eager)
    assert len(graph_logits) == len(eager_logits)
    for step, (a, b) in enumerate(zip(graph_logits, eager_logits)):
        assert torch.equal(a, b), f"step {step}"
    # the graphs did the decoding, at every batch size the requests passed through
    assert set(replays) >= {1, 2, 3, 4}, replays
    assert sum(replays.values()) > len(graph_logits) // 2


def test_graph_sizes_follow_the_batch_limit(models):
    assert engine(models("hybrid"), graphs=8, max_num_seqs=3).runner.graphs.sizes == [1, 2, 3]
    assert engine(models("hybrid"), graphs=2).runner.graphs.sizes == [1, 2]


def test_capture_leaves_the_cache_pools_as_it_found_them(models):
    e = engine(models("hybrid"), graphs=0)
    model, config = e.runner.model, e.config
    generator = torch.Generator().manual_seed(0)
    for t in kv_pools(model) + state_pools(model):
        t.copy_(torch.randn(t.shape, generator=generator))
    before = [t.clone() for t in kv_pools(model) + state_pools(model)]
    graph = capture(
        model,
        4,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        max_blocks=config.max_blocks_per_seq,
    )
    assert graph.num_seqs == 4
    assert all(torch.equal(a, b) for a, b in zip(kv_pools(model) + state_pools(model), before))


def test_a_step_that_reads_tensor_values_on_the_host_is_not_captured(models, monkeypatch, caplog):
    # the torch reference's decode attention reads seq_lens back to size its loop
    monkeypatch.setitem(ops_table._chosen, "cpu", ops_table.REFERENCE_OPS)
    e = engine(models("dense"), graphs=4)
    assert e.runner.graphs.sizes == []
    assert "read tensor values on the host" in caplog.text
    config = e.config
    with pytest.raises(CaptureRefused, match="host"):
        capture(
            e.runner.model,
            1,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_blocks=config.max_blocks_per_seq,
        )
    # and the engine decodes eagerly, as before
    e.add_request("r", prompt(9, 0), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert sum(len(o.new_token_ids) for _ in range(6) for o in e.step()) == 5


def test_a_step_that_touches_a_tensor_it_does_not_own_is_not_captured(models):
    e = engine(models("hybrid"), graphs=0)
    model, config = e.runner.model, e.config
    outside = torch.zeros(model.config.vocab_size)  # held by a closure, not by the model
    logits = model.compute_logits
    model.compute_logits = lambda hidden: logits(hidden) + outside
    with pytest.raises(CaptureRefused, match="neither an input"):
        capture(
            model,
            2,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            max_blocks=config.max_blocks_per_seq,
        )
