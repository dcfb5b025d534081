"""Lab (not a library path): where the stacked path pays and what its expand wants (DESIGN §4).

The stacked path (launch.lora_linear_stacked) is one cuBLAS GEMM over [W; A_all], A_all every slot's A
stacked under the base weight, giving y and every slot's h; then the expand adds each token's slot's
scale * h @ B^T, and no shrink runs. Timed here as that layer minus the base GEMM, against add_lora_
("ours"), per Llama-3-8B layer; CUDA-graph replay medians, cold L2, inputs rotated (benchmarks/timing.py);
every stacked timing's config is first checked against the float64 delta. Sections (SECS, in order):

    cross    ranks 16 and 64, 1 to 4096 tokens, the expand without and with PDL behind the GEMM
    wide     capacity-128 (ranks 8-128), rank-128 and rank-320 stacks at 1, 64, 256 tokens: where the
             stack's extra rows stop paying
    sweep64  the expand's configs at 64 tokens (sweep1: at 1 and 256), best against the configured one

Session 12 estimated the path with the wider GEMM and the expand timed apart (this file's first version);
session 13 (H200) results: benchmarks/results/lab-h200-2026-12-03-session13.md, which set
layers.stacked_token_limit, launch.STACKED_PDL_MAX_TOKENS and the tuner's stacked candidates.

    python benchmarks/lab_stacked.py out.json                                   # H200 run (BUDGET=530 s)
    DEV=cpu TRITON_INTERPRET=1 SECS=cross python benchmarks/lab_stacked.py /tmp/x.json   # logic check, tiny
"""
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import repo_path  # noqa: F401
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs import heuristics, tuning  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig  # noqa: E402
import problems  # noqa: E402
import shapes  # noqa: E402
from timing import Timer  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
TINY = DEV != "cuda"
# The interpreter computes bf16 wrongly (tests/interp_bf16.py): float16 off the GPU.
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
BUDGET = float(os.environ.get("BUDGET", "480"))
T0 = time.time()
LAYERS = shapes.LLAMA3_8B if not TINY else [shapes.tiny_layer(layer) for layer in shapes.LLAMA3_8B]
rows = []


def left():
    return BUDGET - (time.time() - T0)


class Row:
    def __init__(self, layer, spec, M):
        self.p = problems.Problem.for_case(shapes.Case(layer, spec, M), DTYPE, DEV)
        self.M = M
        self.sets = {}

    def inputs(self, k):
        p = self.p
        if k not in self.sets:
            x, w = p.base_inputs(k)
            i = p.inputs(k)
            self.sets[k] = (x, w, torch.cat([w, i.lora_a.reshape(-1, p.K)]), i)
        return self.sets[k]

    def stacked_call(self, k, cfg, pdl):
        p = self.p
        _, _, wst, i = self.inputs(k)
        x = i.x   # the LoRA inputs' x (base_inputs' x is another tensor)

        def run():
            out = F.linear(x, wst)
            launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                         pdl=pdl and DEV == "cuda")
            return out
        return run

    def default_cfg(self):
        p = self.p
        return configs.stacked_config(self.M, p.N, p.S, p.R, p.L, p.K, torch.device(DEV), DTYPE)

    def check(self, cfg, pdl):
        """The stacked output's first N columns minus the wider GEMM's, against the float64 delta."""
        p = self.p
        _, _, wst, i = self.inputs(0)
        out = self.stacked_call(0, cfg, pdl)()
        delta = (out[:, :p.N].double() - F.linear(i.x, wst)[:, :p.N].double())
        ref = problems.reference_delta(p, i).double()
        err = ((delta - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        return err

    def time_stacked(self, timer, cfg, pdl):
        p = self.p
        extra = (p.N + p.L * p.S * p.R) * p.K * p.esize
        return timer.measure(lambda k: self.stacked_call(k, cfg, pdl), p.set_bytes() + extra, False)[0]


def base_ours(timer, r):
    p = r.p
    base = timer.measure(lambda k: problems.base(*r.inputs(k)[:2]), p.base_set_bytes(), False)[0]
    ours = timer.measure(lambda k: problems.ours(p, r.inputs(k)[3]), p.set_bytes(), False)[0]
    return base, ours


def problems_within_budget(Ms, specs, reserve_s):
    """(M, layer, spec, Row) for every token count, rank spec and layer, while more than ``reserve_s`` of
    the time budget is left; each Row's tensors are freed before the next."""
    for M in Ms:
        for spec in specs:
            for layer in LAYERS:
                if left() < reserve_s:
                    return
                yield M, layer, spec, Row(layer, spec, M)
                if DEV == "cuda":
                    torch.cuda.empty_cache()


def section_cross(timer, Ms, ranks):
    for M, layer, spec, r in problems_within_budget(Ms, [shapes.uniform(rank) for rank in ranks], 20):
        cfg = r.default_cfg()
        e0, e1 = r.check(cfg, False), r.check(cfg, True)
        base, ours = base_ours(timer, r)
        stk = r.time_stacked(timer, cfg, False) - base
        stkp = r.time_stacked(timer, cfg, True) - base
        rank = spec.capacity
        rows.append(dict(sec="cross", layer=layer.name, rank=rank, M=M, base=base, ours=ours, stk=stk, stk_pdl=stkp,
                         err=e0, err_pdl=e1, cfg=list(cfg)))
        print(f"cross {layer.name:8s} r{rank:<3d} M={M:<5d} base {base:7.1f} ours {ours:6.1f} stk {stk:6.1f} "
              f"pdl {stkp:6.1f} | o/b {ours / base:.2f} s/b {stk / base:.2f} p/b {stkp / base:.2f} "
              f"err {e0:.1e} {e1:.1e} {tuple(cfg)}", flush=True)


def section_wide(timer, Ms, specs):
    for M, layer, spec, r in problems_within_budget(Ms, specs, 20):
        cfg = r.default_cfg()
        e0 = r.check(cfg, True)
        base, ours = base_ours(timer, r)
        stkp = r.time_stacked(timer, cfg, True) - base
        row = dict(sec="wide", layer=layer.name, spec=spec.label, M=M, base=base, ours=ours, stk_pdl=stkp,
                   err=e0, cfg=list(cfg), extra_cols=r.p.L * r.p.S * r.p.R, N=r.p.N)
        rows.append(row)
        print(f"wide  {layer.name:8s} {spec.label:5s} M={M:<5d} base {base:7.1f} ours {ours:6.1f} "
              f"stk_pdl {stkp:6.1f} | o/b {ours / base:.2f} s/b {stkp / base:.2f} cols+{row['extra_cols']}"
              f" err {e0:.1e}", flush=True)


def sweep_cfgs(M, R):
    bms = (16,) if M <= 16 else (16, 32, 64)
    for bm in bms:
        for bn, n_loop, warps in tuning.STACKED_ONE_BLOCK_SHAPES:   # the tuner's one-block shapes
            yield ExpandConfig(bm, bn, heuristics.rank_block(R), warps, 2, n_loop)


def sweep_times(timer, r, M, base):
    """{config: the stacked layer's µs minus base} over sweep_cfgs, each checked first (a failing or
    non-compiling config is skipped, with a line saying so)."""
    times = {}
    for cfg in sweep_cfgs(M, r.p.R):
        if left() < 25:
            break
        try:
            err = r.check(cfg, True)
            if not err < 2e-2:
                print("  BAD", cfg, err)
                continue
            times[cfg] = r.time_stacked(timer, cfg, True) - base
        except Exception as e:  # noqa: BLE001
            print("  fail", cfg, type(e).__name__)
    return times


def section_sweep(timer, Ms, ranks):
    for M, layer, spec, r in problems_within_budget(Ms, [shapes.uniform(rank) for rank in ranks], 30):
        base = timer.measure(lambda k, r=r: problems.base(*r.inputs(k)[:2]), r.p.base_set_bytes(), False)[0]
        d = r.default_cfg()
        t_def = r.time_stacked(timer, d, True) - base
        times = sweep_times(timer, r, M, base)
        best = min(times, key=times.get) if times else None
        rank = spec.capacity
        rows.append(dict(sec="sweep", layer=layer.name, rank=rank, M=M, base=base, default=t_def,
                         default_cfg=list(d), best=times.get(best), best_cfg=list(best) if best else None,
                         all={str(tuple(c)): t for c, t in times.items()}))
        print(f"sweep {layer.name:8s} r{rank:<3d} M={M:<5d} base {base:6.1f} default {t_def:5.1f} {tuple(d)} "
              f"best {times.get(best, math.nan):5.1f} {tuple(best) if best else None} ({len(times)} cfgs)",
              flush=True)


def main(out):
    timer = Timer(DEV)
    secs = os.environ.get("SECS", "cross,wide,sweep64,sweep1").split(",")
    try:
        for s in secs:
            if s == "cross":
                section_cross(timer, (1, 64, 256, 1024, 4096) if not TINY else (1, 64), (16, 64) if not TINY else (8,))
            elif s == "sweep64":
                section_sweep(timer, (64,), (16, 64) if not TINY else (8,))
            elif s == "sweep1":
                section_sweep(timer, (1, 256), (16, 64) if not TINY else (8,))
            elif s == "wide":
                specs = ((shapes.uniform(128), shapes.uniform(320), shapes.MIXED) if not TINY
                         else (shapes.tiny_ranks(shapes.MIXED),))
                section_wide(timer, (1, 64, 256) if not TINY else (1,), specs)
            print(f"[{time.time() - T0:.0f} s] section {s} done", flush=True)
    finally:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    summary()


def gm(v):
    v = [x for x in v if x and x > 0]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan


def summary():
    print("== cross: geomean over layers and ranks, X/base")
    for M in sorted({r["M"] for r in rows if r["sec"] == "cross"}):
        part = [r for r in rows if r["sec"] == "cross" and r["M"] == M]
        print(f"M={M:<5d} ours {gm([r['ours'] / r['base'] for r in part]):.3f} "
              f"stk {gm([r['stk'] / r['base'] for r in part]):.3f} "
              f"stk_pdl {gm([r['stk_pdl'] / r['base'] for r in part]):.3f} (n={len(part)})")
    print("== wide")
    for key in sorted({(r["spec"], r["M"]) for r in rows if r["sec"] == "wide"}):
        part = [r for r in rows if r["sec"] == "wide" and (r["spec"], r["M"]) == key]
        print(f"{key[0]:5s} M={key[1]:<5d} ours {gm([r['ours'] / r['base'] for r in part]):.3f} "
              f"stk_pdl {gm([r['stk_pdl'] / r['base'] for r in part]):.3f}")
    print("== sweep: best/default")
    for M in sorted({r["M"] for r in rows if r["sec"] == "sweep"}):
        part = [r for r in rows if r["sec"] == "sweep" and r["M"] == M and r["best"]]
        print(f"M={M:<5d} default/base {gm([r['default'] / r['base'] for r in part]):.3f} "
              f"best/base {gm([r['best'] / r['base'] for r in part]):.3f} (n={len(part)})")


if __name__ == "__main__":
    main(sys.argv[1])
