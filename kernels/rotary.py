"""NeoX (rotate-half) rotary embedding on the leading `rotary_dim` dims of each head."""

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import norm


def rope_cache(rotary_dim: int, max_positions: int, base: float) -> Tensor:
    """Build the fp32 `[max_positions, rotary_dim]` table cat(cos, sin) used by `rotary`."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    # x [T, H, D]; cos/sin [T, 1, rotary_dim/2] fp32
    half = rotary_dim // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:rotary_dim].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, rotary_dim: int
) -> tuple[Tensor, Tensor]:
    """Rotate the first `rotary_dim` dims of q `[T, H, D]` and k `[T, Hkv, D]` (new tensors)."""
    if cos_sin_cache.shape[-1] != rotary_dim or rotary_dim > q.shape[-1]:
        raise ValueError(
            f"cos_sin_cache width {cos_sin_cache.shape[-1]} / head dim {q.shape[-1]} "
            f"do not fit rotary_dim {rotary_dim}"
        )
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


def qk_norm_rotary(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    cos_sin_cache: Tensor,
    rotary_dim: int,
    *,
    eps: float,
    offset: float,
    rms_norm: Callable = norm.rms_norm,
    rotary: Callable = rotary,
) -> tuple[Tensor, Tensor]:
    """`rotary` of q `[T, H, D]` and k `[T, Hkv, D]` after each head's RMS norm (`rms_norm` with
    `q_weight` / `k_weight`): the attention inputs of Qwen3 and Qwen3.5. A device's own norm and
    rotary kernels can be passed in; the CPU's compiled kernel does both in one pass."""
    q = rms_norm(q, q_weight, eps, offset=offset)
    k = rms_norm(k, k_weight, eps, offset=offset)
    return rotary(positions, q, k, cos_sin_cache, rotary_dim)
