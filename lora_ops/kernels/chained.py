"""add_lora_ in one launch that is still parallel over K: split-K shrink programs, then expand programs that
wait for them, in one grid.

Two launches cost a launch gap plus the expand's first round trips (token ids, y, B) after the shrink has
ended; the one-launch kernel of kernels.fused recomputes h in every column block, serially over K. Here the
grid holds both programs of the two-launch path. Programs take tickets in the order they start (an atomic
counter), not their program ids: tickets below the shrink's program count run shrink programs, the rest
expand programs. A program only takes a ticket once it is running, so every shrink ticket belongs to a
running program that waits for nothing: the expand programs' spin always ends, whatever order or how few at
a time the hardware runs programs (no co-residency assumption). Expand programs issue their first y loads,
then wait for the shrink count, then read the partial sums.

The three int32 counters (tickets, shrinks done, expands done) start at zero and the last expand program
puts them back to zero, so one buffer serves launch after launch, CUDA-graph replays included, as long as
launches sharing it run one after another (one stream).
"""
import triton
import triton.language as tl

from lora_ops.kernels.expand import expand_program
from lora_ops.kernels.shrink import shrink_program


@triton.jit(do_not_specialize=["M", "split_k"])
def chained_add_lora_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, part_ptr, sync_ptr, scale_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr,
    slot_counts_ptr,
    M, K, num_slices, num_slots, max_rank, capacity, split_k,
    shrink_cols, shrink_tiles, expand_chunks, expand_tiles,
    stride_xm, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    stride_pk, stride_pm, stride_ps, stride_pr,
    SH_BLOCK_M: tl.constexpr, SH_BLOCK_R: tl.constexpr, SLICE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
    SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr,
    EX_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EX_BLOCK_R: tl.constexpr, N_LOOP: tl.constexpr,
    PART_CHUNK: tl.constexpr, SLOTS_POW2: tl.constexpr, RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, H_PRECISION: tl.constexpr,
):
    """One program: one shrink program or one expand program, by ticket.

    Pointers: x [M, K]; A [L, S, R, K]; B [L, N, R]; y [M, N] (one dtype); part [split_k, M, S, R] float32
    (each split's partial sums; the expand adds them in split order); sync [3] int32, zeros before the
    launch and after it; scale [L] float32; rank [L] int32; sorted_ids [capacity] int32, slot_starts /
    slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised), K, S slices, L slots, R max rank, capacity, split_k (run time).
    shrink_cols x shrink_tiles x split_k shrink programs (kernels.shrink's grid), then expand_chunks x
    expand_tiles expand programs (kernels.expand's grid, one rank block: R <= EX_BLOCK_R).
    Strides: every dimension of x, A, B, y and part, in elements.
    SH_*, SLICE_GROUP, BLOCK_K: the shrink's tiles; SLICE_COLS, SLICE_CHUNKS, EX_*, BLOCK_N, N_LOOP,
    PART_CHUNK: the expand's (kernels.expand); RANK_ALIGN, DOT_PRECISION, H_PRECISION as there.
    Grid: (shrink programs + expand programs,).
    """
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    shrinks = shrink_cols * shrink_tiles * split_k
    if ticket < shrinks:
        shrink_program(
            ticket % shrink_cols, (ticket // shrink_cols) % shrink_tiles, ticket // (shrink_cols * shrink_tiles),
            x_ptr, a_ptr, part_ptr, part_ptr, sorted_ids_ptr, scale_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr,
            slot_counts_ptr, M, K, num_slices, num_slots, max_rank, capacity, split_k,
            stride_xm, stride_xk, stride_al, stride_as, stride_ar, stride_ak, stride_pm, stride_ps, stride_pr,
            stride_pk, stride_pm, stride_ps, stride_pr,
            SH_BLOCK_M, SH_BLOCK_R, SLICE_GROUP, BLOCK_K, True, True, SLOTS_POW2, DOT_PRECISION)
        tl.debug_barrier()  # every thread's partial sums are stored before the release below
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        e = ticket - shrinks
        expand_program(
            e % expand_chunks, e // expand_chunks,
            part_ptr, b_ptr, y_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
            M, num_slots, max_rank, capacity, split_k,
            stride_pk, stride_pm, stride_ps, stride_pr, stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
            sync_ptr + 1, shrinks,
            SLICE_COLS, SLICE_CHUNKS, EX_BLOCK_M, BLOCK_N, EX_BLOCK_R, N_LOOP, True, PART_CHUNK, SLOTS_POW2,
            RANK_ALIGN, H_PRECISION, True)
        tl.debug_barrier()
        finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel")
        if finished == expand_chunks * expand_tiles - 1:  # the last program: every ticket is taken
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed")
