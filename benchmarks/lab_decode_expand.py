"""Lab (session 42): the stacked expand's configs at decode sizes, then the decode step with the winners.

Why: the decode target (a step of 4 Llama-3-8B-shaped blocks, batch 64, within 15% of the tokens/s without
LoRA) stood at 0.831-0.836 at rank 64 on the H100 (sessions 34, 37): ~20 µs of a ~850 µs step short. At 64
tokens the stacked expand alone costs 4-9 µs a layer where its bytes take 1-4 (session 18, H200), gate_up r64
most of all (9.0 µs alone against 3.6 µs for its B). The shipped configs are the H200 table's, tuned over 14-28
candidates with at most two column blocks a program below 256 tokens; a program that streams more column
blocks (n_loop 4-8, the y prefetch and B's pipelined loads keeping more bytes in flight) was never tried there.

Part 1, per layer, rank (RANKS) and token count (MS): the stacked layer (F.linear(x, [W; A]), then the expand
under PDL, as lora_linear_stacked runs it) with each candidate config, every one timed in turn with the base
layer and the shipped config (Timer.measure_paired: CUDA-graph replays, cold L2; the layer's delta = the median
of per-round differences from the base layer). Every candidate's output is checked against float64 first
(relative error within problems.TOLERANCE, rows without an adapter untouched, no NaN); one that fails is
reported and dropped.

Part 2: bench_decode's model (4 blocks, batch 64 round-robin over 4 adapters, stack_a) at each rank, three
CUDA graphs timed in turn: the model without LoRA, with the shipped configs, and with part 1's winners (a
winner: best paired delta, at least 3% under the shipped config's); tokens/s ratios of both.

    python benchmarks/lab_decode_expand.py out.json          # H100 (BUDGET s for part 1, default 330)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_decode_expand.py /tmp/x.json   # logic check, tiny
"""
import contextlib
import json
import math
import os
import statistics
import sys
import time
from unittest import mock

import torch

import repo_path  # noqa: F401,E402
from lab_env import DEV, DTYPE, TINY, T0, ints, lab_rows, problem, run_env, stacked_parts  # noqa: E402
import problems  # noqa: E402
from lora_ops import configs, launch, plan  # noqa: E402
from lora_ops.configs import heuristics  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig  # noqa: E402
from lora_ops.precision import stacked_gemm  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402


TOKENS = ints("MS", "64" if not TINY else "16")
RANKS = ints("RANKS", "64,16")
BUDGET = float(os.environ.get("BUDGET", "330"))
MIN_GAIN = float(os.environ.get("MIN_GAIN", "0.97"))
# (block_n, n_loops) of the sweep: one to eight column blocks a program.
COLUMN_SHAPES = ((32, (1, 4, 8)), (64, (1, 2, 4, 8)), (128, (1, 2, 4)), (256, (1, 2)))


def candidates(M, R):
    br = heuristics.rank_block(R)
    for bn, n_loops in COLUMN_SHAPES:
        for n_loop in n_loops:
            for warps in (4, 8):
                yield ExpandConfig(16, bn, br, warps, 2, n_loop)
    if M > 16:
        for bn, n_loop in ((64, 1), (64, 2), (128, 1), (128, 2)):
            yield ExpandConfig(32, bn, br, 4, 2, n_loop)


def layer_call(p, inputs, cfg):
    """The stacked layer with ``cfg`` as its expand's config: a make_call(k) for the timer."""
    def make(k):
        i, _, ws, _ = inputs(k)

        def run():
            out = stacked_gemm(i.x, ws, None, p.N, p.L * p.S * p.R)
            launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                         pdl=launch.stacked_uses_pdl(i.x))
            return out
        return run
    return make


def check(p, inputs, cfg):
    """Relative error of the layer's delta against float64; inf where a row without an adapter changed or a
    value is not finite."""
    i, _, ws, _ = inputs(0)
    out = layer_call(p, inputs, cfg)(0)()
    delta = out[:, :p.N].double() - stacked_gemm(i.x, ws, None, p.N, p.L * p.S * p.R)[:, :p.N].double()
    ref = problems.reference_delta(p, i).double()
    if not torch.isfinite(delta).all():
        return math.inf
    none = p.slots < 0
    if none.any() and delta[none].abs().max() != 0:
        return math.inf
    return ((delta - ref).norm() / ref.norm()).item()


def sweep_row(timer, layer, rank, M, out_rows):
    p = problem(layer, rank, M)
    inputs, call = stacked_parts(p)
    shipped = configs.stacked_config(M, p.N, p.S, p.R, p.L, p.K, p.device, p.dtype)
    makes, errs = {"base": lambda k: call("base", k), "shipped": layer_call(p, inputs, shipped)}, {}
    for cfg in dict.fromkeys(candidates(M, p.R)):
        if cfg == shipped:
            continue
        try:
            err = check(p, inputs, cfg)
        except Exception as e:  # noqa: BLE001  (a config that does not compile is reported, not fatal)
            print(f"  {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if not err <= problems.TOLERANCE[p.dtype]:
            print(f"  {tuple(cfg)} WRONG: error {err:.2e}", flush=True)
            continue
        errs[cfg] = err
        makes[cfg] = layer_call(p, inputs, cfg)
    errs["shipped"] = check(p, inputs, shipped)
    set_bytes = p.set_bytes() + p.base_set_bytes()
    _, runs = timer.measure_paired(makes, {n: set_bytes for n in makes})
    deltas = {n: paired_delta(runs, n, "base") for n in makes if n != "base"}
    best = min((n for n in deltas if n != "shipped"), key=deltas.get, default=None)
    row = dict(layer=layer.name, rank=rank, M=M, N=p.N, K=p.K, S=p.S, L=p.L, R=p.R,
               base=statistics.median(runs["base"]), shipped=deltas["shipped"], shipped_cfg=list(shipped),
               best=deltas.get(best), best_cfg=list(best) if best else None, shipped_err=errs["shipped"],
               all={str(tuple(n)): [round(d, 2), errs[n]] for n, d in deltas.items() if n != "shipped"})
    out_rows.append(row)
    print(f"{layer.name:8s} r{rank:<3d} M={M:<3d} base {row['base']:6.1f} shipped {row['shipped']:5.2f} "
          f"{tuple(shipped)} best {row['best'] or math.nan:5.2f} {tuple(best) if best else None} "
          f"({len(deltas) - 1} configs) err {errs['shipped']:.1e}", flush=True)


def winners(rows):
    """{(N, K, R, M): config} where the best candidate beat the shipped config by MIN_GAIN."""
    return {(r["N"], r["K"], r["R"], r["M"]): ExpandConfig(*r["best_cfg"]) for r in rows
            if r["best"] is not None and r["best"] < MIN_GAIN * r["shipped"]}


@contextlib.contextmanager
def with_configs(table):
    """configs.stacked_config answers from ``table`` where it has the shape; the launch plans are rebuilt."""
    shipped = configs.stacked_config

    def pick(num_tokens, out_features, num_slices, max_rank, num_slots, in_features, device=None, dtype=None):
        got = table.get((out_features, in_features, max_rank, num_tokens))
        return got or shipped(num_tokens, out_features, num_slices, max_rank, num_slots, in_features, device, dtype)
    plan.clear()
    with mock.patch.object(configs, "stacked_config", pick):
        yield
    plan.clear()


def decode_steps(table, ranks, replays):
    """Part 2: {rank: {"base", "shipped", "tuned": µs per step}} from bench_decode's model, paired."""
    import bench_decode
    from lora_ops.configs.tuning import paired_graph_times_us
    import lora_ops
    d = bench_decode.TINY if TINY else bench_decode.LLAMA
    device = torch.device(DEV)
    dtype = DTYPE if not TINY else torch.float32   # float16's range overflows the tiny model's residual
    batch = 64 if not TINY else 16
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, d["hidden"], device=device, dtype=dtype, generator=gen)
    slots = torch.arange(batch, device=device) % 4
    base_model = bench_decode.build_model(d, 4, dtype, device)
    out = {}
    for rank in ranks:
        model = bench_decode.build_model(d, 4, dtype, device)
        ctx = lora_ops.apply_lora(model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], max_loras=4,
                                  max_rank=rank, max_tokens=batch, packed_modules=bench_decode.packed(d),
                                  stack_a=True)
        ctx.set_token_slots(slots)
        bench_decode.fill_adapters(ctx, rank, 4, gen)

        def step(m):
            with torch.no_grad():
                return m(x)

        def tuned_step():
            with with_configs(table):
                return step(model)
        plan.clear()
        with torch.no_grad():
            check = (step(model).double() - tuned_step().double()).abs().max().item()
        plan.clear()
        if DEV != "cuda":
            out[rank] = dict(check=check)
            continue
        t = paired_graph_times_us({"base": [lambda: step(base_model)], "shipped": [lambda: step(model)],
                                   "tuned": [tuned_step]}, replays=replays)
        out[rank] = dict(t, check=check)
        print(f"decode r{rank}: base {t['base']:.1f} shipped {t['shipped']:.1f} ({t['base'] / t['shipped']:.3f}) "
              f"tuned {t['tuned']:.1f} ({t['base'] / t['tuned']:.3f}) max |shipped - tuned| {check:.2e}", flush=True)
        del ctx
        plan.clear()
    return out


def main(path):
    timer = Timer(DEV)
    rows = []
    try:
        for layer, rank, M in lab_rows(TOKENS, RANKS, BUDGET):
            sweep_row(timer, layer, rank, M, rows)
        print(f"[{time.time() - T0:.0f} s] part 1 done", flush=True)
        table = winners(rows)
        print("winners:", {k: tuple(v) for k, v in table.items()}, flush=True)
        steps = decode_steps(table, sorted({r["rank"] for r in rows}), 15 if DEV == "cuda" else 1)
    finally:
        with open(path, "w") as f:
            json.dump(dict(env=run_env(), rows=rows, steps=locals().get("steps")), f, indent=1,
                      default=str)
    print("\n| layer | r | M | base | shipped delta | best delta | best/shipped | shipped cfg | best cfg |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["best"] / r["shipped"] if r["best"] is not None and r["shipped"] > 0 else math.nan
        print(f"| {r['layer']} | {r['rank']} | {r['M']} | {r['base']:.1f} | {r['shipped']:.2f} | "
              f"{r['best'] or math.nan:.2f} | {ratio:.2f} | {tuple(r['shipped_cfg'])} | "
              f"{tuple(r['best_cfg']) if r['best_cfg'] else None} |")
    for rank, s in (steps or {}).items():
        if "base" in s:
            print(f"decode step r{rank}: tokens/s shipped {s['base'] / s['shipped']:.3f}, "
                  f"tuned {s['base'] / s['tuned']:.3f} of the base model's")


if __name__ == "__main__":
    main(sys.argv[1])
