"""The readable float64 reference of the LoRA delta (tests and benchmarks check against it).

    y[t] += scale[s_t] * (x[t] A[s_t]^T) B[s_t]^T     per output slice, at slot s_t's own rank;
                                                     rows with s_t = -1 unchanged.
"""
import torch


def lora_delta_reference(x, lora_a, lora_b, scale, rank, token_slots, slice_widths=None):
    """The delta [M, N] in float64 (zero rows for slot -1). Dense gather: small shapes only."""
    L, S, R, K = lora_a.shape
    slice_widths = list(slice_widths or [lora_b.shape[1]])
    slots = token_slots.long().cpu()
    used = slots >= 0
    s = slots.clamp(min=0)
    x64 = x.detach().double().cpu()
    rank_mask = (torch.arange(R) < rank.cpu().long()[:, None]).double()          # [L, R]
    a = lora_a.detach().double().cpu() * rank_mask[:, None, :, None]             # [L, S, R, K]
    h = torch.einsum("mk,msrk->msr", x64, a[s]) * scale.double().cpu()[s][:, None, None]
    b = lora_b.detach().double().cpu() * rank_mask[:, None, :]                   # [L, N, R]
    out, col = [], 0
    for i, n in enumerate(slice_widths):
        out.append(torch.einsum("mr,mnr->mn", h[:, i], b[s, col:col + n]))
        col += n
    return torch.cat(out, dim=1) * used[:, None].double()


def shrink_reference(x, lora_a, scale, rank, token_slots):
    """h [M, S, R] in float64: scale * x A^T at each slot's rank, zero elsewhere and for slot -1."""
    R = lora_a.shape[2]
    slots = token_slots.long().cpu()
    s = slots.clamp(min=0)
    rank_mask = (torch.arange(R) < rank.cpu().long()[:, None]).double()
    a = lora_a.detach().double().cpu() * rank_mask[:, None, :, None]
    h = torch.einsum("mk,msrk->msr", x.detach().double().cpu(), a[s])
    return h * (scale.double().cpu()[s] * (slots >= 0).double())[:, None, None]


def lora_forward_reference(y, x, lora_a, lora_b, scale, rank, token_slots, slice_widths=None):
    """y + delta in float64, differentiable in y, x, lora_a and lora_b (the gradient reference).

    Grouped per slot (float64 products over each slot's tokens only, no dense [M, R, K] gather), on the
    tensors' own device, so it serves the GPU check at real shapes too. Reads slots and ranks on the host.
    """
    L, S, R, K = lora_a.shape
    slice_widths = list(slice_widths or [lora_b.shape[1]])
    slots = token_slots.to(y.device).long()
    ranks = rank.tolist()
    scales = scale.double()
    out = y.double()
    for slot in range(L):
        ids = (slots == slot).nonzero().squeeze(1)
        r = min(max(int(ranks[slot]), 0), R)
        if r == 0 or ids.numel() == 0:
            continue
        h = torch.einsum("mk,srk->msr", x[ids].double(), lora_a[slot, :, :r].double()) * scales[slot]
        parts, col = [], 0
        for i, n in enumerate(slice_widths):
            parts.append(h[:, i] @ lora_b[slot, col:col + n, :r].double().T)
            col += n
        out = out.index_add(0, ids, torch.cat(parts, dim=1))
    return out
