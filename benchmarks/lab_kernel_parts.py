"""Lab (session 18): add_lora_'s shrink and expand timed alone at high ranks, against their MMA floors.

Phi-4-mini at ranks 256 / 320 and Llama-3-8B at 128 / 320, 4 slots, 4096 tokens by default (MS), bf16: each
kernel's CUDA-graph replay median (cold L2) with the config the shipped table gives it, and the time its
multiply-adds take at the rate of one large bf16 matmul measured in the run (the used tokens only; the
expand's bf16x2 split of h doubles its MMA work, not counted). Also add_lora_ whole and the base layer.

    python benchmarks/lab_kernel_parts.py       # on a GPU (MS)
"""
import torch

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import ints  # noqa: E402
from lora_ops import launch  # noqa: E402
from timing import Timer  # noqa: E402

TOKENS = ints("MS", "4096")
CFG_KEYS = ("N_LOOP", "M_LOOP", "num_warps", "num_stages", "SLICE_GROUP", "PART_CHUNK")


def describe(lc):
    """A launch's grid and tile constexprs."""
    picked = {k: v for k, v in lc.constexprs.items() if k.startswith("BLOCK") or k in CFG_KEYS}
    return f"grid {tuple(lc.grid)} " + " ".join(f"{k}={v}" for k, v in picked.items())


def main():
    timer = Timer("cuda")
    rate = timer.matmul_rate(torch.bfloat16)
    print(f"matmul {rate / 1e12:.0f} TFLOP/s\n| layer | r | M | base | add_lora_ | shrink | expand | shrink mma floor | "
          "expand mma floor | shrink cfg | expand cfg |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = ([(layer, r) for layer in shapes.PHI4_MINI for r in (256, 320)]
            + [(layer, r) for layer in shapes.LLAMA3_8B for r in (128, 320)])
    for layer, rank in rows:
        for M in TOKENS:
            p = problems.Problem.for_case(shapes.Case(layer, shapes.uniform(rank), M), torch.bfloat16, "cuda")
            i = p.inputs(0)
            launches, _, buffers = launch.add_lora_launches(i.y, i.x, i.lora_a, i.lora_b, p.scale, p.rank, p.widths,
                                                            *p.meta)
            if len(launches) != 2:
                continue
            shrink, expand = launches
            shrink()
            bi = p.base_inputs(0)
            t = {name: timer.measure(make, size, eager=False)[0] for name, make, size in (
                ("shrink", lambda k: (lambda: (shrink(), buffers)), p.set_bytes()),
                ("expand", lambda k: (lambda: (expand(), buffers)), p.set_bytes()),
                ("ours", lambda k: problems.ours(p, i), p.set_bytes()),
                ("base", lambda k: problems.base(*bi), p.base_set_bytes()))}
            used = int((p.slots >= 0).sum())
            shrink_floor = 2 * used * p.K * p.S * rank / rate * 1e6
            expand_floor = 2 * used * rank * p.N / rate * 1e6
            print(f"| {layer.name} | {rank} | {M} | {t['base']:.1f} | {t['ours']:.1f} | {t['shrink']:.1f} | "
                  f"{t['expand']:.1f} | {shrink_floor:.1f} | {expand_floor:.1f} | {describe(shrink)} | "
                  f"{describe(expand)} |", flush=True)


if __name__ == "__main__":
    main()
