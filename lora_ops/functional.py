"""The public functional API over the ops (one op call each; metadata built here only on request)."""
import operator

import torch
from torch.autograd import forward_ad

from csrc_meta import checks
from lora_ops import ops
from lora_ops.batch import BatchMeta, LoRABatch, batch_meta_of, build_batch_meta, check_token_slots, first_outside


def _tensor(name, t):
    """The functional API reads shapes before the op's checks: a non-tensor is named here, not met as an
    AttributeError or IndexError."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _meta(x, lora_a, token_slots, batch, names=("x", "lora_a")):
    """The batch metadata for x [M, K] (or h [M, S, R]: expand checks it first), whose first dimension is the
    tokens; ``names``: those of x and lora_a in the caller's signature."""
    _tensor(names[0], x)
    _tensor(names[1], lora_a)
    if x.dim() == 3 and lora_a.dim() == 4:  # (before the token counts)
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)} (x [M, K]: its tokens flattened "
                         f"into the first dimension)")
    if x.dim() < 2 and lora_a.dim() == 4:   # (else the token counts name token_slots)
        raise ValueError(f"x: expected a 2-D tensor [M, K], got shape {tuple(x.shape)}")
    if lora_a.dim() >= 3 and lora_a.shape[0] == 0:
        raise ValueError(f"{names[1]}: expected at least one slot, got shape {tuple(lora_a.shape)}")
    if (token_slots is None) == (batch is None):
        raise ValueError("token_slots / batch: pass exactly one of them (per-token slots, or the metadata "
                         "built from them by LoRABatch.update / build_batch_meta)")
    if batch is None:
        if isinstance(token_slots, torch.Tensor) and token_slots.device != x.device:
            # Slots made on the host for tensors on a GPU (set_token_slots takes them too): checked there, moved.
            check_token_slots(token_slots, lora_a.shape[0], device=x.device)
            token_slots = token_slots.to(x.device)
        if _traced(token_slots):
            # Traceable ops in tensors of the tokens' own size: a LoRABatch sized from the count pinned an
            # exported program to one token count, and an unbacked count (mark_unbacked) did not compile.
            check_token_slots(token_slots, lora_a.shape[0])
            torch._check(token_slots.shape[0] == x.shape[0], lambda: "token_slots: expected one entry per token "
                         "(as many as x's rows)")
            return batch_meta_of(token_slots, lora_a.shape[0])
        meta = build_batch_meta(token_slots, lora_a.shape[0])  # checks token_slots' type, shape and range
        if token_slots.shape[0] != x.shape[0]:  # else extra slots are ignored, or the error names the metadata
            raise ValueError(f"token_slots: expected {x.shape[0]} entries (one per token), "
                             f"got {token_slots.shape[0]}")
        return meta
    if isinstance(batch, LoRABatch):
        # (Not while compiling: a count compared with the input's would pin the graph to one token count.)
        if not torch.compiler.is_compiling() and batch.num_tokens != x.shape[0]:
            raise ValueError(f"batch: filled for {batch.num_tokens} tokens (its last LoRABatch.update), but the "
                             f"input has {x.shape[0]}; update it with this batch's token slots first")
        return batch.meta
    if isinstance(batch, BatchMeta):
        return batch
    raise TypeError(f"batch: expected a LoRABatch or BatchMeta, got {type(batch).__name__}")


def _traced(token_slots):
    """Whether torch.compile or torch.export traces this call (an export's symbolic token count included)."""
    return torch.compiler.is_compiling() or (isinstance(token_slots, torch.Tensor) and token_slots.dim() == 1
                                             and isinstance(token_slots.shape[0], torch.SymInt))


def _check_rank_values(rank, lora):
    """rank's entries in [0, R], R the stack's capacity (dimension 2 of ``lora``: lora_a [L, S, R, K] or lora_b
    [L, N, R]), where rank is a CPU tensor (no device sync; as token_slots' range). The kernels clamp a rank
    outside it, which no one means. Other faults of rank or the stack are the op's checks to name."""
    if torch.compiler.is_compiling():       # (the values are data: a compiled call reads them in the kernels only)
        return
    if (isinstance(rank, torch.Tensor) and rank.device.type == "cpu" and rank.dim() == 1 and rank.numel()
            and not rank.is_floating_point() and isinstance(lora, torch.Tensor) and lora.dim() >= 3):
        R = lora.shape[2]
        i = first_outside(rank, 0, R + 1)
        if i is not None:
            raise ValueError(f"rank: slot {i} has rank {int(rank[i])}, outside [0, R={R}] (the stack's capacity)")


def _widths(y, slice_widths):
    """The slice widths as ints: ``slice_widths``, or one slice of y's width."""
    _tensor("y", y)
    if slice_widths is not None:
        try:
            widths = list(slice_widths)
        except TypeError:
            raise TypeError(f"slice_widths: expected a sequence of integers, got {slice_widths!r}") from None
        return [_width(w) for w in widths]
    if y.dim() != 2:
        raise ValueError(f"y: expected a 2-D tensor, got shape {tuple(y.shape)}")
    if y.shape[1] == 0:
        raise ValueError("y: expected N >= 1 columns, got shape " + str(tuple(y.shape)))
    return [y.shape[1]]


def _width(w):
    """A slice width as an int: integers of any kind (numpy's, 0-d tensors), never a float truncated."""
    try:
        return operator.index(w)
    except TypeError:
        raise TypeError(f"slice_widths: expected integers, got {w!r}") from None


def add_lora(y, x, lora_a, lora_b, scale, rank, *, token_slots=None, batch=None, slice_widths=None):
    """y += the LoRA delta of every token's adapter slot, in place; returns y.

    x [M, K]; y [M, N]; lora_a [L, S, R, K]; lora_b [L, N, R]; scale [L] float32; rank [L] int32;
    slice_widths: S widths summing to N (default: one slice [N]); token_slots [M] int32/int64 in
    [-1, L) (-1: no adapter), or batch: the metadata built from them.
    Where autograd needs the call (grad mode on, y, x, lora_a, lora_b or scale requiring grad), y is written by
    a differentiable copy of :func:`lora_forward`'s result, so gradients flow as through y + delta (the scale
    takes none, as in lora_forward).
    """
    meta = _meta(x, lora_a, token_slots, batch)
    widths = _widths(y, slice_widths)
    _tensor("lora_b", lora_b)
    _check_rank_values(rank, lora_a)
    # (requires_grad read tensor by tensor: Dynamo cannot trace ops.any_requires_grad's C call.) Under
    # torch.func transforms and forward-mode AD too, as LoRALinear does: add_lora has their rules (a vmap batch
    # rule, ops.FORWARD_AD), the in-place op has none.
    if ((torch.is_grad_enabled() and (y.requires_grad or x.requires_grad or lora_a.requires_grad
                                      or lora_b.requires_grad or getattr(scale, "requires_grad", False)))
            or (not torch.compiler.is_compiling()
                and (torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0))):
        out = ops.call("add_lora", y, x, lora_a, lora_b, scale, rank, widths, *meta)     # (checks y's shape)
        # (y's memory checked as add_lora_ checks it: torch's copy_ refuses a stride 0 but writes rows that
        # overlap, one token's delta over another's)
        checks.check_written_in_place("y", y)
        return y.copy_(out)
    ops.call("add_lora_", y, x, lora_a, lora_b, scale, rank, widths, *meta)
    return y


def shrink(x, lora_a, scale, rank, *, token_slots=None, batch=None):
    """h [M, S, R] float32 = scale * x A^T at each token's slot and rank (zero elsewhere)."""
    meta = _meta(x, lora_a, token_slots, batch)
    _check_rank_values(rank, lora_a)
    return ops.call("shrink", x, lora_a, scale, rank, *meta)


def expand(y, h, lora_b, rank, *, token_slots=None, batch=None, slice_widths=None):
    """y[:, slice i] += h[:, i, :rank] @ B[slot, slice i, :rank]^T, in place; returns y."""
    checks.check_shrink_output(h)
    if (isinstance(y, torch.Tensor) and y.dim() == 2 and not torch.compiler.is_compiling()
            and h.shape[0] != y.shape[0]):   # (before the token count: _meta counts h's rows)
        raise ValueError(f"h: expected {y.shape[0]} rows (y's tokens), got shape {tuple(h.shape)}")
    meta = _meta(h, lora_b, token_slots, batch, names=("h", "lora_b"))
    widths = _widths(y, slice_widths)
    _check_rank_values(rank, lora_b)
    ops.call("expand_", y, h, lora_b, widths, rank, *meta)
    return y


def lora_dropout(x, p, training):
    """The LoRA input under dropout with PEFT's semantics: only the adapters see the dropped x (the base
    layer is fed the original x by the caller), and only in training mode; x itself when p == 0 or eval."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p: expected a dropout probability in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    return torch.nn.functional.dropout(x, p, training=True)


def lora_forward(y, x, lora_a, lora_b, scale, rank, *, token_slots=None, batch=None, slice_widths=None,
                 dropout=0.0, training=True):
    """y + the LoRA delta of every token's adapter slot, out of place and differentiable.

    Gradients flow to y (unchanged), x, lora_a and lora_b (per slot: sums over that slot's tokens); scale,
    rank and the batch metadata get none. With ``dropout`` > 0 and ``training``, the delta is computed from
    dropout(x) (PEFT's lora_dropout); pass y = base(x) computed from the undropped x.
    Shapes and arguments as :func:`add_lora`.
    """
    meta = _meta(x, lora_a, token_slots, batch)
    widths = _widths(y, slice_widths)
    _check_rank_values(rank, lora_a)
    x_lora = lora_dropout(x, dropout, training)
    return ops.call("add_lora", y, x_lora, lora_a, lora_b, scale, rank, widths, *meta)
