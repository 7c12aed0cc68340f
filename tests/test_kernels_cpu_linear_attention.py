"""The compiled CPU gated delta rule and causal conv1d (kernels/csrc) against the torch reference."""

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import conv, cpu_ext, delta_rule


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    # a machine that runs the tests has a compiler: a failed build is a failure, not a skip
    error = cpu_ext.build()
    assert error is None, f"building the CPU kernels failed: {error}"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def qsl_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def shuffled_slots(num_seqs: int, spare: int = 3) -> tuple[torch.Tensor, int]:
    pool = num_seqs + spare
    return torch.randperm(pool)[:num_seqs], pool


# --- gated delta rule ------------------------------------------------------------------------


def delta_inputs(num_tokens, heads, dk, dv, dtype=torch.float32, strided=False):
    """Inputs as the model makes them: L2-normalised q and k, g < 0, beta in (0, 1); `strided`
    gives v, g and beta as column slices of wider tensors, as the fused projection does."""
    q = F.normalize(torch.randn(num_tokens, heads, dk), dim=-1).to(dtype)
    k = F.normalize(torch.randn(num_tokens, heads, dk), dim=-1).to(dtype)
    if strided:
        v = (
            torch.randn(num_tokens, heads * dv + 5)
            .to(dtype)[:, 3 : 3 + heads * dv]
            .view(num_tokens, heads, dv)
        )
        gates = torch.randn(num_tokens, 3 * heads)
        g = -F.softplus(gates[:, :heads]) * 0.5
        beta = gates.to(dtype)[:, heads : 2 * heads].sigmoid()
        assert not v.is_contiguous() or num_tokens <= 1
    else:
        v = torch.randn(num_tokens, heads, dv).to(dtype)
        g = -F.softplus(torch.randn(num_tokens, heads)) * 0.5
        beta = torch.rand(num_tokens, heads).to(dtype)
    return q, k, v, g, beta


def run_chunk(fn, inputs, pool, lens, slots, has_init, scale):
    return fn(
        *inputs,
        ssm_state=pool,
        query_start_loc=qsl_of(lens),
        state_indices=slots,
        has_initial_state=has_init,
        scale=scale,
    )


PREFILL_CASES = {
    "one_short": ([5], 2, 16, 8),
    "chunk_edges": ([1, 63, 64, 65, 130], 2, 16, 8),
    "model_size": ([97, 33, 160], 4, 128, 128),
    "odd_dims": ([7, 40, 3], 3, 24, 53),  # a 32-column block, one-vector blocks, 5 single columns
    "with_empty": ([0, 12, 0, 9], 2, 32, 48),
}


@pytest.mark.parametrize("case", PREFILL_CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_prefill_matches_reference(case, strided) -> None:
    lens, heads, dk, dv = PREFILL_CASES[case]
    inputs = delta_inputs(sum(lens), heads, dk, dv, strided=strided)
    slots, num_slots = shuffled_slots(len(lens))
    pool = torch.randn(num_slots, heads, dk, dv) * 0.5
    pool_ref = pool.clone()
    has_init = torch.tensor([i % 3 != 1 for i in range(len(lens))])
    o = run_chunk(cpu_ext.chunk_gated_delta_rule, inputs, pool, lens, slots, has_init, dk**-0.5)
    o_ref = run_chunk(
        delta_rule.chunk_gated_delta_rule, inputs, pool_ref, lens, slots, has_init, dk**-0.5
    )
    close(o, o_ref)
    close(pool, pool_ref)  # the slots in use updated alike, the others untouched


@pytest.mark.parametrize("batch", [1, 3, 16, 37])
@pytest.mark.parametrize("dims", [(4, 128, 128), (2, 16, 8), (3, 40, 72)])
def test_decode_matches_reference_in_shuffled_slots(batch, dims) -> None:
    heads, dk, dv = dims
    inputs = delta_inputs(batch, heads, dk, dv, strided=True)
    slots, num_slots = shuffled_slots(batch)
    pool = torch.randn(num_slots, heads, dk, dv) * 0.5
    pool_ref = pool.clone()
    o = cpu_ext.recurrent_gated_delta_rule(*inputs, ssm_state=pool, state_indices=slots, scale=0.3)
    o_ref = delta_rule.recurrent_gated_delta_rule(
        *inputs, ssm_state=pool_ref, state_indices=slots, scale=0.3
    )
    close(o, o_ref)
    close(pool, pool_ref)


def test_decode_continues_a_prefill() -> None:
    # a prefill of 70 tokens then 5 decode steps equals one prefill of 75 tokens
    q, k, v, g, beta = delta_inputs(75, 2, 64, 64)
    pool, one = torch.zeros(2, 2, 64, 64), torch.zeros(2, 2, 64, 64)
    slot = torch.tensor([1])
    parts = [
        run_chunk(
            cpu_ext.chunk_gated_delta_rule,
            [t[:70] for t in (q, k, v, g, beta)],
            pool,
            [70],
            slot,
            torch.tensor([False]),
            0.125,
        )
    ]
    for t in range(70, 75):
        parts.append(
            cpu_ext.recurrent_gated_delta_rule(
                q[t : t + 1],
                k[t : t + 1],
                v[t : t + 1],
                g[t : t + 1],
                beta[t : t + 1],
                ssm_state=pool,
                state_indices=slot,
                scale=0.125,
            )
        )
    o_one = run_chunk(
        delta_rule.chunk_gated_delta_rule,
        (q, k, v, g, beta),
        one,
        [75],
        slot,
        torch.tensor([False]),
        0.125,
    )
    close(torch.cat(parts), o_one)
    close(pool, one)


@pytest.mark.parametrize("decode", [False, True])
def test_bf16_inputs_keep_dtype_and_fp32_state(decode) -> None:
    lens = [1, 1, 1] if decode else [20, 45]
    inputs = delta_inputs(sum(lens), 2, 64, 40, dtype=torch.bfloat16, strided=True)
    slots, num_slots = shuffled_slots(len(lens))
    pool = torch.randn(num_slots, 2, 64, 40) * 0.5
    pool_ref = pool.clone()
    if decode:
        o = cpu_ext.recurrent_gated_delta_rule(
            *inputs, ssm_state=pool, state_indices=slots, scale=0.2
        )
        o_ref = delta_rule.recurrent_gated_delta_rule(
            *inputs, ssm_state=pool_ref, state_indices=slots, scale=0.2
        )
    else:
        has_init = torch.tensor([True, False])
        o = run_chunk(cpu_ext.chunk_gated_delta_rule, inputs, pool, lens, slots, has_init, 0.2)
        o_ref = run_chunk(
            delta_rule.chunk_gated_delta_rule, inputs, pool_ref, lens, slots, has_init, 0.2
        )
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    close(pool, pool_ref)
    # both round the same fp32 result to bf16: at most one bf16 step apart
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_same_result_for_any_thread_count(threads) -> None:
    lens = [3, 90, 17, 1, 44]
    inputs = delta_inputs(sum(lens), 4, 32, 96)
    slots, num_slots = shuffled_slots(len(lens))
    start = torch.randn(num_slots, 4, 32, 96)
    results = []
    before = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            pool = start.clone()
            o = run_chunk(
                cpu_ext.chunk_gated_delta_rule,
                inputs,
                pool,
                lens,
                slots,
                torch.ones(len(lens), dtype=torch.bool),
                0.2,
            )
            results.append((o, pool))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_delta_rule_other_dtypes_and_empty_batches() -> None:
    q, k, v, g, beta = (t.double() for t in delta_inputs(4, 2, 16, 8))
    pool = torch.randn(3, 2, 16, 8)
    pool_ref = pool.clone()
    o = run_chunk(
        cpu_ext.chunk_gated_delta_rule,
        (q, k, v, g, beta),
        pool,
        [4],
        torch.tensor([2]),
        torch.tensor([True]),
        0.5,
    )
    o_ref = run_chunk(
        delta_rule.chunk_gated_delta_rule,
        (q, k, v, g, beta),
        pool_ref,
        [4],
        torch.tensor([2]),
        torch.tensor([True]),
        0.5,
    )
    assert o.dtype == torch.float64 and torch.equal(o, o_ref) and torch.equal(pool, pool_ref)
    empty = [t[:0].float() for t in (q, k, v, g, beta)]
    out = cpu_ext.recurrent_gated_delta_rule(
        *empty, ssm_state=pool, state_indices=torch.tensor([], dtype=torch.long), scale=0.5
    )
    assert out.shape == (0, 2, 8) and torch.equal(pool, pool_ref)


def test_delta_rule_rejects_slots_outside_the_pool() -> None:
    inputs = delta_inputs(2, 2, 16, 8)
    with pytest.raises(ValueError, match="outside the pool of 3 slots"):
        cpu_ext.recurrent_gated_delta_rule(
            *inputs,
            ssm_state=torch.zeros(3, 2, 16, 8),
            state_indices=torch.tensor([0, 3]),
            scale=0.5,
        )


# --- causal conv1d ---------------------------------------------------------------------------


def conv_inputs(num_tokens, channels, kernel, dtype=torch.float32, strided=False):
    if strided:  # a column slice of the fused projection's output
        x = torch.randn(num_tokens, channels + 7).to(dtype)[:, 2 : 2 + channels]
    else:
        x = torch.randn(num_tokens, channels).to(dtype)
    return x, torch.randn(channels, kernel)


CONV_CASES = {
    "mixed": ([5, 1, 9, 2], 6, 4),
    "model_size": ([40, 3, 77], 3072, 4),
    "with_empty": ([0, 2, 0, 6], 67, 4),
    "kernel_2": ([4, 1, 3], 19, 2),
}


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_matches_reference(case, dtype) -> None:
    lens, channels, kernel = CONV_CASES[case]
    x, weight = conv_inputs(sum(lens), channels, kernel, dtype, strided=True)
    slots, num_slots = shuffled_slots(len(lens))
    state = torch.randn(num_slots, channels, kernel - 1).to(dtype)
    state_ref = state.clone()
    common = dict(
        query_start_loc=qsl_of(lens),
        state_indices=slots,
        has_initial_state=torch.tensor([i % 3 != 1 for i in range(len(lens))]),
    )
    y = cpu_ext.causal_conv1d(x, weight, state, **common)
    y_ref = conv.causal_conv1d(x, weight, state_ref, **common)
    tol = (
        1e-4 if dtype == torch.float32 else 1e-2
    )  # bf16: the same fp32 sum rounded, one step apart
    close(y, y_ref, tol)
    assert torch.equal(state, state_ref)  # inputs move into the state unchanged


@pytest.mark.parametrize("batch", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_matches_reference(batch, dtype) -> None:
    x, weight = conv_inputs(batch, 3072, 4, dtype, strided=True)
    slots, num_slots = shuffled_slots(batch)
    state = torch.randn(num_slots, 3072, 3).to(dtype)
    state_ref = state.clone()
    y = cpu_ext.causal_conv1d_update(x, weight, state, slots)
    y_ref = conv.causal_conv1d_update(x, weight, state_ref, slots)
    close(y, y_ref, 1e-4 if dtype == torch.float32 else 1e-2)
    assert torch.equal(state, state_ref)


def test_conv_decode_continues_a_prefill() -> None:
    x, weight = conv_inputs(12, 10, 4)
    state, one = torch.zeros(2, 10, 3), torch.zeros(2, 10, 3)
    slot = torch.tensor([1])
    ys = [
        cpu_ext.causal_conv1d(
            x[:9],
            weight,
            state,
            query_start_loc=torch.tensor([0, 9]),
            state_indices=slot,
            has_initial_state=torch.tensor([False]),
        )
    ]
    ys += [cpu_ext.causal_conv1d_update(x[t : t + 1], weight, state, slot) for t in range(9, 12)]
    y_one = conv.causal_conv1d(
        x,
        weight,
        one,
        query_start_loc=torch.tensor([0, 12]),
        state_indices=slot,
        has_initial_state=torch.tensor([False]),
    )
    close(torch.cat(ys), y_one)
    assert torch.equal(state, one)


def test_conv_other_dtypes_use_the_reference() -> None:
    x, weight = conv_inputs(3, 8, 4, torch.float64)
    state = torch.randn(4, 8, 3, dtype=torch.float64)
    state_ref = state.clone()
    y = cpu_ext.causal_conv1d_update(x, weight, state, torch.tensor([3, 0, 2]))
    assert torch.equal(y, conv.causal_conv1d_update(x, weight, state_ref, torch.tensor([3, 0, 2])))
    assert torch.equal(state, state_ref)


def test_cpu_ops_use_the_compiled_linear_attention() -> None:
    ops = kernels.get_ops("cpu")
    assert ops.causal_conv1d is cpu_ext.causal_conv1d
    assert ops.causal_conv1d_update is cpu_ext.causal_conv1d_update
    assert ops.chunk_gated_delta_rule is cpu_ext.chunk_gated_delta_rule
    assert ops.recurrent_gated_delta_rule is cpu_ext.recurrent_gated_delta_rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_heads,v_heads,dk,dv,tokens", [(3, 3, 64, 64, 1), (2, 4, 128, 96, 7)])
def test_delta_rule_inputs_match_reference(dtype, k_heads, v_heads, dk, dv, tokens) -> None:
    """Normalised q and k (each key head repeated for its value heads), the decay and write
    gates, from slices of the fused projections as the model passes them."""
    conv_dim = 2 * k_heads * dk + v_heads * dv
    mixed = (torch.randn(tokens, conv_dim + 5) * 3).to(dtype)[:, 5:]  # strided rows
    gates = (torch.randn(tokens, 2 * v_heads + 9) * 8).to(dtype)
    gates[0, 9] = 30.0  # softplus past its threshold: the identity
    a, b = gates[:, 9 : 9 + v_heads], gates[:, 9 + v_heads :]
    A_log, dt_bias = torch.randn(v_heads).to(dtype), torch.randn(v_heads).to(dtype)
    heads = dict(num_k_heads=k_heads, head_k_dim=dk, num_v_heads=v_heads)
    got = cpu_ext.gated_delta_net_inputs(mixed, a, b, A_log, dt_bias, **heads)
    want = delta_rule.gated_delta_net_inputs(mixed, a, b, A_log, dt_bias, **heads)
    for g, w in zip(got, want):
        assert g.is_contiguous()
        close(g, w, 1e-6 if dtype == torch.float32 else 8e-3)
    q, k, g, beta = got
    assert q.shape == k.shape == (tokens, v_heads, dk) and q.dtype == dtype
    assert g.dtype == beta.dtype == torch.float32 and g.shape == (tokens, v_heads)
    assert kernels.get_ops("cpu").gated_delta_net_inputs is cpu_ext.gated_delta_net_inputs


def test_delta_rule_inputs_reject_bad_head_counts() -> None:
    mixed, gates = torch.randn(2, 3 * 64 + 64), torch.randn(2, 3)
    with pytest.raises(ValueError, match="must be a positive multiple of num_k_heads"):
        cpu_ext.gated_delta_net_inputs(
            mixed, gates, gates, torch.zeros(3), torch.zeros(3),
            num_k_heads=2, head_k_dim=32, num_v_heads=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"a must be a cpu tensor \[2, 4\]"):
        cpu_ext.gated_delta_net_inputs(
            mixed, gates, gates, torch.zeros(4), torch.zeros(4),
            num_k_heads=2, head_k_dim=32, num_v_heads=4,
        )  # fmt: skip
