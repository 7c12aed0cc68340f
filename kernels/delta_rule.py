"""Gated delta rule (Gated DeltaNet core): chunked prefill of packed sequences, one-token decode.

Per value head, in fp32: S = S*exp(g_t); delta = beta_t*(v_t - S^T k_t); S = S + k_t (x) delta;
o_t = S^T (scale*q_t). The state S is `[Dk, Dv]`.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


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
    """The delta rule's q, k `[T, Hv, Dk]`, g and beta (fp32 `[T, Hv]`) from a Gated DeltaNet's
    conv output `mixed_qkv` `[T, 2 Hk Dk + ...]` and gate projections a, b `[T, Hv]`.

    q and k (the first two Hk Dk columns) are L2-normalised per head, each key head serving a
    run of Hv / Hk consecutive value heads; g = -exp(A_log) softplus(a + dt_bias) is the log
    decay and beta = sigmoid(b) the write strength.
    """
    T, key_dim = mixed_qkv.shape[0], num_k_heads * head_k_dim
    q = l2_normalize(mixed_qkv[:, :key_dim].reshape(T, num_k_heads, head_k_dim), eps)
    k = l2_normalize(mixed_qkv[:, key_dim : 2 * key_dim].reshape(T, num_k_heads, head_k_dim), eps)
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, g, b.sigmoid().float()


def _to_chunks(x: Tensor, chunk: Tensor, pos: Tensor, num_chunks: int) -> Tensor:
    """Scatter packed `[T, H, ...]` into zero-padded fp32 chunks `[N, H, C, ...]`."""
    out = torch.zeros((num_chunks, CHUNK_SIZE) + tuple(x.shape[1:]), device=x.device)
    out[chunk, pos] = x.float()
    return out.transpose(1, 2).contiguous()


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
    """Gated delta rule of packed sequences, in chunks of 64; updates `ssm_state` in place."""
    num_tokens, num_heads, _ = k.shape
    dv = v.shape[-1]
    device = q.device
    starts = query_start_loc.tolist()
    lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    num_seqs = len(lens)
    seq_chunks = [-(-n // CHUNK_SIZE) for n in lens]
    chunk_base = [sum(seq_chunks[:b]) for b in range(num_seqs)]
    total_chunks = sum(seq_chunks)

    slots = state_indices.long()
    state = ssm_state[slots].float()
    state = torch.where(has_initial_state.to(device)[:, None, None, None], state, 0.0)

    if total_chunks:
        # Padded positions get q=k=v=g=beta=0: they neither decay nor write the state.
        qsl = query_start_loc.to(device).long()
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), qsl[1:] - qsl[:-1], output_size=num_tokens
        )
        local = torch.arange(num_tokens, device=device) - qsl[:-1][seq_of_token]
        chunk = torch.tensor(chunk_base, device=device, dtype=torch.long)[seq_of_token]
        chunk = chunk + local // CHUNK_SIZE
        pos = local % CHUNK_SIZE
        qc, kc, vc, gc, bc = (_to_chunks(t, chunk, pos, total_chunks) for t in (q, k, v, g, beta))

        # Within a chunk, with G the cumulative log decay and S0 the incoming state:
        #   u = (I + A)^-1 (beta*v - beta*exp(G)*k S0),  A_ij = beta_i exp(G_i-G_j) k_i.k_j, j < i
        #   o = scale * (exp(G) q S0 + (exp(G_i - G_j) q_i.k_j)_{j<=i} u)
        #   S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j (x) u_j
        cum = gc.cumsum(-1)
        causal = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        a = ((kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]).tril(-1)
        a = a + torch.eye(CHUNK_SIZE, device=device)
        rhs = torch.cat((vc * bc[..., None], kc * (bc * cum.exp())[..., None]), dim=-1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u_part, w = solved.split([dv, kc.shape[-1]], dim=-1)
        attn = (qc @ kc.transpose(-1, -2)) * decay * scale
        q_decayed = qc * (cum.exp() * scale)[..., None]
        last = cum[..., -1:]
        k_decayed_t = (kc * (last - cum).exp()[..., None]).transpose(-1, -2)
        chunk_decay = last.exp()[..., None]  # [N, H, 1, 1]

        out = torch.empty(total_chunks, num_heads, CHUNK_SIZE, dv, device=device)
        for step in range(max(seq_chunks)):
            active = [b for b in range(num_seqs) if seq_chunks[b] > step]
            ids = torch.tensor([chunk_base[b] + step for b in active], device=device)
            rows = torch.tensor(active, device=device)
            s = state if len(active) == num_seqs else state[rows]
            u = u_part[ids] - w[ids] @ s
            out[ids] = q_decayed[ids] @ s + attn[ids] @ u
            s = chunk_decay[ids] * s + k_decayed_t[ids] @ u
            if len(active) == num_seqs:
                state = s
            else:
                state[rows] = s
        o = out.transpose(1, 2)[chunk, pos]
    else:
        o = torch.empty(0, num_heads, dv, device=device)

    ssm_state[slots] = state.to(ssm_state.dtype)
    return o.to(v.dtype)


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
    """One token per sequence: q/k `[B, Hv, Dk]`, v `[B, Hv, Dv]`; updates `ssm_state` in place."""
    batch, num_heads, dk = k.shape
    dv = v.shape[-1]
    slots = state_indices.long()
    state = ssm_state.index_select(0, slots).float()  # a fresh copy, updated in place below
    state.mul_(g.float().exp()[..., None, None])
    flat = state.view(batch * num_heads, dk, dv)
    kf = k.float().reshape(-1, 1, dk)
    delta = beta.float().reshape(-1, 1, 1) * (v.float().reshape(-1, 1, dv) - kf @ flat)
    flat.baddbmm_(kf.transpose(1, 2), delta)
    o = (q.float().reshape(-1, 1, dk) * scale) @ flat
    ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
    return o.view(batch, num_heads, dv).to(v.dtype)
