"""Phoneme-synchronous decoding: the batched sampler rule against a per-row reference, and the
engine against a reference decoder on a tiny random model through chunked prefill, batching,
preemption and prefix-cache hits, greedy and seeded."""

import math

import numpy as np
import pytest
import torch
from hf_models import load_hf_model, make_tiny_model

from text_service.constraints import PhonemeSync, PhonemeSyncState
from text_service.engine import EngineArgs, LLMEngine
from text_service.errors import InvalidRequestError
from text_service.sampler import Sampler, apply_phoneme_sync, apply_phoneme_sync_shared
from text_service.sampling_params import SamplingParams

LO, HI, END = 20, 255, 3  # speech ids, the end id
PROMPT = [1, 7, 9, 11, 40, 12, 2]


def sync(phonemes, mins=None, maxs=None, cap=6) -> PhonemeSync:
    n = len(phonemes)
    return PhonemeSync(
        tuple(phonemes), (LO, HI), END, tuple(mins or (0,) * n), tuple(maxs or (cap,) * n)
    )


def reference_row(logits: list[float], c: PhonemeSync, state: PhonemeSyncState) -> list[float]:
    """The rule written out per row: pooled non-speech mass onto the next id, bounds applied."""
    k, run = state.num_phonemes, state.run
    may = k == 0 or run >= c.min_tokens[k - 1]
    must = k == 0 or run >= c.max_tokens[k - 1]
    nxt = c.phoneme_ids[k] if k < len(c.phoneme_ids) else c.end_token_id
    others = [x for i, x in enumerate(logits) if not LO <= i <= HI]
    top = max(others)
    pooled = top + math.log(sum(math.exp(x - top) for x in others))
    out = [x if LO <= i <= HI and not must else -math.inf for i, x in enumerate(logits)]
    out[nxt] = 0.0 if must else (pooled if may else -math.inf)
    return out


def test_batched_rule_matches_the_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    c = sync([5, 9, 5, 30, 31], mins=[0, 2, 1, 0, 3], maxs=[4, 2, 5, 3, 6])
    states = [PhonemeSyncState(k, r) for k in range(6) for r in range(7)]
    logits = torch.randn(len(states), 256, generator=gen, dtype=torch.float64) * 3
    lo = torch.full((len(states),), LO)
    hi = torch.full((len(states),), HI)
    bounds = [
        s.bounds(c)
        if s.num_phonemes == 0 or s.run <= c.max_tokens[s.num_phonemes - 1]
        else (True, True)
        for s in states
    ]
    got = apply_phoneme_sync(
        logits,
        lo,
        hi,
        torch.tensor([s.next_id(c) for s in states]),
        torch.tensor([b[0] for b in bounds]),
        torch.tensor([b[1] for b in bounds]),
    )
    shared = logits.clone()
    apply_phoneme_sync_shared(
        shared,
        LO,
        HI,
        torch.tensor([s.next_id(c) for s in states]),
        np.array([b[0] for b in bounds]),
        np.array([b[1] for b in bounds]),
    )
    for row, state in enumerate(states):
        want = torch.tensor(reference_row(logits[row].tolist(), c, state), dtype=torch.float64)
        assert torch.allclose(got[row], want, atol=1e-9), state
        assert torch.allclose(shared[row], want, atol=1e-9), state


def test_only_rows_with_a_constraint_change_and_non_finite_logits_give_valid_ids():
    c = sync([5, 6])
    logits = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("inf")  # an overflowed logit in the constrained row
    logits[2] = float("nan")  # a broken row without a constraint
    plain = logits[0].clone()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, phoneme_sync=c),
        SamplingParams(temperature=1, seed=3),
    ]
    tokens = Sampler(256)(logits, params, [None] * 3, [0] * 3, [None, c.initial_state(), None])
    assert tokens[0] == int(plain.argmax()) and torch.equal(logits[0], plain)
    assert tokens[1] == 5  # the first phoneme opens the output whatever the logits say
    assert 0 <= tokens[2] < 256


def test_sampler_refuses_rows_without_state():
    with pytest.raises(ValueError, match="constraint states"):
        Sampler(256)(torch.zeros(1, 256), [SamplingParams(phoneme_sync=sync([5]))], [None], [0])


# -- the engine against a reference decoder --------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    # peaky logits, so the model's own choices mix speech tokens and votes to move on
    path = make_tiny_model(tmp_path_factory.mktemp("sync"), "qwen3_5", initializer_range=0.6)
    return path, load_hf_model(path)


def reference_greedy(hf, prompt: list[int], c: PhonemeSync, max_tokens: int) -> list[int]:
    """Full-sequence HF forwards, one per token, under the per-row rule."""
    ids, state, out = list(prompt), c.initial_state(), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double().tolist()
        row = reference_row(logits, c, state)
        tok = max(range(len(row)), key=row.__getitem__)
        out.append(tok)
        ids.append(tok)
        state.advance(c, tok)
        if tok == END:
            break
    return out


CONSTRAINTS = {
    "cap": sync([5, 9, 5, 12, 13, 5, 14, 15], cap=5),
    "band": sync(
        [5, 9, 5, 12, 13, 5, 14, 15], mins=[1, 0, 2, 1, 0, 3, 1, 0], maxs=[4, 3, 6, 2, 5, 5, 3, 8]
    ),
    "schedule": sync([5, 9, 5, 12, 13, 5], mins=[2, 0, 3, 1, 4, 2], maxs=[2, 0, 3, 1, 4, 2]),
}


def check_structure(out: list[int], c: PhonemeSync) -> None:
    assert out[-1] == END and out[0] == c.phoneme_ids[0]
    assert [t for t in out if not LO <= t <= HI][:-1] == list(c.phoneme_ids)
    runs, k = [0] * len(c.phoneme_ids), -1
    for t in out[:-1]:
        if LO <= t <= HI:
            runs[k] += 1
        else:
            k += 1
    assert all(lo <= r <= hi for r, lo, hi in zip(runs, c.min_tokens, c.max_tokens)), runs


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_greedy_equals_the_reference_decoder(model, name):
    path, hf = model
    c = CONSTRAINTS[name]
    engine = LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory_bytes=1 << 24))
    got = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=80, phoneme_sync=c))[0]
    assert got == reference_greedy(hf, PROMPT, c, 80)
    check_structure(got, c)
    if name == "schedule":
        assert sum(LO <= t <= HI for t in got) == sum(c.min_tokens)


def test_speech_choices_equal_the_unconstrained_model(model):
    # wherever the constrained output holds a speech token it chose freely, an unconstrained
    # greedy step from the same prefix picks that very token
    path, hf = model
    c = CONSTRAINTS["cap"]
    engine = LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory_bytes=1 << 24))
    got = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=80, phoneme_sync=c))[0]
    free = 0
    for i, tok in enumerate(got):
        if LO <= tok <= HI:
            with torch.no_grad():
                plain = hf(torch.tensor([PROMPT + got[:i]])).logits[0, -1]
            assert int(plain.argmax()) == tok
            free += 1
    assert free > 0


def _requests():
    out = []
    for i, (_, c) in enumerate(sorted(CONSTRAINTS.items())):
        prompt = PROMPT + [16 + i] * (5 + 7 * i)
        for params in (
            SamplingParams(temperature=0, max_tokens=80, phoneme_sync=c),
            SamplingParams(temperature=1.0, top_k=40, seed=11 + i, max_tokens=80, phoneme_sync=c),
            SamplingParams(temperature=0.8, top_p=0.9, seed=5 + i, max_tokens=80, phoneme_sync=c),
        ):
            out.append((prompt, params))
    return out


@pytest.mark.parametrize("config", ["chunked", "preempt", "prefix_hit"])
def test_identical_through_chunked_prefill_preemption_and_prefix_hits(model, config):
    path, _ = model
    requests = _requests()
    base = LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory_bytes=1 << 24))
    want = [base.generate([p], sp)[0] for p, sp in requests]  # one at a time
    for out, (_, sp) in zip(want, requests):
        check_structure(out, sp.phoneme_sync)
    kwargs = {
        "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
        "preempt": dict(block_size=4, num_kv_blocks=48, max_model_len=180),
        "prefix_hit": dict(block_size=4),
    }[config]
    engine = LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory_bytes=1 << 24, **kwargs))
    if config == "prefix_hit":
        engine.generate([p for p, _ in requests], [sp for _, sp in requests])
    got = engine.generate([p for p, _ in requests], [sp for _, sp in requests])
    assert got == want
    stats = engine.stats()
    if config == "preempt":
        assert stats["num_preemptions"] > 0
    if config == "prefix_hit":
        assert stats["prefix_cache_hits"] > 0
    assert stats["num_used_blocks"] == 0


@pytest.mark.parametrize(
    "c, max_tokens, field",
    [
        (PhonemeSync((), (LO, HI), END, (), ()), 50, "phoneme_sync.phoneme_ids"),
        (sync([5, 300]), 50, "phoneme_sync.phoneme_ids"),
        (sync([5, 120]), 50, "phoneme_sync.phoneme_ids"),  # a phoneme inside the speech range
        (sync([5, 6], maxs=[0, 0]), 50, "phoneme_sync.max_tokens"),
        (sync([5, 6], mins=[3, 0], maxs=[2, 4]), 50, "phoneme_sync.min_tokens"),
        (sync([5, 6], mins=[1]), 50, "phoneme_sync.min_tokens"),
        (PhonemeSync((5,), (LO, HI), 150, (0,), (4,)), 50, "phoneme_sync.end_token_id"),
        (PhonemeSync((5,), (HI, LO), END, (0,), (4,)), 50, "phoneme_sync.speech_tokens"),
        (sync([5, 6], mins=[20, 20], maxs=[20, 20]), 30, "max_tokens"),
    ],
)
def test_unsatisfiable_constraints_are_refused(c, max_tokens, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=max_tokens, phoneme_sync=c).validate(256, 512, 4)
    assert err.value.field == field


def test_a_phoneme_that_is_a_stop_id_is_refused():
    params = SamplingParams(max_tokens=50, stop_token_ids=(6,), phoneme_sync=sync([5, 6]))
    with pytest.raises(InvalidRequestError) as err:
        params.validate(256, 512, 4)
    assert err.value.field == "phoneme_sync.phoneme_ids"
    assert END in SamplingParams(phoneme_sync=sync([5])).stop_token_ids
