"""The Python side of a LoRALinear eager call, on any machine: CPU tensors, the Triton launchers' C launches
stubbed out (no GPU, no interpreter), so what is timed is lora_ops' own host work per call: the module,
the op's checks, path and plan key (or the bound call's guards, lora_ops.eager), the plan replay's
addresses; for a training step also autograd's and the backward's. The H200 host adds the C launches (~6 µs
each: two per inference call, one with stack_a, about a dozen per training step) and runs Python ~1.5x
slower than this repository's CPU machine; benchmarks/host_overhead.py times the real thing there.

Rows (µs per call, the median of --rounds rounds, each the best of 3 x --calls calls, variants
interleaved): F.linear; LoRALinear with and without bound calls; the same with stack_a against F.linear
over its stack; a LoRALinear whose base runs its own forward (a hook; a quantized subclass alike) against
that base; a training step (forward + backward, x and the adapters requiring grad, the base frozen)
of nn.Linear and of LoRALinear: with bound calls (lora_ops.autograd.BoundLoRALinear) and the bound backward
(lora_ops.autograd._delta_grads), with the backward's ops called, without bound calls, and with neither them
nor ops.AUTOGRAD (the dispatcher's autograd); a hooked base's training step with and without bound calls. "adds" = the row minus its base.

Usage: python benchmarks/host_python.py [--rounds 9 --calls 2000 --out DIR]   (markdown + JSON with --out)
"""
import argparse
import datetime
import statistics
import timeit

import torch
import torch.nn.functional as F
from torch import nn

from repo_path import HERE  # noqa: F401  (first: this checkout's lora_ops)

import lora_ops  # noqa: E402
import report  # noqa: E402
from lora_ops import autograd, eager, ops  # noqa: E402
from launch_stubs import stub_launches  # noqa: E402
from lora_ops.layers import LoRALinear  # noqa: E402

M, K, WIDTHS, L, R = 64, 64, (64, 16, 16), 4, 16


def make_layer(stack_a):
    ctx = lora_ops.LoRAContext(L, 256)
    layer = LoRALinear(nn.Linear(K, sum(WIDTHS), bias=False), ctx, R, WIDTHS)
    if stack_a:
        layer._stack()
        layer.stacked_max_tokens = M
    ctx.set_token_slots(torch.randint(-1, L, (M,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)))
    return layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None, help="write host_python-cpu-<date>.md / .json here")
    args = ap.parse_args(argv)
    stub_launches()
    layer, stacked, trained, hooked = make_layer(False), make_layer(True), make_layer(False), make_layer(False)
    hooked_trained = make_layer(False)
    for module in (hooked, hooked_trained):
        module.base.register_forward_hook(lambda module, args, out: None)   # the base runs its own forward
    for module in (trained, hooked_trained):
        for p in (module.lora_a, module.lora_b):
            p.requires_grad_(True)
        module.base.weight.requires_grad_(False)
    linear = nn.Linear(K, sum(WIDTHS), bias=False).requires_grad_(False)
    hooked_linear = nn.Linear(K, sum(WIDTHS), bias=False).requires_grad_(False)
    hooked_linear.register_forward_hook(lambda module, args, out: None)
    x = torch.randn(M, K)
    x_grad = torch.randn(M, K, requires_grad=True)
    grad_out = torch.randn(M, sum(WIDTHS))

    def bound(on):
        return lambda: eager.set_enabled(on)

    def training_setup(bound_calls, eager_autograd, bound_backward=True):
        return lambda: (eager.set_enabled(bound_calls), ops.set_eager_autograd(eager_autograd),
                        autograd.set_bound_backward(bound_backward))

    def train_step(module):
        return lambda: module(x_grad).backward(grad_out)
    variants = {   # name: (setup, call, the row it adds to)
        "F.linear": (bound(True), lambda: F.linear(x, layer.base.weight), None),
        "LoRALinear": (bound(True), lambda: layer(x), "F.linear"),
        "LoRALinear without bound calls": (bound(False), lambda: layer(x), "F.linear"),
        "F.linear over the stack": (bound(True), lambda: F.linear(x, stacked._stacked[0]), None),
        "stack_a": (bound(True), lambda: stacked(x), "F.linear over the stack"),
        "stack_a without bound calls": (bound(False), lambda: stacked(x), "F.linear over the stack"),
        "nn.Linear with a forward hook": (bound(True), lambda: hooked.base(x), None),
        "LoRALinear, base with a forward hook": (bound(True), lambda: hooked(x), "nn.Linear with a forward hook"),
        "LoRALinear, base with a forward hook, without bound calls": (bound(False), lambda: hooked(x),
                                                                      "nn.Linear with a forward hook"),
        "nn.Linear train step": (training_setup(True, True), train_step(linear), None),
        "LoRALinear train step": (training_setup(True, True), train_step(trained), "nn.Linear train step"),
        "LoRALinear train step, backward's ops called": (training_setup(True, True, False), train_step(trained),
                                                         "nn.Linear train step"),
        "LoRALinear train step without bound calls": (training_setup(False, True), train_step(trained),
                                                      "nn.Linear train step"),
        "LoRALinear train step, dispatcher's autograd": (training_setup(False, False), train_step(trained),
                                                          "nn.Linear train step"),
        "nn.Linear with a forward hook, train step": (training_setup(True, True), train_step(hooked_linear), None),
        "LoRALinear, base with a forward hook, train step": (training_setup(True, True), train_step(hooked_trained),
                                                            "nn.Linear with a forward hook, train step"),
        "LoRALinear, base with a forward hook, train step without bound calls": (
            training_setup(False, True), train_step(hooked_trained), "nn.Linear with a forward hook, train step"),
    }
    times = {name: [] for name in variants}
    training = {name for name in variants if "train step" in name}
    try:
        for _ in range(args.rounds):
            for name, (setup, fn, _) in variants.items():
                setup()
                with torch.set_grad_enabled(name in training):
                    fn()
                    calls = args.calls if name not in training else max(1, args.calls // 10)
                    times[name].append(min(timeit.repeat(fn, number=calls, repeat=3)) / calls * 1e6)
    finally:
        eager.set_enabled(True)
        ops.set_eager_autograd(True)
        autograd.set_bound_backward(True)
    assert layer._eager.replays > 0 and stacked._eager.replays > 0, "the bound calls never replayed"
    median = {name: statistics.median(v) for name, v in times.items()}
    adds = {name: median[name] - median[base] for name, (_, _, base) in variants.items() if base}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Python host work per LoRALinear call, C launches stubbed (cpu, torch {torch.__version__}, {date})",
             "", f"LoRALinear K {K} -> N {sum(WIDTHS)} ({len(WIDTHS)} slices), rank {R}, {L} slots, M = {M}, "
             f"float32 CPU tensors, under no_grad but for the training steps; µs per call, median of "
             f"{args.rounds} interleaved rounds (each the best of 3 x {args.calls} calls, "
             f"{max(1, args.calls // 10)} for a training step).", "", "| call | µs | adds |", "|---|---|---|"]
    lines += [f"| {name} | {median[name]:.2f} | {f'{adds[name]:.2f}' if name in adds else ''} |"
              for name in variants]
    text = "\n".join(lines)
    print(text)
    if args.out:
        report.write_run_files(args.out, "host_python", {"gpu": "cpu", "date": date, "torch": torch.__version__,
                                                         "median_us": median, "adds_us": adds}, text)


if __name__ == "__main__":
    main()
