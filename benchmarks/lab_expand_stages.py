"""Lab (session 19): the high-rank expand's pipeline depth.

A 4-stage pipeline won the high-rank shrink up to 14% (lab_shrink_tiles.py). The rank-loop expand's tuned
tile everywhere at 1024-8192 tokens is 64 x 256 x 32 at 4 warps and 3 stages, and the tuner's candidates
never held that tile at 4 stages (only 8 warps went to 4). Here the shipped expand, on the h add_lora_'s
shrink writes, runs on the table's config and on the same tile at other stage counts (and 8 warps at 4),
each timed as CUDA-graph replays (cold L2) and checked against float64 twice, before and after its
timing: the relative error of its delta (an exact kernel shows the rounding of y, ~2.8e-3 in bf16), how
many values are off by more than the tuner's check allows (configs.tuning.allowed_error), and how far
its delta is from the table config's first one.

Session 19's run (call 8) compared deltas with the table config's only: on Llama o / down r320 every
other config's delta was 1.3e-3 away from it, and 5 stages gave garbage on down. Settled in session 20
(lab_wrong_values.py): the rank loop raced (an asynchronous wgmma reading registers the next step
overwrote, kernels.work.dot_t), in some runs and at several configs, the table's among them.

    python benchmarks/lab_expand_stages.py                          # H200 (MS default 4096)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_expand_stages.py   # logic check, tiny, float16
"""
import torch

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import DEV, TINY, ints, rank_loop_rows  # noqa: E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs import tuning  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig  # noqa: E402
from timing import Timer  # noqa: E402

TOKENS = ints("MS", "4096" if not TINY else "48")


def rows():
    if TINY:   # rank 40 in blocks of 16 (below): two full rank blocks and a partial one
        return [(shapes.tiny_layer(layer), 40) for layer in shapes.LLAMA3_8B[:2]]
    return ([(layer, r) for layer in shapes.LLAMA3_8B for r in (128, 320)]
            + [(layer, 320) for layer in shapes.PHI4_MINI])


def variants(cfg):
    """The table's tile at other pipeline depths, and at 8 warps."""
    out = [cfg._replace(num_stages=s) for s in (2, 4, 5) if s != cfg.num_stages]
    return out + [cfg._replace(num_warps=8, num_stages=4)]


def where(p, mask, block_m):
    """Where a [M, N] mask is set: how many values and rows, and the first rows as (token, slot, token tile
    of its slot, row in the tile) with their first columns: a race, a tile or a row shows in the pattern."""
    rows = mask.any(1).nonzero()[:, 0].tolist()
    if not rows:
        return ""
    sorted_ids, starts, _ = (t.tolist() for t in p.meta)
    order = {tok: k for k, tok in enumerate(sorted_ids[:p.M])}
    slots = p.slots_cpu.tolist()
    first = []
    for t in rows[:3]:
        s = slots[t]
        k = order[t] - starts[s] if s >= 0 else -1
        cols = mask[t].nonzero()[:, 0].tolist()
        more = "..." if len(cols) > 4 else ""
        first.append(f"token {t} slot {s} tile {k // block_m} row {k % block_m} cols {cols[:4]}{more}")
    return f"{int(mask.sum())} values in {len(rows)} rows; " + "; ".join(first)


def main():
    if TINY:   # the rank loop at tiny shapes: a rank block smaller than the rank
        configs.expand_config = lambda *a, **k: ExpandConfig(16, 32, 16, 4, 3)
    timer = Timer(DEV)
    print("| layer | r | M | config (block_m, block_n, block_r, warps, stages) | µs | / table | vs table | "
          "fp64 err before / after timing | values off before / after |\n|---|---|---|---|---|---|---|---|---|")
    for layer, rank, M, p, i, h, table in rank_loop_rows(rows(), TOKENS):
        y0 = i.y.clone()
        exact = problems.reference_delta(p, i)
        first, base_us = None, None

        rms = float(exact.pow(2).mean().sqrt())

        def run_checked(lc):
            """(delta, its fp64 relative error, values off by more than the tuner's check allows, where)."""
            i.y.copy_(y0)
            lc()
            delta = i.y.double() - y0.double()
            want = y0.double() + exact
            off = tuning.off_mask(i.y, want, rms, torch.finfo(i.y.dtype).eps)
            err = float((delta - exact).norm() / exact.norm())
            return delta, err, int(off.sum()), where(p, off.cpu(), table.block_m)
        for cfg in [table, *variants(table)]:
            try:
                lc = launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg, run=False)
                delta, err, off, off_where = run_checked(lc)
            except Exception as e:  # noqa: BLE001 (a lab: a config that does not run is a row)
                print(f"| {layer.name} | {rank} | {M} | {tuple(cfg[:5])} | failed: {type(e).__name__} |")
                continue
            first = delta if first is None else first
            vs_table = float((delta - first).norm() / first.norm())
            us = timer.measure(lambda k, lc=lc: lc, p.set_bytes(), eager=False)[0]
            _, err_after, off_after, where_after = run_checked(lc)
            base_us = base_us or us
            print(f"| {layer.name} | {rank} | {M} | {tuple(cfg[:5])} | {us:.1f} | {us / base_us:.3f} | "
                  f"{vs_table:.1e} | {err:.2e} / {err_after:.2e} | {off} / {off_after} |", flush=True)
            for label, text in (("off before timing", off_where), ("off after timing", where_after),
                                ("differs from the table's", where(p, (delta != first).cpu(), table.block_m))):
                if text:
                    print(f"|   | {label}: {text} |", flush=True)


if __name__ == "__main__":
    main()
