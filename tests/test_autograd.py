"""Autograd of the LoRA delta: lora_ops.lora_forward / lora_ops::add_lora and its backward ops.

How the gradients are checked (our ops take fp16 / bf16 / fp32 only, so gradcheck cannot run on them):

1. ``torch.autograd.gradcheck`` in float64 checks the float64 reference (lora_forward_reference): its
   autograd gradients against finite differences. The reference is then the ground truth.
2. Our analytic gradients (float32 accumulation; fp32, fp16 and bf16 inputs) are compared with the
   reference's gradients, computed in float64 from the same rounded inputs, with the suite's relative
   Frobenius tolerances (conftest.TOLERANCE). We chose this over adding a float64 path to the CPU kernel:
   that path would check a float64 twin of the math, not the kernels that run, and it would widen the
   ops' dtype contract for tests only.

Both CPU backends run everything: the torch CPU kernels and the real Triton kernels under the interpreter
(bf16 values there through the test patch of its bf16 arithmetic, conftest.bf16_interpreter).
"""
import inspect
import itertools
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import lora_ops
from conftest import DTYPES, H_TOLERANCE, TOLERANCE, dtype_id, laid_out, make_case, rel_err
from lora_ops import autograd, launch, launch_grad
from lora_ops.batch import BatchMeta, build_batch_meta
from lora_ops.reference import lora_forward_reference, shrink_reference

FP16_FP32 = [torch.float16, torch.float32]

# Small problems (the interpreter runs every program in Python). make_case draws what is not given:
# signed data and scales, unequal slice widths, unsorted slots with -1, one slot at rank 0 when L > 1.
GRAD_CASES = {
    "one_slice": dict(M=29, K=24, N=20, num_slots=3, num_slices=1, max_rank=16),
    "qkv_3_slices": dict(M=37, K=40, N=48, num_slots=4, num_slices=3, max_rank=16),
    "gate_up_mixed_ranks": dict(M=33, K=24, N=32, num_slots=4, num_slices=2, max_rank=20, ranks=[20, 7, 0, 13]),
    "strided_x": dict(M=21, K=24, N=20, num_slots=2, num_slices=2, max_rank=8, x_layout="transposed",
                      y_layout="column_slice"),
    "slot_without_tokens": dict(M=18, K=16, N=16, num_slots=3, num_slices=1, max_rank=8, ranks=[8, 8, 4],
                                token_slots=[0, -1, 2] * 6),
    "all_minus_one": dict(M=12, K=16, N=16, num_slots=2, num_slices=1, max_rank=8, token_slots=[-1] * 12),
    "no_tokens": dict(M=0, K=16, N=16, num_slots=2, num_slices=1, max_rank=8),
}
LEAVES = ("y", "x", "lora_a", "lora_b")


def same_layout_copy(t):
    """A copy of ``t`` with its exact strides (a column slice or transposed storage stays one)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def leaves_of(case, y, needs=LEAVES):
    """Fresh leaves (y, x, lora_a, lora_b) holding the case's values in the case's layouts."""
    values = dict(y=y, x=case.x, lora_a=case.lora_a, lora_b=case.lora_b)
    return {name: same_layout_copy(values[name]).requires_grad_(name in needs) for name in LEAVES}


def forward(case, leaves, **kw):
    return lora_ops.lora_forward(leaves["y"], leaves["x"], leaves["lora_a"], leaves["lora_b"], case.scale,
                                 case.rank, batch=case.meta, slice_widths=case.slice_widths, **kw)


def reference_grads(case, leaves, grad_out, needs=LEAVES):
    """The float64 output and gradients of the reference, from the same (rounded) values."""
    ref = {n: leaves[n].detach().double().requires_grad_(n in needs) for n in LEAVES}
    out = lora_forward_reference(ref["y"], ref["x"], ref["lora_a"], ref["lora_b"], case.scale, case.rank,
                                 case.token_slots, case.slice_widths)
    out.backward(grad_out.double())
    # A leaf the reference never touched (no token with an adapter) has a zero gradient.
    return out.detach(), {n: torch.zeros_like(ref[n]) if ref[n].grad is None else ref[n].grad for n in needs}


def record_grad_configs(monkeypatch):
    """{"grad_x_config": [...], "segment_outer_config": [...]}: each call launch_grad made of them during the test,
    as (args, kwargs, the config returned). (Plans are built on a first call: triton_kernels clears them.)"""
    seen = {}
    for name in ("grad_x_config", "segment_outer_config"):
        calls = seen[name] = []

        def recorded(*args, real=getattr(launch_grad, name), calls=calls, **kwargs):
            cfg = real(*args, **kwargs)
            calls.append((args, kwargs, cfg))
            return cfg
        monkeypatch.setattr(launch_grad, name, recorded)
    return seen


def record_grad_launches(monkeypatch):
    """{"lora_grad_x": [...], "lora_grad_a": [...], "lora_grad_b": [...]}: the config each backward launch of the
    test was given (launch_grad.launch_<name>'s ``cfg``), so a test asserts what ran, not what the heuristic gives
    for its own arguments."""
    seen = {}
    for name in ("lora_grad_x", "lora_grad_a", "lora_grad_b"):
        real = getattr(launch_grad, f"launch_{name}")
        cfgs = seen[name] = []

        def recorded(*args, real=real, cfgs=cfgs, **kwargs):
            cfgs.append(inspect.signature(real).bind(*args, **kwargs).arguments["cfg"])
            return real(*args, **kwargs)
        monkeypatch.setattr(launch_grad, f"launch_{name}", recorded)
    return seen


def run_and_compare(case, grad_out, dtype, needs=LEAVES, y=None):
    if y is None:
        y = laid_out(case.signed(case.x.shape[:1] + case.lora_b.shape[1:2]), case.y_layout, case.gen)
    leaves = leaves_of(case, y, needs)
    out = forward(case, leaves)
    out.backward(grad_out)
    ref_out, ref = reference_grads(case, leaves, grad_out, needs)
    tol = TOLERANCE[dtype]
    assert rel_err(out, ref_out) <= tol, "forward"
    for name in needs:
        assert leaves[name].grad is not None, name
        assert leaves[name].grad.dtype == dtype, name
        err = rel_err(leaves[name].grad, ref[name])
        assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"
    for name in set(LEAVES) - set(needs):
        assert leaves[name].grad is None, name
    return leaves


def test_reference_passes_float64_gradcheck():
    """The float64 reference's autograd against finite differences (slices, mixed ranks, -1, empty slot)."""
    case = make_case(M=11, K=5, N=7, num_slots=4, num_slices=2, max_rank=3, dtype=torch.float64, seed=1,
                     ranks=[3, 1, 0, 2], token_slots=[0, 1, -1, 2, 0, 1, 1, -1, 0, 2, 0])
    y = case.signed((11, 7))

    def fn(y, x, lora_a, lora_b):
        return lora_forward_reference(y, x, lora_a, lora_b, case.scale, case.rank, case.token_slots,
                                      case.slice_widths)

    inputs = [t.detach().clone().requires_grad_() for t in (y, case.x, case.lora_a, case.lora_b)]
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("case_id", list(GRAD_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grads_match_float64_reference(backend, checked_dtype, case_id):
    case = make_case(**GRAD_CASES[case_id], dtype=checked_dtype, device=backend.device, seed=7)
    M, _, N, *_ = case.shape
    run_and_compare(case, case.signed((M, N)), checked_dtype)


def large_bucket_dtype(backend):
    """The dtype of a test of the backward's 1024-token configs: float32 (its tight tolerance) where the kernels
    run on the CPU, bfloat16 on a GPU, where float32 and float16 take configs of their own
    (launch_grad.takes_float32_tiles, float16_on_gpu: no deep token steps, no dx column loop for float32)."""
    return torch.bfloat16 if backend.device == "cuda" else torch.float32


def test_grads_past_1024_tokens_match_float64_reference(triton_kernels, monkeypatch):
    """A backward in the 1024-token bucket and above runs other configs (heuristics.SELF_SUM_MIN_BUCKET: the
    shrink op's and dh's split cap; launch_grad.DEEP_STEP: dA / dB's token steps; launch_grad.grad_x_n_loop:
    dx's column blocks): the whole forward + backward against float64, packed slices, mixed ranks."""
    dtype = large_bucket_dtype(triton_kernels)
    case = make_case(M=1100, K=4096, N=192, num_slots=4, num_slices=2, max_rank=16, ranks=[16, 5, 0, 11],
                     dtype=dtype, device=triton_kernels.device, seed=37)
    M, K, N, L, S, R = case.shape
    launched = record_grad_launches(monkeypatch)
    run_and_compare(case, case.signed((M, N)), dtype)
    assert launched["lora_grad_x"] and all(cfg.n_loop > 1 for cfg in launched["lora_grad_x"])
    deep = launch_grad.DEEP_STEP["block_t"]
    assert [cfg.block_t for cfg in launched["lora_grad_a"] + launched["lora_grad_b"]] == [deep, deep]


@pytest.mark.parametrize("needs", [("x",), ("lora_b",), ("lora_a", "lora_b"), ("y", "x", "lora_a"), ("y", "lora_b")],
                         ids=lambda n: "+".join(n))
def test_only_requested_grads(backend, needs):
    """Frozen inputs get no gradient; the requested ones are still right (y's gradient with x frozen too:
    dy follows y's own need, not x's)."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=torch.float32, device=backend.device, seed=3)
    M, _, N, *_ = case.shape
    run_and_compare(case, case.signed((M, N)), torch.float32, needs=needs)


GRAD_LAYOUTS = ("column_slice", "transposed", "row_expanded", "scalar_expanded")


def incoming_grad(layout, case):
    """A strided or expanded gradient of the [M, N] output (an expanded one has stride 0)."""
    M, _, N, *_ = case.shape
    if layout == "row_expanded":
        return case.signed((1, N)).expand(M, N)
    if layout == "scalar_expanded":   # what out.sum().backward() passes down
        return case.signed((1, 1)).expand(M, N)
    return laid_out(case.signed((M, N)), layout, case.gen)


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_strided_and_expanded_incoming_grads(backend, dtype, layout, monkeypatch):
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=dtype, device=backend.device, seed=11)
    grad_out = incoming_grad(layout, case)
    assert not grad_out.is_contiguous()
    seen = []
    real_grad_h = lora_ops.autograd.grad_h

    def recording_grad_h(grad, *args):
        seen.append(grad.stride())
        return real_grad_h(grad, *args)

    monkeypatch.setattr(lora_ops.autograd, "grad_h", recording_grad_h)
    leaves = leaves_of(case, case.signed(grad_out.shape))
    out = forward(case, leaves)
    x, a, b = torch.autograd.grad(out, [leaves["x"], leaves["lora_a"], leaves["lora_b"]], grad_outputs=grad_out)
    assert seen == [grad_out.stride()], "the backward did not receive the strided gradient itself"
    _, ref = reference_grads(case, leaves, grad_out)
    for name, got in (("x", x), ("lora_a", a), ("lora_b", b)):
        assert rel_err(got, ref[name]) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_no_adapter_and_padding_contribute_nothing(backend, dtype):
    """NaN in the rows of -1 tokens (x and the incoming gradient) and in A / B past each slot's rank
    (the rank-0 slot entirely NaN): any contribution would be NaN. dx rows of -1 tokens are exactly 0, and
    dA / dB past each rank and for slots without tokens are exactly 0."""
    spec = dict(GRAD_CASES["gate_up_mixed_ranks"], num_slots=5, ranks=[20, 7, 0, 13, 9])
    spec["token_slots"] = [-1, 0, 1, 2, 3, -1, 0, 1, 1, 2, -1, 3] * 2 + [0] * 9   # slot 4: no tokens
    case = make_case(**spec, dtype=dtype, device=backend.device, seed=5)
    M, _, N, L, _, R = case.shape
    none = case.token_slots < 0
    grad_out = case.signed((M, N))
    clean = run_and_compare(case, grad_out, dtype, needs=("x", "lora_a", "lora_b"))

    past_rank = torch.arange(R, device=case.x.device) >= case.rank[:, None]            # [L, R]
    case.x[none] = float("nan")
    case.lora_a.masked_fill_(past_rank[:, None, :, None], float("nan"))
    case.lora_b.masked_fill_(past_rank[:, None, :], float("nan"))
    poisoned = grad_out.clone()
    poisoned[none] = float("nan")
    leaves = leaves_of(case, case.signed((M, N)))
    forward(case, leaves).backward(poisoned)

    for name in ("x", "lora_a", "lora_b"):   # rel_err is inf on any NaN
        assert rel_err(leaves[name].grad, clean[name].grad) <= TOLERANCE[dtype], name
    assert torch.equal(leaves["x"].grad[none], torch.zeros_like(leaves["x"].grad[none]))
    assert not leaves["lora_a"].grad[past_rank[:, None, :, None].expand_as(case.lora_a)].any()
    assert not leaves["lora_b"].grad[past_rank[:, None, :].expand_as(case.lora_b)].any()
    assert not leaves["lora_a"].grad[4].any() and not leaves["lora_b"].grad[4].any()


def test_frozen_base_and_dropout_follow_peft(backend):
    """Base layer frozen (no grad) and fed the original x; the adapters see dropout(x) in training only."""
    case = make_case(**GRAD_CASES["one_slice"], dtype=torch.float32, device=backend.device, seed=13)
    M, K, N, *_ = case.shape
    base = torch.nn.Linear(K, N, device=case.x.device).requires_grad_(False)
    x = case.x.clone().requires_grad_()
    a, b = case.lora_a.clone().requires_grad_(), case.lora_b.clone().requires_grad_()
    grad_out = case.signed((M, N))
    p = 0.5

    torch.manual_seed(123)
    out = lora_ops.lora_forward(base(x), x, a, b, case.scale, case.rank, batch=case.meta, dropout=p, training=True)
    out.backward(grad_out)
    torch.manual_seed(123)   # the same draw: F.dropout on the same shape consumes the same random numbers
    keep = F.dropout(torch.ones_like(x), p, training=True)
    assert 0 < int((keep == 0).sum()) < keep.numel()

    x64 = x.detach().double().requires_grad_()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    base_out = F.linear(x64, base.weight.double(), base.bias.double())
    ref = lora_forward_reference(base_out, x64 * keep.double(), a64, b64, case.scale, case.rank, case.token_slots)
    ref.backward(grad_out.double())
    assert base.weight.grad is None and base.bias.grad is None
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    for got, want in ((x, x64), (a, a64), (b, b64)):
        assert rel_err(got.grad, want.grad) <= TOLERANCE[torch.float32]

    assert lora_ops.lora_dropout(x, p, training=False) is x
    eval_out = lora_ops.lora_forward(base(x), x, a, b, case.scale, case.rank, batch=case.meta, dropout=p,
                                     training=False)
    plain = lora_ops.lora_forward(base(x), x, a, b, case.scale, case.rank, batch=case.meta)
    assert torch.equal(eval_out, plain)


def test_lora_dropout_rejects_bad_p():
    with pytest.raises(ValueError, match="dropout probability"):
        lora_ops.lora_dropout(torch.ones(2, 2), 1.5, training=True)


def test_metadata_refilled_before_backward_raises(backend):
    """Saved metadata is the caller's buffers: refilling them makes autograd refuse the stale backward."""
    case = make_case(**GRAD_CASES["one_slice"], dtype=torch.float32, device=backend.device, seed=17)
    leaves = leaves_of(case, case.signed((case.shape[0], case.shape[2])))
    out = forward(case, leaves)
    case.batch.update(case.token_slots.flip(0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_copying_saved_tensor_hooks_keep_hand_built_metadata(backend):
    """Metadata of the caller's own, filled in place (version counter past 0), saved under hooks that copy
    (activation offloading): the copies start at version 0, and the batch check took them for a recompute on
    another batch and refused the backward. A copy is told by its address now."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=torch.float32, device=backend.device, seed=23)
    own = BatchMeta(*(torch.empty_like(t).copy_(t) for t in case.meta))
    assert all(t._version > 0 for t in own)
    grad_out = case.signed((case.shape[0], case.shape[2]))
    leaves = leaves_of(case, case.signed((case.shape[0], case.shape[2])))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = lora_ops.lora_forward(leaves["y"], leaves["x"], leaves["lora_a"], leaves["lora_b"], case.scale,
                                    case.rank, batch=own, slice_widths=case.slice_widths)
    out.backward(grad_out)
    _, ref = reference_grads(case, leaves, grad_out)
    for name in LEAVES:
        assert rel_err(leaves[name].grad, ref[name]) <= TOLERANCE[torch.float32], name


def _halve_b_rank(leaves):
    """``.data`` swap of lora_b [L, N, R] for [L, N, R / 2] (its rank no longer lora_a's): autograd's version
    counters do not see it, the ops' checks do."""
    b = leaves["lora_b"].detach()
    leaves["lora_b"].data = b[..., :b.shape[2] // 2].contiguous()


def _record_trusted_calls(monkeypatch, device):
    """The list every call of a trusted kernel (ops.TRUSTED: the backward's unchecked op calls) on ``device``
    appends its op's name to, for the test."""
    calls = []
    for name, kernels in lora_ops.ops.TRUSTED.items():
        monkeypatch.setitem(kernels, device, lambda *a, _k=kernels[device], _n=name: calls.append(_n) or _k(*a))
    return calls


@pytest.mark.parametrize("op", ["lora_forward", "lora_linear"])
def test_backward_skips_its_checks_only_on_the_forwards_inputs(backend, monkeypatch, op):
    """The backward formula's op calls skip their argument checks (ops.call_trusted) while the saved inputs
    are as the forward's checks saw them: the same gradients bit for bit as with the checks. A ``.data`` swap
    between forward and backward (autograd's version counters do not see one) takes the checked calls,
    which refuse it, rather than kernels reading past the smaller tensor."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=torch.float32, device=backend.device, seed=19)
    M, K, N = case.shape[:3]
    trusted = _record_trusted_calls(monkeypatch, "cuda" if case.x.is_cuda else "cpu")
    weight = case.signed((N, K))
    grad_out = case.signed((M, N))

    def grads(swap=None):
        leaves = leaves_of(case, case.signed((M, N)))
        if op == "lora_forward":
            out = forward(case, leaves)
        else:
            out = torch.ops.lora_ops.lora_linear(leaves["x"], weight, None, leaves["lora_a"], leaves["lora_b"],
                                                 case.scale, case.rank, case.slice_widths, *case.meta)
        if swap:
            swap(leaves)
        out.backward(grad_out)
        return [leaves[n].grad for n in ("x", "lora_a", "lora_b")]

    monkeypatch.setattr(lora_ops.autograd, "_bound_enabled", [False])   # (a bound backward calls no op: next test)
    fast = grads()
    assert sorted(trusted) == ["lora_grad_a", "lora_grad_b", "lora_grad_h", "lora_grad_x", "shrink"]
    trusted.clear()
    monkeypatch.setattr(lora_ops.autograd, "_unchanged", lambda ctx, tensors: False)
    checked = grads()
    assert trusted == []
    for got, want in zip(fast, checked):
        assert torch.equal(got, want)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="lora_a"):
        grads(_halve_b_rank)


def test_bound_backward_replays_the_op_calls_bit_for_bit(triton_kernels, monkeypatch):
    """A backward whose op calls ran on plans is bound (lora_ops.autograd._delta_grads): later backwards of
    its key replay the plans without calling the ops, and give the op calls' gradients bit for bit. A new
    key (other gradients needed, another incoming-gradient layout, an adapter swapped for one of the same
    shape but other strides, the plans dropped) records again; a swap of shape takes the checked calls."""
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=torch.float32, device=triton_kernels.device,
                     seed=23)
    M, K, N = case.shape[:3]
    weight = case.signed((N, K))
    calls = _record_trusted_calls(monkeypatch, "cuda" if case.x.is_cuda else "cpu")

    def grads(grad_out, needs=LEAVES[1:], swap=None):
        leaves = leaves_of(case, case.signed((M, N)), needs)
        if swap:
            swap(leaves)
        out = torch.ops.lora_ops.lora_linear(leaves["x"], weight, None, leaves["lora_a"], leaves["lora_b"],
                                             case.scale, case.rank, case.slice_widths, *case.meta)
        out.backward(grad_out)
        return [leaves[n].grad for n in ("x", "lora_a", "lora_b")]

    def unbound(**kw):
        lora_ops.autograd.set_bound_backward(False)
        try:
            return grads(**kw)
        finally:
            lora_ops.autograd.set_bound_backward(True)

    def check(want, got):
        for w, g in zip(want, got):
            assert (w is None and g is None) or torch.equal(w, g)

    monkeypatch.setattr(lora_ops.autograd, "_BOUND", {})
    bound = lora_ops.autograd._BOUND
    grad_out = case.signed((M, N))
    first = grads(grad_out=grad_out)
    assert len(bound) == 1 and sorted(calls) == ["lora_grad_a", "lora_grad_b", "lora_grad_h", "lora_grad_x", "shrink"]
    calls.clear()
    check(first, grads(grad_out=grad_out))
    assert calls == [], "the bound backward called its ops"
    check(unbound(grad_out=grad_out), first)

    transposed = grad_out.t().contiguous().t()
    for kw in (dict(needs=("lora_b",), grad_out=grad_out), dict(grad_out=transposed)):
        want = unbound(**kw)
        calls.clear()
        check(want, grads(**kw))      # records
        check(want, grads(**kw))      # replays
        assert calls.count("shrink") == 1
    assert len(bound) == 3

    def strided_a(leaves):   # the same shape and values, other strides: a key of its own
        leaves["lora_a"].data = leaves["lora_a"].detach().transpose(2, 3).contiguous().transpose(2, 3)
    want = unbound(swap=strided_a, grad_out=grad_out)
    check(want, grads(swap=strided_a, grad_out=grad_out))
    assert len(bound) == 4
    check(first, unbound(grad_out=grad_out))
    lora_ops.plan.clear()
    calls.clear()
    check(first, grads(grad_out=grad_out))
    assert "shrink" in calls and len(bound) == 5

    leaves = leaves_of(case, case.signed((M, N)))
    out = torch.ops.lora_ops.lora_linear(leaves["x"], weight, None, leaves["lora_a"], leaves["lora_b"],
                                         case.scale, case.rank, case.slice_widths, *case.meta)
    _halve_b_rank(leaves)      # after the forward: the checked calls refuse it
    with pytest.raises(ValueError, match="lora_a"):
        out.backward(grad_out)


def test_bound_backward_keys_the_slice_widths(triton_kernels, monkeypatch):
    """Two packed layers alike in every shape, stride and dtype but their slices' widths (20 + 12 and 12 + 20
    columns) bind backwards of their own: one replaying the other's plans would take dh and dB over the
    other's column ranges. Each, recorded and then replayed, matches float64."""
    monkeypatch.setattr(lora_ops.autograd, "_BOUND", {})
    for widths in ([20, 12], [12, 20]):
        case = make_case(M=21, K=24, N=32, num_slots=2, num_slices=2, max_rank=8, ranks=[8, 5], slice_widths=widths,
                         dtype=torch.float32, device=triton_kernels.device, seed=59)
        for _ in range(2):      # records, then replays
            run_and_compare(case, case.signed((21, 32)), torch.float32)
    assert len(lora_ops.autograd._BOUND) == 2


# -- the backward ops on their own ---------------------------------------------------------------------

@pytest.mark.parametrize("wide", [False, True, "deep"], ids=["heuristic", "wide_q_config", "deep_step_config"])
def test_segment_outer_kernel_writes_every_output_element(triton_kernels, wide):
    """The Triton launcher's output is never zero-filled: poison it with NaN and check all of it. Also with
    the config the heuristic gives wide outputs (launch_grad.WIDE_Q: 32-token steps) and the one it gives a
    small grid from 1024 tokens (launch_grad.DEEP_STEP: 128-token steps, more than these tokens)."""
    backend = triton_kernels
    spec = dict(GRAD_CASES["gate_up_mixed_ranks"], K=200 if wide == "deep" else 24)   # (deep: 128-column blocks)
    case = make_case(**spec, dtype=torch.float32, device=backend.device, seed=19)
    M, K, _, L, _, R = case.shape
    u, v = case.signed((M, R), torch.float32), case.signed((M, K))
    out = torch.full((L, R, K), float("nan"), device=case.x.device)
    if wide == "deep":
        cfg = launch_grad.segment_outer_config(R, K, L, num_tokens=1024)
        assert cfg.block_t == launch_grad.DEEP_STEP["block_t"] and cfg.block_q == 128
    else:
        cfg = launch_grad.segment_outer_config(R, launch_grad.WIDE_Q if wide else K, L)
        assert (cfg.block_t == 32) == wide
    launch_grad.launch_segment_outer(out, u, v, case.rank, *case.meta, cfg)
    assert not out.isnan().any()
    assert rel_err(out, segment_outer_reference(u, v, case)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("write_all", [False, True], ids=["adapted_rows", "write_all"])
@pytest.mark.parametrize("one_rank_block", [False, True], ids=["rank_blocks", "one_rank_block"])
@pytest.mark.parametrize("n_loop", [1, 3], ids=["one_column_block", "three_column_blocks"])
def test_lora_grad_x_kernel_rows_written(triton_kernels, n_loop, one_rank_block, write_all):
    """Poisoned dx: the rows of adapted tokens are written; the others are never touched, or with write_all
    (the op's launch) get zeros, slot -1 and the rank-0 slot alike; both of dx's paths (rank blocks, the whole
    rank in one block). Also with a program walking three 16-wide column blocks of K = 24 (the third past K).
    dh holds NaN past each token's rank (within the rank's vector loads: rank 7 of 20) and in rows without an
    adapter: never multiplied."""
    backend = triton_kernels
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=torch.float32, device=backend.device, seed=23)
    M, K, _, L, S, R = case.shape
    dh = nan_past_rank(case.signed((M, S, R), torch.float32), case)
    dx = torch.full((M, K), float("nan"), device=case.x.device)
    cfg = launch_grad.grad_x_config(M, K, R, S)
    if one_rank_block:
        cfg = cfg._replace(block_r=32, one_rank_block=True)
    if n_loop > 1:
        cfg = cfg._replace(block_n=16, n_loop=n_loop)
        assert launch_grad.cdiv(K, 16) % n_loop
    launch_grad.launch_lora_grad_x(dx, dh, case.lora_a, case.rank, *case.meta, cfg, write_all=write_all)
    untouched = case.untouched_rows().to(dx.device)
    slots = case.token_slots.cpu()
    assert (slots < 0).any() and (case.rank.cpu()[slots.clamp(min=0)][slots >= 0] == 0).any()   # both kinds
    if write_all:
        assert (dx[untouched] == 0).all()
    else:
        assert dx[untouched].isnan().all()
    assert not dx[~untouched].isnan().any()
    want = grad_x_reference(dh, case)
    assert rel_err(dx[~untouched], want[~untouched.cpu()]) <= TOLERANCE[torch.float32]


def poison_unzeroed_scratch(monkeypatch):
    """Every scratch buffer allocated unzeroed (Scratch.alloc) comes back filled with NaN; returns the list
    of the specs (shape, dtype, zero) of the buffers allocated since."""
    real_alloc = launch.Scratch.alloc
    seen = []

    def poisoned(spec, device):
        buf = real_alloc(spec, device)
        seen.append(spec)
        return buf if spec.zero else buf.fill_(float("nan"))
    monkeypatch.setattr(launch.Scratch, "alloc", poisoned)
    return seen


def nan_past_rank(dh, case):
    """``dh`` [M, S, R] with NaN wherever lora_grad_x (and a segment_outer of its rank side) must not read it: past
    each token's slot rank, and the whole rows of tokens without an adapter (the kernels zero what they load there
    or mask it off; the torch CPU kernels never index it)."""
    slots = case.token_slots.cpu()
    ranks = torch.cat([case.rank.cpu(), torch.zeros(1, dtype=case.rank.dtype)])[slots]    # (slot -1: rank 0)
    past = torch.arange(dh.shape[2]) >= ranks[:, None]                                     # [M, R]
    return dh.masked_fill(past[:, None, :].to(dh.device), float("nan"))


def test_lora_grad_x_of_a_rank_zero_stack_is_zero(backend):
    """dh [M, S, 0] against lora_a [L, S, 0, K]: no rank row to contract, dx is zero on every backend (the torch
    CPU kernel raised torch's "cannot reshape tensor of 0 elements" there: session 45's input audit)."""
    meta = build_batch_meta(torch.tensor([0, 1, -1, 1]), 2)
    dx = torch.ops.lora_ops.lora_grad_x(torch.randn(4, 2, 0, device=backend.device),
                                        torch.randn(2, 2, 0, 8, device=backend.device),
                                        torch.tensor([3, 1], dtype=torch.int32, device=backend.device),
                                        *[t.to(backend.device) for t in meta])
    assert torch.equal(dx.cpu(), torch.zeros(4, 8))


def test_lora_grad_x_op_needs_no_zeroed_output(triton_kernels, monkeypatch):
    """The op allocates dx unzeroed (the kernel writes every row): with every unzeroed scratch buffer poisoned
    with NaN, rows of tokens without a delta still come back zero and the others match float64."""
    seen = poison_unzeroed_scratch(monkeypatch)
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=torch.float32, device=triton_kernels.device, seed=29)
    M, K, _, L, S, R = case.shape
    dh = case.signed((M, S, R), torch.float32)
    for _ in range(2):   # the call that keeps the plan, then its replay
        dx = torch.ops.lora_ops.lora_grad_x(dh, case.lora_a, case.rank, *case.meta)
        untouched = case.untouched_rows().to(dx.device)
        assert (dx[untouched] == 0).all() and not dx.isnan().any()
        assert rel_err(dx[~untouched], grad_x_reference(dh, case)[~untouched.cpu()]) <= TOLERANCE[torch.float32]
    assert launch.Scratch((M, K), dh.dtype, zero=False) in seen   # dx was allocated unzeroed, so poisoned


def many_tiles_case(device, capacity, shuffle_seed, **shape):
    """300 tokens whose groups span several tiles: three slots (not a power of two), 40 tokens on slot 0, 90 on
    slot 1 (give it rank 0), none on slot 2, 170 without an adapter, shuffled; float32, two slices; ``shape``:
    K, N, max_rank, ranks. Returns the case and its slots."""
    M = 300
    gen = torch.Generator().manual_seed(shuffle_seed)
    slots = torch.tensor([0] * 40 + [1] * 90 + [-1] * 170)[torch.randperm(M, generator=gen)]
    case = make_case(M=M, num_slots=3, num_slices=2, token_slots=slots, capacity=capacity, dtype=torch.float32,
                     device=device, seed=3, **shape)
    return case, slots


@pytest.mark.parametrize("capacity", [None, 400], ids=["exact_capacity", "stale_ids_past_M"])
@pytest.mark.parametrize("block_m", [16, 64], ids=["16_token_tiles", "64_token_tiles"])
def test_lora_grad_x_op_writes_groups_of_many_tiles(triton_kernels, monkeypatch, block_m, capacity):
    """The write-all work list past its first tile of a group: three slots (not a power of two), a rank-0 slot
    of 90 tokens and 170 tokens without an adapter (several tiles each), a slot without tokens, metadata
    longer than M; dx poisoned, against float64 (zeros where a token has no delta)."""
    seen = poison_unzeroed_scratch(monkeypatch)
    case, _ = many_tiles_case(triton_kernels.device, capacity, 5, K=24, N=16, max_rank=8, ranks=[8, 0, 5])
    M = case.shape[0]
    cfg = launch_grad.grad_x_config(M, 24, 8, 2)._replace(block_m=block_m)
    monkeypatch.setattr(launch_grad, "grad_x_config", lambda *a, **k: cfg)
    dh = case.signed((M, 2, 8), torch.float32)
    dx = torch.ops.lora_ops.lora_grad_x(dh, case.lora_a, case.rank, *case.meta)
    assert launch.Scratch((M, 24), torch.float32, zero=False) in seen and not dx.isnan().any()
    assert (dx[case.untouched_rows().to(dx.device)] == 0).all()
    assert rel_err(dx, grad_x_reference(dh, case)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("split_k", [1, 6], ids=["one_split", "six_splits_the_last_empty"])
@pytest.mark.parametrize("capacity", [None, 400], ids=["exact_capacity", "stale_ids_past_M"])
@pytest.mark.parametrize("op,slice_group", [("shrink", 1), ("shrink", 4), ("lora_grad_h", 1)],
                         ids=["shrink", "shrink_slice_group_past_S", "lora_grad_h"])
def test_shrink_ops_return_h_written_whole(triton_kernels, monkeypatch, op, slice_group, capacity, split_k):
    """The shrink op and lora_grad_h allocate the h they return unzeroed (the kernel writes every entry): poisoned
    with NaN, past a group's first tile (three slots, a rank-0 slot of 90 tokens and 170 tokens without an
    adapter, a slot without tokens, 16-token tiles, two 16-rank blocks; four slices a program where there are
    two), with and without split-K (16-feature steps: the last three of six splits of 40 features get none, and
    lora_grad_h's past its slice's 13 or 11 columns), metadata longer than M: against float64 everywhere, zeros
    past each token's rank. A token of x holding inf gives inf / NaN within its slot's rank only (0 * inf never
    reaches an entry past it)."""
    seen = poison_unzeroed_scratch(monkeypatch)
    case, slots = many_tiles_case(triton_kernels.device, capacity, 7, K=40, N=24, max_rank=32, ranks=[13, 0, 5])
    M, _, N = case.shape[:3]
    cfg = lora_ops.configs.heuristics.ShrinkConfig(16, 16, 16, split_k, 4, 2, slice_group)
    monkeypatch.setattr(lora_ops.configs, "shrink_config", lambda *a, **k: cfg)
    untouched = case.untouched_rows()
    if op == "shrink":
        x = case.x.clone()
        inf_token = int((slots == 0).nonzero()[0])
        x[inf_token, 3] = float("inf")
        h = torch.ops.lora_ops.shrink(x, case.lora_a, case.scale, case.rank, *case.meta)
        want = shrink_reference(x, case.lora_a, case.scale, case.rank, slots)   # (NaN in inf_token's row)
        assert not h[inf_token, :, :13].isfinite().all() and (h[inf_token, :, 13:] == 0).all()
        keep = torch.arange(M) != inf_token
        h, want, untouched = h[keep.to(h.device)], want[keep], untouched[keep]
    else:
        grad_out = case.signed((M, N))
        h = torch.ops.lora_ops.lora_grad_h(grad_out, case.lora_b, case.scale, case.rank, case.slice_widths,
                                           *case.meta)
        want = grad_h_reference(grad_out, case)
    assert launch.Scratch((M, 2, 32), torch.float32, zero=False) in seen and not h.isnan().any()
    assert untouched.sum() == 260 and (h[untouched.to(h.device)] == 0).all()
    assert (h.cpu()[want == 0] == 0).all()
    assert rel_err(h, want) <= TOLERANCE[torch.float32]


ONE_RANK_BLOCK_CASES = {**GRAD_CASES, "three_slices_rank_64": dict(M=23, K=40, N=48, num_slots=2, num_slices=3,
                                                                    max_rank=64, ranks=[64, 37])}


@pytest.mark.parametrize("case_id,n_loop", [("one_slice", 1), ("qkv_3_slices", 2), ("gate_up_mixed_ranks", 3),
                                            ("three_slices_rank_64", 2)],
                         ids=["one_slice", "three_slices_two_blocks", "two_slices_rank_20_three_blocks",
                              "three_slices_rank_64_past_the_heuristics_cap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_lora_grad_x_one_rank_block_splits_dh_once(triton_kernels, bf16_interpreter, dtype, case_id, n_loop):
    """lora_grad_x's ONE_RANK_BLOCK path (dh of every slice loaded and split once, one dot a column block over
    the slices side by side; three slices take four slices' columns, at rank 64 more than the heuristic gives
    it): poisoned dx, rows of adapted tokens written and the others never touched; A and dh past each slot's rank
    NaN (never multiplied); programs walking 16-wide column blocks, the last past K; against float64 token by
    token."""
    case = make_case(**ONE_RANK_BLOCK_CASES[case_id], dtype=dtype, device=triton_kernels.device, seed=41)
    M, K, _, L, S, R = case.shape
    lora_a = case.lora_a.clone()
    for slot, r in enumerate(case.rank.tolist()):
        lora_a[slot, :, r:] = float("nan")
    dh = nan_past_rank(case.signed((M, S, R), torch.float32), case)
    dx = torch.full((M, K), float("nan"), device=case.x.device, dtype=dtype)
    cfg = launch_grad.grad_x_config(M, K, R, S)._replace(block_n=16, n_loop=n_loop, one_rank_block=True)
    assert R <= cfg.block_r
    launch_grad.launch_lora_grad_x(dx, dh, lora_a, case.rank, *case.meta, cfg)
    untouched = case.untouched_rows().to(dx.device)
    assert dx[untouched].isnan().all()
    assert not dx[~untouched].isnan().any()
    want = grad_x_reference(dh, case)
    assert rel_err(dx[~untouched], want[~untouched.cpu()]) <= TOLERANCE[dtype]


def test_lora_grad_x_one_rank_block_refuses_a_rank_past_its_block():
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=torch.float32, seed=3)
    M, K, _, L, S, R = case.shape
    cfg = launch_grad.grad_x_config(M, K, R, S)._replace(block_r=16, one_rank_block=True)
    with pytest.raises(ValueError, match="rank \\(20\\) within block_r \\(16\\)"):
        launch_grad.launch_lora_grad_x(torch.zeros(M, K), case.signed((M, S, R), torch.float32), case.lora_a,
                                       case.rank, *case.meta, cfg, run=False)


def test_lora_grad_x_past_1024_tokens_walks_column_blocks(triton_kernels, monkeypatch):
    """From 1024 tokens the heuristic gives a program several column blocks (launch_grad.grad_x_n_loop); the op
    still matches float64 token by token, rows of tokens without an adapter zero."""
    backend = triton_kernels
    dtype = large_bucket_dtype(backend)
    case = make_case(M=1100, K=4096, N=32, num_slots=4, num_slices=1, max_rank=16, ranks=[16, 3, 0, 9],
                     dtype=dtype, device=backend.device, seed=31)
    M, K, _, L, S, R = case.shape
    launched = record_grad_launches(monkeypatch)
    dh = case.signed((M, S, R), torch.float32)
    dx = torch.ops.lora_ops.lora_grad_x(dh, case.lora_a, case.rank, *case.meta)
    assert [cfg.n_loop for cfg in launched["lora_grad_x"]] == [2]
    untouched = case.untouched_rows().to(dx.device)
    assert (dx[untouched] == 0).all()
    assert rel_err(dx, grad_x_reference(dh, case)) <= TOLERANCE[dtype]


def segment_outer_reference(u, v, case):
    """float64 [L, P, Q], token by token (``case``: its rank and token_slots)."""
    L = case.rank.shape[0]
    out = torch.zeros(L, u.shape[1], v.shape[1], dtype=torch.float64)
    ranks = case.rank.tolist()
    for t, s in enumerate(case.token_slots.tolist()):
        if s >= 0:
            r = ranks[s]
            out[s, :r] += u[t, :r].double().cpu()[:, None] * v[t].double().cpu()[None, :]
    return out


def grad_x_reference(dh, case):
    """float64 [M, K], token by token (``case``: its lora_a, rank and token_slots)."""
    out = torch.zeros(dh.shape[0], case.lora_a.shape[-1], dtype=torch.float64)
    ranks = case.rank.tolist()
    for t, s in enumerate(case.token_slots.tolist()):
        if s >= 0:
            r = ranks[s]
            out[t] = torch.einsum("sr,srk->k", dh[t, :, :r].double().cpu(), case.lora_a[s, :, :r].double().cpu())
    return out


@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_backward_ops_match_token_by_token_reference(backend, dtype):
    """lora_grad_x and segment_outer on both backends, dh NaN where neither reads it (past each token's rank,
    rows without an adapter)."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=dtype, device=backend.device, seed=29)
    M, K, _, L, S, R = case.shape
    dh = nan_past_rank(case.signed((M, S, R), torch.float32), case)
    dx = torch.ops.lora_ops.lora_grad_x(dh, case.lora_a, case.rank, *case.meta)
    assert dx.dtype == dtype and dx.shape == (M, K)
    assert rel_err(dx, grad_x_reference(dh, case)) <= TOLERANCE[dtype]
    v = laid_out(case.signed((M, K)), "column_slice", case.gen)
    out = torch.ops.lora_ops.segment_outer(dh[:, 1], v, case.rank, *case.meta)
    assert out.dtype == dtype and out.shape == (L, R, K)
    assert rel_err(out, segment_outer_reference(dh[:, 1], v, case)) <= TOLERANCE[dtype]


def grad_h_reference(grad_out, case):
    """float64 [M, S, R], token by token: scale * grad_out[t, slice i] @ B[s, slice i, :r]."""
    M, _, _, _, S, R = case.shape
    out = torch.zeros(M, S, R, dtype=torch.float64)
    ranks, scales = case.rank.tolist(), case.scale.tolist()
    bounds = torch.tensor([0, *case.slice_widths]).cumsum(0).tolist()
    for t, s in enumerate(case.token_slots.tolist()):
        if s >= 0:
            r = ranks[s]
            for i in range(S):
                lo, hi = bounds[i], bounds[i + 1]
                b = case.lora_b[s, lo:hi, :r].double().cpu()
                out[t, i, :r] = scales[s] * (grad_out[t, lo:hi].double().cpu() @ b)
    return out


def grad_a_reference(dh, x, case):
    """float64 [L, S, R, K]: the slices' segment_outer references, stacked."""
    return torch.stack([segment_outer_reference(dh[:, i], x, case) for i in range(dh.shape[1])], dim=1)


def grad_b_reference(grad_out, h, case):
    """float64 [L, N, R]: each slice's segment_outer reference, transposed into its columns."""
    bounds = torch.tensor([0, *case.slice_widths]).cumsum(0).tolist()
    return torch.cat([segment_outer_reference(h[:, i], grad_out[:, bounds[i]:bounds[i + 1]], case).transpose(1, 2)
                      for i in range(h.shape[1])], dim=1)


# From 1024 tokens the backward's configs change (heuristics.SELF_SUM_MIN_BUCKET, launch_grad.DEEP_STEP): a
# case past it, its 128-column blocks and 16-wide rank blocks on a grid small enough for the deep token steps.
SLICE_OP_CASES = dict(GRAD_CASES, tokens_1100=dict(M=1100, K=200, N=192, num_slots=4, num_slices=2, max_rank=16,
                                                   ranks=[16, 5, 0, 11]))


# tokens_1100 in bfloat16 too: on a GPU only bfloat16 takes the deep token steps (launch_grad.segment_outer_config).
SLICE_OP_PARAMS = [pytest.param(dtype, case_id, id=f"{dtype_id(dtype)}-{case_id}")
                   for dtype in FP16_FP32 for case_id in ("qkv_3_slices", "gate_up_mixed_ranks", "one_slice",
                                                          "all_minus_one", "tokens_1100")]
SLICE_OP_PARAMS.append(pytest.param(torch.bfloat16, "tokens_1100", id="bf16-tokens_1100"))


@pytest.mark.parametrize("dtype, case_id", SLICE_OP_PARAMS)
def test_slice_ops_match_token_by_token_reference(backend, monkeypatch, checked_dtype, case_id):
    """lora_grad_h, lora_grad_a, lora_grad_b: every slice in one call, against float64, with a strided
    output gradient (a transposed layout: features at stride M) and x at a column offset. Past 1024 tokens
    dA and dB take 128-token steps, except float32 and float16 on a GPU (their own configs)."""
    dtype = checked_dtype
    case = make_case(**SLICE_OP_CASES[case_id], dtype=dtype, device=backend.device, seed=41)
    launched = record_grad_launches(monkeypatch)
    M, K, N, L, S, R = case.shape
    grad_out = laid_out(case.signed((M, N)), "transposed", case.gen)
    dh = torch.ops.lora_ops.lora_grad_h(grad_out, case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
    assert dh.dtype == torch.float32 and dh.shape == (M, S, R)
    # dh is float32 from 16-bit operands whose products are exact: float32's tolerance at every dtype (a dh
    # rounded to 16 bits on the way passed float16's, session 48's test audit).
    assert rel_err(dh, grad_h_reference(grad_out, case)) <= H_TOLERANCE
    x = laid_out(case.signed((M, K)), "column_slice", case.gen)
    u = case.signed((M, S, R), torch.float32)
    da = torch.ops.lora_ops.lora_grad_a(u, x, case.rank, *case.meta)
    assert da.dtype == dtype and da.shape == (L, S, R, K)
    assert rel_err(da, grad_a_reference(u, x, case)) <= TOLERANCE[dtype]
    db = torch.ops.lora_ops.lora_grad_b(grad_out, u, case.rank, case.slice_widths, *case.meta)
    assert db.dtype == dtype and db.shape == (L, N, R)
    assert rel_err(db, grad_b_reference(grad_out, u, case)) <= TOLERANCE[dtype]
    if case_id == "tokens_1100" and backend.name == "triton":     # dA's and dB's token steps of 128
        steps = [cfg.block_t for cfg in launched["lora_grad_a"] + launched["lora_grad_b"]]
        own_gpu_configs = backend.device == "cuda" and dtype in FP16_FP32
        assert len(steps) == 2 and all((t != 128) if own_gpu_configs else (t == 128) for t in steps), steps


def test_slice_ops_kernels_write_every_output_element(triton_kernels):
    """dA's and dB's launchers write all of their output (the ops never zero-fill it): poisoned with NaN,
    every element comes back a number and right; dh's launch (the shrink over each slice's own columns,
    launch_shrink's slice_k) writes every entry of an adapted token up to its slot's rank and leaves the rest,
    or with write_all (the op's launch) writes zeros there: past the slot's rank, slot -1, the rank-0 slot."""
    backend = triton_kernels
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=torch.float32, device=backend.device, seed=43)
    M, K, N, L, S, R = case.shape
    x, grad_out, u = case.signed((M, K)), case.signed((M, N)), case.signed((M, S, R), torch.float32)
    da = torch.full((L, S, R, K), float("nan"), device=x.device)
    launch_grad.launch_lora_grad_a(da, u, x, case.rank, *case.meta, launch_grad.segment_outer_config(R, K, L * S))
    assert not da.isnan().any() and rel_err(da, grad_a_reference(u, x, case)) <= TOLERANCE[torch.float32]
    db = torch.full((L, N, R), float("nan"), device=x.device)
    cfg = launch_grad.segment_outer_config(R, N, L)._replace(block_q=16)   # several column blocks per slice
    launch_grad.launch_lora_grad_b(db, u, grad_out, case.rank, case.slice_widths, *case.meta, cfg)
    assert not db.isnan().any() and rel_err(db, grad_b_reference(grad_out, u, case)) <= TOLERANCE[torch.float32]
    dh = torch.full((M, S, R), float("nan"), device=x.device)
    a = case.lora_b.transpose(1, 2).contiguous().unsqueeze(1).expand(L, S, R, N)   # B^T, every slice's A
    cols = launch.slice_layout(case.slice_widths, 1)[0]
    want = grad_h_reference(grad_out, case)
    ranks = case.rank.tolist()
    assert 0 in ranks and (case.token_slots < 0).any() and min(r for r in ranks if r) < R
    for split_k, write_all in itertools.product((1, 3), (False, True)):
        # split-K: each slice's columns cut in three, the last split adding them
        cfg = lora_ops.configs.heuristics.ShrinkConfig(16, 16, 16, split_k, 4, 2, 1)
        grid = launch.shrink_grid(M, S, R, L, cfg)
        sums = [spec.alloc(x.device) for spec in launch.shrink_sum_scratch(M, S, R, grid, cfg)]
        dh.fill_(float("nan"))
        launch.launch_shrink(grad_out, a, case.scale, case.rank, *case.meta, dh, cfg, sum_scratch=sums, slice_k=cols,
                             write_all=write_all)
        for t, s in enumerate(case.token_slots.tolist()):
            r = ranks[s] if s >= 0 else 0
            assert not dh[t, :, :r].isnan().any(), (split_k, t)
            torch.testing.assert_close(dh[t, :, :r].double().cpu(), want[t, :, :r], rtol=1e-5, atol=1e-5)
            if write_all:
                assert (dh[t, :, r:] == 0).all(), (split_k, t)
            else:
                assert dh[t, :, r:].isnan().all(), (split_k, t)


# -- opcheck and the compiler --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_opcheck_add_lora_with_grad(backend, dtype):
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=dtype, device=backend.device, seed=31)
    leaves = leaves_of(case, case.signed((case.shape[0], case.shape[2])))
    args = (leaves["y"], leaves["x"], leaves["lora_a"], leaves["lora_b"], case.scale, case.rank,
            case.slice_widths, *case.meta)
    torch.library.opcheck(torch.ops.lora_ops.add_lora.default, args)


@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_opcheck_backward_ops(backend, dtype):
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks"], dtype=dtype, device=backend.device, seed=37)
    M, K, N, L, S, R = case.shape
    dh = case.signed((M, S, R), torch.float32)
    torch.library.opcheck(torch.ops.lora_ops.lora_grad_x.default, (dh, case.lora_a, case.rank, *case.meta))
    grad_out = laid_out(case.signed((M, N)), "transposed", case.gen)
    torch.library.opcheck(torch.ops.lora_ops.segment_outer.default,
                          (dh[:, 1], grad_out[:, 5:], case.rank, *case.meta))
    torch.library.opcheck(torch.ops.lora_ops.lora_grad_h.default,
                          (grad_out, case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta))
    torch.library.opcheck(torch.ops.lora_ops.lora_grad_a.default, (dh, case.x, case.rank, *case.meta))
    torch.library.opcheck(torch.ops.lora_ops.lora_grad_b.default,
                          (grad_out, dh, case.rank, case.slice_widths, *case.meta))


def test_compile_one_graph_with_backward_for_every_token_count(backend):
    """fullgraph, aot_eager, forward + backward, token dim dynamic: M in {2, 7, 33} compile once."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    base = dict(K=24, N=32, num_slots=3, num_slices=2, max_rank=8, ranks=[8, 3, 0], capacity=40)

    @torch.compile(fullgraph=True, backend=counter)
    def layer(y, x, lora_a, lora_b, scale, rank, meta):
        return lora_ops.lora_forward(y, x, lora_a, lora_b, scale, rank, batch=meta, slice_widths=[20, 12]) * 2.0

    for M in (2, 7, 33):
        case = make_case(M=M, **base, dtype=torch.float32, device=backend.device, seed=M, slice_widths=[20, 12])
        leaves = leaves_of(case, case.signed((M, 32)))
        torch._dynamo.mark_dynamic(leaves["x"], 0)
        torch._dynamo.mark_dynamic(leaves["y"], 0)
        grad_out = case.signed((M, 32))
        out = layer(leaves["y"], leaves["x"], leaves["lora_a"], leaves["lora_b"], case.scale, case.rank, case.meta)
        out.backward(grad_out)
        _, ref = reference_grads(case, leaves, 2.0 * grad_out)
        for name in LEAVES:
            assert rel_err(leaves[name].grad, ref[name]) <= TOLERANCE[torch.float32], (M, name)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} compiles for 3 token counts"


# ---- lora_linear (the whole layer in one op): its gradients are the base layer's plus the delta's ----

LINEAR_LEAVES = ("x", "weight", "bias", "lora_a", "lora_b")


def check_lora_linear_grads(case, dtype, needs=LINEAR_LEAVES):
    """lora_linear's forward and the gradients of ``needs`` (the other inputs frozen) against float64; each
    frozen input gets none."""
    M, K, N = case.shape[:3]
    values = {"x": case.x, "weight": case.signed((N, K)) * K ** -0.5, "bias": case.signed((N,)),
              "lora_a": case.lora_a, "lora_b": case.lora_b}
    leaves = {n: same_layout_copy(v).requires_grad_(n in needs) for n, v in values.items()}
    out = torch.ops.lora_ops.lora_linear(*[leaves[n] for n in LINEAR_LEAVES], case.scale, case.rank,
                                         case.slice_widths, *case.meta)
    grad_out = case.signed((M, N))
    out.backward(grad_out)
    ref = {n: v.detach().double().requires_grad_(n in needs) for n, v in values.items()}
    ref_out = lora_forward_reference(F.linear(ref["x"], ref["weight"], ref["bias"]), ref["x"], ref["lora_a"],
                                     ref["lora_b"], case.scale, case.rank, case.token_slots, case.slice_widths)
    ref_out.backward(grad_out.double())
    tol = TOLERANCE[dtype]
    assert rel_err(out, ref_out) <= tol, "forward"
    for name in LINEAR_LEAVES:
        if name not in needs:
            assert leaves[name].grad is None, name
            continue
        expected = torch.zeros_like(ref[name]) if ref[name].grad is None else ref[name].grad
        err = rel_err(leaves[name].grad, expected)
        assert err <= tol, f"d{name}: relative error {err:.3g} > {tol:g}"


@pytest.mark.parametrize("case_id", ["qkv_3_slices", "strided_x", "all_minus_one", "no_tokens"])
@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_lora_linear_grads_match_float64_reference(backend, dtype, case_id):
    check_lora_linear_grads(make_case(**GRAD_CASES[case_id], dtype=dtype, device=backend.device, seed=23), dtype)


@pytest.mark.parametrize("needs", [("x", "lora_a", "lora_b"), ("x",), ("weight", "lora_b"), ("bias", "lora_a")],
                         ids=lambda n: "+".join(n))
def test_lora_linear_only_requested_grads(backend, needs):
    """lora_linear with some inputs frozen (PEFT's frozen base layer: x, A and B only): each requested gradient
    matches float64, dx with the base layer's term in it whether or not the weight trains, and each frozen
    input gets none (dW, dbias and the delta's gradients each follow their own input's need)."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=torch.float32, device=backend.device, seed=53)
    check_lora_linear_grads(case, torch.float32, needs)


DOUBLE_BACKWARD_CASES = ["qkv_3_slices", "gate_up_mixed_ranks", "strided_x", "slot_without_tokens",
                         "all_minus_one", "nan_past_rank"]


def penalty_grads(fn, leaves, wrt, grad_out):
    """A gradient penalty: the first-order gradients of (out * grad_out).sum() with create_graph=True, then the
    backward of the sum of their squares; returns (first-order gradients, the leaves' second-order .grad)."""
    inputs = [leaves[n] for n in wrt]
    first = [torch.zeros_like(t) if g is None else g for t, g in
             zip(inputs, torch.autograd.grad((fn(leaves) * grad_out).sum(), inputs, create_graph=True,
                                             allow_unused=True))]
    penalty = sum(g.double().pow(2).sum() for g in first)
    if penalty.requires_grad:   # (not where no token has an adapter: every gradient is then constant)
        penalty.backward()
    return [g.detach() for g in first], [t.grad for t in inputs]


@pytest.mark.parametrize("case_id", DOUBLE_BACKWARD_CASES)
@pytest.mark.parametrize("op", ["lora_forward", "lora_linear"])
def test_double_backward_matches_float64_reference(backend, op, case_id):
    """create_graph=True (gradient penalties, Hessian-vector products): the first-order gradients are then
    differentiable, and the second-order ones match the float64 reference's. Without a formula of their own
    the backward ops' second-order terms were dropped (torch only warned). "nan_past_rank": gate_up_mixed_ranks
    with NaN in A and B past each slot's rank (a rank-0 slot all NaN), which no kernel reads: the graph's
    masks multiplied them by zero, and every gradient came back NaN."""
    poison = case_id == "nan_past_rank"
    case = make_case(**GRAD_CASES["gate_up_mixed_ranks" if poison else case_id], dtype=torch.float32,
                     device=backend.device, seed=31, capacity=64)
    M, K, N = case.shape[:3]
    values = {"x": same_layout_copy(case.x), "lora_a": case.lora_a, "lora_b": case.lora_b,
              "weight": case.signed((N, K)) * K ** -0.5, "bias": case.signed((N,)), "y": case.signed((M, N))}
    wrt = ("x", "lora_a", "lora_b") + (("weight",) if op == "lora_linear" else ())

    def ours(t):
        if op == "lora_linear":
            return torch.ops.lora_ops.lora_linear(t["x"], t["weight"], t["bias"], t["lora_a"], t["lora_b"],
                                                  case.scale, case.rank, case.slice_widths, *case.meta)
        return forward(case, t)

    def reference(t):
        y = F.linear(t["x"], t["weight"], t["bias"]) if op == "lora_linear" else t["y"]
        return lora_forward_reference(y, t["x"], t["lora_a"], t["lora_b"], case.scale, case.rank, case.token_slots,
                                      case.slice_widths)

    grad_out = case.signed((M, N))
    grads = set(wrt) | {"y"}        # (y: so the reference's output needs grad where no token has an adapter)
    leaves = {n: same_layout_copy(v).requires_grad_(n in grads) for n, v in values.items()}
    ref_leaves = {n: v.detach().double().requires_grad_(n in grads) for n, v in values.items()}
    if poison:
        with torch.no_grad():
            for slot, rank in enumerate(case.rank.tolist()):
                leaves["lora_a"][slot, :, rank:] = float("nan")
                leaves["lora_b"][slot, :, rank:] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # torch's "autograd kernel was not registered" warning included
        first, second = penalty_grads(ours, leaves, wrt, grad_out)
    ref_first, ref_second = penalty_grads(reference, ref_leaves, wrt, grad_out.double())
    tol = TOLERANCE[torch.float32]
    names = [f"d{n}" for n in wrt] + [f"d(penalty)/d{n}" for n in wrt]
    for name, got, want in zip(names, first + second, ref_first + ref_second, strict=True):
        assert got is not None and torch.isfinite(got).all(), name
        want = torch.zeros_like(got, dtype=torch.float64) if want is None else want    # (the reference's: unused)
        assert rel_err(got, want) <= tol, f"{name}: relative error {rel_err(got, want):.3g}"


@pytest.mark.parametrize("poisoned", [2, 1], ids=["slot_with_tokens", "slot_without_tokens"])
def test_double_backward_keeps_a_slots_nan_in_its_own_gradients(backend, poisoned):
    """NaN in one slot's weights (inside its rank) reaches no other slot's gradients of any order. A penalty on
    the gradient of out² (grad_out itself a function of every slot's weights): the second-order graph
    multiplied the poisoned slot's weights into every row (zero cotangents times NaN), and the gradient through
    grad_out carried it to every slot."""
    case = make_case(**GRAD_CASES["slot_without_tokens"], dtype=torch.float32, device=backend.device, seed=33)
    y = case.signed((case.x.shape[0], case.lora_b.shape[1]))

    def grads(poison):
        leaves = {"y": y, "x": same_layout_copy(case.x).requires_grad_(),
                  "lora_a": case.lora_a.clone().requires_grad_(), "lora_b": case.lora_b.clone()}
        if poison:
            with torch.no_grad():
                leaves["lora_a"][poisoned, 0, 1] = float("nan")
        dx, = torch.autograd.grad(forward(case, leaves).square().sum(), leaves["x"], create_graph=True)
        da, = torch.autograd.grad(dx.square().sum(), leaves["lora_a"])
        return dx.detach(), da

    dx, da = grads(False)
    poisoned_dx, poisoned_da = grads(True)
    rows = (case.token_slots != poisoned).to(dx.device)
    others = [s for s in range(case.lora_a.shape[0]) if s != poisoned]
    assert torch.isfinite(poisoned_dx[rows]).all() and torch.equal(poisoned_dx[rows], dx[rows])
    assert torch.isfinite(poisoned_da[others]).all() and torch.equal(poisoned_da[others], da[others])
    assert torch.isnan(poisoned_da[poisoned]).any() == (poisoned == 2)     # (slot 2 has tokens: its own NaN)


@pytest.mark.parametrize("weight", ["lora_a", "lora_b", "scale"])
def test_create_graph_gradients_of_a_slot_without_tokens_are_zero_despite_its_nan(backend, weight):
    """A slot with no tokens and NaN in its weights or its scale (a scale buffer from torch.empty, the slot
    unused): its weight gradients are zeros with create_graph=True as without (the kernels' backward), not NaN.
    The graph's dense products met its NaN weights on rows no token of it owns (0 @ NaN), in its h and so in
    both its gradients; its scale multiplied h's masked gradient (0 * NaN)."""
    case = make_case(**GRAD_CASES["slot_without_tokens"], dtype=torch.float32, device=backend.device, seed=34)
    y = case.signed((case.x.shape[0], case.lora_b.shape[1]))
    grad_out = case.signed(y.shape)
    empty = 1                                       # (the case's slot without tokens)
    assert not (case.token_slots == empty).any()

    def grads(create_graph):
        leaves = {"y": y, "x": case.x, "lora_a": case.lora_a.clone().requires_grad_(),
                  "lora_b": case.lora_b.clone().requires_grad_()}
        with torch.no_grad():
            (case.scale if weight == "scale" else leaves[weight])[empty] = float("nan")
        return torch.autograd.grad(forward(case, leaves), (leaves["lora_a"], leaves["lora_b"]), grad_out,
                                   create_graph=create_graph)

    for first, second in zip(grads(False), grads(True)):
        assert torch.isfinite(second).all()
        torch.testing.assert_close(second.detach(), first, rtol=1e-5, atol=1e-5)
        assert torch.equal(second[empty], torch.zeros_like(second[empty]))


@pytest.mark.parametrize("how", ["func_jvp", "dual_level"])
@pytest.mark.parametrize("case_id", ["qkv_3_slices", "gate_up_mixed_ranks", "strided_x", "all_minus_one"])
@pytest.mark.parametrize("op", ["lora_forward", "lora_linear", "add_lora"])
def test_forward_mode_ad_matches_float64_reference(backend, op, case_id, how):
    """torch.func.jvp and forward_ad dual tensors through both ops, a tangent on every differentiable input:
    the output's tangent matches the float64 reference's (ops.FORWARD_AD; torch's custom-op autograd had
    returned the output without the delta's tangent). The functional in-place add_lora takes the op add_lora
    there and copies its result into y (the in-place op has no formula: it raised)."""
    case = make_case(**GRAD_CASES[case_id], dtype=torch.float32, device=backend.device, seed=41)
    M, K, N = case.shape[:3]
    names = ("x", "weight", "bias", "lora_a", "lora_b") if op == "lora_linear" else ("y", "x", "lora_a", "lora_b")
    values = {"x": same_layout_copy(case.x), "lora_a": case.lora_a, "lora_b": case.lora_b,
              "weight": case.signed((N, K)) * K ** -0.5, "bias": case.signed((N,)), "y": case.signed((M, N))}
    primals = [values[n] for n in names]
    tangents = [case.signed(values[n].shape) for n in names]

    def ours(*t):
        v = dict(zip(names, t))
        if op == "lora_linear":
            return lora_ops.ops.call("lora_linear", v["x"], v["weight"], v["bias"], v["lora_a"], v["lora_b"],
                                     case.scale, case.rank, case.slice_widths, *case.meta)
        if op == "add_lora":
            return lora_ops.add_lora(v["y"].clone(), v["x"], v["lora_a"], v["lora_b"], case.scale, case.rank,
                                     batch=case.meta, slice_widths=case.slice_widths)
        return forward(case, v)

    def reference(*t):
        v = dict(zip(names, t))
        y = F.linear(v["x"], v["weight"], v["bias"]) if op == "lora_linear" else v["y"]
        return lora_forward_reference(y, v["x"], v["lora_a"], v["lora_b"], case.scale, case.rank, case.token_slots,
                                      case.slice_widths)

    if how == "func_jvp":
        out, tangent = torch.func.jvp(ours, tuple(primals), tuple(tangents))
    else:
        with fwAD.dual_level():
            dual = ours(*[fwAD.make_dual(p, t) for p, t in zip(primals, tangents)])
            out, tangent = fwAD.unpack_dual(dual)
    want_out, want_tangent = torch.func.jvp(reference, tuple(p.double() for p in primals),
                                            tuple(t.double() for t in tangents))
    tol = TOLERANCE[torch.float32]
    assert rel_err(out, want_out) <= tol and rel_err(tangent, want_tangent) <= tol, rel_err(tangent, want_tangent)


def test_in_place_add_lora_under_vmap_adds_each_elements_delta(backend):
    """torch.func.vmap over the functional in-place add_lora (no grad): torch's loop over the op add_lora, the
    result copied into y, element by element as calls one by one give (the in-place op has no batching rule:
    torch's raw error)."""
    case = make_case(**GRAD_CASES["qkv_3_slices"], dtype=torch.float32, device=backend.device, seed=44)
    M, _, N = case.shape[:3]
    xs, ys = torch.stack([case.x, -2 * case.x]), torch.stack([case.signed((M, N)), case.signed((M, N))])

    def add(y, x):
        return lora_ops.add_lora(y, x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                                 slice_widths=case.slice_widths)
    want = torch.stack([add(y.clone(), x) for y, x in zip(ys, xs)])
    got = ys.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        torch.func.vmap(add)(got, xs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_forward_mode_ad_refuses_what_it_cannot_differentiate(backend):
    """A tangent on scale (no formula: reverse mode gives scale no gradient either) or through an op without
    a forward-mode formula (expand_, shrink) raises naming the op and the argument."""
    case = make_case(**GRAD_CASES["one_slice"], dtype=torch.float32, device=backend.device, seed=43)
    M, _, N = case.shape[:3]
    y = case.signed((M, N))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=r"lora_ops::add_lora: forward-mode AD .* argument 4"):
            lora_ops.lora_forward(y, case.x, case.lora_a, case.lora_b, fwAD.make_dual(case.scale, case.scale),
                                  case.rank, batch=case.meta)
        h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)
        with pytest.raises(NotImplementedError, match=r"lora_ops::expand_: .* no forward-mode formula"):
            lora_ops.expand(y, fwAD.make_dual(h, h), case.lora_b, case.rank, batch=case.meta)
        with pytest.raises(NotImplementedError, match=r"lora_ops::shrink: .* argument 0"):
            lora_ops.shrink(fwAD.make_dual(case.x, case.x), case.lora_a, case.scale, case.rank, batch=case.meta)
        # The ops called through the dispatcher would return the output without the tangent: refused there too.
        with pytest.raises(NotImplementedError, match=r"torch.ops.lora_ops.add_lora under forward-mode AD"):
            torch.ops.lora_ops.add_lora(y, fwAD.make_dual(case.x, case.x), case.lora_a, case.lora_b, case.scale,
                                        case.rank, case.slice_widths, *case.meta)


def test_token_slots_read_from_the_metadata_as_the_kernels_read_it():
    """autograd._token_slots (the double backward's per-token slots): each token's slot from a LoRABatch
    with stale ids past M; a run past the capacity and ids outside [0, M) are ignored, not indexed."""
    case = make_case(M=21, K=8, N=8, num_slots=3, num_slices=1, max_rank=4, capacity=40, seed=5)
    got = autograd._token_slots(case.meta, 21, 3)
    assert torch.equal(got, torch.where(case.token_slots >= 0, case.token_slots, 3))
    sorted_ids = torch.tensor([4, 0, 99, -2, 1], dtype=torch.int32)
    starts, counts = torch.tensor([0, 2, 5, 0], dtype=torch.int32), torch.tensor([2, 2, 7, 0], dtype=torch.int32)
    assert autograd._token_slots((sorted_ids, starts, counts), 5, 3).tolist() == [0, 3, 3, 3, 0]


@pytest.mark.parametrize("case_id", ["qkv_3_slices", "gate_up_mixed_ranks", "rank_80"])
def test_float32_gpu_tiles_compute_the_same_gradients(triton_kernels, monkeypatch, case_id):
    """float32 on a GPU takes its own tiles (heuristics.float32_tiles, launch_grad's float32 configs: what
    tests/test_codegen.py compiles without spills). Forced here on the interpreter's CPU tensors: the
    forward and every gradient still match float64 (rank 80: the expand's rank in one block of 128 at
    decode sizes, 16 columns a block)."""
    from lora_ops import configs
    from lora_ops.configs import heuristics
    gpu = torch.device("cuda")
    resolved = []

    def on_gpu(real, leading):
        def config(*a, **k):
            cfg = real(*a[:leading], gpu, *a[leading + 1:], **k)
            resolved.append(cfg)
            return cfg
        return config
    for name, leading in (("shrink_config", 5), ("expand_config", 5), ("fused_config", 6)):
        monkeypatch.setattr(configs, name, on_gpu(getattr(configs, name), leading))
    monkeypatch.setattr(launch_grad, "takes_float32_tiles", lambda t: t.dtype is torch.float32)
    real_grad_configs = launch_grad.grad_x_config, launch_grad.segment_outer_config
    seen = record_grad_configs(monkeypatch)
    spec = GRAD_CASES.get(case_id) or dict(M=9, K=24, N=20, num_slots=3, num_slices=2, max_rank=80, ranks=[80, 33, 0])
    case = make_case(**spec, dtype=torch.float32, device=triton_kernels.device, seed=47)
    M, _, N, *_ = case.shape
    run_and_compare(case, case.signed((M, N)), torch.float32)
    assert any(c is not None and c.num_warps == heuristics.F32_WARPS for c in resolved), resolved
    # The backward's launches took the float32 tiles too: each config is the float32 one for its call's
    # arguments, and differs from the other tiles' (both real functions asked here).
    for real, name, at in zip(real_grad_configs, ("grad_x_config", "segment_outer_config"), (4, 3)):
        assert seen[name], name
        for args, kwargs, cfg in seen[name]:     # (float32_gpu: positional argument ``at`` of either)
            as_f32, plain = (real(*args[:at], on, *args[at + 1:], **kwargs) for on in (True, False))
            assert cfg == as_f32 != plain, (name, args, kwargs, cfg)


@pytest.mark.parametrize("N, R, layout", [(200, 20, "contiguous"), (64, 64, "contiguous"), (130, 100, "contiguous"),
                                          (96, 16, "strided"), (70, 24, "rank_strided"), (50, 16, "one_slot_shared")],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_lora_grad_h_transposes_b_exactly(triton_kernels, dtype, N, R, layout):
    """lora_grad_h's operand B^T [L, S, R, N] comes from our transpose kernel (torch's copy of the transposed view
    was slower than the shrink, DESIGN §4): bit for bit B transposed, NaN and infinities included, every slice a
    view of one copy; features past a 64-wide block and ranks past one 64-wide step; B with gaps between its
    features, with its rank not contiguous, and one slot's B shared by all (stride 0)."""
    gen = torch.Generator().manual_seed(43)
    L = 3
    values = torch.randn(L, N, R, generator=gen).to(dtype)
    values[0, 1, R - 1] = float("nan")
    values[1, N - 1, 0] = float("-inf")
    if layout == "strided":            # gaps between features
        lora_b = torch.zeros(L, 2 * N, R, dtype=dtype)
        lora_b[:, ::2] = values
        lora_b = lora_b[:, ::2]
    elif layout == "rank_strided":     # the rank not contiguous: laid out [L, R, N], viewed [L, N, R]
        lora_b = values.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "one_slot_shared":  # stride 0 between slots
        lora_b = values[:1].expand(L, N, R)
    else:
        lora_b = values
    lora_b = lora_b.to(triton_kernels.device)
    a = launch_grad.b_as_shrink_a(lora_b, 3)
    assert a.shape == (L, 3, R, N) and a.stride(1) == 0
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(a[:, 2].view(bits), lora_b.transpose(1, 2).contiguous().view(bits))
