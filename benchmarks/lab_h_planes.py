"""Lab (session 18, not yet run on a GPU): the high-rank expand reading h as bf16 planes instead of float32.

At ranks 128-320 add_lora_'s expand runs at 4.4-5.2x its MMA floor (lab_kernel_parts.py, session 18). Its
rank loop loads each block of h as float32 and splits it in registers into two bf16 terms (hi, lo) for two
MMAs (kernels.work.split_f32, "bf16x2"), so h goes global -> registers -> (split) -> the MMA's operand
layout on every rank step. Here the split is done once, before the expand, into two planes
[2, M, S, R] bf16 (hi = bf16(h), lo = bf16(h - hi)): both operands of every dot are then plain bf16 loads
that can stream into shared memory for the tensor cores, the same arithmetic in the same order (the shipped
kernel adds hi·B, then lo·B, per rank block). One plane (hi only) is what launch.set_fast_bf16 computes.

Variants per row (the shrink's h as the shipped add_lora_ makes it, summed over split-K parts where it has
them):

    expand                the shipped expand (kernels.expand, rank loop) on the float32 h, the table's config
    planes2               this file's kernel on two bf16 planes, the same tile
    planes1               the same on the hi plane alone
    planes2 <tile>        two planes on larger tiles (BLOCK_M x BLOCK_N x BLOCK_R, warps, stages), which the
                          in-register split kept from paying (the tuner's 128 x 256 lost)

Each variant's delta is checked against the shipped expand's (relative Frobenius error, printed); timed as
CUDA-graph replays (cold L2, benchmarks/timing.py). If planes2 wins clearly, the shrink should write the
planes itself (its epilogue has the full sum when it sums its own splits) and the expand take them.

    python benchmarks/lab_h_planes.py                        # H200 (MS, default 4096)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_h_planes.py   # logic check, tiny, float16
"""
import functools

import torch
import triton
import triton.language as tl

import repo_path  # noqa: F401,E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints, rank_loop_rows  # noqa: E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig, max_token_tiles, next_power_of_2, rank_align  # noqa: E402
from lora_ops.kernels.work import find_slice_chunk, find_slot_tile, load_tile_tokens, rank_ceil  # noqa: E402
from timing import Timer  # noqa: E402

TOKENS = ints("MS", "4096" if not TINY else "48")


@triton.jit(do_not_specialize=["M"])
def expand_planes_kernel(
    hp_ptr, b_ptr, y_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, num_slots, max_rank, capacity,
    stride_hp, stride_hm, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_POW2: tl.constexpr,
    RANK_ALIGN: tl.constexpr, PLANES: tl.constexpr,
):
    """One program: one token tile of one slot times one column block of one output slice.

    Pointers: hp [2, M, S, R] in B's dtype (plane 0 hi, plane 1 lo; scale already in h, as the shrink
    writes it), B [L, N, R], y [M, N] (read and written once), rank [L] int32, sorted_ids [capacity],
    slot_starts / slot_counts [L + 1] int32. Sizes: M tokens, num_slots L, max_rank R, capacity.
    Strides: every dimension of hp, B and y, in elements. SLICE_COLS / SLICE_CHUNKS: as kernels.expand
    (one column block a chunk). PLANES: 2 (hi·B + lo·B per rank block) or 1 (hi·B).
    Grid: (column blocks, token-tile bound).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_n >= SLICE_CHUNKS[len(SLICE_CHUNKS) - 1]:
        return
    slice_id, col0, col_hi = find_slice_chunk(pid_n, SLICE_COLS, SLICE_CHUNKS, BLOCK_N)
    slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                  max_rank, capacity, BLOCK_M, SLOTS_POW2)
    if rank == 0:
        return
    tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < col_hi
    h_rows = hp_ptr + tok[:, None] * stride_hm + slice_id * stride_hs
    b_cols = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    full = rank // BLOCK_R * BLOCK_R
    for r0 in range(0, full, BLOCK_R):
        rs = r0 + offs_r
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=n_ok[None, :], other=0.0)
        acc = tl.dot(tl.load(h_rows + rs[None, :] * stride_hr), bt, acc)
        if PLANES == 2:
            acc = tl.dot(tl.load(h_rows + stride_hp + rs[None, :] * stride_hr), bt, acc)
    if full < rank:   # the last rank block, partial: masked to the rank, rounded up for vector loads
        rs = full + offs_r
        r_ok = rs < rank
        r_in = rs < rank_ceil(rank, RANK_ALIGN)
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=r_in[:, None] & n_ok[None, :], other=0.0)
        bt = tl.where(r_ok[:, None], bt, 0.0)
        hi = tl.load(h_rows + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0)
        acc = tl.dot(tl.where(r_ok[None, :], hi, 0.0), bt, acc)
        if PLANES == 2:
            lo = tl.load(h_rows + stride_hp + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0)
            acc = tl.dot(tl.where(r_ok[None, :], lo, 0.0), bt, acc)
    mask = valid[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def h_planes(h_parts, dtype):
    """[2, M, S, R] planes (hi, lo) in ``dtype`` of the float32 h summed over its split-K parts [P, M, S, R]."""
    h = h_parts.sum(0) if h_parts.shape[0] > 1 else h_parts[0]
    hi = h.to(dtype)
    return torch.stack([hi, (h - hi.float()).to(dtype)])


def planes_launch(y, planes, p, cfg, num_planes):
    """The lab kernel bound to its arguments, with the shipped expand config's tile sizes."""
    cols, chunks = launch.slice_layout(p.widths, cfg.block_n)
    grid = (chunks[-1], max_token_tiles(p.M, p.L, cfg.block_m))
    ids, starts, counts = p.meta

    def run(i):
        expand_planes_kernel[grid](
            planes, i.lora_b, y, p.rank, ids, starts, counts, p.M, p.L, p.R, ids.shape[0],
            *planes.stride(), *i.lora_b.stride(), *y.stride(), SLICE_COLS=cols, SLICE_CHUNKS=chunks,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, SLOTS_POW2=next_power_of_2(p.L),
            RANK_ALIGN=rank_align(p.R), PLANES=num_planes, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return run


def rows():
    if TINY:   # rank 40 in blocks of 16 (below): two full rank blocks and a partial one
        return [(shapes.tiny_layer(layer), 40) for layer in shapes.LLAMA3_8B[:2]]
    return ([(layer, r) for layer in shapes.PHI4_MINI for r in (256, 320)]
            + [(layer, r) for layer in shapes.LLAMA3_8B for r in (128, 320)])


def variants(cfg):
    """name -> (planes, config): the shipped tile with two planes and with one, and two planes on larger tiles
    (the float32 split in registers kept those from paying: the tuner's 128 x 256 lost)."""
    out = {"planes2": (2, cfg), "planes1": (1, cfg)}
    tiles = ((128, 256, 32, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 4, 3)) if not TINY else ((32, 32, 16, 4, 1),)
    for bm, bn, br, warps, stages in tiles:
        out[f"planes2 {bm}x{bn}x{br} w{warps} s{stages}"] = (2, ExpandConfig(bm, bn, br, warps, stages))
    return out


def main():
    if TINY:   # the rank loop at tiny shapes: a rank block smaller than the rank
        configs.expand_config = lambda *a, **k: ExpandConfig(16, 32, 16, 4, 1)
    timer = Timer(DEV)
    print("| layer | r | M | variant | µs | / expand | err vs expand |\n|---|---|---|---|---|---|---|")
    for layer, rank, M, p, i, h, cfg in rank_loop_rows(rows(), TOKENS):
        expand = launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg, run=False)
        planes = h_planes(h, DTYPE)
        calls = {"expand": expand}
        for name, (count, tile) in variants(cfg).items():
            calls[name] = functools.partial(planes_launch(i.y, planes, p, tile, count), i)
        y0 = i.y.clone()
        deltas = {}
        for name, fn in calls.items():
            i.y.copy_(y0)
            fn()
            deltas[name] = i.y.double() - y0.double()
        ref = deltas["expand"]
        for name, fn in calls.items():
            us = timer.measure(lambda k, fn=fn: fn, p.set_bytes(), eager=False)[0]
            if name == "expand":
                base_us = us
                label = f"expand (shipped: {cfg.block_m}x{cfg.block_n}x{cfg.block_r} w{cfg.num_warps} " \
                        f"s{cfg.num_stages})"
                print(f"| {layer.name} | {rank} | {M} | {label} | {us:.1f} | 1 | 0 |", flush=True)
                continue
            err = float((deltas[name] - ref).norm() / ref.norm())
            print(f"| {layer.name} | {rank} | {M} | {name} | {us:.1f} | {us / base_us:.3f} | {err:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
