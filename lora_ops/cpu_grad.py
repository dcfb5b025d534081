"""CPU kernels of the backward ops: vectorised torch, one matrix product per used slot (as lora_ops.cpu).

Products run in float32 (under torch.autocast too) and each output element is rounded once to the weights'
dtype. No autograd graph is recorded (the op owns autograd, whichever backend runs it).
"""
import torch

from lora_ops.cpu import _slot_runs, cpu_kernel


@cpu_kernel
def lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
    """dx [M, K]: sum over slices of dh[t, i, :rank] @ A[s_t, i, :rank]; zero rows for tokens without one."""
    M, S, R = dh.shape
    L, _, _, K = lora_a.shape
    dx = torch.zeros(M, K, dtype=lora_a.dtype, device=dh.device)
    for slot, ids, r in _slot_runs(L, rank, sorted_token_ids, slot_starts, slot_counts, M):
        r = min(r, R)
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
