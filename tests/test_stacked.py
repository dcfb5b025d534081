"""lora_linear_stacked: every slot's A stacked under the base weight, so one GEMM gives the layer's output
and every slot's h; the expand then adds each token's slot's scaled h @ B^T (DESIGN §4). Checked against
float64 on both backends, the expand kernel's two paths on the Triton one, and the argument errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, dtype_id, expand_reference, make_case
from lora_ops import launch
from lora_ops.configs.heuristics import ExpandConfig
from test_kernels_property import assert_delta_close, assert_rows_bit_identical, assert_rows_equal

K, N, L, S = 40, 75, 4, 3
WIDTHS = [41, 29, 5]


def stacked_problem(M, R, dtype, device, seed, with_bias=True):
    """A case, its stacked weight [N + L·S·R, K] (base weight over lora_a) and bias (zeros past N), with
    NaN in the rows of A past each slot's rank and in B past it (neither may reach y); the base output
    F.linear(x, stacked, bias) as the op's GEMM computes it; the float64 delta."""
    case = make_case(M, K, N, L, S, R, dtype=dtype, device=device, seed=seed, slice_widths=WIDTHS,
                     ranks=[R, R // 2 + 1, 0, 3], capacity=M + 5)
    gen = torch.Generator().manual_seed(seed + 1)
    ref = case.delta_reference()
    weight = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype=dtype, device=device)
    bias = torch.randn(N, generator=gen).to(dtype=dtype, device=device) if with_bias else None
    past = torch.arange(R, device=device) >= case.rank[:, None].to(device)           # [L, R]
    lora_a = case.lora_a.masked_fill(past[:, None, :, None], math.nan)
    case.lora_b.masked_fill_(past[:, None, :], math.nan)
    stacked = torch.cat([weight, lora_a.reshape(-1, K)])
    stacked_bias = None if bias is None else torch.cat([bias, bias.new_zeros(L * S * R)])
    before = F.linear(case.x, stacked, stacked_bias)
    return case, stacked, stacked_bias, before, ref


def check_output(out, before, case, ref, dtype):
    y, y_in = out[:, :N], before[:, :N]
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")
    # Columns N.. are the GEMM's h, untouched (NaN where A held it).
    torch.testing.assert_close(out[:, N:], before[:, N:], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("M,R", [(1, 16), (37, 24), (130, 80)], ids=["decode-r16", "M37-r24", "M130-r80"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_lora_linear_stacked_matches_reference(backend, checked_dtype, M, R, with_bias):
    dtype = checked_dtype
    case, stacked, bias, before, ref = stacked_problem(M, R, dtype, backend.device, seed=M + R, with_bias=with_bias)
    out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, bias, case.lora_b, case.scale, case.rank,
                                                 case.slice_widths, *case.meta)
    assert out.shape == (M, N + L * S * R)
    check_output(out, before, case, ref, dtype)


# The expand kernel's two paths (whole rank in one block; the rank loop), each with one and two column blocks.
STACKED_PATHS = {
    "one_block-1_col_block": (ExpandConfig(16, 16, 32, 4, 2, 1), 24),
    "one_block-2_col_blocks": (ExpandConfig(16, 16, 32, 4, 2, 2), 24),
    "rank_loop-1_col_block": (ExpandConfig(32, 32, 16, 4, 3, 1), 40),
    "rank_loop-2_col_blocks": (ExpandConfig(16, 16, 16, 4, 2, 2), 40),
}


@pytest.mark.parametrize("path", STACKED_PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_stacked_expand_kernel_paths(backend, checked_dtype, path):
    if backend.name != "triton":
        pytest.skip("the Triton expand kernel's configs")
    dtype = checked_dtype
    cfg, R = STACKED_PATHS[path]
    case, stacked, bias, before, ref = stacked_problem(37, R, dtype, backend.device, seed=5)
    out = before.clone()
    launch.launch_expand_stacked(out, N, case.lora_b, case.slice_widths, case.rank, case.scale, *case.meta, cfg)
    check_output(out, before, case, ref, dtype)


def test_stacked_h_is_the_unscaled_product_the_expand_reads():
    """Columns N.. hold x A^T for every slot (the stack's h, unscaled); the delta is the slot's scale times
    h @ B^T: the expand reference on the slot's block of those columns reproduces it."""
    case, stacked, bias, before, ref = stacked_problem(9, 8, torch.float32, "cpu", seed=2)
    h_all = before[:, N:].view(9, L, S, 8).double()
    slots = case.token_slots.clamp(min=0)
    h = h_all[torch.arange(9), slots] * case.scale.double()[slots][:, None, None]
    torch.testing.assert_close(expand_reference(h, case.lora_b, case.rank, case.token_slots, WIDTHS), ref,
                               rtol=1e-4, atol=1e-5)   # h from a float32 GEMM


def test_stacked_weight_errors_name_the_argument():
    case, stacked, bias, _, _ = stacked_problem(5, 8, torch.float32, "cpu", seed=3)
    args = (case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
    op = torch.ops.lora_ops.lora_linear_stacked
    with pytest.raises(ValueError, match=r"stacked_weight: expected shape \[N \+ L\*S\*R, K\]"):
        op(case.x, stacked[:-1], None, *args)
    with pytest.raises(ValueError, match="stacked_weight: expected a contiguous"):
        op(case.x, torch.cat([stacked, stacked], 1)[:, :K], None, *args)
    with pytest.raises(ValueError, match=r"stacked_bias: expected shape \["):
        op(case.x, stacked, bias[:N], *args)
    with pytest.raises(ValueError, match="weight: expected shape"):
        op(case.x[:, :-1], stacked, None, *args)
