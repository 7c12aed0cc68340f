"""Depthwise causal conv1d + SiLU over packed variable-length sequences, with per-slot state."""

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    *,
    query_start_loc: Tensor,
    state_indices: Tensor,
    has_initial_state: Tensor,
) -> Tensor:
    """Causal depthwise conv + SiLU on x `[T, C]`; conv_state holds K-1 inputs of left context."""
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    num_seqs = state_indices.shape[0]
    device = x.device
    starts = query_start_loc.to(device).long()
    lens = starts[1:] - starts[:-1]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), lens, output_size=num_tokens
    )
    # One buffer holding, per sequence, `width` rows of left context followed by its tokens:
    # sequence b occupies rows starts[b] + b*width ... starts[b+1] + (b+1)*width - 1.
    ext = torch.empty(num_tokens + num_seqs * width, channels, device=device)
    token_rows = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * width
    ext[token_rows] = x.float()
    slots = state_indices.long()
    offsets = torch.arange(width, device=device)
    if width:
        context = conv_state[slots].float().transpose(1, 2)  # [B, width, C]
        context = torch.where(has_initial_state.to(device)[:, None, None], context, 0.0)
        seq_base = starts[:-1] + torch.arange(num_seqs, device=device) * width
        ext[(seq_base[:, None] + offsets).flatten()] = context.reshape(-1, channels)

    w = weight.float()
    y = torch.zeros(num_tokens, channels, device=device)
    for j in range(width + 1):
        y += ext[token_rows - (width - j)] * w[:, j]

    if width:
        seq_end = starts[1:] + torch.arange(1, num_seqs + 1, device=device) * width
        last = ext[(seq_end[:, None] - width + offsets).flatten()].view(num_seqs, width, channels)
        conv_state[slots] = last.transpose(1, 2).to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


def causal_conv1d_update(
    x: Tensor, weight: Tensor, conv_state: Tensor, state_indices: Tensor
) -> Tensor:
    """One new token per sequence, x `[B, C]`; same state semantics as `causal_conv1d`."""
    slots = state_indices.long()
    window = torch.cat((conv_state[slots].float(), x.float().unsqueeze(-1)), dim=-1)  # [B, C, K]
    w = weight.float()
    y = torch.zeros(x.shape, device=x.device)
    for j in range(w.shape[1]):
        y += window[..., j] * w[:, j]
    conv_state[slots] = window[..., 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)
