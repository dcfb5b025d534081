"""Shrink: h[t, i, r] = scale[s_t] * x[t] . A[s_t, i, r], grouped by slot, each slot at its own rank."""
import triton
import triton.language as tl

from lora_ops.kernels.work import (find_slot_tile, gdc_launch_dependents, gdc_wait, load_tile_tokens, rank_ceil,
                                   store_zero_rows)


@triton.jit(do_not_specialize=["M", "split_k", "stride_pk"])
def shrink_kernel(
    x_ptr, a_ptr, h_ptr, part_ptr, arrivals_ptr, scale_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr,
    slot_counts_ptr,
    M, K, num_slices, num_slots, max_rank, capacity, split_k,
    stride_xm, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_hm, stride_hs, stride_hr, stride_hp,
    stride_pk, stride_pm, stride_ps, stride_pr,
    stride_scale, stride_rank, stride_ids, stride_starts, stride_counts,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SLICE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, PARTIALS_OUT: tl.constexpr, SLOTS_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False, H_PLANES: tl.constexpr = 0, RANK_ALIGN: tl.constexpr = 1,
    SLICE_K: tl.constexpr = None, WRITE_ALL: tl.constexpr = False,
):
    """One program: one token tile of one slot, BLOCK_R rank rows of SLICE_GROUP slices, one K split.

    The SLICE_GROUP x BLOCK_R rank rows form the columns of one tl.dot, so a token tile of x is read
    once for all the slices of a packed layer (column j: slice g0 + j // BLOCK_R, rank row r0 + j % BLOCK_R).
    Pointers: x [M, K] (fp16/bf16/fp32); A [L, S, R, K] (x's dtype); h [M, S, R] float32; scale [L]
    float32; rank [L] int32; sorted_ids [capacity] int32, slot_starts / slot_counts [L + 1] int32
    (lora_ops.batch). With SPLIT_K: part [split_k, M, S, R] float32 (each split's partial sums) and
    arrivals [grid0 * grid1] int32 zeros (one arrival counter per (column block, token tile)).
    Sizes: M tokens (not specialised: one compile serves every batch size), K features, num_slices S,
    num_slots L, max_rank R, capacity of sorted_ids, split_k: K is cut into split_k ranges (grid axis 2;
    a run-time value, so changing it does not recompile).
    Strides: every dimension of x, A and h, and of the 1-D scale, rank, sorted_ids, slot_starts and
    slot_counts (stride_scale .. stride_counts), in elements.
    Grid: (cdiv(S, SLICE_GROUP) * cdiv(R, BLOCK_R), token-tile bound, split_k). Programs whose rank block
    starts at or past the slot's rank return at once (with WRITE_ALL, split 0's after storing zeros): padded
    rank blocks are never multiplied.
    Writes h only at valid tokens, existing slices and r < rank; other entries are left as they were (but
    with WRITE_ALL, below).
    SPLIT_K: split_k > 1. Each split stores its partial sums, then counts its arrival; the last split to
    arrive adds the partials in split order and writes h. Sums are therefore deterministic (no float
    atomics): a CUDA-graph replay, a compiled model and eager mode give bit-identical results.
    PARTIALS_OUT (with SPLIT_K): each split stores its partial sums and returns; h is not written and no
    counter is used. The consumer adds the splits in order (the expand kernel does, for add_lora_), which
    saves the counters' zero-fill launch and the last split's extra round trip.
    DOT_PRECISION: "ieee" for float32 inputs (no silent tf32), ignored for 16-bit inputs.
    H_PLANES (1 or 2; 0: h is float32): h is [H_PLANES, M, S, R] in a 16-bit dtype, plane p at stride_hp * p:
    the sum's bf16 terms, hi = bf16(h) and lo = bf16(h - hi), which the expand's rank loop multiplies as
    loaded (kernels.expand.rank_loop). Stored up to the rank rounded up to RANK_ALIGN (a power of two
    dividing R: vector stores; the columns between the rank and it hold zeros, A's rows there being masked).
    PDL (launched with programmatic dependent launch, sm_90+): wait for the previous kernel in the stream
    before reading anything, then let the next kernel (the expand) launch at once: its programs load their
    y and B while this kernel runs, and wait for it before reading h.
    SLICE_K (SLICE_GROUP = 1; None: every slice reads all K features): S + 1 offsets; slice i reads x's and
    A's features [SLICE_K[i], SLICE_K[i + 1]) only, its splits cutting that range. The backward's dh
    (launch_grad.lora_grad_h): x = the output gradient [M, N], A = B^T [L, R, N] for every slice (stride_as
    = 0), each slice over its own output columns, one launch for all of them.
    WRITE_ALL (h float32, not PARTIALS_OUT): every entry of h that a token the metadata names has is written,
    zeros where the token has no delta there (slot -1, a rank-0 slot, ranks past its slot's up to R), so h needs
    no zero fill first: the token tiles also cover the tokens without a delta (kernels.work.find_slot_tile's
    WITH_NONE; heuristics.max_token_tiles bounds their L + 1 groups' tiles too), and their programs, and those
    of rank blocks past the slot's rank, store zeros from split 0. (The shrink op and lora_grad_h return such an
    h.)
    """
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid_sr = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    r_blocks = tl.cdiv(max_rank, BLOCK_R)
    g0 = (pid_sr // r_blocks) * SLICE_GROUP
    r0 = (pid_sr % r_blocks) * BLOCK_R

    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2, WRITE_ALL, stride_counts,
                                                  stride_starts, stride_rank)
    if r0 >= rank:
        if WRITE_ALL and pid_k == 0:   # no delta in this block: zeros
            tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)
            col_slice, col_r, col_exists = block_columns(g0, r0, num_slices, max_rank, BLOCK_R, SLICE_GROUP)
            store_zero_rows(h_ptr, tok, valid, col_slice.to(tl.int64) * stride_hs + col_r * stride_hr, col_exists,
                            stride_hm, BLOCK_M, SLICE_GROUP * BLOCK_R)
        return
    # Issued now, not after the K loop: there it was one more dependent round trip before the store.
    slot_scale = tl.load(scale_ptr + slot * stride_scale)
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)

    col_slice, col_r, col_exists = block_columns(g0, r0, num_slices, max_rank, BLOCK_R, SLICE_GROUP)
    col_ok = (col_slice < num_slices) & (col_r < rank)
    offs_k = tl.arange(0, BLOCK_K)
    k_first = 0
    k_end = K
    if SLICE_K is not None:
        k_end = SLICE_K[1]
        for i in tl.static_range(1, len(SLICE_K) - 1):
            later = g0 >= i
            k_first = tl.where(later, SLICE_K[i], k_first)
            k_end = tl.where(later, SLICE_K[i + 1], k_end)
    k_per_split = tl.cdiv(tl.cdiv(k_end - k_first, split_k), BLOCK_K) * BLOCK_K
    k_lo = k_first + pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, k_end)

    x_rows = x_ptr + tok[:, None] * stride_xm
    a_cols = (a_ptr + slot.to(tl.int64) * stride_al + col_slice[None, :].to(tl.int64) * stride_as
              + col_r[None, :].to(tl.int64) * stride_ar)
    acc = tl.zeros((BLOCK_M, SLICE_GROUP * BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + offs_k
        k_ok = ks < k_hi
        xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_cols + ks[:, None] * stride_ak, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
    acc = acc * slot_scale

    mask = valid[:, None] & col_ok[None, :]
    if SPLIT_K:
        part_off = tok[:, None] * stride_pm + col_slice[None, :] * stride_ps + col_r[None, :] * stride_pr
        tl.store(part_ptr + pid_k * stride_pk + part_off, acc, mask=mask)
        if PARTIALS_OUT:
            return
        # acq_rel: this split's partials are visible to whichever split arrives last.
        arrived = tl.atomic_add(arrivals_ptr + pid_m * tl.num_programs(0) + pid_sr, 1, sem="acq_rel")
        if arrived != split_k - 1:
            return
        acc = tl.zeros((BLOCK_M, SLICE_GROUP * BLOCK_R), dtype=tl.float32)
        for k_split in range(0, split_k):
            acc += tl.load(part_ptr + k_split * stride_pk + part_off, mask=mask, other=0.0, cache_modifier=".cg")
    h_ptrs = h_ptr + tok[:, None] * stride_hm + col_slice[None, :] * stride_hs + col_r[None, :] * stride_hr
    if WRITE_ALL:   # the block's ranks past the slot's too, as zeros (0 * an inf of x would be NaN: not stored)
        tl.store(h_ptrs, tl.where(col_ok[None, :], acc, 0.0), mask=valid[:, None] & col_exists[None, :])
    elif H_PLANES == 0:
        tl.store(h_ptrs, acc, mask=mask)
    else:
        plane_mask = valid[:, None] & ((col_slice < num_slices) & (col_r < rank_ceil(rank, RANK_ALIGN)))[None, :]
        hi = acc.to(h_ptr.dtype.element_ty)
        tl.store(h_ptrs, hi, mask=plane_mask)
        if H_PLANES == 2:
            tl.store(h_ptrs + stride_hp, (acc - hi.to(tl.float32)).to(h_ptr.dtype.element_ty), mask=plane_mask)


@triton.jit
def block_columns(g0, r0, num_slices, max_rank, BLOCK_R: tl.constexpr, SLICE_GROUP: tl.constexpr):
    """A shrink program's SLICE_GROUP * BLOCK_R columns (column j: slice g0 + j // BLOCK_R, rank row
    r0 + j % BLOCK_R) as (slice, rank row, whether that entry of h exists: slice < S and rank row < R)."""
    cols = tl.arange(0, SLICE_GROUP * BLOCK_R)
    col_slice = g0 + cols // BLOCK_R
    col_r = r0 + cols % BLOCK_R
    return col_slice, col_r, (col_slice < num_slices) & (col_r < max_rank)
