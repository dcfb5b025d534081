"""Lab (session 20): where the tuner's output check found wrong values, what is wrong.

Session 20's first device call ran a small real tune with the check on (`gpu_session.sh checks`). On Llama
down rank 320 at 4096 tokens it dropped the expand (64, 128, 32, 4 warps, 3 stages) alone (3066 of 16.8M
values off, by up to 187) and the table's own pair (shrink (64, 64, 64, split 1, 4 warps, 4 stages) before
expand (64, 256, 32, 4, 3): 333 values off, by up to 0.77). Either the kernels write wrong values at those
configs (a miscompile, or a race: then the values differ between runs), or something wrote into the
problem's inputs (an out-of-bounds write by a candidate run earlier) and every later check saw it.

Here each candidate of the tuner's spaces for a row is run as the tuner runs it (its runners, on the
tuner's problem copies): checked three times before its timing and three times after, each run's output
compared bit for bit with the first (a race shows as runs that differ), and after its timing every copy's
inputs are compared with a snapshot taken at the start (an out-of-bounds write shows as a changed input,
and the lab stops there). Values off are located: rows, token tiles, columns.

    python benchmarks/lab_wrong_values.py                       # H200, the rows below
    ROWS=down KINDS=expand python benchmarks/lab_wrong_values.py
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_wrong_values.py   # logic check: tiny, float32
"""
import os
import time

import torch

import repo_path  # noqa: F401,E402
import shapes  # noqa: E402
from lora_ops import configs  # noqa: E402
from lora_ops.configs import heuristics, tuning  # noqa: E402

DEV = torch.device(os.environ.get("DEV", "cuda"))
TINY = DEV.type != "cuda"
DTYPE = torch.bfloat16 if not TINY else torch.float32
M = int(os.environ.get("M", "4096" if not TINY else "40"))
RANK = int(os.environ.get("RANK", "320" if not TINY else "40"))
ROWS = os.environ.get("ROWS", "down,o,qkv").split(",")
KINDS = os.environ.get("KINDS", "expand,pair,shrink").split(",")
REPEATS = 3
BUDGET = float(os.environ.get("BUDGET", "1e9"))
T0 = time.time()


def layer_of(name):
    layer = next(layer for layer in shapes.LLAMA3_8B if layer.name == name)
    return shapes.tiny_layer(layer) if TINY else layer


def snapshot(problems):
    return [{k: p[k].clone() for k in ("x", "A", "B", "h")} for p in problems]


def changed_inputs(problems, snaps):
    return [f"copy {i} {k}" for i, (p, s) in enumerate(zip(problems, snaps)) for k in s if not torch.equal(p[k], s[k])]


def output(kind, p, cfg, ecfg):
    """One run of ``cfg`` as the tuner's check runs it (tuning.output_of_one_run): (the output it is judged
    on, base, exact delta)."""
    shrink_alone = kind == "shrink" and ecfg is None
    out = tuning.output_of_one_run(kind, p, tuning.RUNNERS[kind](p, cfg, ecfg), shrink_alone)
    if shrink_alone:
        return out, None, tuning._reference(p, "h")
    return out, p["y_first"], tuning._reference(p, "expand" if kind == "expand" else "delta")


def locate(p, out, base, exact, block_m):
    """Where ``out`` is off (the tuner's bound): rows, token tiles of their slots, column blocks of 64."""
    out, exact = out.double(), exact.double()
    if base is not None:
        exact = exact + base.double()
    written = exact != 0 if base is None else torch.ones_like(exact, dtype=torch.bool)
    rms = (exact - (0 if base is None else base.double())).pow(2).mean().sqrt()
    eps = 2 ** -10 if base is None else torch.finfo(p["y"].dtype).eps
    off = written & tuning.off_mask(out, exact, rms, eps)
    if not bool(off.any()):
        return ""
    off = off.reshape(out.shape[0], -1).cpu()
    rows = off.any(1).nonzero()[:, 0].tolist()
    cols = off.any(0).nonzero()[:, 0]
    sorted_ids, starts, _ = (t.tolist() for t in p["meta"])
    order = {tok: k for k, tok in enumerate(sorted_ids[:out.shape[0]])}
    slots = p["slots"].tolist()
    tiles = sorted({(slots[t], (order[t] - starts[slots[t]]) // block_m) for t in rows if slots[t] >= 0})
    worst = float((out - exact).abs().nan_to_num(float("inf")).masked_fill(~off.to(out.device).reshape(out.shape),
                                                                           0).max())
    return (f"{int(off.sum())} off (worst {worst:.3g}) in {len(rows)} rows {rows[:4]}, (slot, tile) {tiles[:6]}, "
            f"{len(cols)} columns, col blocks of 64 {sorted(set((cols // 64).tolist()))[:8]}")


def check_runs(kind, p, cfg, ecfg, block_m):
    """REPEATS runs: (their findings, whether all runs wrote the same bits)."""
    outs, notes = [], []
    for _ in range(REPEATS):
        out, base, exact = output(kind, p, cfg, ecfg)
        outs.append(out)
        notes.append(locate(p, out, base, exact, block_m))
    same = all(torch.equal(tuning.bits_of(o), tuning.bits_of(outs[0])) for o in outs[1:])
    return notes, same


def configs_for(kind, layer, bucket):
    K, N, S = layer.in_features, sum(layer.slices), len(layer.slices)
    expand = configs.expand_config(bucket, N, S, RANK, tuning.TUNE_SLOTS, DEV, DTYPE)
    shrink = configs.shrink_config(bucket, K, S, RANK, tuning.TUNE_SLOTS, DEV, DTYPE, out_features=N)
    if kind == "expand":
        return [(c, None) for c in tuning.candidates_for("expand", bucket, N, RANK)], expand, shrink
    cands = [shrink, shrink._replace(num_stages=3), shrink._replace(num_stages=4)]
    cands += [c for c in tuning.candidates_for("shrink", bucket, K, RANK, S) if c.split_k == 1 and c.num_stages == 4]
    cands = list(dict.fromkeys(cands))
    return [(c, expand if kind == "pair" else None) for c in cands], expand, shrink


def sanitize():
    """One run of each config in SANITIZE ("expand:64,128,32,4,3;pair") on one problem, for compute-sanitizer."""
    layer = layer_of(ROWS[0])
    bucket = heuristics.token_bucket(M)
    p = tuning.synthetic_problem(DEV, DTYPE, layer.in_features, list(layer.slices), RANK, tuning.TUNE_SLOTS, M)
    _, expand, shrink = configs_for("pair", layer, bucket)
    for item in os.environ["SANITIZE"].split(";"):
        kind, _, cfg = item.partition(":")
        if kind == "expand":
            cfg = heuristics.ExpandConfig(*map(int, cfg.split(","))) if cfg else expand
            out, base, exact = output("expand", p, cfg, None)
        else:
            cfg = heuristics.ShrinkConfig(*map(int, cfg.split(","))) if cfg else shrink
            out, base, exact = output("shrink", p, cfg, expand)
        torch.cuda.synchronize()
        print(f"{kind} {tuple(cfg)}: {locate(p, out, base, exact, cfg.block_m) or 'right'}", flush=True)


def main():
    if os.environ.get("SANITIZE"):
        return sanitize()
    print(f"device {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"M {M}, rank {RANK}, {DTYPE}")
    for name in ROWS:
        layer = layer_of(name)
        bucket = heuristics.token_bucket(M)
        problems = tuning.problem_copies(DEV, DTYPE, layer.in_features, list(layer.slices), RANK,
                                         tuning.TUNE_SLOTS, M)
        snaps = snapshot(problems)
        print(f"\n## {layer.model} {name} r{RANK} M={M}: {len(problems)} copies")
        for kind in KINDS:
            items, expand, shrink = configs_for(kind, layer, bucket)
            print(f"### {kind} (table: shrink {tuple(shrink)}, expand {tuple(expand)}), {len(items)} configs")
            runner = "shrink" if kind in ("pair", "shrink") else "expand"
            for cfg, ecfg in items:
                if time.time() - T0 > BUDGET:
                    print("budget spent")
                    return
                bm = cfg.block_m
                try:
                    before, same_before = check_runs(runner, problems[0], cfg, ecfg, bm)
                    us = tuning.time_config(runner, problems, cfg, ecfg, check=False)
                    after, same_after = check_runs(runner, problems[0], cfg, ecfg, bm)
                except Exception as e:  # noqa: BLE001 — a lab: a config that cannot run is a line
                    print(f"{tuple(cfg)}: raised {type(e).__name__}: {str(e)[:100]}")
                    continue
                bad = changed_inputs(problems, snaps)
                wrong = sum(bool(n) for n in before + after)
                us_s = "-" if us is None else f"{us:.1f}"
                print(f"{tuple(cfg)}: {us_s} µs, wrong in {wrong} of {2 * REPEATS} runs, bits same across runs "
                      f"{same_before}/{same_after}" + (f", INPUTS CHANGED: {bad[:6]}" if bad else ""), flush=True)
                for n in dict.fromkeys(before + after):
                    if n:
                        print(f"    {n}", flush=True)
                if bad:
                    return


if __name__ == "__main__":
    main()
