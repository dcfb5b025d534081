"""Lab (session 26): the rank loop's planes taking turns, one dot a step. Found on the H200: slower everywhere
(1.10-1.24x the table's configs; `benchmarks/results/lab-planes-in-turn-h200-2026-12-05-session26.md`).

Why: in add_lora_'s rank loop over h's two bf16 planes (kernels.expand.rank_loop) each rank step holds two dots,
hi·B then lo·B on one load of B. Compiled for sm_90 (Triton 3.6) only the step's last dot is asynchronous: the
hi plane's wgmmas end in `wgmma.wait_group 0`, so they run exposed (DESIGN §4, "The planes' two dots").
With `PLANES_IN_TURN` (ExpandConfig.planes_in_turn) the loop takes a step per (rank block, plane), hi then
lo: one dot a step, which Triton pipelines as a plain GEMM (`wait_group 1`), the same products in the same
order (bit-identical y), at the price of loading B's block twice from L2. Compiled for sm_90 on the CPU
machine (Triton 3.6, 320-rank planes):

    tile (M x N x R, warps, stages)   shipped loop: regs / spill / smem   in turn: regs / spill / smem
    64 x 256 x 32, 4, 3               255 / 0 / 72 KB                     255 / 0 / 60 KB
    128 x 256 x 32, 8, 3              248 / 0 / 96 KB                     248 / 0 / 72 KB
    128 x 256 x 32, 8, 4              248 / 0 / 128 KB                    248 / 0 / 96 KB
    128 x 128 x 64, 8, 3              170 / 0 / 144 KB                    166 / 0 / 96 KB
    128 x 256 x 64, 8, 2              255 / 20 B / 128 KB                 255 / 0 / 96 KB

The loop is L2-bound at ranks 256-320 with 64 x 256 tiles (~5 TB/s from L2, session 23), where B's block is
two thirds of a step's traffic: in turn there it moves 40 KB a step instead of 24, so expect no gain at the
table's tile; a 128 x 256 tile moves per output what today's 64 x 256 moves and overlaps every wgmma, the
variant to watch. Lower smem also lets a fourth stage fit.

Per row (the shrink's planes as add_lora_ makes them; both of the expand's modes: accumulate, add_lora_'s; store,
lora_linear's write-first path from 1024 tokens): the table's config, shipped loop (the ratio's base), then
each variant. Every variant's y is checked against float64 (relative Frobenius error, and tuning.off_mask's
count of values off by more than the dtype allows) before and after its timing; CUDA-graph replays, cold L2.

    python benchmarks/lab_planes_in_turn.py        # H200; MS, RANKS, MODELS, LAYERS, MODES, BUDGET (s)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_planes_in_turn.py   # logic check, tiny, bf16
"""
import collections
import math
import os
import time

import torch

import repo_path  # noqa: F401,E402
import lab_env  # noqa: E402
from lab_env import DEV, TINY, checked_modes, ints, model_rows, rank_loop_rows  # noqa: E402
from lora_ops import launch  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig  # noqa: E402

TOKENS = ints("MS", "1024,4096" if not TINY else "48")
RANKS = ints("RANKS", "128,256,320" if not TINY else "40")
MODELS = os.environ.get("MODELS", "llama3-8b,phi4-mini").split(",")
LAYER_NAMES = os.environ.get("LAYERS", "qkv,o,gate_up,down").split(",")
MODES = os.environ.get("MODES", "store,accumulate").split(",")
BUDGET = float(os.environ.get("BUDGET", "480"))


def variants(table):
    """(name, config, planes in turn): the table's tile in turn, then wider tiles, shipped loop and in turn."""
    if TINY:
        return [("table in turn", table, True), ("16x32x16 w4 s2 in turn", ExpandConfig(16, 32, 16, 4, 2), True)]
    out = [("table in turn", table, True)]
    for bm, bn, br, warps, stages in ((128, 256, 32, 8, 3), (128, 256, 32, 8, 4), (128, 256, 64, 8, 2),
                                      (128, 128, 64, 8, 3), (64, 256, 32, 4, 4)):
        cfg = ExpandConfig(bm, bn, br, warps, stages)
        name = f"{bm}x{bn}x{br} w{warps} s{stages}"
        if bm == 128 and bn == 256 and br == 32 and stages == 3:
            out.append((name, cfg, False))   # the wide tile's shipped loop: what turns gain on it
        out.append((name + " in turn", cfg, True))
    return out


def expand_launch(i, h, p, cfg, accumulate, in_turn):
    """add_lora_'s expand of this row on ``cfg``, the planes in turn or not (a launch, not run)."""
    return launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg._replace(planes_in_turn=in_turn),
                                run=False, accumulate=accumulate)


def rows():   # Phi-4-multimodal's adapters: ranks 256 and 320
    return model_rows(MODELS, LAYER_NAMES, RANKS, keep=lambda model, rank: model != "phi4-mini" or rank >= 256)


def main():
    return lab_env.run_rank_loop_lab(run)


def run(timer):
    ratios = collections.defaultdict(list)   # (mode, M, variant) -> [time / the table's]
    try:
        walk(timer, ratios)
    finally:
        print_summary(ratios)


def print_summary(ratios):
    """Last: the geometric mean of each variant's time over the table config's, per mode and token count."""
    print("\n| mode | M | variant | rows | geomean / table |\n|---|---|---|---|---|")
    for (mode, M, name), values in sorted(ratios.items()):
        geomean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"| {mode} | {M} | {name} | {len(values)} | {geomean:.3f} |", flush=True)


def walk(timer, ratios):
    start = time.time()
    print("| model layer | r | M | mode | variant | µs | / table | fp64 err before / after "
          "| values off before / after |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for layer, rank, M, p, i, h, table in rank_loop_rows(rows(), TOKENS):
        if time.time() - start > BUDGET:
            print(f"budget spent ({BUDGET:.0f} s)", flush=True)
            return
        if h.dim() != 4 or h.shape[0] != 2 or h.dtype == torch.float32:
            print(f"| {layer.model} {layer.name} | {rank} | {M} | (h is not two planes: {tuple(h.shape)} {h.dtype}) |")
            continue
        for mode, accumulate, run_checked in checked_modes(p, i, MODES):
            label = "table " + "x".join(map(str, table[:3])) + f" w{table.num_warps} s{table.num_stages}"
            candidates = [(label, table, False)] + variants(table)
            base_us = None
            for name, cfg, in_turn in candidates:
                try:
                    go = expand_launch(i, h, p, cfg, accumulate, in_turn)
                    err, off = run_checked(go)
                    us = timer.measure(lambda k, go=go: go, p.set_bytes(), eager=False)[0]
                    err_after, off_after = run_checked(go)
                except Exception as e:  # noqa: BLE001 (a lab: a variant that does not build is a row)
                    print(f"| {layer.model} {layer.name} | {rank} | {M} | {mode} | {name} | failed: {e!r:.200} |",
                          flush=True)
                    continue
                base_us = base_us or us
                ratios[mode, M, "table" if name == label else name].append(us / base_us)
                print(f"| {layer.model} {layer.name} | {rank} | {M} | {mode} | {name} | {us:.1f} | "
                      f"{us / base_us:.3f} | {err:.2e} / {err_after:.2e} | {off} / {off_after} |", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
