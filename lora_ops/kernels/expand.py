"""Expand: y[t, slice i] += h[t, i, :rank] @ B[s_t, slice i, :rank]^T, all slices in one launch."""
import triton
import triton.language as tl

from lora_ops.kernels.work import (dot_f32_lhs, dot_split, dot_t, expand_tile_rows, find_slice_chunk, find_slot_tile,
                                   gdc_wait, load_h_parts, load_tile_tokens, rank_ceil, store_zero_rows)


@triton.jit(do_not_specialize=["M"])
def expand_kernel(
    h_ptr, b_ptr, y_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr, scale_ptr,
    M, num_slots, max_rank, capacity, num_parts, h_offset,
    stride_hp, stride_hm, stride_hl, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    stride_scale, stride_rank, stride_ids, stride_starts, stride_counts,
    SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_LOOP: tl.constexpr,
    ONE_RANK_BLOCK: tl.constexpr, PART_CHUNK: tl.constexpr, SLOTS_POW2: tl.constexpr, RANK_ALIGN: tl.constexpr,
    H_PRECISION: tl.constexpr, PDL: tl.constexpr = False, SCALE_BY_SLOT: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = True, M_LOOP: tl.constexpr = 1, H_PLANES: tl.constexpr = 0,
    TOKENS_FIRST: tl.constexpr = False, PLANES_IN_TURN: tl.constexpr = False,
):
    """One program: one token tile of one slot times one chunk of N_LOOP column blocks of one output slice.

    Pointers: h [P, M, S, R] float32: the shrink output as num_parts = P partial sums (split-K partials,
    added here in split order, so the sum is deterministic; P = 1: h itself). The rank loop takes P = 1
    only (the launcher has the shrink add its splits): a loop over the parts inside it would keep the
    compiler from pipelining it. P is a run-time value; the parts are read PART_CHUNK at a time, all of a
    chunk's loads in flight together (one at a time, each part was a round trip of its own; all P at once
    spilled registers at rank 64 with 16 parts: DESIGN §4). PART_CHUNK: parts per chunk (a power of two).
    B [L, N, R] (y's dtype);
    y [M, N] (fp16/bf16/fp32), read and written once per element; rank [L] int32; sorted_ids
    [capacity] int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised), num_slots L, max_rank R, capacity of sorted_ids.
    Strides: every dimension of h (stride_hp between parts), B and y, and of the 1-D scale, rank,
    sorted_ids, slot_starts and slot_counts (stride_scale .. stride_counts), in elements.
    h_offset, stride_hl, scale_ptr, SCALE_BY_SLOT: h may hold every slot's h unscaled, as the stacked GEMM
    writes it (launch.launch_expand_stacked: columns N.. of F.linear(x, [W; A]), in y's dtype): then the
    tile's slot's block starts at h_ptr + h_offset + slot * stride_hl, and the product is multiplied by
    scale[slot] (scale_ptr: float32 [L]) before it is added. Otherwise h_offset = stride_hl = 0 and
    scale_ptr is not read. h is read in its own dtype and widened to float32.
    SLICE_COLS: S + 1 column offsets of the output slices in y and B (0, n_0, n_0 + n_1, ..., N);
    SLICE_CHUNKS: S + 1 offsets of each slice's first chunk (prefix sums of cdiv(n_i, N_LOOP * BLOCK_N)).
    Grid: (total chunks, token-tile bound), or with TOKENS_FIRST (token-tile bound, total chunks): the
    programs that run together then share column blocks of B (launch.expand_tokens_first says where).
    ONE_RANK_BLOCK (R <= BLOCK_R): the tile's h is loaded and split once, then the program streams its
    N_LOOP column blocks of B and y, prefetching the next block of y while it adds into this one: y is the
    bulk of the bytes, and one program per (tile, block) left too few loads in flight to reach bandwidth.
    Otherwise each column block runs a rank loop in BLOCK_R steps up to the slot's own rank (a GEMM with
    K = rank), then reads y, adds and writes it. Its full rank blocks load h and B without a rank mask, the
    last partial one (rank not a multiple of BLOCK_R) with one.
    M_LOOP (one rank block and N_LOOP = 1 only; the launcher checks): a program covers M_LOOP consecutive
    token tiles of its slot for its one column block, loading that block of B once (the token axis of the
    grid counts tiles of BLOCK_M * M_LOOP rows). One tile per program re-reads B for every tile: at 1024
    tokens and rank 64 that is more bytes than y's, each through shared memory for the dot. Under PDL this
    path loads its block of B before the wait, y and h after it.
    RANK_ALIGN: a power of two dividing R; rank masks are rounded up to it (kernels.work.rank_ceil), so
    h and B rows load in vectors.
    H_PRECISION: how the fp32 h meets B on the tensor cores (kernels.work.split_f32).
    H_PLANES (the rank loop only): h is [H_PLANES, M, S, R] in B's dtype, the bf16 terms of h as the shrink
    stores them (launch.h_planes), plane p stride_hp * p further (num_parts = 1), holding zeros between
    each slot's rank and the rank rounded up to RANK_ALIGN (the last rank block multiplies them as loaded).
    PLANES_IN_TURN (two planes only): one dot per loop step, the planes taking turns (rank_loop says why).
    ACCUMULATE (default): y += the delta. Otherwise y = the delta, y never read (launch.lora_linear's
    write-first path: the base GEMM then accumulates onto it with beta = 1): the token tiles then also
    cover the tokens without a delta (slot -1 or a slot of rank 0), whose rows get zeros, so every row
    of y that the metadata names is written (heuristics.max_token_tiles bounds the L + 1 groups' tiles
    too). The mode compiles no y load (each sits under a constexpr ``if ACCUMULATE``, so the accumulating
    path compiles to the same code as without the mode). Until session 23 they were masked off instead:
    loads that never fired still cost the store mode 5-20% of its time (H200, ranks 16-320; DESIGN §4).
    PDL (launched with programmatic dependent launch after a PDL shrink, which lets it launch once all its
    programs run): the metadata, y and B loads go first, then the program waits for the shrink to finish
    before it reads h. Everything earlier in the stream is complete by then (each shrink program waited
    for it before letting this kernel launch); y is only stored after the wait. With SCALE_BY_SLOT (PDL
    right behind the stacked GEMM, which writes y and h) only the metadata, token ids and scale are
    loaded before the wait.
    """
    if TOKENS_FIRST:
        # Grid (token tiles, chunks): the programs running together share a column block of B and read it
        # from memory once, rather than each wave streaming all of B for one or two token tiles.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    if pid_n >= SLICE_CHUNKS[len(SLICE_CHUNKS) - 1]:
        return
    slice_id, col0, col_hi = find_slice_chunk(pid_n, SLICE_COLS, SLICE_CHUNKS, N_LOOP * BLOCK_N)
    # A program's token rows: M_LOOP tiles of BLOCK_M (M_LOOP = 1: one tile).
    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M * M_LOOP, SLOTS_POW2, not ACCUMULATE,
                                                  stride_counts, stride_starts, stride_rank)
    if rank == 0:
        if not ACCUMULATE:   # tokens without a delta: their rows of y are zero
            for i in tl.static_range(M_LOOP):
                tok, valid = load_tile_tokens(sorted_ids_ptr, row0 + i * BLOCK_M, rows_left - i * BLOCK_M, capacity,
                                              M, BLOCK_M, stride_ids)
                offs_n = col0 + tl.arange(0, BLOCK_N)
                for j in range(N_LOOP):
                    store_zero_rows(y_ptr, tok, valid, offs_n.to(tl.int64) * stride_yn, offs_n < col_hi, stride_ym,
                                    BLOCK_M, BLOCK_N)
                    offs_n += BLOCK_N
        return
    slot_scale = 1.0
    if SCALE_BY_SLOT:
        slot_scale = tl.load(scale_ptr + slot * stride_scale)
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)

    offs_r = tl.arange(0, BLOCK_R)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    h_rows, y_rows = expand_tile_rows(h_ptr, y_ptr, tok, slot, slice_id, h_offset, stride_hm, stride_hs, stride_hl,
                                      stride_ym, SCALE_BY_SLOT)
    b_slot = b_ptr + slot.to(tl.int64) * stride_bl

    if ONE_RANK_BLOCK and M_LOOP > 1:
        # One column block (N_LOOP = 1) over M_LOOP token tiles of the slot: B's block is loaded once and held,
        # where one program per tile re-reads it for every tile (at 1024 tokens and rank 64 B's re-reads
        # outweigh y's traffic, and their trips through shared memory made the stacked expand L1-bound).
        n_ok = offs_n < col_hi
        r_ok = offs_r < rank
        r_in = offs_r < rank_ceil(rank, RANK_ALIGN)
        bt = tl.load(b_slot + offs_r[:, None] * stride_br + offs_n[None, :].to(tl.int64) * stride_bn,
                     mask=r_in[:, None] & n_ok[None, :], other=0.0)
        bt = tl.where(r_ok[:, None], bt, 0.0)
        if PDL:
            gdc_wait()   # h is the shrink's (y and h the stacked GEMM's)
        for i in tl.static_range(M_LOOP):
            if i > 0:
                tok, valid = load_tile_tokens(sorted_ids_ptr, row0 + i * BLOCK_M, rows_left - i * BLOCK_M, capacity,
                                              M, BLOCK_M, stride_ids)
                h_rows, y_rows = expand_tile_rows(h_ptr, y_ptr, tok, slot, slice_id, h_offset, stride_hm, stride_hs,
                                                  stride_hl, stride_ym, SCALE_BY_SLOT)
            y_ptrs = y_rows + offs_n[None, :].to(tl.int64) * stride_yn
            y_old = 0.0   # unread unless ACCUMULATE
            if ACCUMULATE:
                y_old = tl.load(y_ptrs, mask=valid[:, None] & n_ok[None, :], other=0.0)
            h_hi, h_lo = load_h_parts(h_rows + offs_r[None, :] * stride_hr, valid[:, None] & r_in[None, :], r_ok,
                                      num_parts, tl.cast(stride_hp, tl.int64), PART_CHUNK, H_PRECISION)
            acc = dot_split(h_hi, h_lo, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), H_PRECISION,
                            False)
            store_tile(y_ptrs, acc, y_old, slot_scale, valid[:, None] & n_ok[None, :], SCALE_BY_SLOT, ACCUMULATE)
    elif ONE_RANK_BLOCK:
        if PDL and SCALE_BY_SLOT:
            gdc_wait()   # y and h are the stacked GEMM's
        # y is the bulk of the bytes: the first block's load is in flight while h is read.
        n_ok = offs_n < col_hi
        if ACCUMULATE:
            y_next = tl.load(y_rows + offs_n[None, :].to(tl.int64) * stride_yn, mask=valid[:, None] & n_ok[None, :],
                             other=0.0)
        r_ok = offs_r < rank
        r_in = offs_r < rank_ceil(rank, RANK_ALIGN)  # vector loads; r_ok zeroes the rest after the load
        h_mask = valid[:, None] & r_in[None, :]
        part_rows = h_rows + offs_r[None, :] * stride_hr
        if PDL and not SCALE_BY_SLOT:
            gdc_wait()   # h is the shrink's
        h_hi, h_lo = load_h_parts(part_rows, h_mask, r_ok, num_parts, tl.cast(stride_hp, tl.int64), PART_CHUNK,
                                  H_PRECISION)
        b_rows = b_slot + offs_r[:, None] * stride_br
        for j in range(N_LOOP):
            y_old = 0.0   # unread unless ACCUMULATE
            if ACCUMULATE:
                y_old = y_next
            mask = valid[:, None] & n_ok[None, :]
            y_ptrs = y_rows + offs_n[None, :].to(tl.int64) * stride_yn
            bt = tl.load(b_rows + offs_n[None, :].to(tl.int64) * stride_bn, mask=r_in[:, None] & n_ok[None, :],
                         other=0.0)
            bt = tl.where(r_ok[:, None], bt, 0.0)
            next_n = offs_n + BLOCK_N
            next_ok = (next_n < col_hi) & (j + 1 < N_LOOP)
            if ACCUMULATE:
                y_next = tl.load(y_rows + next_n[None, :].to(tl.int64) * stride_yn,
                                 mask=valid[:, None] & next_ok[None, :], other=0.0)
            acc = dot_split(h_hi, h_lo, bt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), H_PRECISION,
                            False)
            store_tile(y_ptrs, acc, y_old, slot_scale, mask, SCALE_BY_SLOT, ACCUMULATE)
            offs_n = next_n
            n_ok = next_ok
    else:
        # h in B's 16-bit dtype (the stacked GEMM's, or add_lora_'s planes): multiplied as it is (rank_loop).
        h_native: tl.constexpr = (h_ptr.dtype.element_ty == b_ptr.dtype.element_ty
                                  and b_ptr.dtype.element_ty != tl.float32)
        if PDL:
            gdc_wait()   # h is the shrink's
        for j in range(N_LOOP):
            n_ok = offs_n < col_hi
            acc = rank_loop(h_rows, b_slot, offs_n, n_ok, rank, stride_hr, stride_hp, stride_bn, stride_br, BLOCK_M,
                            BLOCK_N, BLOCK_R, RANK_ALIGN, H_PRECISION, h_native, H_PLANES, PLANES_IN_TURN)
            # y after the rank loop: holding it through the loop cost the registers that larger tiles need
            # (H200: 128 x 256 tiles, 10-15% faster at ranks 128-320).
            mask = valid[:, None] & n_ok[None, :]
            y_ptrs = y_rows + offs_n[None, :].to(tl.int64) * stride_yn
            y_old = acc   # unread unless ACCUMULATE
            if ACCUMULATE:
                y_old = tl.load(y_ptrs, mask=mask, other=0.0)
            store_tile(y_ptrs, acc, y_old, slot_scale, mask, SCALE_BY_SLOT, ACCUMULATE)
            offs_n += BLOCK_N


@triton.jit
def store_tile(y_ptrs, acc, y_old, slot_scale, mask, SCALE_BY_SLOT: tl.constexpr, ACCUMULATE: tl.constexpr):
    """Store a tile's product: acc [BLOCK_M, BLOCK_N] float32, times the slot's scale (SCALE_BY_SLOT: the
    stacked path, whose h is unscaled), plus y_old (ACCUMULATE: y's values, loaded by the caller, added in
    float32) at y_ptrs, in y's dtype; mask: the tile's valid tokens and existing columns."""
    if SCALE_BY_SLOT:
        acc = acc * slot_scale
    if ACCUMULATE:
        acc = y_old.to(tl.float32) + acc
    tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def rank_loop(h_rows, b_slot, offs_n, n_ok, rank, stride_hr, stride_hp, stride_bn, stride_br, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_ALIGN: tl.constexpr, H_PRECISION: tl.constexpr,
              H_NATIVE: tl.constexpr, H_PLANES: tl.constexpr, PLANES_IN_TURN: tl.constexpr = False):
    """h[tile, :rank] @ B[slot, cols, :rank]^T as float32 [BLOCK_M, BLOCK_N]: a GEMM with K = the slot's rank
    in BLOCK_R steps (expand_kernel's rank loop). h_rows: [BLOCK_M, 1] pointers to the tile's h rows (rank
    stride stride_hr); b_slot: the slot's B; offs_n / n_ok: the block's columns and which exist.

    Where the operands sit (kernels.work.dot_t says why it matters on Hopper):
    - h in B's 16-bit dtype (the stacked path's h, add_lora_'s planes): a dot of the loads as they are, one
      per plane;
    - float32 h with bf16 B ("bf16x2", "bf16"): the transposed product, acc^T = B h^T (dot_t), so h's bf16
      terms, computed in registers, are the right operand, staged in shared memory;
    - float32 h with fp16 or float32 B ("tf32", "ieee"): h, a plain load, on the left, B widened on the right.
    PLANES_IN_TURN (two planes): a step per (rank block, plane), hi then lo, so the same products in the same
    order (bit-identical). With both planes' dots in one step Triton makes only the last asynchronous (the
    hi plane's wgmmas end in wait_group 0, exposed); one dot a step pipelines like a plain GEMM (wait_group
    1), at the price of loading B's block twice from L2 (DESIGN §4, "The planes' two dots"). Measured slower
    on the H200 (1.10-1.24x the table's configs, session 26: the loop is L2-bound), so no table entry or tuner
    candidate takes it; ExpandConfig.planes_in_turn selects it (benchmarks/lab_planes_in_turn.py).
    Full rank blocks load without a rank mask (16-byte vectors, pipelined; a run-time rank mask made every
    element a load of its own); rows of invalid tokens read token 0's h (in bounds, never stored). The last,
    partial block is masked to the rank (rounded up for vector loads, kernels.work.rank_ceil).
    """
    offs_r = tl.arange(0, BLOCK_R)
    full = rank // BLOCK_R * BLOCK_R
    transposed: tl.constexpr = not H_NATIVE and (H_PRECISION == "bf16x2" or H_PRECISION == "bf16")
    b_cols = b_slot + offs_n[None, :].to(tl.int64) * stride_bn     # B^T [BLOCK_R, BLOCK_N] blocks
    b_rows = b_slot + offs_n[:, None].to(tl.int64) * stride_bn     # B [BLOCK_N, BLOCK_R] blocks
    if transposed:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for r0 in range(0, full, BLOCK_R):
            rs = r0 + offs_r
            ht = tl.load(h_rows + rs[None, :] * stride_hr)
            b = tl.load(b_rows + rs[None, :] * stride_br, mask=n_ok[:, None], other=0.0)
            acc_t = dot_t(b, tl.trans(ht), acc_t, H_PRECISION)
        if full < rank:
            rs = full + offs_r
            r_ok = rs < rank
            r_in = rs < rank_ceil(rank, RANK_ALIGN)
            ht = tl.load(h_rows + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0)
            b = tl.load(b_rows + rs[None, :] * stride_br, mask=n_ok[:, None] & r_in[None, :], other=0.0)
            acc_t = dot_t(tl.where(r_ok[None, :], b, 0.0), tl.trans(tl.where(r_ok[None, :], ht, 0.0)), acc_t,
                          H_PRECISION)
        return tl.trans(acc_t)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if H_PLANES == 2 and PLANES_IN_TURN:
        for step in range(0, 2 * (full // BLOCK_R)):
            rs = step // 2 * BLOCK_R + offs_r
            ht = tl.load(h_rows + step % 2 * stride_hp + rs[None, :] * stride_hr)
            bt = tl.load(b_cols + rs[:, None] * stride_br, mask=n_ok[None, :], other=0.0)
            acc = tl.dot(ht, bt, acc)
    else:
        for r0 in range(0, full, BLOCK_R):
            rs = r0 + offs_r
            ht = tl.load(h_rows + rs[None, :] * stride_hr)
            bt = tl.load(b_cols + rs[:, None] * stride_br, mask=n_ok[None, :], other=0.0)
            if H_NATIVE:
                acc = tl.dot(ht, bt, acc)
                if H_PLANES == 2:
                    acc = tl.dot(tl.load(h_rows + stride_hp + rs[None, :] * stride_hr), bt, acc)
            else:
                acc = dot_f32_lhs(ht, bt, acc, H_PRECISION)
    if full < rank:
        rs = full + offs_r
        r_ok = rs < rank
        r_in = rs < rank_ceil(rank, RANK_ALIGN)
        ht = tl.load(h_rows + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0)
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=r_in[:, None] & n_ok[None, :], other=0.0)
        bt = tl.where(r_ok[:, None], bt, 0.0)
        if H_PLANES > 0:
            # The shrink stored zeros between the rank and rank_ceil, so the planes multiply as loaded: a
            # tl.where on them made this last block's MMA read its left operand from registers.
            acc = tl.dot(ht, bt, acc)
            if H_PLANES == 2:
                acc = tl.dot(tl.load(h_rows + stride_hp + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0),
                             bt, acc)
        elif H_NATIVE:
            acc = tl.dot(tl.where(r_ok[None, :], ht, 0.0), bt, acc)
        else:
            ht = tl.where(r_ok[None, :], ht, 0.0)
            acc = dot_f32_lhs(ht, bt, acc, H_PRECISION)
    return acc
