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
