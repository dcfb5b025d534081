"""What torch.autocast does to lora_ops: nothing to the ops, the casts of nn.Linear to LoRALinear.

The ops compute in their inputs' dtype whatever an ambient autocast says, as their fake kernels state; so
their base GEMM (and the write-first path's addmm_) runs with autocast off, and so does every CPU kernel
(lora_ops.cpu: its float32 products would be recast too). LoRALinear, under autocast, casts its floating
inputs as autocast casts an nn.Linear's, then calls the ops in that dtype (DESIGN §5). The ops' base GEMMs
live here for that reason, stack_a's too (over the prefix of its stack a token count takes: DESIGN §4).
"""
import contextlib

import torch

from lora_ops import configs


# One C call for the usual case, autocast off everywhere (~0.1 µs; asking about a device takes ~0.4).
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_on(device_type):
    """Whether torch.autocast is on for ``device_type`` (never for one it does not know, such as meta)."""
    if not _any_autocast():
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def no_autocast(device_type):
    """A context in which torch.autocast recasts nothing on ``device_type`` (a null one where it is off)."""
    if autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def base_linear(x, weight, bias):
    """The lora_linear ops' base GEMM (both backends), in the inputs' dtype. (no_autocast written out: on
    the eager hot path its null context costs more than the test.)"""
    if autocast_on(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def base_addmm_(y, x, weight):
    """y += x @ weight^T in place (lora_linear's write-first path), in the inputs' dtype."""
    with no_autocast(x.device.type):
        return y.addmm_(x, weight.t())


def stacked_gemm(x, stacked_weight, stacked_bias, out_features, stack_rows):
    """F.linear(x, [W; A; pad], bias): lora_linear_stacked's GEMM (both backends; the eager replay runs the same
    from the rows it resolved when it bound the call),
    [M, rows of the stack]: W's ``out_features`` rows, ``stack_rows`` (L·S·R) of A, then zero padding, there
    for cuBLAS's kernel choice, which changes with the token count. Where the table pads this count less than
    the stack holds (:func:`stacked_prefix_rows`), only that prefix of the stack is multiplied, into the
    output's first columns (:func:`stack_prefix_gemm`); the padding's other columns are left unwritten and
    nothing reads them (the layer takes the first N columns, the expand the next L·S·R)."""
    rows = stacked_prefix_rows(x.shape[0], stacked_weight, stacked_bias, out_features, stack_rows)
    if rows is None:
        return base_linear(x, stacked_weight, stacked_bias)
    return stack_prefix_gemm(x, stack_prefix(stacked_weight, rows), stacked_weight.shape[0])


def stacked_prefix_rows(num_tokens, stacked_weight, stacked_bias, out_features, stack_rows):
    """The rows of the stack the GEMM multiplies at ``num_tokens`` tokens where that is fewer than all of them
    (W, A and the padding configs.stack_pad_at gives this count), else None: the whole stack. None too without
    a table entry, and with a bias (an addmm into a column view would first copy the bias there)."""
    total, K = stacked_weight.shape
    end = out_features + stack_rows
    if total <= end or stacked_bias is not None:
        return None
    pad = configs.stack_pad_at(num_tokens, out_features, K, stack_rows, stacked_weight.device, stacked_weight.dtype)
    return None if pad is None or end + pad >= total else end + pad


def stack_prefix(stacked_weight, rows):
    """The prefix GEMM's right operand, stacked_weight[:rows]^T: a view, which the eager replay takes once, when
    it binds a call (two view ops, ~1.5 µs of host time a call)."""
    return stacked_weight[:rows].t()


def stack_prefix_gemm(x, prefix_t, columns):
    """[M, ``columns``] (the stack's rows) whose first ``prefix_t.shape[1]`` columns are x @ prefix_t, prefix_t
    from :func:`stack_prefix` (cuBLAS takes the output's row stride as its leading dimension: one kernel, no
    copy), and the rest unwritten."""
    out = x.new_empty(x.shape[0], columns)
    if autocast_on(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            torch.mm(x, prefix_t, out=out[:, :prefix_t.shape[1]])
    else:
        torch.mm(x, prefix_t, out=out[:, :prefix_t.shape[1]])
    return out


def autocast_dtype(x):
    """The dtype torch.autocast casts a linear layer's floating inputs to on ``x``'s device, or None where
    autocast is off there."""
    if not _any_autocast():
        return None
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if autocast_on(device_type) else None


def autocast_cast(t, dtype):
    """``t`` (a tensor or None) as autocast casts an input of a linear layer: floating point, float64 aside,
    to ``dtype`` (differentiably)."""
    if t is None or t.dtype == dtype or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)
