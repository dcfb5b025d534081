"""Repeated runs of every shipped path at the grids' shapes, checked value by value and bit for bit.

Session 20 found the high-rank expand writing wrong values into a few rows of a tile in some runs and not
in others (benchmarks/lab_wrong_values.py; a race between an asynchronous wgmma and the registers it
reads, triton-lang/triton#9433). The benchmark's check (a relative Frobenius error) passes a few hundred
wrong values among millions, and one run can be lucky. Here each path runs REPEATS times on the same
inputs: every run's delta is compared with the float64 one value by value (the tuner's bound,
configs.tuning.allowed_error: 4 rounding steps of y's dtype relative to |value| + the delta's RMS; NaN
fails), and the runs' outputs bit for bit (every path is deterministic by design: no float atomics).

Paths per row: add_lora_ (the table's configs: fused, shrink + one-block or rank-loop expand), lora_linear
(at 1024+ tokens its write-first path where launch.writes_first), and lora_linear_stacked (stack_a's layer)
where layers.stacked_token_limit lets LoRALinear take it and at up to 256 tokens everywhere; with GRADS
(token counts, default 256,4096) also lora_forward's backward (dx, dA, dB: kernels.grad) there, against
the float64 reference's gradients.

    python benchmarks/race_sweep.py                       # H200: high ranks first, then the core grid
    GRID=core MS=1,64 python benchmarks/race_sweep.py
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/race_sweep.py   # logic check, tiny, float32
"""
import os
import time

import torch

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lora_ops.configs import tuning  # noqa: E402
from lora_ops.layers import stacked_token_limit, stacked_weight  # noqa: E402
from lora_ops.precision import stacked_gemm  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
TINY = DEV != "cuda"
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
    os.environ.get("DTYPE", "bf16" if not TINY else "fp32")]
REPEATS = int(os.environ.get("REPEATS", "5"))
BUDGET = float(os.environ.get("BUDGET", "1e9"))
GRID = os.environ.get("GRID", "highrank,core").split(",")
GRAD_TOKENS = [int(v) for v in os.environ.get("GRADS", "256,4096").split(",") if v]
T0 = time.time()


def ints(var, default):
    return [int(v) for v in os.environ.get(var, default).split(",")]


def cases():
    layers = {"core": shapes.LLAMA3_8B, "highrank": shapes.LLAMA3_8B + shapes.PHI4_MINI}
    ranks = {"core": ints("CORE_RANKS", "16,64"), "highrank": ints("HIGH_RANKS", "128,256,320")}
    tokens = {"core": ints("MS", "1,16,64,256,1024,4096,8192"), "highrank": ints("MS", "64,256,1024,4096")}
    for grid in GRID:
        for M in tokens[grid]:
            for r in ranks[grid]:
                for layer in layers[grid]:
                    if TINY:
                        layer = shapes.tiny_layer(layer)
                    yield layer, r, M


def paths(p, i):
    """name -> build(): sets i.y to what the path adds the delta onto and returns the call that adds it."""
    w = p.base_inputs(0)[1]
    out = {"add_lora_": lambda: problems.ours(p, i)}

    def layer_path(call, before):
        def build():
            i.y.copy_(before())
            return lambda: i.y.copy_(call())
        return build
    if p.M >= 1024:
        out["lora_linear"] = layer_path(problems.layer(p, i, w), lambda: torch.nn.functional.linear(i.x, w))
    # The stacked op where LoRALinear(stack_a=True) takes it, and at up to 256 tokens everywhere (a public op:
    # its rank loop reads the GEMM's 16-bit h as it is, kernels.expand.rank_loop).
    if p.M <= max(256, stacked_token_limit(p.N, p.K, p.L * p.S * p.R, device=p.device, dtype=p.dtype)):
        wst = stacked_weight(w, i.lora_a)
        op = torch.ops.lora_ops.lora_linear_stacked
        args = (i.x, wst, None, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
        out["stacked"] = layer_path(lambda: op(*args)[:, :p.N],
                                    lambda: stacked_gemm(i.x, wst, None, p.N, p.L * p.S * p.R)[:, :p.N])
    return out


def grad_row(p, i):
    """lora_forward's backward REPEATS times: (runs with a gradient off, most values off, bits same)."""
    import lora_ops
    from lora_ops.reference import lora_forward_reference
    g = torch.Generator(device=p.device).manual_seed(1)
    dy = torch.randn(i.y.shape, generator=g, device=p.device).to(p.dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (i.x, i.lora_a, i.lora_b)]
    refs = [t.detach().double().requires_grad_() for t in (i.x, i.lora_a, i.lora_b)]
    lora_forward_reference(i.y.double(), *refs, p.scale, p.rank, p.slots, p.widths).backward(dy.double())
    exact = [r.grad for r in refs]
    rms = [e.pow(2).mean().sqrt() for e in exact]
    outs, wrong = [], []
    for _ in range(REPEATS):
        for t in leaves:
            t.grad = None
        lora_ops.lora_forward(i.y, *leaves, p.scale, p.rank, batch=p.meta, slice_widths=p.widths).backward(dy)
        grads = [t.grad.clone() for t in leaves]
        wrong.append(sum(int(tuning.off_mask(o, e, r, torch.finfo(p.dtype).eps).sum())
                         for o, e, r in zip(grads, exact, rms)))
        outs.append(grads)
    same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0]))
    return sum(w > 0 for w in wrong), max(wrong), same


def sweep_row(layer, r, M):
    p = problems.Problem.for_case(shapes.Case(layer, shapes.uniform(r), M), DTYPE, DEV)
    i = p.inputs(0)
    exact = problems.reference_delta(p, i)
    y0 = i.y.clone()
    lines = []
    for name, build in paths(p, i).items():
        outs, wrong = [], []
        for _ in range(REPEATS):
            call = build()
            before = i.y.clone()
            call()
            wrong.append(problems.values_off(i.y, before, exact))
            outs.append(i.y.clone())
            i.y.copy_(y0)
        same = all(torch.equal(o, outs[0]) for o in outs[1:])
        bad = sum(w > 0 for w in wrong)
        lines.append((name, bad, max(wrong), same))
    if M in GRAD_TOKENS:
        lines.append(("grads", *grad_row(p, i)))
    return lines


def main():
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, torch {torch.__version__}, {DTYPE}, "
          f"{REPEATS} runs a path")
    print("| model | layer | r | M | path | runs wrong | most values off | bits same |\n"
          "|---|---|---|---|---|---|---|---|")
    total = failed = 0
    for layer, r, M in cases():
        if time.time() - T0 > BUDGET:
            print("budget spent")
            break
        for name, bad, most, same in sweep_row(layer, r, M):
            total += 1
            failed += bool(bad) or not same
            flag = "" if not bad and same else " **FAIL**"
            print(f"| {layer.model} | {layer.name} | {r} | {M} | {name} | {bad}/{REPEATS} | {most} | {same}{flag} |",
                  flush=True)
    print(f"\n{failed} of {total} paths failed (wrong values in some run, or runs that differ)")


if __name__ == "__main__":
    main()
