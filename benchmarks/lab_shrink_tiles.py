"""Lab (session 19): the high-rank shrink's tile against its L2 traffic.

At ranks 128-320 and 4096 tokens the shrink runs at 2.4-3.8x its MMA floor (lab_kernel_parts.py, session
18); the tuner picked 64 x 64 or 128 x 64 tiles (token rows x rank columns). A program reads its token tile
of x for every rank block and its slot's A for every token tile, so what crosses L2 into the SMs is

    x bytes * rank blocks  +  A bytes of a slot * token tiles        (rank blocks padded to BLOCK_R)

which for Llama down r320 on 64 x 64 tiles is ~0.6 GB of x and ~0.6 GB of A, for 0.12 GB of x from HBM.
If that is the limit, wider tiles (128 x 128, 128 x 256) win and deeper pipelines do not. Each variant is
the shipped shrink kernel on another config (split-K writing its partial sums, as add_lora_ takes them),
checked against the table's h and timed as CUDA-graph replays (cold L2) beside the table's config.

    python benchmarks/lab_shrink_tiles.py                          # H200 (MS default 4096)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_shrink_tiles.py   # logic check, tiny, float16
"""

import torch

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints  # noqa: E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs.heuristics import ShrinkConfig, cdiv, max_token_tiles, next_power_of_2  # noqa: E402
from timing import Timer  # noqa: E402

TOKENS = ints("MS", "4096" if not TINY else "48")
ROWS = ([("llama3-8b", name, 320) for name in ("qkv", "o", "gate_up", "down")]
        + [("llama3-8b", "down", 128), ("llama3-8b", "qkv", 128), ("phi4-mini", "qkv", 320),
           ("phi4-mini", "down", 256)])
# (block_m, block_r, block_k, warps, stages, split counts), each with one slice per program and, for packed
# layers, with up to a 256-wide dot of slices; the table's config and its deeper pipelines are added per row.
VARIANTS = [(128, 128, 64, 8, 3, (1, 2, 4)), (128, 128, 64, 8, 4, (1, 2)), (128, 128, 128, 8, 3, (1, 2)),
            (128, 256, 64, 8, 3, (1, 2)), (64, 256, 64, 8, 3, (1, 2)), (64, 128, 64, 4, 3, (1, 2)),
            (128, 64, 64, 4, 4, (1, 2))]


def layer_of(model, name):
    layer = {"llama3-8b": shapes.LLAMA3_8B, "phi4-mini": shapes.PHI4_MINI}[model]
    layer = next(lay for lay in layer if lay.name == name)
    return layer if not TINY else shapes.tiny_layer(layer)


def l2_bytes(p, cfg):
    """What crosses L2 into the SMs: x per rank block (group of slices), each slot's A per token tile."""
    rank_blocks = cdiv(p.S, cfg.slice_group) * cdiv(p.R, cfg.block_r)
    padded_rank = cdiv(p.R, cfg.block_r) * cfg.block_r
    token_tiles = max_token_tiles(p.M, p.L, cfg.block_m)
    return p.esize * p.K * (p.M * rank_blocks + token_tiles * p.S * padded_rank)


def run_shrink(p, i, cfg):
    """(launch, h summed over its splits): h [split, M, S, R] zeros, the splits written as partial sums."""
    h = torch.zeros(cfg.split_k, p.M, p.S, p.R, dtype=torch.float32, device=DEV)
    lc = launch.launch_shrink(i.x, i.lora_a, p.scale, p.rank, *p.meta, h, cfg, partials_out=True, run=False)
    lc()
    return lc, h.sum(0)


def main():
    timer = Timer(DEV)
    print("| model | layer | r | M | config | µs | / table | L2 GB | err |\n|---|---|---|---|---|---|---|---|---|")
    for model, name, rank in ROWS:
        for M in TOKENS:
            rank_here = rank if not TINY else rank // 8
            p = problems.Problem.for_case(shapes.Case(layer_of(model, name), shapes.uniform(rank_here), M), DTYPE,
                                          DEV)
            i = p.inputs(0)
            table = configs.shrink_config(M, p.K, p.S, p.R, p.L, i.x.device, i.x.dtype, out_features=p.N)
            cfgs = [table, table._replace(num_stages=4), table._replace(num_stages=5)]
            cfgs += [ShrinkConfig(bm, br, bk, sk, w, st, g) for bm, br, bk, w, st, splits in VARIANTS
                     for g in sorted({1, min(next_power_of_2(p.S), max(1, 256 // br))})
                     for sk in splits if br <= 2 * p.R or br == 128]
            ref_launch, ref = run_shrink(p, i, table)
            base_us = None
            for cfg in cfgs:
                try:
                    lc, h = run_shrink(p, i, cfg)
                except Exception as e:  # noqa: BLE001 (a lab: a config that does not compile is a row)
                    print(f"| {model} | {name} | {rank_here} | {M} | {tuple(cfg)} | failed: {type(e).__name__} |")
                    continue
                err = float((h - ref).norm() / ref.norm())
                us = timer.measure(lambda k, lc=lc: lc, p.set_bytes(), eager=False)[0]
                base_us = base_us or us
                print(f"| {model} | {name} | {rank_here} | {M} | {tuple(cfg)} | {us:.1f} | {us / base_us:.3f} | "
                      f"{l2_bytes(p, cfg) / 1e9:.2f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
