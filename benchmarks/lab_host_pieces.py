"""Lab (session 18): where LoRALinear's eager host time goes, the layer built up one piece at a time.

One qkv-shaped layer as in host_overhead.py (K 4096 -> 4096/1024/1024, rank 16, 4 adapters, 64 tokens, bf16),
each row adding one step of what LoRALinear runs, so differences between rows price the steps:

    F.linear                                  the base GEMM
    launch._add_lora fixed y                  add_lora_'s plan replay alone (key, scratch, two C launches)
    F.linear + launch._add_lora fixed y       both, independent
    F.linear then _add_lora on it             the replay on the GEMM's fresh output
    F.linear then add_lora_ (checks) on it    ... with add_lora_'s argument checks
    launch.lora_linear                        the op's launcher (its own checks, the write-first test)
    ops.call lora_linear                      through lora_ops.ops.call (no dispatcher)
    LoRALinear                                the module as users call it
    F.linear stacked / launch.lora_linear_stacked / LoRALinear stack_a     the same for apply_lora(stack_a=True)

Host time alone (host_overhead.enqueue_us_per_call: 50 calls from an idle GPU); the rows interleaved round by
round (11 rounds; min and median), with PDL on, then off. The host's speed drifts by up to 1.5x within a
minute (session 18): compare rows of one table only.

    python benchmarks/lab_host_pieces.py       # on a GPU
"""
import statistics

import torch
import torch.nn.functional as F

import repo_path  # noqa: F401,E402
from host_overhead import build, enqueue_us_per_call  # noqa: E402
from lora_ops import launch, ops, plan  # noqa: E402

ROUNDS = 11


class Shape:
    tiny = False
    tokens = 64
    rank = 16


def variants(layer, stacked_layer, x):
    w = layer.base.weight
    y = F.linear(x, w)
    meta = layer.context.meta
    widths = list(layer.slice_widths)
    rest = (layer.lora_a, layer.lora_b, layer.scale, layer.rank, widths, *meta)
    stacked = stacked_layer._stacked[0]
    s_rest = (stacked_layer.lora_b, stacked_layer.scale, stacked_layer.rank, widths, *meta)

    def fresh_y_replay():
        launch._add_lora(F.linear(x, w), x, *rest)

    def fresh_y_checked():
        launch.add_lora_(F.linear(x, w), x, *rest)
    return {
        "F.linear": lambda: F.linear(x, w),
        "launch._add_lora fixed y": lambda: launch._add_lora(y, x, *rest),
        "F.linear + launch._add_lora fixed y": lambda: (F.linear(x, w), launch._add_lora(y, x, *rest)),
        "F.linear then _add_lora on it": fresh_y_replay,
        "F.linear then add_lora_ (checks) on it": fresh_y_checked,
        "launch.lora_linear": lambda: launch.lora_linear(x, w, None, *rest),
        "ops.call lora_linear": lambda: ops.call("lora_linear", x, w, None, *rest),
        "LoRALinear": lambda: layer(x),
        "F.linear stacked": lambda: F.linear(x, stacked),
        "launch.lora_linear_stacked": lambda: launch.lora_linear_stacked(x, stacked, None, *s_rest),
        "LoRALinear stack_a": lambda: stacked_layer(x),
    }


def main():
    device = torch.device("cuda")
    layer, x = build(Shape, device, torch.bfloat16)
    stacked_layer, _ = build(Shape, device, torch.bfloat16, stack_a=True)
    calls = variants(layer, stacked_layer, x)
    for pdl in (True, False):
        launch.set_pdl(pdl)
        plan.clear()
        samples = {name: [] for name in calls}
        with torch.no_grad():
            for fn in calls.values():
                for _ in range(5):
                    fn()
            torch.cuda.synchronize()
            for _ in range(ROUNDS):
                for name, fn in calls.items():
                    samples[name].append(enqueue_us_per_call(fn, device))
        print(f"\nPDL {pdl}\n| call | min µs | median µs |\n|---|---|---|")
        for name, v in samples.items():
            print(f"| {name} | {min(v):.1f} | {statistics.median(v):.1f} |", flush=True)
    launch.set_pdl(True)


if __name__ == "__main__":
    main()
