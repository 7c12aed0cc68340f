"""Height-1 2-D convolutions on the CPU through oneDNN, with their weights packed once.

`F.conv2d` and `F.conv_transpose2d` re-block the weight into oneDNN's layout on every call. For
a vocoder's layers on short streaming chunks that costs more than the convolution: measured on
the project's CPU (AMX bf16, one thread, `[1, 256, 1, 64]` input) a conv went from 107 to 45 us
and a stride-8 transposed conv from 562 to 84 us with the weight packed at load. The output is
the same arithmetic (equal to F.conv2d's on the shapes tested in tests/test_kernels_onednn_conv.py).

Weights are `[out, in, 1, k]` (conv) or `[in, out, 1, k]` (transposed conv) in fp32 or bf16;
inputs `[B, C, 1, T]` of the same dtype, best in channels-last layout. `QuantizedConv` runs a
conv in int8 (oneDNN's u8s8 convolution, AVX-512 VNNI's `vpdpbusd`).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_ext
from kernels.linear import onednn_available, onednn_bf16_available

# oneDNN picks a blocked layout for an expected input width; streaming chunks are about this long
_WIDTH_HINT = 64
# oneDNN blocks a conv's weight by how many outputs the call makes (its AMX bf16 convolutions on
# the project's CPU: another blocking below 8 outputs for some layers, 32 output channels to a
# block below 56, 64 from there). Each class: (outputs below which it applies, outputs hinted).
WIDTH_CLASSES = ((8, 4), (56, 32), (None, _WIDTH_HINT))


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack conv weights of `dtype` (fp32 or bf16) on this CPU."""
    if dtype == torch.bfloat16 and not onednn_bf16_available():
        return False
    return onednn_available() and hasattr(torch.ops.mkldnn, "_convolution_transpose_pointwise")


class PackedConv:
    """A height-1 conv weight `[out, in, 1, k]` in oneDNN's layout, once per width class met. A
    weight packed for one class is re-blocked on every call of another: up to 120 us a conv, a
    third of a streamed HiFi-GAN V1 call on a 4-frame chunk. The wide class is packed at once,
    the others when first used."""

    def __init__(self, weight: Tensor, dilation: int = 1):
        self.weight = weight.detach().contiguous()
        self.dilation = dilation
        self.span = (weight.shape[-1] - 1) * dilation  # inputs beyond outputs
        self._packed: dict[int, Tensor] = {}
        self.for_outputs(1 << 30)

    def for_outputs(self, outputs: int) -> Tensor:
        """The packing for a call making `outputs` samples."""
        hint = _hinted_outputs(outputs)
        packed = self._packed.get(hint)
        if packed is None:  # two threads may both pack: equal tensors, one kept
            packed = self._packed.setdefault(hint, self._reorder(hint))
        return packed

    def _reorder(self, outputs: int) -> Tensor:
        return torch.ops.mkldnn._reorder_convolution_weight(
            self.weight,
            [0, 0],
            [1, 1],
            [1, self.dilation],
            1,
            [1, self.weight.shape[1], 1, outputs + self.span],
        )

    @property
    def is_mkldnn(self) -> bool:
        return all(p.is_mkldnn for p in self._packed.values())


def _hinted_outputs(outputs: int) -> int:
    """The outputs hinted for the width class `outputs` falls in."""
    for below, hint in WIDTH_CLASSES:
        if below is None or outputs < below:
            return hint
    raise AssertionError("the last width class has no bound")


def pack_conv_weight(weight: Tensor, dilation: int = 1) -> PackedConv:
    """oneDNN's layouts of a height-1 conv weight `[out, in, 1, k]`, for `conv2d`."""
    return PackedConv(weight, dilation)


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


def conv2d(
    x: Tensor, packed: PackedConv, bias: Tensor | None, padding: int, dilation: int
) -> Tensor:
    """`F.conv2d(x, w, bias, padding=(0, padding), dilation=(1, dilation))` on a packed `w`."""
    return torch.ops.mkldnn._convolution_pointwise(
        x,
        packed.for_outputs(x.shape[-1] + 2 * padding - packed.span),
        bias,
        [0, padding],
        [1, 1],
        [1, dilation],
        1,
        "none",
        [],
        "",
    )


def conv_transpose2d(
    x: Tensor, packed: Tensor, bias: Tensor | None, padding: int, stride: int
) -> Tensor:
    """`F.conv_transpose2d(x, w, bias, stride=(1, stride), padding=(0, padding))` on a packed
    `w`."""
    return torch.ops.mkldnn._convolution_transpose_pointwise(
        x, packed, bias, [0, padding], [0, 0], [1, stride], [1, 1], 1, "none", [], ""
    )


def int8_available() -> bool:
    """Whether oneDNN's int8 convolutions are exact here: this torch has them, and the CPU has
    AVX-512 VNNI. Without VNNI (AVX2 alone, an AMD Zen 3 say) oneDNN's u8s8 products go through
    `vpmaddubsw`, which saturates pairs of products at 16 bits: off the float conv by up to half
    of the output's range on a few percent of outputs (tests/test_kernels_onednn_conv.py)."""
    return (
        onednn_available()
        and hasattr(torch.ops.onednn, "qconv2d_pointwise")
        and bool(torch.cpu._is_vnni_supported())
    )


class QuantizedConv:
    """A height-1 conv in int8 through oneDNN: the weight `[out, in, 1, k]` rounded to int8 per
    output channel (symmetric, packed once), the input to uint8 on the affine grid `scale`,
    `zero_point` that the caller measured for it (`cpu_ext.quantize_u8`), sums in int32; the
    output in the input's dtype (fp32 or bf16), bias added in fp32.

    Called as `conv(x, padding)` on `[B, C, 1, T]`: zero padding is added before the rounding,
    so a padded sample is the grid's nearest value to 0, as in the float conv."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, dilation: int, scale: float, zero_point: int
    ):
        if not scale > 0 or not 0 <= zero_point <= 255:
            raise ValueError(
                f"need scale > 0 and zero_point in [0, 255] (got {scale} and {zero_point})"
            )
        w = weight.detach().float()
        self.weight_scales = (w.abs().amax(dim=(1, 2, 3)) / 127).clamp_min(1e-12)
        q = torch.round(w / self.weight_scales[:, None, None, None]).clamp_(-127, 127)
        self.weight = q.to(torch.int8)
        self.weight_zero_points = torch.zeros(w.shape[0], dtype=torch.int64)
        self.bias = None if bias is None else bias.detach().float()
        self.dilation, self.scale, self.zero_point = dilation, float(scale), int(zero_point)
        self._packed = torch.ops.onednn.qconv_prepack(
            self.weight, self.weight_scales, self.scale, self.zero_point,
            [1, 1], [0, 0], [1, dilation], 1, None,
        )  # fmt: skip

    def __call__(self, x: Tensor, padding: int = 0) -> Tensor:
        if padding:
            x = F.pad(x, (padding, padding))
        q = cpu_ext.quantize_u8(x, self.scale, self.zero_point)
        return torch.ops.onednn.qconv2d_pointwise(
            q, self.scale, self.zero_point, self._packed, self.weight_scales,
            self.weight_zero_points, self.bias, [1, 1], [0, 0], [1, self.dilation], 1,
            1.0, 0, x.dtype, "none", [], "",
        )  # fmt: skip
