"""NPU kernels against the reference, run on CPU through a torch_npu STAND-IN.

This is NOT a hardware test: no Ascend device or real torch_npu is involved. The stand-in
(tests/torch_npu_standin.py) checks every call against the documented torch_npu signatures and
computes results with plain torch, so these tests show that `kernels.npu` calls those
operations with the documented arguments and layouts and turns their results back into the
agreed kernel API.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.ops
from kernels.ops import REFERENCE_OPS
from tests import torch_npu_standin as standin

ref = REFERENCE_OPS


@pytest.fixture
def npu_ops(monkeypatch: pytest.MonkeyPatch):
    """NPU Ops built against the stand-in installed as sys.modules['torch_npu'] (restored after)."""
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    monkeypatch.setattr(kernels.ops, "_chosen", {})
    standin.calls.clear()
    torch.manual_seed(0)
    return kernels.get_ops("npu")


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def test_importing_kernels_does_not_import_torch_npu() -> None:
    code = "import sys, kernels; kernels.get_ops('cpu'); print('torch_npu' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_missing_torch_npu_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    monkeypatch.setattr(kernels.ops, "_chosen", {})
    with pytest.raises(RuntimeError, match="device 'npu' needs torch_npu"):
        kernels.get_ops("npu")


def test_get_ops_npu_is_chosen_once(npu_ops) -> None:
    assert kernels.get_ops("npu:3") is npu_ops
    assert npu_ops is not REFERENCE_OPS


def test_norms(npu_ops) -> None:
    x, res, w = torch.randn(5, 3, 32), torch.randn(5, 3, 32), torch.randn(32)
    for offset in (1.0, 0.0):
        close(npu_ops.rms_norm(x, w, 1e-6, offset), ref.rms_norm(x, w, 1e-6, offset), 1e-5)
        y, new_res = npu_ops.add_rms_norm(x, res, w, 1e-6, offset)
        y_ref, new_res_ref = ref.add_rms_norm(x, res, w, 1e-6, offset)
        close(y, y_ref, 1e-5)
        assert torch.equal(new_res, new_res_ref)
    assert standin.calls.count("npu_rms_norm") == 2
    assert standin.calls.count("npu_add_rms_norm") == 2


@pytest.mark.parametrize("rotary_dim", [8, 32])
def test_rotary(npu_ops, rotary_dim: int) -> None:
    cache = kernels.rope_cache(rotary_dim, 64, 1e4)
    positions = torch.tensor([3, 0, 63, 7])
    q, k = torch.randn(4, 4, 32), torch.randn(4, 2, 32)
    got_qk = npu_ops.rotary(positions, q, k, cache, rotary_dim)
    for got, want in zip(got_qk, ref.rotary(positions, q, k, cache, rotary_dim)):
        assert got.shape == want.shape
        close(got, want, 1e-5)
    assert standin.calls == ["npu_rotary_mul"] * 2


def test_write_kv_drops_negative_slots(npu_ops) -> None:
    cache_shape = (3, 128, 2, 16)
    k_npu, v_npu = (torch.randn(cache_shape, dtype=torch.bfloat16) for _ in range(2))
    k_ref, v_ref = k_npu.clone(), v_npu.clone()
    key, value = (torch.randn(4, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([300, -1, 5, 129])
    npu_ops.write_kv(key, value, k_npu, v_npu, slots)
    ref.write_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_npu, k_ref) and torch.equal(v_npu, v_ref)
    assert standin.calls == ["npu_scatter_pa_kv_cache"]


def paged_batch(q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=128):
    blocks = [-(-n // block_size) for n in kv_lens]
    perm = torch.randperm(sum(blocks) + 2)
    table = torch.zeros(len(q_lens), max(blocks) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used : used + n]
        used += n
    shape = (sum(blocks) + 2, block_size, num_kv_heads, head_dim)
    starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    return dict(
        q=torch.randn(sum(q_lens), num_heads, head_dim, dtype=torch.bfloat16),
        k_cache=torch.randn(shape, dtype=torch.bfloat16),
        v_cache=torch.randn(shape, dtype=torch.bfloat16),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=table,
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["gqa1", "gqa2", "gqa4"])
def test_paged_attention_mixed_batch(npu_ops, heads) -> None:
    batch = paged_batch([1, 1, 40, 130], [200, 3, 40, 300], *heads)
    q = batch.pop("q")
    out = npu_ops.paged_attention(q, **batch, scale=0.25)
    close(out, ref.paged_attention(q, **batch, scale=0.25), 1e-2)
    assert standin.calls == ["npu_fused_infer_attention_score"]


def test_paged_attention_takes_host_lengths(npu_ops) -> None:
    batch = paged_batch([1, 40, 130], [200, 40, 300])
    q = batch.pop("q")
    host = dict(
        query_start_loc_list=batch["query_start_loc"].tolist(),
        seq_lens_list=batch["seq_lens"].tolist(),
    )
    expected = ref.paged_attention(q, **batch, scale=0.25)
    batch["seq_lens"] = torch.ones_like(batch["seq_lens"])  # ignored: the host copy is used
    close(npu_ops.paged_attention(q, **batch, **host, scale=0.25), expected, 1e-2)
    # decode: the host copy alone reaches the op's context_lens (the device tensor is garbage)
    caches = dict(
        k_cache=batch["k_cache"],
        v_cache=batch["v_cache"],
        block_tables=batch["block_tables"][:1],
        scale=0.25,
    )
    out = npu_ops.paged_attention_decode(
        q[:1], **caches, seq_lens=torch.tensor([7]), seq_lens_list=[200]
    )
    close(out, ref.paged_attention_decode(q[:1], **caches, seq_lens=torch.tensor([200])), 1e-2)


def test_paged_attention_decode(npu_ops) -> None:
    batch = paged_batch([1, 1, 1], [129, 1, 260], num_heads=8, num_kv_heads=2)
    q = batch.pop("q")
    batch.pop("query_start_loc")
    out = npu_ops.paged_attention_decode(q, **batch, scale=0.25)
    close(out, ref.paged_attention_decode(q, **batch, scale=0.25), 1e-2)
    assert standin.calls == ["_npu_paged_attention"]


def test_paged_attention_falls_back_outside_documented_constraints(npu_ops) -> None:
    batch = paged_batch([3, 1], [5, 9], block_size=16)
    q = batch.pop("q").float()
    batch["k_cache"], batch["v_cache"] = batch["k_cache"].float(), batch["v_cache"].float()
    out = npu_ops.paged_attention(q, **batch, scale=0.5)
    assert torch.equal(out, ref.paged_attention(q, **batch, scale=0.5))
    assert standin.calls == []


def delta_inputs(num_tokens, heads=2, dim=128):
    q = F.normalize(torch.randn(num_tokens, heads, dim), dim=-1)
    k = F.normalize(torch.randn(num_tokens, heads, dim), dim=-1)
    v = torch.randn(num_tokens, heads, dim)
    g = -F.softplus(torch.randn(num_tokens, heads))
    beta = torch.rand(num_tokens, heads)
    return [t.bfloat16() for t in (q, k, v, beta)] + [g]


def test_chunk_gated_delta_rule(npu_ops) -> None:
    q, k, v, beta, g = delta_inputs(70)
    pool = torch.randn(4, 2, 128, 128) * 0.1
    pool_ref = pool.clone()
    args = dict(
        query_start_loc=torch.tensor([0, 5, 70]), state_indices=torch.tensor([3, 1]),
        has_initial_state=torch.tensor([True, False]), scale=128**-0.5,
    )  # fmt: skip
    out = npu_ops.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=pool, **args)
    out_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=pool_ref, **args)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.float32
    close(out, out_ref, 2e-2)
    close(pool, pool_ref, 2e-2)  # the op keeps its state in bfloat16
    assert torch.equal(pool[[0, 2]], pool_ref[[0, 2]])
    assert standin.calls == ["npu_chunk_gated_delta_rule"]


def test_recurrent_gated_delta_rule(npu_ops) -> None:
    q, k, v, beta, g = delta_inputs(3)
    pool = torch.randn(5, 2, 128, 128) * 0.1
    pool_ref = pool.clone()
    slots = torch.tensor([4, 0, 2])
    args = dict(state_indices=slots, scale=0.1)
    out = npu_ops.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state=pool, **args)
    out_ref = ref.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state=pool_ref, **args)
    close(out, out_ref, 2e-2)
    close(pool, pool_ref, 2e-2)
    assert torch.equal(pool[[1, 3]], pool_ref[[1, 3]])
    assert standin.calls == ["npu_recurrent_gated_delta_rule"]


def test_delta_rule_falls_back_for_small_heads(npu_ops) -> None:
    q, k, v, beta, g = delta_inputs(9, dim=16)
    pool, pool_ref = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
    args = dict(
        query_start_loc=torch.tensor([0, 9]), state_indices=torch.tensor([0]),
        has_initial_state=torch.tensor([False]), scale=0.25,
    )  # fmt: skip
    out = npu_ops.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=pool, **args)
    out_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, ssm_state=pool_ref, **args)
    assert torch.equal(out, out_ref)
    assert standin.calls == []


def test_conv_and_gated_norm_are_the_reference(npu_ops) -> None:
    assert npu_ops.causal_conv1d is ref.causal_conv1d
    assert npu_ops.causal_conv1d_update is ref.causal_conv1d_update
    assert npu_ops.gated_rms_norm is ref.gated_rms_norm


def test_standin_rejects_calls_the_documentation_rejects() -> None:
    # Guards the guard: the stand-in must refuse what torch_npu documents as invalid.
    q, k, v, beta, g = delta_inputs(4)
    lens = torch.tensor([4], dtype=torch.int32)
    state = torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    good = dict(beta=beta, initial_state=state, actual_seq_lengths=lens, scale=0.1, g=g)
    standin.npu_chunk_gated_delta_rule(q, k, v, **good)
    for bad in (
        dict(good, g=g.bfloat16()),  # g must be float32
        dict(good, initial_state=state.float()),  # state must be bfloat16
        dict(good, actual_seq_lengths=torch.tensor([0, 4], dtype=torch.int32)),  # lengths, not ends
    ):
        with pytest.raises(standin.StandInMismatch):
            standin.npu_chunk_gated_delta_rule(q, k, v, **bad)
    with pytest.raises(TypeError):
        standin.npu_chunk_gated_delta_rule(q, k, v, gamma=g, **good)  # unknown keyword
    cache = torch.zeros(2, 128, 2, 16, dtype=torch.bfloat16)
    key = torch.zeros(2, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(standin.StandInMismatch, match="slots"):
        standin.npu_scatter_pa_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, -1]))
    batch = paged_batch([2], [2])
    fia = dict(
        atten_mask=torch.ones(2048, 2048, dtype=torch.int8).tril(),  # wrong triangle
        block_table=batch["block_tables"], input_layout="TND", block_size=128,
        actual_seq_lengths=[2], actual_seq_lengths_kv=[2], num_key_value_heads=2,
        num_heads=4, scale=1.0, sparse_mode=3,
    )  # fmt: skip
    kv = batch["k_cache"].flatten(2)
    with pytest.raises(standin.StandInMismatch, match="triu"):
        standin.npu_fused_infer_attention_score(batch["q"], kv, kv, **fia)
