"""Argument checks shared by the fake kernels and the real ones.

Every check reads sizes, dtypes and devices only (never tensor data), so it runs unchanged on fake,
meta, CPU and CUDA tensors and costs no device sync. Each error names the argument and what was
expected. The one data-dependent check (slot ids in range) lives in lora_ops.batch, where it runs only
for CPU tensors.
"""
import math
import sys

import torch
import torch._guards     # (TracingContext: refuse_frozen_fakes)

from csrc_meta.schemas import NOT_DIFFERENTIABLE

try:
    from torch.fx.experimental.symbolic_shapes import guard_or_true
except ImportError:  # older torch: sizes are plain ints or backed symbols there
    def guard_or_true(cond):
        return bool(cond)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPE = torch.int32

# Each check_* below starts with a quick test of the common, valid case (a few attribute reads, no
# message building); only when that fails do the detailed checks run to name the culprit. The quick
# tests accept a subset of what the detailed checks accept, and leave symbolic sizes to the detailed
# checks (which guard them with care). On the eager hot path this is the difference between ~5 and
# ~20 µs of host time per call on the H200 host.
_QUICK_ERRORS = (AttributeError, TypeError, ValueError)
# The per-slot tensors (scale, rank) and the batch metadata: the quick checks take unit strides (any
# other goes through the detailed checks, which bound it: check_index_extent).
_UNIT = (1,)
INT32_MAX = 2 ** 31 - 1


def _on(dev, *tensors):
    for t in tensors:
        if t.device != dev:
            return False
    return True


def _meta_ok(num_slots, num_tokens, sorted_token_ids, slot_starts, slot_counts):
    i32 = INDEX_DTYPE
    return (sorted_token_ids.dtype is i32 and slot_starts.dtype is i32 and slot_counts.dtype is i32
            and sorted_token_ids.dim() == 1 and type(sorted_token_ids.shape[0]) is int
            and sorted_token_ids.shape[0] >= num_tokens
            and slot_starts.shape == (num_slots + 1,) and slot_counts.shape == (num_slots + 1,)
            and sorted_token_ids.stride() == _UNIT and slot_starts.stride() == _UNIT
            and slot_counts.stride() == _UNIT)


def _widths_ok(slice_widths, S, N):
    return len(slice_widths) == S and min(slice_widths) > 0 and sum(slice_widths) == N


def _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts):
    """rank [L] int32 at unit stride and the batch metadata of its L slots, for M tokens."""
    return (rank.dtype is INDEX_DTYPE and rank.dim() == 1 and rank.stride() == _UNIT
            and _meta_ok(rank.shape[0], M, sorted_token_ids, slot_starts, slot_counts))


def _slot_args_ok(L, S, R, N, M, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """The per-slot arguments and the batch metadata of a stack of L slots, S slices of N outputs in all, max
    rank R, for M tokens (the quick checks' shared part)."""
    return (L >= 1 and S >= 1 and R >= 1
            and scale.dtype is torch.float32 and scale.shape == (L,) and scale.stride() == _UNIT
            and rank.shape == (L,) and _widths_ok(slice_widths, S, N)
            and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts))


def _add_lora_ok(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                 out_shape=None):
    """``out_shape``: the output's (M, N) when ``y`` only stands for its dtype and device (lora_linear
    passes the base weight [N, K])."""
    try:
        dt, dev = x.dtype, x.device
        M, K = x.shape
        L, S, R, K_a = lora_a.shape
        M_y, N = y.shape if out_shape is None else out_shape
        if not (type(M) is int and type(K) is int and type(N) is int and type(M_y) is int):
            return False
        return (dt in FLOAT_DTYPES and y.dtype is dt and lora_a.dtype is dt and lora_b.dtype is dt
                and K_a == K and M_y == M and lora_b.shape == (L, N, R)
                and _slot_args_ok(L, S, R, N, M, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                                  slot_counts)
                and _on(dev, y, lora_a, lora_b, scale, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _lora_linear_ok(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                    slot_counts):
    try:
        N, K = weight.shape
        return (type(N) is int and weight.dtype is x.dtype and K == x.shape[1] and weight.device == x.device
                and (bias is None or (bias.dtype is x.dtype and bias.shape == (N,) and bias.device == x.device))
                and _add_lora_ok(weight, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                                 slot_starts, slot_counts, out_shape=(x.shape[0], N)))
    except _QUICK_ERRORS:
        return False


def _lora_linear_stacked_ok(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                            slot_starts, slot_counts):
    """What check_lora_linear_stacked passes, without building the stack's views (~8 µs of host time)."""
    try:
        dt, dev = x.dtype, x.device
        M, K = x.shape
        L, N, R = lora_b.shape
        S = len(slice_widths)
        rows = N + L * S * R
        if not (type(M) is int and type(K) is int and type(N) is int):
            return False
        return (dt in FLOAT_DTYPES and stacked_weight.dtype is dt and lora_b.dtype is dt
                and stacked_weight.shape[0] >= rows and stacked_weight.shape[1] == K
                and stacked_weight.stride() == (K, 1)
                and (stacked_bias is None or (stacked_bias.dtype is dt and stacked_bias.device == dev
                                              and stacked_bias.shape == (stacked_weight.shape[0],)))
                and _slot_args_ok(L, S, R, N, M, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                                  slot_counts)
                and _on(dev, stacked_weight, lora_b, scale, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _shrink_ok(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
    try:
        dt, dev = x.dtype, x.device
        M, K = x.shape
        L, S, R, K_a = lora_a.shape
        if not (type(M) is int and type(K) is int):
            return False
        return (dt in FLOAT_DTYPES and lora_a.dtype is dt and K_a == K and L >= 1 and S >= 1 and R >= 1
                and scale.dtype is torch.float32 and scale.shape == (L,) and scale.stride() == _UNIT
                and rank.shape == (L,) and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts)
                and _on(dev, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _lora_grad_x_ok(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
    try:
        M, S, R = dh.shape
        L, S_a, R_a, _ = lora_a.shape
        if type(M) is not int:
            return False
        return (dh.dtype is torch.float32 and lora_a.dtype in FLOAT_DTYPES and S_a == S and R_a == R
                and rank.shape == (L,) and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts)
                and _on(dh.device, lora_a, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _segment_outer_ok(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
    try:
        M, _ = u.shape
        M_v, _ = v.shape
        if type(M) is not int:
            return False
        return (u.dtype is torch.float32 and v.dtype in FLOAT_DTYPES and M_v == M
                and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts)
                and _on(u.device, v, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _lora_grad_h_ok(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    try:
        M, N = grad_out.shape
        L, N_b, R = lora_b.shape
        if not (type(M) is int and type(N) is int):
            return False
        return (grad_out.dtype in FLOAT_DTYPES and lora_b.dtype is grad_out.dtype and N_b == N
                and _slot_args_ok(L, len(slice_widths), R, N, M, scale, rank, slice_widths, sorted_token_ids,
                                  slot_starts, slot_counts)
                and _on(grad_out.device, lora_b, scale, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _lora_grad_a_ok(dh, x, rank, sorted_token_ids, slot_starts, slot_counts):
    try:
        M, S, R = dh.shape
        M_x, _ = x.shape
        if type(M) is not int:
            return False
        return (dh.dtype is torch.float32 and x.dtype in FLOAT_DTYPES and M_x == M and S >= 1 and R >= 1
                and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts)
                and _on(dh.device, x, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _lora_grad_b_ok(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    try:
        M, N = grad_out.shape
        M_h, S, R = h.shape
        if not (type(M) is int and type(N) is int):
            return False
        return (h.dtype is torch.float32 and grad_out.dtype in FLOAT_DTYPES and M_h == M and R >= 1
                and _widths_ok(slice_widths, S, N)
                and _rank_meta_ok(rank, M, sorted_token_ids, slot_starts, slot_counts)
                and _on(grad_out.device, h, rank, sorted_token_ids, slot_starts, slot_counts))
    except _QUICK_ERRORS:
        return False


def _fail(exc, msg):
    raise exc(msg)


def refuse_frozen_graphs():
    """Under torch.compile with Inductor's freezing on (``torch._inductor.config.freezing``, common for CPU
    inference) and grad mode off, where Inductor freezes: the parameters and the static-address inputs, the
    adapter stacks and the batch's metadata among them, become constants of the compiled code, which then ignored
    every later set_batch, load and unload, silently. Refused while Dynamo traces lora_ops.ops.call, which every
    traced LoRALinear path reaches (without fullgraph Dynamo runs a layer eagerly but compiles the frames below
    it, call's among them). Read only where Inductor's config is imported (importing it costs ~0.8 s); the
    backend is not known here, so another backend under that flag and no_grad is refused too; torch.export
    freezes nothing."""
    if _freezing(torch.is_grad_enabled()):
        # (torch._check, not a raise: Dynamo reports its message; a raise made it run the frame eagerly and compile
        # the frames below, which froze the same tensors)
        torch._check_with(RuntimeError, False, lambda: FROZEN_GRAPHS)


def refuse_frozen_fakes():
    """:func:`refuse_frozen_graphs` from the fake kernels, which Dynamo runs as plain Python while it traces:
    torch 2.11's Dynamo put ops.call's ``torch._check_with(..., False, ...)`` in the graph, which dropped it
    (session 54, an H100: freezing served the first batch, silently). Grad mode as the compiled frame was entered,
    which Dynamo keeps and Inductor's freezing reads (an op with autograd runs its fake kernel with grad mode
    off); not known outside Dynamo's tracing, where nothing is refused."""
    tracing = torch._guards.TracingContext.try_get()
    state = getattr(getattr(tracing, "global_context", None), "global_state", None) or {}
    grad_enabled = state.get("grad_enabled")
    if grad_enabled is not None and _freezing(grad_enabled[1]):
        raise RuntimeError(FROZEN_GRAPHS)


FROZEN_GRAPHS = ("lora_ops under torch.compile with torch._inductor.config.freezing on: freezing makes the adapter "
                 "stacks and the batch's metadata constants of the compiled code, which then ignores set_batch, "
                 "loads and unloads. Turn freezing off for models served by lora_ops")


def _freezing(grad_enabled):
    """Inductor's freezing on (its config imported) where grad mode is off, outside torch.export."""
    inductor_config = sys.modules.get("torch._inductor.config")
    return (inductor_config is not None and inductor_config.freezing and not grad_enabled
            and not torch.compiler.is_exporting())


def check_float(name, t, dims):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        _fail(ValueError, f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        _fail(TypeError, f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")


def check_index(name, t, dims=1, dtype=INDEX_DTYPE):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        _fail(ValueError, f"{name}: expected a {dims}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(TypeError, f"{name}: expected dtype {dtype}, got {t.dtype}")
    if dims == 1:
        check_index_extent(name, t)


def check_index_extent(name, t):
    """A 1-D tensor (per-slot values, batch metadata) whose every element the kernels can reach with an
    int32 offset: (length - 1) * stride within int32. Any stride below that is taken."""
    if not guard_or_true((t.shape[0] - 1) * t.stride(0) <= INT32_MAX):
        _fail(ValueError, f"{name}: its last element lies {(t.shape[0] - 1) * t.stride(0)} elements past its "
                          f"first (stride {t.stride(0)}); the kernels index it with 32-bit offsets, so at most "
                          f"{INT32_MAX}; pass {name}.contiguous()")


def check_same_device(ref_name, ref, **others):
    for name, t in others.items():
        try:
            device = t.device
        except AttributeError:      # (a Python number where a tensor belongs: the functional API passes it on)
            _fail(TypeError, f"{name}: expected a tensor, got {type(t).__name__} {t!r}")
        if device != ref.device:
            _fail(ValueError, f"{name}: expected a tensor on {ref.device} (the device of {ref_name}), got {device}")


def check_same_dtype(ref_name, ref, **others):
    for name, t in others.items():
        if t.dtype != ref.dtype:
            _fail(TypeError, f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")


def check_like(name, t, dims, ref_name, ref):
    """``t`` is a ``dims``-D float tensor of ``ref``'s dtype, on ``ref``'s device."""
    check_float(name, t, dims)
    check_same_dtype(ref_name, ref, **{name: t})
    check_same_device(ref_name, ref, **{name: t})


def check_slot_params(stack, scale, rank, stack_name="lora_a"):
    """scale [L] float32 and rank [L] int32 match the slot stack's L (``stack``: lora_a, or lora_b)."""
    L = stack.shape[0]
    check_index("rank", rank)
    if not isinstance(scale, torch.Tensor) or scale.dim() != 1 or scale.dtype != torch.float32:
        _fail(TypeError, f"scale: expected a 1-D float32 tensor of per-slot scales, got "
                         f"{getattr(scale, 'dtype', type(scale).__name__)} {tuple(getattr(scale, 'shape', ()))}")
    if scale.shape[0] != L:
        _fail(ValueError, f"scale: expected {L} entries (one per slot of {stack_name}), got {scale.shape[0]}")
    check_index_extent("scale", scale)
    check_rank_length(rank, L, stack_name)


def check_rank_length(rank, L, stack_name):
    if rank.shape[0] != L:
        _fail(ValueError, f"rank: expected {L} entries (one per slot of {stack_name}), got {rank.shape[0]}")


def check_batch_meta(num_slots, sorted_token_ids, slot_starts, slot_counts, num_tokens=None, tokens_of="x"):
    """The metadata of ``num_slots`` slots; with ``num_tokens``, room for that many tokens (the rows of the
    argument named ``tokens_of``)."""
    check_index("sorted_token_ids", sorted_token_ids)
    check_index("slot_starts", slot_starts)
    check_index("slot_counts", slot_counts)
    if slot_starts.shape[0] != num_slots + 1:
        _fail(ValueError, f"slot_starts: expected {num_slots + 1} entries (slots + 1 for 'no adapter'), "
                          f"got {slot_starts.shape[0]}")
    if slot_counts.shape[0] != num_slots + 1:
        _fail(ValueError, f"slot_counts: expected {num_slots + 1} entries (slots + 1 for 'no adapter'), "
                          f"got {slot_counts.shape[0]}")
    # guard_or_true: an unbacked token count (torch._dynamo.mark_unbacked) passes at trace time rather than
    # failing to guard; the real kernels run this check again on concrete sizes.
    if num_tokens is not None and not guard_or_true(sorted_token_ids.shape[0] >= num_tokens):
        _fail(ValueError, f"sorted_token_ids: holds {sorted_token_ids.shape[0]} entries, fewer than the "
                          f"{num_tokens} tokens of {tokens_of}; build the batch metadata with max_tokens >= "
                          f"{num_tokens}")


def check_lora_a(x, lora_a):
    check_float("x", x, 2)
    check_like("lora_a", lora_a, 4, "x", x)
    if lora_a.shape[3] != x.shape[1]:
        _fail(ValueError, f"lora_a: expected shape [L, S, R, K] with K = {x.shape[1]} (x's features), "
                          f"got {tuple(lora_a.shape)}")
    if lora_a.shape[0] < 1 or lora_a.shape[1] < 1 or lora_a.shape[2] < 1:
        _fail(ValueError, f"lora_a: expected shape [L, S, R, K] with L, S, R >= 1, got {tuple(lora_a.shape)}")


def check_lora_b(y, lora_b, slice_widths, num_slots, num_slices, max_rank, y_name="y", per="slice of lora_a"):
    """lora_b [L, N, R] in y's dtype and on its device, N = y's columns (``y_name``: what y is called); ``per``:
    what gives the slice count."""
    check_like("lora_b", lora_b, 3, y_name, y)
    N = y.shape[1]
    if tuple(lora_b.shape) != (num_slots, N, max_rank):
        _fail(ValueError, f"lora_b: expected shape [L, N, R] = [{num_slots}, {N}, {max_rank}], "
                          f"got {tuple(lora_b.shape)}")
    check_slice_widths(slice_widths, num_slices, N, f"{y_name}'s columns", per)


def check_slice_widths(slice_widths, num_slices, N, what, per="slice of lora_a"):
    widths = list(slice_widths)
    if len(widths) != num_slices:
        _fail(ValueError, f"slice_widths: expected {num_slices} widths (one per {per}), got {widths}")
    if any(w <= 0 for w in widths) or sum(widths) != N:
        _fail(ValueError, f"slice_widths: expected positive widths summing to N = {N} ({what}), got {widths}")


def check_add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                   y_name="y"):
    """``y_name``: what the messages call y (lora_linear's checks pass the output it returns, no argument)."""
    if _add_lora_ok(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
        return
    check_lora_a(x, lora_a)
    check_float("y", y, 2)
    check_same_dtype("x", x, y=y)
    check_same_device("x", x, y=y, lora_b=lora_b, scale=scale, rank=rank, sorted_token_ids=sorted_token_ids,
                      slot_starts=slot_starts, slot_counts=slot_counts)
    # (torch._check_with: traced with independently unbacked token counts (mark_unbacked on y and x) a plain
    # comparison could not be guarded on; this one becomes a runtime assert there, the ValueError in eager mode)
    torch._check_with(ValueError, y.shape[0] == x.shape[0],
                      lambda: f"y: expected {x.shape[0]} rows (x's tokens), got shape {tuple(y.shape)}")
    L, S, R, _ = lora_a.shape
    check_lora_b(y, lora_b, slice_widths, L, S, R, y_name=y_name)
    check_slot_params(lora_a, scale, rank)
    check_batch_meta(L, sorted_token_ids, slot_starts, slot_counts, x.shape[0])


def _any_requires_grad_py(*args):
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# Whether any argument is a tensor that requires grad: torch's own C check (what torch.library's autograd
# wrapper asks), a private name, so a Python loop where a torch lacks it.
any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)


def check_no_gradient(op, **tensors):
    """Op ``op`` has no backward formula (schemas.NOT_DIFFERENTIABLE): refuse, naming them, inputs that require
    grad while grad mode is on, whose gradients would come back without the op's part. Run by the kernels' and
    the fake kernels' checks (no dispatcher hop of its own: ~0.1 µs where grad mode is off)."""
    if not torch.is_grad_enabled() or not any_requires_grad(*tensors.values()):
        return
    wanting = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    # (No op gives the scale a gradient: the differentiable ones take such a scale and give it none.)
    scale = "; the scale gets a gradient from no lora_ops op: pass scale.detach()" if "scale" in wanting else ""
    _fail(RuntimeError, f"lora_ops::{op} has no gradient, but {', '.join(wanting)} require"
                        f"{'s' if len(wanting) == 1 else ''} grad: use {NOT_DIFFERENTIABLE[op]}{scale}")


def check_add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                    slot_counts):
    """add_lora_'s arguments: add_lora's, and y writable in place (check_written_in_place); none requiring grad
    under grad mode (check_no_gradient)."""
    check_no_gradient("add_lora_", y=y, x=x, lora_a=lora_a, lora_b=lora_b, scale=scale)
    check_add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
    check_written_in_place("y", y)


def check_written_in_place(name, t):
    """A 2-D output the kernels write in place: no two of its elements may share memory (an expanded view, a
    stride 0, rows that overlap), whose rows would take each other's deltas; torch's own in-place ops refuse
    such outputs too. Exact for two dimensions: elements (i, j) and (i + di, j + dj) meet where
    di·s0 + dj·s1 = 0, whose smallest solution is (s1 / g, -s0 / g), g = gcd(s0, s1). Symbolic sizes or
    strides (tracing) are left to the run. Nor may it be an inference tensor outside inference mode, which
    torch's in-place ops refuse (the CPU path did; the Triton kernels wrote it)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        _fail(RuntimeError, f"{name}: written in place, but it is an inference tensor (made under "
                            f"torch.inference_mode) and inference mode is off now; write into a normal tensor "
                            f"(e.g. {name}.clone()) or call under torch.inference_mode()")
    (M, N), (s0, s1) = t.shape, t.stride()
    if s1 == 1 and type(N) is int and type(s0) is int and s0 >= N:   # rows of a row-major tensor: the usual case
        return
    if not all(type(v) is int for v in (M, N, s0, s1)) or M == 0 or N == 0:
        return
    if (M > 1 and s0 == 0) or (N > 1 and s1 == 0):
        overlap = True
    elif M == 1 or N == 1:
        overlap = False
    else:
        g = math.gcd(s0, s1)
        overlap = abs(s1) // g < M and abs(s0) // g < N
    if overlap:
        _fail(ValueError, f"{name}: written in place, but more than one of its elements refers to one memory "
                          f"location (shape {tuple(t.shape)}, strides {tuple(t.stride())}: an expanded or "
                          f"overlapping view); pass a tensor of its own, e.g. {name}.clone()")


def apart_from(y, *inputs):
    """``inputs``, each as it is, or a copy of it where its memory meets y's, which the op writes in place
    (``add_lora(x, x, ...)``: x += delta(x) on a square layer; x, h or a weight stack a view of y's buffer). The
    ops' contract: every floating input (x or h, lora_a, lora_b, scale) is read as it was before the call; the
    integer ones (rank, the batch metadata) must not share y's memory. Each backend passes its inputs through
    this before it writes y: Triton programs of the one-launch kernel read x rows while others write their y
    columns, an expand's column blocks each read h rows, and the torch CPU kernels write one slot's rows of y
    before they read the next slot's x (on memory they share, a later read saw an earlier write). Conservative
    (views interleaved in one buffer without a shared element are copied too); y's storage is read once, and an
    input of another storage apart from it (the usual case) costs one storage read. Two storages can share
    memory (torch.from_numpy of overlapping views of one array): their address ranges are compared, not their
    identity."""
    if y.numel() == 0:
        return inputs
    y_store = y.untyped_storage()
    y_at, y_end = y_store.data_ptr(), y_store.data_ptr() + y_store.nbytes()
    return tuple(_apart(t, y, y_at, y_end) for t in inputs)


def _apart(t, y, y_at, y_end):
    """apart_from for one input ``t``, y's storage spanning bytes [y_at, y_end)."""
    t_store = t.untyped_storage()
    t_at = t_store.data_ptr()
    if (t_at != y_at and (t_at >= y_end or y_at >= t_at + t_store.nbytes())) or t.numel() == 0:
        return t
    t0, y0 = t.data_ptr(), y.data_ptr()
    if t0 < y0 + _extent(y) and y0 < t0 + _extent(t):
        return t.clone()
    return t


def _extent(t):
    """The bytes from ``t``'s first element to the end of its last (strides are never negative in torch)."""
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                      slot_counts):
    """weight [N, K] and bias [N] (or None) of the base layer, in x's dtype and on its device; then the
    LoRA arguments as add_lora_ checks them, against the output [M, N] the op returns."""
    if _lora_linear_ok(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                       slot_counts):
        return
    check_float("x", x, 2)
    check_like("weight", weight, 2, "x", x)
    if weight.shape[1] != x.shape[1]:
        _fail(ValueError, f"weight: expected shape [N, K] with K = {x.shape[1]} (x's features), "
                          f"got {tuple(weight.shape)}")
    if bias is not None:
        check_like("bias", bias, 1, "x", x)
        if bias.shape[0] != weight.shape[0]:
            _fail(ValueError, f"bias: expected {weight.shape[0]} entries (weight's rows), got {bias.shape[0]}")
    if isinstance(lora_b, torch.Tensor):    # (else add_lora's checks name it, against the output "y" this op has not)
        check_same_dtype("x", x, lora_b=lora_b)
    # The output the op returns, for add_lora_'s checks (only reached on unusual or bad input).
    out = x.new_empty((x.shape[0], weight.shape[0]))
    check_add_lora(out, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                   y_name="the output")


def stacked_views(stacked_weight, stacked_bias, lora_b, slice_widths):
    """(weight [N, K], bias [N] or None, lora_a [L, S, R, K]): the views of a stacked weight
    [N + L·S·R + P, K] (and bias [N + L·S·R + P]) that lora_linear_stacked reads, with N, L, R from lora_b
    [L, N, R] and S from slice_widths (P >= 0 trailing rows are padding, never read into the layer's output);
    a clear error where the stack's shape does not match them."""
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != 3:
        _fail(TypeError, f"lora_b: expected a 3-D tensor [L, N, R], got {tuple(getattr(lora_b, 'shape', ()))}")
    L, N, R = lora_b.shape
    S = len(slice_widths)
    rows = N + L * S * R
    if not isinstance(stacked_weight, torch.Tensor) or stacked_weight.dim() != 2 or stacked_weight.shape[0] < rows:
        _fail(ValueError, f"stacked_weight: expected shape [N + L*S*R (+ padding rows), K] with N + L*S*R = "
                          f"{N} + {L}*{S}*{R} = {rows} (lora_b [L, N, R], {S} slices), got "
                          f"{tuple(getattr(stacked_weight, 'shape', ()))}")
    if stacked_weight.stride(1) != 1 or stacked_weight.stride(0) != stacked_weight.shape[1]:
        _fail(ValueError, f"stacked_weight: expected a contiguous [N + L*S*R, K] tensor, got strides "
                          f"{tuple(stacked_weight.stride())}")
    K = stacked_weight.shape[1]
    bias = None
    if stacked_bias is not None:
        if not isinstance(stacked_bias, torch.Tensor) or tuple(stacked_bias.shape) != (stacked_weight.shape[0],):
            _fail(ValueError, f"stacked_bias: expected shape [{stacked_weight.shape[0]}] (stacked_weight's rows), "
                              f"got {tuple(getattr(stacked_bias, 'shape', ()))}")
        bias = stacked_bias[:N]
    return stacked_weight[:N], bias, stacked_weight[N:rows].view(L, S, R, K)


def check_lora_linear_stacked(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                              slot_starts, slot_counts):
    """stacked_weight [N + L·S·R, K] (contiguous) and stacked_bias [N + L·S·R] (or None); then what
    lora_linear checks, on the base weight, bias and lora_a the stack holds; none requiring grad under grad
    mode (check_no_gradient)."""
    check_no_gradient("lora_linear_stacked", x=x, stacked_weight=stacked_weight, stacked_bias=stacked_bias,
                      lora_b=lora_b, scale=scale)
    if _lora_linear_stacked_ok(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                               slot_starts, slot_counts):
        return
    weight, bias, lora_a = stacked_views(stacked_weight, stacked_bias, lora_b, slice_widths)
    try:
        check_lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                          slot_counts)
    except (TypeError, ValueError) as e:
        # lora_linear's checks name the stack's views; this op's caller passed the stack.
        name, colon, rest = str(e).partition(":")
        if not colon or name not in _STACKED_VIEWS:
            raise
        _fail(type(e), f"{_STACKED_VIEWS[name]}:{rest}")


# What lora_linear_stacked's arguments are to the views lora_linear's checks name.
_STACKED_VIEWS = {"weight": "stacked_weight (its first N rows: the base weight)",
                  "bias": "stacked_bias (its first N entries: the base bias)",
                  "lora_a": "stacked_weight (its rows N to N + L*S*R: lora_a)"}


def check_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
    check_no_gradient("shrink", x=x, lora_a=lora_a, scale=scale)
    if _shrink_ok(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
        return
    check_lora_a(x, lora_a)
    check_same_device("x", x, scale=scale, rank=rank, sorted_token_ids=sorted_token_ids,
                      slot_starts=slot_starts, slot_counts=slot_counts)
    check_slot_params(lora_a, scale, rank)
    check_batch_meta(lora_a.shape[0], sorted_token_ids, slot_starts, slot_counts, x.shape[0])


def check_shrink_output(h):
    """h [M, S, R] float32, the shrink's output that expand_ reads."""
    if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.dtype != torch.float32:
        _fail(TypeError, f"h: expected a 3-D float32 tensor [M, S, R] (the shrink output), got "
                         f"{getattr(h, 'dtype', type(h).__name__)} {tuple(getattr(h, 'shape', ()))}")


def check_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts):
    check_no_gradient("expand_", y=y, h=h, lora_b=lora_b)
    check_float("y", y, 2)
    check_written_in_place("y", y)
    check_shrink_output(h)
    check_same_device("y", y, h=h, rank=rank, sorted_token_ids=sorted_token_ids, slot_starts=slot_starts,
                      slot_counts=slot_counts)
    if h.shape[0] != y.shape[0]:
        _fail(ValueError, f"h: expected {y.shape[0]} rows (y's tokens), got shape {tuple(h.shape)}")
    L = lora_b.shape[0] if lora_b.dim() == 3 else -1
    check_lora_b(y, lora_b, slice_widths, L, h.shape[1], h.shape[2], per="slice of h")
    check_index("rank", rank)
    check_rank_length(rank, L, "lora_b")
    check_batch_meta(L, sorted_token_ids, slot_starts, slot_counts, y.shape[0], "y")


def _check_fp32(name, t, dims, what):
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.float32:
        _fail(TypeError, f"{name}: expected a {dims}-D float32 tensor {what}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def check_lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
    """dh [M, S, R] float32 (the gradient of the shrink output) against lora_a [L, S, R, K]."""
    if _lora_grad_x_ok(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
        return
    _check_fp32("dh", dh, 3, "[M, S, R] (the gradient of the shrink output)")
    check_float("lora_a", lora_a, 4)
    check_same_device("dh", dh, lora_a=lora_a, rank=rank, sorted_token_ids=sorted_token_ids,
                      slot_starts=slot_starts, slot_counts=slot_counts)
    if tuple(dh.shape[1:]) != tuple(lora_a.shape[1:3]):
        _fail(ValueError, f"dh: expected shape [M, S, R] with S, R = {tuple(lora_a.shape[1:3])} (lora_a's "
                          f"slices and rank), got {tuple(dh.shape)}")
    L = lora_a.shape[0]
    check_index("rank", rank)
    check_rank_length(rank, L, "lora_a")
    check_batch_meta(L, sorted_token_ids, slot_starts, slot_counts, dh.shape[0], "dh")


def check_segment_outer(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
    """u [M, P] float32 and v [M, Q] (fp16/bf16/fp32) share their tokens; L = rank's length."""
    if _segment_outer_ok(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
        return
    _check_outer_factors("u", u, 2, "[M, P] (the rank-side factor)", "v", v, rank, sorted_token_ids, slot_starts,
                         slot_counts)


def _check_outer_factors(u_name, u, u_dims, u_what, v_name, v, rank, sorted_token_ids, slot_starts, slot_counts):
    """The two factors of a per-slot outer-product sum: ``u`` float32 on the rank side (``u_dims``-D, described
    by ``u_what``), ``v`` [M, Q] (fp16/bf16/fp32) with u's tokens, on u's device; rank [L] and the metadata."""
    _check_fp32(u_name, u, u_dims, u_what)
    check_float(v_name, v, 2)
    check_same_device(u_name, u, **{v_name: v}, rank=rank, sorted_token_ids=sorted_token_ids,
                      slot_starts=slot_starts, slot_counts=slot_counts)
    if v.shape[0] != u.shape[0]:
        _fail(ValueError, f"{v_name}: expected {u.shape[0]} rows ({u_name}'s tokens), got shape {tuple(v.shape)}")
    check_index("rank", rank)
    check_batch_meta(rank.shape[0], sorted_token_ids, slot_starts, slot_counts, u.shape[0], u_name)


def check_lora_grad_h(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """grad_out [M, N] (the gradient of the layer's output) against lora_b [L, N, R] of its dtype, slice_widths
    cutting N; scale and rank per slot of lora_b."""
    if _lora_grad_h_ok(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
        return
    check_float("grad_out", grad_out, 2)
    check_float("lora_b", lora_b, 3)
    check_same_device("grad_out", grad_out, lora_b=lora_b, scale=scale, rank=rank,
                      sorted_token_ids=sorted_token_ids, slot_starts=slot_starts, slot_counts=slot_counts)
    L, _, R = lora_b.shape
    check_lora_b(grad_out, lora_b, slice_widths, L, len(slice_widths), R, y_name="grad_out")
    check_slot_params(lora_b, scale, rank, "lora_b")
    check_batch_meta(L, sorted_token_ids, slot_starts, slot_counts, grad_out.shape[0], "grad_out")


def check_lora_grad_a(dh, x, rank, sorted_token_ids, slot_starts, slot_counts):
    """dh [M, S, R] float32 and x [M, K] (fp16/bf16/fp32) share their tokens; L = rank's length."""
    if _lora_grad_a_ok(dh, x, rank, sorted_token_ids, slot_starts, slot_counts):
        return
    _check_outer_factors("dh", dh, 3, "[M, S, R] (the gradient of the shrink output)", "x", x, rank,
                         sorted_token_ids, slot_starts, slot_counts)
    if dh.shape[1] < 1 or dh.shape[2] < 1:
        _fail(ValueError, f"dh: expected shape [M, S, R] with S, R >= 1, got {tuple(dh.shape)}")


def check_lora_grad_b(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """grad_out [M, N] (fp16/bf16/fp32) and h [M, S, R] float32 share their tokens; slice_widths: S widths
    cutting N; L = rank's length."""
    if _lora_grad_b_ok(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
        return
    check_float("grad_out", grad_out, 2)
    _check_fp32("h", h, 3, "[M, S, R] (the shrink output)")
    check_same_device("grad_out", grad_out, h=h, rank=rank, sorted_token_ids=sorted_token_ids,
                      slot_starts=slot_starts, slot_counts=slot_counts)
    if h.shape[0] != grad_out.shape[0]:
        _fail(ValueError, f"h: expected {grad_out.shape[0]} rows (grad_out's tokens), got shape {tuple(h.shape)}")
    if h.shape[2] < 1:
        _fail(ValueError, f"h: expected shape [M, S, R] with R >= 1, got {tuple(h.shape)}")
    check_slice_widths(slice_widths, h.shape[1], grad_out.shape[1], "grad_out's columns", per="slice of h")
    check_index("rank", rank)
    check_batch_meta(rank.shape[0], sorted_token_ids, slot_starts, slot_counts, h.shape[0], "h")
