"""Dense projections y = x W^T (+ b) with the checkpoint's `[out, in]` weight layout."""

import torch
import torch.nn.functional as F
from torch import Tensor


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Reference: `F.linear` (BLAS on CPU, cuBLAS on CUDA)."""
    return F.linear(x, weight, bias)


def onednn_available() -> bool:
    """Whether torch was built with oneDNN's CPU matmul (x86 and arm64 wheels are)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Weights of fewer parameters stay unpacked, on F.linear: for them a oneDNN call costs more than
# it saves (10-40 us of overhead per call against MKL's few, e.g. [4,192] x [192,1152]), and
# each new row count compiles a primitive (see `onednn_linear`).
ONEDNN_MIN_MACS = 1 << 20


def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bf16 on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX). Elsewhere
    (an AMD Zen 3, say: AVX2 only) it refuses to pack a bf16 weight at all, and bf16 matmuls run
    on torch's own fallback."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def keep_weight(weight: Tensor) -> Tensor:
    """The reference layout: weights stay as loaded."""
    return weight


# Outputs per panel of the compiled kernels' packed weights (kernels.cpu_ext.pack_linear_weight):
# a weight they pack has a multiple of this many rows.
PANEL_OUTPUTS = 32

# oneDNN picks its blocked layout for an expected row count; decode batches are this size.
PACK_ROWS_HINT = 64


def pack_weight(weight: Tensor) -> Tensor:
    """oneDNN's blocked layout of a `[out, in]` weight, taken once at load, for `onednn_linear`.

    An unpacked weight is re-blocked inside every matmul call; at decode batch sizes that cost
    as much as 15-30% of the call (measured on the project's CPU). Weights too small for oneDNN
    (see ONEDNN_MIN_MACS), other dtypes, and bf16 where oneDNN has no bf16 on this CPU
    (`onednn_bf16_available`) stay as they are, for F.linear.
    """
    if (
        not onednn_available()
        or weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.numel() < ONEDNN_MIN_MACS
        or (weight.dtype == torch.bfloat16 and not onednn_bf16_available())
    ):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """CPU: oneDNN's matmul on a weight packed by `pack_weight`, which picks its kernels by
    instruction set rather than CPU vendor; any other weight goes to F.linear.

    F.linear goes to MKL's sgemm, which on the AMD EPYC (AVX-512) of our CI machine ran at
    60-100 GFLOP/s per core against oneDNN's 140-230 for 16-256 rows (fp32, K=1024). Same
    fp32 arithmetic; only the summation order differs. A weight too small to pack (a speech LM
    of a few million parameters) stays on F.linear at every row count: oneDNN compiles a
    primitive for each new one, 0.5-13 ms per projection shape for products of tens of
    microseconds, and compiled it was still slower than MKL for them (0.15-0.3 ms against
    0.06-0.09 for 37-53 rows of 192 x 576, on the project's Intel CPU). A prefill of the default
    voice's LM on a prompt length not seen before took 10.0-11.3 ms that way, and 6.1-8.1 ms
    on F.linear (41-88 prompt tokens, one thread).
    """
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return y.view(*shape[:-1], weight.shape[0])
