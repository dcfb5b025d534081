"""Lab (session 23): a persistent rank-loop expand, and 128-token tiles, against the shipped expand.

Why: at ranks 256-320 the expand's rank loop (64 x 256 tiles, 4 warps, two CTAs an SM) moves ~1.8 GB from L2
into the SMs for Llama gate_up at 4096 tokens (each 64-token tile re-reads its slot's B; each column block
re-reads h's two planes), ~5 TB/s over its time in the store mode, where y is never read: the loop is bound
by L2 bandwidth more than by its MMAs. A 128 x 256 tile moves a third less per output but takes 8 warps and
~250 registers a thread: one CTA an SM, nothing to run while a tile's y moves, and the tuner found it slower.
A persistent program walks tiles in a loop (``tl.range(..., flatten=True)`` may let Triton's pipeliner fetch
the next tile's first rank blocks during this tile's y traffic), so the wide tile might keep the SM busy.

The lab's kernel takes add_lora_'s planes h (two bf16 terms, zeros between a slot's rank and the rank rounded
up to the alignment) like the shipped rank loop (lora_ops.kernels.expand.rank_loop, reused here), in both
modes (accumulate: y += delta; store: y = delta, rows without an adapter zeroed). "uniform" variants loop over
the stack's max rank with every step masked alike (flattening needs one trip count for every tile). Each
variant's y is checked against float64 (tuning.off_mask) before and after timing; CUDA-graph replays, cold L2.

Found (H200, session 23, `benchmarks/results/lab-h200-2026-12-04-session23.md`): the wide tile lost (1.05-1.16x
the table's tile, 1.04-1.64x persistent), flattening lost (1.5-3.2x), and only the persistent 64 x 256 kernel
at two programs an SM won, in the store mode only (0.91-1.00). That win was this kernel's store mode having
no y load, where the shipped one kept a masked-off one: removed there (kernels.expand), the shipped kernel
took the gain and the persistent one came out mixed (0.90-1.07). Nothing here shipped but that finding.

    python benchmarks/lab_persistent_expand.py                          # H200; MS, RANKS, MODELS, LAYERS, MODES
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_persistent_expand.py   # logic check, tiny, bf16
"""
import os

import torch
import triton
import triton.language as tl

import repo_path  # noqa: F401,E402
import lab_env  # noqa: E402
from lab_env import DEV, TINY, checked_modes, ints, model_rows, rank_loop_rows  # noqa: E402
from lora_ops import launch  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig, max_token_tiles, next_power_of_2, rank_align  # noqa: E402
from lora_ops.kernels.expand import rank_loop  # noqa: E402
from lora_ops.kernels.work import find_slice_chunk, find_slot_tile, load_tile_tokens, rank_ceil  # noqa: E402

TOKENS = ints("MS", "1024,4096" if not TINY else "48")
RANKS = ints("RANKS", "256,320" if not TINY else "40")
MODELS = os.environ.get("MODELS", "llama3-8b,phi4-mini").split(",")
LAYER_NAMES = os.environ.get("LAYERS", "qkv,gate_up").split(",")
MODES = os.environ.get("MODES", "accumulate,store").split(",")


@triton.jit(do_not_specialize=["M"])
def persistent_expand_kernel(
    h_ptr, b_ptr, y_ptr, rank_ptr, sorted_ids_ptr, slot_starts_ptr, slot_counts_ptr,
    M, num_slots, max_rank, capacity, token_tiles,
    stride_hp, stride_hm, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_ym, stride_yn,
    SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_POW2: tl.constexpr,
    RANK_ALIGN: tl.constexpr, H_PLANES: tl.constexpr, ACCUMULATE: tl.constexpr, FLATTEN: tl.constexpr,
    UNIFORM: tl.constexpr,
):
    """Each program walks tiles t = pid, pid + P, ... of (token tile, column block), token tiles first (the
    programs running together share a column block of B). Pointers and strides as kernels.expand's
    expand_kernel with planes h ([H_PLANES, M, S, R] in B's dtype); token_tiles: the grid bound of token
    tiles (heuristics.max_token_tiles). Tiles past the work find rank 0 and no valid rows: their loop is
    empty and their stores masked off (no branch, so the tile loop flattens)."""
    chunks = SLICE_CHUNKS[len(SLICE_CHUNKS) - 1]
    num_tiles = token_tiles * chunks
    for t in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m = t % token_tiles
        pid_n = t // token_tiles
        slice_id, col0, col_hi = find_slice_chunk(pid_n, SLICE_COLS, SLICE_CHUNKS, BLOCK_N)
        slot, row0, rows_left, rank = find_slot_tile(pid_m, slot_counts_ptr, slot_starts_ptr, rank_ptr, num_slots,
                                                      max_rank, capacity, BLOCK_M, SLOTS_POW2, not ACCUMULATE)
        tok, valid = load_tile_tokens(sorted_ids_ptr, row0, rows_left, capacity, M, BLOCK_M)
        h_rows = h_ptr + tok[:, None] * stride_hm + slice_id * stride_hs
        b_slot = b_ptr + slot.to(tl.int64) * stride_bl
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < col_hi
        if UNIFORM:
            acc = uniform_rank_loop(h_rows, b_slot, offs_n, n_ok, rank, max_rank, stride_hr, stride_hp, stride_bn,
                                    stride_br, BLOCK_M, BLOCK_N, BLOCK_R, RANK_ALIGN, H_PLANES)
        else:
            acc = rank_loop(h_rows, b_slot, offs_n, n_ok, rank, stride_hr, stride_hp, stride_bn, stride_br, BLOCK_M,
                            BLOCK_N, BLOCK_R, RANK_ALIGN, "bf16x2", True, H_PLANES)
        y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
        mask = valid[:, None] & n_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def uniform_rank_loop(h_rows, b_slot, offs_n, n_ok, rank, max_rank, stride_hr, stride_hp, stride_bn, stride_br,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, RANK_ALIGN: tl.constexpr,
                      H_PLANES: tl.constexpr):
    """rank_loop's planes case as one loop, every step masked alike (no partial block after it: nothing
    but the loop between a tile's start and its y, which the flattening pass may need). B is zeroed past
    the rank in registers each step (its padded ranks may hold anything)."""
    offs_r = tl.arange(0, BLOCK_R)
    b_cols = b_slot + offs_n[None, :].to(tl.int64) * stride_bn
    ceil = rank_ceil(rank, RANK_ALIGN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, max_rank, BLOCK_R):
        rs = r0 + offs_r
        r_in = rs < ceil
        ht = tl.load(h_rows + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0)
        bt = tl.load(b_cols + rs[:, None] * stride_br, mask=r_in[:, None] & n_ok[None, :], other=0.0)
        bt = tl.where((rs < rank)[:, None], bt, 0.0)
        acc = tl.dot(ht, bt, acc)
        if H_PLANES == 2:
            acc = tl.dot(tl.load(h_rows + stride_hp + rs[None, :] * stride_hr, mask=r_in[None, :], other=0.0), bt, acc)
    return acc


def sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def persistent_launch(y, h, lora_b, widths, rank, sorted_ids, starts, counts, cfg, ctas_per_sm, flatten,
                      accumulate, uniform=False):
    """A callable launching the lab kernel (grid from shapes and the SM count only)."""
    M = y.shape[0]
    L, _, R = lora_b.shape
    groups = L if accumulate else L + 1
    cols, chunks = launch.slice_layout(widths, cfg.block_n)
    token_tiles = max_token_tiles(M, groups, cfg.block_m)
    programs = min(sm_count(y.device) * ctas_per_sm, token_tiles * chunks[-1])
    hp, hm, hs, hr = h.stride()

    def go():
        persistent_expand_kernel[(programs,)](
            h, lora_b, y, rank, sorted_ids, starts, counts,
            M, L, R, sorted_ids.shape[0], token_tiles, hp, hm, hs, hr, *lora_b.stride(), *y.stride(),
            SLICE_COLS=cols, SLICE_CHUNKS=chunks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
            SLOTS_POW2=next_power_of_2(groups), RANK_ALIGN=rank_align(R), H_PLANES=h.shape[0],
            ACCUMULATE=accumulate, FLATTEN=flatten, UNIFORM=uniform, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return go


def variants():
    """(name, kind, config, CTAs an SM, flatten, uniform loop): the shipped kernel at the wide tile, then the
    lab kernel (its rank loop as the shipped one's, or uniform: over the max rank, which lets it flatten)."""
    if TINY:
        small = ExpandConfig(16, 32, 16, 4, 3)
        return [("persistent 16x32x16", "persistent", small, 2, False, False),
                ("persistent 16x32x16 uniform flat", "persistent", small, 2, True, True)]
    wide = ExpandConfig(128, 256, 32, 8, 3)
    narrow = ExpandConfig(64, 256, 32, 4, 3)
    return [
        ("shipped 128x256x32 w8 s3", "shipped", wide, 0, False, False),
        ("persistent 128x256x32 w8 s3", "persistent", wide, 1, False, False),
        ("persistent 128x256x32 w8 s4", "persistent", wide._replace(num_stages=4), 1, False, False),
        ("persistent 128x256x32 w8 s3 uniform", "persistent", wide, 1, False, True),
        ("persistent 128x256x32 w8 s3 uniform flat", "persistent", wide, 1, True, True),
        ("persistent 64x256x32 w4 s3 2/SM", "persistent", narrow, 2, False, False),
        ("persistent 64x256x32 w4 s3 2/SM uniform flat", "persistent", narrow, 2, True, True),
    ]


def rows():
    return model_rows(MODELS, LAYER_NAMES, RANKS)


def main():
    return lab_env.run_rank_loop_lab(run)


def run(timer):
    print("| model layer | r | M | mode | variant | µs | / table | fp64 err before / after | values off before / after |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    for layer, rank, M, p, i, h, table in rank_loop_rows(rows(), TOKENS):
        if h.dtype == torch.float32:
            print(f"| {layer.name} | {rank} | {M} | (h is not planes) |")
            continue
        for mode, accumulate, run_checked in checked_modes(p, i, MODES):
            base_us = None
            table_lc = launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, table, run=False,
                                            accumulate=accumulate)
            candidates = [("table " + "x".join(map(str, table[:3])) + f" w{table.num_warps} s{table.num_stages}",
                           table_lc)]
            for name, kind, cfg, per_sm, flatten, uniform in variants():
                try:
                    if kind == "shipped":
                        go = launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg, run=False,
                                                  accumulate=accumulate)
                    else:
                        go = persistent_launch(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg, per_sm, flatten,
                                               accumulate, uniform)
                except Exception as e:  # noqa: BLE001 (a lab: a variant that does not build is a row)
                    print(f"| {layer.model} {layer.name} | {rank} | {M} | {mode} | {name} | failed: {e!r:.200} |")
                    continue
                candidates.append((name, go))
            for name, go in candidates:
                try:
                    err, off = run_checked(go)
                    us = timer.measure(lambda k, go=go: go, p.set_bytes(), eager=False)[0]
                    err_after, off_after = run_checked(go)
                except Exception as e:  # noqa: BLE001
                    print(f"| {layer.model} {layer.name} | {rank} | {M} | {mode} | {name} | failed: {e!r:.200} |",
                          flush=True)
                    continue
                base_us = base_us or us
                print(f"| {layer.model} {layer.name} | {rank} | {M} | {mode} | {name} | {us:.1f} | "
                      f"{us / base_us:.3f} | {err:.2e} / {err_after:.2e} | {off} / {off_after} |", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
