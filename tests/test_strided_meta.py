"""The 1-D per-slot tensors (scale, rank) and the batch metadata (sorted_token_ids, slot_starts, slot_counts)
at any stride: every kernel takes their strides, so each op gives, bit for bit, what it gives on contiguous
copies of the same values, on every path (one launch, shrink + expand, split-K, write-first, stack_a's
expand, the backward's kernels). The five tensors take five different strides, so a launcher that passes one's
stride for another's reads wrong entries. The contiguous call runs first, and then calls that each stride one
tensor more, so a plan keyed without any one of the strides would be replayed on a call that differs in it and
read the wrong entries. Outputs start poisoned (NaN). Strides whose last element lies past int32's reach are
refused by every op."""
import pytest
import torch

from conftest import DEVICE, TOLERANCE, add_lora_paths, force_add_lora_path, make_case, rel_err
from csrc_meta import OPS, checks
from lora_ops import launch, launch_grad
from test_ops_contract import arg_names, args_by_name

R = 32      # add_lora_paths' split_k_summed takes rank blocks of R // 2: tl.dot needs K >= 16 on a GPU
PATHS = add_lora_paths(R)


# The strides of scale, rank, sorted_token_ids, slot_starts and slot_counts: all different.
STEPS = (2, 3, 4, 5, 6)


def strided(t, step):
    """A copy of the 1-D ``t`` at stride ``step`` (every step-th element of a longer tensor, garbage between and
    after them, room for a read at any of :data:`STEPS`; 0: a broadcast of one value, for a tensor whose entries
    are all equal)."""
    if step == 0:
        return t[:1].expand(t.shape[0])
    wide = torch.full((t.shape[0] * max(STEPS),), -7, dtype=t.dtype, device=t.device)
    wide[:t.shape[0] * step:step] = t
    return wide[:t.shape[0] * step:step]


def case_and_args(seed, M=21, K=40, N=36, L=3, S=2):
    case = make_case(M, K, N, num_slots=L, num_slices=S, max_rank=R, device=DEVICE, seed=seed, ranks=[R, 5, 11])
    contiguous = (case.scale, case.rank, *case.meta)
    return case, contiguous, tuple(strided(t, step) for t, step in zip(contiguous, STEPS))


def one_more_strided(contiguous, strided_args):
    """The argument tuples with the first k tensors strided, k = 0 (all contiguous) .. 5, then all strided once
    more: each call differs from the one before in one stride (the last replays the strided call's own plans)."""
    rungs = [(*strided_args[:k], *contiguous[k:]) for k in range(len(contiguous) + 1)]
    return rungs + rungs[-1:]


def poisoned(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("path", list(PATHS))
def test_add_lora_takes_strided_metadata(triton_kernels, monkeypatch, path):
    force_add_lora_path(monkeypatch, PATHS[path])
    case, contiguous, strided_args = case_and_args(1)
    outs = []
    for scale, rank, *meta in (contiguous, strided_args):
        y = case.new_y("zero")
        torch.ops.lora_ops.add_lora_(y, case.x, case.lora_a, case.lora_b, scale, rank, case.slice_widths, *meta)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], case.delta_reference()) <= TOLERANCE[torch.float32]


def test_every_op_takes_strided_metadata(triton_kernels):
    case, contiguous, strided_args = case_and_args(2)
    M, K, N, L, S, _ = case.shape
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(M, S, R, generator=gen).to(DEVICE)
    v = torch.randn(M, N, generator=gen).to(DEVICE)
    weight = torch.randn(N, K, generator=gen).to(DEVICE)
    stacked = torch.cat([weight, case.lora_a.reshape(L * S * R, K)])

    def ops_on(scale, rank, *meta):
        y = poisoned((M, N))
        y.copy_(v)
        torch.ops.lora_ops.expand_(y, h, case.lora_b, case.slice_widths, rank, *meta)
        return {
            "shrink": torch.ops.lora_ops.shrink(case.x, case.lora_a, scale, rank, *meta),
            "expand_": y,
            "lora_linear": torch.ops.lora_ops.lora_linear(case.x, weight, None, case.lora_a, case.lora_b, scale,
                                                          rank, case.slice_widths, *meta),
            "lora_linear_stacked": torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, None, case.lora_b, scale,
                                                                          rank, case.slice_widths, *meta),
            "lora_grad_x": launch_grad.lora_grad_x(h, case.lora_a, rank, *meta),
            "segment_outer": launch_grad.segment_outer(h[:, 1], v, rank, *meta),
            "lora_grad_h": launch_grad.lora_grad_h(v, case.lora_b, scale, rank, case.slice_widths, *meta),
            "lora_grad_a": launch_grad.lora_grad_a(h, case.x, rank, *meta),
            "lora_grad_b": launch_grad.lora_grad_b(v, h, rank, case.slice_widths, *meta),
        }
    rungs = one_more_strided(contiguous, strided_args)
    reference = ops_on(*rungs[0])
    for k, args in enumerate(rungs[1:], start=1):
        ours = ops_on(*args)
        how = f"the first {k} of scale .. slot_counts strided" if k < len(rungs) - 1 else "all strided, replayed"
        for name in ours:
            assert not ours[name].isnan().any(), (name, how)
            assert torch.equal(ours[name], reference[name]), (name, how)


def test_write_first_and_stacked_take_strided_metadata(triton_kernels, monkeypatch):
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 1)
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    case, contiguous, strided_args = case_and_args(4)
    M, K, N, L, S, _ = case.shape
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    stacked = torch.cat([weight, case.lora_a.reshape(L * S * R, K)])
    for scale, rank, *meta in (contiguous, strided_args):
        torch.full((1 << 16,), float("nan"), device=DEVICE)
        written = torch.ops.lora_ops.lora_linear(case.x, weight, None, case.lora_a, case.lora_b, scale, rank,
                                                 case.slice_widths, *meta)
        stack_out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, None, case.lora_b, scale, rank,
                                                           case.slice_widths, *meta)
        if scale is contiguous[0]:
            first = (written, stack_out)
    assert torch.equal(written, first[0]) and torch.equal(stack_out, first[1])
    assert not written.isnan().any()


def test_a_broadcast_scale_is_read_at_stride_zero(triton_kernels):
    case, contiguous, _ = case_and_args(6)
    scale = strided(case.scale, 0)
    outs = []
    for s in (scale.contiguous(), scale):
        y = case.new_y("zero")
        torch.ops.lora_ops.add_lora_(y, case.x, case.lora_a, case.lora_b, s, case.rank, case.slice_widths,
                                     *case.meta)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


def test_the_grad_kernels_see_strided_metadata_through_autograd(triton_kernels):
    case, contiguous, strided_args = case_and_args(7)
    grads = []
    for scale, rank, *meta in (contiguous, strided_args):
        x = case.x.clone().requires_grad_()
        a = case.lora_a.clone().requires_grad_()
        b = case.lora_b.clone().requires_grad_()
        y = torch.ops.lora_ops.add_lora(case.new_y("zero"), x, a, b, scale, rank, case.slice_widths, *meta)
        y.backward(torch.ones_like(y))
        grads.append((x.grad, a.grad, b.grad))
    for ours, ref in zip(grads[1], grads[0]):
        assert torch.equal(ours, ref)


# Each op's 1-D tensors among scale, rank and the metadata: "op-tensor".
FAR_CASES = [(op, name) for op in OPS for name in ("scale", "rank", "sorted_token_ids", "slot_starts", "slot_counts")
             if name in arg_names(op)]


@pytest.mark.parametrize("op_name, name", FAR_CASES, ids=[f"{op}-{name}" for op, name in FAR_CASES])
def test_every_op_refuses_a_stride_past_int32(op_name, name):
    """The kernels index the 1-D tensors with 32-bit offsets: an op given one whose last element lies 2**31
    elements or more past its first refuses it, naming it (its checks on meta tensors: the fake kernel's, which
    the real kernels share), where a quick check that took any stride would hand it to the kernels."""
    op = getattr(torch.ops.lora_ops, op_name)
    t = args_by_name(op_name, "meta")[arg_names(op_name).index(name)]
    n = t.shape[0]
    step = -(-2 ** 31 // (n - 1))   # the least stride that puts the last element 2**31 or more past the first
    far = torch.empty_strided((n,), (step,), dtype=t.dtype, device="meta")
    with pytest.raises(ValueError, match=f"^{name}: its last element lies {(n - 1) * step} elements past"):
        op(*args_by_name(op_name, "meta", **{name: far}))


def test_an_offset_past_int32_is_refused():
    # A meta tensor has no storage, so it can hold a stride no real allocation of this size could.
    far = torch.empty_strided((3,), (2 ** 30,), dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="^slot_counts: its last element lies 2147483648 elements past its first"):
        checks.check_index_extent("slot_counts", far)
    checks.check_index_extent("slot_counts", torch.empty_strided((2,), (2 ** 31 - 1,), dtype=torch.int32,
                                                                 device="meta"))
