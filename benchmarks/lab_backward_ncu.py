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
from lora_ops.ops import set_cpu_backend  # noqa: E402

ROWS = [r.split(":") for r in os.environ.get("ROWS", "gate_up:64:1024,down:64:4096,qkv:64:1024").split(",")]


def layer_named(name):
    layer = next(layer for layer in shapes.LLAMA3_8B if layer.name == name)
    return shapes.tiny_layer(layer) if TINY else layer


def step_ops(p, k=0):
    """{op name: callable} of one training step's LoRA ops on input set ``k`` of problem ``p``."""
    i = p.inputs(k)
    gen = torch.Generator(device=DEV).manual_seed(2000 + k)
    g = torch.randn(p.M, p.N, device=DEV, dtype=DTYPE, generator=gen)
    ops = torch.ops.lora_ops
    meta = (p.rank, *p.meta)
    h = ops.shrink(i.x, i.lora_a, p.scale, *meta)
    dh = ops.lora_grad_h(g, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
    return {
        "add_lora_": lambda: ops.add_lora_(i.y, i.x, i.lora_a, i.lora_b, p.scale, p.rank, p.widths, *p.meta),
        "grad_h": lambda: ops.lora_grad_h(g, i.lora_b, p.scale, p.rank, p.widths, *p.meta),
        "grad_x": lambda: ops.lora_grad_x(dh, i.lora_a, *meta),
        "grad_a": lambda: ops.lora_grad_a(dh, i.x, *meta),
        "shrink": lambda: ops.shrink(i.x, i.lora_a, p.scale, *meta),
        "grad_b": lambda: ops.lora_grad_b(g, h, p.rank, p.widths, *p.meta),
    }


def main():
    if DEV != "cuda":
        set_cpu_backend("triton")   # the logic check runs our kernels (interpreted), not the torch ones
    for name, rank, M in ROWS:
        rank, M = int(rank), int(M)
        layer = layer_named(name)
        spec = shapes.uniform(rank) if not TINY else shapes.tiny_ranks(shapes.uniform(rank))
        p = problems.Problem.for_case(shapes.Case(layer, spec, M), DTYPE, DEV)
        calls = step_ops(p)
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
