"""Gated activations of fused projections."""

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(x: Tensor) -> Tensor:
    """`silu(gate) * up` where x is `[..., 2 * I]` = cat(gate, up) (a fused gate/up matmul)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
