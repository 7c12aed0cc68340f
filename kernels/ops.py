"""The `Ops` table and its per-device choice: pure-torch reference on cuda, the reference with
oneDNN projections and compiled kernels (kernels/csrc) on cpu, torch_npu on npu."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels import activation, attention, conv, cpu_ext, delta_rule, linear, norm, rotary


@dataclass(frozen=True)
class Ops:
    """Kernel entry points for one device type; signatures are the agreed kernel API."""

    linear: Callable
    pack_linear_weight: Callable  # at load: a weight in the layout `linear` runs fastest on
    silu_and_mul: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    gated_rms_norm: Callable
    rotary: Callable
    qk_norm_rotary: Callable
    write_kv: Callable
    paged_attention: Callable
    paged_attention_decode: Callable
    causal_conv1d: Callable
    causal_conv1d_update: Callable
    chunk_gated_delta_rule: Callable
    recurrent_gated_delta_rule: Callable
    gated_delta_net_inputs: Callable


REFERENCE_OPS = Ops(
    linear=linear.linear,
    pack_linear_weight=linear.keep_weight,
    silu_and_mul=activation.silu_and_mul,
    rms_norm=norm.rms_norm,
    add_rms_norm=norm.add_rms_norm,
    gated_rms_norm=norm.gated_rms_norm,
    rotary=rotary.rotary,
    qk_norm_rotary=rotary.qk_norm_rotary,
    write_kv=attention.write_kv,
    paged_attention=attention.paged_attention,
    paged_attention_decode=attention.paged_attention_decode,
    causal_conv1d=conv.causal_conv1d,
    causal_conv1d_update=conv.causal_conv1d_update,
    chunk_gated_delta_rule=delta_rule.chunk_gated_delta_rule,
    recurrent_gated_delta_rule=delta_rule.recurrent_gated_delta_rule,
    gated_delta_net_inputs=delta_rule.gated_delta_net_inputs,
)

_chosen: dict[str, Ops] = {}


def cpu_ops() -> Ops:
    """The reference with oneDNN projections and, where they build, the compiled kernels (decode
    attention and the KV write, RMS norms plain, residual and gated, SiLU-and-multiply, rotary
    with or without q/k norms, causal conv1d, gated delta rule and its inputs; bf16 projections
    on AMX and fp32 ones on AVX-512 where the CPU has them, or the small fp32 ones on AVX2)."""
    ops = REFERENCE_OPS
    if linear.onednn_available():
        ops = replace(ops, linear=linear.onednn_linear, pack_linear_weight=linear.pack_weight)
    if cpu_ext.build() is None:
        ops = replace(
            ops,
            paged_attention=cpu_ext.paged_attention,
            paged_attention_decode=cpu_ext.paged_attention_decode,
            rms_norm=cpu_ext.rms_norm,
            add_rms_norm=cpu_ext.add_rms_norm,
            gated_rms_norm=cpu_ext.gated_rms_norm,
            write_kv=cpu_ext.write_kv,
            silu_and_mul=cpu_ext.silu_and_mul,
            rotary=cpu_ext.rotary,
            qk_norm_rotary=cpu_ext.qk_norm_rotary,
            causal_conv1d=cpu_ext.causal_conv1d,
            causal_conv1d_update=cpu_ext.causal_conv1d_update,
            chunk_gated_delta_rule=cpu_ext.chunk_gated_delta_rule,
            recurrent_gated_delta_rule=cpu_ext.recurrent_gated_delta_rule,
            gated_delta_net_inputs=cpu_ext.gated_delta_net_inputs,
        )
        if cpu_ext.amx_linear_available() or cpu_ext.fp32_linear_available():
            ops = replace(ops, linear=cpu_ext.linear, pack_linear_weight=cpu_ext.pack_linear_weight)
    return ops


def get_ops(device: str | torch.device) -> Ops:
    """Return the `Ops` for a device ("cpu", "cuda:1", "npu", or a torch.device of those types)."""
    # parsed by hand: torch.device("npu") only exists once torch_npu has been imported
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if device_type not in _chosen:
        if device_type == "cpu":
            _chosen[device_type] = cpu_ops()
        elif device_type == "cuda":
            _chosen[device_type] = REFERENCE_OPS
        elif device_type == "npu":
            from kernels import npu  # imports torch_npu, so only when asked for

            _chosen[device_type] = npu.npu_ops()
        else:
            raise ValueError(
                f"no kernels for device type {device_type!r}; supported: cpu, cuda, npu"
            )
    return _chosen[device_type]
