"""The batch metadata in one launch (lora_ops.batch): a counting sort of the tokens by slot in one program.
Its launcher is lora_ops.launch_batch."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def batch_meta_kernel(
    slots_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr, slots_out_ptr,
    num_tokens, num_slots,
    stride_slots, stride_ids, stride_starts, stride_counts, stride_out,
    BLOCK_T: tl.constexpr, KEYS: tl.constexpr, WRITE_SLOTS: tl.constexpr = False,
):
    """sorted_token_ids, slot_starts and slot_counts from per-token slots, as lora_ops.batch.fill_batch_meta's
    torch ops compute them (a stable sort by key; key = the slot where it lies in [0, L), else L, 'no
    adapter'), in one program of one launch: two passes over the tokens, BLOCK_T at a time.

    slots_ptr: int32 or int64 [num_tokens] at stride_slots (any value: out of range means 'no adapter').
    sorted_ids_ptr: int32 [>= num_tokens] at stride_ids: entry i is the token at place i (first num_tokens
    entries written, the rest left as they are). slot_starts_ptr, slot_counts_ptr: int32 [L + 1] at
    stride_starts / stride_counts, every entry written. num_tokens: M; num_slots: L.
    slots_out_ptr (WRITE_SLOTS): int32 [>= num_tokens] at stride_out: entry t gets token t's slot where it lies
    in [0, L), else -1 (a LoRAContext's per-token slots, which it then need not copy first: a copy into int32
    would wrap an int64 slot past int32's range into one in range). It may be slots_ptr itself: what it
    writes maps to the same keys, so pass 2 reads the same batch.
    BLOCK_T: tokens per step (a power of two); KEYS: a power of two >= L + 1 (keys past L unused; masked-off
    tokens take key KEYS, which no column matches).

    Pass 1 counts the tokens per key (a one-hot [BLOCK_T, KEYS] summed over tokens); the starts are the
    counts' exclusive prefix sum. Pass 2 places each token at its key's start + the tokens of its key
    before it: those of earlier steps (``seen``) and of this step (the one-hot's inclusive prefix sum down
    the tokens, read in the token's own column). No atomics, so the order is the tokens' own: stable.
    """
    keys = tl.arange(0, KEYS)
    counts = tl.zeros([KEYS], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        key = _key(slots_ptr, t0, num_tokens, num_slots, stride_slots, BLOCK_T, KEYS)
        if WRITE_SLOTS:
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(slots_out_ptr + t * stride_out, tl.where(key < num_slots, key, -1), mask=t < num_tokens)
        counts += tl.sum((key[:, None] == keys[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    written = keys <= num_slots
    tl.store(slot_counts_ptr + keys * stride_counts, counts, mask=written)
    tl.store(slot_starts_ptr + keys * stride_starts, starts, mask=written)
    seen = starts
    for t0 in range(0, num_tokens, BLOCK_T):
        key = _key(slots_ptr, t0, num_tokens, num_slots, stride_slots, BLOCK_T, KEYS)
        onehot = (key[:, None] == keys[None, :]).to(tl.int32)     # all zero past num_tokens
        before = tl.cumsum(onehot, axis=0) - onehot           # tokens of the same key earlier in this step
        place = tl.sum((before + seen[None, :]) * onehot, axis=1)
        t = t0 + tl.arange(0, BLOCK_T)
        tl.store(sorted_ids_ptr + place * stride_ids, t, mask=t < num_tokens)
        seen += tl.sum(onehot, axis=0)


@triton.jit
def _key(slots_ptr, t0, num_tokens, num_slots, stride_slots, BLOCK_T: tl.constexpr, KEYS: tl.constexpr):
    """int32 [BLOCK_T]: the key of token t0 + i, its slot where it lies in [0, L), else L; KEYS (no one-hot
    column) past num_tokens. Compared in the slots' own dtype: an int64 slot is never narrowed first."""
    t = t0 + tl.arange(0, BLOCK_T)
    inside = t < num_tokens
    slot = tl.load(slots_ptr + t * stride_slots, mask=inside, other=-1)
    key = tl.where((slot >= 0) & (slot < num_slots), slot, num_slots).to(tl.int32)
    return tl.where(inside, key, KEYS)
