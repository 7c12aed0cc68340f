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


# Below this many multiply-adds a oneDNN call costs more than it saves (10-40 us of overhead
# per call against MKL's few; measured on the project's CPU, e.g. [4,192] x [192,1152]).
ONEDNN_MIN_MACS = 1 << 20


def keep_weight(weight: Tensor) -> Tensor:
    """The reference layout: weights stay as loaded."""
    return weight


# oneDNN picks its blocked layout for an expected row count; decode batches are this size.
PACK_ROWS_HINT = 64


def pack_weight(weight: Tensor) -> Tensor:
    """oneDNN's blocked layout of a `[out, in]` weight, taken once at load, for `onednn_linear`.

    An unpacked weight is re-blocked inside every matmul call; at decode batch sizes that cost
    as much as 15-30% of the call (measured on the project's CPU). Weights too small for oneDNN
    (see ONEDNN_MIN_MACS) and other dtypes stay as they are, for F.linear.
    """
    if (
        not onednn_available()
        or weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or weight.numel() < ONEDNN_MIN_MACS
    ):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """CPU: oneDNN's matmul, which picks its kernels by instruction set rather than CPU vendor.

    F.linear goes to MKL's sgemm, which on the AMD EPYC (AVX-512) of our CI machine ran at
    60-100 GFLOP/s per core against oneDNN's 140-230 for 16-256 rows (fp32, K=1024). Same
    fp32 arithmetic; only the summation order differs. Small products (a speech LM of a few
    million parameters decoding one sequence) and other dtypes stay on F.linear. `weight` may be
    the output of `pack_weight`.
    """
    packed = weight.is_mkldnn  # from pack_weight: big enough and of a oneDNN dtype
    if not packed and (
        x.dtype not in (torch.float32, torch.bfloat16)
        or weight.dtype != x.dtype
        or x.numel() * weight.shape[0] < ONEDNN_MIN_MACS
    ):
        return F.linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return y.view(*shape[:-1], weight.shape[0])
