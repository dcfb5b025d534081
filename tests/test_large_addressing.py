"""64-bit addressing: x or y with more than 2**31 elements, so row offsets overflow int32.

Most tokens have no adapter (their programs return at once), the first and last tokens do: the last rows
sit past the 2**31-element mark. Checked there against float64. On the CPU this runs the real Triton
kernels through the interpreter, which takes about 7 minutes on 2 cores: opt in with LORA_OPS_SLOW_TESTS=1.
With LORA_OPS_TEST_DEVICE=cuda it runs on the GPU.
"""
import os

import pytest
import torch

from conftest import DEVICE, INTERPRETED, TOLERANCE, rel_err
from lora_ops import launch, ops
from lora_ops.batch import LoRABatch
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig

EDGE_TOKENS = 64


@pytest.fixture
def triton_backend():
    before = ops.get_cpu_backend()
    ops.set_cpu_backend("triton")
    yield
    ops.set_cpu_backend(before)


@pytest.mark.skipif(DEVICE == "cpu" and not (INTERPRETED and os.environ.get("LORA_OPS_SLOW_TESTS") == "1"),
                    reason="on the CPU interpreter it takes ~7 min: LORA_OPS_SLOW_TESTS=1 runs it")
@pytest.mark.parametrize("K, N", [(4096, 16), (16, 4096)], ids=["x-past-2^31", "y-past-2^31"])
def test_rows_past_int32_offsets(K, N, triton_backend):
    torch.manual_seed(0)
    dev, dtype = DEVICE, torch.float16
    M = 2 ** 31 // max(K, N) + 1024
    L, R = 3, 16
    x = torch.empty(M, K, device=dev, dtype=dtype)
    y = torch.empty(M, N, device=dev, dtype=dtype)
    rows = torch.cat([torch.arange(EDGE_TOKENS), torch.arange(M - EDGE_TOKENS, M)]).to(dev)
    x[rows] = torch.randn(rows.numel(), K, device=dev, dtype=dtype)
    y[rows] = torch.randn(rows.numel(), N, device=dev, dtype=dtype)
    A = (torch.randn(L, 1, R, K, device=dev) / K ** 0.5).to(dtype)
    B = (torch.randn(L, N, R, device=dev) / R ** 0.5).to(dtype)
    scale = torch.tensor([0.5, 1.0, 2.0], device=dev)
    rank = torch.tensor([16, 8, 12], dtype=torch.int32, device=dev)
    slots = torch.full((M,), -1, dtype=torch.int32, device=dev)
    slots[rows] = torch.randint(-1, L, (rows.numel(),), dtype=torch.int32, device=dev)
    batch = LoRABatch(M, L, dev)
    batch.update(slots)
    y_in = y[rows].clone()
    if dev == "cpu":   # large blocks keep the interpreter's program count small
        h = torch.empty(M, 1, R, device=dev)
        launch.launch_shrink(x, A, scale, rank, *batch.meta, h, ShrinkConfig(64, 16, 16 if K == 16 else 1024, 1, 4, 2))
        launch.launch_expand(y, h, B, [N], rank, *batch.meta, ExpandConfig(64, 16 if N == 16 else 4096, 16, 4, 2))
    else:
        torch.ops.lora_ops.add_lora_(y, x, A, B, scale, rank, [N], *batch.meta)

    s = slots[rows]
    ref = torch.zeros(rows.numel(), N, dtype=torch.float64, device=dev)
    for slot in range(L):
        sel = (s == slot).nonzero().squeeze(1)
        r = int(rank[slot])
        h_ref = x[rows[sel]].double() @ A[slot, 0, :r].double().T * float(scale[slot])
        ref[sel] = h_ref @ B[slot, :, :r].double().T
    delta = y[rows].double() - y_in.double()
    assert rel_err(delta, ref) <= TOLERANCE[dtype] + 2e-3     # + one fp16 rounding of y (non-zero start)
    none = s == -1
    assert torch.equal(y[rows][none], y_in[none])


def test_a_transposed_x_past_int32_feature_offsets_is_copied_row_major():
    """The shrink and one-launch kernels compute a feature offset times x's feature stride in 32 bits: a
    transposed x of 2^31 elements or more (feature stride M) read out of bounds there. The launcher hands them
    a row-major copy of such an x (meta tensors: the shapes without the memory)."""
    x = torch.empty_strided((2 ** 20, 4096), (1, 2 ** 20), device="meta")
    assert launch._features_addressable(x).stride() == (4096, 1)
    small = torch.empty_strided((2 ** 10, 4096), (1, 2 ** 10), device="meta")
    assert launch._features_addressable(small) is small


@pytest.mark.parametrize("features, copied", [(2 ** 11 + 1, True), (2 ** 11, False)],
                         ids=["last-feature-offset-2^31", "last-feature-offset-2^31-2^20"])
def test_the_copy_starts_at_the_first_feature_offset_int32_cannot_hold(features, copied):
    """At the edge: a last feature offset of exactly 2^31 (feature stride 2^20) already overflows int32 and is
    copied; one stride less fits and is not (meta tensors)."""
    x = torch.empty_strided((2 ** 20, features), (1, 2 ** 20), device="meta")
    assert (launch._features_addressable(x) is not x) == copied


def test_the_shrink_and_one_launch_kernels_take_the_addressable_x(monkeypatch):
    """Both launchers hand their kernel what _features_addressable gives (launches built, not run)."""
    from conftest import make_case
    from lora_ops.configs.heuristics import FusedConfig
    case = make_case(6, 20, 24, num_slots=2, num_slices=2, max_rank=16, seed=3)
    copies = []
    monkeypatch.setattr(launch, "_features_addressable", lambda x: copies.append(x.clone()) or copies[-1])
    h = torch.empty(6, 2, 16)
    shrink = launch.launch_shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta, h,
                                  ShrinkConfig(16, 16, 16, 1, 4, 2), run=False)
    fused = launch.launch_fused(case.new_y("zero"), case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                                case.slice_widths, *case.meta, FusedConfig(16, 32, 16, 16, 4, 1), run=False)
    assert shrink.tensors[0] is copies[0] and fused.tensors[0] is copies[1]
