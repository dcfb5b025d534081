"""The Python side of a LoRALinear eager call, on any machine: CPU tensors, the Triton launchers' C launches
stubbed out (no GPU, no interpreter), so what is timed is lora_ops' own host work per call: the module,
the op's checks, path and plan key (or the bound call's guards, lora_ops.eager), the plan replay's
addresses. The H200 host adds two C launches of ~6 µs each (one with stack_a) and runs Python ~1.5x
slower than this repository's CPU machine; benchmarks/host_overhead.py times the real thing there.

Rows (µs per call, the median of --rounds rounds, each the best of 3 x --calls calls, variants
interleaved): F.linear; LoRALinear with and without bound calls; the same with stack_a against F.linear
over its stack. "adds" = the row minus its base GEMM.

Usage: python benchmarks/host_python.py [--rounds 9 --calls 2000 --out DIR]   (markdown + JSON with --out)
"""
import argparse
import datetime
import operator
import statistics
import timeit

import torch
import torch.nn.functional as F
from torch import nn

from repo_path import HERE  # noqa: F401  (first: this checkout's lora_ops)

import lora_ops  # noqa: E402
import report  # noqa: E402
from lora_ops import eager, launch, ops, plan, triton_launch  # noqa: E402
from lora_ops.layers import LoRALinear  # noqa: E402

M, K, WIDTHS, L, R = 64, 64, (64, 16, 16), 4, 16


class _StubStep:
    """A plan step whose C launch does nothing (the replay still picks each call's addresses)."""

    class _Launcher:
        hits = 0

    def __init__(self, count):
        self.launch = type("Launch", (), {"launcher": self._Launcher()})()
        self.pick = operator.itemgetter(*range(count))
        self.go = lambda stream, pointers: None


def stub_launches():
    """Route CPU tensors to the Triton launchers and give every new plan key a plan of two stubbed
    launches (the expand alone for stack_a), as the fast replay on a GPU would hold."""
    triton_launch._current_stream = lambda device: 0
    ops._cpu_backend = "triton"       # not set_cpu_backend: that asks for the interpreter
    for name in ("lora_linear", "lora_linear_stacked", "add_lora_"):
        ops.KERNELS[name]["cpu"] = getattr(launch, name)
    real_run = plan.run

    def run(plan_key, tensors, build, scratch_out=True):
        if plan.lookup(plan_key) is None:
            steps = [_StubStep(len(tensors))] * (1 if plan_key[0] == "lora_linear_stacked" else 2)
            plan._PLANS[plan_key] = plan.Plan(steps, (), -1, workspace=None if scratch_out else (0,))
        return real_run(plan_key, tensors, build, scratch_out)
    plan.run = run


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
    layer, stacked = make_layer(False), make_layer(True)
    x = torch.randn(M, K)

    def bound(on):
        return lambda: eager.set_enabled(on)
    variants = {   # name: (setup, call, the row it adds to)
        "F.linear": (bound(True), lambda: F.linear(x, layer.base.weight), None),
        "LoRALinear": (bound(True), lambda: layer(x), "F.linear"),
        "LoRALinear without bound calls": (bound(False), lambda: layer(x), "F.linear"),
        "F.linear over the stack": (bound(True), lambda: F.linear(x, stacked._stacked[0]), None),
        "stack_a": (bound(True), lambda: stacked(x), "F.linear over the stack"),
        "stack_a without bound calls": (bound(False), lambda: stacked(x), "F.linear over the stack"),
    }
    times = {name: [] for name in variants}
    with torch.no_grad():
        try:
            for _ in range(args.rounds):
                for name, (setup, fn, _) in variants.items():
                    setup()
                    fn()
                    times[name].append(min(timeit.repeat(fn, number=args.calls, repeat=3)) / args.calls * 1e6)
        finally:
            eager.set_enabled(True)
    assert layer._eager.replays > 0 and stacked._eager.replays > 0, "the bound calls never replayed"
    median = {name: statistics.median(v) for name, v in times.items()}
    adds = {name: median[name] - median[base] for name, (_, _, base) in variants.items() if base}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Python host work per LoRALinear call, C launches stubbed (cpu, torch {torch.__version__}, {date})",
             "", f"LoRALinear K {K} -> N {sum(WIDTHS)} ({len(WIDTHS)} slices), rank {R}, {L} slots, M = {M}, "
             f"float32 CPU tensors under no_grad; µs per call, median of {args.rounds} interleaved rounds "
             f"(each the best of 3 x {args.calls} calls).", "", "| call | µs | adds |", "|---|---|---|"]
    lines += [f"| {name} | {median[name]:.2f} | {f'{adds[name]:.2f}' if name in adds else ''} |"
              for name in variants]
    text = "\n".join(lines)
    print(text)
    if args.out:
        report.write_run_files(args.out, "host_python", {"gpu": "cpu", "date": date, "torch": torch.__version__,
                                                         "median_us": median, "adds_us": adds}, text)


if __name__ == "__main__":
    main()
