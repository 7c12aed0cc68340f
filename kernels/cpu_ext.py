"""Compiled CPU kernels from kernels/csrc, built with the local C++ compiler on first use.

The build is cached under torch's extensions directory (`TORCH_EXTENSIONS_DIR` overrides it),
in a folder named after this machine's CPU features and the torch version, because it is
compiled with `-march=native`. When it cannot be built the callers keep the torch reference.
"""

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch
from torch import Tensor

from kernels import activation, attention, conv, delta_rule, linear as dense, norm, rotary as rope

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in (
        "paged_attention_cpu.cpp",
        "elementwise_cpu.cpp",
        "gated_delta_rule_cpu.cpp",
        "causal_conv1d_cpu.cpp",
        "amx_linear_cpu.cpp",
        "dense_fp32_cpu.cpp",
    )
]
_HEADERS = [_CSRC / "cpu_math.h"]
# -fno-trapping-math: without AVX-512's masked ops, gcc vectorises a loop over a clamped
# exponential (silu, softmax, sigmoid) only if it may evaluate both sides of the clamp, which
# floating-point traps forbid; nothing here reads the floating-point exception flags.
_CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp"]
_DTYPES = (torch.float32, torch.bfloat16)
_STALE_LOCK_S = 900  # a build takes well under a minute; an older lock is a killed build's


def _cpu_tag() -> str:
    """A short hash of what the binary depends on: CPU features, torch, Python, the compiler
    flags, our sources.

    The sources, and the folder they lie in, are part of it so that two copies of the project
    on one machine (a checkout and a worktree, an upgrade beside a running service) build into
    folders of their own instead of rebuilding over each other's binary and waiting on each
    other's lock: the build file names the sources by path, so two copies of the same sources
    also rebuilt each other's on every alternate start.
    """
    features = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            features += next(
                (line for line in cpuinfo if line.startswith(("flags", "Features"))), ""
            )
    except OSError:
        features += platform.processor()
    key = f"{features}|{torch.__version__}|{platform.python_version()}|{' '.join(_CFLAGS)}"
    key += f"|{_SOURCES[0].parent.resolve()}"
    digest = hashlib.sha256(key.encode())
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def _build_directory(name: str) -> Path:
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    # torch waits forever on the lock file of a build that was killed; clear an old one
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass
    return directory


@functools.cache
def build() -> str | None:
    """Build (or load the cached build of) the extension and register its ops.

    Returns None on success, else the error, which is also logged once as a warning.
    """
    name = f"splittts_cpu_kernels_{_cpu_tag()}"
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory(name)),
            is_python_module=False,
        )
    except Exception as exc:  # noqa: BLE001 - any failure to build or load: keep the reference
        logger.warning("compiled CPU kernels unavailable, using the torch reference: %s", exc)
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.cache
def amx_linear_available() -> bool:
    """Whether the extension built its AMX projections and the OS lets this process use the
    tiles (x86 CPUs with AMX-BF16, such as Xeon Sapphire Rapids and later)."""
    return build() is None and bool(torch.ops.splittts_kernels.amx_linear_available.default())


@functools.cache
def fp32_linear_available() -> bool:
    """Whether the extension built its fp32 projections (x86 CPUs with AVX-512, or AVX2 and
    FMA)."""
    return build() is None and bool(torch.ops.splittts_kernels.fp32_linear_available.default())


@functools.cache
def fp32_linear_form() -> str | None:
    """The form of the fp32 projections the build took for this CPU: "avx512", "avx2", or None
    where it has none."""
    if not fp32_linear_available():
        return None
    return str(torch.ops.splittts_kernels.fp32_linear_form.default())


def _packable(weight: Tensor, dtype: torch.dtype) -> bool:
    return (
        weight.dtype == dtype
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[0] % dense.PANEL_OUTPUTS == 0
        and weight.shape[1] % 32 == 0
    )


def pack_linear_weight(weight: Tensor) -> Tensor:
    """At load: a weight with both dims multiples of 32 in the layout of the compiled kernel for
    its dtype; any other weight (and any weight where that kernel is not built) as
    `dense.pack_weight` leaves it.

    - bf16, where the CPU has AMX, and the weight is big enough for a packed matmul
      (`dense.ONEDNN_MIN_MACS`): the AMX kernel's tile order, `[out/32, in/32, 2, 16, 32]`
      (csrc/amx_linear_cpu.cpp). oneDNN's bf16 matmul streamed the benchmark model's weights at
      15-23 GB/s for 1-64 rows on the project's CPU, where two threads can read 33; this kernel
      reads them at 22-33.
    - fp32, where the CPU has AVX-512 or AVX2, at any size: panels of 32 outputs,
      `[out/32, in, 32]` (csrc/dense_fp32_cpu.cpp), which stream from memory while the
      multiplies run. AVX-512: 0.83-0.87x oneDNN's time for 8-64 rows of the benchmark model,
      1.09x at 256-1024 (a prefill). AVX2 (AMD EPYC Zen 3, 2 threads): 0.78-0.91x from 8 rows
      to 256, 146-166 GFLOP/s from 32 rows, 1.07x at one row (both bound by memory there;
      `bench.amx_linear --dtype float32`). A small weight gains most: the default voice's LM
      (hidden 192) had its weights re-packed by MKL's sgemm in every call, 83 us a projection
      at 8 rows from memory, and its decode step at 8 sequences took 2.8 ms against 1.9 on
      this kernel (AMD EPYC Zen 4, one thread).
    """
    big = weight.numel() >= dense.ONEDNN_MIN_MACS
    if big and _packable(weight, torch.bfloat16) and amx_linear_available():
        return torch.ops.splittts_kernels.amx_pack_linear_weight.default(weight.detach())
    form = fp32_linear_form()
    if _packable(weight, torch.float32) and form in ("avx512", "avx2"):
        return torch.ops.splittts_kernels.fp32_pack_linear_weight.default(weight.detach())
    return dense.pack_weight(weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`dense.linear` on a weight from `pack_linear_weight`: the compiled kernel that packed it,
    `dense.onednn_linear` for the rest.

    Told apart by the weight's rank alone (only `pack_linear_weight` makes these): AMX tiles
    `[out/32, in/32, 2, 16, 32]`, fp32 panels `[out/32, in, 32]`. A step's rows (2-D, as the
    models pass them) go straight to the kernel: on a small LM every call's Python counts (the
    default voice's decode step makes 17 of them, and the reshape and view of other shapes
    cost as much as the kernel's own call, about 5 us on the project's AVX2 CPU)."""
    rank = weight.dim()
    if rank == 3:
        op = torch.ops.splittts_kernels.fp32_linear.default
    elif rank == 5:
        op = torch.ops.splittts_kernels.amx_linear.default
    else:
        return dense.onednn_linear(x, weight, bias)
    if x.dim() == 2:
        return op(x if x.is_contiguous() else x.contiguous(), weight, bias)
    shape = x.shape
    y = op(x.reshape(-1, shape[-1]).contiguous(), weight, bias)
    return y.view(*shape[:-1], y.shape[-1])


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
    """`attention.paged_attention_decode` reading the paged K/V in place (fp32 and bf16).

    Other dtypes, mixed dtypes and non-CPU tensors go to the reference.
    """
    if (
        q.dtype not in _DTYPES
        or k_cache.dtype != q.dtype
        or v_cache.dtype != q.dtype
        or q.device.type != "cpu"
    ):
        return attention.paged_attention_decode(
            q,
            k_cache,
            v_cache,
            seq_lens=seq_lens,
            block_tables=block_tables,
            scale=scale,
            seq_lens_list=seq_lens_list,
        )
    return torch.ops.splittts_kernels.paged_attention_decode.default(
        q.contiguous(),
        k_cache,
        v_cache,
        seq_lens.to(torch.int32).contiguous(),
        block_tables.to(torch.int32),
        scale,
    )


def paged_attention(
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
    """`attention.paged_attention` with its single-token sequences on the compiled decode."""
    return attention.paged_attention(
        q,
        k_cache,
        v_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        scale=scale,
        decode=paged_attention_decode,
        query_start_loc_list=query_start_loc_list,
        seq_lens_list=seq_lens_list,
    )


def _compiled(*tensors: Tensor) -> bool:
    """The compiled row kernels take CPU tensors of one dtype, fp32 or bf16. (Plain loops: a
    streamed vocoder call asks this over a hundred times.)"""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:  # is_cpu: no device object built per call
            return False
    return True


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
    """`norm.rms_norm` in one pass per row."""
    if not _compiled(x):
        return norm.rms_norm(x, weight, eps, offset)
    return torch.ops.splittts_kernels.rms_norm.default(x.contiguous(), weight, eps, offset)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 1.0
) -> tuple[Tensor, Tensor]:
    """`norm.add_rms_norm` in one pass per row."""
    if not _compiled(x, residual) or x.shape != residual.shape:
        return norm.add_rms_norm(x, residual, weight, eps, offset)
    return torch.ops.splittts_kernels.add_rms_norm.default(
        x.contiguous(), residual.contiguous(), weight, eps, offset
    )


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`norm.gated_rms_norm` in one pass per row, a strided gate read in place."""
    if not _compiled(x, gate) or x.dim() != 3 or gate.shape != x.shape or gate.stride(-1) != 1:
        return norm.gated_rms_norm(x, gate, weight, eps)
    return torch.ops.splittts_kernels.gated_rms_norm.default(x.contiguous(), gate, weight, eps)


def write_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    all_valid: bool | None = None,
) -> None:
    """`attention.write_kv` as one copy per token and cache, strided rows read in place."""
    if (
        not _compiled(key, value, k_cache, v_cache)
        or key.dim() != 3
        or value.dim() != 3
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
        or key.stride(1) != key.shape[2]
        or value.stride(1) != value.shape[2]
        or key.stride(2) != 1
        or value.stride(2) != 1
    ):
        attention.write_kv(key, value, k_cache, v_cache, slot_mapping, all_valid=all_valid)
        return
    torch.ops.splittts_kernels.write_kv.default(
        key, value, k_cache, v_cache, slot_mapping.long().contiguous()
    )


def silu_and_mul(x: Tensor) -> Tensor:
    """`activation.silu_and_mul` in one pass."""
    if not _compiled(x):
        return activation.silu_and_mul(x)
    return torch.ops.splittts_kernels.silu_and_mul.default(x.contiguous())


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor, rotary_dim: int
) -> tuple[Tensor, Tensor]:
    """`rotary.rotary` in one pass per token, the table looked up inside."""
    if not _compiled(q, k) or q.dim() != 3 or k.dim() != 3 or cos_sin_cache.dtype != torch.float32:
        return rope.rotary(positions, q, k, cos_sin_cache, rotary_dim)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    return torch.ops.splittts_kernels.rotary.default(
        positions.long().contiguous(), q, k, cos_sin_cache.contiguous(), rotary_dim
    )


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
) -> tuple[Tensor, Tensor]:
    """`rotary.qk_norm_rotary` in one pass per token, strided q and k read in place."""
    if (
        not _compiled(q, k)
        or q.dim() != 3
        or k.dim() != 3
        or q.stride(-1) != 1
        or k.stride(-1) != 1
        or cos_sin_cache.dtype != torch.float32
    ):
        return rope.qk_norm_rotary(
            positions,
            q,
            k,
            q_weight,
            k_weight,
            cos_sin_cache,
            rotary_dim,
            eps=eps,
            offset=offset,
            rms_norm=rms_norm,
            rotary=rotary,
        )
    return torch.ops.splittts_kernels.qk_norm_rotary.default(
        positions.long().contiguous(),
        q,
        k,
        q_weight,
        k_weight,
        cos_sin_cache.contiguous(),
        rotary_dim,
        eps,
        offset,
    )


def _channels_last_rows(*tensors: Tensor) -> bool:
    """[B, C, 1, T] tensors whose batches each hold T x C contiguous values (channels last)."""
    for t in tensors:
        shape = t.shape
        if len(shape) != 4 or shape[2] != 1:
            return False
        stride = t.stride()
        if (shape[1] != 1 and stride[1] != 1) or (shape[3] > 1 and stride[3] != shape[1]):
            return False
    return True


def _rest(first: Tensor, then: Tensor, start: int) -> Tensor:
    """`torch.cat([first, then], -1)[..., start:]` in storage of its own, in `then`'s layout."""
    fmt = torch.channels_last if _channels_last_rows(then) and then.shape[1] > 1 else None
    rest = torch.cat([first, then], -1)[..., start:]
    return rest.clone(memory_format=fmt or torch.contiguous_format)


def join_channels_last(
    first: Tensor, then: Tensor, slope: float | None = None, keep: int = 0
) -> tuple[Tensor, Tensor]:
    """(`torch.cat([first, leaky_relu(then, slope)], -1)` of `[B, C, 1, T]` tensors (no
    activation without a slope) in channels-last layout, its last `keep` samples in storage of
    their own), in one pass over `then` (the compiled kernel where both are channels last)."""
    if _compiled(first, then) and _channels_last_rows(first, then) and build() is None:
        return torch.ops.splittts_kernels.join_channels_last.default(
            first, then, 1.0 if slope is None else slope, keep
        )
    n = first.shape[-1]
    out = torch.empty(
        (*then.shape[:-1], n + then.shape[-1]),
        dtype=then.dtype,
        device=then.device,
        memory_format=torch.channels_last,
    )
    out[..., :n].copy_(first)
    if slope is None:
        out[..., n:].copy_(then)
    else:
        torch._C._nn.leaky_relu(then, slope, out=out[..., n:])
    keep = min(keep, out.shape[-1])
    return out, out[..., out.shape[-1] - keep :].clone(memory_format=torch.channels_last)


def add_joined_(t: Tensor, first: Tensor, then: Tensor) -> tuple[Tensor, Tensor]:
    """`t += torch.cat([first, then], -1)[..., :T]` in place, for `[B, C, 1, T]` tensors, without
    the join (the compiled kernel where all three are channels last); returns `t` and the rest
    of the join (from T on) in storage of its own."""
    if _compiled(t, first, then) and _channels_last_rows(t, first, then) and build() is None:
        return t, torch.ops.splittts_kernels.add_joined_.default(t, first, then)
    length = t.shape[-1]
    return t.add_(torch.cat([first, then], -1)[..., :length]), _rest(first, then, length)


def mean_joined(
    firsts: list[Tensor], thens: list[Tensor], length: int
) -> tuple[Tensor, list[Tensor]]:
    """`sum(cat([f, t], -1)[..., :length] for f, t in zip(firsts, thens)) / len(firsts)` of
    `[B, C, 1, T]` tensors, summed in that order, without the joins and in one pass (the
    compiled kernel, with a channels-last result, where all are channels last); and each join's
    rest (from `length` on) in storage of its own."""
    tensors = [*firsts, *thens]
    if _compiled(*tensors) and _channels_last_rows(*tensors) and build() is None:
        return torch.ops.splittts_kernels.mean_joined.default(firsts, thens, length)
    parts = [torch.cat([f, t], -1)[..., :length] for f, t in zip(firsts, thens)]
    rests = [_rest(f, t, length) for f, t in zip(firsts, thens)]
    return sum(parts[1:], parts[0]) / len(parts), rests


def quantize_u8(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """`x` (fp32 or bf16) as uint8 on the affine grid of `scale` and `zero_point`:
    `clamp(round(x * (1 / scale)) + zero_point, 0, 255)`, rounding half to even, in `x`'s memory
    layout (the compiled kernel where `x` is dense)."""
    dense = x.is_contiguous() or (
        x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)
    )
    if _compiled(x) and dense and build() is None:
        return torch.ops.splittts_kernels.quantize_u8.default(x, scale, zero_point)
    q = torch.round(x.float() * (1.0 / scale)) + zero_point
    return q.clamp_(0, 255).to(torch.uint8)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    *,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
) -> Tensor:
    """`conv.causal_conv1d` in one pass over the tokens, the state slots updated in place."""
    if not _compiled(x, conv_state) or x.dim() != 2 or not conv_state.is_contiguous():
        return conv.causal_conv1d(
            x,
            weight,
            conv_state,
            query_start_loc=query_start_loc,
            state_indices=state_indices,
            has_initial_state=has_initial_state,
        )
    return torch.ops.splittts_kernels.causal_conv1d.default(
        _last_dim_contiguous(x),
        weight,
        conv_state,
        query_start_loc.long().contiguous(),
        state_indices.long().contiguous(),
        has_initial_state.bool().contiguous(),
    )


def causal_conv1d_update(
    x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor
) -> Tensor:
    """`conv.causal_conv1d_update` reading and writing the state slots in place."""
    if not _compiled(x, conv_state) or x.dim() != 2 or not conv_state.is_contiguous():
        return conv.causal_conv1d_update(x, weight, conv_state, state_indices)
    return torch.ops.splittts_kernels.causal_conv1d.default(
        _last_dim_contiguous(x), weight, conv_state, None, state_indices.long().contiguous(), None
    )


def _delta_rule_compiled(q: Tensor, k: Tensor, v: Tensor, ssm_state: Tensor) -> bool:
    return (
        _compiled(q, k, v)
        and q.dim() == 3
        and ssm_state.dtype == torch.float32
        and ssm_state.device.type == "cpu"
        and ssm_state.is_contiguous()
    )


def chunk_gated_delta_rule(
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
    """`delta_rule.chunk_gated_delta_rule` as a recurrence over each sequence's tokens with its
    state held in cache, read and written in its slot in place."""
    if not _delta_rule_compiled(q, k, v, ssm_state):
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
    return torch.ops.splittts_kernels.gated_delta_rule.default(
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        _last_dim_contiguous(v),
        g.float(),
        beta.float(),
        ssm_state,
        query_start_loc.long().contiguous(),
        state_indices.long().contiguous(),
        has_initial_state.bool().contiguous(),
        scale,
    )


def recurrent_gated_delta_rule(
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
    """`delta_rule.recurrent_gated_delta_rule` reading and writing the state slots in place."""
    if not _delta_rule_compiled(q, k, v, ssm_state):
        return delta_rule.recurrent_gated_delta_rule(
            q, k, v, g, beta, ssm_state=ssm_state, state_indices=state_indices, scale=scale
        )
    return torch.ops.splittts_kernels.gated_delta_rule.default(
        _last_dim_contiguous(q),
        _last_dim_contiguous(k),
        _last_dim_contiguous(v),
        g.float(),
        beta.float(),
        ssm_state,
        None,
        state_indices.long().contiguous(),
        None,
        scale,
    )


def gated_delta_net_inputs(
    mixed_qkv: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    num_k_heads: int,
    head_k_dim: int,
    num_v_heads: int,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`delta_rule.gated_delta_net_inputs` in one pass per token."""
    if not _compiled(mixed_qkv, a, b) or mixed_qkv.dim() != 2:
        return delta_rule.gated_delta_net_inputs(
            mixed_qkv,
            a,
            b,
            A_log,
            dt_bias,
            num_k_heads=num_k_heads,
            head_k_dim=head_k_dim,
            num_v_heads=num_v_heads,
            eps=eps,
        )
    return torch.ops.splittts_kernels.gated_delta_net_inputs.default(
        _last_dim_contiguous(mixed_qkv),
        _last_dim_contiguous(a),
        _last_dim_contiguous(b),
        A_log,
        dt_bias,
        num_k_heads,
        head_k_dim,
        num_v_heads,
        eps,
    )
