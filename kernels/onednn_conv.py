"""Height-1 2-D convolutions on the CPU through oneDNN, with their weights packed once.

`F.conv2d` and `F.conv_transpose2d` re-block the weight into oneDNN's layout on every call. For
a vocoder's layers on short streaming chunks that costs more than the convolution: measured on
the project's CPU (AMX bf16, one thread, `[1, 256, 1, 64]` input) a conv went from 107 to 45 us
and a stride-8 transposed conv from 562 to 84 us with the weight packed at load. The output is
the same arithmetic (equal to F.conv2d's on the shapes tested in tests/test_kernels_onednn_conv.py).

Weights are `[out, in, 1, k]` (conv) or `[in, out, 1, k]` (transposed conv) in fp32 or bf16;
inputs `[B, C, 1, T]` of the same dtype, best in channels-last layout.
"""

import torch
from torch import Tensor

from kernels.linear import onednn_available

# oneDNN picks a blocked layout for an expected input width; streaming chunks are about this long
_WIDTH_HINT = 64


def packing_available() -> bool:
    return onednn_available() and hasattr(torch.ops.mkldnn, "_convolution_transpose_pointwise")


def pack_conv_weight(weight: Tensor, dilation: int = 1) -> Tensor:
    """oneDNN's layout of a height-1 conv weight `[out, in, 1, k]`, for `conv2d`."""
    return torch.ops.mkldnn._reorder_convolution_weight(
        weight.detach().contiguous(),
        [0, 0],
        [1, 1],
        [1, dilation],
        1,
        [1, weight.shape[1], 1, _WIDTH_HINT],
    )


def pack_conv_transpose_weight(weight: Tensor, stride: int) -> Tensor:
    """oneDNN's layout of a height-1 transposed conv weight `[in, out, 1, k]`, for
    `conv_transpose2d`."""
    return torch.ops.mkldnn._reorder_convolution_transpose_weight(
        weight.detach().contiguous(),
        [0, 0],
        [0, 0],
        [1, stride],
        [1, 1],
        1,
        [1, weight.shape[0], 1, _WIDTH_HINT],
    )


def conv2d(x: Tensor, packed: Tensor, bias: Tensor | None, padding: int, dilation: int) -> Tensor:
    """`F.conv2d(x, w, bias, padding=(0, padding), dilation=(1, dilation))` on a packed `w`."""
    return torch.ops.mkldnn._convolution_pointwise(
        x, packed, bias, [0, padding], [1, 1], [1, dilation], 1, "none", [], ""
    )


def conv_transpose2d(
    x: Tensor, packed: Tensor, bias: Tensor | None, padding: int, stride: int
) -> Tensor:
    """`F.conv_transpose2d(x, w, bias, stride=(1, stride), padding=(0, padding))` on a packed
    `w`."""
    return torch.ops.mkldnn._convolution_transpose_pointwise(
        x, packed, bias, [0, padding], [0, 0], [1, stride], [1, 1], 1, "none", [], ""
    )
