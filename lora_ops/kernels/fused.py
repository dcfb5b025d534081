"""One-launch add_lora_ for small batches: each program computes its tile's h itself, then adds h @ B^T.

At decode sizes the two-launch path (shrink, then expand) is bound by latency, not bytes: every launch
pays its start plus a chain of dependent memory round trips (counts -> token ids -> operands -> store),
and split-K adds a partial-sum round. Here the chain is walked once. The price is redundancy: every
column block of a slice recomputes its token tile's h over all of K, so the bytes read per program are
about (BLOCK_M + rank) * K; the config layer uses this path only where that stays small (small token
buckets, modest rank * K), and the tuner measures the crossover.
"""
import triton
import triton.language as tl

from lora_ops.kernels.work import dot_f32_lhs, find_slice_block, find_slot_tile, load_tile_tokens, rank_ceil


@triton.jit(do_not_specialize=["M"])
def fused_add_lora_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, scale_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, K, num_slots, max_rank, capacity,
    stride_xm, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    stride_scale, stride_rank, stride_ids, stride_starts, stride_counts,
    SLICE_COLS: tl.constexpr, SLICE_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SLOTS_POW2: tl.constexpr, RANK_ALIGN: tl.constexpr, DOT_PRECISION: tl.constexpr, H_PRECISION: tl.constexpr,
):
    """One program: one token tile of one slot times one BLOCK_N block of one output slice, all of K.

    Pointers: x [M, K] (fp16/bf16/fp32); A [L, S, R, K] and B [L, N, R] (x's dtype); y [M, N] (x's
    dtype), read and written once per element; scale [L] float32; rank [L] int32; sorted_ids [capacity]
    int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised), K features, num_slots L, max_rank R (ranks clamped to [0, R]),
    capacity of sorted_ids.
    Strides: every dimension of x, A, B and y, and of the 1-D scale, rank, sorted_ids, slot_starts and
    slot_counts (stride_scale .. stride_counts), in elements.
    SLICE_COLS / SLICE_BLOCKS: the output slices' column offsets and first column blocks, S + 1 each
    (kernels.work.find_slice_block).
    Grid: (total column blocks, token-tile bound). For each BLOCK_R block of the slot's rank, the program
    forms h = scale * x_tile A^T in float32 over all of K, then adds h @ B_block^T; rank blocks at or past
    the slot's rank are never read.
    DOT_PRECISION: the x.A dot ("ieee" for float32 inputs); H_PRECISION: how the float32 h meets B
    (kernels.work.dot_f32_lhs), as in the two-launch path, so both paths round alike.
    RANK_ALIGN: a power of two dividing R (kernels.work.rank_ceil: B's rank columns load in vectors).
    Writes y only at valid tokens and existing columns; rows of other slots and of slot -1 are untouched.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_n >= SLICE_BLOCKS[len(SLICE_BLOCKS) - 1]:
        return
    slice_id, offs_n, n_ok = find_slice_block(pid_n, SLICE_COLS, SLICE_BLOCKS, BLOCK_N)
    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2, False, stride_counts,
                                                  stride_starts, stride_rank)
    if rank == 0:
        return
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)

    # y is the bulk of the bytes: issue its load first so it is in flight during the K loop.
    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
    mask = valid[:, None] & n_ok[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + slot * stride_scale)

    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * stride_xm
    a_slice = a_ptr + slot.to(tl.int64) * stride_al + slice_id.to(tl.int64) * stride_as
    b_cols = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn
    rank_in = rank_ceil(rank, RANK_ALIGN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + offs_r
        r_ok = rs < rank
        a_cols = a_slice + rs[None, :].to(tl.int64) * stride_ar
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + offs_k
            k_ok = ks < K
            xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + ks[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            h = tl.dot(xt, at, h, input_precision=DOT_PRECISION)
        h = h * scale
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=(rs < rank_in)[:, None] & n_ok[None, :], other=0.0)
        acc = dot_f32_lhs(h, tl.where(r_ok[:, None], bt, 0.0), acc, H_PRECISION)

    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
