"""Ascend versions of the kernels, built on torch_npu operations (the layouts vllm-ascend uses).

torch_npu is imported only when `npu_ops()` runs. Each op falls back to the pure-torch
reference where the torch_npu operation's documented constraints do not hold (dtype, block
size, head sizes), logging the reason once. Without a documented torch_npu operation,
`causal_conv1d`, `causal_conv1d_update` and `gated_rms_norm` always run the reference.
The torch_npu delta-rule operations take bfloat16 inputs and a bfloat16 `[.., Dv, Dk]` state,
so the fp32 state pool is transposed and rounded to bfloat16 around each call.
"""

import functools
import logging
from types import ModuleType

import torch
from torch import Tensor

from kernels import activation, attention, conv, delta_rule, linear, norm, rotary
from kernels.ops import Ops

logger = logging.getLogger(__name__)

_MASK_SIZE = 2048  # sparse_mode=3 takes a fixed 2048x2048 "optimised" causal mask
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def import_torch_npu() -> ModuleType:
    """Import torch_npu, or raise a RuntimeError saying what to install."""
    try:
        import torch_npu
    except (ImportError, OSError, RuntimeError) as exc:
        raise RuntimeError(
            "device 'npu' needs torch_npu (install the 'npu' extra: torch-npu built for this "
            f"torch {torch.__version__} and an installed CANN toolkit); importing it failed: {exc}"
        ) from exc
    return torch_npu


class NpuKernels:
    """The kernel API implemented with one torch_npu module (real or a test stand-in)."""

    def __init__(self, torch_npu: ModuleType) -> None:
        self.torch_npu = torch_npu
        self._masks: dict[torch.device, Tensor] = {}
        self._logged: set[str] = set()

    def _fallback(self, op: str, reason: str) -> None:
        if op not in self._logged:
            self._logged.add(op)
            logger.info("npu %s: using the torch reference (%s)", op, reason)

    def _causal_mask(self, device: torch.device) -> Tensor:
        if device not in self._masks:
            ones = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device)
            self._masks[device] = torch.triu(ones, diagonal=1).to(torch.int8)
        return self._masks[device]

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
        gamma = (offset + weight.float()).to(x.dtype)
        return self.torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        gamma = (offset + weight.float()).to(x.dtype)
        y, _, new_residual = self.torch_npu.npu_add_rms_norm(x, residual, gamma, epsilon=eps)
        return y, new_residual

    def rotary(
        self, positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, rotary_dim: int
    ) -> tuple[Tensor, Tensor]:
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        # rotate-half form: r1 = [cos, cos], r2 = [sin, sin], laid out 1S1D for BSND input
        r1 = torch.cat((cos, cos), dim=-1)[None, :, None, :]
        r2 = torch.cat((sin, sin), dim=-1)[None, :, None, :]

        def apply(x: Tensor) -> Tensor:
            part = x[..., :rotary_dim].unsqueeze(0).contiguous()
            rotated = self.torch_npu.npu_rotary_mul(
                part, r1.to(x.dtype), r2.to(x.dtype), rotary_mode="half"
            ).squeeze(0)
            if rotary_dim == x.shape[-1]:
                return rotated
            return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

        return apply(q), apply(k)

    def write_kv(
        self,
        key: Tensor,
        value: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        slot_mapping: Tensor,
        *,
        all_valid: bool | None = None,
    ) -> None:
        if all_valid is None:  # without the host's word, a device read-back
            all_valid = bool((slot_mapping >= 0).all())
        if not all_valid:  # the op takes only slots in [0, num_blocks * block_size)
            valid = slot_mapping >= 0
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        if key.shape[0] == 0:
            return
        self.torch_npu.npu_scatter_pa_kv_cache(
            key.to(k_cache.dtype).contiguous(),
            value.to(v_cache.dtype).contiguous(),
            k_cache,
            v_cache,
            slot_mapping.contiguous(),
        )

    def paged_attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        block_tables: Tensor,
        scale: float,
        query_start_loc_list: list[int] | None = None,
        seq_lens_list: list[int] | None = None,
    ) -> Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if q.dtype not in _HALF_DTYPES or block_size % 128 or not 128 <= block_size <= 512:
            self._fallback("paged_attention", f"dtype {q.dtype}, block_size {block_size}")
            return attention.paged_attention(
                q,
                k_cache,
                v_cache,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=block_tables,
                scale=scale,
                query_start_loc_list=query_start_loc_list,
                seq_lens_list=seq_lens_list,
            )
        if query_start_loc_list is None:  # without the host's copies, device read-backs
            query_start_loc_list = query_start_loc.tolist()
        if seq_lens_list is None:
            seq_lens_list = seq_lens.tolist()
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            q.contiguous(),
            k_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
            atten_mask=self._causal_mask(q.device),
            block_table=block_tables.to(torch.int32),
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=query_start_loc_list[1:],  # TND: cumulative query ends
            actual_seq_lengths_kv=seq_lens_list,  # paged: per-sequence KV lengths
            num_key_value_heads=num_kv_heads,
            num_heads=q.shape[1],
            scale=scale,
            sparse_mode=3,  # causal aligned to the end of each sequence's KV
        )
        return out

    def paged_attention_decode(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        seq_lens: Tensor,
        block_tables: Tensor,
        scale: float,
        seq_lens_list: list[int] | None = None,
    ) -> Tensor:
        if q.dtype not in _HALF_DTYPES:
            self._fallback("paged_attention_decode", f"dtype {q.dtype}")
            return attention.paged_attention_decode(
                q,
                k_cache,
                v_cache,
                seq_lens=seq_lens,
                block_tables=block_tables,
                scale=scale,
                seq_lens_list=seq_lens_list,
            )
        if seq_lens_list is None:  # without the host's copy, a device read-back
            context_lens = seq_lens.to("cpu", torch.int32)
        else:
            context_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
        out = torch.empty_like(q)
        self.torch_npu._npu_paged_attention(
            query=q.contiguous(),
            key_cache=k_cache,
            value_cache=v_cache,
            num_kv_heads=k_cache.shape[2],
            num_heads=q.shape[1],
            scale_value=scale,
            block_table=block_tables.to(torch.int32),
            context_lens=context_lens,  # read on the host
            out=out,
        )
        return out

    def chunk_gated_delta_rule(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        ssm_state: Tensor,
        query_start_loc: Tensor,
        state_indices: Tensor,
        has_initial_state: Tensor,
        scale: float,
    ) -> Tensor:
        num_heads, dk, dv = k.shape[1], k.shape[2], v.shape[2]
        if dk != 128 or dv != 128 or num_heads > 64:
            self._fallback("chunk_gated_delta_rule", f"heads {num_heads}, Dk {dk}, Dv {dv}")
            return delta_rule.chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                ssm_state=ssm_state,
                query_start_loc=query_start_loc,
                state_indices=state_indices,
                has_initial_state=has_initial_state,
                scale=scale,
            )
        slots = state_indices.long()
        has_initial = has_initial_state.to(ssm_state.device)[:, None, None, None]
        initial = torch.where(has_initial, ssm_state[slots], 0.0)
        bf16 = torch.bfloat16
        out, final = self.torch_npu.npu_chunk_gated_delta_rule(
            q.to(bf16).contiguous(),
            k.to(bf16).contiguous(),
            v.to(bf16).contiguous(),
            beta=beta.to(bf16).contiguous(),
            initial_state=initial.transpose(-1, -2).to(bf16).contiguous(),
            actual_seq_lengths=(query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32),
            scale=scale,
            g=g.float().contiguous(),
        )
        ssm_state[slots] = final.transpose(-1, -2).to(ssm_state.dtype)
        return out.to(v.dtype)

    def recurrent_gated_delta_rule(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        ssm_state: Tensor,
        state_indices: Tensor,
        scale: float,
    ) -> Tensor:
        batch, num_heads, dk = k.shape
        dv = v.shape[2]
        if dk > 512 or dv > 512 or num_heads > 256:
            self._fallback("recurrent_gated_delta_rule", f"heads {num_heads}, Dk {dk}, Dv {dv}")
            return delta_rule.recurrent_gated_delta_rule(
                q, k, v, g, beta, ssm_state=ssm_state, state_indices=state_indices, scale=scale
            )
        slots = state_indices.long()
        bf16 = torch.bfloat16
        # a compact copy of this step's states, token i reading and writing row i
        state = ssm_state[slots].transpose(-1, -2).to(bf16).contiguous()
        out = self.torch_npu.npu_recurrent_gated_delta_rule(
            q.to(bf16).contiguous(),
            k.to(bf16).contiguous(),
            v.to(bf16).contiguous(),
            state,
            beta=beta.to(bf16).contiguous(),
            scale=scale,
            actual_seq_lengths=torch.ones(batch, dtype=torch.int32, device=q.device),
            ssm_state_indices=torch.arange(batch, dtype=torch.int32, device=q.device),
            g=g.float().contiguous(),
        )
        ssm_state[slots] = state.transpose(-1, -2).to(ssm_state.dtype)
        return out.to(v.dtype)


def npu_ops() -> Ops:
    """Import torch_npu and build the NPU `Ops`."""
    kernels = NpuKernels(import_torch_npu())
    return Ops(
        linear=linear.linear,
        pack_linear_weight=linear.keep_weight,
        silu_and_mul=activation.silu_and_mul,
        rms_norm=kernels.rms_norm,
        add_rms_norm=kernels.add_rms_norm,
        gated_rms_norm=norm.gated_rms_norm,
        rotary=kernels.rotary,
        qk_norm_rotary=functools.partial(
            rotary.qk_norm_rotary, rms_norm=kernels.rms_norm, rotary=kernels.rotary
        ),
        write_kv=kernels.write_kv,
        paged_attention=kernels.paged_attention,
        paged_attention_decode=kernels.paged_attention_decode,
        causal_conv1d=conv.causal_conv1d,
        causal_conv1d_update=conv.causal_conv1d_update,
        chunk_gated_delta_rule=kernels.chunk_gated_delta_rule,
        recurrent_gated_delta_rule=kernels.recurrent_gated_delta_rule,
        gated_delta_net_inputs=delta_rule.gated_delta_net_inputs,
    )
