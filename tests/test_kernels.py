"""Reference kernels against naive float64 oracles on random inputs."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import attention
from kernels.ops import REFERENCE_OPS

ops = kernels.get_ops("cpu")


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# --- registry --------------------------------------------------------------------------------


def test_get_ops_picks_reference_for_cpu_and_cuda() -> None:
    from kernels import activation, conv, cpu_ext, delta_rule, linear, norm, rotary

    cpu = kernels.get_ops("cpu")
    assert cpu is kernels.get_ops(torch.device("cpu"))  # chosen once
    # bf16 on AMX, fp32 on AVX-512, the rest on oneDNN (test_kernels_{amx,fp32}_linear)
    if cpu_ext.amx_linear_available() or cpu_ext.fp32_linear_available():
        assert (cpu.linear, cpu.pack_linear_weight) == (cpu_ext.linear, cpu_ext.pack_linear_weight)
    else:
        assert cpu.linear is (linear.onednn_linear if linear.onednn_available() else linear.linear)
    # only the matmuls and the compiled kernels differ (tests/test_kernels_cpu_ext.py)
    reference_parts = dict(
        linear=linear.linear,
        pack_linear_weight=linear.keep_weight,
        paged_attention=attention.paged_attention,
        paged_attention_decode=attention.paged_attention_decode,
        rms_norm=norm.rms_norm,
        add_rms_norm=norm.add_rms_norm,
        gated_rms_norm=norm.gated_rms_norm,
        write_kv=attention.write_kv,
        silu_and_mul=activation.silu_and_mul,
        rotary=rotary.rotary,
        qk_norm_rotary=rotary.qk_norm_rotary,
        causal_conv1d=conv.causal_conv1d,
        causal_conv1d_update=conv.causal_conv1d_update,
        chunk_gated_delta_rule=delta_rule.chunk_gated_delta_rule,
        recurrent_gated_delta_rule=delta_rule.recurrent_gated_delta_rule,
        gated_delta_net_inputs=delta_rule.gated_delta_net_inputs,
    )
    assert dataclasses.replace(cpu, **reference_parts) == REFERENCE_OPS
    assert (cpu.paged_attention_decode is cpu_ext.paged_attention_decode) == (
        cpu_ext.build() is None
    )
    assert kernels.get_ops(torch.device("cuda", 1)) is REFERENCE_OPS
    assert {f.name for f in dataclasses.fields(kernels.Ops)} == {
        "linear", "pack_linear_weight", "silu_and_mul", "rms_norm", "add_rms_norm", "gated_rms_norm",
        "rotary", "qk_norm_rotary", "write_kv", "paged_attention",
        "paged_attention_decode", "causal_conv1d", "causal_conv1d_update",
        "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_net_inputs",
    }  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops.rms_norm = None  # type: ignore[misc]
    with pytest.raises(ValueError, match="supported: cpu, cuda, npu"):
        kernels.get_ops("meta")


# --- projections -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 256), (37, 256), (2, 20, 256), (0, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_unpacked_weights_stay_on_f_linear_at_every_row_count(shape, bias, monkeypatch) -> None:
    """A weight `pack_weight` left as it is (too small, or another dtype) never reaches oneDNN,
    whose primitive per new row count made a prefill of each new prompt length compile."""
    from kernels import linear

    if not linear.onednn_available():
        pytest.skip("this torch has no oneDNN matmul")
    calls = []

    class Counting:  # torch.ops namespaces cannot be patched attribute by attribute
        @staticmethod
        def _linear_pointwise(*args):
            calls.append(args[0].shape)
            raise AssertionError("an unpacked weight reached oneDNN")

    monkeypatch.setattr(torch.ops, "mkldnn", Counting)
    w, b = torch.randn(512, 256), torch.randn(512) if bias else None
    x = torch.randn(*shape)
    assert torch.equal(linear.onednn_linear(x, w, b), linear.linear(x, w, b))
    strided = torch.randn(*shape[:-1], 512)[..., ::2]  # a view, not contiguous
    assert torch.equal(linear.onednn_linear(strided, w, b), linear.linear(strided, w, b))
    xh, wh = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear.onednn_linear(xh, wh), linear.linear(xh, wh))
    x64 = x.double()  # not a oneDNN dtype
    assert linear.onednn_linear(x64, w.double()).dtype == torch.float64
    assert not calls


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_packed_weights_match_and_small_ones_stay(rows) -> None:
    from kernels import linear

    if not linear.onednn_available():
        pytest.skip("this torch has no oneDNN matmul")
    w, b = torch.randn(2048, 1024), torch.randn(2048)
    packed = linear.pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    x = torch.randn(rows, 1024)
    # same fp32 products, another summation order over K=1024
    close(linear.onednn_linear(x, packed, b), linear.linear(x, w, b), tol=1e-4)
    strided = torch.randn(rows, 2048)[:, ::2]  # a view, not contiguous
    close(linear.onednn_linear(strided, packed, b), linear.linear(strided, w, b), tol=1e-4)
    packed_bf16 = linear.pack_weight(w.bfloat16())
    # oneDNN packs bf16 only where it runs bf16 on this CPU; elsewhere F.linear keeps the weight
    assert packed_bf16.is_mkldnn == linear.onednn_bf16_available()
    close(linear.onednn_linear(x.bfloat16(), packed_bf16).float(), linear.linear(x, w), tol=0.3)
    small = torch.randn(64, 256)  # under ONEDNN_MIN_MACS even as a weight: F.linear keeps it
    assert (
        linear.pack_weight(small) is small and linear.pack_weight(w.double()).dtype == torch.float64
    )
    assert linear.keep_weight(w) is w


# --- norms -----------------------------------------------------------------------------------


def naive_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(5, 32), (3, 4, 16)])
@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_rms_norm(shape: tuple[int, ...], offset: float) -> None:
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    close(ops.rms_norm(x, w, 1e-6, offset), naive_rms(x, 1e-6) * (offset + w.double()))
    assert ops.rms_norm(x, w, 1e-6).dtype == torch.float32
    assert ops.rms_norm(x.bfloat16(), w, 1e-6).dtype == torch.bfloat16


def test_rms_norm_default_offset_is_zero_centred() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    close(ops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w + 1.0, 1e-6, offset=0.0))


@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_add_rms_norm(offset: float) -> None:
    x, res, w = torch.randn(6, 24), torch.randn(6, 24), torch.randn(24)
    y, new_res = ops.add_rms_norm(x, res, w, 1e-5, offset)
    close(new_res, x.double() + res.double())
    close(y, naive_rms(x + res, 1e-5) * (offset + w.double()))


def test_gated_rms_norm() -> None:
    x, gate, w = torch.randn(7, 3, 16), torch.randn(7, 3, 16), torch.randn(16)
    gd = gate.double()
    expected = naive_rms(x, 1e-6) * w.double() * gd * torch.sigmoid(gd)
    close(ops.gated_rms_norm(x, gate, w, 1e-6), expected)


# --- rotary ----------------------------------------------------------------------------------


def test_rope_cache_matches_formula() -> None:
    cache = kernels.rope_cache(8, 50, 10000.0)
    assert cache.shape == (50, 8) and cache.dtype == torch.float32
    pos = torch.arange(50, dtype=torch.float64)[:, None]
    theta = pos * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    close(cache, torch.cat((theta.cos(), theta.sin()), -1), tol=1e-4)


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 16), (32, 8), (24, 12)])
def test_rotary_matches_explicit_formula(head_dim: int, rotary_dim: int) -> None:
    base = 1e4
    positions = torch.tensor([0, 5, 3, 99, 17])
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    qr, kr = ops.rotary(positions, q, k, kernels.rope_cache(rotary_dim, 128, base), rotary_dim)
    half = rotary_dim // 2
    inv = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    theta = positions.double()[:, None, None] * inv  # [T, 1, half]
    for x, xr in ((q, qr), (k, kr)):
        xd = x.double()
        a, b = xd[..., :half], xd[..., half:rotary_dim]
        cos, sin = theta.cos(), theta.sin()
        expected = torch.cat((a * cos - b * sin, b * cos + a * sin, xd[..., rotary_dim:]), dim=-1)
        close(xr, expected, tol=1e-4)
        assert xr.shape == x.shape
    assert torch.equal(qr[..., rotary_dim:], q[..., rotary_dim:])


# --- paged KV cache --------------------------------------------------------------------------


def test_write_kv_skips_negative_slots() -> None:
    k_cache, v_cache = torch.randn(5, 4, 2, 8), torch.randn(5, 4, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([13, -1, 2, 19])
    ops.write_kv(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.view(20, 2, 8).clone(), before_v.view(20, 2, 8).clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot], expected_v[slot] = key[i], value[i]
    assert torch.equal(k_cache.view(20, 2, 8), expected_k)
    assert torch.equal(v_cache.view(20, 2, 8), expected_v)


def random_paged_batch(q_lens, kv_lens, num_heads, num_kv_heads, head_dim=16, block_size=4):
    """Random q and caches; each sequence owns random, non-contiguous blocks."""
    blocks_per_seq = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(q_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        q=torch.randn(sum(q_lens), num_heads, head_dim),
        k_cache=torch.randn(cache_shape),
        v_cache=torch.randn(cache_shape),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=table,
    )


def slot_of(block_row: torch.Tensor, position: int, block_size: int) -> int:
    return int(block_row[position // block_size]) * block_size + position % block_size


def naive_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale):
    """Per sequence, per head, per query: softmax over the allowed cached positions (float64)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3]).double()
    flat_v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3]).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, kv_len in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        slots = [slot_of(block_tables[b], p, block_size) for p in range(kv_len)]
        for i in range(q_len):
            position = kv_len - q_len + i
            for h in range(q.shape[1]):
                keys = flat_k[slots[: position + 1], h // group]
                values = flat_v[slots[: position + 1], h // group]
                weights = torch.softmax(keys @ q[starts[b] + i, h].double() * scale, dim=0)
                out[starts[b] + i, h] = weights @ values
    return out


GQA = [(4, 4), (4, 2), (8, 2)]
SCENARIOS = {
    "prefill_from_empty": ([5, 9, 2], [5, 9, 2]),
    "chunked_prefill_over_prefix": ([7, 3], [16, 11]),
    "mixed_decode_and_prefill": ([1, 1, 1, 6, 4], [9, 1, 14, 6, 10]),
}


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_paged_attention(scenario: str, heads: tuple[int, int]) -> None:
    q_lens, kv_lens = SCENARIOS[scenario]
    batch = random_paged_batch(q_lens, kv_lens, *heads)
    scale = 0.3
    q = batch.pop("q")
    out = ops.paged_attention(q, **batch, scale=scale)
    close(out, naive_paged_attention(q, **batch, scale=scale), tol=1e-5)


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_paged_attention_decode_equals_general_path(heads: tuple[int, int]) -> None:
    kv_lens = [1, 13, 4, 8, 21]
    batch = random_paged_batch([1] * 5, kv_lens, *heads)
    q = batch.pop("q")
    general = ops.paged_attention(q, **batch, scale=0.25)
    batch.pop("query_start_loc")
    fast = ops.paged_attention_decode(q, **batch, scale=0.25)
    close(fast, general, tol=1e-6)
    batch["query_start_loc"] = torch.arange(6, dtype=torch.int32)
    close(fast, naive_paged_attention(q, **batch, scale=0.25))


@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_batched_decode_used_off_cpu_matches_oracle(heads: tuple[int, int]) -> None:
    batch = random_paged_batch([1] * 4, [7, 1, 18, 12], *heads)
    q = batch.pop("q")
    out = attention._decode_batched(
        q, batch["k_cache"], batch["v_cache"], batch["seq_lens"], batch["block_tables"], 0.4
    )
    close(out, naive_paged_attention(q, **batch, scale=0.4))


def test_write_kv_then_attend_matches_dense_causal_attention() -> None:
    # A prompt written in two chunks, then attended chunk by chunk, equals one causal pass.
    num_blocks, block_size, length = 6, 4, 10
    k_cache = torch.zeros(num_blocks, block_size, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)
    q, k, v = torch.randn(length, 4, 8), torch.randn(length, 2, 8), torch.randn(length, 2, 8)
    slots = torch.tensor([slot_of(table[0], p, block_size) for p in range(length)])
    outs = []
    for lo, hi in ((0, 6), (6, 10)):
        ops.write_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi])
        outs.append(
            ops.paged_attention(
                q[lo:hi], k_cache, v_cache,
                query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
                seq_lens=torch.tensor([hi], dtype=torch.int32),
                block_tables=table, scale=0.5,
            )
        )  # fmt: skip
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=0.5, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    close(torch.cat(outs), dense)


# --- causal conv1d ---------------------------------------------------------------------------


@pytest.fixture(params=["reference", "cpu"])
def linear_ops(request) -> kernels.Ops:
    """The linear-attention ops of the torch reference and of the CPU table (compiled where it builds)."""
    return REFERENCE_OPS if request.param == "reference" else ops


def naive_conv(x: torch.Tensor, weight: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv) of one sequence x `[L, C]` after left context `[C, K-1]`."""
    full = torch.cat((context.double(), x.double().T), dim=1)  # [C, K-1+L]
    width = weight.shape[1] - 1
    y = torch.stack(
        [(full[:, t : t + width + 1] * weight.double()).sum(-1) for t in range(x.shape[0])]
    )
    return F.silu(y)


def test_causal_conv1d_matches_oracle_and_updates_state(linear_ops) -> None:
    channels, kernel = 6, 4
    lens = [5, 1, 9, 2]
    x, weight = torch.randn(sum(lens), channels), torch.randn(channels, kernel)
    state = torch.randn(8, channels, kernel - 1)
    before = state.clone()
    slots = torch.tensor([6, 0, 3, 5])
    has_init = torch.tensor([True, True, False, True])
    qsl = torch.tensor([0, 5, 6, 15, 17], dtype=torch.int32)
    y = linear_ops.causal_conv1d(
        x, weight, state, query_start_loc=qsl, state_indices=slots, has_initial_state=has_init
    )
    for b, slot in enumerate(slots.tolist()):
        seq = x[qsl[b] : qsl[b + 1]]
        context = before[slot] if has_init[b] else torch.zeros(channels, kernel - 1)
        close(y[qsl[b] : qsl[b + 1]], naive_conv(seq, weight, context))
        history = torch.cat((context, seq.T), dim=1)
        assert torch.equal(state[slot], history[:, -(kernel - 1) :])
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(state[untouched], before[untouched])


def test_causal_conv1d_chunked_equals_one_shot(linear_ops) -> None:
    channels, kernel = 5, 4
    a, b = torch.randn(11, channels), torch.randn(8, channels)  # two sequences
    weight = torch.randn(channels, kernel)
    one = torch.zeros(2, channels, kernel - 1)
    y_one = linear_ops.causal_conv1d(
        torch.cat((a, b)), weight, one,
        query_start_loc=torch.tensor([0, 11, 19]), state_indices=torch.tensor([0, 1]),
        has_initial_state=torch.tensor([False, False]),
    )  # fmt: skip
    split = torch.randn(2, channels, kernel - 1)  # garbage must be ignored on the first chunk
    ys = []
    for (lo_a, hi_a), (lo_b, hi_b), first in (((0, 2), (0, 6), True), ((2, 11), (6, 8), False)):
        ys.append(
            linear_ops.causal_conv1d(
                torch.cat((a[lo_a:hi_a], b[lo_b:hi_b])), weight, split,
                query_start_loc=torch.tensor([0, hi_a - lo_a, hi_a - lo_a + hi_b - lo_b]),
                state_indices=torch.tensor([0, 1]),
                has_initial_state=torch.tensor([not first, not first]),
            )
        )  # fmt: skip
    close(torch.cat((ys[0][:2], ys[1][:9])), y_one[:11], tol=1e-6)
    close(torch.cat((ys[0][2:], ys[1][9:])), y_one[11:], tol=1e-6)
    assert torch.equal(split, one)


def test_causal_conv1d_update_equals_one_token_prefill(linear_ops) -> None:
    channels, kernel = 7, 4
    x, weight = torch.randn(3, channels), torch.randn(channels, kernel)
    state = torch.randn(5, channels, kernel - 1)
    state_prefill = state.clone()
    slots = torch.tensor([4, 1, 2])
    y_update = linear_ops.causal_conv1d_update(x, weight, state, slots)
    y_prefill = linear_ops.causal_conv1d(
        x, weight, state_prefill,
        query_start_loc=torch.arange(4), state_indices=slots,
        has_initial_state=torch.ones(3, dtype=torch.bool),
    )  # fmt: skip
    close(y_update, y_prefill, tol=1e-6)
    assert torch.equal(state, state_prefill)


# --- gated delta rule ------------------------------------------------------------------------


def naive_delta_rule(q, k, v, g, beta, state, scale):
    """Token-by-token recurrence in float64; state `[H, Dk, Dv]`; returns (o, final state)."""
    state = state.double().clone()
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].double().exp()[:, None, None]
        error = v[t].double() - torch.einsum("hk,hkv->hv", k[t].double(), state)
        delta = beta[t].double()[:, None] * error
        state = state + k[t].double()[:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t].double() * scale, state))
    return torch.stack(out) if out else torch.zeros(0, *v.shape[1:], dtype=torch.float64), state


def random_delta_inputs(num_tokens: int, heads: int = 2, dk: int = 16, dv: int = 8):
    q = F.normalize(torch.randn(num_tokens, heads, dk), dim=-1)
    k = F.normalize(torch.randn(num_tokens, heads, dk), dim=-1)
    v = torch.randn(num_tokens, heads, dv)
    g = -F.softplus(torch.randn(num_tokens, heads)) * 0.5
    beta = torch.rand(num_tokens, heads)
    return q, k, v, g, beta


def test_chunk_gated_delta_rule_matches_recurrence_for_packed_lengths(linear_ops) -> None:
    lens = [1, 63, 64, 65, 200]
    q, k, v, g, beta = random_delta_inputs(sum(lens))
    pool = torch.randn(7, 2, 16, 8) * 0.5
    before = pool.clone()
    slots = torch.tensor([3, 0, 6, 1, 4])
    has_init = torch.tensor([True, False, True, True, False])
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    o = linear_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state=pool, query_start_loc=qsl, state_indices=slots,
        has_initial_state=has_init, scale=0.25,
    )  # fmt: skip
    for b, slot in enumerate(slots.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        initial = before[slot] if has_init[b] else torch.zeros(2, 16, 8)
        seq = (t[lo:hi] for t in (q, k, v, g, beta))
        o_ref, s_ref = naive_delta_rule(*seq, initial, 0.25)
        close(o[lo:hi], o_ref, tol=2e-5)
        close(pool[slot], s_ref, tol=2e-5)
    assert torch.equal(pool[[2, 5]], before[[2, 5]])


def test_chunk_gated_delta_rule_split_across_calls_equals_one_call(linear_ops) -> None:
    q, k, v, g, beta = random_delta_inputs(150)
    one, split = torch.zeros(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    common = dict(state_indices=torch.tensor([0]), scale=0.25)
    o_one = linear_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state=one, query_start_loc=torch.tensor([0, 150]),
        has_initial_state=torch.tensor([False]), **common,
    )  # fmt: skip
    parts = []
    for lo, hi, has_init in ((0, 70, False), (70, 150, True)):
        parts.append(
            linear_ops.chunk_gated_delta_rule(
                q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], ssm_state=split,
                query_start_loc=torch.tensor([0, hi - lo]),
                has_initial_state=torch.tensor([has_init]), **common,
            )
        )  # fmt: skip
    close(torch.cat(parts), o_one, tol=1e-5)
    close(split, one, tol=1e-5)


def test_recurrent_gated_delta_rule_matches_recurrence_and_chunk_form(linear_ops) -> None:
    q, k, v, g, beta = random_delta_inputs(3)
    pool = torch.randn(5, 2, 16, 8)
    pool_chunk, before = pool.clone(), pool.clone()
    slots = torch.tensor([2, 4, 0])
    o = linear_ops.recurrent_gated_delta_rule(
        q, k, v, g, beta, ssm_state=pool, state_indices=slots, scale=0.3
    )
    for b, slot in enumerate(slots.tolist()):
        token = (t[b : b + 1] for t in (q, k, v, g, beta))
        o_ref, s_ref = naive_delta_rule(*token, before[slot], 0.3)
        close(o[b], o_ref[0])
        close(pool[slot], s_ref)
    o_chunk = linear_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state=pool_chunk, query_start_loc=torch.arange(4),
        state_indices=slots, has_initial_state=torch.ones(3, dtype=torch.bool), scale=0.3,
    )  # fmt: skip
    close(o, o_chunk, tol=1e-6)
    close(pool, pool_chunk, tol=1e-6)


def test_delta_rule_keeps_input_dtype_and_fp32_state(linear_ops) -> None:
    q, k, v, g, beta = (t.bfloat16() for t in random_delta_inputs(70))
    pool = torch.zeros(1, 2, 16, 8)
    o = linear_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state=pool, query_start_loc=torch.tensor([0, 70]),
        state_indices=torch.tensor([0]), has_initial_state=torch.tensor([False]), scale=0.25,
    )  # fmt: skip
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32
    o_ref, s_ref = naive_delta_rule(q, k, v, g, beta, torch.zeros(2, 16, 8), 0.25)
    close(o, o_ref, tol=2e-2)
    close(pool[0], s_ref, tol=1e-4)
