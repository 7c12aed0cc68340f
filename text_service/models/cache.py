"""Per-layer cache shapes, their cost in bytes, and attaching freshly allocated pools to a model."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from text_service.models.base import CausalLM


@dataclass(frozen=True)
class KVCacheSpec:
    """One full-attention layer: K and V pools of ``[num_blocks, block_size, Hkv, D]``."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        """K plus V bytes of one block."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class LinearStateSpec:
    """One Gated DeltaNet layer: conv state ``[slots, conv_dim, K-1]`` and fp32 ``[slots, Hv, Dk, Dv]``."""

    conv_dim: int
    conv_width: int  # kernel size - 1
    num_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32

    def conv_shape(self, num_slots: int) -> tuple[int, int, int]:
        return (num_slots, self.conv_dim, self.conv_width)

    def ssm_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (num_slots, self.num_heads, self.key_head_dim, self.value_head_dim)

    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * self.conv_width * self.conv_dtype.itemsize
        ssm = self.num_heads * self.key_head_dim * self.value_head_dim * self.ssm_dtype.itemsize
        return conv + ssm


def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
    """Bytes one KV block costs summed over all full-attention layers."""
    return sum(spec.bytes_per_block(block_size) for spec in model.kv_cache_specs().values())


def state_bytes_per_slot(model: CausalLM) -> int:
    """Bytes one sequence state slot costs summed over all linear-attention layers."""
    return sum(spec.bytes_per_slot() for spec in model.state_specs().values())


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux or where it cannot be found."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.zeros`, but on the CPU the pool's 2 MiB-aligned interior asks Linux for transparent
    huge pages before the first write touches it.

    A decode step reads every sequence's cache blocks from all over a pool of hundreds of MB: on
    4 KiB pages each 16 KiB block crosses four pages, each a TLB miss. On the project's Xeon (THP
    "madvise", 64 sequences, blocks at random in a 24,576-block bf16 pool) the compiled decode
    attention took 1.59-1.66 ms a layer on huge pages against 2.00-2.04 on 4 KiB pages. Where the
    kernel declines (THP "never", no memory to compact), or a small pool reuses heap memory
    already touched (glibc maps fresh memory for 32 MiB and up), it is on 4 KiB pages as before.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    pool = torch.empty(shape, dtype=dtype)
    madvise = _madvise()
    start = (pool.data_ptr() + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (pool.data_ptr() + pool.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return pool.zero_()


def allocate_caches(
    model: CausalLM, *, num_blocks: int, block_size: int, num_slots: int, device: torch.device | str
) -> None:
    """Allocate zeroed pools for every layer and attach them (k_cache/v_cache, conv_state/ssm_state),
    on the CPU in transparent huge pages where Linux grants them."""
    kv_specs, state_specs = model.kv_cache_specs(), model.state_specs()
    for idx, attn in model.attention_layers().items():
        spec = kv_specs[idx]
        shape = spec.shape(num_blocks, block_size)
        attn.k_cache = zeros_in_huge_pages(shape, spec.dtype, device)
        attn.v_cache = zeros_in_huge_pages(shape, spec.dtype, device)
    for idx, mixer in model.linear_attention_layers().items():
        state = state_specs[idx]
        mixer.conv_state = zeros_in_huge_pages(
            state.conv_shape(num_slots), state.conv_dtype, device
        )
        mixer.ssm_state = zeros_in_huge_pages(state.ssm_shape(num_slots), state.ssm_dtype, device)


def kv_pools(model: CausalLM) -> list[torch.Tensor]:
    """The attached K and V pools, layer by layer."""
    pools = [t for a in model.attention_layers().values() for t in (a.k_cache, a.v_cache)]
    return [t for t in pools if isinstance(t, torch.Tensor)]


def state_pools(model: CausalLM) -> list[torch.Tensor]:
    """The attached conv and recurrent state pools, layer by layer."""
    pools = [
        t for m in model.linear_attention_layers().values() for t in (m.conv_state, m.ssm_state)
    ]
    return [t for t in pools if isinstance(t, torch.Tensor)]


def copy_state_slots(model: CausalLM, src: list[int], dst: list[int]) -> None:
    """Copy conv and recurrent state from slot ``src[i]`` to ``dst[i]`` in every linear-attention layer."""
    if len(src) != len(dst):
        raise ValueError(f"src and dst slot lists differ in length ({len(src)} != {len(dst)})")
    if not src:
        return
    for mixer in model.linear_attention_layers().values():
        index_src = torch.as_tensor(src, dtype=torch.long, device=mixer.ssm_state.device)
        index_dst = torch.as_tensor(dst, dtype=torch.long, device=mixer.ssm_state.device)
        mixer.conv_state[index_dst] = mixer.conv_state[index_src]
        mixer.ssm_state[index_dst] = mixer.ssm_state[index_src]
