"""Expand: y[t, slice i] += h[t, i, :rank] @ B[s_t, slice i, :rank]^T, all slices in one launch."""
import triton
import triton.language as tl

from lora_ops.kernels.work import dot_f32_lhs, find_slice_block, find_slot_tile, load_tile_tokens


@triton.jit(do_not_specialize=["M"])
def expand_kernel(
    h_ptr, b_ptr, y_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, num_slots, max_rank, capacity, num_parts,
    stride_hp, stride_hm, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    SLICE_COLS: tl.constexpr, SLICE_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOTS_POW2: tl.constexpr, H_PRECISION: tl.constexpr,
):
    """One program: one token tile of one slot times one BLOCK_N block of one output slice.

    Pointers: h [P, M, S, R] float32: the shrink output as num_parts = P partial sums (split-K partials,
    added here in split order, so the sum is deterministic; P = 1: h itself); B [L, N, R] (y's dtype);
    y [M, N] (fp16/bf16/fp32), read and written once per element; rank [L] int32; sorted_ids
    [capacity] int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised), num_slots L, max_rank R, capacity of sorted_ids.
    Strides: every dimension of h (stride_hp between parts), B and y, in elements.
    SLICE_COLS: S + 1 column offsets of the output slices in y and B (0, n_0, n_0 + n_1, ..., N);
    SLICE_BLOCKS: S + 1 offsets of each slice's first column block (prefix sums of cdiv(n_i, BLOCK_N)).
    Grid: (total column blocks, token-tile bound). The rank loop stops at the slot's own rank.
    H_PRECISION: how the fp32 h meets B on the tensor cores: "ieee" (float32 inputs), "tf32" (float16:
    h keeps fp32 range), "bf16x2" (bfloat16: h split into two bf16 terms, about 16 significant bits).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_n >= SLICE_BLOCKS[len(SLICE_BLOCKS) - 1]:
        return
    slice_id, offs_n, n_ok = find_slice_block(pid_n, SLICE_COLS, SLICE_BLOCKS, BLOCK_N)
    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2)
    if rank == 0:
        return
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M)

    offs_r = tl.arange(0, BLOCK_R)
    h_rows = h_ptr + tok[:, None] * stride_hm + slice_id * stride_hs
    b_cols = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn

    # y is the bulk of the bytes: issue its load first so it is in flight during the rank loop.
    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
    mask = valid[:, None] & n_ok[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + offs_r
        r_ok = rs < rank
        h_mask = valid[:, None] & r_ok[None, :]
        part_rows = h_rows + rs[None, :] * stride_hr
        ht = tl.load(part_rows, mask=h_mask, other=0.0)
        for _ in range(1, num_parts):  # the splits' partial sums, in split order
            part_rows += stride_hp
            ht += tl.load(part_rows, mask=h_mask, other=0.0)
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_f32_lhs(ht, bt, acc, H_PRECISION)

    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)
