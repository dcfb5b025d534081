"""The readable float64 reference of the LoRA delta (tests and benchmarks check against it).

    y[t] += scale[s_t] * (x[t] A[s_t]^T) B[s_t]^T     per output slice, at slot s_t's own rank;
                                                     rows with s_t = -1 unchanged.
"""
import torch


def lora_delta_reference(x, lora_a, lora_b, scale, rank, token_slots, slice_widths=None):
    """The delta [M, N] in float64 (zero rows for slot -1). Dense gather: small shapes only. Values the ops
    never read (factors past a slot's rank, anything of a slot -1 row) are selected away, never multiplied by
    zero: a NaN or inf there made the reference NaN where the ops are finite."""
    L, S, R, K = lora_a.shape
    slice_widths = list(slice_widths or [lora_b.shape[1]])
    slots = token_slots.long().cpu()
    used = slots >= 0
    s = slots.clamp(min=0)
    within = torch.arange(R) < rank.cpu().long()[:, None]                                     # [L, R]
    a = torch.where(within[:, None, :, None], lora_a.detach().double().cpu(), 0)               # [L, S, R, K]
    b = torch.where(within[:, None, :], lora_b.detach().double().cpu(), 0)                     # [L, N, R]
    h = torch.einsum("mk,msrk->msr", x.detach().double().cpu(), a[s]) * scale.double().cpu()[s][:, None, None]
    h = torch.where(within[s][:, None, :], h, 0)     # (an inf in x times A's zeros past the rank)
    out, col = [], 0
    for i, n in enumerate(slice_widths):
        out.append(torch.einsum("mr,mnr->mn", h[:, i], b[s, col:col + n]))
        col += n
    return torch.where(used[:, None], torch.cat(out, dim=1), 0)


def shrink_reference(x, lora_a, scale, rank, token_slots):
    """h [M, S, R] in float64: scale * x A^T at each slot's rank, zero elsewhere and for slot -1 (selected, as
    in :func:`lora_delta_reference`)."""
    R = lora_a.shape[2]
    slots = token_slots.long().cpu()
    s = slots.clamp(min=0)
    within = torch.arange(R) < rank.cpu().long()[:, None]
    a = torch.where(within[:, None, :, None], lora_a.detach().double().cpu(), 0)
    h = torch.einsum("mk,msrk->msr", x.detach().double().cpu(), a[s]) * scale.double().cpu()[s][:, None, None]
    return torch.where((slots >= 0)[:, None, None] & within[s][:, None, :], h, 0)


def lora_forward_reference(y, x, lora_a, lora_b, scale, rank, token_slots, slice_widths=None, dtype=torch.float64):
    """y + delta in float64, differentiable in y, x, lora_a and lora_b (the gradient reference).

    Grouped per slot (float64 products over each slot's tokens only, no dense [M, R, K] gather), on the
    tensors' own device, so it serves the GPU check at real shapes too. Reads slots and ranks on the host.
    ``dtype``: float32 for a fast check where float64 is slow (the tuner's, on GPUs with little float64).
    """
    return _add_slot_products(y, _slot_h(x, lora_a, scale, dtype), lora_b, rank, token_slots, slice_widths, dtype)


def shrink_grouped_reference(x, lora_a, scale, rank, token_slots, dtype=torch.float64):
    """:func:`shrink_reference` grouped per slot on x's device (real shapes: the tuner's check)."""
    L, S, R, K = lora_a.shape
    slot_h = _slot_h(x, lora_a, scale, dtype)
    out = torch.zeros(x.shape[0], S, R, dtype=dtype, device=x.device)
    for slot, ids, r in _slot_groups(token_slots, rank, R, x.device):
        out[ids, :, :r] = slot_h(slot, ids, r)
    return out


def expand_forward_reference(y, h, lora_b, rank, token_slots, slice_widths=None, dtype=torch.float64):
    """y + h B^T in float64 (h [M, S, R] given: what the expand alone adds), grouped per slot on the
    tensors' own device like :func:`lora_forward_reference`."""
    return _add_slot_products(y, lambda slot, ids, r: h[ids, :, :r].to(dtype), lora_b, rank, token_slots,
                              slice_widths, dtype)


def _slot_groups(token_slots, rank, max_rank, device):
    """(slot, its token ids on ``device``, its rank) for each slot holding tokens and a rank above 0."""
    slots = token_slots.to(device).long()
    for slot, r in enumerate(rank.tolist()):
        ids = (slots == slot).nonzero().squeeze(1)
        r = min(max(int(r), 0), max_rank)
        if r and ids.numel():
            yield slot, ids, r


def _slot_h(x, lora_a, scale, dtype):
    """slot_h(slot, ids, r): scale[slot] * x[ids] A[slot, :, :r]^T, [m, S, r] in ``dtype``."""
    scales = scale.to(dtype)
    return lambda slot, ids, r: torch.einsum("mk,srk->msr", x[ids].to(dtype), lora_a[slot, :, :r].to(dtype)) \
        * scales[slot]


def _add_slot_products(y, slot_h, lora_b, rank, token_slots, slice_widths, dtype):
    """y (in ``dtype``) plus, per slot with tokens and a rank, slot_h(slot, token ids, rank) [m, S, r] times
    that slot's B per output slice, added at the slot's token rows."""
    L, N, R = lora_b.shape
    slice_widths = list(slice_widths or [N])
    out = y.to(dtype)
    for slot, ids, r in _slot_groups(token_slots, rank, R, y.device):
        h = slot_h(slot, ids, r)
        parts, col = [], 0
        for i, n in enumerate(slice_widths):
            parts.append(h[:, i] @ lora_b[slot, col:col + n, :r].to(dtype).T)
            col += n
        out = out.index_add(0, ids, torch.cat(parts, dim=1))
    return out
