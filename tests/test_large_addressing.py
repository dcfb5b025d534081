"""64-bit addressing: x or y with more than 2**31 elements, so row offsets overflow int32.

Most tokens have no adapter (their programs return at once), the first and last tokens do: the last rows
sit past the 2**31-element mark. Checked there against float64. On the CPU this runs the real Triton
kernels through the interpreter, which takes about 7 minutes on 2 cores: opt in with LORA_OPS_SLOW_TESTS=1.
With LORA_OPS_TEST_DEVICE=cuda it runs on the GPU. test_far_apart_input_rows_past_int32_offsets reaches the
same mark in the other kernels with 192 tokens (an input's rows 2^24 elements apart), by default, in about a second.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import DEVICE, INTERPRETED, TOLERANCE, rel_err
from lora_ops import launch, launch_grad, ops
from lora_ops.batch import LoRABatch
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig
from lora_ops.reference import lora_delta_reference, shrink_reference
from test_autograd import grad_x_reference, segment_outer_reference

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
    assert launch.addressable(x).stride() == (4096, 1)
    small = torch.empty_strided((2 ** 10, 4096), (1, 2 ** 10), device="meta")
    assert launch.addressable(small) is small


@pytest.mark.parametrize("features, copied", [(2 ** 11 + 1, True), (2 ** 11, False)],
                         ids=["last-feature-offset-2^31", "last-feature-offset-2^31-2^20"])
def test_the_copy_starts_at_the_first_feature_offset_int32_cannot_hold(features, copied):
    """At the edge: a last feature offset of exactly 2^31 (feature stride 2^20) already overflows int32 and is
    copied; one stride less fits and is not (meta tensors)."""
    x = torch.empty_strided((2 ** 20, features), (1, 2 ** 20), device="meta")
    assert (launch.addressable(x) is not x) == copied


def test_the_shrink_and_one_launch_kernels_take_the_addressable_x(monkeypatch):
    """Both launchers hand their kernel what addressable gives for x and the factors (launches built, not
    run)."""
    from conftest import make_case
    from lora_ops.configs.heuristics import FusedConfig
    case = make_case(6, 20, 24, num_slots=2, num_slices=2, max_rank=16, seed=3)
    copies = []
    monkeypatch.setattr(launch, "addressable", lambda t: copies.append(t.clone()) or copies[-1])
    h = torch.empty(6, 2, 16)
    shrink = launch.launch_shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta, h,
                                  ShrinkConfig(16, 16, 16, 1, 4, 2), run=False)
    fused = launch.launch_fused(case.new_y("zero"), case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                                case.slice_widths, *case.meta, FusedConfig(16, 32, 16, 16, 4, 1), run=False)
    assert shrink.tensors[:2] == tuple(copies[:2]) and fused.tensors[:3] == tuple(copies[2:5])


# Each (op, argument): that argument a view whose last offset along a dimension after the first passes 2^31
# elements while its stride stays below (the rank or feature dimension, stride 2^27, 17 entries). The kernels
# compute those offsets in 32 bits: the offset wrapped and the kernel read gigabytes before the tensor (a
# segfault under the interpreter; session 54). The launchers copy such a view row-major.
FAR_STRIDE, FAR_R = 2 ** 27, 17
INNER_CASES = ["expand_-lora_b", "expand_-h", "one_launch-lora_a", "one_launch-lora_b", "shrink-lora_a",
               "lora_grad_x-dh", "lora_grad_x-lora_a", "lora_grad_a-dh", "segment_outer-u"]


def far_apart_along(values, dim):
    """``values`` copied into a view whose dimension ``dim`` has stride FAR_STRIDE (the others packed) in a
    storage otherwise untouched (on the CPU only its pages are; a GPU allocates it all: 4-8 GiB)."""
    shape = values.shape
    strides, inner = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        if d != dim:
            strides[d], inner = inner, inner * shape[d]
    strides[dim] = FAR_STRIDE
    storage = torch.empty(FAR_STRIDE * (shape[dim] - 1) + inner, dtype=values.dtype, device=values.device)
    view = storage.as_strided(shape, strides)
    view.copy_(values)
    return view


@pytest.mark.parametrize("case", INNER_CASES)
def test_inner_offsets_past_int32_are_copied_row_major(case, triton_backend):
    from lora_ops import configs
    from lora_ops.batch import build_batch_meta
    op, arg = case.split("-")
    gen = torch.Generator().manual_seed(INNER_CASES.index(case))
    M, K, N, dev, dtype = 2, FAR_R, 16, DEVICE, torch.float16
    signed = lambda *shape, dt=dtype: (torch.randn(*shape, generator=gen) / 4).to(dev, dt)
    x, a, b, h = signed(M, K), signed(1, 1, FAR_R, K), signed(1, N, FAR_R), signed(M, 1, FAR_R, dt=torch.float32)
    far = {"lora_a": (a, 3), "lora_b": (b, 2), "h": (h, 2), "dh": (h, 2), "u": (h[:, 0], 1)}[arg]
    t = far_apart_along(*far)
    a, b, h = (t if arg == "lora_a" else a), (t if arg == "lora_b" else b), (t if arg in ("h", "dh") else h)
    u = t if arg == "u" else h[:, 0]
    meta = build_batch_meta(torch.zeros(M, dtype=torch.int32, device=dev), 1)
    scale, rank = torch.ones(1, device=dev), torch.tensor([FAR_R], dtype=torch.int32, device=dev)
    x64, a64, b64, h64 = x.double(), a[0, 0].double(), b[0].double(), h[:, 0].double()
    ops = torch.ops.lora_ops
    if op in ("expand_", "one_launch"):
        y = torch.zeros(M, N, dtype=dtype, device=dev)
        if op == "expand_":
            ops.expand_(y, h, b, [N], rank, *meta)
            expected = h64 @ b64.T
        else:
            configs.force_path("fused")
            try:
                ops.add_lora_(y, x, a, b, scale, rank, [N], *meta)
            finally:
                configs.force_path(None)
            expected = x64 @ a64.T @ b64.T
        out = y
    elif op == "shrink":
        out, expected = ops.shrink(x, a, scale, rank, *meta)[:, 0], x64 @ a64.T
    elif op == "lora_grad_x":
        out, expected = ops.lora_grad_x(h, a, rank, *meta), h64 @ a64
    elif op == "lora_grad_a":
        out, expected = ops.lora_grad_a(h, x, rank, *meta)[0, 0], h64.T @ x64
    else:
        out, expected = ops.segment_outer(u, x, rank, *meta)[0], u.double().T @ x64
    assert rel_err(out, expected) <= TOLERANCE[dtype] + 2e-3


# ---------------------------------------------------------------------------------------------
# The kernels test_rows_past_int32_offsets never reaches (the one-launch kernel, the backward kernels, the
# write-first path), fast: an input's token rows FAR_ROW_STRIDE elements apart (a column slice of a wide
# storage nothing else touches), so the last rows' offsets pass 2^31 elements with only FAR_TOKENS tokens.
# Only inputs the caller passes can be laid out so; the outputs an op allocates are contiguous.
# ---------------------------------------------------------------------------------------------
FAR_TOKENS = 192
FAR_ROW_STRIDE = 2 ** 24        # row 128 starts at element 2^31: a third of the tokens lie past it
SMALL = 16                      # K, N and the max rank: few programs for the interpreter
FAR_SLOTS, FAR_RANKS = 3, [16, 8, 12]


def far_apart_rows(cols, dtype, gen, device):
    """[FAR_TOKENS, cols] random signed values, rows FAR_ROW_STRIDE elements apart. On the CPU only the pages of
    these rows are ever touched; on a GPU the whole storage is allocated (6.4 GB in fp16, 12.9 GB in fp32)."""
    rows = torch.empty(FAR_TOKENS, FAR_ROW_STRIDE, dtype=dtype, device=device)[:, :cols]
    rows.copy_(torch.randn(FAR_TOKENS, cols, generator=gen).to(dtype))
    return rows


def far_problem(device, seed):
    """A LoRA problem of FAR_TOKENS tokens, every size SMALL, fp16: slots in [-1, L) with each slot and -1
    among the tokens past 2^31 elements, so each kind of row is checked there. Its fields carry a Case's names
    (token_slots, lora_a, rank, ...): test_autograd's token-by-token references read it as one."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16

    def signed(*shape, std=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=device)
    slots = torch.randint(-1, FAR_SLOTS, (FAR_TOKENS,), generator=gen)
    past_2_31 = torch.arange(FAR_TOKENS) * FAR_ROW_STRIDE >= 2 ** 31
    slots[past_2_31.nonzero()[:FAR_SLOTS + 1, 0]] = torch.arange(-1, FAR_SLOTS)
    batch = LoRABatch(FAR_TOKENS, FAR_SLOTS, device)
    batch.update(slots.to(device))
    sign = torch.randint(0, 2, (FAR_SLOTS,), generator=gen) * 2 - 1
    return SimpleNamespace(gen=gen, dtype=dtype, device=device, signed=signed, token_slots=slots, meta=batch.meta,
                           lora_a=signed(FAR_SLOTS, 1, SMALL, SMALL, std=SMALL ** -0.5),
                           lora_b=signed(FAR_SLOTS, SMALL, SMALL, std=SMALL ** -0.5),
                           scale=(sign * (0.25 + 1.75 * torch.rand(FAR_SLOTS, generator=gen))).to(device),
                           rank=torch.tensor(FAR_RANKS, dtype=torch.int32, device=device))


def operand(p, far, cols, dtype=None):
    """The problem's [FAR_TOKENS, cols] operand: rows far apart if ``far``, else contiguous."""
    dtype = dtype or p.dtype
    if far:
        return far_apart_rows(cols, dtype, p.gen, p.device)
    return p.signed(FAR_TOKENS, cols, dtype=dtype)


def one_launch_add_lora(p, far, request):
    """add_lora_ on the one-launch kernel (kernels.fused), x or y far apart: y's rows of slot -1 unchanged."""
    from lora_ops import configs
    from lora_ops.configs.heuristics import FusedConfig
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setattr(configs, "fused_config", lambda *a, **k: FusedConfig(64, SMALL, SMALL, SMALL, 4, 1))
    fused_launches = []
    real_launch_fused = launch.launch_fused
    monkeypatch.setattr(launch, "launch_fused", lambda *a, **k: fused_launches.append(1) or real_launch_fused(*a, **k))
    x, y = operand(p, far == "x", SMALL), operand(p, far == "y", SMALL)
    y_before = y.clone()
    torch.ops.lora_ops.add_lora_(y, x, p.lora_a, p.lora_b, p.scale, p.rank, [SMALL], *p.meta)
    assert fused_launches, "add_lora_ did not take the one-launch kernel"
    no_adapter = (p.token_slots < 0).to(y.device)
    assert torch.equal(y[no_adapter], y_before[no_adapter])
    delta = y.double() - y_before.double()
    ref = lora_delta_reference(x, p.lora_a, p.lora_b, p.scale, p.rank, p.token_slots)
    return delta, ref, TOLERANCE[p.dtype] + 2e-3     # + one fp16 rounding of y (non-zero start)


def grad_x_of_far_dh(p, path, request):
    """lora_grad_x with dh [M, 1, R] far apart: dx = dh A at each slot's rank, zero rows for slot -1 (every
    row written). At FAR_TOKENS tokens the heuristic takes the rank loop; ``one-rank-block`` forces the other."""
    if path == "one-rank-block":
        real_config = launch_grad.grad_x_config
        request.getfixturevalue("monkeypatch").setattr(
            launch_grad, "grad_x_config", lambda *a, **k: real_config(*a, **k)._replace(one_rank_block=True))
    else:
        assert not launch_grad.grad_x_config(FAR_TOKENS, SMALL, SMALL, 1).one_rank_block
    dh = operand(p, True, SMALL, torch.float32).unsqueeze(1)
    dx = torch.ops.lora_ops.lora_grad_x(dh, p.lora_a, p.rank, *p.meta)
    return dx, grad_x_reference(dh, p), TOLERANCE[dx.dtype]


def grad_h_of_far_dy(p, far, request):
    """lora_grad_h with dy far apart (the shrink kernel over each slice's columns): dh = scale dy B."""
    dy = operand(p, True, SMALL)
    dh = torch.ops.lora_ops.lora_grad_h(dy, p.lora_b, p.scale, p.rank, [SMALL], *p.meta)
    b_t = p.lora_b.transpose(1, 2).unsqueeze(1)               # B^T [L, 1, R, N]: dh is the shrink of dy by it
    return dh, shrink_reference(dy, b_t, p.scale, p.rank, p.token_slots), TOLERANCE[torch.float32]


def grad_a_far(p, far, request):
    """lora_grad_a (segment_outer) with dh or x far apart: dA[l] = sum of dh[t]^T x[t] over slot l's tokens."""
    dh = operand(p, far == "dh", SMALL, torch.float32)
    x = operand(p, far == "x", SMALL)
    grad_a = torch.ops.lora_ops.lora_grad_a(dh.unsqueeze(1), x, p.rank, *p.meta)
    return grad_a[:, 0], segment_outer_reference(dh, x, p), TOLERANCE[grad_a.dtype]


def grad_b_far(p, far, request):
    """lora_grad_b (segment_outer) with dy or h far apart: dB[l] = sum of dy[t]^T h[t] over slot l's tokens."""
    dy = operand(p, far == "dy", SMALL)
    h = operand(p, far == "h", SMALL, torch.float32)
    grad_b = torch.ops.lora_ops.lora_grad_b(dy, h.unsqueeze(1), p.rank, [SMALL], *p.meta)
    return grad_b.transpose(1, 2), segment_outer_reference(h, dy, p), TOLERANCE[grad_b.dtype]


def write_first_lora_linear(p, far, request):
    """lora_linear's write-first path (the shrink, the expand storing the delta, then y += x W^T) on x far
    apart; write_calls fills y with NaN first, so a row the store skipped fails."""
    request.getfixturevalue("write_first_from")(1)
    write_calls = request.getfixturevalue("write_calls")
    x = operand(p, True, SMALL)
    weight = p.signed(SMALL, SMALL, std=SMALL ** -0.5)
    y = torch.ops.lora_ops.lora_linear(x, weight, None, p.lora_a, p.lora_b, p.scale, p.rank, [SMALL],
                                       *p.meta)
    assert len(write_calls) == 1, "lora_linear did not take the write-first path"
    ref = x.double().cpu() @ weight.double().cpu().T + lora_delta_reference(
        x, p.lora_a, p.lora_b, p.scale, p.rank, p.token_slots)
    return y, ref, TOLERANCE[p.dtype]


FAR_CASES = {
    "fused-x-past-2^31": (one_launch_add_lora, "x"),
    "fused-y-past-2^31": (one_launch_add_lora, "y"),
    "grad_x-dh-past-2^31": (grad_x_of_far_dh, "rank-loop"),
    "grad_x-one-rank-block-dh-past-2^31": (grad_x_of_far_dh, "one-rank-block"),
    "grad_h-dy-past-2^31": (grad_h_of_far_dy, "dy"),
    "grad_a-dh-past-2^31": (grad_a_far, "dh"),
    "grad_a-x-past-2^31": (grad_a_far, "x"),
    "grad_b-dy-past-2^31": (grad_b_far, "dy"),
    "grad_b-h-past-2^31": (grad_b_far, "h"),
    "write-first-x-past-2^31": (write_first_lora_linear, "x"),
}


@pytest.mark.parametrize("case", FAR_CASES, ids=list(FAR_CASES))
def test_far_apart_input_rows_past_int32_offsets(case, triton_kernels, request):
    """Each kernel reads an input's token rows at 64-bit offsets: rows of a caller's strided input lie past 2^31
    elements with only FAR_TOKENS tokens (the interpreter wraps an int32 offset there, as a GPU would). Checked
    against float64. lora_linear_stacked is not here: its expand reads only the output its GEMM allocates."""
    run, far = FAR_CASES[case]
    p = far_problem(triton_kernels.device, seed=sorted(FAR_CASES).index(case))
    out, ref, tolerance = run(p, far, request)
    assert rel_err(out, ref) <= tolerance
