"""The public functional API over the ops (one op call each; metadata built here only on request)."""
import torch

from lora_ops.batch import BatchMeta, LoRABatch, build_batch_meta


def _meta(x, lora_a, token_slots, batch):
    if (token_slots is None) == (batch is None):
        raise ValueError("token_slots / batch: pass exactly one of them (per-token slots, or the metadata "
                         "built from them by LoRABatch.update / build_batch_meta)")
    if batch is None:
        return build_batch_meta(token_slots, lora_a.shape[0])
    if isinstance(batch, LoRABatch):
        return batch.meta
    if isinstance(batch, BatchMeta):
        return batch
    raise TypeError(f"batch: expected a LoRABatch or BatchMeta, got {type(batch).__name__}")


def add_lora(y, x, lora_a, lora_b, scale, rank, *, token_slots=None, batch=None, slice_widths=None):
    """y += the LoRA delta of every token's adapter slot, in place; returns y.

    x [M, K]; y [M, N]; lora_a [L, S, R, K]; lora_b [L, N, R]; scale [L] float32; rank [L] int32;
    slice_widths: S widths summing to N (default: one slice [N]); token_slots [M] int32/int64 in
    [-1, L) (-1: no adapter), or batch: the metadata built from them.
    """
    meta = _meta(x, lora_a, token_slots, batch)
    widths = [y.shape[1]] if slice_widths is None else [int(w) for w in slice_widths]
    torch.ops.lora_ops.add_lora_(y, x, lora_a, lora_b, scale, rank, widths, *meta)
    return y


def shrink(x, lora_a, scale, rank, *, token_slots=None, batch=None):
    """h [M, S, R] float32 = scale * x A^T at each token's slot and rank (zero elsewhere)."""
    meta = _meta(x, lora_a, token_slots, batch)
    return torch.ops.lora_ops.shrink(x, lora_a, scale, rank, *meta)


def expand(y, h, lora_b, rank, *, token_slots=None, batch=None, slice_widths=None):
    """y[:, slice i] += h[:, i, :rank] @ B[slot, slice i, :rank]^T, in place; returns y."""
    meta = _meta(h, lora_b, token_slots, batch)
    widths = [y.shape[1]] if slice_widths is None else [int(w) for w in slice_widths]
    torch.ops.lora_ops.expand_(y, h, lora_b, widths, rank, *meta)
    return y
