"""FLOP formulas of the ops, for torch.utils.flop_counter.FlopCounterMode (which counts an op it has no formula
for as zero: without these a LoRA model's count held the base layers only).

A multiply-add counts 2, as torch's own formulas count a matmul. Each slot's tokens are counted at the slot's
rank (clamped to [0, R], as the kernels clamp it) and tokens with no adapter not at all: the count reads
`rank` and `slot_counts`, a device sync, which FlopCounterMode (a debugging and accounting tool, not a hot
path) can afford. Where the values cannot be read (fake or meta tensors, a fake mode active, a CUDA graph being
captured) every token counts at the max rank R: an upper bound. Bias additions are not counted (torch's addmm formula does
not count them either).

The formulas are registered when torch.utils.flop_counter is imported, not before: that module imports
Triton, and Triton imported before TRITON_INTERPRET is set cannot run the interpreter (its own @jit helpers,
tl.sum and kin, are compiled-mode functions then), so importing lora_ops must not import it.
"""
import importlib.abc
import importlib.machinery
import sys
import warnings

import torch

from csrc_meta.schemas import OPS

FLOP_COUNTER = "torch.utils.flop_counter"
FORMULAS = {}   # op name -> its formula, registered by register()


def _readable(*tensors):
    """Whether the tensors' values can be read here: not fake or meta, no fake mode active (a real tensor read
    under one comes back fake: FlopCounterMode inside FakeTensorMode over a real model), and no CUDA graph
    capture on their devices (a sync would end it)."""
    from torch._subclasses.fake_tensor import is_fake
    if any(t.device.type == "meta" or is_fake(t) for t in tensors):
        return False
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return False
    for device in {t.device for t in tensors if t.is_cuda}:     # (each device once)
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return False
    return True


def token_ranks(M, R, rank, slot_counts):
    """Sum over the adapted tokens of each one's rank: sum over slots l of slot_counts[l] * clamp(rank[l], 0, R)
    (the last entry of slot_counts counts the tokens with no adapter); M * R where the values cannot be read."""
    if not _readable(rank, slot_counts):
        return M * R
    L = rank.shape[0]
    counts = slot_counts[:L].to(device="cpu", dtype=torch.int64)
    return int((counts * rank.to(device="cpu", dtype=torch.int64).clamp(0, R)).sum())


def _formula(*names):
    def add(fn):
        FORMULAS.update(dict.fromkeys(names, fn))
        return fn
    return add


@_formula("shrink")
def shrink_flops(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, *, out_val=None, **kwargs):
    _, S, R, K = lora_a.shape
    return 2 * token_ranks(x.shape[0], R, rank, slot_counts) * S * K


@_formula("expand_")
def expand_flops(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts, *, out_val=None,
                 **kwargs):
    _, N, R = lora_b.shape
    return 2 * token_ranks(y.shape[0], R, rank, slot_counts) * N


def delta_flops(M, lora_a, lora_b, rank, slot_counts):
    """The add_lora_ delta's: the shrink (S slices of K features) and the expand (N outputs), per token-rank."""
    _, S, R, K = lora_a.shape
    return 2 * token_ranks(M, R, rank, slot_counts) * (S * K + lora_b.shape[1])


@_formula("add_lora_", "add_lora")    # (in place and out of place: the same arguments, the same work)
def add_lora_flops(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts, *,
                   out_val=None, **kwargs):
    return delta_flops(x.shape[0], lora_a, lora_b, rank, slot_counts)


@_formula("lora_linear")
def lora_linear_flops(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                      slot_counts, *, out_val=None, **kwargs):
    M, K = x.shape
    return 2 * M * weight.shape[0] * K + delta_flops(M, lora_a, lora_b, rank, slot_counts)


@_formula("lora_linear_stacked")
def lora_linear_stacked_flops(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                              slot_starts, slot_counts, *, out_val=None, **kwargs):
    # One GEMM over the base weight's N rows and every slot's L * S * R rows of A (each token's h for every
    # slot: the work this path does; its padding rows are not counted), then the expand at each slot's rank.
    M, K = x.shape
    L, N, R = lora_b.shape
    gemm_rows = N + L * len(slice_widths) * R
    return 2 * M * gemm_rows * K + 2 * token_ranks(M, R, rank, slot_counts) * N


@_formula("lora_grad_x")
def lora_grad_x_flops(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts, *, out_val=None, **kwargs):
    _, S, R, K = lora_a.shape
    return 2 * token_ranks(dh.shape[0], R, rank, slot_counts) * S * K


@_formula("segment_outer")
def segment_outer_flops(u, v, rank, sorted_token_ids, slot_starts, slot_counts, *, out_val=None, **kwargs):
    return 2 * token_ranks(u.shape[0], u.shape[1], rank, slot_counts) * v.shape[1]


@_formula("lora_grad_h")
def lora_grad_h_flops(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts, *,
                      out_val=None, **kwargs):
    _, N, R = lora_b.shape
    return 2 * token_ranks(grad_out.shape[0], R, rank, slot_counts) * N


@_formula("lora_grad_a")
def lora_grad_a_flops(dh, x, rank, sorted_token_ids, slot_starts, slot_counts, *, out_val=None, **kwargs):
    M, S, R = dh.shape
    return 2 * token_ranks(M, R, rank, slot_counts) * S * x.shape[1]


@_formula("lora_grad_b")
def lora_grad_b_flops(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts, *, out_val=None,
                      **kwargs):
    M, N = grad_out.shape
    return 2 * token_ranks(M, h.shape[2], rank, slot_counts) * N


assert set(FORMULAS) == set(OPS), "every op has a FLOP formula"


def register(flop_counter):
    """Register every formula with ``flop_counter`` (the torch.utils.flop_counter module), once."""
    for name, fn in FORMULAS.items():
        if getattr(torch.ops.lora_ops, name) not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(getattr(torch.ops.lora_ops, name), get_raw=True)(fn)


class _Loader(importlib.abc.Loader):
    """torch.utils.flop_counter's own loader, then the formulas registered (on every load: a reload rebuilds
    the module's registry)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader    # as the real loader would have left them
        self.loader.exec_module(module)
        try:
            register(module)
        except Exception as e:   # (FlopCounterMode must stay importable whatever happens here)
            warnings.warn(f"lora_ops: FLOP formulas not registered with FlopCounterMode: {e!r}")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """A post-import hook: finds torch.utils.flop_counter as the path finder does (a fresh spec each time, so
    a find_spec that loads nothing uses nothing up) and gives it a loader that registers the formulas. It
    stays in sys.meta_path: one string comparison per import not yet cached."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != FLOP_COUNTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if FLOP_COUNTER in sys.modules:
    register(sys.modules[FLOP_COUNTER])
if not any(type(f).__name__ == _RegisterOnImport.__name__ for f in sys.meta_path):   # (once, reloads too)
    sys.meta_path.insert(0, _RegisterOnImport())
