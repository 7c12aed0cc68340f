"""The compiled CPU decode attention (kernels/csrc) against the torch reference."""

import functools
import math

import pytest
import torch

import kernels
from kernels import attention, cpu_ext
from kernels.ops import REFERENCE_OPS


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    # a machine that runs the tests has a compiler: a failed build is a failure, not a skip
    error = cpu_ext.build()
    assert error is None, f"building the CPU kernels failed: {error}"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def decode_batch(kv_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32):
    """Random q and caches; each sequence owns random, shuffled blocks of a larger pool."""
    blocks_per_seq = [math.ceil(n / block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks)
    table = torch.full((len(kv_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return dict(
        q=torch.randn(len(kv_lens), num_heads, head_dim).to(dtype),
        k_cache=torch.randn(shape).to(dtype),
        v_cache=torch.randn(shape).to(dtype),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=table,
    )


def both(batch, scale=0.125):
    compiled = cpu_ext.paged_attention_decode(**batch, scale=scale)
    reference = attention.paged_attention_decode(**batch, scale=scale)
    assert compiled.shape == reference.shape and compiled.dtype == reference.dtype
    return compiled, reference


LENGTHS = {
    "one_token": [1],
    "block_aligned": [32, 64],
    "unaligned": [17, 5, 63],
    "long": [600, 613],
    "mixed_37": [1 + (i * 53) % 300 for i in range(37)],
}
HEADS = [(8, 8), (8, 4), (16, 4), (16, 2)]  # GQA ratios 1, 2, 4, 8


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_fp32(lengths, heads, head_dim, block_size) -> None:
    compiled, reference = both(decode_batch(LENGTHS[lengths], *heads, head_dim, block_size))
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


SCORES = {"widened_keys": 0, "bf16_dot": 1}  # attention_bf16_dot_scores' choices


@pytest.fixture(params=list(SCORES))
def bf16_scores(request):
    """Each way the vector path takes bf16 scores, whichever this CPU would pick."""
    choose = torch.ops.splittts_kernels.attention_bf16_dot_scores
    taken = choose(SCORES[request.param])
    if request.param == "bf16_dot" and not taken:
        choose(-1)
        pytest.skip("this CPU or build has no AVX-512 BF16")
    yield request.param
    choose(-1)


def test_bf16_scores_take_the_dot_products_where_the_cpu_runs_them_fast() -> None:
    # AMD's cores run vdpbf16ps at twice their fp32 multiply-add rate, Intel's at a quarter
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    expected = amd and torch.cpu._is_avx512_bf16_supported()
    assert torch.ops.splittts_kernels.attention_bf16_dot_scores(-1) == expected
    with pytest.raises(ValueError, match="choice must be -1, 0, 1 or 2, got 5"):
        torch.ops.splittts_kernels.attention_bf16_dot_scores(5)


@pytest.mark.parametrize("lengths", ["one_token", "unaligned", "long", "mixed_37"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference_bf16(lengths, heads, head_dim, block_size, bf16_scores) -> None:
    """bf16 caches: head sizes 64 and 128 take the vector path where the CPU has AVX-512 (rows
    widened as even and odd values, outputs put back in order; scores either from the keys
    widened to fp32 or from bf16 dot products of the keys as they lie), 80 the scalar one; every
    GQA ratio; blocks of one and of two 16-token vectors."""
    batch = decode_batch(LENGTHS[lengths], *heads, head_dim, block_size, torch.bfloat16)
    compiled, reference = both(batch)
    # both round the same fp32-accumulated result to bf16 (reference: SDPA's own kernel)
    torch.testing.assert_close(compiled.float(), reference.float(), rtol=2e-2, atol=2e-2)
    # and to within bf16 rounding of attention done in fp64 on the same bf16 inputs
    exact = attention.paged_attention_decode(
        **{k: v.double() if v.is_floating_point() else v for k, v in batch.items()}, scale=0.125
    )
    torch.testing.assert_close(compiled.double(), exact, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("head_dim", [8, 40, 72])  # below, between and above vector widths
def test_decode_head_sizes_off_the_vector_width(head_dim) -> None:
    compiled, reference = both(decode_batch([3, 40, 19], 4, 2, head_dim, 16))
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


def test_decode_large_scores_and_row_slices() -> None:
    # large logits exercise the running-max rescaling; a row slice of a larger table and a
    # non-contiguous q (a slice of heads) are accepted as the model passes them
    batch = decode_batch([70, 9, 130, 48], 8, 2, 64, 16)
    batch["q"] = torch.randn(4, 16, 64)[:, ::2] * 30
    table = batch["block_tables"]
    batch["block_tables"] = torch.cat([table, torch.zeros_like(table)], dim=1)[:, : table.shape[1]]
    compiled, reference = both(batch, scale=0.5)
    torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_same_result_for_any_thread_count(threads) -> None:
    batch = decode_batch([5, 200, 33, 1, 90], 16, 8, 64, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = cpu_ext.paged_attention_decode(**batch, scale=0.2)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(
        out, attention.paged_attention_decode(**batch, scale=0.2), rtol=1e-5, atol=1e-5
    )


def test_empty_batch() -> None:
    batch = decode_batch([4], 4, 2, 64, 16)
    for name in ("q", "seq_lens", "block_tables"):
        batch[name] = batch[name][:0]
    assert cpu_ext.paged_attention_decode(**batch, scale=0.1).shape == (0, 4, 64)


def test_other_dtypes_use_the_reference() -> None:
    batch = {
        k: v.double() if v.is_floating_point() else v
        for k, v in decode_batch([7, 20], 4, 2, 64, 16).items()
    }
    out = cpu_ext.paged_attention_decode(**batch, scale=0.3)
    assert out.dtype == torch.float64
    assert torch.equal(out, attention.paged_attention_decode(**batch, scale=0.3))


def test_mixed_paged_attention_routes_single_tokens_to_the_compiled_decode(monkeypatch) -> None:
    calls = []
    compiled = cpu_ext.paged_attention_decode

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return compiled(*args, **kwargs)

    monkeypatch.setattr(cpu_ext, "paged_attention_decode", counting)
    q_lens = [1, 4, 1, 1, 3]
    batch = decode_batch([9, 12, 1, 30, 3], 8, 2, 64, 16)
    batch["q"] = torch.randn(sum(q_lens), 8, 64)
    batch["query_start_loc"] = torch.tensor([0, 1, 5, 6, 7, 10], dtype=torch.int32)
    out = cpu_ext.paged_attention(**batch, scale=0.3)
    assert calls == [3]
    torch.testing.assert_close(
        out, attention.paged_attention(**batch, scale=0.3), rtol=1e-5, atol=1e-5
    )


def test_cpu_ops_use_the_compiled_decode() -> None:
    ops = kernels.get_ops("cpu")
    assert ops.paged_attention_decode is cpu_ext.paged_attention_decode
    assert ops.paged_attention is cpu_ext.paged_attention
    assert REFERENCE_OPS.paged_attention_decode is attention.paged_attention_decode
    assert REFERENCE_OPS.paged_attention is attention.paged_attention


def test_build_failure_falls_back_to_the_reference(monkeypatch, caplog) -> None:
    from kernels import ops as ops_module

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    monkeypatch.setattr(cpu_ext, "build", functools.cache(cpu_ext.build.__wrapped__))
    with caplog.at_level("WARNING", logger="kernels.cpu_ext"):
        fallbacks = [ops_module.cpu_ops(), ops_module.cpu_ops()]
    for fallback in fallbacks:
        assert fallback.paged_attention_decode is attention.paged_attention_decode
        assert fallback.paged_attention is attention.paged_attention
    assert len(caplog.records) == 1 and "no compiler" in caplog.text  # logged once


def int32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# case: (argument, how it is spoilt, error type, message)
BAD_INPUTS = {
    "q_2d": ("q", lambda t: t[0], ValueError, r"q must be \[batch, num_heads, head_dim\]"),
    "k_cache_3d": ("k_cache", lambda t: t[0], ValueError, r"k_cache must be \[num_blocks"),
    "v_cache_shape": ("v_cache", lambda t: t[:, :8], ValueError, "v_cache shape"),
    "head_dim": ("q", lambda t: t[:, :, :32].contiguous(), ValueError, "head_dim 32 differs"),
    "num_heads": (
        "q",
        lambda t: t[:, :7].contiguous(),
        ValueError,
        "num_heads 7 is not a multiple",
    ),
    "seq_lens_shape": ("seq_lens", lambda t: t[:1], ValueError, r"seq_lens must be \[batch\]"),
    "block_tables_1d": ("block_tables", lambda t: t[0], ValueError, "block_tables must be"),
    "seq_len_zero": ("seq_lens", lambda t: int32(5, 0), ValueError, r"seq_lens\[1\] = 0"),
    "seq_len_past_table": (
        "seq_lens",
        lambda t: int32(5, 1000),
        ValueError,
        r"seq_lens\[1\] = 1000",
    ),
    "block_out_of_range": ("block_tables", lambda t: t + 1000, ValueError, r"block_tables\[0, 0\]"),
    "q_dtype": ("q", lambda t: t.half(), TypeError, "q must be float32 or bfloat16"),
    "cache_dtype": ("k_cache", lambda t: t.bfloat16(), TypeError, "must have q's dtype"),
    "seq_lens_dtype": ("seq_lens", lambda t: t.long(), TypeError, "seq_lens must be int32"),
    "block_tables_dtype": (
        "block_tables",
        lambda t: t.long(),
        TypeError,
        "block_tables must be int32",
    ),
    "cache_strided": (
        "k_cache",
        lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
        RuntimeError,
        "must be contiguous",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(case) -> None:
    name, spoil, error, message = BAD_INPUTS[case]
    args = decode_batch([5, 20], 8, 2, 64, 16)
    args[name] = spoil(args[name])
    with pytest.raises(error, match=message):
        torch.ops.splittts_kernels.paged_attention_decode(
            args["q"], args["k_cache"], args["v_cache"], args["seq_lens"], args["block_tables"], 0.1
        )


def test_python_entry_reports_wrong_dims() -> None:
    batch = decode_batch([5], 8, 2, 64, 16)
    batch["q"] = batch["q"][0]
    with pytest.raises(ValueError, match=r"q must be \[batch, num_heads, head_dim\]"):
        cpu_ext.paged_attention_decode(**batch, scale=0.1)


# --- row kernels: RMS norms and SiLU-and-multiply ---------------------------------------------

ROW_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=0.07, rtol=0.02)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 1024), (2048, 96), (3, 5, 128)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norms_match_reference(dtype, shape, offset) -> None:
    from kernels import norm

    x = (torch.randn(shape) * 3).to(dtype)
    residual = torch.randn(shape).to(dtype)
    weight = (torch.randn(shape[-1]) * 0.1).to(dtype)
    torch.testing.assert_close(
        cpu_ext.rms_norm(x, weight, 1e-6, offset),
        norm.rms_norm(x, weight, 1e-6, offset),
        **ROW_TOL[dtype],
    )
    y, new_residual = cpu_ext.add_rms_norm(x, residual, weight, 1e-6, offset)
    ref_y, ref_residual = norm.add_rms_norm(x, residual, weight, 1e-6, offset)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # same rounding
    torch.testing.assert_close(y, ref_y, **ROW_TOL[dtype])


def test_rms_norm_of_a_strided_view_and_an_fp32_weight_on_bf16() -> None:
    from kernels import norm

    qkv = torch.randn(6, 3 * 8 * 64)
    q = qkv[:, : 8 * 64].view(6, 8, 64)  # rows of a fused projection: not contiguous
    weight = torch.randn(64)
    torch.testing.assert_close(
        cpu_ext.rms_norm(q, weight, 1e-6, 1.0),
        norm.rms_norm(q, weight, 1e-6, 1.0),
        **ROW_TOL[torch.float32],
    )
    xb = torch.randn(4, 64).bfloat16()
    torch.testing.assert_close(
        cpu_ext.rms_norm(xb, weight, 1e-6, 1.0),
        norm.rms_norm(xb, weight, 1e-6, 1.0),
        **ROW_TOL[torch.bfloat16],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2), (64, 4608), (3, 7, 34)])
def test_silu_and_mul_matches_reference(dtype, shape) -> None:
    from kernels import activation

    x = (torch.randn(shape) * 6).to(dtype)  # large |gate| too: the sigmoid must not overflow
    x.view(-1)[0] = -100.0
    torch.testing.assert_close(
        cpu_ext.silu_and_mul(x), activation.silu_and_mul(x), **ROW_TOL[dtype]
    )


def test_bf16_outputs_round_as_torch_does() -> None:
    """The row kernels compute in fp32 and round to bf16 without c10's branches (so the loops
    vectorise): the bf16 output is exactly the fp32 kernel's output rounded by torch, for
    halfway cases (to even), overflow to inf, NaN and subnormals."""
    up = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, float("nan"), 1e-40, 0.0, -0.0],
        dtype=torch.float32,
    )
    up = torch.cat([up, torch.randn(1000) * 50])
    gate = torch.full_like(up, 30.0)  # silu(30) = 30 to fp32 precision: products near `up * 30`
    x = torch.cat([gate, up])[None]
    exact = cpu_ext.silu_and_mul(x)  # fp32
    as_bf16 = cpu_ext.silu_and_mul(x.to(torch.bfloat16).float())  # the bf16 inputs, in fp32
    got = cpu_ext.silu_and_mul(x.to(torch.bfloat16))
    want = as_bf16.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan[0, 4]  # a NaN's payload may differ
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.isinf(got[0, 3]) and exact.isfinite()[0, 0]


def test_row_kernels_are_the_cpu_ops_and_reject_bad_shapes() -> None:
    cpu = kernels.get_ops("cpu")
    assert (cpu.rms_norm, cpu.add_rms_norm, cpu.silu_and_mul) == (
        cpu_ext.rms_norm,
        cpu_ext.add_rms_norm,
        cpu_ext.silu_and_mul,
    )
    with pytest.raises(ValueError, match="weight must be"):
        cpu_ext.rms_norm(torch.randn(4, 64), torch.randn(32), 1e-6, 1.0)
    with pytest.raises(ValueError, match="last dim must be even"):
        cpu_ext.silu_and_mul(torch.randn(4, 7))
    # other dtypes and mixed inputs keep the reference
    x64 = torch.randn(3, 8, dtype=torch.float64)
    assert cpu_ext.silu_and_mul(x64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 32), (80, 80)])
def test_rotary_matches_reference(dtype, head_dim, rotary_dim) -> None:
    from kernels import rotary

    cache = kernels.rope_cache(rotary_dim, 600, 10000.0)
    positions = torch.tensor([0, 599, 17, 17, 300])
    qkv = torch.randn(5, (8 + 2 + 2) * head_dim).to(dtype)
    q = qkv[:, : 8 * head_dim].view(5, 8, head_dim)  # strided rows, as split from a fused matmul
    k = qkv[:, 8 * head_dim : 10 * head_dim].view(5, 2, head_dim)
    got = cpu_ext.rotary(positions, q, k, cache, rotary_dim)
    want = rotary.rotary(positions, q, k, cache, rotary_dim)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **ROW_TOL[dtype])
    assert kernels.get_ops("cpu").rotary is cpu_ext.rotary
    with pytest.raises(ValueError, match="outside the cos/sin table"):
        cpu_ext.rotary(torch.tensor([0, 1, 2, 3, 600]), q, k, cache, rotary_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(3, 1, 64, 32), (8, 2, 128, 128)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("gated", [False, True])
def test_qk_norm_rotary_matches_reference(
    dtype, heads, kv_heads, head_dim, rotary_dim, offset, gated
) -> None:
    """Per-head norms then rotary in one pass, on q and k as a fused projection leaves them:
    rows strided, and for Qwen3.5 each query head's half of a [q | gate] row."""
    from kernels import rotary

    cache = kernels.rope_cache(rotary_dim, 600, 10000.0)
    positions = torch.tensor([0, 599, 17, 17, 300])
    q_width = heads * head_dim * (2 if gated else 1)
    qkv = (torch.randn(5, q_width + 2 * kv_heads * head_dim) * 4).to(dtype)
    q = qkv[:, :q_width].view(5, heads, -1)[..., :head_dim]
    k = qkv[:, q_width : q_width + kv_heads * head_dim].view(5, kv_heads, head_dim)
    q_weight, k_weight = torch.randn(head_dim) * 0.3, torch.randn(head_dim) * 0.3
    args = (positions, q, k, q_weight.to(dtype), k_weight.to(dtype), cache, rotary_dim)
    got = cpu_ext.qk_norm_rotary(*args, eps=1e-6, offset=offset)
    want = rotary.qk_norm_rotary(*args, eps=1e-6, offset=offset)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.dtype == dtype
        torch.testing.assert_close(g, w, **ROW_TOL[dtype])
    assert kernels.get_ops("cpu").qk_norm_rotary is cpu_ext.qk_norm_rotary
    with pytest.raises(ValueError, match="weight must be"):
        cpu_ext.qk_norm_rotary(*args[:3], q_weight[:8], *args[4:], eps=1e-6, offset=offset)
    with pytest.raises(ValueError, match="outside the cos/sin table"):
        cpu_ext.qk_norm_rotary(torch.tensor([0, 1, 2, 3, 600]), *args[1:], eps=1e-6, offset=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 3, 64), (37, 4, 128), (5, 1, 48)])
def test_gated_rms_norm_matches_reference(dtype, tokens, heads, dim) -> None:
    from kernels import norm

    x = (torch.randn(tokens, heads, dim) * 3).to(dtype)
    proj = (torch.randn(tokens, heads * dim + 7) * 4).to(dtype)
    gate = proj[:, 7:].view(tokens, heads, dim)  # a slice of the fused input projection
    gate[0, 0, 0] = -100.0  # the sigmoid inside SiLU must not overflow
    weight = torch.randn(dim).to(dtype)
    got = cpu_ext.gated_rms_norm(x, gate, weight, 1e-6)
    torch.testing.assert_close(got, norm.gated_rms_norm(x, gate, weight, 1e-6), **ROW_TOL[dtype])
    assert kernels.get_ops("cpu").gated_rms_norm is cpu_ext.gated_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype) -> None:
    """New keys and values land in their slots bit for bit; negative slots are skipped and
    nothing else in the caches changes."""
    shape = (6, 16, 2, 64)
    caches = [torch.randn(shape).to(dtype) for _ in range(2)]
    compiled = [c.clone() for c in caches]
    kv = torch.randn(7, 3 * 2 * 64).to(dtype)
    key, value = kv[:, :128].view(7, 2, 64), kv[:, 128:256].view(7, 2, 64)  # strided rows
    slots = torch.tensor([3, -1, 17, 95, 0, 40, -1])
    attention.write_kv(key, value, *caches, slots)
    cpu_ext.write_kv(key, value, *compiled, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, compiled))
    assert kernels.get_ops("cpu").write_kv is cpu_ext.write_kv
    with pytest.raises(ValueError, match="is outside the cache of 96 slots"):
        cpu_ext.write_kv(key, value, *compiled, torch.tensor([0, 1, 2, 3, 4, 5, 96]))
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int64"):
        cpu_ext.write_kv(key, value, *compiled, slots[:3])


def channels_last(*shape: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(*shape)
    x[0, 0, 0, :4] = torch.tensor([float("nan"), -0.0, 0.0, -3.0])[: shape[-1]]
    return x.to(dtype).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,channels,head,new", [(1, 32, 10, 8192), (3, 64, 2, 33), (2, 1, 1, 5)]
)
def test_channels_last_join_equals_torch(dtype, batch, channels, head, new) -> None:
    """A vocoder layer's carried input joined to its new input through a leaky ReLU, of
    `[B, C, 1, T]` channels-last tensors, and the join's tail that the layer carries on: torch's
    values (the same rounding to bf16, NaN aside) in channels-last layout, the tail in storage of
    its own, with a carried part that is a slice of a longer tensor and lengths off the vector
    width."""
    first = channels_last(batch, channels, 1, head + 7, dtype=dtype)[..., 7:]
    then = channels_last(batch, channels, 1, new, dtype=dtype)
    for slope, keep in ((0.1, 6), (None, 0), (0.1, head + new + 5)):
        joined, tail = cpu_ext.join_channels_last(first, then, slope, keep)
        act = then if slope is None else torch.nn.functional.leaky_relu(then, slope)
        want = torch.cat([first, act], -1)
        assert torch.equal(joined.nan_to_num(), want.nan_to_num())
        assert joined.isnan().sum() == want.isnan().sum()
        assert joined.is_contiguous(memory_format=torch.channels_last)
        assert_own_copy(tail, want[..., want.shape[-1] - min(keep, want.shape[-1]) :])


def assert_own_copy(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` equals `want` (NaN aside), channels last, in storage no larger than itself."""
    assert got.shape == want.shape
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    assert got.shape[1] == 1 or got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,channels,head,new", [(1, 32, 10, 8192), (3, 64, 2, 33), (2, 1, 1, 5)]
)
def test_residual_sum_over_a_join_equals_torch(dtype, batch, channels, head, new) -> None:
    """`t += cat([first, then])[..., :T]` in place, the join never made: torch's values and
    rounding, t's storage kept, with the carried part a slice of a longer tensor, T shorter than
    the join, and lengths off the vector width."""
    first = channels_last(batch, channels, 1, head + 7, dtype=dtype)[..., 7:]
    then = channels_last(batch, channels, 1, new, dtype=dtype)
    for length in (head + new, head + new - 3, max(1, head - 1)):
        t = channels_last(batch, channels, 1, length, dtype=dtype)
        want = torch.cat([first, then], -1)[..., :length] + t
        ptr = t.data_ptr()
        got, rest = cpu_ext.add_joined_(t, first, then)
        assert got.data_ptr() == ptr and got is t
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert got.isnan().sum() == want.isnan().sum()
        assert_own_copy(rest, torch.cat([first, then], -1)[..., length:])
    with pytest.raises(ValueError, match="fewer than the"):
        cpu_ext.add_joined_(
            channels_last(batch, channels, 1, head + new + 1, dtype=dtype), first, then
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,channels,new", [(1, 32, 8192), (3, 64, 33), (2, 1, 5)])
def test_mean_of_joins_equals_torch(dtype, batch, channels, new) -> None:
    """A stage's residual blocks averaged, each with the samples it ran ahead last call: torch's
    sum-then-divide, bit for bit, over joins with empty, short and long carried parts."""
    heads = [0, 3, 17]
    firsts = [channels_last(batch, channels, 1, h, dtype=dtype) for h in heads]
    thens = [channels_last(batch, channels, 1, new + 17 - h, dtype=dtype) for h in heads]
    for length in (new, new + 17, 1):
        got, rests = cpu_ext.mean_joined(firsts, thens, length)
        parts = [torch.cat([f, t], -1)[..., :length] for f, t in zip(firsts, thens)]
        want = (parts[0] + parts[1] + parts[2]) / 3
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert got.is_contiguous(memory_format=torch.channels_last)
        for rest, f, t in zip(rests, firsts, thens, strict=True):
            assert_own_copy(rest, torch.cat([f, t], -1)[..., length:])
    with pytest.raises(ValueError, match="one length"):
        torch.ops.splittts_kernels.mean_joined(firsts, thens[:2], new)


def test_channels_last_join_of_plain_tensors_uses_torch() -> None:
    first, then = torch.randn(2, 8, 1, 3), torch.randn(2, 8, 1, 5)  # plain layout
    joined, tail = cpu_ext.join_channels_last(first, then, 0.2, 3)
    assert torch.equal(joined, torch.cat([first, torch.nn.functional.leaky_relu(then, 0.2)], -1))
    assert joined.is_contiguous(memory_format=torch.channels_last)
    assert_own_copy(tail, joined[..., -3:])
    with pytest.raises(ValueError, match="channels-last layout"):
        torch.ops.splittts_kernels.join_channels_last(first, then, 0.2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "strided"])
def test_quantize_u8_equals_torch(dtype, layout) -> None:
    """An activation rounded to uint8 for an int8 convolution: torch's affine rounding (half to
    even, clamped to [0, 255]) in the input's layout, lengths off the vector width, through the
    compiled kernel (dense inputs) or the reference (a slice)."""
    scale, zero_point = 0.25, 37  # a power of two: the ties below are exact
    x = torch.randn(2, 48, 1, 1037) * 20
    x[0, 0, 0, :6] = torch.tensor([2.5, 3.5, -1.85, 300.0, -100.0, 0.0]) * scale
    x = x.to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[..., 3:]
    got = cpu_ext.quantize_u8(x, scale, zero_point)
    want = (torch.round(x.float() * (1 / scale)) + zero_point).clamp(0, 255).to(torch.uint8)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    if layout == "channels_last":
        assert got.is_contiguous(memory_format=torch.channels_last)
    # ties go to even, the extremes clamp, 0 lands exactly on the zero point
    assert got[0, 0, 0, :6].tolist() == [39, 41, 35, 255, 0, 37] or layout == "strided"
    with pytest.raises(ValueError, match="need scale > 0 and zero_point in"):
        torch.ops.splittts_kernels.quantize_u8(x.contiguous(), scale, 256)


def test_a_copy_of_the_sources_elsewhere_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """A checkout and a worktree of the same commit: the build file names the sources by path,
    so sharing one folder made each start rebuild over the other's binary."""
    import shutil

    here = cpu_ext._cpu_tag()
    assert cpu_ext._cpu_tag() == here  # the same copy keeps its folder
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ext._CSRC, copy)
    monkeypatch.setattr(cpu_ext, "_SOURCES", [copy / p.name for p in cpu_ext._SOURCES])
    monkeypatch.setattr(cpu_ext, "_HEADERS", [copy / p.name for p in cpu_ext._HEADERS])
    assert cpu_ext._cpu_tag() != here
