"""The fp32 projection (kernels/csrc/dense_fp32_cpu.cpp) against F.linear, its weight layout
against the panel order written out, and the choice of which weights it takes. Runs where the CPU
has AVX-512 or AVX2 (the build takes the widest: every x86 CI machine so far has one of them)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext, linear

pytestmark = pytest.mark.skipif(
    not cpu_ext.fp32_linear_available(), reason="this CPU or build has neither AVX-512 nor AVX2"
)
dense = torch.ops.splittts_kernels


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # the same fp32 products summed in another order over K = 2304: ~1e-6 relative to the terms
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-4)


# AVX-512: 1-8 rows are one register block of their own size over one panel; more rows go in
# blocks of up to 7 over a pair of panels, as even as they come; 96 outputs are a pair and a lone
# panel. AVX2: blocks of up to 6 rows over half a panel (5, 6, 7 and 13 rows: one block, one
# full, two uneven, three). K = 2304 puts 113 rows in a chunk, so 300 rows span three chunks
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 8, 9, 13, 15, 29, 64, 113, 114, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_matches_f_linear(rows, bias) -> None:
    w = torch.randn(96, 2304)
    b = torch.randn(96) if bias else None
    x = torch.randn(rows, 2304)
    close(dense.fp32_linear(x, dense.fp32_pack_linear_weight(w), b), F.linear(x, w, b))


@pytest.mark.parametrize("k", [2304, 195, 3])
def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(k) -> None:
    # a decode of one sequence and of eight must give that sequence the same logits: each
    # output's products are summed in the same order whatever the block's row count (AVX2 runs a
    # lone row's K segments side by side, more rows' one after another); K = 195 and 3 leave
    # K % 4 inputs for the last segment, and 3 leaves the first three segments empty
    w, b = torch.randn(64, k), torch.randn(64)
    x = torch.randn(13, k)
    packed = dense.fp32_pack_linear_weight(w)
    alone = torch.cat([dense.fp32_linear(x[i : i + 1], packed, b) for i in range(13)])
    for rows in range(2, 14):
        assert torch.equal(dense.fp32_linear(x[:rows], packed, b), alone[:rows]), rows


def test_every_output_and_row_lands_in_its_place() -> None:
    # small integers: every product and sum is exact, so a misplaced row, output or input index
    # shows as an exact mismatch
    w = torch.randint(-3, 4, (128, 96)).float()
    x = torch.randint(-3, 4, (50, 96)).float()
    b = torch.arange(128).float()
    y = dense.fp32_linear(x, dense.fp32_pack_linear_weight(w), b)
    assert torch.equal(y, x @ w.T + b)


def test_the_packed_layout_is_panels_of_32_outputs() -> None:
    w = torch.randn(64, 40)
    packed = dense.fp32_pack_linear_weight(w)
    assert packed.shape == (2, 40, 32) and packed.is_contiguous()
    for p, k, c in [(0, 0, 0), (1, 39, 31), (0, 17, 5), (1, 3, 20)]:
        # panel p, input index k, output c of the panel
        assert packed[p, k, c] == w[p * 32 + c, k]


def test_pack_linear_weight_takes_fp32_weights_whose_dims_are_multiples_of_32() -> None:
    w = torch.randn(2048, 1024)
    assert cpu_ext.pack_linear_weight(w).shape == (64, 1024, 32)  # AVX-512 and AVX2 alike
    # small ones too (the default voice's LM: MKL re-packs them in every call)
    assert cpu_ext.pack_linear_weight(torch.randn(64, 192)).shape == (2, 192, 32)
    # a weight with 16 spare outputs keeps oneDNN, a small one F.linear
    odd = torch.randn(2000, 1024)
    assert cpu_ext.pack_linear_weight(odd).is_mkldnn == linear.onednn_available()
    small_odd = torch.randn(6, 192)
    assert cpu_ext.pack_linear_weight(small_odd) is small_odd


@pytest.mark.parametrize("shape", [(1, 1024), (3, 5, 1024), (0, 1024)])
def test_linear_runs_packed_fp32_weights_on_the_kernel(shape) -> None:
    w, b = torch.randn(512, 1024), torch.randn(512)  # small enough for either form
    packed = cpu_ext.pack_linear_weight(w)
    assert packed.dim() == 3
    x = torch.randn(*shape[:-1], 2048)[..., ::2]  # a view, not contiguous
    y = cpu_ext.linear(x, packed, b)
    assert y.shape == (*shape[:-1], 512)
    close(y, F.linear(x, w, b))


def test_bad_arguments_name_the_argument_and_the_rule() -> None:
    w = torch.randn(64, 64)
    packed = dense.fp32_pack_linear_weight(w)
    with pytest.raises(TypeError, match="x must be float32"):
        dense.fp32_linear(torch.randn(2, 64).bfloat16(), packed, None)
    with pytest.raises(ValueError, match=r"x must be a contiguous \[rows, 64\] cpu tensor"):
        dense.fp32_linear(torch.randn(2, 32), packed, None)
    with pytest.raises(ValueError, match="must come from fp32_pack_linear_weight"):
        dense.fp32_linear(torch.randn(2, 64), w, None)
    with pytest.raises(ValueError, match=r"bias must be \[64\]"):
        dense.fp32_linear(torch.randn(2, 64), packed, torch.zeros(63))
    with pytest.raises(ValueError, match="out a multiple of 32"):
        dense.fp32_pack_linear_weight(torch.randn(48, 64))
    with pytest.raises(TypeError, match="weight must be float32"):
        dense.fp32_pack_linear_weight(torch.randn(64, 64).bfloat16())
