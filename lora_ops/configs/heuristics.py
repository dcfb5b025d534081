"""Heuristic kernel configs from shapes alone (never from data, never from the raw token count).

The token count enters only through its bucket (:data:`TOKEN_BUCKETS`), so every batch size in a bucket
shares one config: a new batch size never changes a constexpr (no recompiles) and configs never change
between CUDA-graph replays.
"""
import functools
from typing import NamedTuple

# Programs to aim for with split-K at decode sizes: about two waves on a 132-SM GPU.
TARGET_PROGRAMS = 256
MAX_SPLIT_K = 32
# Upper edges of the token-count buckets; past the last, the last bucket.
TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 8192)


def cdiv(a, b):
    # Plain Python: triton.cdiv is a JIT-callable whose host-side call costs microseconds.
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def next_power_of_2(n):
    # Remembered: launchers ask for the slot count's power on every launch.
    return 1 << max(int(n) - 1, 0).bit_length()


class ShrinkConfig(NamedTuple):
    block_m: int
    block_r: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    slice_group: int = 1   # slices computed by one program (a power of two): x is read once for them


class ExpandConfig(NamedTuple):
    block_m: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    n_loop: int = 1        # column blocks one program streams through (kernels.expand)
    m_loop: int = 1        # token tiles one program walks with its block of B held (n_loop 1, rank in one block)
    planes_in_turn: bool = False   # the rank loop over h's planes, one dot a step (kernels.expand; slower)


class FusedConfig(NamedTuple):
    """The one-launch add_lora_ kernel (lora_ops.kernels.fused)."""
    block_m: int
    block_n: int
    block_r: int
    block_k: int
    num_warps: int
    num_stages: int


# The one-launch path recomputes a tile's h in every column block, reading about (BLOCK_M + rank) * K
# values per program, one program per SM doing all of K. On the H200 (2026-12-02 tuning) it only broke
# even with two launches at one token and rank 16 (K 4096) and lost everywhere else, so the heuristic
# takes it only there; the tuner records the shapes where it wins.
FUSED_MAX_BUCKET = 1
FUSED_MAX_RANK_K = 16 * 4096


def token_bucket(num_tokens):
    for edge in TOKEN_BUCKETS:
        if num_tokens <= edge:
            return edge
    return TOKEN_BUCKETS[-1]


def feature_block(features):
    """The block along a feature dimension (K, N): the next power of two, clamped to [16, 128]."""
    return max(16, min(128, next_power_of_2(features)))


def rank_block(max_rank):
    # tl.dot needs every dimension >= 16; 64 keeps the fp32 accumulator tile in registers.
    return max(16, min(64, next_power_of_2(max_rank)))


def rank_align(max_rank):
    """The largest power of two up to 8 dividing the max rank R: kernels mask rank columns on the rank
    rounded up to it, so their loads read that many elements at a time (kernels.work.rank_ceil)."""
    return min(8, max_rank & -max_rank) if max_rank > 0 else 1


def rank_loops(max_rank):
    """Whether the rank is past one 64-wide rank block, where the expand may run its rank loop
    (kernels.expand). The heuristic's own path: :func:`expand_rank_loops`; a config's: the rank loop runs
    where its block_r is below the rank (launch.takes_partials)."""
    return max_rank > rank_block(max_rank)


# The expand may also hold a rank above 64 in one block (tuned tables, decode sizes): block_m x block_r
# values of h per program at most. sm_90 PTX (2026-12-03): 16 x 512 takes 108-173 registers at 8 warps;
# 32 x 512 and 64 x 512 take 255, at the edge of spilling.
ONE_BLOCK_MAX_H_TILE = 16 * 512


def one_block_rank(max_rank):
    """The expand's rank block that holds the whole rank in one block (a power of two, at least 16)."""
    return max(16, next_power_of_2(max_rank))


# Where the heuristic's expand holds the whole rank in one block: (up to this token bucket, a block up to this
# rank (one_block_rank), out_features x that block up to this many, or None: any width). Each of a token
# tile's column blocks re-reads all of the shrink's split-K partial sums, so at rank 320 and at 256 tokens
# wide outputs take the rank loop (whose shrink sums its own splits). From the H200 table's choices
# (2026-12-03, Llama-3-8B and Phi-4-mini, ranks 128-320) and three timings of the heuristic against the table
# (highrank grid, M <= 256, session 11; `benchmarks/results/lab-h200-2026-12-03-session11.md` §7): rank 320 in
# a 512 block at one token (Llama qkv 17.8 -> 13.0 µs, o 14.6 -> 12.5; gate_up, 28672 wide, keeps the loop)
# and at 16 tokens for o and down; ranks <= 256 up to 64 tokens at any width (Llama gate_up r256 at 16
# tokens: one block 36.7 µs, the rank loop 47.0); rank 128, and 256 for o and down, at 256 tokens (Llama o
# r128 26.1 -> 17.0 µs).
ONE_BLOCK_LIMITS = ((1, 512, 8 << 20), (16, 512, 2_200_000), (64, 256, None), (256, 256, 1_100_000))
# Its column block up to 64 tokens: the widest of 128 / 64 / 32 leaving this many programs (a decode step
# of a 4096-wide layer has one token tile: 32 programs of 128 columns left most SMs idle; 32 columns won).
ONE_BLOCK_MIN_PROGRAMS = 96


def expand_rank_loops(bucket, max_rank, out_features):
    """Whether the heuristic's expand runs its rank loop (kernels.expand) for this bucket, rank and output
    width; if not, the whole rank is one block and the expand adds the shrink's split-K partial sums itself."""
    if not rank_loops(max_rank):
        return False
    block = one_block_rank(max_rank)
    return not any(bucket <= b and block <= r and (n is None or out_features * block <= n)
                   for b, r, n in ONE_BLOCK_LIMITS)


def max_token_tiles(num_tokens, num_slots, block_m):
    """Upper bound on (slot, token tile) pairs: each slot adds at most one partial tile; each tile holds
    at least one token. The grid's token axis has this size (programs past the real work return).
    It also bounds the tiles of the L + 1 groups a kernel that writes every row walks (group L: the tokens
    without an adapter; kernels.work.find_slot_tile's WITH_NONE): G groups of M tokens in all make at most
    sum ceil(c_g / B) <= (M + G (B - 1)) / B < cdiv(M, B) + G tiles, so cdiv(M, B) + G - 1 with G = L + 1."""
    return min(cdiv(num_tokens, block_m) + num_slots, num_tokens)


def block_m_for(bucket):
    return max(16, min(64, bucket))


def slice_group_for(num_slices, block_r):
    """All slices in one program while the dot stays at most 128 columns wide."""
    return min(next_power_of_2(num_slices), max(1, 128 // block_r))


# Split-K partial sums the expand adds itself (add_lora_, ranks of one block): every column block of a
# token tile re-reads all of them, so their count is capped where they feed an expand.
MAX_EXPAND_PARTS = 8


# The shrink op alone (out_features None: the backward's h, and its dh through lora_grad_h) sums its own splits
# through arrival counters, and no table serves it. From the 1024-token bucket (257 tokens on) a split there
# keeps at least this many K steps (of the widest slice, for lora_grad_h), on 8 warps: on an H100 (2026-12-06,
# benchmarks/results/lab-train-ops-h100-2026-12-06-session40.md; Llama-3-8B and Phi-4-mini layers, ranks 16
# and 64, 1024 and 4096 tokens) the 6-12 splits the program target gives at 1024 tokens ran 1.2-2.2x the time
# of 2-4 (a split of 2-5 steps barely fills its pipeline); this rule's configs took the shrink op to 0.80 of the
# heuristic's time (geomean of the 30 rows where the sweep ran them, worst 1.00) and lora_grad_h to 0.87 (worst
# 1.01). Smaller buckets (not measured) keep the program target alone.
SELF_SUM_MIN_BUCKET = 1024
SELF_SUM_MIN_K_STEPS = 16


def shrink_config(bucket, in_features, num_slices, max_rank, num_slots, out_features=None):
    """out_features: the width of the expand that adds this shrink's split-K partial sums (add_lora_);
    None where the shrink adds its splits itself (the shrink op)."""
    block_m = block_m_for(bucket)
    block_r = rank_block(max_rank)
    group = slice_group_for(num_slices, block_r)
    block_k = feature_block(in_features)
    programs = cdiv(num_slices, group) * cdiv(max_rank, block_r) * max_token_tiles(bucket, num_slots, block_m)
    most = (MAX_SPLIT_K if out_features is None or expand_rank_loops(bucket, max_rank, out_features)
            else MAX_EXPAND_PARTS)
    split_k = max(1, min(TARGET_PROGRAMS // max(programs, 1), cdiv(in_features, block_k), most))
    # H200 tuning (configs/tuned): 3 stages at most shapes (4 won at some from 1024 tokens and lost by up to
    # 1.3x at others, session 19: not a rule), 8 warps once the rank block is 64 wide.
    num_warps = 8 if block_r >= 64 else 4
    if out_features is None and bucket >= SELF_SUM_MIN_BUCKET:
        split_k = max(1, min(split_k, cdiv(in_features, block_k) // SELF_SUM_MIN_K_STEPS))
        num_warps = 8
    return ShrinkConfig(block_m, block_r, block_k, split_k, num_warps=num_warps, num_stages=3, slice_group=group)


def prefers_fused(bucket, in_features, max_rank):
    return bucket <= FUSED_MAX_BUCKET and max_rank * in_features <= FUSED_MAX_RANK_K


def fused_config(bucket, in_features, max_rank):
    block_k = feature_block(in_features)
    return FusedConfig(block_m_for(bucket), 128, rank_block(max_rank), block_k, num_warps=4, num_stages=3)


# From 256 tokens a program may stream up to 8 column blocks (H200, 2026-12-02: Llama gate_up r64 at 4096
# tokens 270 -> 183 µs, qkv r64 at 1024 tokens 17.7 -> 13.8 µs), as long as about EXPAND_MIN_PROGRAMS
# programs remain to fill the GPU (qkv r16 at 256 tokens has 384 blocks in all: 4 per program took 2x).
EXPAND_MAX_N_LOOP = 8
EXPAND_N_LOOP_MIN_BUCKET = 256
EXPAND_MIN_PROGRAMS = 512


# float32's dots are IEEE (lora_ops never computes float32 in TF32 behind the caller's back): FMA loops that
# hold whole operand tiles in registers, where the bf16 tiles above spill on sm_90 (ptxas, Triton 3.6, a
# qkv-like layer: lora_grad_x 53 KB a thread, segment_outer 18 KB, the expand up to 17 KB; DESIGN §4). On a
# GPU float32 takes narrower tiles and 8 warps, which compile without spills at ranks 16-320 (tests:
# sm90_codegen.float32_spills); the expand keeps its rank tile, on which its path (one block, or the rank
# loop) and add_lora_'s split-K pairing depend. The CPU (the interpreter, the tests' float32) keeps the
# tiles above.
F32_WARPS = 8


def float32_tiles(cfg):
    """``cfg`` (a shrink, expand or one-launch config) as float32 takes it on a GPU."""
    if isinstance(cfg, ShrinkConfig):
        block_r = min(cfg.block_r, 16)
        # More rank blocks fill the GPU: the split count shrinks as they grow (it was chosen for cfg.block_r).
        return cfg._replace(block_r=block_r, block_k=min(cfg.block_k, 64), num_warps=F32_WARPS, slice_group=1,
                            split_k=max(1, cdiv(cfg.split_k * block_r, cfg.block_r)))
    if isinstance(cfg, ExpandConfig):   # (a rank in one block past 64, at decode sizes: 16 columns a block)
        return cfg._replace(block_m=min(cfg.block_m, 64), block_n=min(cfg.block_n, 16 if cfg.block_r > 64 else 32),
                            num_warps=F32_WARPS)
    if isinstance(cfg, FusedConfig):
        return cfg._replace(block_n=min(cfg.block_n, 32), block_k=min(cfg.block_k, 64), num_warps=F32_WARPS)
    return cfg


# float16's expand meets the float32 h in "tf32" (kernels.work.split_f32): its B tile is widened to float32,
# twice bfloat16's shared memory. A rank of 257-512 in one block with 128 columns took 292 KiB, past sm_90's
# 227 (the H200 table's decode entries at ranks 257-512, tuned in bf16, and the heuristic's at 16384-wide
# outputs; sm90_codegen, 2026-12-06). At most this many B elements a tile in float16: 64 columns at 512.
FLOAT16_MAX_B_TILE = 512 * 64


def float16_tiles(cfg):
    """``cfg`` as float16 takes it on a GPU: an expand (or one-launch) column block narrowed where its B tile,
    widened to float32, would pass :data:`FLOAT16_MAX_B_TILE`; anything else as it is."""
    if isinstance(cfg, (ExpandConfig, FusedConfig)) and cfg.block_r * cfg.block_n > FLOAT16_MAX_B_TILE:
        return cfg._replace(block_n=max(16, FLOAT16_MAX_B_TILE // cfg.block_r))
    return cfg


def expand_config(bucket, out_features, max_rank, num_slots):
    block_r = rank_block(max_rank)
    if rank_loops(max_rank):
        # Past one 64-wide block: at decode sizes the whole rank in one block (ONE_BLOCK_LIMITS), else
        # the rank loop, a GEMM with K = rank. Since its loads are vectors (kernels.work.rank_ceil) the
        # tuner picks 64 x 256 tiles, 32-wide rank steps, 4 warps at every high-rank shape at 4096 tokens
        # (H200, 2026-12-03: 24 shapes, Llama-3-8B and Phi-4-mini, ranks 128-320; 1.1-1.3x the former
        # 128 x 256 x 64, 8 warps, whose registers spill).
        if bucket >= 1024:
            return ExpandConfig(64, 256, 32, num_warps=4, num_stages=3)
        if not expand_rank_loops(bucket, max_rank, out_features):
            if bucket > 64:   # the table's choice at 256 tokens
                return ExpandConfig(32, 128, one_block_rank(max_rank), num_warps=4, num_stages=2)
            tiles = max_token_tiles(bucket, num_slots, 16)
            block_n = next((bn for bn in (128, 64) if cdiv(out_features, bn) * tiles >= ONE_BLOCK_MIN_PROGRAMS), 32)
            return ExpandConfig(16, block_n, one_block_rank(max_rank), num_warps=8, num_stages=2)
        # The rank loop below 1024 tokens: token tiles of half the bucket, 16 to 64 rows (the table's at rank
        # 320: 16 rows at 16 tokens, 32 at 64; 32 rows at 16 tokens took 1.14-1.33x the time).
        return ExpandConfig(max(16, min(64, bucket // 2)), feature_block(out_features), block_r, num_warps=4,
                            num_stages=3)
    block_m, block_n = block_m_for(bucket), feature_block(out_features)
    n_loop = 1
    if bucket >= EXPAND_N_LOOP_MIN_BUCKET:
        block_n = min(64 if max_rank > 32 else 128, block_n)
        blocks = cdiv(out_features, block_n) * max_token_tiles(bucket, num_slots, block_m)
        while n_loop < EXPAND_MAX_N_LOOP and blocks // (2 * n_loop) >= EXPAND_MIN_PROGRAMS:
            n_loop *= 2
    return ExpandConfig(block_m, block_n, block_r, num_warps=4, num_stages=2, n_loop=n_loop)
