"""Lab (session 42): at decode sizes, B brought into L2 while the stacked GEMM runs, so the expand after it
reads B from L2.

Why: at 64 tokens the stacked layer's delta (lora_linear_stacked: F.linear(x, [W; A]), then the expand)
costs 4-13 µs on the H100 where its bytes take 1-7; sweeping the expand's configs found nothing (session 42,
lab_decode_expand: more column blocks a program only lost). The base GEMM is bound by its weight's bytes, so
B's bytes cost their time whenever they move, but the expand can only start them once the GEMM is done:
their DRAM latency and time sit on the critical path. A prefetch on a side stream, forked before the GEMM and
joined before the expand, moves them beside the GEMM (L2::evict_last, so that the GEMM's stream of W, 8-16x
B's size, does not evict them first).

Per Llama-3-8B layer, rank (RANKS) and token count (MS), paired with the base layer (Timer.measure_paired:
CUDA-graph replays in turn, cold L2, inputs rotated), µs:

    base          F.linear(x, W)
    gemm          F.linear(x, [W; A])
    gemm_pf       the same with B's prefetch beside it on a side stream (what the prefetch costs the GEMM)
    layer         lora_linear_stacked as shipped (the expand under PDL behind the GEMM)
    layer_nopdl   the same, the expand launched without PDL
    layer_pf      the prefetch beside the GEMM, then the expand (no PDL: it follows a join)
    layer_pf_normal  the same, the prefetch's loads without the evict_last mark

Every variant's output is checked against the shipped layer's first (bit-identical: the prefetch reads only).

    python benchmarks/lab_l2_prefetch.py out.json
    NCU=1 ncu --nvtx --nvtx-include "regex:.*/" --cache-control none --clock-control none --section SpeedOfLight \
        --csv --page details python benchmarks/lab_l2_prefetch.py /tmp/x.json    # each kernel once, no timing
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_l2_prefetch.py /tmp/x.json   # logic check, tiny
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

import repo_path  # noqa: F401,E402
from lab_env import DEV, TINY, ints, lab_rows, problem, run_env, stacked_parts  # noqa: E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.precision import stacked_gemm  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

TOKENS = ints("MS", "64" if not TINY else "16")
RANKS = ints("RANKS", "64,16")
PREFETCH_BLOCK = 4096   # elements a program touches
NCU = os.environ.get("NCU") == "1"


@triton.jit
def l2_prefetch_kernel(src_ptr, sink_ptr, numel, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Reads src[pid * BLOCK : (pid + 1) * BLOCK] marked evict_last (ptxas refuses .cg with it); stores one value to
    sink[pid] only if the block's sum is NaN... never in practice, but it keeps the load from being dropped."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVICT_LAST:
        v = tl.load(src_ptr + offs, mask=offs < numel, other=0.0, eviction_policy="evict_last")
    else:
        v = tl.load(src_ptr + offs, mask=offs < numel, other=0.0)
    s = tl.sum(v.to(tl.float32), axis=0)
    tl.store(sink_ptr + pid, s, mask=s != s)


def prefetch(t, sink, evict_last=True):
    n = t.numel()
    grid = (triton.cdiv(n, PREFETCH_BLOCK),)
    l2_prefetch_kernel[grid](t, sink, n, BLOCK=PREFETCH_BLOCK, EVICT_LAST=evict_last, num_warps=4)


def main(path):
    timer = Timer(DEV)
    side = torch.cuda.Stream() if DEV == "cuda" else None
    rows = []
    for layer, rank, M in lab_rows(TOKENS, RANKS, 420):
        p = problem(layer, rank, M)
        inputs, call = stacked_parts(p)
        cfg = configs.stacked_config(M, p.N, p.S, p.R, p.L, p.K, p.device, p.dtype)
        sink = torch.empty(triton.cdiv(p.L * p.N * p.R, PREFETCH_BLOCK), device=p.device, dtype=torch.float32)

        def gemm(x, ws):   # the stacked GEMM as the op runs it
            return stacked_gemm(x, ws, None, p.N, p.L * p.S * p.R)

        def fork(run_side, run_main):
            if side is None:
                run_side()
                return run_main()
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                run_side()
            out = run_main()
            main_stream.wait_stream(side)
            return out

        def make(name, k):
            i, _, ws, _ = inputs(k)
            if name in ("base", "gemm", "layer"):
                return call(name, k)
            if name == "gemm_pf":
                return lambda: fork(lambda: prefetch(i.lora_b, sink), lambda: gemm(i.x, ws))

            def layer(pf, pdl):
                def run():
                    if pf:
                        out = fork(lambda: prefetch(i.lora_b, sink, pf == "last"), lambda: gemm(i.x, ws))
                    else:
                        out = gemm(i.x, ws)
                    launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                                 pdl=pdl)
                    return out
                return run
            return layer({"layer_pf": "last", "layer_pf_normal": "normal"}.get(name),
                         name == "layer" and launch.stacked_uses_pdl(i.x))

        names = ("base", "gemm", "gemm_pf", "layer", "layer_nopdl", "layer_pf", "layer_pf_normal")
        ref = make("layer", 0)()[:, :p.N].clone()
        for n in ("layer_nopdl", "layer_pf", "layer_pf_normal"):
            got = make(n, 0)()[:, :p.N]
            assert torch.equal(got, ref), f"{n} differs from the shipped layer on {layer.name} r{rank} M{M}"
        if NCU:   # one run of each in an NVTX range for Nsight Compute (see the module docstring)
            for n in ("layer", "layer_pf"):
                fn = make(n, 0)
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push(f"{layer.name} r{rank} M{M}/{n}")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            continue
        set_bytes = p.set_bytes() + p.base_set_bytes()
        _, runs = timer.measure_paired({n: (lambda k, n=n: make(n, k)) for n in names},
                                       {n: set_bytes for n in names})
        d = {n: paired_delta(runs, n, "base") for n in names if n != "base"}
        row = dict(d, name=layer.name, rank=rank, M=M, base=sorted(runs["base"])[len(runs["base"]) // 2],
                   b_mb=p.L * p.N * p.R * p.esize / 2 ** 20)
        rows.append(row)
        print(f"{layer.name:8s} r{rank:<3d} M={M:<3d} base {row['base']:6.1f} | gemm {d['gemm']:5.2f} "
              f"gemm_pf {d['gemm_pf']:5.2f} | layer {d['layer']:5.2f} nopdl {d['layer_nopdl']:5.2f} "
              f"pf {d['layer_pf']:5.2f} pf_normal {d['layer_pf_normal']:5.2f} | B {row['b_mb']:.1f} MiB", flush=True)
    with open(path, "w") as f:
        json.dump(dict(env=run_env(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
