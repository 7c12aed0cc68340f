"""Sampler semantics on hand-made logits: greedy, temperature, top-k/p, penalties, ranges, seeds."""

import numpy as np
import pytest
import torch

from text_service.sampler import Sampler, inverse_cdf, step_seed, top_k_top_p
from text_service.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]
N = 4000  # rows per distribution check: frequencies within 0.03 (several sigma)


def sample(params, logits, histories=None, steps=None, eos=(), seed=0):
    rows = logits.shape[0]
    return Sampler(logits.shape[1], eos_token_ids=eos, seed=seed)(
        logits.clone(), params, histories or [None] * rows, steps or [0] * rows
    )


def frequencies(params: SamplingParams, probs=PROBS) -> np.ndarray:
    logits = torch.tensor(probs).log().repeat(N, 1)
    tokens = sample([params] * N, logits)
    return np.bincount(tokens, minlength=len(probs)) / N


def normalised(p) -> np.ndarray:
    p = np.asarray(p, dtype=float)
    return p / p.sum()


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample([SamplingParams(temperature=0)] * 5, logits) == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_equal_maxima():
    """Ties (common in bf16 logits) go to the lowest id, as `argmax` resolves them, in greedy
    batches and in greedy rows of a mixed batch."""
    logits = torch.zeros(3, 40)
    logits[0, [7, 3, 30]] = 2.0
    logits[1, [39, 38]] = 5.0
    logits[2, [0, 20]] = float("inf")
    assert sample([SamplingParams(temperature=0)] * 3, logits.clone()) == [3, 38, 0]
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)] * 2
    assert sample(mixed[:3], logits.clone())[::2] == [3, 0]


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)] * 3
    assert sample(params, logits) == logits.argmax(-1).tolist()


def test_temperature_one_follows_the_softmax():
    assert np.abs(frequencies(SamplingParams(temperature=1.0)) - PROBS).max() < 0.03


def test_temperature_flattens_the_distribution():
    got = frequencies(SamplingParams(temperature=2.0))
    assert np.abs(got - normalised(np.sqrt(PROBS))).max() < 0.03


def test_top_k_keeps_the_k_best_renormalised():
    got = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert got[2] == got[3] == 0
    assert np.abs(got - normalised(PROBS[:2] + [0, 0])).max() < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 < 0.7 so token 1 is needed; 0.5 + 0.3 >= 0.7 so token 2 is not
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.7))
    assert got[2] == got[3] == 0
    assert np.abs(got - normalised([0.5, 0.3, 0, 0])).max() < 0.03


def kept_ids(values: torch.Tensor, ids: torch.Tensor) -> list[list[int]]:
    return [sorted(i[torch.isfinite(v)].tolist()) for v, i in zip(values, ids)]


def test_top_k_and_top_p_candidates():
    logits = torch.tensor([PROBS, PROBS, PROBS]).log()
    values, ids = top_k_top_p(logits, torch.tensor([3, 4, 1]), torch.tensor([0.9, 0.45, 1.0]))
    assert kept_ids(values, ids) == [
        [0, 1, 2],  # top-3, and 0.5 + 0.3 < 0.9 keeps token 2
        [0],  # top-p 0.45 is reached by token 0 alone
        [0],
    ]  # top-1
    finite = torch.isfinite(values)
    assert torch.equal(values[finite], logits.gather(1, ids)[finite])  # kept logits unchanged


def test_top_p_nucleus_wider_than_the_first_window():
    flat = torch.zeros(2, 5000)
    flat[1, :10] = 20.0  # a peaked row next to a flat one
    values, ids = top_k_top_p(flat, torch.tensor([5000, 5000]), torch.tensor([0.9, 0.85]))
    flat_kept, peaked_kept = kept_ids(values, ids)
    assert 4499 <= len(flat_kept) <= 4501
    # ten tied tokens hold ~0.1 each: any nine of them reach 0.85
    assert len(peaked_kept) == 9 and set(peaked_kept) < set(range(10))


def test_inverse_cdf_never_draws_zero_probability():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    cases = ((0.0, [0, 1, 3]), (0.49, [0, 1, 3]), (0.51, [1, 1, 3]), (1 - 2**-24, [1, 1, 3]))
    for u, want in cases:
        assert inverse_cdf(probs, torch.full((3,), u)).tolist() == want


def test_tiny_top_p_and_top_k_one_are_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 4 + [SamplingParams(top_k=1)] * 4
    assert sample(params, logits) == logits.argmax(-1).tolist()


def test_repetition_penalty_matches_hf_rule():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    history = np.array([0, 1, 1, 4])  # 0 and 1 seen, 4 seen; 2 and 3 not
    sampler = Sampler(5)
    got = logits.clone()
    sampler(got, [SamplingParams(temperature=0, repetition_penalty=2.0)], [history], [0])
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 0.5, 3.0, -4.0]]))


def test_repetition_penalty_changes_the_greedy_choice_and_respects_the_window():
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]]).repeat(2, 1)
    history = np.array([0, 2, 3])
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),  # 0 penalised: 1.5 < 2.5
        SamplingParams(temperature=0, repetition_penalty=2.0, repetition_window=2),
    ]
    assert sample(params, logits, histories=[history, history]) == [1, 0]


def test_allowed_range_masks_all_but_range_and_stop_ids():
    logits = torch.zeros(3, 20)
    logits[:, 0] = 10.0  # the eos id is the best token everywhere
    logits[:, 19] = 5.0
    params = [
        SamplingParams(temperature=0, allowed_token_range=(10, 15)),  # eos exempt
        SamplingParams(temperature=0, allowed_token_range=(10, 15), ignore_eos=True),
        SamplingParams(
            temperature=0, allowed_token_range=(10, 15), ignore_eos=True, stop_token_ids=(19,)
        ),
    ]
    assert sample(params, logits, eos=(0,)) == [0, 10, 19]
    many = SamplingParams(temperature=1.0, allowed_token_range=(3, 6), stop_token_ids=(12,))
    tokens = sample([many] * 500, torch.randn(500, 20, generator=torch.Generator().manual_seed(3)))
    assert set(tokens) <= {3, 4, 5, 6, 12} and len(set(tokens)) == 5


def test_seeded_rows_do_not_depend_on_the_batch():
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample([seeded], row, steps=[s])[0] for s in range(20)]
    others = torch.randn(3, 64)
    in_batch = [
        sample(
            [
                SamplingParams(temperature=1.0),
                SamplingParams(temperature=0),
                seeded,
                SamplingParams(temperature=0.5, seed=9),
            ],
            torch.cat([others[:2], row, others[2:]]),
            steps=[7, 0, s, s],
            seed=s,
        )[2]
        for s in range(20)
    ]
    assert alone == in_batch
    assert len(set(alone)) > 3  # each step draws afresh
    other_seed = [
        sample([SamplingParams(temperature=1.0, seed=4321)], row, steps=[s])[0] for s in range(20)
    ]
    assert other_seed != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(50, 1000)
    params = [SamplingParams(temperature=1.0)] * 50
    assert sample(params, logits, seed=1) == sample(params, logits, seed=1)
    assert sample(params, logits, seed=1) != sample(params, logits, seed=2)


def test_step_seeds_are_distinct():
    seeds = {step_seed(s, t) for s in range(50) for t in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**64 for x in seeds)


def test_rows_and_params_must_agree():
    with pytest.raises(ValueError):
        Sampler(4)(torch.zeros(2, 4), [SamplingParams()], [None], [0])


def test_penalty_without_history_is_an_error():
    with pytest.raises(ValueError):
        Sampler(4)(torch.zeros(1, 4), [SamplingParams(repetition_penalty=1.2)], [None], [0])


def test_very_low_temperature_is_greedy_not_nan():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)) * 100
    tokens = sample([SamplingParams(temperature=1e-9)] * 4, logits)
    assert tokens == logits.argmax(-1).tolist()


def test_logsumexp_equals_torch_bit_for_bit() -> None:
    """The phoneme-synchronous pool's logsumexp: torch's formula in fewer operators, so its
    results (and the tokens they pick) are torch's, infinities and empty rows included."""
    from text_service.sampler import logsumexp

    torch.manual_seed(0)
    x = torch.randn(64, 1152) * 20
    x[0] = float("-inf")  # a fully masked row
    x[1, 7] = float("inf")
    x[2, :500] = float("-inf")
    for rows in (x, x[:, :128], x[:, 1000:], x[:1, :1]):
        assert torch.equal(logsumexp(rows), torch.logsumexp(rows, -1))
    assert torch.equal(logsumexp(x[:, :0]), torch.logsumexp(x[:, :0], -1))
