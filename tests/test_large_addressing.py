"""64-bit addressing: x and y with more than 2**31 elements, so row offsets overflow int32 (GPU only:
about 9 GB of device memory). Checked on the rows past the 2**31-element mark against float64."""
import pytest
import torch

from conftest import DEVICE, TOLERANCE, rel_err
from lora_ops.batch import LoRABatch

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (about 9 GB)")


def test_rows_past_int32_offsets():
    torch.manual_seed(0)
    K = N = 4096
    M = 2 ** 31 // K + 4096                      # x and y both pass 2**31 elements
    L, R, dtype = 3, 16, torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    y = torch.randn(M, N, device="cuda", dtype=dtype)
    A = (torch.randn(L, 1, R, K, device="cuda") / K ** 0.5).to(dtype)
    B = (torch.randn(L, N, R, device="cuda") / R ** 0.5).to(dtype)
    scale = torch.tensor([0.5, 1.0, 2.0], device="cuda")
    rank = torch.tensor([16, 8, 12], dtype=torch.int32, device="cuda")
    slots = torch.randint(-1, L, (M,), device="cuda")
    batch = LoRABatch(M, L, "cuda")
    batch.update(slots)
    tail = torch.arange(M - 2048, M, device="cuda")          # rows whose offsets pass 2**31
    head = torch.arange(0, 2048, device="cuda")
    rows = torch.cat([head, tail])
    y_in = y[rows].clone()
    torch.ops.lora_ops.add_lora_(y, x, A, B, scale, rank, [N], *batch.meta)

    s = slots[rows]
    ref = torch.zeros(rows.numel(), N, dtype=torch.float64, device="cuda")
    for l in range(L):
        sel = (s == l).nonzero().squeeze(1)
        r = int(rank[l])
        h = x[rows[sel]].double() @ A[l, 0, :r].double().T * float(scale[l])
        ref[sel] = h @ B[l, :, :r].double().T
    delta = y[rows].double() - y_in.double()
    assert rel_err(delta, ref) <= TOLERANCE[dtype] + 4e-3     # + one bf16 rounding of y (non-zero start)
    none = s == -1
    assert torch.equal(y[rows][none], y_in[none])
