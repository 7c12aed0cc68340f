"""Packed-weight oneDNN convolutions against torch's own, over the geometries HiFi-GAN uses."""

import pytest
import torch
import torch.nn.functional as F

from kernels import onednn_conv

pytestmark = pytest.mark.skipif(
    not onednn_conv.packing_available(), reason="this torch build has no oneDNN convolutions"
)
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 here"
        ),
    ),
]


def _input(channels: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, channels, 1, width, generator=g).to(dtype)
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kernel,dilation,padding,width", [(7, 1, 3, 17), (3, 5, 0, 64), (11, 3, 15, 200), (3, 1, 1, 1)]
)
def test_conv2d_equals_torch(dtype, kernel, dilation, padding, width):
    g = torch.Generator().manual_seed(kernel * 10 + dilation)
    weight = (torch.randn(48, 32, 1, kernel, generator=g) / 10).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    x = _input(32, width, dtype, seed=width)
    packed = onednn_conv.pack_conv_weight(weight, dilation)
    assert packed.is_mkldnn
    got = onednn_conv.conv2d(x, packed, bias, padding, dilation)
    want = F.conv2d(x, weight, bias, padding=(0, padding), dilation=(1, dilation))
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "stride,kernel,padding,width", [(8, 16, 4, 9), (2, 4, 1, 33), (4, 8, 0, 2)]
)
def test_conv_transpose2d_equals_torch(dtype, stride, kernel, padding, width):
    g = torch.Generator().manual_seed(stride * 100 + kernel)
    weight = (torch.randn(32, 16, 1, kernel, generator=g) / 10).to(dtype)  # [in, out, 1, k]
    bias = torch.randn(16, generator=g).to(dtype)
    x = _input(32, width, dtype, seed=width)
    packed = onednn_conv.pack_conv_transpose_weight(weight, stride)
    got = onednn_conv.conv_transpose2d(x, packed, bias, padding, stride)
    want = F.conv_transpose2d(x, weight, bias, stride=(1, stride), padding=(0, padding))
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not onednn_conv.int8_available(), reason="no oneDNN int8 convolutions here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,dilation,padding,width", [(7, 1, 3, 17), (11, 5, 0, 300)])
def test_quantized_conv_is_the_float_conv_on_its_grid(dtype, kernel, dilation, padding, width):
    """An int8 conv gives what the float conv gives on its rounded operands (the input on its
    uint8 grid, the weight on its per-channel int8 one), up to the output's rounding; and,
    zero padding included, stays near the unrounded float conv."""
    g = torch.Generator().manual_seed(kernel)
    weight = torch.randn(48, 32, 1, kernel, generator=g) / 10
    bias = torch.randn(48, generator=g)
    x = torch.randn(1, 32, 1, width, generator=g).clamp(-2.5, 3).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    scale, zero_point = 5.5 / 255, 116
    conv = onednn_conv.QuantizedConv(weight, bias, dilation, scale, zero_point)
    got = conv(x, padding)
    assert got.dtype == dtype and got.shape[-1] == width + 2 * padding - (kernel - 1) * dilation
    w_grid = conv.weight.float() * conv.weight_scales[:, None, None, None]
    x_pad = F.pad(x.float(), (padding, padding))
    x_grid = ((torch.round(x_pad / scale) + zero_point).clamp(0, 255) - zero_point) * scale
    want = F.conv2d(x_grid, w_grid, bias, dilation=(1, dilation))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    exact = F.conv2d(x_pad, weight, bias, dilation=(1, dilation))
    assert (got.float() - exact).norm() / exact.norm() < 0.03  # 8 bits: about 1% here
    with pytest.raises(ValueError, match="zero_point in"):
        onednn_conv.QuantizedConv(weight, bias, dilation, scale, 300)
