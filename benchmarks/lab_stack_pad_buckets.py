"""Lab (session 42): stack_a's GEMM over [W; A; pad] against the base GEMM, pad by pad and token count by token count.

Why: at 64 tokens on the H100 the stacked GEMM's extra rows cost far more than their bytes on two layers
(session 42, lab_l2_prefetch: gate_up r16 3.3 µs for 128 rows of A, 0.35 µs of bytes; down r16 2.8 µs
for 0.6): cuBLAS picks its kernel by shape. The shipped pads (the table's "stack_pad" entries, the H200's) are
one per layer and rank for every token count, chosen by the geomean over the stacked buckets.

Per Llama-3-8B layer and rank (RANKS; 4 slots, so L·S·R rows of A): F.linear(x, W) and F.linear(x, [W; A;
pad zero rows]) for every pad in PADS, at each token count of MS, all timed in turn
(tuning.stack_pad_times: CUDA-graph replays, weights in enough copies to stay cold). Prints each pad's extra
over the base GEMM, the shipped pad's and the best.

    python benchmarks/lab_stack_pad_buckets.py out.json
    DEV=cpu python benchmarks/lab_stack_pad_buckets.py /tmp/x.json       # logic check (host wall times)
"""
import json
import os
import sys
from unittest import mock

import torch

import repo_path  # noqa: F401,E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints, run_env  # noqa: E402
from lora_ops import configs  # noqa: E402
from lora_ops.configs import tuning  # noqa: E402

TOKENS = ints("MS", "1,16,64,256" if not TINY else "4")
RANKS = ints("RANKS", "16,64")
PADS = ints("PADS", ",".join(str(p) for p in range(0, 513, 32)))
LAYER_NAMES = os.environ.get("LAYERS", "qkv,o,gate_up,down").split(",")
SLOTS = 4


def main(path):
    device = torch.device(DEV)
    rows = []
    layers = [layer for layer in shapes.LLAMA3_8B if layer.name in LAYER_NAMES]
    for layer in layers:
        N, K, S = layer.out_features, layer.in_features, len(layer.slices)
        if TINY:
            N, K = N // 64, K // 64
        for rank in RANKS:
            stack = SLOTS * S * rank
            shipped = configs.stack_pad_rows(N, K, stack, device, DTYPE)
            pads = sorted({0, *PADS, shipped})
            # pad -stack: the base weight alone, timed in turn with the rest
            with mock.patch.object(tuning, "STACK_PAD_ROWS", (-stack, *pads)):
                times = tuning.stack_pad_times(device, DTYPE, N, K, stack, TOKENS)
            for i, M in enumerate(TOKENS):
                base = times[-stack][i]
                extra = {pad: times[pad][i] - base for pad in pads}
                best = min(extra, key=extra.get)
                row = dict(layer=layer.name, rank=rank, M=M, N=N, K=K, stack=stack, base=base, shipped_pad=shipped,
                           shipped=extra[shipped], best_pad=best, best=extra[best], extra=extra)
                rows.append(row)
                print(f"{layer.name:8s} r{rank:<3d} M={M:<4d} base {base:6.1f} | no pad {extra[0]:5.2f} shipped "
                      f"+{shipped} {extra[shipped]:5.2f} | best +{best} {extra[best]:5.2f} | "
                      + " ".join(f"{p}:{extra[p]:.1f}" for p in pads), flush=True)
            if DEV == "cuda":
                torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(dict(env=run_env(), rows=rows), f, indent=1)
    print("\n| layer | r | M | base µs | no pad | shipped pad | its extra | best pad | its extra | bytes µs |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bytes_us = r["stack"] * r["K"] * 2 / 2.97e12 * 1e6
        print(f"| {r['layer']} | {r['rank']} | {r['M']} | {r['base']:.1f} | {r['extra'][0]:.2f} | {r['shipped_pad']} | "
              f"{r['shipped']:.2f} | {r['best_pad']} | {r['best']:.2f} | {bytes_us:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
