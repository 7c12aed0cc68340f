"""The engine end to end on tiny random models: greedy tokens equal HF `generate` through chunked
prefill, batching, preemption and the prefix cache; sampling, stops, aborts and sizing."""

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_models import WIDE, load_hf_model, make_tiny_model

from kernels import cpu_ext
from text_service.engine import EngineArgs, LLMEngine, StepOutput
from text_service.errors import CapacityError, InvalidRequestError
from text_service.sampling_params import SamplingParams

LIN = "linear_attention"
KINDS = {
    "hybrid": ("qwen3_5", {}),  # three Gated DeltaNet layers, then full attention
    "dense": ("qwen3", {}),
    "all_linear": ("qwen3_5", dict(layer_types=[LIN, LIN])),
}
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT_A, PROMPT_B, PROMPT_C = tokens(20, 1), tokens(5, 2), tokens(37, 3)


@dataclass
class Tiny:
    kind: str
    path: Path
    hf: object
    refs: dict = field(default_factory=dict)

    def greedy(self, prompt: list[int], n: int = 64) -> list[int]:
        """HF's own greedy continuation (no EOS in the config, so exactly n tokens); HF's cache
        cannot hold a model without attention layers, so that one recomputes every step."""
        key = (tuple(prompt), n)
        if key not in self.refs:
            ids = torch.tensor([prompt])
            with torch.no_grad():  # an explicit mask: HF would treat ids equal to pad as padding
                out = self.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    pad_token_id=0,
                    use_cache=self.kind != "all_linear",
                )
            self.refs[key] = out[0, len(prompt) :].tolist()
            assert len(self.refs[key]) == n
        return self.refs[key]

    def engine(self, **kwargs) -> LLMEngine:
        args = dict(
            model=str(self.path),
            device="cpu",
            kv_cache_memory_bytes=1 << 24,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            num_snapshot_slots=16,
        )
        return LLMEngine(EngineArgs(**{**args, **kwargs}))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    built: dict[str, Tiny] = {}

    def get(name: str) -> Tiny:
        if name not in built:
            kind, overrides = KINDS[name]
            path = make_tiny_model(tmp_path_factory.mktemp(name), kind, **overrides)
            built[name] = Tiny(name, path, load_hf_model(path))
        return built[name]

    return get


@pytest.fixture(params=["hybrid", "dense"])
def tiny(request, tiny_models) -> Tiny:
    return tiny_models(request.param)


@pytest.fixture
def dense(tiny_models) -> Tiny:
    return tiny_models("dense")


def run(engine: LLMEngine, requests, late=(), late_step: int = 3) -> dict:
    """Add (id, prompt, params) requests, the `late` ones after `late_step` steps; step until all
    finish and return each request's streamed tokens."""
    streamed = {rid: [] for rid, _, _ in [*requests, *late]}
    for request in requests:
        engine.add_request(*request)
    step = 0
    while engine.has_unfinished_requests() or step <= late_step:
        if step == late_step:
            for request in late:
                engine.add_request(*request)
        for out in engine.step():
            assert isinstance(out, StepOutput) and len(out.new_token_ids) == 1
            streamed[out.seq.seq_id] += out.new_token_ids
        step += 1
    return streamed


# -- greedy parity with HF ------------------------------------------------------------------------
def test_single_request_matches_hf_greedy(tiny):
    engine = tiny.engine()
    assert engine.generate([PROMPT_A], GREEDY) == [tiny.greedy(PROMPT_A)]


def test_chunked_prefill_matches_hf_greedy(tiny):
    engine = tiny.engine(max_num_batched_tokens=8, max_num_seqs=4)
    engine.add_request("c", PROMPT_C, GREEDY)
    steps_to_first_token, got = 0, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps_to_first_token += not got
        got += [t for out in outs for t in out.new_token_ids]
    assert steps_to_first_token >= 5  # 37 prompt tokens in chunks of at most 8
    assert got == tiny.greedy(PROMPT_C)


def test_batched_sequences_of_different_lengths_match_hf_greedy(tiny):
    # the late request is prefilled in chunks next to the others' decodes
    engine = tiny.engine(max_num_batched_tokens=16, max_num_seqs=4)
    got = run(
        engine, [("a", PROMPT_A, GREEDY), ("b", PROMPT_B, GREEDY)], late=[("c", PROMPT_C, GREEDY)]
    )
    assert got == {
        "a": tiny.greedy(PROMPT_A),
        "b": tiny.greedy(PROMPT_B),
        "c": tiny.greedy(PROMPT_C),
    }


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_sequences_recompute_the_same_tokens(tiny, prefix_caching):
    # 3 requests need 21 + 18 + 26 blocks of 4 tokens; 32 blocks force preemption
    engine = tiny.engine(
        block_size=4, num_kv_blocks=32, max_model_len=104, enable_prefix_caching=prefix_caching
    )
    got = engine.generate([PROMPT_A, PROMPT_B, PROMPT_C], GREEDY)
    assert engine.stats()["num_preemptions"] > 0
    assert got == [tiny.greedy(PROMPT_A), tiny.greedy(PROMPT_B), tiny.greedy(PROMPT_C)]
    assert engine.stats()["num_used_blocks"] == 0


def test_prefix_cache_hits_keep_greedy_tokens(tiny):
    # on the hybrid model a hit restores the linear-attention state from a snapshot
    engine = tiny.engine()
    assert engine.generate([PROMPT_C], GREEDY) == [tiny.greedy(PROMPT_C)]
    assert engine.stats()["prefix_cache_hits"] == 0
    assert engine.generate([PROMPT_C], GREEDY) == [tiny.greedy(PROMPT_C)]
    hits = engine.stats()["prefix_cache_hits"]
    assert hits >= 32
    shared = PROMPT_C[:34] + tokens(6, 9)  # shares two full blocks and part of a third
    assert engine.generate([shared], GREEDY) == [tiny.greedy(shared)]
    assert engine.stats()["prefix_cache_hits"] >= hits + 32
    hits = engine.stats()["prefix_cache_hits"]
    one_left = PROMPT_C[:32] + tokens(1, 10)  # a hit leaves a one-token prefill chunk
    assert engine.generate([one_left], GREEDY) == [tiny.greedy(one_left)]
    assert engine.stats()["prefix_cache_hits"] >= hits + 32


def test_all_linear_model_has_no_kv_pool_and_matches_hf(tiny_models):
    tiny = tiny_models("all_linear")
    budget = 1 << 20
    engine = tiny.engine(kv_cache_memory_bytes=budget, max_num_seqs=4, num_snapshot_slots=4)
    assert engine.runner.kv_bytes_per_block(16) == 0
    assert engine.runner.cache_bytes() == 8 * engine.runner.state_bytes_per_slot() <= budget
    assert engine.config.num_kv_blocks * 16 >= 4 * engine.config.max_model_len
    got = engine.generate([PROMPT_A, PROMPT_C], GREEDY)
    assert got == [tiny.greedy(PROMPT_A), tiny.greedy(PROMPT_C)]
    assert engine.generate([PROMPT_C], GREEDY) == [tiny.greedy(PROMPT_C)]
    assert engine.stats()["prefix_cache_hits"] >= 32


# -- sizing, requests, aborts ---------------------------------------------------------------------
def test_pools_are_sized_from_the_memory_budget(tiny):
    budget = 3 << 20
    engine = tiny.engine(kv_cache_memory_bytes=budget, max_num_seqs=4, num_snapshot_slots=6)
    runner, config = engine.runner, engine.config
    per_block = runner.kv_bytes_per_block(config.block_size)
    assert config.num_state_slots == (4 if tiny.kind == "hybrid" else 0)
    assert config.num_snapshot_slots == (6 if tiny.kind == "hybrid" else 0)
    state_bytes = config.state_pool_size * runner.state_bytes_per_slot()
    assert config.num_kv_blocks == (budget - state_bytes) // per_block
    assert budget - per_block < runner.cache_bytes() <= budget
    with pytest.raises(ValueError):
        tiny.engine(kv_cache_memory_bytes=per_block * 4)  # cannot hold one max_model_len sequence


def test_abort_frees_all_blocks_and_state_slots(tiny):
    engine = tiny.engine(max_num_batched_tokens=16, max_num_seqs=2)
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_C), ("c", PROMPT_B)):
        engine.add_request(rid, prompt, GREEDY)
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats["num_used_blocks"] > 0 and stats["num_waiting"] == 1
    assert stats["num_used_state_slots"] == (2 if tiny.kind == "hybrid" else 0)
    assert engine.abort_request("c")  # still waiting
    assert engine.abort_request("b")  # mid-prefill
    assert engine.abort_request("a")  # decoding
    assert not engine.abort_request("a") and not engine.abort_request("unknown")
    stats = engine.stats()
    assert stats["num_used_blocks"] == stats["num_used_state_slots"] == 0
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.generate([PROMPT_B], GREEDY) == [tiny.greedy(PROMPT_B)]  # still serves


def test_step_outputs_and_timings(dense):
    engine = dense.engine()
    seq = engine.add_request("x", PROMPT_A, SamplingParams(temperature=0, max_tokens=5))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.new_token_ids[0] for o in outs] == dense.greedy(PROMPT_A)[:5]
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert all(o.seq is seq for o in outs) and seq.finish_reason == "length"
    assert (
        seq.arrival_time
        <= seq.first_scheduled_time
        <= seq.prefill_done_time
        <= seq.first_token_time
        <= seq.finished_time
    )


def test_invalid_requests_and_admission_cap(dense):
    engine = dense.engine(max_num_waiting=2)
    with pytest.raises(InvalidRequestError):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("v", [1, 256], GREEDY)  # outside the vocabulary
    with pytest.raises(InvalidRequestError):
        engine.add_request("t", [1], SamplingParams(temperature=-1))
    engine.add_request("r1", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("r1", [1, 2], GREEDY)  # id in use
    engine.add_request("r2", [1, 2], GREEDY)
    with pytest.raises(CapacityError):
        engine.add_request("r3", [1, 2], GREEDY)
    assert engine.generate([PROMPT_B] * 5, GREEDY) == [dense.greedy(PROMPT_B)] * 5  # fed in turn


# -- sampling and stopping ------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=24, ignore_eos=True)
    alone = tiny.engine().generate([PROMPT_A], seeded)[0]
    noisy = SamplingParams(temperature=1.2, max_tokens=30)
    batched = run(
        tiny.engine(max_num_batched_tokens=16, seed=3),
        [("n1", PROMPT_C, noisy), ("s", PROMPT_A, seeded)],
        late=[("n2", PROMPT_B, noisy)],
    )
    assert batched["s"] == alone
    other = tiny.engine().generate(
        [PROMPT_A],
        SamplingParams(temperature=1.0, top_k=50, seed=8, max_tokens=24, ignore_eos=True),
    )[0]
    assert other != alone
    assert alone != tiny.greedy(PROMPT_A)[:24]


def test_allowed_token_range_is_respected(dense):
    engine = dense.engine()
    sampled = SamplingParams(temperature=1.5, seed=1, max_tokens=40, allowed_token_range=(100, 140))
    greedy = SamplingParams(temperature=0, max_tokens=40, allowed_token_range=(100, 140))
    out_sampled, out_greedy = engine.generate([PROMPT_A, PROMPT_A], [sampled, greedy])
    assert all(100 <= t <= 140 for t in out_sampled + out_greedy)
    assert len(set(out_sampled)) > 5


def test_stop_ids_and_max_tokens(tiny):
    ref = tiny.greedy(PROMPT_A)
    stop = ref[10]
    i = ref.index(stop)
    engine = tiny.engine()
    seq = engine.add_request("s", PROMPT_A, SamplingParams(temperature=0, stop_token_ids=(stop,)))
    short = engine.add_request("m", PROMPT_A, SamplingParams(temperature=0, max_tokens=7))
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == ref[: i + 1]  # the stop id is the last token
    assert seq.finish_reason == "stop" and seq.stop_token_id == stop
    assert short.output_token_ids == ref[:7] and short.finish_reason == "length"


def test_eos_from_the_checkpoint_stops_unless_ignored(dense, tmp_path):
    ref = dense.greedy(PROMPT_A)
    eos = ref[5]
    path = make_tiny_model(tmp_path, "qwen3", eos_token_id=eos)  # same seed: same weights
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 255]}))
    shutil.copy(_word_tokenizer(tmp_path), path / "tokenizer.json")
    engine = LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory_bytes=1 << 24))
    assert engine.config.eos_token_ids == (eos, 255)
    assert engine.tokenizer is not None and engine.tokenizer.token_to_id("hello") == 1
    stopped, ignored = engine.generate(
        [PROMPT_A, PROMPT_A],
        [
            SamplingParams(temperature=0, max_tokens=64),
            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        ],
    )
    assert stopped == ref[: ref.index(eos) + 1]
    assert ignored == ref


def _word_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    out = tmp_path / "tokenizer.json"
    tokenizer.save(str(out))
    return out


@pytest.mark.parametrize("name", sorted(WIDE))
def test_cpu_projections_are_packed_once_and_match_hf(name, tmp_path):
    """On CPU every projection runs on a weight packed once at load (the AVX-512 fp32 kernel's
    panels where the CPU has it, at any size; else oneDNN's blocks for the big ones); a tied LM
    head on its own copy, the embedding table untouched; greedy tokens equal HF's."""
    from kernels.linear import ONEDNN_MIN_MACS
    from text_service.models.layers import Linear

    def packed(w: torch.Tensor) -> bool:
        return w.is_mkldnn or w.dim() == 3

    kind, overrides = WIDE[name]
    path = make_tiny_model(tmp_path, kind, **overrides)
    wide = Tiny(name, path, load_hf_model(path))
    engine = wide.engine()
    model = engine.runner.model
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
    assert sum(packed(w) for w in linears) >= 6
    if cpu_ext.fp32_linear_available():
        # every fp32 weight, however small; a merged one padded to whole panels where need be
        assert all(w.dim() == 3 for w in linears)
    else:
        assert all(packed(w) == (w.numel() >= ONEDNN_MIN_MACS) for w in linears)
    assert model.tie_word_embeddings == (name == "hybrid")  # one of each
    if model.tie_word_embeddings:
        assert model._tied_head is not None and packed(model._tied_head)
    assert not packed(model.model.embed_tokens.weight)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert run(engine, [(0, PROMPT_A, params), (1, PROMPT_C, params)]) == {
        0: wide.greedy(PROMPT_A, 24),
        1: wide.greedy(PROMPT_C, 24),
    }


@pytest.mark.skipif(not cpu_ext.fp32_linear_available(), reason="no AVX-512 or AVX2")
@pytest.mark.parametrize("bias", [False, True])
def test_a_merged_projection_is_padded_to_whole_panels_and_split_back(bias):
    """Qwen3.5's in_proj_qkvzba has rows no packed layout takes (774 in the default voice): zero
    rows pad it to whole panels of outputs, and its split drops their outputs."""
    from kernels import get_ops
    from text_service.models.layers import MergedLinear

    sizes = [40, 8, 3, 3]  # 54 rows: 10 of padding
    layer = MergedLinear(64, sizes, bias=bias, ops=get_ops("cpu"))
    weight, b = torch.randn(54, 64), torch.randn(54)
    layer.weight.data.copy_(weight)
    if bias:
        layer.bias.data.copy_(b)
    layer.pack_weight()
    assert layer.weight.shape == (2, 64, 32)  # 64 rows: two panels
    x = torch.randn(5, 64)
    parts = layer.split(layer(x))
    expected = F.linear(x, weight, b if bias else None).split(sizes, dim=-1)
    assert [p.shape for p in parts] == [e.shape for e in expected]
    for p, e in zip(parts, expected):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


def test_cpu_runner_keeps_freed_heap_for_reuse():
    """glibc accepts the settings that stop each prefill step's activations from being unmapped
    on free and faulted in again on the next step."""
    from servicekit.memory import retain_freed_memory

    assert retain_freed_memory() is True


def test_onednn_primitive_cache_is_enlarged_unless_the_operator_set_it(monkeypatch):
    from servicekit.memory import ONEDNN_PRIMITIVES, keep_onednn_primitives

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    keep_onednn_primitives()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVES)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    keep_onednn_primitives()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
