"""Qwen3.5 text model (``qwen3_5_text``): Gated DeltaNet and gated full attention layers, dense MLP."""

import torch
from torch import Tensor, nn

import kernels
from text_service.context import get_context
from text_service.models.base import CausalLM
from text_service.models.cache import LinearStateSpec
from text_service.models.layers import (
    DecoderModel,
    GatedMLP,
    GatedRMSNorm,
    Linear,
    MergedLinear,
    PagedAttention,
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    leading,
    new_parameter,
    rope_settings,
    split_decode_prefill,
)

LAYER_TYPES = ("full_attention", "linear_attention")


class Qwen3_5Attention(nn.Module):
    """Full attention whose q_proj also yields a per-head output gate: o = attn * sigmoid(gate)."""

    def __init__(self, config, ops, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q_proj rows are per head [q | gate], so q_proj stays one shard of 2 * q_size
        self.qkv_proj = MergedLinear(hidden, [2 * q_size, kv_size, kv_size], bias=bias, ops=ops)
        self.o_proj = Linear(q_size, hidden, bias=bias, ops=ops)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0, ops=ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=1.0, ops=ops)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        T, D = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q_gate = q_gate.view(T, self.num_heads, 2 * D)
        q, k = self.rotary.normed(
            positions, q_gate[..., :D], k.view(T, self.num_kv_heads, D), self.q_norm, self.k_norm
        )
        o = self.attn(q, k, v.view(T, self.num_kv_heads, D))
        o = o * torch.sigmoid(q_gate[..., D:])
        return self.o_proj(o.reshape(T, self.num_heads * D))


class CausalConv1d(nn.Module):
    """Depthwise causal conv + SiLU with per-sequence left context in a state pool."""

    def __init__(self, channels: int, kernel_size: int, ops) -> None:
        super().__init__()
        self.weight = new_parameter(channels, 1, kernel_size)  # checkpoint layout of nn.Conv1d
        self.ops = ops

    def forward(self, x: Tensor, conv_state: Tensor) -> Tensor:
        ctx, ops = get_context(), self.ops
        weight = self.weight.squeeze(1)

        def decode(nd: int) -> Tensor:
            return ops.causal_conv1d_update(
                leading(x, nd), weight, conv_state, leading(ctx.state_indices, nd)
            )

        def prefill(nd: int) -> Tensor:
            return ops.causal_conv1d(
                x[nd:],
                weight,
                conv_state,
                query_start_loc=ctx.prefill_query_start_loc,
                state_indices=ctx.state_indices[nd:],
                has_initial_state=ctx.has_initial_state[nd:],
            )

        return split_decode_prefill(ctx, decode, prefill)


class Qwen3_5GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; the runner attaches ``conv_state`` and ``ssm_state`` pools."""

    def __init__(self, config, ops) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.ops = ops

        hidden, Hv = config.hidden_size, self.num_v_heads
        self.in_proj_qkvzba = MergedLinear(hidden, [self.conv_dim, self.value_dim, Hv, Hv], ops=ops)
        self.conv1d = CausalConv1d(self.conv_dim, self.conv_kernel_size, ops)
        self.dt_bias = new_parameter(Hv)
        self.A_log = new_parameter(Hv)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, ops)
        self.out_proj = Linear(self.value_dim, hidden, ops=ops)
        self.conv_state: Tensor | None = None
        self.ssm_state: Tensor | None = None

    def state_spec(self, dtype: torch.dtype) -> LinearStateSpec:
        return LinearStateSpec(
            self.conv_dim,
            self.conv_kernel_size - 1,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            dtype,
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError(
                "linear-attention state pools are not attached: call models.cache.allocate_caches"
            )
        ctx, ops = get_context(), self.ops
        T, Hv = x.shape[0], self.num_v_heads
        mixed_qkv, z, b, a = self.in_proj_qkvzba.split(self.in_proj_qkvzba(x))
        mixed_qkv = self.conv1d(mixed_qkv, self.conv_state)
        q, k, g, beta = ops.gated_delta_net_inputs(
            mixed_qkv,
            a,
            b,
            self.A_log,
            self.dt_bias,
            num_k_heads=self.num_k_heads,
            head_k_dim=self.head_k_dim,
            num_v_heads=Hv,
        )
        v = mixed_qkv[:, 2 * self.key_dim :].reshape(T, Hv, self.head_v_dim)
        scale = self.head_k_dim**-0.5
        ssm_state = self.ssm_state

        def decode(nd: int) -> Tensor:
            return ops.recurrent_gated_delta_rule(
                leading(q, nd),
                leading(k, nd),
                leading(v, nd),
                leading(g, nd),
                leading(beta, nd),
                ssm_state=ssm_state,
                state_indices=leading(ctx.state_indices, nd),
                scale=scale,
            )

        def prefill(nd: int) -> Tensor:
            return ops.chunk_gated_delta_rule(
                q[nd:],
                k[nd:],
                v[nd:],
                g[nd:],
                beta[nd:],
                ssm_state=ssm_state,
                query_start_loc=ctx.prefill_query_start_loc,
                state_indices=ctx.state_indices[nd:],
                has_initial_state=ctx.has_initial_state[nd:],
                scale=scale,
            )

        o = split_decode_prefill(ctx, decode, prefill)
        o = self.norm(o, z.reshape(T, Hv, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))


class Qwen3_5DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_type: str, ops, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = Qwen3_5GatedDeltaNet(config, ops)
        else:
            self.self_attn = Qwen3_5Attention(config, ops, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0, ops=ops)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, offset=1.0, ops=ops
        )

    def mix(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.linear_attn(positions, x) if self.is_linear else self.self_attn(positions, x)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 text LM; submodule names follow the HF checkpoint (``Qwen3_5ForCausalLM``)."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj_qkvzba", 0),
        "in_proj_z": ("in_proj_qkvzba", 1),
        "in_proj_b": ("in_proj_qkvzba", 2),
        "in_proj_a": ("in_proj_qkvzba", 3),
    }
    # the image-text checkpoints keep the text model under model.language_model
    checkpoint_renames = {"model.language_model.": "model."}
    ignored_checkpoint_prefixes = ("mtp.", "model.visual.")

    def __init__(
        self, config, device: torch.device | str = "cpu", max_positions: int | None = None
    ) -> None:
        layer_types = list(config.layer_types)
        if len(layer_types) != config.num_hidden_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must list {config.num_hidden_layers} entries of {LAYER_TYPES}"
            )
        device = torch.device(device)
        ops = kernels.get_ops(device)
        super().__init__(config, ops)
        rotary_dim, base = rope_settings(config, config.head_dim, partial=True)
        rotary = RotaryEmbedding(
            ops, rotary_dim, max_positions or config.max_position_embeddings, base, device
        )
        self.model = DecoderModel(
            config,
            [
                Qwen3_5DecoderLayer(config, layer_type, ops, rotary)
                for layer_type in config.layer_types
            ],
            norm_offset=1.0,
            ops=ops,
        )
