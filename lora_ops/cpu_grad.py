"""CPU kernels of the backward ops: vectorised torch, one matrix product per used slot (as lora_ops.cpu).

Products run in float32 (under torch.autocast too) and each output element is rounded once to the weights'
dtype. No autograd graph is recorded (the op owns autograd, whichever backend runs it).
"""
import torch

from lora_ops.cpu import _slot_runs, cpu_kernel, slice_bounds


@cpu_kernel
def lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
    """dx [M, K]: sum over slices of dh[t, i, :rank] @ A[s_t, i, :rank]; zero rows for tokens without one."""
    M, S, R = dh.shape
    L, _, _, K = lora_a.shape
    dx = torch.zeros(M, K, dtype=lora_a.dtype, device=dh.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        if S * r == 0:      # a stack of rank (or slices) 0: no rank row to contract, the zeros stand
            continue
        # The slices are one product over the S * r stacked rank rows: their sum is the contraction.
        a = lora_a[slot, :, :r].float().reshape(S * r, K)
        dx[ids] = (dh[ids, :, :r].reshape(-1, S * r) @ a).to(dx.dtype)
    return dx


@cpu_kernel
def segment_outer(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
    """out [L, P, Q]: out[l, :rank] = u[slot l's tokens, :rank]^T v[slot l's tokens]; zeros elsewhere."""
    M, P = u.shape
    L = rank.shape[0]
    out = torch.zeros(L, P, v.shape[1], dtype=v.dtype, device=v.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, P)
        out[slot, :r] = (u[ids, :r].T @ v[ids].float()).to(out.dtype)
    return out


@cpu_kernel
def lora_grad_h(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """dh [M, S, R] float32: dh[t, i, :r] = scale * grad_out[t, slice i] @ B[s_t, slice i, :r]; zeros elsewhere."""
    M = grad_out.shape[0]
    L, _, R = lora_b.shape
    dh = torch.zeros(M, len(slice_widths), R, dtype=torch.float32, device=grad_out.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        g = grad_out[ids].float()
        for i, (lo, hi) in enumerate(slice_bounds(slice_widths)):
            dh[ids, i, :r] = (g[:, lo:hi] @ lora_b[slot, lo:hi, :r].float()) * scale[slot]
    return dh


@cpu_kernel
def lora_grad_a(dh, x, rank, sorted_token_ids, slot_starts, slot_counts):
    """dA [L, S, R, K]: dA[l, i, :r] = dh[slot l's tokens, i, :r]^T x[slot l's tokens]; zeros elsewhere."""
    M, S, R = dh.shape
    L = rank.shape[0]
    out = torch.zeros(L, S, R, x.shape[1], dtype=x.dtype, device=x.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        out[slot, :, :r] = (dh[ids, :, :r].permute(1, 2, 0) @ x[ids].float()).to(out.dtype)
    return out


@cpu_kernel
def lora_grad_b(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """dB [L, N, R]: dB[l, slice i, :r] = grad_out[slot l's tokens, slice i]^T h[slot l's tokens, i, :r]."""
    M, S, R = h.shape
    L = rank.shape[0]
    out = torch.zeros(L, grad_out.shape[1], R, dtype=grad_out.dtype, device=grad_out.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
        g = grad_out[ids].float()
        for i, (lo, hi) in enumerate(slice_bounds(slice_widths)):
            out[slot, lo:hi, :r] = (g[:, lo:hi].T @ h[ids, i, :r]).to(out.dtype)
    return out
