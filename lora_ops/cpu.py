"""The CPU kernels: vectorised torch, one matrix product per used slot, no per-token Python loop.

They read the same batch metadata as the Triton kernels (tokens grouped by slot), so models run on
CPU and on machines without Triton. On the CPU, reading the counts on the host costs no sync.
Products run in float32 (float64 stays float64 nowhere: inputs are fp16/bf16/fp32) and each output
element is rounded once, under torch.autocast too. Like the Triton kernels, they record no autograd graph
(torch.no_grad): autograd belongs to the op, whichever backend runs it.
"""
import functools

import torch

from csrc_meta.checks import apart_from
from lora_ops.precision import base_linear, no_autocast, stacked_gemm


def cpu_kernel(fn):
    """A CPU kernel: no autograd graph (autograd belongs to the op) and its own precision (float32
    products, one rounding) whatever an ambient torch.autocast says."""
    @functools.wraps(fn)
    def kernel(*args):
        with torch.no_grad(), no_autocast("cpu"):
            return fn(*args)
    return kernel


def _slot_runs(num_slots, rank, sorted_token_ids, slot_starts, slot_counts, num_tokens):
    """(slot, token ids, rank) for every slot with tokens and a positive rank. Starts are clamped to the buffer as
    the kernels clamp them (kernels.work.find_slot_tile): a negative one, a Python slice's from the end, gave
    the slot other tokens than the GPU's."""
    starts = slot_starts.tolist()
    counts = slot_counts.tolist()
    ranks = rank.tolist()
    capacity = sorted_token_ids.shape[0]
    for slot in range(num_slots):
        r, n = ranks[slot], counts[slot]
        if n <= 0 or r <= 0:
            continue
        start = min(max(starts[slot], 0), capacity)
        ids = sorted_token_ids[start:start + n].long()
        yield slot, ids[(ids >= 0) & (ids < num_tokens)], r


@cpu_kernel
def shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
    M = x.shape[0]
    L, S, R, K = lora_a.shape
    h = torch.zeros(M, S, R, dtype=torch.float32, device=x.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        a = lora_a[slot, :, :r].float().reshape(S * r, K)
        h[ids, :, :r] = (x[ids].float() @ a.T).view(-1, S, r) * scale[slot]
    return h


@cpu_kernel
def expand_(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts):
    M = y.shape[0]
    L, N, R = lora_b.shape
    h, lora_b = apart_from(y, h, lora_b)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        y[ids] = _expanded(y[ids], h[ids, :, :r], lora_b[slot, :, :r], slice_widths)


@cpu_kernel
def add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    M = x.shape[0]
    L, S, R, K = lora_a.shape
    x, lora_a, lora_b, scale = apart_from(y, x, lora_a, lora_b, scale)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        a = lora_a[slot, :, :r].float().reshape(S * r, K)
        h = (x[ids].float() @ a.T).view(-1, S, r) * scale[slot]
        y[ids] = _expanded(y[ids], h, lora_b[slot, :, :r], slice_widths)


@cpu_kernel
def lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                slot_counts):
    y = base_linear(x, weight, bias)
    add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
    return y


@cpu_kernel
def lora_linear_stacked(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                        slot_starts, slot_counts):
    L, N, R = lora_b.shape
    S = len(slice_widths)
    out = stacked_gemm(x, stacked_weight, stacked_bias, N, L * S * R)
    h = out[:, N:N + L * S * R].view(-1, L, S, R)   # every slot's h, unscaled, in x's dtype (rounded once)
    y = out[:, :N]
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, out.shape[0]):
        r = min(r, R)
        y[ids] = _expanded(y[ids], h[ids, slot, :, :r].float() * scale[slot], lora_b[slot, :, :r], slice_widths)
    return out


def slice_bounds(slice_widths):
    """[(first column, end column)] of each packed output slice."""
    bounds, col = [], 0
    for n in slice_widths:
        bounds.append((col, col + n))
        col += n
    return bounds


def _expanded(y_rows, h, b, slice_widths):
    """y_rows + h @ B^T slice by slice, computed in float32 and rounded once to y's dtype."""
    out = y_rows.float()
    for i, (lo, hi) in enumerate(slice_bounds(slice_widths)):
        out[:, lo:hi] += h[:, i] @ b[lo:hi].float().T
    return out.to(y_rows.dtype)
