"""Lab (session 41): the training step's LoRA kernels, one launch each, for Nsight Compute.

Per row (ROWS: layer:rank:M, comma-separated; Llama-3-8B shapes, 4 slots of that rank, ~10% tokens without an
adapter), each op of a LoRA layer's training step (add_lora_, then lora_grad_h, lora_grad_x, lora_grad_a, the
shrink op, lora_grad_b) runs once to compile and warm up, then once more inside an NVTX range named
``<layer> r<rank> M<M>/<op>`` that ncu's NVTX filter selects:

    ncu --nvtx --nvtx-include "regex:.*/" --clock-control none --cache-control all \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --csv --page details python benchmarks/lab_backward_ncu.py > ncu.csv

    DEV=cpu TRITON_INTERPRET=1 ROWS=qkv:16:48 python benchmarks/lab_backward_ncu.py   # logic check, tiny
"""
import os

import torch

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY  # noqa: E402
from lab_train_ops import OPS, Step  # noqa: E402  (the step's LoRA ops, as that lab times them)
from lora_ops.ops import set_cpu_backend  # noqa: E402

ROWS = [r.split(":") for r in os.environ.get("ROWS", "gate_up:64:1024,down:64:4096,qkv:64:1024").split(",")]


def layer_named(name):
    layer = next(layer for layer in shapes.LLAMA3_8B if layer.name == name)
    return shapes.tiny_layer(layer) if TINY else layer


def main():
    if DEV != "cuda":
        set_cpu_backend("triton")   # the logic check runs our kernels (interpreted), not the torch ones
    for name, rank, M in ROWS:
        rank, M = int(rank), int(M)
        layer = layer_named(name)
        spec = shapes.uniform(rank) if not TINY else shapes.tiny_ranks(shapes.uniform(rank))
        p = problems.Problem.for_case(shapes.Case(layer, spec, M), DTYPE, DEV)
        step = Step(p, 0)
        calls = {op: step.calls[op] for op in OPS}
        for fn in calls.values():   # compile, plans, warm caches
            fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        for op, fn in calls.items():
            label = f"{name} r{rank} M{M}/{op}"
            if DEV == "cuda":
                torch.cuda.nvtx.range_push(label)
            fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            print(label, flush=True)


if __name__ == "__main__":
    main()
