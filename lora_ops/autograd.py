"""Autograd for the LoRA delta: the functional op ``add_lora``, its backward ops, and the backward formula.

For a token t in slot l (rank r, scale s), slice i owning the output columns C_i, dy = grad of the output:

    dh[t, i, :r]    = s * dy[t, C_i] @ B[l, C_i, :r]        ``lora_grad_h`` (a shrink of dy with B)
    dx[t]           = sum_i dh[t, i, :r] @ A[l, i, :r]      ``lora_grad_x`` (slices summed in fp32)
    dA[l, i, :r]    = sum over t in l of dh[t, i, :r]^T x[t]                  ``lora_grad_a``
    dB[l, C_i, :r]  = sum over t in l of dy[t, C_i]^T h[t, i, :r]             ``lora_grad_b``, h = s * x A^T
    dy passes to y unchanged.

Each op covers every packed slice in one call and one launch (a call per slice and a torch.cat or stack
of their outputs before session 25: host time per training step, DESIGN §4).

Tokens without an adapter contribute nothing and get a zero dx; entries of dA / dB past a slot's rank and
of slots without tokens are zero. No host sync and no dense [M, R, K] gather: per-slot sums run over the
tokens grouped by slot (lora_ops.batch). The frozen base layer is not an input of the op, so it gets no
gradient from here.

h is recomputed in the backward (one ``shrink``: a read of x, which the backward needs anyway for dA)
rather than saved from the forward: the forward stays the single fused ``add_lora_`` launch with no extra
output, and nothing beyond the op's inputs is kept alive between forward and backward.

Saved inputs are the caller's tensors, not copies: refilling the batch metadata (``LoRABatch.update``) or
writing adapter weights in place between forward and backward bumps their version counters, and autograd
then refuses to run the stale backward. (A LoRAContext hands autograd's calls a copy of each batch, so its
layers' backwards survive later ``set_batch`` calls: lora_ops.layers.LoRAContext.) Activation checkpointing
saves nothing and recomputes the forward in the backward: there the metadata the backward gets is the
recompute's, which need not be the forward's. Each call notes which batch its forward read (a context's
copy by serial number, other metadata by version) and the backward refuses another (``_check_batch``);
eager only: a compiled backward checks nothing.

Double backward (``create_graph=True``: a gradient penalty, a Hessian-vector product, meta-learning) needs
a backward that autograd can differentiate, which the backward ops are not: there the backward computes the
delta again as plain torch ops and takes autograd's gradient of it (:func:`_graph_grads`; slower, float32).
Forward mode (torch.func.jvp, forward_ad): the tangent of lora_linear's and add_lora's output
(``ops.FORWARD_AD``, :func:`_delta_tangent`).
"""
import itertools
import operator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

import csrc_meta  # noqa: F401  (defines the ops and their fake kernels)
from csrc_meta import checks
from lora_ops import configs, cpu_grad, ops, plan, triton_launch


def _triton_grad():
    from lora_ops import launch_grad
    return launch_grad


# -- the functional forward: y + delta, out of place ---------------------------------------------------

def _add_lora_functional(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                         slot_counts):
    if forward_ad._current_level >= 0:    # (reached through torch.ops with dual tensors: ops._refuse_tangents)
        ops._refuse_tangents("add_lora", (y, x, lora_a, lora_b, scale))
    # Contiguous like the fake kernel's output, whatever y's layout.
    out = y.clone(memory_format=torch.contiguous_format)
    # Already below the dispatcher (real tensors, this op's own kernel): run add_lora_'s kernel directly (under
    # no_grad: its inputs may require grad, which add_lora_'s check refuses; add_lora's autograd is outside).
    with torch.no_grad():
        ops.kernel_for("add_lora_", out)(out, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                                         slot_starts, slot_counts)
    return out


torch.library.impl("lora_ops::add_lora", "CPU")(_add_lora_functional)
torch.library.impl("lora_ops::add_lora", "CUDA")(_add_lora_functional)
ops.KERNELS["add_lora"] = {"cuda": _add_lora_functional, "cpu": _add_lora_functional}


# -- backward kernels ----------------------------------------------------------------------------------

ops.register_kernels("lora_ops::lora_grad_x", _triton_grad, checks.check_lora_grad_x, cpu_grad.lora_grad_x, trusted=True)
ops.register_kernels("lora_ops::segment_outer", _triton_grad, checks.check_segment_outer, cpu_grad.segment_outer)
ops.register_kernels("lora_ops::lora_grad_h", _triton_grad, checks.check_lora_grad_h, cpu_grad.lora_grad_h, trusted=True)
ops.register_kernels("lora_ops::lora_grad_a", _triton_grad, checks.check_lora_grad_a, cpu_grad.lora_grad_a, trusted=True)
ops.register_kernels("lora_ops::lora_grad_b", _triton_grad, checks.check_lora_grad_b, cpu_grad.lora_grad_b, trusted=True)


# -- the backward formula ------------------------------------------------------------------------------

def grad_h(grad_out, lora_b, scale, rank, slice_widths, meta, call=ops.call):
    """dh [M, S, R] float32 = scale * dy[:, C_i] @ B[slot, C_i]: every slice in one op (lora_grad_h)."""
    return call("lora_grad_h", grad_out, lora_b, scale, rank, slice_widths, *meta)


def lora_grads(grad_out, x, lora_a, lora_b, scale, rank, widths, meta, need_x, need_a, need_b, call=ops.call):
    """(dx, dA, dB) of the LoRA delta for the incoming gradient ``grad_out`` (None where not needed), through
    ``call(op name, *args)``: ops.call; ops.call_trusted where the inputs are the forward's, unchanged
    (:func:`_unchanged`), so every op's arguments are valid by construction and its checks are skipped; or a
    bound backward's recorder or replay (:func:`_delta_grads`)."""
    dx = da = db = None
    if need_x or need_a:
        dh = grad_h(grad_out, lora_b, scale, rank, widths, meta, call)
        if need_x:
            dx = call("lora_grad_x", dh, lora_a, rank, *meta)
        if need_a:
            da = call("lora_grad_a", dh, x, rank, *meta)
    if need_b:
        with torch.no_grad():   # (dB's h is a constant of the backward; shrink has no gradient and refuses one)
            h = call("shrink", x, lora_a, scale, rank, *meta)
        db = call("lora_grad_b", grad_out, h, rank, widths, *meta)
    return dx, da, db


def _graph_grads(grad_out, x, lora_a, lora_b, scale, rank, widths, meta, needs):
    """(dx, dA, dB) as torch ops autograd records, for a backward run with ``create_graph=True`` (grad mode on
    inside it): the gradients are then differentiable themselves. The backward ops have no autograd formula
    (torch would only warn and drop their second-order terms: silently wrong), so the delta is computed
    again, in float32, one slot at a time over every token with the other slots' tokens masked off (L dense
    products of the rank: a fallback, not a fast path), and differentiated by autograd. Metadata is read as
    the kernels read it (:func:`_token_slots`), without a host sync."""
    wanted = [t for t, need in zip((x, lora_a, lora_b), needs) if need]
    if not wanted:
        return None, None, None
    with torch.enable_grad():
        delta = _masked_delta(x, lora_a, lora_b, scale, rank, widths, meta).to(grad_out.dtype)
        grads = iter(torch.autograd.grad(delta, wanted, grad_out, create_graph=True, allow_unused=True))
    return tuple(next(grads) if need else None for need in needs)


def _masked_delta(x, lora_a, lora_b, scale, rank, widths, meta):
    """The delta [M, N] in float32 from differentiable torch ops (:func:`_graph_grads`)."""
    L, S, R, K = lora_a.shape
    slots = _token_slots(meta, x.shape[0], L)
    in_rank = torch.arange(R, device=x.device) < rank.to(x.device)[:, None]                # [L, R]
    xf, scales = x.float(), scale.float()
    bounds = [0, *itertools.accumulate(widths)]
    delta = x.new_zeros(x.shape[0], lora_b.shape[1], dtype=torch.float32)
    # Masks select (torch.where), never multiply: values the kernels do not read (past a slot's rank, other
    # slots' tokens) may be NaN or inf, and NaN * 0 is NaN. Each slot's products are selected on its tokens
    # at every step, x's rows going in, h's and the delta's coming out: its weights meet every row in the
    # dense products, and a slot's NaN weight made NaN of the other slots' rows there, which the gradients of
    # higher orders (the cotangents through grad_out) carried to every slot, and of its own weight gradients
    # where it has no tokens (0 @ NaN; the kernels' first order gives zeros there). Its scale too is selected
    # per token: h's gradient, zero off its tokens, times a NaN scale (an unused slot's) was NaN.
    for slot in range(L):
        mine = (slots == slot)[:, None]
        a = torch.where(in_rank[slot][None, :, None], lora_a[slot].float(), 0.0)     # [S, R, K]
        b = torch.where(in_rank[slot], lora_b[slot].float(), 0.0)                    # [N, R]
        token_scale = torch.where(mine, scales[slot], 0.0)[:, :, None]             # [M, 1, 1]
        h = torch.einsum("mk,srk->msr", torch.where(mine, xf, 0.0), a) * token_scale
        h = torch.where(mine[:, :, None], h, 0.0)
        term = torch.cat([h[:, i] @ b[bounds[i]:bounds[i + 1]].T for i in range(S)], dim=1)
        delta = delta + torch.where(mine, term, 0.0)
    return delta


def _token_slots(meta, num_tokens, num_slots):
    """Each token's slot [M] int64 (num_slots where none) as the kernels read the metadata: slot l owns the
    tokens at places slot_starts[l] .. + slot_counts[l] of sorted_token_ids (places past its end and token ids
    outside [0, M) ignored). No host sync."""
    sorted_ids, starts, counts = meta
    capacity = sorted_ids.shape[0]
    place = torch.arange(capacity, device=sorted_ids.device)
    slot_at = torch.full_like(place, num_slots)
    # (starts and counts clamped to the buffer, as kernels.work.find_slot_tile clamps them)
    starts, counts = starts.long().clamp(0, capacity), counts.long().clamp(0, capacity)
    for slot in range(num_slots):
        run = (place >= starts[slot]) & (place < starts[slot] + counts[slot])
        slot_at = torch.where(run, slot, slot_at)
    token = sorted_ids.long()
    token = torch.where((token >= 0) & (token < num_tokens) & (slot_at < num_slots), token, num_tokens)
    slots = torch.full((num_tokens + 1,), num_slots, dtype=torch.int64, device=sorted_ids.device)
    return slots.scatter(0, token, slot_at)[:num_tokens]


def _signature(tensors):
    """The shapes, strides, dtypes and devices of an op call's saved inputs (``tensors``), or None while tracing or
    for a tensor subclass. The forward's checks passed on these; autograd's version counters catch writes
    in place between forward and backward, not ``param.data = ...``, which can change all four."""
    if torch.compiler.is_compiling():
        return None
    signature = []
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        signature += (t.shape, t.stride(), t.dtype, t.device)
    return tuple(signature)


def _unchanged(ctx, tensors):
    """Whether the saved inputs ``tensors`` are as the forward's checks saw them (so the backward's op calls
    may skip their own checks); False where no signature was taken."""
    return ctx.signature is not None and ctx.signature == _signature(tensors)


def _batch_key(sorted_token_ids):
    """Which batch metadata holds: a LoRAContext's copy by its serial number (never written again), a
    LoRABatch's buffers (tagged 0) and other metadata by their version counter (refilled in place), with the
    address it was at. None while tracing or for a tensor subclass."""
    if type(sorted_token_ids) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    try:
        address = sorted_token_ids.data_ptr()
    except RuntimeError:        # no storage: a torch.func wrapper (its version counter still counts)
        address = None
    return getattr(sorted_token_ids, "_lora_batch", None), sorted_token_ids._version, address


def _check_batch(ctx, sorted_token_ids):
    """Refuse a backward whose metadata is not its forward's (a checkpointed forward recomputed on a later batch)."""
    then = ctx.batch_key
    now = _batch_key(sorted_token_ids) if then is not None else None
    if now is None:
        return
    if now[0] is None and (then[0] is not None or now[2] != then[2]):
        # Untagged where the forward's was tagged, or elsewhere than it was: a copy a saved-tensor hook made
        # when the forward saved it (torch.autograd.graph.save_on_cpu, activation offloading), so it holds the
        # forward's batch (its version counter starts again at 0).
        return
    if now[:2] != then[:2]:
        raise RuntimeError(
            "lora_ops: this backward's forward was recomputed (activation checkpointing) on another batch than "
            "it ran with: set_batch was called between them. Pass context_fn=ctx.checkpoint_context to "
            "torch.utils.checkpoint(..., use_reentrant=False), or run the backward before the next set_batch")


def delta_signature(x, lora_a, lora_b, scale, rank, meta):
    """:func:`_signature` of the delta's saved inputs, in the order both backwards save them (a bound eager
    call takes it once when it binds: lora_ops.eager)."""
    return _signature((x, lora_a, lora_b, scale, rank, *meta))


def _setup_context(ctx, inputs, output, signature=None):
    """add_lora's setup_context; ``signature``: the delta's signature where the caller knows it (a bound call,
    whose guards hold it), else taken here."""
    _, x, lora_a, lora_b, scale, rank, slice_widths, *meta = inputs
    ctx.save_for_backward(x, lora_a, lora_b, scale, rank, *meta)
    ctx.slice_widths = tuple(slice_widths)
    ctx.batch_key = _batch_key(meta[0])
    ctx.signature = signature if signature is not None else delta_signature(x, lora_a, lora_b, scale, rank, meta)


def _backward(ctx, grad_out):
    saved = ctx.saved_tensors
    x, lora_a, lora_b, scale, rank, *meta = saved
    _check_batch(ctx, meta[0])
    need_y, need_x, need_a, need_b = ctx.needs_input_grad[:4]
    dx, da, db = _delta_grads(ctx, saved, grad_out, (need_x, need_a, need_b))
    dy = grad_out if need_y else None
    return dy, dx, da, db, None, None, None, None, None, None


torch.library.register_autograd("lora_ops::add_lora", _backward, setup_context=_setup_context)


# -- lora_linear: the base layer's gradients plus the delta's -------------------------------------------

def _setup_lora_linear(ctx, inputs, output, signature=None):
    """lora_linear's setup_context; ``signature`` as in :func:`_setup_context` (the weight is not in it: the
    delta's ops do not read it)."""
    x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, *meta = inputs
    ctx.save_for_backward(x, weight, lora_a, lora_b, scale, rank, *meta)
    ctx.slice_widths = tuple(slice_widths)
    ctx.batch_key = _batch_key(meta[0])
    ctx.signature = signature if signature is not None else delta_signature(x, lora_a, lora_b, scale, rank, meta)


def _backward_lora_linear(ctx, grad_out):
    x, weight, lora_a, lora_b, scale, rank, *meta = ctx.saved_tensors
    _check_batch(ctx, meta[0])
    need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
    dx, da, db = _delta_grads(ctx, (x, lora_a, lora_b, scale, rank, *meta), grad_out, (need_x, need_a, need_b))
    if need_x:
        # The base layer's dx = grad_out @ W, added to the delta's in the GEMM's epilogue (no extra pass).
        dx = torch.addmm(dx, grad_out, weight)
    dw = grad_out.t() @ x if need_w else None
    dbias = grad_out.sum(0) if need_bias else None
    return dx, dw, dbias, da, db, None, None, None, None, None, None


torch.library.register_autograd("lora_ops::lora_linear", _backward_lora_linear, setup_context=_setup_lora_linear)


# -- forward mode: the tangent of the output ---------------------------------------------------------------

def _delta_tangent(tangent, x, lora_a, lora_b, t_x, t_a, t_b, rest):
    """Add the delta's tangent into ``tangent`` [M, N]: the delta is linear in each of x, A and B, so its
    tangent is the delta with one of them replaced by its tangent, summed over those that have one (three
    add_lora_ calls at most, the forward's kernels)."""
    with torch.no_grad():   # (a tangent is not differentiated: forward over reverse is not supported)
        for x_, a_, b_, t in ((t_x, lora_a, lora_b, t_x), (x, t_a, lora_b, t_a), (x, lora_a, t_b, t_b)):
            if t is not None:
                ops.call("add_lora_", tangent, x_, a_, b_, *rest)
    return tangent


def _lora_linear_tangent(primals, tangents, out):
    x, weight, bias, lora_a, lora_b, *rest = primals
    t_x, t_w, t_bias, t_a, t_b = tangents[:5]
    tangent = torch.zeros_like(out, memory_format=torch.contiguous_format)
    if t_x is not None:
        tangent += F.linear(t_x, weight)
    if t_w is not None:
        tangent += F.linear(x, t_w)
    if t_bias is not None:
        tangent += t_bias
    return _delta_tangent(tangent, x, lora_a, lora_b, t_x, t_a, t_b, rest)


def _add_lora_tangent(primals, tangents, out):
    _, x, lora_a, lora_b, *rest = primals
    t_y, t_x, t_a, t_b = tangents[:4]
    tangent = (torch.zeros_like(out, memory_format=torch.contiguous_format) if t_y is None
               else t_y.clone(memory_format=torch.contiguous_format))
    return _delta_tangent(tangent, x, lora_a, lora_b, t_x, t_a, t_b, rest)


ops.FORWARD_AD["lora_linear"] = ((0, 1, 2, 3, 4), _lora_linear_tangent)
ops.FORWARD_AD["add_lora"] = ((0, 1, 2, 3), _add_lora_tangent)


# -- bound backwards: a backward's op calls replayed from their plans ------------------------------------

MAX_BOUND = 4096        # bound backwards kept (the key holds the token count); the table is cleared when full
_BOUND = {}             # backward key (_backward_key) -> the op calls' _Steps, in call order
_bound_enabled = [True]


def set_bound_backward(on):
    """Replay a backward's op calls from their plans (default; :func:`_delta_grads`), or call each op on
    every backward (benchmarks and tests compare)."""
    _bound_enabled[0] = bool(on)


class _Step(NamedTuple):
    """One op call of a bound backward: the plan it ran, and ``pick``: its arguments -> the plan's tensors."""
    plan: object
    pick: object


def _dead_level(*tensors):
    """Whether one of ``tensors`` is a torch.func wrapper whose transform level has exited."""
    return any(torch._C._functorch.maybe_get_level(t) == -2 for t in tensors)


def _delta_grads(ctx, saved, grad_out, needs):
    """lora_grads for a backward whose saved delta inputs are ``saved`` (x, lora_a, lora_b, scale, rank, then
    the batch metadata). With the inputs the forward's checks saw, the op calls skip their checks
    (ops.call_trusted); where they would also run on their plans (Triton kernels, nothing that needs the
    dispatcher), the whole backward is bound: the first backward of a key records each op call's plan, later
    ones replay the plans directly. A backward's launches are a function of its key, the same quantities the
    op calls' plan keys name, so a replay launches what the op calls would (bit for bit, tests/test_autograd.py).
    On the CPU machine, C launches stubbed, the backward's five op calls cost ~41 µs through
    ops.call_trusted and ~18 µs as plan replays (benchmarks/host_python.py; DESIGN §4)."""
    if _dead_level(*saved):
        # torch.func.vjp's vjp function, called after the forward's level exited: the saved inputs are wrappers
        # of that dead level (no transform is active); their values give the first-order gradients.
        x, lora_a, lora_b, scale, rank, *meta = (torch._C._functorch.get_unwrapped(t) if _dead_level(t) else t
                                                 for t in saved)
        return lora_grads(grad_out, x, lora_a, lora_b, scale, rank, ctx.slice_widths, meta, *needs, ops.call)
    x, lora_a, lora_b, scale, rank, *meta = saved
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():     # create_graph=True
        return _graph_grads(grad_out, x, lora_a, lora_b, scale, rank, ctx.slice_widths, meta, needs)
    args = (grad_out, x, lora_a, lora_b, scale, rank, ctx.slice_widths, meta, *needs)
    if not _unchanged(ctx, saved):
        return lora_grads(*args, ops.call)
    if not _bindable(grad_out, x):
        return lora_grads(*args, ops.call_trusted)
    key = _backward_key(ctx, grad_out, needs, x)
    steps = _BOUND.get(key)
    if steps is not None:
        return lora_grads(*args, _Replay(steps))
    recorder = _Recorder()
    grads = lora_grads(*args, recorder)
    if recorder.steps is not None and key == _backward_key(ctx, grad_out, needs, x):
        if len(_BOUND) >= MAX_BOUND:
            _BOUND.clear()
        _BOUND[key] = tuple(recorder.steps)
    return grads


def _bindable(grad_out, x):
    """Whether a trusted backward's op calls would run on their plans: Triton kernels (CUDA tensors on the
    current device, or CPU tensors under set_cpu_backend("triton")), not traced or wrapped, grad mode off
    (ops.call_trusted's own conditions)."""
    if not _bound_enabled[0] or torch.is_grad_enabled() or ops.wrapped(grad_out):
        return False
    return ops.on_other_device(x) is None if x.is_cuda else ops.get_cpu_backend() == "triton"


def _backward_key(ctx, grad_out, needs, x):
    """What a bound backward's launches derive from: the union of its op calls' plan keys (the saved inputs'
    shapes, strides, dtypes and devices in ctx.signature, the incoming gradient's, the slice widths, which
    gradients are needed, the launch device, the config state and launch switches) and the plan table's
    epoch (the recorded plans are that table's)."""
    return (ctx.signature, grad_out.shape, grad_out.stride(), grad_out.dtype, ctx.slice_widths, needs,
            plan.launch_device(x), configs.generation(), triton_launch.switches(), plan.epoch())


def _pick(name, args):
    """``args`` -> the tensors op ``name``'s plan takes: its tensor arguments in order (the launchers pass
    plan.run those), lora_grad_h's B as the operand its shrink reads (launch_grad.b_as_shrink_a)."""
    where = operator.itemgetter(*[i for i, a in enumerate(args) if isinstance(a, torch.Tensor)])
    if name != "lora_grad_h":
        return where
    num_slices = len(args[4])

    def pick(call_args):
        grad_out, lora_b, *rest = where(call_args)
        return (grad_out, _triton_grad().b_as_shrink_a(lora_b, num_slices), *rest)
    return pick


class _Recorder:
    """lora_grads' ``call`` for a backward's first run: each op through ops.call_trusted, its plan recorded
    (plan.recording). ``steps`` ends None where an op call ran no kept plan or on other tensors than
    :func:`_pick` gives (then nothing is bound)."""

    def __init__(self):
        self.steps = []

    def __call__(self, name, *args):
        with plan.recording() as runs:
            out = ops.call_trusted(name, *args)
        if self.steps is not None:
            pick = _pick(name, args)
            if len(runs) == 1 and runs[0][0] is not None and _same_tensors(runs[0][1], pick(args), args):
                self.steps.append(_Step(runs[0][0], pick))
            else:
                self.steps = None
        return out


def _same_tensors(ran, picked, args):
    """Whether a plan ran on the tensors ``picked``: the arguments' own by identity, a tensor made from them
    (lora_grad_h's B^T) by shape, strides and dtype."""
    def same(r, p):
        if r is p:
            return True
        return all(p is not a for a in args) and (r.shape, r.stride(), r.dtype) == (p.shape, p.stride(), p.dtype)
    return len(ran) == len(picked) and all(same(r, p) for r, p in zip(ran, picked))


class _Replay:
    """lora_grads' ``call`` for a bound backward: the recorded plans in turn, on this call's tensors."""

    def __init__(self, steps):
        self.steps = iter(steps)

    def __call__(self, name, *args):
        step = next(self.steps)
        return step.plan.run(step.pick(args))[0]


# -- the same formulas for eager calls, without the dispatcher (ops.call) --------------------------------

def _eager_function(name, setup_context, backward):
    """A torch.autograd.Function that runs op ``name``'s registered kernel and the formula registered for
    it above: what the dispatcher's autograd does for the op, minus the dispatcher. ops.call runs it for
    eager calls that need autograd (the CPU machine, C launches stubbed: ~45 µs less host time per
    LoRALinear training step, benchmarks/host_python.py).
    forward and setup_context apart (torch's newer Function form), which torch.func's grad and vjp require:
    ops.call runs the Function under them too, torch.library's own having no setup_context."""

    def forward(*args):
        return ops.kernel_for(name, args[0])(*args)

    def setup_context_(ctx, inputs, output):
        setup_context(ctx, inputs, output)

    def backward_(ctx, grad_out):
        return backward(ctx, grad_out)

    function = type(f"Eager_lora_ops_{name}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "setup_context": staticmethod(setup_context_),
                     "backward": staticmethod(backward_)})
    ops.AUTOGRAD[name] = function
    return function


_eager_function("add_lora", _setup_context, _backward)
_eager_function("lora_linear", _setup_lora_linear, _backward_lora_linear)


# The bound calls' Functions take the op's differentiable inputs as tensors and the rest (scale, rank, the
# slice widths, the batch metadata) in one tuple, which autograd does not look into: Function.apply costs
# ~0.4 µs a tensor argument (CPU machine), and those get no gradient from the op anyway. setup_context saves
# them as it does for the op (saved tensors need not be inputs; their version counters are checked alike).

class BoundLoRALinear(torch.autograd.Function):
    """lora_linear's autograd for a LoRALinear call replayed from its bound plan (lora_ops.eager): inputs x,
    weight, bias, lora_a, lora_b, then ``rest`` = the op's other arguments (scale, rank, slice_widths, the
    metadata), ``run``, which computes the output through the bound launches (or returns None, and the
    op's kernel computes it), and the delta's ``signature`` (:func:`delta_signature`, taken when the call was
    bound; the backward compares it with its saved inputs' as ever); setup_context and backward are
    lora_linear's, so the gradients are the op's, bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, rest, run, signature):
        args = (x, weight, bias, lora_a, lora_b, *rest)
        out = run()
        if out is None:
            out = ops.kernel_for("lora_linear", x)(*args)
        _setup_lora_linear(ctx, args, out, signature)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward_lora_linear(ctx, grad_out)[:5], None, None, None)


class BoundAddLora(torch.autograd.Function):
    """add_lora's autograd for a LoRALinear delta replayed from its bound plan (lora_ops.eager: a base that
    runs its own forward, trainable adapters or input): inputs y, x, lora_a, lora_b, then ``rest`` = the op's
    other arguments, ``run(out)``, which adds the delta into ``out``, y's contiguous copy, through the
    bound add_lora_ launches, and ``signature`` as BoundLoRALinear takes it; setup_context and backward are
    add_lora's, so the output and gradients are the op's, bit for bit."""

    @staticmethod
    def forward(ctx, y, x, lora_a, lora_b, rest, run, signature):
        out = y.clone(memory_format=torch.contiguous_format)     # (as _add_lora_functional)
        run(out)
        _setup_context(ctx, (y, x, lora_a, lora_b, *rest), out, signature)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward(ctx, grad_out)[:4], None, None, None)
