"""Building blocks shared by the Qwen models.

Every parameter carries a ``weight_loader(param, tensor[, shard_id])`` so checkpoint tensors load
by name, including the shards of fused projections.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from kernels.linear import PANEL_OUTPUTS
from text_service.context import Context, get_context
from text_service.models.cache import KVCacheSpec


def default_weight_loader(param: Tensor, loaded: Tensor) -> None:
    """Copy a checkpoint tensor of exactly the parameter's shape."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def new_parameter(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]  # read by loader
    return param


class Linear(nn.Module):
    """y = x W^T (+ b) with the checkpoint's [out, in] weight layout, through `ops.linear`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, ops) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size)
        self.bias = new_parameter(output_size) if bias else None
        self.ops = ops

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.linear(x, self.weight, self.bias)

    def pack_weight(self) -> None:
        """Swap the loaded weight for `ops.pack_linear_weight`'s layout (inference only: the
        packed weight is no longer a parameter)."""
        packed = self.ops.pack_linear_weight(self.weight)
        if packed is not self.weight:
            del self.weight
            self.weight = packed


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (one matmul)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, *, ops
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, ops=ops)
        self.output_sizes = list(output_sizes)
        self.weight.weight_loader = self.shard_loader  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.shard_loader  # type: ignore[attr-defined]

    def shard_loader(self, param: nn.Parameter, loaded: Tensor, shard_id: int) -> None:
        """Copy checkpoint projection number ``shard_id`` into its rows of the fused parameter."""
        offset = sum(self.output_sizes[:shard_id])
        default_weight_loader(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded)

    def pack_weight(self) -> None:
        """As `Linear.pack_weight`; a weight whose rows the packed layouts cannot take (Qwen3.5's
        `in_proj_qkvzba`: the conv's, the values' and twice the heads' rows, 774 in the default
        voice) gets zero rows up to a whole panel of outputs first, where that lets it be
        packed: `split` drops their outputs."""
        pad = -self.weight.shape[0] % PANEL_OUTPUTS
        if pad:
            weight = F.pad(self.weight.detach(), (0, 0, 0, pad))
            packed = self.ops.pack_linear_weight(weight)
            if packed is not weight:
                del self.weight
                self.weight = packed
                if self.bias is not None:
                    self.bias = nn.Parameter(F.pad(self.bias.detach(), (0, pad)), False)
                return
        super().pack_weight()

    def split(self, y: Tensor) -> tuple[Tensor, ...]:
        # `split_with_sizes`, not `Tensor.split`: the latter's Python checks cost more than the
        # split itself on a small LM's decode step
        extra = y.shape[-1] - sum(self.output_sizes)  # a padded weight's outputs
        if not extra:
            return tuple(y.split_with_sizes(self.output_sizes, -1))
        return tuple(y.split_with_sizes([*self.output_sizes, extra], -1)[:-1])


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``offset + weight``; with a residual it adds first and returns both."""

    def __init__(self, hidden_size: int, eps: float, offset: float, ops) -> None:
        super().__init__()
        self.weight = new_parameter(hidden_size)
        self.eps = eps
        self.offset = offset
        self.ops = ops

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, offset=self.offset)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate) over the last dim (Gated DeltaNet output norm)."""

    def __init__(self, hidden_size: int, eps: float, ops) -> None:
        super().__init__()
        self.weight = new_parameter(hidden_size)
        self.eps = eps
        self.ops = ops

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return self.ops.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, ops) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")
        self.ops = ops
        self.gate_up_proj = MergedLinear(
            hidden_size, [intermediate_size, intermediate_size], ops=ops
        )
        self.down_proj = Linear(intermediate_size, hidden_size, ops=ops)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class RotaryEmbedding:
    """NeoX rotary on the first ``rotary_dim`` dims of q and k, from a shared cos/sin table."""

    def __init__(
        self, ops, rotary_dim: int, max_positions: int, base: float, device: torch.device
    ) -> None:
        self.ops = ops
        self.rotary_dim = rotary_dim
        self.cos_sin_cache = kernels.rope_cache(rotary_dim, max_positions, base).to(
            device, torch.float32
        )

    def __call__(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.ops.rotary(positions, q, k, self.cos_sin_cache, self.rotary_dim)

    def normed(
        self, positions: Tensor, q: Tensor, k: Tensor, q_norm: RMSNorm, k_norm: RMSNorm
    ) -> tuple[Tensor, Tensor]:
        """Rotary of q and k after each head's RMS norm (q_norm, k_norm), in one kernel."""
        return self.ops.qk_norm_rotary(
            positions,
            q,
            k,
            q_norm.weight,
            k_norm.weight,
            self.cos_sin_cache,
            self.rotary_dim,
            eps=q_norm.eps,
            offset=q_norm.offset,
        )


def rope_settings(config, head_dim: int, partial: bool) -> tuple[int, float]:
    """(rotary_dim, base) from the HF config's ``rope_parameters``; only plain RoPE is supported."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}: only 'default' RoPE is implemented")
    factor = params.get("partial_rotary_factor", 1.0) if partial else 1.0
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"rotary dim {rotary_dim} (head_dim {head_dim} x {factor}) must be positive and even"
        )
    return rotary_dim, float(params["rope_theta"])


def leading(t: Tensor, n: int) -> Tensor:
    """The first n rows of t: t itself where they are all of it (a step of decodes alone). A
    view costs 1.5 us of Python on the project's AVX2 CPU, and a decode step of the default
    voice's LM took 22 of them."""
    return t if len(t) == n else t[:n]


def split_decode_prefill(
    ctx: Context, decode: Callable[[int], Tensor], prefill: Callable[[int], Tensor]
) -> Tensor:
    """Run ``decode(nd)`` for the first nd = num_decodes tokens and ``prefill(nd)`` for the rest.

    Both callables receive nd and slice their inputs themselves; outputs are joined in token order.
    """
    nd = ctx.num_decodes
    if nd == ctx.num_seqs:
        return decode(nd)
    if nd == 0:
        return prefill(0)
    return torch.cat([decode(nd), prefill(nd)])


class PagedAttention(nn.Module):
    """Writes new K/V into the attached paged cache, then attends over each cached sequence.

    The runner attaches ``k_cache``/``v_cache`` (``[num_blocks, block_size, Hkv, D]``) before use.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        self.k_cache: Tensor | None = None
        self.v_cache: Tensor | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> o [T, H, D]."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                "KV caches are not attached: call models.cache.allocate_caches first"
            )
        ctx = get_context()
        ops, k_cache, v_cache, scale = self.ops, self.k_cache, self.v_cache, self.scale
        ops.write_kv(k, v, k_cache, v_cache, ctx.slot_mapping, all_valid=ctx.all_slots_valid)

        def decode(nd: int) -> Tensor:
            return ops.paged_attention_decode(
                leading(q, nd),
                k_cache,
                v_cache,
                seq_lens=leading(ctx.seq_lens, nd),
                block_tables=leading(ctx.block_tables, nd),
                scale=scale,
                seq_lens_list=ctx.decode_seq_lens_list,
            )

        def prefill(nd: int) -> Tensor:
            return ops.paged_attention(
                q[nd:],
                k_cache,
                v_cache,
                query_start_loc=ctx.prefill_query_start_loc,
                seq_lens=ctx.seq_lens[nd:],
                block_tables=ctx.block_tables[nd:],
                scale=scale,
                query_start_loc_list=ctx.prefill_query_start_loc_list,
                seq_lens_list=ctx.prefill_seq_lens_list,
            )

        return split_decode_prefill(ctx, decode, prefill)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(self.num_kv_heads, self.head_dim, dtype)


class PreNormDecoderLayer(nn.Module):
    """Norm, token mixer (attention of some kind), norm, MLP, with the residual carried along."""

    input_layernorm: nn.Module  # the subclass builds these four
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def mix(self, positions: Tensor, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self, positions: Tensor, x: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.mix(positions, x), residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.*`), shared by the model families."""

    def __init__(self, config, layers: list[nn.Module], norm_offset: float, ops) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.ops = ops
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=norm_offset, ops=ops)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x
