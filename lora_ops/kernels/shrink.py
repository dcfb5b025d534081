"""Shrink: h[t, i, r] = scale[s_t] * x[t] . A[s_t, i, r], grouped by slot, each slot at its own rank."""
import triton
import triton.language as tl

from lora_ops.kernels.work import find_slot_tile, load_tile_tokens


@triton.jit(do_not_specialize=["M", "split_k"])
def shrink_kernel(
    x_ptr, a_ptr, h_ptr, scale_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, K, num_slots, max_rank, capacity, split_k,
    stride_xm, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_hm, stride_hs, stride_hr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC_ADD: tl.constexpr,
    SLOTS_POW2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: one token tile of one slot, one block of BLOCK_R rank rows of one slice, one K split.

    Pointers: x [M, K] (fp16/bf16/fp32); A [L, S, R, K] (x's dtype); h [M, S, R] float32; scale [L]
    float32; rank [L] int32;
    sorted_ids [capacity] int32, slot_starts / slot_counts [L + 1] int32 (lora_ops.batch).
    Sizes: M tokens (not specialised: one compile serves every batch size), K features, num_slots L,
    max_rank R, capacity of sorted_ids, split_k: K is cut into split_k ranges, one per grid index 2. Strides: every dimension of x, A and h, in elements.
    Grid: (S * cdiv(R, BLOCK_R), token-tile bound, split_k). Programs whose rank block starts at or
    past the slot's rank return at once: padded rank is never multiplied.
    Writes h only at valid tokens and r < rank; other entries are left as they were.
    ATOMIC_ADD: add into h atomically (required when split_k > 1; h must then hold zeros).
    DOT_PRECISION: "ieee" for float32 inputs (no silent tf32), ignored for 16-bit inputs.
    """
    pid_sr = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    r_blocks = tl.cdiv(max_rank, BLOCK_R)
    slice_id = pid_sr // r_blocks
    r0 = (pid_sr % r_blocks) * BLOCK_R

    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2)
    if r0 >= rank:
        return
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M)

    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    x_rows = x_ptr + tok[:, None] * stride_xm
    a_cols = (a_ptr + slot.to(tl.int64) * stride_al + slice_id * stride_as
              + offs_r[None, :].to(tl.int64) * stride_ar)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + offs_k
        k_ok = ks < k_hi
        xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_cols + ks[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scale_ptr + slot)

    h_ptrs = h_ptr + tok[:, None] * stride_hm + slice_id * stride_hs + offs_r[None, :] * stride_hr
    if ATOMIC_ADD:
        tl.atomic_add(h_ptrs, acc, mask=valid[:, None] & r_ok[None, :])
    else:
        tl.store(h_ptrs, acc, mask=valid[:, None] & r_ok[None, :])
