"""A/B of two lora_ops source trees on the host work of a LoRALinear training step (forward + backward, the
adapters trainable, the base frozen), on any CPU: CPU tensors, every Triton launch stubbed at FastLauncher (its
own path and a plan's replay run, Triton's C launcher is never called), as benchmarks/host_python.py stubs
them. One process per tree and round, the trees in turn.

    git archive <rev> | tar -x -C /tmp/base
    python benchmarks/host_train_trees.py /tmp/base .          # µs per step, and what LoRA adds over nn.Linear's
"""
import os
import statistics
import subprocess
import sys
import timeit

M, K, WIDTHS, L, R = 64, 64, (64, 16, 16), 4, 16


def time_tree(tree):
    """(LoRALinear's step, nn.Linear's step) in µs, medians of 5 rounds of the best of 3 x 200 steps."""
    sys.path.insert(0, tree)
    import torch
    from torch import nn

    import lora_ops
    if not os.path.abspath(lora_ops.__file__).startswith(os.path.abspath(tree)):
        sys.exit(f"host_train_trees: imported {lora_ops.__file__}, not the tree {tree}")
    from lora_ops.layers import LoRALinear
    from launch_stubs import stub_launches   # (benchmarks/ is on sys.path: this script's folder)
    stub_launches()

    ctx = lora_ops.LoRAContext(L, 256)
    layer = LoRALinear(nn.Linear(K, sum(WIDTHS), bias=False), ctx, R, WIDTHS)
    for p in (layer.lora_a, layer.lora_b):
        p.requires_grad_(True)
    layer.base.weight.requires_grad_(False)
    ctx.set_token_slots(torch.randint(-1, L, (M,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)))
    linear = nn.Linear(K, sum(WIDTHS), bias=False).requires_grad_(False)
    x = torch.randn(M, K, requires_grad=True)
    grad_out = torch.randn(M, sum(WIDTHS))
    steps = {"lora": lambda: layer(x).backward(grad_out), "base": lambda: linear(x).backward(grad_out)}
    for _ in range(20):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(5):
        for name, step in steps.items():
            times[name].append(min(timeit.repeat(step, number=200, repeat=3)) / 200 * 1e6)
    return statistics.median(times["lora"]), statistics.median(times["base"])


def main(argv):
    if argv[:1] == ["--one"]:
        lora, base = time_tree(argv[1])
        print(f"{lora:.2f} {base:.2f}")
        return
    trees, rounds = argv[:2], 3
    rows = {tree: [] for tree in trees}
    for _ in range(rounds):
        for tree in trees:
            out = subprocess.run([sys.executable, __file__, "--one", tree], capture_output=True, text=True, check=True)
            rows[tree].append(tuple(float(v) for v in out.stdout.split()))
    print(f"LoRALinear training step, K {K} -> N {sum(WIDTHS)} ({len(WIDTHS)} slices), rank {R}, {L} slots, M = {M}, "
          f"float32 CPU tensors, launches stubbed; µs per step, {rounds} rounds of one process per tree\n")
    print("| tree | round | LoRALinear step | nn.Linear step | LoRA adds |\n|---|---|---|---|---|")
    for tree, values in rows.items():
        for i, (lora, base) in enumerate(values, 1):
            print(f"| {tree} | {i} | {lora:.1f} | {base:.1f} | {lora - base:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
