"""RMS norms: the plain, the residual-fused and the gated (Gated DeltaNet output) form."""

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalize(x: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0) -> Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (offset + weight)` in fp32, returned in x.dtype."""
    return (_normalize(x, eps) * (offset + weight.float())).to(x.dtype)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Return `(rms_norm(x + residual), x + residual)`."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, offset), new_residual


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm(x, offset 0) * weight * silu(gate)` over the last dim, fp32 inside."""
    y = _normalize(x, eps) * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)
