"""Linear with the LoRA delta in its epilogue: y = x W^T (+ bias) + h B^T per slice, one launch after the shrink."""
import triton
import triton.language as tl

from lora_ops.kernels.work import dot_f32_rhs, find_slice_block, rank_ceil


@triton.jit
def slot_of_rows(sorted_ids_ptr, starts, counts, capacity, offs_m, RUN: tl.constexpr):
    """The slot of each token row ``offs_m`` [BLOCK_M] (-1: none), from every slot's run of
    ``sorted_ids`` at once: starts / counts [SLOTS_POW2] (count 0 for slots to skip).

    The tile is in token order, the runs in slot order: each step gathers RUN ids of every run in one load
    and compares them with every row ([SLOTS_POW2, RUN, BLOCK_M] compares), so the map costs one memory
    round trip per RUN ids of the longest run, without a per-token slot array or a scatter."""
    ls = tl.arange(0, starts.shape[0])
    offs = tl.arange(0, RUN)
    slot_of = tl.full(offs_m.shape, -1, tl.int32)
    for c in range(0, tl.max(counts, 0), RUN):
        rows = starts[:, None] + c + offs[None, :]
        ids = tl.load(sorted_ids_ptr + rows, mask=(c + offs[None, :] < counts[:, None]) & (rows < capacity),
                      other=-1)
        hit = ids[:, :, None] == offs_m[None, None, :]
        slot_of = tl.maximum(slot_of, tl.max(tl.max(tl.where(hit, ls[:, None, None], -1), 1), 0))
    return slot_of


@triton.jit(do_not_specialize=["M", "split_k"])
def linear_lora_kernel(
    x_ptr, w_ptr, bias_ptr, h_ptr, b_ptr, y_ptr, part_ptr, arrivals_ptr, rank_ptr, sorted_ids_ptr,
    slot_starts_ptr, slot_counts_ptr,
    M, K, num_slots, max_rank, capacity, num_parts, split_k,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_hp, stride_hm, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    stride_pk, stride_pm, stride_pn,
    SLICE_COLS: tl.constexpr, SLICE_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    RUN: tl.constexpr, SLOTS_POW2: tl.constexpr, PART_CHUNK: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, RANK_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, H_PRECISION: tl.constexpr,
):
    """One program: BLOCK_N output columns (within one slice) of BLOCK_M tokens, one K split.

    The tile is computed transposed, acc [BLOCK_N, BLOCK_M] = W x^T: at decode sizes the tokens are
    few and the columns many, so the columns take the MMA's long side.
    Pointers: x [M, K] (fp16/bf16/fp32); W [N, K] (x's dtype); bias [N] (with HAS_BIAS; else unused);
    h [P, M, S, R] float32, the shrink's output as num_parts = P partial sums added here in part order;
    B [L, N, R] (x's dtype); y [M, N] (x's dtype), written once (not read); rank [L] int32; sorted_ids
    [capacity] int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch). With SPLIT_K: part
    [split_k, M, N] float32 (each split's partial products) and arrivals [grid0 * grid1] int32 zeros.
    Sizes: M tokens (not specialised), K features, num_slots L, max_rank R, capacity of sorted_ids,
    split_k: K is cut into split_k ranges (grid axis 2).
    Strides: every dimension of x, W, h, B, y and part, in elements.
    SLICE_COLS / SLICE_BLOCKS: S + 1 column offsets of the output slices and prefix sums of their
    BLOCK_N blocks (kernels.work.find_slice_block): a program's columns are in one slice, whose h it reads.
    Grid: (total column blocks, cdiv(M, BLOCK_M), split_k).
    The K loop reads full BLOCK_K blocks with no mask at all (tokens past M read row M - 1 and columns past
    the slice read row 0 of W: in bounds, and never stored), so they load as vectors and pipeline; a
    partial last block is masked.
    SPLIT_K: each split stores its partial products and counts its arrival; the last to arrive adds the
    partials in split order (deterministic) and runs the epilogue.
    Epilogue: the tile's rows are mapped to their slots (slot_of_rows: RUN ids of every slot's run a step;
    SLOTS_POW2 = next power of two >= L); h is summed over its parts PART_CHUNK loads at a time; then for
    each slot, its rows get B[slot, cols, :rank] h[token, slice, :rank]^T, h past a slot's rank zeroed after
    the load (the shrink leaves it unwritten). Then bias, one rounding to y's dtype, one store. Every load
    of the epilogue depends only on the slot metadata, so its round trips are few and do not grow with L.
    BLOCK_R: next power of two >= max(R, 16); RANK_ALIGN divides R (kernels.work.rank_ceil).
    DOT_PRECISION: "ieee" for float32 inputs; H_PRECISION: how fp32 h meets B (kernels.work.split_f32).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_n >= SLICE_BLOCKS[len(SLICE_BLOCKS) - 1]:
        return
    slice_id, offs_n, n_ok = find_slice_block(pid_n, SLICE_COLS, SLICE_BLOCKS, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    n_in = tl.where(n_ok, offs_n, 0).to(tl.int64)   # rows in bounds, so the K loop's loads need no mask
    m_in = tl.minimum(offs_m, M - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    k_per_split = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    k_full = k_lo + tl.maximum(k_hi - k_lo, 0) // BLOCK_K * BLOCK_K
    w_rows = w_ptr + n_in[:, None] * stride_wn
    x_cols = x_ptr + m_in[None, :] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_full, BLOCK_K):
        ks = k + offs_k
        wt = tl.load(w_rows + ks[None, :] * stride_wk)
        xt = tl.load(x_cols + ks[:, None] * stride_xk)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PRECISION)
    if k_full < k_hi:
        ks = k_full + offs_k
        k_ok = ks < k_hi
        wt = tl.load(w_rows + ks[None, :] * stride_wk, mask=k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + ks[:, None] * stride_xk, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PRECISION)

    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K:
        part_off = offs_m[None, :] * stride_pm + offs_n[:, None] * stride_pn
        tl.store(part_ptr + pid_k * stride_pk + part_off, acc, mask=out_mask)
        # acq_rel: this split's partials are visible to whichever split arrives last.
        arrived = tl.atomic_add(arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if arrived != split_k - 1:
            return
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k_split in range(0, split_k):
            acc += tl.load(part_ptr + k_split * stride_pk + part_off, mask=out_mask, other=0.0,
                           cache_modifier=".cg")

    # The LoRA delta. Every slot's count, rank and start in one load each; the tile's rows mapped to slots;
    # h of the tile's tokens for this slice, transposed [BLOCK_R, BLOCK_M], the parts PART_CHUNK loads at
    # a time; then one masked B tile and dot per slot (no branch: the loop pipelines its B loads).
    ls = tl.arange(0, SLOTS_POW2)
    in_l = ls < num_slots
    counts = tl.minimum(tl.maximum(tl.load(slot_counts_ptr + ls, mask=in_l, other=0), 0), capacity)
    ranks = tl.minimum(tl.maximum(tl.load(rank_ptr + ls, mask=in_l, other=0), 0), max_rank)
    starts = tl.minimum(tl.maximum(tl.load(slot_starts_ptr + ls, mask=in_l, other=0), 0), capacity)
    slot_of = slot_of_rows(sorted_ids_ptr, starts, tl.where(ranks > 0, counts, 0), capacity, offs_m, RUN)
    slot_of = tl.where(m_ok, slot_of, -1)
    offs_r = tl.arange(0, BLOCK_R)
    r_in = offs_r < rank_ceil(max_rank, RANK_ALIGN)
    h_ptrs = h_ptr + m_in[None, :] * stride_hm + slice_id * stride_hs + offs_r[:, None] * stride_hr
    part_step = tl.cast(stride_hp, tl.int64)
    ht = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    for p0 in range(0, num_parts, PART_CHUNK):  # the shrink's partial sums, added in part order
        for i in tl.static_range(PART_CHUNK):
            exists = (offs_r * 0 + p0 + i) < num_parts  # a tensor: the interpreter takes no scalar masks
            ht += tl.load(h_ptrs + (p0 + i) * part_step, mask=r_in[:, None] & exists[:, None], other=0.0,
                          cache_modifier=".cg")
    b_slot = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br
    for slot in range(0, num_slots):  # B[slot]: advanced a slot at a time (pointer arithmetic is 64-bit)
        rank = tl.sum(tl.where(ls == slot, ranks, 0), 0)
        r_ok = offs_r < rank
        bt = tl.load(b_slot, mask=n_ok[:, None] & (offs_r < rank_ceil(rank, RANK_ALIGN))[None, :], other=0.0)
        bt = tl.where(r_ok[None, :], bt, 0.0)
        acc = dot_f32_rhs(bt, tl.where(r_ok[:, None] & (slot_of == slot)[None, :], ht, 0.0), acc, H_PRECISION)
        b_slot += stride_bl

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None].to(tl.int64) * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
