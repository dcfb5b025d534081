"""Lab (session 40): a training step's LoRA ops, one by one, against the base layer, and their configs.

A LoRA layer's training step runs the base GEMM forward (F.linear) and its backward to x (grad_out @ W, W
frozen), and for the delta: add_lora_ forward, then lora_grad_h (dh), lora_grad_x (dx), lora_grad_a (dA),
the shrink op (h again, for dB) and lora_grad_b (dB) (lora_ops.autograd.lora_grads). Every backward op runs on
the heuristic's config (no tuned table serves them). Per Llama-3-8B and Phi-4-mini layer, rank (4 slots, a
stack of that capacity, ~10% tokens without an adapter) and token count, each op is timed paired with the base
forward (CUDA-graph replays in turn, cold L2; Timer.measure_paired), beside its bytes floor and its MMA floor.

Then, with SWEEP=1, each backward op again on candidate configs (the config function patched, plans cleared),
every candidate checked against the ops' torch kernels (lora_ops.cpu / cpu_grad, float32 products) before it
is timed (alone, input sets rotated: cold L2; before 2026-12-06's second run one set, warm); the best
candidate's time over the heuristic's.

    python benchmarks/lab_train_ops.py                   # GPU (MODELS, LAYERS, RANKS, MS, SWEEP, SWEPT, BUDGET, TAG,
                                                         # GRAD_X_ONE_BLOCK, AB_GRAD_X, AB_GRAD_H: session 41;
                                                         # AB_GRAD_X_FILL: 43; AB_SHRINK_FILL: 44)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_train_ops.py   # logic check, tiny, float16
"""
import contextlib
import json
import os
import time
from unittest import mock

import torch
import torch.nn.functional as F

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints, run_env  # noqa: E402
from lora_ops import configs, cpu, cpu_grad, launch, launch_grad, plan  # noqa: E402
from lora_ops.ops import set_cpu_backend  # noqa: E402
from timing import Timer  # noqa: E402

MODELS = os.environ.get("MODELS", "llama3-8b,phi4-mini").split(",")
KEEP = os.environ.get("LAYERS", "qkv,o,gate_up,down").split(",")
RANKS = ints("RANKS", "16,64,256" if not TINY else "16")
TOKENS = ints("MS", "1024,4096" if not TINY else "48")
SWEEP = os.environ.get("SWEEP", "1") == "1"
BUDGET = float(os.environ.get("BUDGET", "480"))
COPY_BYTES_PER_S = 3.35e12 if DEV == "cuda" else 1e9
OPS = ("add_lora_", "grad_h", "grad_x", "grad_a", "shrink", "grad_b")
SWEPT = os.environ.get("SWEPT", ",".join(OPS[1:])).split(",")   # the ops SWEEP=1 sweeps
T0 = time.time()

# Candidates. The shrink kernel (the shrink op, and lora_grad_h through it): the split count is a runtime
# argument (one compile), so every count the heuristic might choose is tried beside its tiles.
SPLITS = (1, 2, 3, 4, 6, 8, 12)
SHRINK_TILES = ((64, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3))   # (block_m, block_k, warps, stages)
# The backward's own kernels: (block_m, block_n, warps, stages) of lora_grad_x and (block_t, block_q, warps,
# stages) of segment_outer (dA, dB), each on the heuristic's rank block.
GRAD_X = ((64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3))
# lora_grad_x's column blocks a program walks (N_LOOP), on the first three tiles above (GRAD_X_LOOPS=1: instead
# of them, the six tiles alone).
N_LOOPS = (1, 2, 4, 8)
GRAD_X_LOOPS = os.environ.get("GRAD_X_LOOPS", "1") == "1"
GRAD_X_LOOP_TILES = int(os.environ.get("GRAD_X_LOOP_TILES", "3"))   # how many of GRAD_X's tiles take N_LOOPS
# GRAD_X_ONE_BLOCK=1 (session 41): lora_grad_x's candidates are its ONE_RANK_BLOCK path (dh split once) instead,
# on these (block_n, warps, stages) at each of N_LOOPS, where the rank fits one block (the kernel's condition, not
# the heuristic's column cap: session 41's sweep timed three slices at rank 64 so).
GRAD_X_ONE_BLOCK = os.environ.get("GRAD_X_ONE_BLOCK", "0") == "1"
ONE_BLOCK_TILES = ((64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2), (64, 8, 3))
# AB_GRAD_X=1: the profile also times lora_grad_x as before session 41 (launch_grad.GRAD_X_HOLDS_DH off),
# paired with the rest, as "grad_x_before".
AB_GRAD_X = os.environ.get("AB_GRAD_X", "0") == "1"
# AB_GRAD_H=1: also lora_grad_h with B^T copied by torch (before session 41's transpose kernel), as "grad_h_before".
AB_GRAD_H = os.environ.get("AB_GRAD_H", "0") == "1"
# AB_GRAD_X_FILL=1 (session 43): also lora_grad_x with dx zero-filled first and the adapted rows written
# (launch_grad.GRAD_X_WRITES_ALL off), as "grad_x_fill".
AB_GRAD_X_FILL = os.environ.get("AB_GRAD_X_FILL", "0") == "1"
# AB_SHRINK_FILL=1 (session 44): also the shrink op and lora_grad_h with the h they return zero-filled first and
# the adapted entries written (launch.SHRINK_WRITES_ALL off), as "shrink_fill" and "grad_h_fill".
AB_SHRINK_FILL = os.environ.get("AB_SHRINK_FILL", "0") == "1"
SEGMENT = ((64, 128, 4, 2), (32, 128, 4, 3), (64, 128, 8, 3), (32, 256, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3))


def layers():
    by_model = {"llama3-8b": shapes.LLAMA3_8B, "phi4-mini": shapes.PHI4_MINI}
    if TINY:
        return [shapes.tiny_layer(layer) for layer in shapes.LLAMA3_8B[:2]]
    return [layer for m in MODELS for layer in by_model[m] if layer.name in KEEP]


class Step:
    """One problem's tensors (input set k) and its ops as callables."""

    def __init__(self, p, k):
        self.p, i = p, p.inputs(k)
        gen = torch.Generator(device=DEV).manual_seed(1000 + k)
        self.x, self.y, self.a, self.b = i.x, i.y, i.lora_a, i.lora_b
        self.w = torch.randn(p.N, p.K, device=DEV, dtype=DTYPE, generator=gen).mul_(p.K ** -0.5)
        self.g = torch.randn(p.M, p.N, device=DEV, dtype=DTYPE, generator=gen)
        ops = torch.ops.lora_ops
        meta = (p.rank, *p.meta)
        self.h = ops.shrink(self.x, self.a, p.scale, *meta)
        self.dh = ops.lora_grad_h(self.g, self.b, p.scale, *meta[:1], p.widths, *meta[1:])
        self.calls = {
            "base": lambda: F.linear(self.x, self.w),
            "base_dx": lambda: torch.mm(self.g, self.w),
            "add_lora_": lambda: ops.add_lora_(self.y, self.x, self.a, self.b, p.scale, p.rank, p.widths, *p.meta),
            "grad_h": lambda: ops.lora_grad_h(self.g, self.b, p.scale, p.rank, p.widths, *p.meta),
            "grad_x": lambda: ops.lora_grad_x(self.dh, self.a, *meta),
            "grad_a": lambda: ops.lora_grad_a(self.dh, self.x, *meta),
            "shrink": lambda: ops.shrink(self.x, self.a, p.scale, *meta),
            "grad_b": lambda: ops.lora_grad_b(self.g, self.h, p.rank, p.widths, *p.meta),
        }

    def reference(self, name):
        """The op's output by its torch kernel (float32 products), for checking a candidate."""
        p, meta = self.p, (self.p.rank, *self.p.meta)
        return {"grad_h": lambda: cpu_grad.lora_grad_h(self.g, self.b, p.scale, p.rank, p.widths, *p.meta),
                "grad_x": lambda: cpu_grad.lora_grad_x(self.dh, self.a, *meta),
                "grad_a": lambda: cpu_grad.lora_grad_a(self.dh, self.x, *meta),
                "shrink": lambda: cpu.shrink(self.x, self.a, p.scale, *meta),
                "grad_b": lambda: cpu_grad.lora_grad_b(self.g, self.h, p.rank, p.widths, *p.meta)}[name]()


def floors(p):
    """{op: (bytes floor µs, flops)} of each op, and of the base forward."""
    e, M, K, N, L, S, R = p.esize, p.M, p.K, p.N, p.L, p.S, p.R
    a, b = L * S * R * K * e, L * N * R * e
    h = M * S * R * 4
    by = {"base": M * K * e + N * K * e + M * N * e, "base_dx": M * N * e + N * K * e + M * K * e,
          "add_lora_": M * K * e + a + b + 2 * M * N * e, "grad_h": M * N * e + 3 * b + h,
          "grad_x": h + a + M * K * e, "grad_a": h + M * K * e + a, "shrink": M * K * e + a + h,
          "grad_b": M * N * e + h + b}
    fl = {"base": 2 * M * N * K, "base_dx": 2 * M * N * K, "add_lora_": 2 * M * R * (S * K + N),
          "grad_h": 2 * M * N * R, "grad_x": 2 * M * S * R * K, "grad_a": 2 * M * S * R * K,
          "shrink": 2 * M * S * R * K, "grad_b": 2 * M * N * R}
    return {k: (by[k] / COPY_BYTES_PER_S * 1e6, fl[k]) for k in by}


@contextlib.contextmanager
def patched(name, cfg):
    """The op ``name``'s config function answering ``cfg`` (plans built afresh inside and after)."""
    if name in ("shrink", "grad_h"):
        target = mock.patch.object(configs, "shrink_config", lambda *a, **k: cfg)
    elif name == "grad_x":
        target = mock.patch.object(launch_grad, "grad_x_config", lambda *a, **k: cfg)
    else:
        target = mock.patch.object(launch_grad, "segment_outer_config", lambda *a, **k: cfg)
    plan.clear()
    with target:
        yield
    plan.clear()


def candidates(name, p):
    if name in ("shrink", "grad_h"):
        base = configs.shrink_config(p.M, p.K if name == "shrink" else max(p.widths), p.S, p.R, p.L,
                                     torch.device(DEV), DTYPE)
        group = 1 if name == "grad_h" else base.slice_group
        out = []
        for bm, bk, w, st in SHRINK_TILES:
            for s in SPLITS:
                out.append(base._replace(block_m=bm, block_k=bk, num_warps=w, num_stages=st, split_k=s,
                                         slice_group=group))
        return out if not TINY else out[:3]
    if name == "grad_x" and GRAD_X_ONE_BLOCK:
        base = launch_grad.grad_x_config(p.M, p.K, p.R, p.S)
        if p.R > base.block_r:
            return []
        out = [base._replace(block_n=n, num_warps=w, num_stages=st, n_loop=k, one_rank_block=True)
               for n, w, st in ONE_BLOCK_TILES for k in N_LOOPS]
    elif name == "grad_x":
        base = launch_grad.grad_x_config(p.M, p.K, p.R, p.S)
        tiles = [base._replace(block_m=m, block_n=n, num_warps=w, num_stages=st, one_rank_block=False)
                 for m, n, w, st in GRAD_X]   # (session 40's sweep: the rank-block path)
        out = [t._replace(n_loop=k) for t in tiles[:GRAD_X_LOOP_TILES] for k in N_LOOPS] if GRAD_X_LOOPS else tiles
    else:
        P, Q, slots = (p.R, p.K, p.L * p.S) if name == "grad_a" else (p.R, p.N, p.L)
        base = launch_grad.segment_outer_config(P, Q, slots)   # (its rank block; the candidates set the rest)
        out = [base._replace(block_t=t, block_q=q, num_warps=w, num_stages=st) for t, q, w, st in SEGMENT]
    return out if not TINY else out[:2]


def rel_err(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def step_sets(p):
    """(steps, make): the problem's input sets as Steps, made on demand; make(name)(k) is op ``name``'s call on
    set k (Timer rotates sets across a graph's calls, so each replay reads from a cold L2)."""
    steps = {}

    def make(name):
        def make_call(k):
            if k not in steps:
                steps[k] = Step(p, k)
            return steps[k].calls[VARIANTS[name][0] if name in VARIANTS else name]   # (a variant: the op, patched)
        return make_call
    return steps, make


def _torch_b_t(lora_b, num_slices):
    L, N, R = lora_b.shape
    return lora_b.transpose(1, 2).contiguous().unsqueeze(1).expand(L, num_slices, R, N)


@contextlib.contextmanager
def patched_attr(attr, value, module=launch_grad):
    """``module``'s ``attr`` as ``value`` inside, plans built afresh inside and after: an op as it was."""
    plan.clear()
    with mock.patch.object(module, attr, value):
        yield
    plan.clear()


# The profile's "before" variants, {name: (the op, on, its patch)}: lora_grad_x without its ONE_RANK_BLOCK path
# and lora_grad_h with B^T copied by torch (AB_GRAD_X, AB_GRAD_H: as before session 41), lora_grad_x on a
# zero-filled dx (AB_GRAD_X_FILL: as before session 43), the shrink op and lora_grad_h on a zero-filled h
# (AB_SHRINK_FILL: as before session 44).
VARIANTS = {"grad_x_before": ("grad_x", AB_GRAD_X, lambda: patched_attr("GRAD_X_HOLDS_DH", False)),
            "grad_h_before": ("grad_h", AB_GRAD_H, lambda: patched_attr("b_as_shrink_a", _torch_b_t)),
            "grad_x_fill": ("grad_x", AB_GRAD_X_FILL, lambda: patched_attr("GRAD_X_WRITES_ALL", False)),
            "shrink_fill": ("shrink", AB_SHRINK_FILL, lambda: patched_attr("SHRINK_WRITES_ALL", False, launch)),
            "grad_h_fill": ("grad_h", AB_SHRINK_FILL, lambda: patched_attr("SHRINK_WRITES_ALL", False, launch))}
AB = [name for name, (_, on, _) in VARIANTS.items() if on]


def profile(timer, p):
    steps, make = step_sets(p)
    names = ("base", "base_dx", *OPS, *AB)
    set_bytes = p.set_bytes() * 2
    times, _ = timer.measure_paired({n: make(n) for n in names}, dict.fromkeys(names, set_bytes),
                                    {n: VARIANTS[n][2] for n in AB})
    return times, steps, make


def sweep(timer, p, step0, make, name):
    """[(config, µs, error)] of the candidates of op ``name``, each checked on set 0, then timed (sets rotated)
    if it passes."""
    tol = 1e-2 if name in ("grad_x", "grad_a", "grad_b") else 1e-4
    want = step0.reference(name)
    rows = []
    for cfg in candidates(name, p):
        if time.time() - T0 > BUDGET:
            break
        try:
            with patched(name, cfg):
                got = step0.calls[name]()
                err = rel_err(got, want)
                if not err <= tol:
                    rows.append((cfg, None, err))
                    continue
                us, _, _ = timer.measure(make(name), p.set_bytes() * 2, eager=False)
        except Exception as e:   # a config past the GPU's shared memory: noted, not fatal
            timer.sync_quietly()
            rows.append((cfg, None, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        rows.append((cfg, us, err))
    return rows


def main():
    if DEV != "cuda":
        set_cpu_backend("triton")   # the logic check runs our kernels (interpreted), not the torch ones
    timer = Timer(DEV)
    out = dict(run_env(), rows=[], method=timer.method())
    print(f"# {out['gpu']}, torch {out['torch']}, Triton {out['triton']}, {out['dtype']}")
    print("| layer | r | M | base | base dx | " + " | ".join(OPS) + " | LoRA / base (fwd+dx) | worst op / floor |")
    print("|" + "---|" * (6 + len(OPS) + 1))
    for layer in layers():
        for rank in RANKS:
            for M in TOKENS:
                if time.time() - T0 > BUDGET:
                    print("budget spent")
                    break
                p = problems.Problem.for_case(shapes.Case(layer, shapes.uniform(rank), M), DTYPE, DEV)
                times, steps, make = profile(timer, p)
                fl = floors(p)
                lora = sum(times[o] for o in OPS)
                base = times["base"] + times["base_dx"]
                worst = max(OPS, key=lambda o: times[o] / fl[o][0])
                row = dict(model=layer.model, layer=layer.name, rank=rank, M=M, us=times,
                           floor_us={k: v[0] for k, v in fl.items()}, lora_over_base=lora / base)
                print(f"| {layer.model[:5]} {layer.name} | {rank} | {M} | {times['base']:.1f} | "
                      + f"{times['base_dx']:.1f} | " + " | ".join(f"{times[o]:.1f}" for o in OPS)
                      + f" | {lora / base:.2f} | {worst} {times[worst] / fl[worst][0]:.1f}x |"
                      + "".join(f" {n} {times[n]:.1f} ({times[VARIANTS[n][0]] / times[n]:.2f})" for n in AB),
                      flush=True)
                if SWEEP:
                    row["sweep"] = {}
                    for name in SWEPT:
                        heur_us, _, _ = timer.measure(make(name), p.set_bytes() * 2, eager=False)
                        res = sweep(timer, p, steps[0], make, name)
                        ok = [r for r in res if r[1] is not None]
                        best = min(ok, key=lambda r: r[1]) if ok else None
                        row["sweep"][name] = dict(heuristic_us=heur_us,
                                                  candidates=[(list(c), u, e if isinstance(e, str) else round(e, 8))
                                                              for c, u, e in res])
                        failed = [r for r in res if r[1] is None]
                        print(f"    {name}: heuristic {heur_us:.1f} us; best {best[1]:.1f} us "
                              f"({best[1] / heur_us:.2f}) {tuple(best[0])}" if best else f"    {name}: none ran",
                              f"; failed {len(failed)}: {failed[:1]}" if failed else "", flush=True)
                out["rows"].append(row)
                steps.clear()
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    dest = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    tag = os.environ.get("TAG", "")
    with open(os.path.join(dest, f"lab_train_ops{'-' + tag if tag else ''}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
