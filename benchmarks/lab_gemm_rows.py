"""Lab: how cuBLAS's time for F.linear(x, W') moves with W''s extra rows (the stacked GEMM's [W; A]).

Llama-3-8B layer shapes, 16 to 1024 tokens, 0 to 1024 extra rows; CUDA-graph replay medians, cold L2
(benchmarks/timing.py). Session 13 (H200): benchmarks/results/lab-h200-2026-12-03-session13.md §5.

    python benchmarks/lab_gemm_rows.py          # on a GPU; prints one row per (layer, tokens)
"""
import torch
import torch.nn.functional as F

import repo_path  # noqa: F401  (first: this checkout)
from timing import Timer

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
EXTRA = (0, 64, 128, 192, 256, 320, 384, 512, 768, 1024)


def main():
    timer = Timer("cuda")
    print("layer M " + " ".join(f"{e:>6d}" for e in EXTRA))
    for M in (16, 64, 256, 1024):
        for name, (N, K) in LAYERS.items():
            ts = []
            for e in EXTRA:
                sets = {}

                def call(k, sets=sets, M=M, N=N, K=K, e=e):
                    if k not in sets:
                        sets[k] = (torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                                   torch.randn(N + e, K, device="cuda", dtype=torch.bfloat16))
                    x, w = sets[k]
                    return lambda: F.linear(x, w)
                ts.append(timer.measure(call, (M * K + (N + e) * K + M * (N + e)) * 2, False)[0])
                sets.clear()
                torch.cuda.empty_cache()
            print(f"{name:8s}{M:5d} " + " ".join(f"{t:6.1f}" for t in ts), flush=True)


if __name__ == "__main__":
    main()
