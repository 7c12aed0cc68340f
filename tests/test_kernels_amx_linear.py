"""The AMX bf16 projection (kernels/csrc/amx_linear_cpu.cpp) against fp32 products rounded once
to bf16, its weight layout against the tile order written out, and the choice of which weights
it takes. Runs where the CPU has AMX-BF16 (the project's CI machine does)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext, linear

pytestmark = pytest.mark.skipif(
    not cpu_ext.amx_linear_available(), reason="this CPU or build has no AMX-BF16"
)
amx = torch.ops.splittts_kernels


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def rounded_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The same bf16 products summed in fp32 (another order), rounded once to bf16."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()


def assert_within_a_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # two fp32 sums of the same products differ by far less than a bf16 step, so the results
    # agree or sit on either side of one rounding boundary: one bf16 step (2^-8 relative) apart
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 33, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_fp32_products_rounded_to_bf16(rows, bias) -> None:
    # K = 2048: rows are taken 128 at a time (512 KiB of input), so 300 rows span three chunks
    w = torch.randn(96, 2048).bfloat16()
    b = torch.randn(96).bfloat16() if bias else None
    x = torch.randn(rows, 2048).bfloat16()
    y = amx.amx_linear(x, amx.amx_pack_linear_weight(w), b)
    assert_within_a_rounding(y, rounded_reference(x, w, b))


def test_every_output_and_row_lands_in_its_place() -> None:
    # small integers: every product and sum is exact in fp32 and in bf16, so any misplaced
    # row, output, k pair or tile shows as an exact mismatch
    w = torch.randint(-3, 4, (128, 96)).bfloat16()
    x = torch.randint(-3, 4, (50, 96)).bfloat16()
    b = torch.arange(128).bfloat16()
    y = amx.amx_linear(x, amx.amx_pack_linear_weight(w), b)
    assert torch.equal(y, (x.float() @ w.float().T + b.float()).bfloat16())


def test_the_packed_layout_is_the_tile_order() -> None:
    w = torch.randn(64, 96).bfloat16()
    packed = amx.amx_pack_linear_weight(w)
    assert packed.shape == (2, 3, 2, 16, 32) and packed.is_contiguous()
    for p, s, j, r, c in [(0, 0, 0, 0, 0), (1, 2, 1, 15, 31), (0, 1, 1, 7, 4), (1, 0, 0, 3, 9)]:
        # output pair p, k slice s, block j of the pair, k pair r, column c = 2 * output + k
        assert packed[p, s, j, r, c] == w[p * 32 + j * 16 + c // 2, s * 32 + 2 * r + c % 2]
    assert torch.equal(packed.flatten().sort().values, w.flatten().sort().values)


def test_pack_linear_weight_takes_bf16_weights_whose_dims_are_multiples_of_32() -> None:
    w = torch.randn(2048, 1024)
    assert cpu_ext.pack_linear_weight(w.bfloat16()).shape == (64, 32, 2, 16, 32)
    # fp32 weights go to their own kernel (test_kernels_fp32_linear); a bf16 weight with 16
    # spare outputs and small ones keep the oneDNN / F.linear path
    assert cpu_ext.pack_linear_weight(w).dim() == (
        3 if cpu_ext.fp32_linear_form() == "avx512" else 2
    )
    odd = torch.randn(2000, 1024).bfloat16()
    assert cpu_ext.pack_linear_weight(odd).is_mkldnn == linear.onednn_available()
    small = torch.randn(64, 256).bfloat16()
    assert cpu_ext.pack_linear_weight(small) is small


@pytest.mark.parametrize("shape", [(1, 1024), (3, 5, 1024), (0, 1024)])
def test_linear_runs_packed_weights_on_amx_and_others_as_before(shape) -> None:
    w, b = torch.randn(2048, 1024).bfloat16(), torch.randn(2048).bfloat16()
    packed = cpu_ext.pack_linear_weight(w)
    x = torch.randn(*shape[:-1], 2048).bfloat16()[..., ::2]  # a view, not contiguous
    y = cpu_ext.linear(x, packed, b)
    assert y.shape == (*shape[:-1], 2048)
    assert_within_a_rounding(y, rounded_reference(x, w, b))
    small = torch.randn(64, 256)
    xs = torch.randn(*shape[:-1], 256)
    assert torch.equal(cpu_ext.linear(xs, small), F.linear(xs, small))


def test_bad_arguments_name_the_argument_and_the_rule() -> None:
    w = torch.randn(64, 64).bfloat16()
    packed = amx.amx_pack_linear_weight(w)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        amx.amx_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(ValueError, match=r"x must be a contiguous \[rows, 64\] cpu tensor"):
        amx.amx_linear(torch.randn(2, 32).bfloat16(), packed, None)
    with pytest.raises(ValueError, match="must come from amx_pack_linear_weight"):
        amx.amx_linear(torch.randn(2, 64).bfloat16(), w, None)
    with pytest.raises(ValueError, match=r"bias must be \[64\]"):
        amx.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(63))
    with pytest.raises(ValueError, match="out a multiple of 32"):
        amx.amx_pack_linear_weight(torch.randn(48, 64).bfloat16())
    with pytest.raises(TypeError, match="weight must be bfloat16"):
        amx.amx_pack_linear_weight(torch.randn(64, 64))
