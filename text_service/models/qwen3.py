"""Qwen3 dense model (``qwen3``): full attention with q/k RMSNorm, full rotary, dense MLP."""

import torch
from torch import Tensor, nn

import kernels
from text_service.models.base import CausalLM
from text_service.models.layers import (
    DecoderModel,
    GatedMLP,
    Linear,
    MergedLinear,
    PagedAttention,
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    rope_settings,
)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config, ops, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(hidden, [q_size, kv_size, kv_size], bias=bias, ops=ops)
        self.o_proj = Linear(q_size, hidden, bias=bias, ops=ops)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=0.0, ops=ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=0.0, ops=ops)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.rotary.normed(
            positions,
            q.view(T, self.num_heads, D),
            k.view(T, self.num_kv_heads, D),
            self.q_norm,
            self.k_norm,
        )
        o = self.attn(q, k, v.view(T, self.num_kv_heads, D))
        return self.o_proj(o.reshape(T, self.num_heads * D))


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, ops, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, ops, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=0.0, ops=ops)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, offset=0.0, ops=ops
        )

    def mix(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.self_attn(positions, x)


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense LM; submodule names follow the HF checkpoint (``Qwen3ForCausalLM``)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config, device: torch.device | str = "cpu", max_positions: int | None = None
    ) -> None:
        layer_types = (
            getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        )
        if getattr(config, "use_sliding_window", False) or set(layer_types) != {"full_attention"}:
            raise ValueError(
                "sliding-window attention layers are not supported: every layer must be full_attention"
            )
        device = torch.device(device)
        ops = kernels.get_ops(device)
        super().__init__(config, ops)
        head_dim = head_dim_of(config)
        rotary_dim, base = rope_settings(config, head_dim, partial=False)
        rotary = RotaryEmbedding(
            ops, rotary_dim, max_positions or config.max_position_embeddings, base, device
        )
        self.model = DecoderModel(
            config,
            [Qwen3DecoderLayer(config, ops, rotary) for _ in range(config.num_hidden_layers)],
            norm_offset=0.0,
            ops=ops,
        )
