"""Launcher of the batch metadata kernel (lora_ops.kernels.batch): lora_ops.batch.fill_batch_meta's one-launch
path on a GPU, where its torch path is about a dozen small launches (argsort, scatter_add, cumsum, ...)."""
import torch

from lora_ops.configs.heuristics import cdiv, next_power_of_2
from lora_ops.kernels import batch as batch_kernels
from lora_ops.ops import on_other_device
from lora_ops.triton_launch import FastLauncher

BATCH_META = FastLauncher(batch_kernels.batch_meta_kernel)
# A step's one-hot [BLOCK_T, KEYS] int32: at most this many elements (64 registers a thread at 4 warps).
ONE_HOT_ELEMENTS = 8192
MIN_BLOCK_T, MAX_BLOCK_T = 16, 1024
# One program walks the tokens twice, BLOCK_T at a time: past this many steps a pass, the torch path's
# parallel sort serves (e.g. 4 slots: up to 32768 tokens; 64 slots: up to 2048).
MAX_STEPS = 32
# By default (lora_ops.batch.set_one_launch_fill(None)) the kernel serves batches of at most 16 steps a pass
# (4 slots: up to 16384 tokens; 16: 4096; 64: 1024). Its GPU time grows with the steps (one program on one SM,
# BLOCK_T x KEYS a step); the torch path's kernels run in parallel. H100, torch 2.11, Triton 3.6 (session 34,
# benchmarks/results/lab_batch_fill-h100-2026-12-05-session34.md), GPU us one launch / torch: 16 steps
# 91 / 106 (4 slots), 36 / 63 (16), 53 / 55 (64); 32 steps (4 slots, 32768 tokens) 181 / 96. The host time
# saved is 120-170 us at every size.
DEFAULT_MAX_STEPS = 16


def _keys(num_slots):
    return next_power_of_2(num_slots + 1)


def _block_t(num_tokens, num_slots):
    """Tokens a step: as many as the one-hot's budget allows, but no more than the batch's power of two (a
    decode batch of 64 takes one step of 64, not of 1024 lanes mostly masked; one compile per power of two,
    as the other kernels' configs go by token bucket)."""
    widest = max(MIN_BLOCK_T, min(MAX_BLOCK_T, ONE_HOT_ELEMENTS // _keys(num_slots)))
    return min(widest, max(MIN_BLOCK_T, next_power_of_2(num_tokens)))


def fits(num_tokens, num_slots, max_steps=MAX_STEPS):
    """Whether the one-program kernel serves a batch of this many tokens and slots (shapes only), in at most
    ``max_steps`` steps a pass."""
    return (_keys(num_slots) * MIN_BLOCK_T <= ONE_HOT_ELEMENTS
            and cdiv(num_tokens, _block_t(num_tokens, num_slots)) <= max_steps)


def fill_batch_meta(token_slots, num_slots, sorted_token_ids, slot_starts, slot_counts, slots_out=None):
    """The metadata of ``token_slots`` [M] (int32 / int64, on the buffers' device) into the buffers, in one
    launch of one program (grid (1,), whatever the data), on the buffers' GPU. Where :func:`fits` holds.
    ``slots_out``: an int32 [>= M] buffer there that also receives each token's slot, -1 where it lies
    outside [0, L) (lora_ops.batch.fill_batch_meta)."""
    other = on_other_device(slot_counts)
    if other is not None:
        with torch.cuda.device(other):
            return fill_batch_meta(token_slots, num_slots, sorted_token_ids, slot_starts, slot_counts, slots_out)
    write_slots = slots_out is not None
    out = slots_out if write_slots else slot_counts     # (not written without WRITE_SLOTS)
    BATCH_META((1,), (token_slots, sorted_token_ids, slot_starts, slot_counts, out),
               (token_slots.shape[0], num_slots, token_slots.stride(0), sorted_token_ids.stride(0),
                slot_starts.stride(0), slot_counts.stride(0), out.stride(0)),
               BLOCK_T=_block_t(token_slots.shape[0], num_slots), KEYS=_keys(num_slots), WRITE_SLOTS=write_slots,
               num_warps=4)
