"""Lab estimate: would stacking every slot's A under the base weight pay at decode sizes?

One cuBLAS GEMM, F.linear(x, [W; A_all]) with A_all the stack's L * S * R rows of A, gives y and every
slot's h; the expand then adds each token's slot's h @ B^T, and the shrink launch goes away. This script
times, per Llama-3-8B layer, rank (16, 64) and token count (1, 16, 64): the base GEMM, the wider GEMM, our
expand alone (the configured expand, fp32 h) and add_lora_; the estimate of the stacked path's delta is
(wider GEMM - GEMM) + expand. Benchmark timer: CUDA-graph replay medians, cold L2, inputs rotated.
Session 12 (H200) results: benchmarks/results/lab-h200-2026-12-03-session12.md section 6. The path itself is
now the op lora_ops::lora_linear_stacked; `bench_lora.py --variants stacked` times it on the grids.

    python benchmarks/lab_stacked_a.py out.json            # H200 run
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_stacked_a.py /tmp/x.json   # logic check, tiny shapes
"""
import json
import math
import os
import sys

import torch

import repo_path  # first: this checkout's lora_ops

from lora_ops import configs, launch  # noqa: E402
import problems  # noqa: E402
import shapes  # noqa: E402
from timing import Timer  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
LAYERS = shapes.LLAMA3_8B if DEV == "cuda" else [shapes.tiny_layer(layer) for layer in shapes.LLAMA3_8B]
TOKENS = (1, 16, 64)
RANKS = (16, 64)


def time_row(timer, layer, rank, M):
    p = problems.Problem.for_case(shapes.Case(layer, shapes.uniform(rank), M), torch.bfloat16, DEV)
    extra = p.L * p.S * p.R
    sets = {}

    def inputs(k):   # x, W, [W; A_all], the LoRA inputs, an fp32 h for the expand alone
        if k not in sets:
            x, w = p.base_inputs(k)
            i = p.inputs(k)
            sets[k] = (x, w, torch.cat([w, i.lora_a.reshape(extra, p.K)]), i,
                       torch.randn(1, M, p.S, p.R, device=DEV))
        return sets[k]

    ecfg = configs.expand_config(M, p.N, p.S, p.R, p.L, torch.device(DEV), torch.bfloat16)

    def expand(k):
        _, _, _, i, h = inputs(k)
        return lambda: launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, ecfg)

    t = {
        "base": timer.measure(lambda k: problems.base(*inputs(k)[:2]), p.base_set_bytes(), False)[0],
        "stacked": timer.measure(lambda k: problems.base(inputs(k)[0], inputs(k)[2]),
                                 p.base_set_bytes() + extra * p.K * p.esize, False)[0],
        "expand": timer.measure(expand, p.set_bytes(), False)[0],
        "ours": timer.measure(lambda k: problems.ours(p, inputs(k)[3]), p.set_bytes(), False)[0],
    }
    t["est"] = t["stacked"] - t["base"] + t["expand"]
    return dict(layer=layer.name, rank=rank, M=M, **t)


def main(out):
    timer = Timer(DEV)
    rows = []
    for M in TOKENS:
        for layer in LAYERS:
            for rank in RANKS:
                r = time_row(timer, layer, rank, M)
                rows.append(r)
                print(f"{r['layer']:8s} r{rank:<3d} M={M:<3d} base {r['base']:6.1f} stacked {r['stacked']:6.1f} "
                      f"expand {r['expand']:5.1f} -> est {r['est']:5.1f} vs ours {r['ours']:5.1f} "
                      f"({r['est'] / r['ours']:.2f})", flush=True)
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    for M in TOKENS:
        part = [r for r in rows if r["M"] == M]
        for key in ("ours", "est"):
            g = math.exp(sum(math.log(r[key] / r["base"]) for r in part) / len(part))
            print(f"M={M}: {key}/base {g:.3f}")
    with open(out, "w") as f:
        json.dump(dict(repo=repo_path.REPO, device=DEV, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
