"""Helpers shared by the kernels: the work list (slot, token tile) and the fp32-by-weight dot.

The grid's token axis has a fixed size computed from shapes (see lora_ops.launch); each program finds
its (slot, token tile) here, from the per-slot counts on the device. Slots with rank 0 get no tiles,
so no program is spent on them; programs past the last tile find rank 0 and return. The work lists of
kernels that write every row (find_slot_tile's WITH_NONE) also give tiles to rank-0
slots and to group L, with rank 0; past the last tile their programs get no rows (rows left <= 0).
"""
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton without grid dependency control: launchers never ask for PDL (launch.uses_pdl)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def find_slot_tile(pid, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots, max_rank, capacity,
                   BLOCK_M: tl.constexpr, SLOTS_POW2: tl.constexpr, WITH_NONE: tl.constexpr = False,
                   stride_counts=1, stride_starts=1, stride_rank=1):
    """Map token-tile program ``pid`` to (slot, first row in sorted_token_ids, rows left, rank).

    slot_counts_ptr / slot_starts_ptr: int32 [num_slots + 1]; rank_ptr: int32 [num_slots]; each at its
    stride (stride_counts, stride_starts, stride_rank; 1, the usual value, is specialised by Triton, and
    the checks keep every offset within int32).
    num_slots: L; max_rank: R (ranks are clamped to [0, R]); capacity: length of sorted_token_ids
    (counts and starts are clamped to it, so corrupt metadata cannot send a read out of bounds).
    BLOCK_M: tokens per tile; SLOTS_POW2: next power of two >= L.
    Returns rank 0 when ``pid`` is past the last tile.
    WITH_NONE: tiles also cover the tokens without a delta, with rank 0: every slot's tokens, rank-0 slots
    too, then those of group L (no adapter), so the tiles cover every token (a kernel that writes all of its
    output, not adds to it). Group L's count and start are two scalar loads beside the slots' vector loads,
    in the same round trip, and its tiles return a slot >= L. (A vector of L + 1 lanes, eight where four
    do, made Triton 3.9 spill lora_grad_x's float32 tiles at their 128 registers.)
    """
    ls = tl.arange(0, SLOTS_POW2)
    in_range = ls < num_slots
    # Counts, ranks and starts in one round trip: at decode sizes a kernel is a chain of dependent memory
    # round trips (metadata, token ids, operands), and the start loaded after the slot was known was one more.
    cnt = tl.load(slot_counts_ptr + ls * stride_counts, mask=in_range, other=0)
    rk = tl.load(rank_ptr + ls * stride_rank, mask=in_range, other=0)
    starts = tl.load(slot_starts_ptr + ls * stride_starts, mask=in_range, other=0)
    cnt = tl.minimum(tl.maximum(cnt, 0), capacity)
    rk = tl.minimum(tl.maximum(rk, 0), max_rank)
    if WITH_NONE:
        tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    else:
        tiles = tl.where(rk > 0, (cnt + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    slot = tl.sum((ends <= pid).to(tl.int32), 0)
    mine = ls == slot
    tile = pid - tl.sum(tl.where(mine, ends - tiles, 0), 0)
    count = tl.sum(tl.where(mine, cnt, 0), 0)
    rank = tl.sum(tl.where(mine, rk, 0), 0)
    start = tl.sum(tl.where(mine, starts, 0), 0)
    if WITH_NONE:
        none = slot >= num_slots   # past every slot's tiles: group L's
        none_count = tl.load(slot_counts_ptr + num_slots * stride_counts)
        none_start = tl.load(slot_starts_ptr + num_slots * stride_starts)
        tile = tl.where(none, pid - tl.sum(tiles, 0), tile)
        count = tl.where(none, tl.minimum(tl.maximum(none_count, 0), capacity), count)
        start = tl.where(none, none_start, start)
    start = tl.minimum(tl.maximum(start, 0), capacity)
    return slot, start + tile * BLOCK_M, count - tile * BLOCK_M, rank


@triton.jit
def find_slice_chunk(pid_n, SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """Map column-chunk program ``pid_n`` to (slice, its chunk's first column, the slice's column end).

    SLICE_COLS: S + 1 column offsets of the output slices (0, n_0, n_0 + n_1, ..., N); SLICE_CHUNKS: S + 1
    offsets of each slice's first chunk of CHUNK columns (prefix sums of cdiv(n_i, CHUNK)). The caller
    returns when ``pid_n >= SLICE_CHUNKS[-1]``.
    """
    slice_id = 0
    col_lo = 0
    col_hi = SLICE_COLS[1]
    chunk_lo = 0
    for i in tl.static_range(1, len(SLICE_CHUNKS) - 1):
        later = pid_n >= SLICE_CHUNKS[i]
        slice_id = tl.where(later, i, slice_id)
        col_lo = tl.where(later, SLICE_COLS[i], col_lo)
        col_hi = tl.where(later, SLICE_COLS[i + 1], col_hi)
        chunk_lo = tl.where(later, SLICE_CHUNKS[i], chunk_lo)
    return slice_id, col_lo + (pid_n - chunk_lo) * CHUNK, col_hi


@triton.jit
def find_slice_block(pid_n, SLICE_COLS: tl.constexpr, SLICE_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Map column-block program ``pid_n`` to (slice, its columns [BLOCK_N], which of them exist)."""
    slice_id, col0, col_hi = find_slice_chunk(pid_n, SLICE_COLS, SLICE_BLOCKS, BLOCK_N)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    return slice_id, offs_n, offs_n < col_hi


@triton.jit
def load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M: tl.constexpr, stride_ids=1):
    """Token ids [BLOCK_M] of a tile and their validity (in the tile, in the buffer, in [0, M)); sorted_ids
    at stride ``stride_ids``.

    Invalid entries get token 0 (M >= 1 whenever a kernel runs), so a load that skips the row mask stays
    in bounds."""
    offs = tl.arange(0, BLOCK_M)
    rows = row0 + offs
    valid = (offs < rows_left) & (rows < capacity)
    tok = tl.load(sorted_ids_ptr + rows * stride_ids, mask=valid, other=0)
    valid = valid & (tok >= 0) & (tok < M)
    return tl.where(valid, tok, 0).to(tl.int64), valid


@triton.jit
def store_zero_rows(out_ptr, tok, valid, col_offsets, col_ok, stride_row, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Zeros into a token tile's rows of an output, where a kernel that writes every row meets tokens without a
    delta: rows ``tok`` [BLOCK_M] (``stride_row`` apart) where ``valid``, columns at ``col_offsets`` [BLOCK_N]
    (elements from a row's start) where ``col_ok``."""
    tl.store(out_ptr + tok[:, None] * stride_row + col_offsets[None, :],
             tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def expand_tile_rows(h_ptr, y_ptr, tok, slot, slice_id, h_offset, stride_hm, stride_hs, stride_hl, stride_ym,
                     SCALE_BY_SLOT: tl.constexpr):
    """The expand's row pointers for a token tile: (h rows of its slice, y rows).

    With SCALE_BY_SLOT, h holds every slot's h (the stacked GEMM's) and the tile's slot's block starts
    h_offset + slot * stride_hl further."""
    h_rows = h_ptr + tok[:, None] * stride_hm + slice_id * stride_hs
    if SCALE_BY_SLOT:
        h_rows += h_offset + slot.to(tl.int64) * stride_hl
    return h_rows, y_ptr + tok[:, None] * stride_ym


@triton.jit
def load_h_parts(part_rows, h_mask, r_ok, num_parts, part_step, PART_CHUNK: tl.constexpr,
                 H_PRECISION: tl.constexpr):
    """A token tile's h (the expand's one-rank-block path) as (hi, lo) terms for kernels.work.dot_split:
    part 0 at ``part_rows`` [BLOCK_M, BLOCK_R] pointers, the other num_parts - 1 split-K partial sums
    ``part_step`` elements apart added in split order, PART_CHUNK loads in flight together. h was written
    by another kernel and is read once per program: past L1 (.cg). Columns outside ``r_ok`` become 0."""
    ht = tl.load(part_rows, mask=h_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for p0 in range(1, num_parts, PART_CHUNK):  # the splits' partial sums, added in split order
        chunk_rows = part_rows + p0 * part_step
        for i in tl.static_range(PART_CHUNK):
            exists = (r_ok.to(tl.int32) * 0 + p0 + i) < num_parts  # a tensor: the interpreter takes no scalar masks
            ht += tl.load(chunk_rows + i * part_step, mask=h_mask & exists[None, :], other=0.0,
                          cache_modifier=".cg")
    return split_f32(tl.where(r_ok[None, :], ht, 0.0), H_PRECISION)


@triton.jit
def rank_ceil(rank, RANK_ALIGN: tl.constexpr):
    """``rank`` rounded up to a multiple of RANK_ALIGN, and declared so.

    A load masked on ``offs < rank`` with ``rank`` a run-time value reads one element per instruction
    (the compiler cannot prove that a vector of adjacent elements is all in or all out); masked on
    ``offs < rank_ceil(rank)`` it reads RANK_ALIGN at a time (H200, Triton 3.6: the rank loop's operands
    went from 4-byte to 16-byte cp.async). RANK_ALIGN must divide the stack's max rank R (the launcher
    takes ``heuristics.rank_align(R)``), so the rounded bound stays <= R and in bounds; the elements
    between the rank and the bound are zeroed after the load (``tl.where(offs < rank, v, 0)``: garbage
    there, even NaN, never reaches a product).
    """
    return tl.multiple_of((rank + RANK_ALIGN - 1) // RANK_ALIGN * RANK_ALIGN, RANK_ALIGN)


@triton.jit
def split_f32(a, PRECISION: tl.constexpr):
    """A float32 tensor as the tensor-core operand(s) ``dot_split`` takes for PRECISION:

    "ieee" (b float32): a itself, exact fp32 products; "tf32" (b float16: fp16 fits tf32 exactly, ``a``
    keeps fp32 range): a itself; "bf16x2" (b bfloat16): two bf16 terms hi + lo, about 16 significant
    bits, two MMAs; "bf16" (b bfloat16, launch.set_fast_bf16): one bf16 term, 8 significant bits, one MMA.
    Returns (hi, lo); lo is hi where unused. Splitting once lets a kernel reuse the terms across several
    dots (kernels.expand).
    """
    if PRECISION == "bf16x2":
        hi = a.to(tl.bfloat16)
        lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
    elif PRECISION == "bf16":
        hi = a.to(tl.bfloat16)
        lo = hi
    else:
        hi = a
        lo = a
    return hi, lo


@triton.jit
def _mma(term, b, acc, TERM_RIGHT: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + term @ b, or acc + b @ term with TERM_RIGHT (INPUT_PRECISION applies to float32 operands only).

    No defaults for the constexprs of helpers like this one: Triton 3.6 hands a called function's string
    default in as a plain str, not a constexpr, and fails to compile it (3.9 wraps it)."""
    if TERM_RIGHT:
        acc = tl.dot(b, term, acc, input_precision=INPUT_PRECISION)
    else:
        acc = tl.dot(term, b, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def dot_split(hi, lo, b, acc, PRECISION: tl.constexpr, TERMS_RIGHT: tl.constexpr):
    """acc + a @ b from ``split_f32(a, PRECISION)``, ``b`` in the weights' dtype, accumulated in float32;
    with TERMS_RIGHT, acc + b @ a (:func:`dot_t`)."""
    if PRECISION == "bf16x2":
        acc = _mma(hi, b, acc, TERMS_RIGHT, "tf32")   # bf16 operands: input_precision does not apply
        acc = _mma(lo, b, acc, TERMS_RIGHT, "tf32")
    elif PRECISION == "bf16":
        acc = _mma(hi, b, acc, TERMS_RIGHT, "tf32")
    elif PRECISION == "tf32":
        acc = _mma(hi, b.to(tl.float32), acc, TERMS_RIGHT, "tf32")
    else:
        acc = _mma(hi, b, acc, TERMS_RIGHT, "ieee")
    return acc


@triton.jit
def dot_t(b_t, a_t, acc_t, PRECISION: tl.constexpr):
    """acc_t + b_t @ a_t with ``a_t`` float32, computed in registers, and ``b_t`` in the weights' dtype: the
    transposed form of acc + a @ b (acc_t = acc^T, b_t = b^T, a_t = a^T), which keeps the float32 operand
    on the MMA's right, where the tensor cores read it from shared memory.

    Why (Hopper): an operand computed in registers can only be the left one of a wgmma, read from the
    registers while the MMA runs asynchronously; in a pipelined loop with Triton 3.6's ptxas (12.8) the
    next step overwrote those registers before the MMA had read them (triton-lang/triton#9433, fixed in
    ptxas 13.3). H200, session 20 (benchmarks/lab_wrong_values.py): the expand's rank loop at 64 x 256
    tiles and 4 warps wrote stale or garbage products into a few rows of a tile in 1 to 5 runs of 6. On
    the right the compiler stages the operand in shared memory, and the wgmma reads both from there.
    PRECISION as :func:`split_f32`; "tf32" widens ``b_t`` (fp16) to float32 on the left (the one form
    that still reads registers), "ieee" multiplies in float32 without tensor cores.
    """
    hi, lo = split_f32(a_t, PRECISION)
    return dot_split(hi, lo, b_t, acc_t, PRECISION, True)


@triton.jit
def dot_f32_lhs(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with ``a`` float32 and ``b`` in the weights' dtype (see :func:`split_f32`)."""
    hi, lo = split_f32(a, PRECISION)
    return dot_split(hi, lo, b, acc, PRECISION, False)
