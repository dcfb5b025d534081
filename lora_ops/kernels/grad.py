"""Backward kernels of the LoRA delta: dx (expand of dh into K columns, slices summed) and the per-slot
weight gradients dA / dB (a segmented outer-product sum over each slot's tokens)."""
import triton
import triton.language as tl

from lora_ops.kernels.work import (dot_split, dot_t, find_slice_block, find_slot_tile, load_tile_tokens, rank_ceil,
                                   split_f32, store_zero_rows)


@triton.jit(do_not_specialize=["M"])
def lora_grad_x_kernel(
    dh_ptr, a_ptr, dx_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, K, num_slots, max_rank, capacity,
    stride_hm, stride_hs, stride_hr,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_xm, stride_xk,
    stride_rank, stride_ids, stride_starts, stride_counts,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOTS_POW2: tl.constexpr, RANK_ALIGN: tl.constexpr, H_PRECISION: tl.constexpr, N_LOOP: tl.constexpr = 1,
    ONE_RANK_BLOCK: tl.constexpr = False, SLICES_POW2: tl.constexpr = 1, WRITE_ALL: tl.constexpr = False,
):
    """dx[t, n-blocks] = sum_i dh[t, i, :rank] @ A[s_t, i, :rank, n-block], one token tile of one slot, for
    N_LOOP column blocks in turn.

    Pointers: dh [M, S, R] float32 (gradient of the shrink output, scale already in it); A [L, S, R, K]
    (fp16/bf16/fp32); dx [M, K] (A's dtype), written (not added) at the tile's valid tokens only, so rows
    of tokens without a delta (slot -1, a slot of rank 0) keep what the caller put there, unless WRITE_ALL;
    rank [L] int32; sorted_ids [capacity] int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised), K features, num_slots L, max_rank R, capacity of sorted_ids.
    Strides: every dimension of dh, A and dx, and of the 1-D rank, sorted_ids, slot_starts and slot_counts
    (stride_rank .. stride_counts), in elements.
    NUM_SLICES: S; the slices are summed in the fp32 accumulator, so dx is rounded once.
    Grid: (cdiv(cdiv(K, BLOCK_N), N_LOOP), token-tile bound); the rank loop stops at the slot's own rank.
    N_LOOP: column blocks a program walks after finding its tile (its slot, tokens and rank found once: with
    one slice and one rank block, a program of one column block is one dot between that search and its store).
    H_PRECISION: see kernels.work.split_f32. RANK_ALIGN: a power of two dividing R (kernels.work.rank_ceil:
    dh's rank columns load in vectors).
    ONE_RANK_BLOCK (R <= BLOCK_R; SLICES_POW2: S rounded up to a power of two): the tile's dh, every slice
    side by side as [BLOCK_M, SLICES_POW2 * BLOCK_R], is loaded from memory and split into its bf16 terms
    once, before the column blocks, and each block is one dot with that many rows of A (slices past S and
    ranks past the slot's are zeros). On sm_90 (Triton 3.6 and 3.9) the compiler parks the terms in shared
    memory and reloads them into registers for each block's MMA (a register operand), every MMA waited for
    (wait_group 0) before the next block: nothing in flight reads registers a later step rewrites, which is
    what raced (kernels.work.dot_t; tests/test_codegen.py holds the waits). Otherwise each column block
    reloads and splits dh, slice by slice and rank block by rank block, on the MMA's right (dot_t).
    WRITE_ALL: the token tiles also cover the tokens without a delta (slot -1, slots of rank 0; group L's tiles
    after every slot's: kernels.work.find_slot_tile's WITH_NONE), whose rows get zeros, so every row the metadata
    names is written and dx needs no zero fill first (the metadata must partition the M tokens, as
    lora_ops.batch builds it).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2, WRITE_ALL, stride_counts,
                                                  stride_starts, stride_rank)
    if rank == 0:
        if WRITE_ALL:   # tokens without a delta: their rows of dx are zero
            tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)
            for nb in range(N_LOOP):
                offs_n = (pid_n * N_LOOP + nb) * BLOCK_N + tl.arange(0, BLOCK_N)
                store_zero_rows(dx_ptr, tok, valid, offs_n.to(tl.int64) * stride_xk, offs_n < K, stride_xm, BLOCK_M,
                                BLOCK_N)
        return
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M, stride_ids)

    if ONE_RANK_BLOCK:
        _grad_x_one_rank_block(dh_ptr, a_ptr, dx_ptr, tok, valid, slot, rank, pid_n, K, stride_hm, stride_hs,
                               stride_hr, stride_al, stride_as, stride_ar, stride_ak, stride_xm, stride_xk,
                               NUM_SLICES, SLICES_POW2, BLOCK_M, BLOCK_N, BLOCK_R, RANK_ALIGN, H_PRECISION, N_LOOP)
        return
    offs_r = tl.arange(0, BLOCK_R)
    dh_rows = dh_ptr + tok[:, None] * stride_hm
    rank_in = rank_ceil(rank, RANK_ALIGN)
    for nb in tl.static_range(N_LOOP):   # (unrolled: with N_LOOP 1 the code of one block a program)
        n0 = (pid_n * N_LOOP + nb) * BLOCK_N
        if nb == 0 or n0 < K:   # (a block past the first may lie past K; the first never does)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < K
            # Transposed, dx^T = A^T dh^T, so the float32 dh (split in registers) is the MMA's right operand,
            # staged in shared memory: on the left a pipelined wgmma reads it from registers, which raced in the
            # expand's rank loop (kernels.work.dot_t).
            a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_n[:, None].to(tl.int64) * stride_ak
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in tl.static_range(NUM_SLICES):
                for r0 in range(0, rank, BLOCK_R):
                    rs = r0 + offs_r
                    r_ok = rs < rank
                    ht = tl.load(dh_rows + i * stride_hs + rs[None, :] * stride_hr,
                                 mask=valid[:, None] & (rs < rank_in)[None, :], other=0.0)
                    ht = tl.where(r_ok[None, :], ht, 0.0)
                    a_t = tl.load(a_rows + i * stride_as + rs[None, :].to(tl.int64) * stride_ar,
                                  mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                    acc_t = dot_t(a_t, tl.trans(ht), acc_t, H_PRECISION)
            acc = tl.trans(acc_t)
            dx_ptrs = dx_ptr + tok[:, None] * stride_xm + offs_n[None, :].to(tl.int64) * stride_xk
            tl.store(dx_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _grad_x_one_rank_block(dh_ptr, a_ptr, dx_ptr, tok, valid, slot, rank, pid_n, K, stride_hm, stride_hs, stride_hr,
                           stride_al, stride_as, stride_ar, stride_ak, stride_xm, stride_xk,
                           NUM_SLICES: tl.constexpr, SLICES_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_ALIGN: tl.constexpr,
                           H_PRECISION: tl.constexpr, N_LOOP: tl.constexpr):
    """lora_grad_x_kernel's ONE_RANK_BLOCK path: column j of the tile's dh is slice j // BLOCK_R, rank
    j % BLOCK_R; the same j indexes A's rows, so one dot sums the slices."""
    offs_j = tl.arange(0, SLICES_POW2 * BLOCK_R)
    j_slice = offs_j // BLOCK_R
    j_rank = offs_j % BLOCK_R
    j_ok = (j_slice < NUM_SLICES) & (j_rank < rank)
    j_in = (j_slice < NUM_SLICES) & (j_rank < rank_ceil(rank, RANK_ALIGN))   # vector loads; j_ok zeroes the rest
    ht = tl.load(dh_ptr + tok[:, None] * stride_hm + j_slice[None, :] * stride_hs + j_rank[None, :] * stride_hr,
                 mask=valid[:, None] & j_in[None, :], other=0.0)
    hi, lo = split_f32(tl.where(j_ok[None, :], ht, 0.0), H_PRECISION)
    a_rows = (a_ptr + slot.to(tl.int64) * stride_al + j_slice[:, None].to(tl.int64) * stride_as
              + j_rank[:, None].to(tl.int64) * stride_ar)
    dx_rows = dx_ptr + tok[:, None] * stride_xm
    for nb in range(N_LOOP):
        offs_n = (pid_n * N_LOOP + nb) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < K
        a = tl.load(a_rows + offs_n[None, :].to(tl.int64) * stride_ak, mask=j_in[:, None] & n_ok[None, :], other=0.0)
        a = tl.where(j_ok[:, None], a, 0.0)   # A past the rank may hold anything, NaN included
        acc = dot_split(hi, lo, a, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), H_PRECISION, False)
        tl.store(dx_rows + offs_n[None, :].to(tl.int64) * stride_xk, acc.to(dx_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def segment_outer_kernel(
    u_ptr, v_ptr, out_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, P, Q, capacity,
    stride_um, stride_up,
    stride_vm, stride_vq,
    stride_ol, stride_op, stride_oq,
    stride_rank, stride_ids, stride_starts, stride_counts,
    stride_us, stride_os,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, RANK_ALIGN: tl.constexpr,
    PRECISION: tl.constexpr, NUM_SLICES: tl.constexpr = 1, SLICE_COLS: tl.constexpr = None,
    SLICE_BLOCKS: tl.constexpr = None,
):
    """out[l, p-block, q-block] = sum over slot l's tokens t of u[t, p-block]^T v[t, q-block].

    The backward's weight gradients, every packed slice in one launch (launch_grad): dA = lora_grad_a (u =
    dh, NUM_SLICES = S: slice i's u and out start stride_us and stride_os * i further, v = x shared) and dB =
    lora_grad_b (u = h, SLICE_COLS: slice i owns the columns [SLICE_COLS[i], SLICE_COLS[i + 1]) of v =
    grad_out and of out = dB^T; its u starts stride_us * i further). With neither, the segment_outer op: one
    u [M, P] against v [M, Q].
    Pointers: u [M, P] float32 (rank side: rows p >= rank[l] count as zero and are never read);
    v [M, Q] (fp16/bf16/fp32); out [L, P, Q] (v's dtype), every element written, so slots without tokens
    or rank get zeros; rank [L] int32; sorted_ids [capacity] int32, slot_starts / slot_counts [L + 1]
    int32 (lora_ops.batch; only the first L slots are read, the 'no adapter' bucket never is).
    Sizes: M tokens (not specialised), P, Q, capacity of sorted_ids. Strides: every dimension of u, v and
    out (views with any strides, stride 0 included), and of the 1-D rank, sorted_ids, slot_starts and
    slot_counts (stride_rank .. stride_counts), in elements; stride_us / stride_os: from one slice's u / out
    to the next (0 without slices).
    Grid: (cdiv(Q, BLOCK_Q), cdiv(P, BLOCK_P), L); each program walks its slot's tokens in BLOCK_T chunks,
    accumulating in float32 (no atomics: every output block has one owner, so results are deterministic).
    NUM_SLICES > 1: axis 1 holds NUM_SLICES * cdiv(P, BLOCK_P) programs, slice by slice. SLICE_COLS (S + 1
    column offsets; SLICE_BLOCKS: S + 1 offsets of each slice's first column block, prefix sums of cdiv(n_i,
    BLOCK_Q)): axis 0 holds SLICE_BLOCKS[-1] programs, each in one slice's columns (kernels.work
    .find_slice_block); Q is then the width of v and out.
    PRECISION: see kernels.work.split_f32. RANK_ALIGN: a power of two dividing P (kernels.work.rank_ceil: u's
    rank columns load in vectors).
    """
    pid_q = tl.program_id(0)
    pid_p = tl.program_id(1)
    slot = tl.program_id(2)
    if NUM_SLICES > 1:
        p_blocks = tl.cdiv(P, BLOCK_P)
        slice_id = pid_p // p_blocks
        pid_p = pid_p % p_blocks
        u_ptr += slice_id * stride_us
        out_ptr += slice_id.to(tl.int64) * stride_os
    if SLICE_COLS is not None:
        if pid_q >= SLICE_BLOCKS[len(SLICE_BLOCKS) - 1]:
            return
        col_slice, offs_q, q_ok = find_slice_block(pid_q, SLICE_COLS, SLICE_BLOCKS, BLOCK_Q)
        u_ptr += col_slice * stride_us
    rank = tl.minimum(tl.maximum(tl.load(rank_ptr + slot * stride_rank), 0), P)
    count = tl.minimum(tl.maximum(tl.load(slot_counts_ptr + slot * stride_counts), 0), capacity)
    start = tl.minimum(tl.maximum(tl.load(slot_starts_ptr + slot * stride_starts), 0), capacity)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    if SLICE_COLS is None:
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_t = tl.arange(0, BLOCK_T)
    p_ok = offs_p < rank
    p_in = offs_p < rank_ceil(rank, RANK_ALIGN)
    if SLICE_COLS is None:
        q_ok = offs_q < Q
    # A rank block past the slot's rank only writes its zeros.
    n_tokens = tl.where(pid_p * BLOCK_P < rank, count, 0)

    # Transposed, out^T = v^T u, so the float32 u (split in registers) is the MMA's right operand (dot_t).
    acc_t = tl.zeros((BLOCK_Q, BLOCK_P), dtype=tl.float32)
    for t0 in range(0, n_tokens, BLOCK_T):
        rows = start + t0 + offs_t
        valid = (t0 + offs_t < count) & (rows < capacity)
        tok = tl.load(sorted_ids_ptr + rows * stride_ids, mask=valid, other=0)
        valid = valid & (tok >= 0) & (tok < M)
        tok = tok.to(tl.int64)
        ut = tl.load(u_ptr + tok[:, None] * stride_um + offs_p[None, :] * stride_up,
                     mask=valid[:, None] & p_in[None, :], other=0.0)
        ut = tl.where(p_ok[None, :], ut, 0.0)
        # v^T [BLOCK_Q, BLOCK_T], loaded transposed.
        v_t = tl.load(v_ptr + tok[None, :] * stride_vm + offs_q[:, None].to(tl.int64) * stride_vq,
                      mask=q_ok[:, None] & valid[None, :], other=0.0)
        acc_t = dot_t(v_t, ut, acc_t, PRECISION)
    acc = tl.trans(acc_t)

    out_ptrs = (out_ptr + slot.to(tl.int64) * stride_ol + offs_p[:, None].to(tl.int64) * stride_op
                + offs_q[None, :].to(tl.int64) * stride_oq)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_p[:, None] < P) & q_ok[None, :])


@triton.jit
def transpose_rank_kernel(b_ptr, out_ptr, N, R, stride_bl, stride_bn, stride_br, stride_ol, stride_or, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[l, r, n] = b[l, n, r]: lora_grad_h's shrink operand, B^T with the features contiguous.

    Pointers: b [L, N, R] (any strides; values copied as they are, NaN included), out [L, R, N].
    Sizes: N features, R max rank. Strides: every dimension of b and out, in elements.
    Grid: (cdiv(N, BLOCK_N), L); a program copies BLOCK_N features of one slot, BLOCK_R ranks at a time: its
    tile loads along the rank (b's contiguous dimension) and is stored transposed along the features (out's),
    both coalesced, the layout change through shared memory. torch's copy of the transposed view read one
    side element by element: 57 µs for Llama gate_up's B at rank 64 (H100, ncu, session 41), its bytes
    ~10 µs at copy speed.
    """
    pid_n = tl.program_id(0)
    slot = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    src = b_ptr + slot * stride_bl + offs_n[:, None].to(tl.int64) * stride_bn
    dst = out_ptr + slot * stride_ol + offs_n[None, :].to(tl.int64) * stride_on
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        tile = tl.load(src + offs_r[None, :].to(tl.int64) * stride_br, mask=n_ok[:, None] & r_ok[None, :])
        tl.store(dst + offs_r[:, None].to(tl.int64) * stride_or, tl.trans(tile), mask=r_ok[:, None] & n_ok[None, :])
