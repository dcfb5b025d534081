"""Launchers of the backward kernels (lora_ops.kernels.grad): validate, pick a config, grid from shapes, launch.

As in lora_ops.launch, grids depend on shapes and capacities only (never on tensor data) and nothing here
reads tensor data on the host, so the backward is CUDA-graph safe and sync-free.
"""
from typing import NamedTuple

import torch

from csrc_meta import checks
from lora_ops.configs.heuristics import (F32_WARPS, TARGET_PROGRAMS, block_m_for, cdiv, feature_block,
                                         max_token_tiles, next_power_of_2, rank_align, rank_block, token_bucket)
from lora_ops import configs, launch, plan
from lora_ops.launch import Launch, Scratch, f32_operand_precision
from lora_ops.kernels import grad as grad_kernels
from lora_ops.triton_launch import FastLauncher

GRAD_X = FastLauncher(grad_kernels.lora_grad_x_kernel)
SEGMENT_OUTER = FastLauncher(grad_kernels.segment_outer_kernel)
TRANSPOSE = FastLauncher(grad_kernels.transpose_rank_kernel)
# transpose_rank_kernel's features a program (its ranks a step: rank_block's).
TRANSPOSE_BLOCK_N = 64


class GradXConfig(NamedTuple):
    block_m: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    n_loop: int = 1        # column blocks one program walks (kernels.grad.lora_grad_x_kernel's N_LOOP)
    one_rank_block: bool = False   # the tile's dh, all slices, split once for its blocks (kernel's ONE_RANK_BLOCK)


class SegmentOuterConfig(NamedTuple):
    block_t: int
    block_p: int
    block_q: int
    num_warps: int
    num_stages: int


# From the 1024-token bucket (257 tokens on) a program of lora_grad_x walks up to 8 column blocks (the widest
# power of two leaving at least this many programs): with one slice and one rank block a program of one block
# is a single dot between its tile search and its store (Llama down r64 at 4096 tokens: 7616 such programs,
# 4.6x the bytes floor). H100, 4096 tokens, Llama-3-8B, ranks 16 / 64 (docs/DESIGN.md §4 "The backward's
# configs"): 0.77-0.96 of one block's time on 7 of 8 rows (down r64 174.5 -> 134.6 µs), gate_up r16 1.08-1.19x.
# At 1024 tokens (which this leaves at 1) 2 blocks measured 0.86-0.98 of one.
GRAD_X_LOOP_MIN_BUCKET = 1024
GRAD_X_MIN_PROGRAMS = 1024
GRAD_X_MAX_N_LOOP = 8
# From the same bucket, where the whole rank fits one block and every slice's block side by side at most
# GRAD_X_MAX_HELD_COLUMNS columns, lora_grad_x takes its ONE_RANK_BLOCK path (the tile's dh loaded and split
# once for all its column blocks) on the same tiles. H100, session 41 (Llama-3-8B and Phi-4-mini, ranks 16 /
# 64, 1024 / 4096 tokens, benchmarks/lab_train_ops.py): paired as shipped 0.63-0.99 of the time before, geomean
# 0.80 over 28 rows. Three slices at rank 64 (4 x 64 columns held) gained nothing at best (0.96-1.05) and
# 1.6-2x on 8 warps; 8 warps lost on every row (geomean 1.05-1.37 by tile). Not measured: 257-1023 tokens, and
# held columns that pad (three slices at ranks 17-32, five to eight at rank 16).
GRAD_X_MAX_HELD_COLUMNS = 128
# Whether the heuristic takes that path (a switch for the lab's A/B, benchmarks/lab_train_ops.py).
GRAD_X_HOLDS_DH = True
# The op's dx: every row written by the kernel, zeros where a token has no delta (launch_lora_grad_x's write_all),
# not zero-filled first (an M x K write as large as the kernel's own stores) with the kernel writing the adapted
# rows only (DESIGN §4, "dx written whole"). False: as before (benchmarks/lab_train_ops.py AB_GRAD_X_FILL=1 times
# both).
GRAD_X_WRITES_ALL = True


def grad_x_n_loop(bucket, column_blocks, block_m):
    if bucket < GRAD_X_LOOP_MIN_BUCKET:
        return 1
    n_loop = GRAD_X_MAX_N_LOOP
    while n_loop > 1 and cdiv(column_blocks, n_loop) * cdiv(bucket, block_m) < GRAD_X_MIN_PROGRAMS:
        n_loop //= 2
    return n_loop


def grad_x_config(num_tokens, in_features, max_rank, num_slices, float32_gpu=False, float16_gpu=False):
    """``float32_gpu``: float32 on a GPU, whose IEEE dots spill in these tiles (heuristics.float32_tiles):
    32-wide rank steps and column blocks, 8 warps. From the 1024-token bucket (257 tokens on), where the whole
    rank fits one block and the slices' blocks side by side fit :data:`GRAD_X_MAX_HELD_COLUMNS`, the same tile
    on the ONE_RANK_BLOCK path (not for float16 on a GPU: its TF32 products there were checked, not timed)."""
    bucket = token_bucket(num_tokens)
    block_m = block_m_for(bucket)
    block_n = feature_block(in_features)
    block_r = rank_block(max_rank)
    if float32_gpu:
        return GradXConfig(block_m, min(block_n, 32), min(block_r, 32), num_warps=F32_WARPS, num_stages=2)
    holds_dh = (GRAD_X_HOLDS_DH and not float16_gpu and bucket >= GRAD_X_LOOP_MIN_BUCKET
                and one_rank_block_fits(max_rank, block_r, num_slices))
    return GradXConfig(block_m, block_n, block_r, num_warps=4, num_stages=2,
                       n_loop=grad_x_n_loop(bucket, cdiv(in_features, block_n), block_m), one_rank_block=holds_dh)


def one_rank_block_fits(max_rank, block_r, num_slices):
    """Whether the heuristic gives lora_grad_x's ONE_RANK_BLOCK path this stack: the whole rank in one block,
    and every slice's block side by side at most :data:`GRAD_X_MAX_HELD_COLUMNS` wide (where it was measured
    to gain; the kernel itself needs only the first)."""
    return max_rank <= block_r and next_power_of_2(num_slices) * block_r <= GRAD_X_MAX_HELD_COLUMNS


def takes_float32_tiles(t):
    """Whether a backward launch on ``t``'s dtype and device takes float32's GPU tiles (grad_x_config)."""
    return t.dtype is torch.float32 and t.is_cuda


def float16_on_gpu(t):
    """Whether ``t`` is float16 on a GPU (segment_outer_config's ``float16_gpu``)."""
    return t.dtype is torch.float16 and t.is_cuda


# H200, 4 slots, rank 64, 4096 tokens (2026-12-02): dA (Q = 4096) took 28 µs with 128-wide Q blocks (128
# programs) against 39 µs narrowed to 64 (256 programs); dB of a gate_up slice (Q = 14336) 69 µs with
# 32-token steps and 3 stages against 84 µs with 64 and 2.
WIDE_Q = 8192


# From the 1024-token bucket (257 tokens on) a small grid of them (each program walks a whole slot's tokens)
# takes 128-token steps on 8 warps, 3 stages: up to this many programs of 128 columns, and up to twice as many
# with 16-wide rank blocks (smaller buckets, not measured: the narrowed blocks as before). On an H100
# (2026-12-06, benchmarks/results/lab-train-ops-h100-2026-12-06-session40.md; Llama-3-8B and Phi-4-mini, ranks
# 16 and 64, 1024 and 4096 tokens) that took dA and dB to 0.71-0.99 of the time of the narrowed Q blocks on
# the rows it picks (o and down's dB, o's dA, rank 16's gate_up dA), at worst 1.04; on larger grids it lost
# (up to 1.6x: qkv and gate_up at rank 64).
DEEP_STEP_MAX_PROGRAMS = 128
DEEP_STEP = dict(block_t=128, num_warps=8, num_stages=3)
DEEP_STEP_MIN_BUCKET = 1024


def segment_outer_config(p, q, num_slots, float32_gpu=False, num_tokens=0, float16_gpu=False):
    """Narrow the Q blocks while the grid holds fewer than half of TARGET_PROGRAMS programs: each program
    reduces a whole slot's tokens. From the 1024-token bucket of ``num_tokens``, where the grid of 128-column
    blocks is small (DEEP_STEP_MAX_PROGRAMS), deeper token steps instead, but not for float32 or float16 on a
    GPU (``float16_gpu``: there the deep steps compile to a pipelined wgmma reading its widened float16 operand
    from registers, the pattern that raced in session 20, docs/DESIGN.md §4; bf16's reads shared memory).
    ``float32_gpu``: as grad_x_config's (16-wide rank blocks, 64-wide Q blocks at most, 32-token steps, 8
    warps)."""
    block_p = min(rank_block(p), 16) if float32_gpu else rank_block(p)
    block_q = min(feature_block(q), 64) if float32_gpu else feature_block(q)

    def programs(block_q):
        return cdiv(q, block_q) * cdiv(p, block_p) * num_slots
    if (not (float32_gpu or float16_gpu) and block_q == 128 and token_bucket(num_tokens) >= DEEP_STEP_MIN_BUCKET
            and programs(block_q) <= DEEP_STEP_MAX_PROGRAMS * (2 if block_p == 16 else 1)):
        return SegmentOuterConfig(block_p=block_p, block_q=block_q, **DEEP_STEP)
    while block_q > 32 and programs(block_q) < TARGET_PROGRAMS // 2:
        block_q //= 2
    if float32_gpu:
        return SegmentOuterConfig(block_t=32, block_p=block_p, block_q=block_q, num_warps=F32_WARPS, num_stages=2)
    if q >= WIDE_Q:
        return SegmentOuterConfig(block_t=32, block_p=block_p, block_q=block_q, num_warps=4, num_stages=3)
    return SegmentOuterConfig(block_t=64, block_p=block_p, block_q=block_q, num_warps=4, num_stages=2)


def launch_lora_grad_x(dx, dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts, cfg, run=True,
                       write_all=False):
    """dx[valid tokens] = sum_i dh[:, i] @ A[slot, i] (written, not added); dh [M, S, R] float32.
    ``write_all``: the rows of tokens without a delta get zeros too (every row the metadata names is written);
    otherwise they keep what dx held. Returns the :class:`lora_ops.launch.Launch`, run unless ``run`` is
    False."""
    M, K = dx.shape
    L, S, R, _ = lora_a.shape
    dh, lora_a = launch.addressable(dh), launch.addressable(lora_a)
    if cfg.one_rank_block and R > cfg.block_r:   # (the held-column cap is the heuristic's choice, not a bound)
        raise ValueError(f"lora_grad_x: a one-rank-block config needs the rank ({R}) within block_r "
                         f"({cfg.block_r})")
    grid = (cdiv(cdiv(K, cfg.block_n), cfg.n_loop), max_token_tiles(M, L, cfg.block_m))   # (group L's too)
    return Launch(
        GRAD_X, grid, (dh, lora_a, dx, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, K, L, R, sorted_token_ids.shape[0], *dh.stride(), *lora_a.stride(), *dx.stride(),
         *plan.strides_1d(rank, sorted_token_ids, slot_starts, slot_counts)),
        dict(NUM_SLICES=S, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
             SLOTS_POW2=next_power_of_2(L), RANK_ALIGN=rank_align(R),
             H_PRECISION=f32_operand_precision(lora_a.dtype), N_LOOP=cfg.n_loop,
             ONE_RANK_BLOCK=cfg.one_rank_block, SLICES_POW2=next_power_of_2(S), WRITE_ALL=write_all,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ).run_if(run)


def launch_lora_grad_a(out, dh, x, rank, sorted_token_ids, slot_starts, slot_counts, cfg, run=True):
    """out [L, S, R, K] = per slot and slice, the sum of dh[:, i]^T x over the slot's tokens (every element
    written): segment_outer with the slices' rank blocks on grid axis 1. Returns the :class:`Launch`, run
    unless ``run`` is False."""
    M, S, R = dh.shape
    K = x.shape[1]
    L = out.shape[0]
    dh, x = launch.addressable(dh), launch.addressable(x)
    grid = (cdiv(K, cfg.block_q), S * cdiv(R, cfg.block_p), L)
    return Launch(
        SEGMENT_OUTER, grid, (dh, x, out, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, R, K, sorted_token_ids.shape[0], dh.stride(0), dh.stride(2), *x.stride(),
         out.stride(0), out.stride(2), out.stride(3),
         *plan.strides_1d(rank, sorted_token_ids, slot_starts, slot_counts), dh.stride(1), out.stride(1)),
        dict(BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, RANK_ALIGN=rank_align(R),
             PRECISION=f32_operand_precision(x.dtype), NUM_SLICES=S,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ).run_if(run, "rank: too many slots for one launch", "axis 1 counts dh's slices' rank blocks, axis 2 the slots",
             "use at most 65535 slots")


def launch_lora_grad_b(out, h, grad_out, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts, cfg,
                       run=True):
    """out [L, N, R] = per slot and slice i, the sum of grad_out[:, slice i]^T h[:, i] over the slot's tokens
    (every element written): segment_outer with the slices' column blocks on grid axis 0, storing dB^T's
    blocks through out's strides. Returns the :class:`Launch`, run unless ``run`` is False."""
    M, N = grad_out.shape
    _, S, R = h.shape
    L = out.shape[0]
    h, grad_out = launch.addressable(h), launch.addressable(grad_out)
    cols, blocks = launch.slice_layout(slice_widths, cfg.block_q)
    grid = (blocks[-1], cdiv(R, cfg.block_p), L)
    return Launch(
        SEGMENT_OUTER, grid, (h, grad_out, out, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, R, N, sorted_token_ids.shape[0], h.stride(0), h.stride(2), *grad_out.stride(),
         out.stride(0), out.stride(2), out.stride(1),
         *plan.strides_1d(rank, sorted_token_ids, slot_starts, slot_counts), h.stride(1), 0),
        dict(BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, RANK_ALIGN=rank_align(R),
             PRECISION=f32_operand_precision(grad_out.dtype), SLICE_COLS=cols, SLICE_BLOCKS=blocks,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ).run_if(run, "rank: too many slots for one launch", "axis 1 counts h's rank blocks, axis 2 the slots",
             "use at most 65535 slots")


def launch_segment_outer(out, u, v, rank, sorted_token_ids, slot_starts, slot_counts, cfg, run=True):
    """out [L, P, Q] = per-slot sums of u^T v over each slot's tokens (every element written).
    Returns the :class:`lora_ops.launch.Launch`, run unless ``run`` is False."""
    M, P = u.shape
    Q = v.shape[1]
    L = out.shape[0]
    u, v = launch.addressable(u), launch.addressable(v)
    grid = (cdiv(Q, cfg.block_q), cdiv(P, cfg.block_p), L)
    return Launch(
        SEGMENT_OUTER, grid, (u, v, out, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, P, Q, sorted_token_ids.shape[0], *u.stride(), *v.stride(), *out.stride(),
         *plan.strides_1d(rank, sorted_token_ids, slot_starts, slot_counts), 0, 0),
        dict(BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, RANK_ALIGN=rank_align(P),
             PRECISION=f32_operand_precision(v.dtype),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ).run_if(run, "rank: too many slots for one launch", "axis 1 counts u's rank blocks, axis 2 the slots",
             "use at most 65535 slots")


# Every backward op goes through its shape key's plan (lora_ops.plan), its output allocated as the plan's
# scratch.

def _planned(name, out_spec, shaped, values, meta, make_launch):
    """A backward op whose one launch writes one output, the plan's scratch (lora_ops.plan): its call's
    tensors are ``shaped`` and then ``meta`` (rank and the batch metadata); the plan's key, ``shaped``'s shapes,
    ``values``, the metadata's length and every 1-D stride; ``make_launch(out)``: the launch, not run, on the
    output allocated from ``out_spec`` (the config resolved in it, on the plan's first call only)."""
    def build():
        out = out_spec.alloc(shaped[0].device)
        return [make_launch(out)], (out_spec,), (out,)
    return plan.run(plan.op_key(name, shaped, *values, meta[1].shape[0], plan.strides_1d(*meta)), (*shaped, *meta),
                    build)[0]


def lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts, checked=True):
    if checked:
        checks.check_lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts)
    M = dh.shape[0]
    K = lora_a.shape[3]
    dx_spec = Scratch((M, K), lora_a.dtype, zero=not GRAD_X_WRITES_ALL)
    if not (M and K):
        return dx_spec.alloc(dh.device)
    meta = (rank, sorted_token_ids, slot_starts, slot_counts)
    _, S, R, _ = lora_a.shape
    return _planned("lora_grad_x", dx_spec, (dh, lora_a), (), meta, lambda dx: launch_lora_grad_x(
        dx, dh, lora_a, *meta, grad_x_config(M, K, R, S, takes_float32_tiles(lora_a), float16_on_gpu(lora_a)),
        run=False, write_all=GRAD_X_WRITES_ALL))


def segment_outer(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.check_segment_outer(u, v, rank, sorted_token_ids, slot_starts, slot_counts)
    L = rank.shape[0]
    P, Q = u.shape[1], v.shape[1]
    out_spec = Scratch((L, P, Q), v.dtype)   # every element written
    if not (L and P and Q):
        return out_spec.alloc(v.device)
    meta = (rank, sorted_token_ids, slot_starts, slot_counts)
    return _planned("segment_outer", out_spec, (u, v), (L,), meta, lambda out: launch_segment_outer(
        out, u, v, *meta, segment_outer_config(P, Q, L, takes_float32_tiles(v), u.shape[0], float16_on_gpu(v)),
        run=False))


# The backward of the delta, every packed slice in one launch per op (lora_ops.autograd): one op call and
# one C launch where a call per slice, and a torch.cat or torch.stack of their outputs, were before.
# checked=False (these, lora_grad_x and launch.shrink): no argument checks, for the backward formula's
# calls, whose arguments are valid by construction (ops.call_trusted).

def lora_grad_h(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                checked=True):
    if checked:
        checks.check_lora_grad_h(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                                 slot_counts)
    M, N = grad_out.shape
    L, _, R = lora_b.shape
    widths = tuple(slice_widths)
    S = len(widths)
    dh_spec = launch.returned_h_spec(M, S, R)
    if M == 0:
        return dh_spec.alloc(grad_out.device)
    a = b_as_shrink_a(lora_b, S)

    def build():
        cfg = configs.shrink_config(M, max(widths), S, R, L, grad_out.device, grad_out.dtype)._replace(slice_group=1)
        shrink, scratch, buffers = launch.shrink_with_scratch(grad_out, a, scale, rank, sorted_token_ids,
                                                              slot_starts, slot_counts, dh_spec, cfg,
                                                              slice_k=launch.slice_layout(widths, 1)[0],
                                                              write_all=launch.SHRINK_WRITES_ALL)
        return [shrink], scratch, buffers
    return plan.run(plan.op_key("lora_grad_h", (grad_out, a), widths, sorted_token_ids.shape[0],
                                plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts)),
                    (grad_out, a, scale, rank, sorted_token_ids, slot_starts, slot_counts), build)[0]


def b_as_shrink_a(lora_b, num_slices):
    """lora_grad_h's shrink operand [L, S, R, N]: every slice's A is B^T (stride 0 between slices), each
    slice's programs reading only its own columns of grad_out and of B^T (launch.launch_shrink's slice_k)."""
    # B^T is copied with the features contiguous, as a forward A lies: read in B's own layout (rank
    # contiguous), the shrink took 1.7-4x the time (H200, gate_up r64 at 4096 tokens: 66-179 µs a slice by
    # config against 40 contiguous; torch's copy of the transposed view 25 µs timed warm). The copy is our
    # kernel (transpose_rank_kernel): torch's took 57 µs there on the H100 (ncu, caches flushed, session 41),
    # more than the shrink; ours 10.
    L, N, R = lora_b.shape
    b_t = torch.empty((L, R, N), dtype=lora_b.dtype, device=lora_b.device)
    if b_t.numel():
        launch_transpose_rank(b_t, lora_b)
    return b_t.unsqueeze(1).expand(L, num_slices, R, N)


def launch_transpose_rank(out, lora_b, run=True):
    """out [L, R, N] = lora_b [L, N, R] transposed (transpose_rank_kernel). Returns the :class:`Launch`, run unless
    ``run`` is False."""
    L, N, R = lora_b.shape
    return Launch(
        TRANSPOSE, (cdiv(N, TRANSPOSE_BLOCK_N), L), (lora_b, out), (N, R, *lora_b.stride(), *out.stride()),
        dict(BLOCK_N=TRANSPOSE_BLOCK_N, BLOCK_R=rank_block(R), num_warps=4, num_stages=2),
    ).run_if(run, too_large="lora_b: too many slots for one call", axes="axis 1 counts the slots",
             remedy="use fewer slots")


def lora_grad_a(dh, x, rank, sorted_token_ids, slot_starts, slot_counts, checked=True):
    if checked:
        checks.check_lora_grad_a(dh, x, rank, sorted_token_ids, slot_starts, slot_counts)
    L = rank.shape[0]
    _, S, R = dh.shape
    K = x.shape[1]
    out_spec = Scratch((L, S, R, K), x.dtype)   # every element written
    if not (L and K):
        return out_spec.alloc(x.device)
    meta = (rank, sorted_token_ids, slot_starts, slot_counts)
    return _planned("lora_grad_a", out_spec, (dh, x), (L,), meta, lambda out: launch_lora_grad_a(
        out, dh, x, *meta, segment_outer_config(R, K, L * S, takes_float32_tiles(x), x.shape[0], float16_on_gpu(x)),
        run=False))


def lora_grad_b(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts, checked=True):
    if checked:
        checks.check_lora_grad_b(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
    L = rank.shape[0]
    N = grad_out.shape[1]
    R = h.shape[2]
    widths = tuple(slice_widths)
    out_spec = Scratch((L, N, R), grad_out.dtype)   # every element written
    if not L:
        return out_spec.alloc(grad_out.device)
    meta = (rank, sorted_token_ids, slot_starts, slot_counts)
    return _planned("lora_grad_b", out_spec, (grad_out, h), (widths, L), meta, lambda out: launch_lora_grad_b(
        out, h, grad_out, rank, widths, *meta[1:],
        segment_outer_config(R, N, L, takes_float32_tiles(grad_out), grad_out.shape[0], float16_on_gpu(grad_out)),
        run=False))
