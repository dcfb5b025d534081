"""Heuristic kernel configs from shapes alone (never from data, never from the raw token count).

The token count enters only through a bucket (decode <= 16, small <= 64, prefill above), so every
batch size in a bucket shares one config, and configs never change between CUDA-graph replays.
"""
from typing import NamedTuple

import triton

# Programs to aim for with split-K at decode sizes: a couple of waves on a ~132-SM GPU.
TARGET_PROGRAMS = 256


class ShrinkConfig(NamedTuple):
    block_m: int
    block_r: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


class ExpandConfig(NamedTuple):
    block_m: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int


def token_bucket(num_tokens):
    return 16 if num_tokens <= 16 else 64 if num_tokens <= 64 else 128


def rank_block(max_rank):
    # tl.dot needs every dimension >= 16; 64 keeps the fp32 accumulator tile in registers.
    return max(16, min(64, triton.next_power_of_2(max_rank)))


def max_token_tiles(num_tokens, num_slots, block_m):
    """Upper bound on (slot, token tile) pairs: each slot adds at most one partial tile."""
    return min(triton.cdiv(num_tokens, block_m) + num_slots, num_tokens)


def shrink_config(num_tokens, in_features, num_slices, max_rank, num_slots):
    block_m = min(token_bucket(num_tokens), 64)
    block_r = rank_block(max_rank)
    block_k = max(16, min(128, triton.next_power_of_2(in_features)))
    programs = num_slices * triton.cdiv(max_rank, block_r) * max_token_tiles(num_tokens, num_slots, block_m)
    split_k = max(1, min(TARGET_PROGRAMS // max(programs, 1), triton.cdiv(in_features, block_k), 32))
    return ShrinkConfig(block_m, block_r, block_k, split_k, num_warps=4, num_stages=2)


def expand_config(num_tokens, out_features, max_rank, num_slots):
    bucket = token_bucket(num_tokens)
    block_m = bucket if bucket < 128 else 64
    block_n = max(16, min(128, triton.next_power_of_2(out_features)))
    return ExpandConfig(block_m, block_n, rank_block(max_rank), num_warps=4, num_stages=2)
