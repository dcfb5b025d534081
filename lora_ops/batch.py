"""Per-batch metadata: which tokens use which adapter slot, built once per step and read by every layer.

From per-token slots (``-1`` = no adapter) we build, with no host synchronisation:

    sorted_token_ids [T] int32   token ids grouped by slot (a stable sort; 'no adapter' last)
    slot_counts      [L+1] int32 tokens per slot; entry L counts the tokens with no adapter
    slot_starts      [L+1] int32 where each slot's run starts in sorted_token_ids

Counts come from ``scatter_add_`` into a fixed-size buffer (never ``bincount``/``unique``/``nonzero``,
whose output sizes depend on data). The kernels derive their work list (slot, token tile) from
``slot_counts`` themselves, so one metadata serves kernels of any tile size. On a GPU the same metadata
comes from one Triton launch (a counting sort in one program, lora_ops.kernels.batch) instead of those
dozen torch ops, where the kernel serves the shape (:func:`set_one_launch_fill`).

:class:`LoRABatch` owns buffers allocated once at a capacity and refills them in place, so a captured
CUDA graph replays with new batches and a compiled model sees the same tensors every step.
"""
import os
from typing import NamedTuple

import torch

SLOT_DTYPES = (torch.int32, torch.int64)
# The one-launch fill (lora_ops.kernels.batch): None = on GPUs (the default), True = also CPU tensors under the
# Triton CPU backend (the interpreter), False = never. See set_one_launch_fill.
_one_launch = [{"1": True, "0": False}.get(os.environ.get("LORA_OPS_ONE_LAUNCH_FILL", ""))]


def set_one_launch_fill(on):
    """Whether a batch's metadata is filled by one launch of lora_ops.kernels.batch, where it serves the batch's
    shape (lora_ops.launch_batch.fits), instead of the torch path's dozen small launches. The same metadata bit
    for bit either way (tests/test_batch.py).

    ``None`` (the default): on CUDA tensors, for batches of a few steps of the kernel (launch_batch.
    DEFAULT_MAX_STEPS: 4 slots up to 16384 tokens, 64 slots up to 1024: where its GPU time stays under the
    torch path's). ``True``: wherever it fits
    (launch_batch.MAX_STEPS), CPU tensors under ``ops.set_cpu_backend("triton")`` (Triton's interpreter)
    too. ``False``: the torch path everywhere. ``LORA_OPS_ONE_LAUNCH_FILL=1`` / ``=0`` sets
    True / False at import. Under torch.compile's tracing the torch path serves (it traces; a Triton launch
    outside a registered op would not).

    Why the default: a server fills the next batch's metadata on the host between steps, and every launch
    costs host time there. H100, torch 2.11, Triton 3.6 (2026-12-05, benchmarks/bench_decode.py --stack-a:
    set_token_slots from the host, the step's CUDA-graph replay, a synchronize; 4 Llama-3-8B blocks, 64
    tokens): the step with LoRA took 1.85 / 1.83 (ranks 16 / 64) of the step without by the torch path, 1.25 /
    1.32 by one launch (1433 -> 954 us a step at rank 16)."""
    if on not in (None, True, False):
        raise ValueError(f"set_one_launch_fill: expected None, True or False, got {on!r}")
    _one_launch[0] = on


def _launch_batch(device, num_tokens, max_loras):
    """lora_ops.launch_batch where the one-launch fill serves this call, else None (imported only then:
    it imports Triton, which a CPU-only install lacks)."""
    on = _one_launch[0]
    if on is False:
        return None
    if device.type != "cuda":
        from lora_ops import ops
        if not on or device.type != "cpu" or ops.get_cpu_backend() != "triton":
            return None
        ops._check_interpreter()
    if torch.compiler.is_compiling():
        return None
    from lora_ops import launch_batch
    max_steps = launch_batch.MAX_STEPS if on else launch_batch.DEFAULT_MAX_STEPS
    return launch_batch if launch_batch.fits(num_tokens, max_loras, max_steps) else None


class BatchMeta(NamedTuple):
    """The three tensors every op takes (see lora_ops.batch)."""
    sorted_token_ids: torch.Tensor
    slot_starts: torch.Tensor
    slot_counts: torch.Tensor


def check_token_slots(token_slots, max_loras, max_tokens=None, device=None):
    """Shape and dtype always; the device, where ``device`` is given: that one or the CPU (host slots are
    copied over); the range [-1, max_loras) only for CPU tensors (no device sync), eagerly.

    On a GPU an out-of-range slot is treated as 'no adapter' (see :func:`fill_batch_meta`), so no value
    can make a kernel read or write out of bounds.
    """
    if not isinstance(token_slots, torch.Tensor):
        raise TypeError(f"token_slots: expected a torch.Tensor of per-token slots, got {type(token_slots).__name__}")
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots: expected a 1-D tensor [M], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in SLOT_DTYPES:
        raise TypeError(f"token_slots: expected dtype int32 or int64, got {token_slots.dtype}")
    if device is not None and token_slots.device != torch.device(device) and token_slots.device.type != "cpu":
        where = "the CPU" if torch.device(device).type == "cpu" else f"{torch.device(device)} or the CPU"
        raise ValueError(f"token_slots: expected a tensor on {where}, got one on {token_slots.device}")
    if max_tokens is not None and token_slots.shape[0] > max_tokens:
        raise ValueError(f"token_slots: {token_slots.shape[0]} tokens exceed the batch capacity "
                         f"max_tokens={max_tokens}")
    # (Not while compiling: the values are data there, and reading them broke the graph on a host sync; a
    # slot out of range is served no adapter, as on a GPU.)
    if not torch.compiler.is_compiling() and token_slots.device.type == "cpu" and token_slots.numel():
        i = first_outside(token_slots, -1, max_loras)
        if i is not None:
            raise ValueError(f"token_slots: slot {int(token_slots[i])} at token {i} is outside "
                             f"[-1, max_loras={max_loras})")


def first_outside(values, low, high):
    """The index of the first entry of the non-empty 1-D CPU tensor ``values`` outside [low, high), or None:
    one aminmax when all are inside (a server's host pays the token slots' check every step)."""
    lowest, highest = torch.aminmax(values)
    if int(lowest) >= low and int(highest) < high:
        return None
    return int(((values < low) | (values >= high)).to(torch.uint8).argmax())


def _slot_keys(token_slots, max_loras):
    """Each token's bucket, int64: its slot, or L ('no adapter') for -1 and for any slot out of range (safe on the
    GPU, where it cannot be checked)."""
    slots = token_slots.long()
    return torch.where((slots >= 0) & (slots < max_loras), slots, max_loras)


def fill_batch_meta(token_slots, max_loras, sorted_token_ids, slot_starts, slot_counts, ones, slots_out=None):
    """Refill the metadata buffers in place from ``token_slots`` [M] (on their device, no sync).

    ``ones`` is an int32 buffer of at least M ones (the scatter source), allocated once by the caller.
    ``slots_out``: an int32 buffer of at least M entries on the buffers' device that also receives the slots,
    each outside [0, L) as -1 (a LoRAContext's per-token slots: unlike a copy into int32, an int64 slot past
    int32's range does not wrap into one in range). It may be ``token_slots`` itself.
    """
    M = token_slots.shape[0]
    one_launch = _launch_batch(slot_counts.device, M, max_loras)
    if one_launch is not None:
        slots = token_slots.to(device=slot_counts.device, non_blocking=True)
        one_launch.fill_batch_meta(slots, max_loras, sorted_token_ids, slot_starts, slot_counts,
                                   None if slots_out is None else slots_out[:M])
        # The torch ops below bump the buffers' version counters, and autograd refuses a backward whose
        # saved metadata was refilled since (lora_ops.autograd): a kernel's writes must say so too.
        for t in (sorted_token_ids, slot_starts, slot_counts, slots_out):
            if t is not None and not t.is_inference():    # (inference tensors have no version counter)
                torch.autograd.graph.increment_version(t)
        return
    keys = _slot_keys(token_slots.to(device=slot_counts.device, dtype=torch.int64, non_blocking=True), max_loras)
    if slots_out is not None:
        slots_out[:M].copy_(torch.where(keys < max_loras, keys, -1))
    sorted_token_ids[:M].copy_(torch.argsort(keys, stable=True))
    slot_counts.zero_()
    slot_counts.scatter_add_(0, keys, ones[:M])
    torch.cumsum(slot_counts, 0, out=slot_starts)
    slot_starts.sub_(slot_counts)


class LoRABatch:
    """Batch metadata in buffers allocated once at ``max_tokens`` / ``max_loras + 1``.

    ``update(token_slots)`` refills them in place and returns the :class:`BatchMeta` view every layer
    reads; the tensors (and their data pointers) never change.
    """

    def __init__(self, max_tokens, max_loras, device=None):
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(f"LoRABatch: expected max_tokens >= 1 and max_loras >= 1, got {max_tokens}, {max_loras}")
        self.max_tokens = int(max_tokens)
        self.max_loras = int(max_loras)
        kw = dict(dtype=torch.int32, device=device)
        self._own(BatchMeta(
            sorted_token_ids=torch.zeros(self.max_tokens, **kw),
            slot_starts=torch.zeros(self.max_loras + 1, **kw),
            slot_counts=torch.zeros(self.max_loras + 1, **kw),
        ))
        self._ones = torch.ones(self.max_tokens, **kw)
        self.num_tokens = 0

    def _own(self, meta):
        """Take ``meta``'s tensors as this batch's buffers; returns them."""
        # Tagged as a batch's own buffers: autograd's batch check tells them from a saved-tensor hook's copy of
        # them, which has no tag (lora_ops.autograd._check_batch; a LoRAContext's copies carry serial numbers).
        meta.sorted_token_ids._lora_batch = 0
        self.meta = meta
        return meta

    def own_copies(self):
        """Copies of the buffers as this batch's own (an unpickled LoRAContext's, where they were in shared
        memory: LoRAContext._own_batch); returns them."""
        return self._own(BatchMeta(*[t.clone() for t in self.meta]))

    @property
    def device(self):
        """The device the metadata buffers live on."""
        return self.meta.slot_counts.device

    def update(self, token_slots):
        """Refill from per-token slots [M] (int32/int64, CPU or on this batch's device)."""
        check_token_slots(token_slots, self.max_loras, self.max_tokens, self.device)
        return self._refill(token_slots)

    def _refill(self, token_slots, slots_out=None):
        """:meth:`update` for slots already checked (a LoRAContext checks them as they arrive: a second check
        would cost a server's host a few µs a step for nothing); ``slots_out`` as :func:`fill_batch_meta`."""
        fill_batch_meta(token_slots, self.max_loras, *self.meta, self._ones, slots_out)
        self.num_tokens = token_slots.shape[0]
        return self.meta


def batch_meta_of(token_slots, max_loras):
    """The metadata of ``token_slots`` [M] (valid slots or -1) in new tensors of M and L + 1 entries, by
    traceable ops only: torch.compile builds ``LoRAContext.per_row``'s batches in the graph with it. The
    values :func:`fill_batch_meta` writes."""
    keys = _slot_keys(token_slots, max_loras)
    counts = torch.zeros(max_loras + 1, dtype=torch.int32, device=token_slots.device)
    counts = counts.scatter_add(0, keys, torch.ones_like(keys, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return BatchMeta(torch.argsort(keys, stable=True).to(torch.int32), starts, counts)


def build_batch_meta(token_slots, max_loras):
    """One-off metadata for ``token_slots`` (allocates; use :class:`LoRABatch` in a serving loop)."""
    check_token_slots(token_slots, max_loras)  # before sizing the buffers from it
    batch = LoRABatch(max(token_slots.shape[0], 1), max_loras, device=token_slots.device)
    return batch.update(token_slots)
