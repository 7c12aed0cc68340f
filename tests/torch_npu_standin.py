"""STAND-IN for `torch_npu`, for CPU tests only: not torch_npu, and no evidence about hardware.

It implements just the torch_npu functions that `kernels.npu` calls. Each one checks the call
against the documented torch_npu signature (argument names, shapes, dtypes, layouts and the
documented constraints) and raises `StandInMismatch` on a violation, then computes the result
with plain torch math written independently of `kernels`. `calls` records the function names
called, so tests can tell the torch_npu path from the reference fallback. Features the kernels
do not use (quantisation, speculative tokens, other layouts) raise NotImplementedError.
"""

import torch
from torch import Tensor

calls: list[str] = []

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)


class StandInMismatch(Exception):
    """A call that the documented torch_npu signature would not accept."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise StandInMismatch(message)


def _tensor(
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    dim: int | None = None,
    contiguous: bool = True,
) -> Tensor:
    _require(isinstance(t, Tensor), f"{name} must be a Tensor, got {type(t).__name__}")
    _require(t.dtype in dtypes, f"{name} dtype {t.dtype} not in {dtypes}")
    _require(dim is None or t.dim() == dim, f"{name} must be {dim}-D, got {tuple(t.shape)}")
    _require(not contiguous or t.is_contiguous(), f"{name} must be contiguous")
    return t


def _int_list(name: str, values: object, length: int) -> list[int]:
    _require(
        isinstance(values, (list, tuple)) and all(isinstance(v, int) for v in values),
        f"{name} must be a list of ints (SymInt[]), got {type(values).__name__}",
    )
    _require(len(values) == length, f"{name} has {len(values)} entries, batch is {length}")
    return list(values)


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Dense attention of q `[Lq, N, D]` over k/v `[Lk, Nkv, D]`, causal to the KV end, fp32."""
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q.float(), k) * scale
    allowed = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("nqk,knd->qnd", scores.softmax(-1), v)


def _paged_rows(block_row: Tensor, block_size: int, length: int) -> Tensor:
    """Flat cache rows holding positions 0..length-1 of one sequence."""
    positions = torch.arange(length)
    return block_row.long()[positions // block_size] * block_size + positions % block_size


# --- normalisation -------------------------------------------------------------------------


def _rms(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _check_gamma(x: Tensor, gamma: object) -> Tensor:
    gamma = _tensor("gamma", gamma, (x.dtype,), contiguous=False)
    _require(
        gamma.dim() <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]),
        f"gamma shape {tuple(gamma.shape)} must match the trailing dims of {tuple(x.shape)}",
    )
    return gamma


def npu_rms_norm(self: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
    """Stand-in for torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)."""
    calls.append("npu_rms_norm")
    x = _tensor("self", self, _FLOATS, contiguous=False)
    _require(2 <= x.dim() <= 8, f"self must be 2-8-D, got {x.dim()}-D")
    return _rms(x, _check_gamma(x, gamma), float(epsilon))


def npu_add_rms_norm(
    x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float = 1e-06
) -> tuple[Tensor, Tensor, Tensor]:
    """Stand-in for torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)."""
    calls.append("npu_add_rms_norm")
    x1 = _tensor("x1", x1, _FLOATS, contiguous=False)
    x2 = _tensor("x2", x2, (x1.dtype,), contiguous=False)
    _require(x1.shape == x2.shape, f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} differ")
    _require(1 <= x1.dim() <= 8, f"x1 must be 1-8-D, got {x1.dim()}-D")
    x = x1 + x2
    y, rstd = _rms(x, _check_gamma(x1, gamma), float(epsilon))
    return y, rstd, x


# --- rotary --------------------------------------------------------------------------------


def npu_rotary_mul(input: Tensor, r1: Tensor, r2: Tensor, rotary_mode: str = "half") -> Tensor:
    """Stand-in for torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor."""
    calls.append("npu_rotary_mul")
    x = _tensor("input", input, _FLOATS, dim=4)
    r1 = _tensor("r1", r1, (x.dtype,), dim=4, contiguous=False)
    r2 = _tensor("r2", r2, (x.dtype,), dim=4, contiguous=False)
    _require(rotary_mode in ("half", "interleave"), f"unknown rotary_mode {rotary_mode!r}")
    if rotary_mode != "half":
        raise NotImplementedError("the stand-in models rotary_mode='half' only")
    size = x.shape[-1]
    _require(size % 2 == 0 and size < 896, f"last dim {size} must be even and < 896")
    _require(r1.shape == r2.shape, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    _require(
        r1.shape[-1] == size and all(r in (1, n) for r, n in zip(r1.shape, x.shape)),
        f"r1/r2 {tuple(r1.shape)} do not broadcast to input {tuple(x.shape)}",
    )
    _require(bool((r1.abs() <= 1).all() and (r2.abs() <= 1).all()), "r1/r2 must lie in [-1, 1]")
    x1, x2 = x.float().chunk(2, dim=-1)
    return (r1.float() * x.float() + r2.float() * torch.cat((-x2, x1), dim=-1)).to(x.dtype)


# --- paged KV cache and attention ----------------------------------------------------------


def npu_scatter_pa_kv_cache(
    key: Tensor,
    value: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    slot_mapping: Tensor,
    *,
    compress_lens: Tensor | None = None,
    compress_seq_offsets: Tensor | None = None,
    seq_lens: Tensor | None = None,
) -> None:
    """Stand-in for torch_npu.npu_scatter_pa_kv_cache (3-D key/value into [nb, bs, N, D] caches)."""
    calls.append("npu_scatter_pa_kv_cache")
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("the stand-in models the uncompressed form only")
    key = _tensor("key", key, _FLOATS, dim=3)
    value = _tensor("value", value, (key.dtype,), dim=3)
    key_cache = _tensor("key_cache", key_cache, (key.dtype,), dim=4)
    value_cache = _tensor("value_cache", value_cache, (key.dtype,), dim=4)
    slots = _tensor("slot_mapping", slot_mapping, (torch.int32, torch.int64), dim=1)
    _require(key.shape[:2] == value.shape[:2], "key and value must agree in their first two dims")
    _require(
        key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:],
        f"caches {tuple(key_cache.shape)} must be [num_blocks, block_size, {key.shape[1]}, D]",
    )
    _require(key_cache.shape[:2] == value_cache.shape[:2], "key/value caches differ in blocks")
    _require(slots.shape[0] == key.shape[0], "slot_mapping length must equal the token count")
    capacity = key_cache.shape[0] * key_cache.shape[1]
    _require(bool(((slots >= 0) & (slots < capacity)).all()), f"slots must lie in [0, {capacity})")
    _require(slots.unique().numel() == slots.numel(), "slot_mapping values must be unique")
    key_cache.view(-1, *key_cache.shape[2:])[slots.long()] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots.long()] = value


_FIA_UNMODELLED = (
    "pse_shift dequant_scale1 quant_scale1 dequant_scale2 quant_scale2 quant_offset2 "
    "antiquant_scale antiquant_offset query_padding_size kv_padding_size key_antiquant_scale "
    "key_antiquant_offset value_antiquant_scale value_antiquant_offset key_shared_prefix "
    "value_shared_prefix actual_shared_prefix_len query_rope key_rope key_rope_antiquant_scale"
).split()


def npu_fused_infer_attention_score(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    pse_shift: Tensor | None = None,
    atten_mask: Tensor | None = None,
    actual_seq_lengths: list[int] | None = None,
    actual_seq_lengths_kv: list[int] | None = None,
    dequant_scale1: Tensor | None = None,
    quant_scale1: Tensor | None = None,
    dequant_scale2: Tensor | None = None,
    quant_scale2: Tensor | None = None,
    quant_offset2: Tensor | None = None,
    antiquant_scale: Tensor | None = None,
    antiquant_offset: Tensor | None = None,
    block_table: Tensor | None = None,
    query_padding_size: Tensor | None = None,
    kv_padding_size: Tensor | None = None,
    key_antiquant_scale: Tensor | None = None,
    key_antiquant_offset: Tensor | None = None,
    value_antiquant_scale: Tensor | None = None,
    value_antiquant_offset: Tensor | None = None,
    key_shared_prefix: Tensor | None = None,
    value_shared_prefix: Tensor | None = None,
    actual_shared_prefix_len: list[int] | None = None,
    query_rope: Tensor | None = None,
    key_rope: Tensor | None = None,
    key_rope_antiquant_scale: Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
) -> tuple[Tensor, Tensor]:
    """Stand-in for torch_npu.npu_fused_infer_attention_score, TND query over a paged KV cache."""
    calls.append("npu_fused_infer_attention_score")
    extras = dict(locals())
    used = [name for name in _FIA_UNMODELLED if extras[name] is not None]
    if used or input_layout != "TND" or block_table is None or softmax_lse_flag:
        raise NotImplementedError(f"the stand-in models paged TND attention only (got {used})")
    query = _tensor("query", query, _HALF, dim=3)
    num_tokens, heads, head_dim = query.shape
    _require(num_heads == heads, f"num_heads {num_heads} != query heads {heads}")
    kv_heads = num_key_value_heads or num_heads
    _require(num_heads % kv_heads == 0, "num_heads must be a multiple of num_key_value_heads")
    _require(num_heads // kv_heads <= 64, "num_heads / num_key_value_heads must be <= 64")
    table = _tensor("block_table", block_table, (torch.int32,), dim=2)
    batch = table.shape[0]
    for name, t in (("key", key), ("value", value)):
        # paged layout (blocknum, blocksize, H) with H = num_key_value_heads * D
        t = _tensor(name, t, (query.dtype,), dim=3)
        _require(
            tuple(t.shape[1:]) == (block_size, kv_heads * head_dim),
            f"{name} {tuple(t.shape)} must be (num_blocks, {block_size}, {kv_heads * head_dim})",
        )
    _require(key.shape == value.shape, "key and value shapes differ")
    _require(
        block_size % 128 == 0 and 128 <= block_size <= 512,
        f"block_size {block_size} must be a multiple of 128 in [128, 512]",
    )
    q_ends = _int_list("actual_seq_lengths", actual_seq_lengths, batch)
    kv_lens = _int_list("actual_seq_lengths_kv", actual_seq_lengths_kv, batch)
    q_starts = [0] + q_ends[:-1]
    _require(
        all(end >= start for start, end in zip(q_starts, q_ends)) and q_ends[-1] == num_tokens,
        f"TND actual_seq_lengths must be non-decreasing cumulative ends reaching {num_tokens}",
    )
    _require(
        max(kv_lens) <= table.shape[1] * block_size,
        "block_table is too narrow for actual_seq_lengths_kv",
    )
    _require(sparse_mode in (0, 3), f"TND supports sparse_mode 0 or 3, got {sparse_mode}")
    if sparse_mode == 0:
        raise NotImplementedError("the stand-in models causal attention (sparse_mode=3) only")
    mask = _tensor("atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8))
    _require(mask.numel() == 2048 * 2048 and mask.shape[-2:] == (2048, 2048), "mask not 2048x2048")
    upper = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    _require(bool((mask.reshape(2048, 2048).bool() == upper).all()), "mask must be triu(ones, 1)")

    out = torch.empty_like(query)
    keys = key.reshape(-1, kv_heads, head_dim)
    values = value.reshape(-1, kv_heads, head_dim)
    for b in range(batch):
        q_len = q_ends[b] - q_starts[b]
        _require(q_len <= kv_lens[b], f"batch {b}: query length exceeds its KV length")
        rows = _paged_rows(table[b], block_size, kv_lens[b])
        q = query[q_starts[b] : q_ends[b]]
        out[q_starts[b] : q_ends[b]] = _attend(q, keys[rows], values[rows], scale).to(out.dtype)
    return out, torch.zeros(1)


def _npu_paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: Tensor,
    context_lens: Tensor,
    out: Tensor,
    *,
    workspace: Tensor | None = None,
) -> None:
    """Stand-in for torch_npu._npu_paged_attention (decode, one query token per sequence)."""
    calls.append("_npu_paged_attention")
    query = _tensor("query", query, _HALF, dim=3)
    batch, heads, head_dim = query.shape
    _require(heads == num_heads, f"num_heads {num_heads} != query heads {heads}")
    _require(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        t = _tensor(name, t, (query.dtype,), dim=4)
        _require(
            tuple(t.shape[2:]) == (num_kv_heads, head_dim),
            f"{name} {tuple(t.shape)} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}]",
        )
    table = _tensor("block_table", block_table, (torch.int32,), dim=2)
    lens = _tensor("context_lens", context_lens, (torch.int32,), dim=1)
    _require(lens.device.type == "cpu", "context_lens must be a host (cpu) tensor")
    _require(table.shape[0] == batch and lens.shape[0] == batch, "batch sizes disagree")
    out = _tensor("out", out, (query.dtype,), dim=3)
    _require(out.shape == query.shape, "out must have the query's shape")
    block_size = key_cache.shape[1]
    keys = key_cache.reshape(-1, num_kv_heads, head_dim)
    values = value_cache.reshape(-1, num_kv_heads, head_dim)
    for b in range(batch):
        rows = _paged_rows(table[b], block_size, int(lens[b]))
        out[b] = _attend(query[b : b + 1], keys[rows], values[rows], scale_value)[0].to(out.dtype)


# --- gated delta rule ----------------------------------------------------------------------


def _delta_step(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float
) -> Tensor:
    """One step on fp32 state `[N, Dv, Dk]` in the documented form; returns o `[N, Dv]`."""
    alpha = g.exp()[:, None, None]
    decayed = alpha * state
    error = v - torch.einsum("nvk,nk->nv", decayed, k)
    state.copy_(decayed + beta[:, None, None] * error[:, :, None] * k[:, None, :])
    return torch.einsum("nvk,nk->nv", state, q * scale)


def _check_qkv(query: object, key: object, value: object) -> tuple[Tensor, Tensor, Tensor]:
    query = _tensor("query", query, (torch.bfloat16,), dim=3)
    key = _tensor("key", key, (torch.bfloat16,), dim=3)
    value = _tensor("value", value, (torch.bfloat16,), dim=3)
    _require(query.shape == key.shape, "query and key shapes differ")
    _require(value.shape[0] == query.shape[0], "value must have T rows")
    _require(value.shape[1] % key.shape[1] == 0, "Nv must be a multiple of Nk")
    return query, key, value


def _per_value_head(x: Tensor, num_v_heads: int) -> Tensor:
    return x.float().repeat_interleave(num_v_heads // x.shape[1], dim=1)


def npu_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    beta: Tensor | None = None,
    initial_state: Tensor | None = None,
    actual_seq_lengths: Tensor | None = None,
    scale: float | None = None,
    g: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Stand-in for torch_npu.npu_chunk_gated_delta_rule (TND, state [B, Nv, Dv, Dk])."""
    calls.append("npu_chunk_gated_delta_rule")
    query, key, value = _check_qkv(query, key, value)
    num_tokens, num_k_heads, dk = key.shape
    num_v_heads, dv = value.shape[1:]
    _require(num_v_heads <= 64 and num_k_heads <= 64, "Nv and Nk must be <= 64")
    _require(dk == 128 and dv == 128, f"Dk and Dv must be 128, got {dk} and {dv}")
    _require(scale is not None, "scale is required")
    beta = _tensor("beta", beta, (torch.bfloat16,), dim=2)
    g = _tensor("g", g, (torch.float32,), dim=2)
    _require(beta.shape == g.shape == (num_tokens, num_v_heads), "beta and g must be [T, Nv]")
    lens = _tensor("actual_seq_lengths", actual_seq_lengths, (torch.int32,), dim=1)
    _require(int(lens.sum()) == num_tokens and bool((lens >= 0).all()), "lengths must sum to T")
    state = _tensor("initial_state", initial_state, (torch.bfloat16,), dim=4)
    _require(
        tuple(state.shape) == (lens.shape[0], num_v_heads, dv, dk),
        f"initial_state {tuple(state.shape)} must be [B, Nv, Dv, Dk]",
    )
    q, k = _per_value_head(query, num_v_heads), _per_value_head(key, num_v_heads)
    out = torch.empty(num_tokens, num_v_heads, dv)
    final = state.float().clone()
    start = 0
    for b, length in enumerate(lens.tolist()):
        for t in range(start, start + length):
            v_t, beta_t = value[t].float(), beta[t].float()
            out[t] = _delta_step(final[b], q[t], k[t], v_t, g[t], beta_t, scale)
        start += length
    return out.to(torch.bfloat16), final.to(torch.bfloat16)


def npu_recurrent_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    state: Tensor,
    *,
    beta: Tensor | None = None,
    scale: float | None = None,
    actual_seq_lengths: Tensor | None = None,
    ssm_state_indices: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    g: Tensor | None = None,
    gk: Tensor | None = None,
) -> Tensor:
    """Stand-in for torch_npu.npu_recurrent_gated_delta_rule; updates `state` in place."""
    calls.append("npu_recurrent_gated_delta_rule")
    query, key, value = _check_qkv(query, key, value)
    num_tokens, num_k_heads, dk = key.shape
    num_v_heads, dv = value.shape[1:]
    _require(max(num_k_heads, num_v_heads) <= 256 and max(dk, dv) <= 512, "heads/dims too large")
    _require(scale is not None, "scale is required")
    _require(gk is None, "gk is not supported by this torch_npu version; pass None")
    beta = _tensor("beta", beta, (torch.bfloat16,), dim=2)
    g = _tensor("g", g, (torch.float32,), dim=2)
    _require(beta.shape == g.shape == (num_tokens, num_v_heads), "beta and g must be [T, Nv]")
    lens = _tensor("actual_seq_lengths", actual_seq_lengths, (torch.int32,), dim=1)
    _require(bool(((lens >= 1) & (lens <= 8)).all()), "each sequence length must be in 1..8")
    _require(int(lens.sum()) == num_tokens, "actual_seq_lengths must sum to T")
    if bool((lens != 1).any()) or num_accepted_tokens is not None:
        raise NotImplementedError("the stand-in models one token per sequence only")
    index = _tensor("ssm_state_indices", ssm_state_indices, (torch.int32,), dim=1)
    _require(index.shape[0] == num_tokens, "ssm_state_indices must have one entry per token")
    state = _tensor("state", state, (torch.bfloat16,), dim=4)
    _require(
        tuple(state.shape[1:]) == (num_v_heads, dv, dk) and state.shape[0] >= num_tokens,
        f"state {tuple(state.shape)} must be [BlockNum >= T, Nv, Dv, Dk]",
    )
    _require(bool(((index >= 0) & (index < state.shape[0])).all()), "state index out of range")
    q, k = _per_value_head(query, num_v_heads), _per_value_head(key, num_v_heads)
    out = torch.empty(num_tokens, num_v_heads, dv)
    for t in range(num_tokens):
        s = state[int(index[t])].float()
        out[t] = _delta_step(s, q[t], k[t], value[t].float(), g[t], beta[t].float(), scale)
        state[int(index[t])] = s.to(state.dtype)
    return out.to(torch.bfloat16)
