"""Paged KV cache: write new keys/values, and attend over cached prefix + new tokens."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _check_heads(q: Tensor, k_cache: Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"expected q [T, H, D] and caches [num_blocks, block_size, Hkv, D], "
            f"got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"query heads/dim {tuple(q.shape[1:])} do not fit cache heads/dim "
            f"{tuple(k_cache.shape[2:])} (H must be a multiple of Hkv)"
        )


def write_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    all_valid: bool | None = None,
) -> None:
    """Store key/value `[T, Hkv, D]` at slot = block * block_size + offset; skip slots < 0.

    `all_valid` says on the host that no slot is negative; None reads that from the device.
    """
    slots = slot_mapping.long()
    valid = slots >= 0
    if not (all_valid if all_valid is not None else bool(valid.all())):
        key, value, slots = key[valid], value[valid], slots[valid]
    # view() (not flatten) so a non-contiguous cache fails loudly instead of writing a copy
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_kv(
    k_cache: Tensor, v_cache: Tensor, block_table: Tensor, kv_len: int
) -> tuple[Tensor, Tensor]:
    """One sequence's first `kv_len` cached keys and values, each `[Hkv, kv_len, D]`."""
    num_blocks = -(-kv_len // k_cache.shape[1])
    blocks = block_table[:num_blocks].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]
    return k.transpose(0, 1), v.transpose(0, 1)


def _attend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, kv_len: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's last `q_len` positions, q `[q_len, H, D]`."""
    q_len = q.shape[0]
    if kv_len < q_len:
        raise ValueError(f"seq_len {kv_len} is shorter than its {q_len} new tokens")
    k, v = _gather_kv(k_cache, v_cache, block_table, kv_len)
    qh = q.transpose(0, 1).unsqueeze(0)
    if q_len == 1 or kv_len == q_len:  # no mask needed, or plain top-left causal
        o = F.scaled_dot_product_attention(
            qh, k[None], v[None], is_causal=q_len > 1, scale=scale, enable_gqa=True
        )
    else:
        # query i sits at absolute position kv_len - q_len + i
        query_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            qh, k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
    return o[0].transpose(0, 1)


def _decode_batched(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> Tensor:
    """One masked softmax over all sequences' KV gathered to the longest length."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if max_seq_len is None:  # without the host's word, a device read-back
        max_seq_len = int(seq_lens.max())
    num_blocks = -(-max_seq_len // block_size)
    # index_select on a flat index: much faster on CPU than advanced indexing by a 2-D one
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    gathered = (batch, -1, num_kv_heads, head_dim)
    k = k_cache.index_select(0, blocks).view(gathered).transpose(1, 2).float()  # [B, Hkv, S, D]
    v = v_cache.index_select(0, blocks).view(gathered).transpose(1, 2).float()
    # query heads sharing a KV head become rows of one matmul: [B, Hkv, H/Hkv, D]
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim) * scale
    scores = qg @ k.transpose(-1, -2)
    padding = torch.arange(k.shape[2], device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).view(batch, num_heads, head_dim).to(q.dtype)


def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    seq_lens_list: list[int] | None = None,
) -> Tensor:
    """Attention for one new token per sequence: q `[B, H, D]` -> o `[B, H, D]`.

    `seq_lens_list` is `seq_lens` on the host; None reads it from the device.
    """
    _check_heads(q, k_cache)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if seq_lens_list is None:
        seq_lens_list = seq_lens.tolist()
    if q.device.type != "cpu":
        return _decode_batched(
            q,
            k_cache,
            v_cache,
            seq_lens.to(q.device),
            block_tables.to(q.device),
            scale,
            max(seq_lens_list),
        )
    # On CPU one gather + masked softmax over the whole batch is memory-bound and measured
    # 1.5-5x slower than per-sequence flash attention over cache-sized gathers.
    out = torch.empty_like(q)
    for b, kv_len in enumerate(seq_lens_list):
        out[b] = _attend(q[b : b + 1], k_cache, v_cache, block_tables[b], kv_len, scale)[0]
    return out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    decode: Callable[..., Tensor] = paged_attention_decode,
    query_start_loc_list: list[int] | None = None,
    seq_lens_list: list[int] | None = None,
) -> Tensor:
    """Causal attention of each sequence's new tokens over its paged KV: o `[T, H, D]`.

    Sequences with one new token go through `decode` (a `paged_attention_decode`) together.
    The `*_list` arguments are the tensors on the host; None reads them from the device.
    """
    _check_heads(q, k_cache)
    starts = query_start_loc.tolist() if query_start_loc_list is None else query_start_loc_list
    kv_lens = seq_lens.tolist() if seq_lens_list is None else seq_lens_list
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    out = torch.empty_like(q)

    single = [b for b, n in enumerate(q_lens) if n == 1]
    if single:
        index = torch.tensor(single, device=q.device)
        rows = query_start_loc[:-1].to(q.device)[index].long()
        out[rows] = decode(
            q[rows],
            k_cache,
            v_cache,
            seq_lens=seq_lens.to(q.device)[index],
            block_tables=block_tables.to(q.device)[index],
            scale=scale,
            seq_lens_list=[kv_lens[b] for b in single],
        )

    for b, q_len in enumerate(q_lens):
        if q_len > 1:
            start = starts[b]
            out[start : start + q_len] = _attend(
                q[start : start + q_len], k_cache, v_cache, block_tables[b], kv_lens[b], scale
            )
    return out
