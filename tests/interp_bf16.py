"""TEST-ONLY patch: bf16 arithmetic in Triton's CPU interpreter, redone in float32.

Triton's interpreter (3.6 and 3.9) keeps bf16 values as their raw 16-bit patterns in uint16 numpy
arrays and then runs numpy on those integers: bf16 ``+``/``-``/``*`` add the bit patterns, ``tl.dot``
multiplies them as integers, and fp32 -> bf16 truncates instead of rounding to nearest even
(DESIGN.md §6; upstream triton-lang/triton#11584, #10945). fp16 and fp32 are right.

:func:`patched` swaps, on ``InterpreterBuilder`` and for the duration of a ``with`` block only:

- ``binary_op`` / ``unary_op`` / ``ternary_op`` / ``create_fma``: bf16 operands are widened exactly
  to float32, the op runs in float32, and a float result is rounded to bf16 (nearest even);
- ``create_dot``: bf16 operands widened exactly, products and sums in float32 (as tensor cores do);
- ``cast_impl``: bf16 <-> float32 exactly / with round-to-nearest-even (other dtypes via float32).

The kernels themselves are never touched. Not patched (our kernels do not use them on bf16):
reductions and scans over bf16 blocks, and fp64 -> bf16 (rounds twice, through float32).
"""
import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

UNPATCHABLE_REASON = None
try:
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    _PATCHED_METHODS = ("binary_op", "unary_op", "ternary_op", "create_fma", "create_dot", "cast_impl")
    _missing = [m for m in _PATCHED_METHODS if not callable(getattr(InterpreterBuilder, m, None))]
    if _missing:
        UNPATCHABLE_REASON = (f"Triton {triton.__version__}: the interpreter has no InterpreterBuilder."
                              f"{', '.join(_missing)}; the bf16 test patch does not apply")
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    UNPATCHABLE_REASON = f"Triton {triton.__version__}: cannot import the interpreter internals ({exc})"


def _is_bf16(handle):
    return handle.dtype.scalar == tl.bfloat16


def bf16_bits_to_f32(bits):
    """Exact widening: a bf16 is the top half of a float32."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(values):
    """Round float32 to bf16 bit patterns, to nearest with ties to even (as CUDA and torch do)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    tie_to_even = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + tie_to_even) >> np.uint32(16)).astype(np.uint16)
    quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)  # NaN stays NaN
    return np.where(np.isnan(values), quiet_nan, rounded)


def _as_f32(handle):
    return bf16_bits_to_f32(handle.data) if _is_bf16(handle) else handle.data


def _result(data, like_dtype):
    """A float32 result goes back to bf16; anything else (comparisons) is kept as computed."""
    if data.dtype == np.float32:
        return TensorHandle(f32_to_bf16_bits(data), tl.bfloat16)
    return TensorHandle(data, like_dtype)


def _make_patches(original):
    def binary_op(self, lhs, rhs, op):
        if not (_is_bf16(lhs) or _is_bf16(rhs)):
            return original["binary_op"](self, lhs, rhs, op)
        return _result(op(_as_f32(lhs), _as_f32(rhs)), lhs.dtype.scalar)

    def unary_op(self, arg, op):
        if not _is_bf16(arg):
            return original["unary_op"](self, arg, op)
        return _result(op(_as_f32(arg)), arg.dtype.scalar)

    def ternary_op(self, lhs, rhs, other, op):
        # tl.where on bf16 would be right on the bit patterns, but clamp is not; widening is exact.
        if not any(map(_is_bf16, (lhs, rhs, other))):
            return original["ternary_op"](self, lhs, rhs, other, op)
        return _result(op(_as_f32(lhs), _as_f32(rhs), _as_f32(other)), other.dtype.scalar)

    def create_fma(self, x, y, z):
        if not any(map(_is_bf16, (x, y, z))):
            return original["create_fma"](self, x, y, z)
        exact = np.multiply(_as_f32(x), _as_f32(y), dtype=np.float64) + _as_f32(z)
        return _result(exact.astype(np.float32), z.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (_is_bf16(a) or _is_bf16(b) or _is_bf16(d)):
            return original["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = np.matmul(_as_f32(a), _as_f32(b), dtype=np.float32) + _as_f32(d)
        if _is_bf16(d):
            return TensorHandle(f32_to_bf16_bits(acc), tl.bfloat16)
        return TensorHandle(acc.astype(d.data.dtype), d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        src_bf16 = src.dtype.scalar == tl.bfloat16
        dst_bf16 = dst_type.scalar == tl.bfloat16
        if src_bf16 == dst_bf16:
            return original["cast_impl"](self, src, dst_type)
        if src_bf16:
            widened = TensorHandle(bf16_bits_to_f32(src.data), tl.float32)
            if dst_type.scalar == tl.float32:
                return widened
            return original["cast_impl"](self, widened, dst_type)
        as_f32 = src if src.dtype.scalar == tl.float32 else original["cast_impl"](self, src, tl.float32)
        return TensorHandle(f32_to_bf16_bits(as_f32.data), tl.bfloat16)

    return dict(binary_op=binary_op, unary_op=unary_op, ternary_op=ternary_op, create_fma=create_fma,
                create_dot=create_dot, cast_impl=cast_impl)


@contextlib.contextmanager
def patched():
    """Within the block, the interpreter computes bf16 in float32 with round-to-nearest-even."""
    if UNPATCHABLE_REASON:
        raise RuntimeError(UNPATCHABLE_REASON)
    from lora_ops import ops
    original = {name: InterpreterBuilder.__dict__[name] for name in _PATCHED_METHODS}
    for name, fn in _make_patches(original).items():
        setattr(InterpreterBuilder, name, fn)
    was = ops.INTERPRETER_BF16["patched"]
    ops.INTERPRETER_BF16["patched"] = True     # (else the ops refuse bf16 on the interpreter)
    try:
        yield
    finally:
        ops.INTERPRETER_BF16["patched"] = was
        for name, fn in original.items():
            setattr(InterpreterBuilder, name, fn)


# Tiny standalone kernels that show the interpreter's bf16 problems and check the patch:
# (a @ b) cast to bf16 and a + b on one BLOCK x BLOCK tile; a float32 -> bf16 cast.
@triton.jit
def probe_kernel(a_ptr, b_ptr, dot_ptr, add_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = offs[:, None] * BLOCK + offs[None, :]
    a = tl.load(a_ptr + idx)
    b = tl.load(b_ptr + idx)
    tl.store(dot_ptr + idx, tl.dot(a, b).to(tl.bfloat16))
    tl.store(add_ptr + idx, a + b)


@triton.jit
def probe_cast_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs).to(tl.bfloat16))


def run_probe(a, b):
    """(bf16 dot, bf16 sum) of two [BLOCK, BLOCK] bf16 CPU tensors, computed by the interpreter."""
    dot, add = a.new_empty(a.shape), a.new_empty(a.shape)
    probe_kernel[(1,)](a, b, dot, add, BLOCK=a.shape[0])
    return dot, add


def run_cast_probe(values):
    """float32 [BLOCK] CPU tensor -> bf16, cast by the interpreter."""
    out = values.new_empty(values.shape, dtype=torch.bfloat16)
    probe_cast_kernel[(1,)](values, out, BLOCK=values.shape[0])
    return out
