"""Gradients of lora_ops.lora_forward at Llama-3-8B layer shapes against a float64 reference, and the time of
one layer's forward + backward with 4 adapters in one batch against a PEFT-style loop over the adapters.

Check rows (layer, dtype, M): y = random, x, A [4, S, 64, K], B [4, N, 64] (slot ranks 64/16/48/8, signed
scales, 10% of tokens with slot -1, rank rows past each slot's rank filled with random values), a random
incoming gradient; ours against lora_forward_reference in float64 on the same device (per slot: float64
products over that slot's tokens), relative Frobenius errors of the output and of dx, dA, dB; dy must equal
the incoming gradient and dx rows of -1 tokens must be exactly 0.

Timing rows (layer, M = 4096, bf16): base = F.linear with a frozen W and its backward to x; ours = base +
lora_forward, backward to x, A, B; PEFT-style = base, then per adapter a boolean mask and, per slice,
y[mask] += scale * (x[mask] @ A^T) @ B^T under autograd. Batch metadata and masks are built outside the
timed region. CUDA events around forward + backward, median over the repeats.

    python benchmarks/grad_check.py                         # the H200 run (writes to $OUT or benchmarks/results)
    python benchmarks/grad_check.py --device cpu --tiny     # logic check on a CPU
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

from repo_path import HERE  # noqa: E402  (first: this checkout's lora_ops)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lora_ops  # noqa: E402
from lora_ops.reference import lora_forward_reference  # noqa: E402
from problems import TOLERANCE, token_slots  # noqa: E402
from shapes import LLAMA3_8B, NUM_SLOTS, TINY_RANK_DIVISOR, tiny_layer  # noqa: E402

SLOT_RANKS = (64, 16, 48, 8)          # one stack of capacity 64 holding four ranks
SLOT_SCALES = (0.5, -2.0, 1.0, 0.25)
CHECK_TOKENS = (1, 256, 4096, 8192)
TINY_CHECK_TOKENS = (1, 16, 64, 256)
TIME_TOKENS = 4096
TINY_TIME_TOKENS = 256
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="features / 64, ranks / 8, M <= 256 (CPU logic check)")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--tokens", help="comma-separated M values of the check (default 1,256,4096,8192)")
    p.add_argument("--time-tokens", type=int, help=f"M of the timing (default {TIME_TOKENS})")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Layer:
    """One layer's weights for a dtype: the frozen base W and the slot stack, and the batch of M tokens."""

    def __init__(self, layer, ranks, M, dtype, device, seed):
        self.name, self.K, self.widths = layer.name, layer.in_features, list(layer.slices)
        self.N, self.S, self.R, self.L = sum(self.widths), len(self.widths), max(ranks), len(ranks)
        self.M, self.dtype, self.device = M, dtype, torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(seed)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, device=self.device) * std).to(dtype)

        self.x = randn(M, self.K)
        self.y = randn(M, self.N)
        self.grad = randn(M, self.N)
        # Rank rows past each slot's rank hold random values too: reading them fails the check.
        self.lora_a = randn(self.L, self.S, self.R, self.K, std=self.K ** -0.5)
        self.lora_b = randn(self.L, self.N, self.R, std=self.R ** -0.5)
        self.w = randn(self.N, self.K, std=self.K ** -0.5)
        self.scale = torch.tensor(SLOT_SCALES[:self.L], dtype=torch.float32, device=self.device)
        self.rank = torch.tensor(ranks, dtype=torch.int32, device=self.device)
        self.slots = token_slots(M, self.L, seed).to(self.device)
        self.batch = lora_ops.LoRABatch(max(M, 1), self.L, device=self.device)
        self.meta = self.batch.update(self.slots)

    def leaves(self, dtype=None):
        return [t.detach().to(dtype or t.dtype).requires_grad_() for t in (self.y, self.x, self.lora_a, self.lora_b)]


def rel_err(out, ref):
    out, ref = out.detach(), ref.detach()
    ref_norm = float(torch.linalg.vector_norm(ref))
    diff = float(torch.linalg.vector_norm(out.double() - ref))
    if diff != diff:   # NaN
        return float("inf")
    return diff / ref_norm if ref_norm else (0.0 if diff == 0.0 else float("inf"))


def check_row(layer):
    y, x, a, b = layer.leaves()
    out = lora_ops.lora_forward(y, x, a, b, layer.scale, layer.rank, batch=layer.meta, slice_widths=layer.widths)
    out.backward(layer.grad)
    y64, x64, a64, b64 = layer.leaves(torch.float64)
    ref = lora_forward_reference(y64, x64, a64, b64, layer.scale, layer.rank, layer.slots, layer.widths)
    ref.backward(layer.grad.double())
    errs = {"out": rel_err(out, ref.detach()), "dx": rel_err(x.grad, x64.grad), "dA": rel_err(a.grad, a64.grad),
            "dB": rel_err(b.grad, b64.grad)}
    none_rows = layer.slots < 0
    notes = []
    tol = TOLERANCE[layer.dtype]
    notes += [f"{k} rel. error {v:.2e} > {tol:.0e}" for k, v in errs.items() if not v <= tol]
    if not torch.equal(y.grad, layer.grad):
        notes.append("dy differs from the incoming gradient")
    if bool(x.grad[none_rows].any()):
        notes.append("dx rows of -1 tokens not zero")
    return dict(layer=layer.name, dtype=str(layer.dtype).replace("torch.", ""), M=layer.M, tol=tol,
                ok=not notes, note="; ".join(notes), **errs)


# --- timing


def peft_style_loop(layer, x, a, b):
    """Base output plus, per adapter, per slice: y[mask] += scale * (x[mask] @ A^T) @ B^T (autograd)."""
    masks = layer.masks
    y = F.linear(x, layer.w)
    ranks = layer.rank.tolist()
    scales = layer.scale.tolist()
    for slot, mask in enumerate(masks):
        xs = x[mask]
        r = ranks[slot]
        parts, col = [], 0
        for i, n in enumerate(layer.widths):
            parts.append((xs @ a[slot, i, :r].T) @ b[slot, col:col + n, :r].T * scales[slot])
            col += n
        y[mask] += torch.cat(parts, dim=1)
    return y


def ours_layer(layer, x, a, b):
    return lora_ops.lora_forward(F.linear(x, layer.w), x, a, b, layer.scale, layer.rank, batch=layer.meta,
                                 slice_widths=layer.widths)


def ours_layer_op(layer, x, a, b):
    """The whole layer as lora_ops::lora_linear (what LoRALinear runs): the base dx and the delta's dx
    summed in one GEMM epilogue in the backward."""
    return torch.ops.lora_ops.lora_linear(x, layer.w, None, a, b, layer.scale, layer.rank, layer.widths,
                                          *layer.meta)


def base_layer(layer, x, a, b):
    return F.linear(x, layer.w)


def time_fwd_bwd(layer, fn, repeats, warmup=3):
    """Median ms of fn(...) forward + backward (x, A, B require grad; W frozen)."""
    _, x, a, b = layer.leaves()
    cuda = layer.device.type == "cuda"
    times = []
    for i in range(warmup + repeats):
        for t in (x, a, b):
            t.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        fn(layer, x, a, b).backward(layer.grad)
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times), (x.grad, a.grad, b.grad)


def timing_row(layer, repeats):
    layer.masks = [layer.slots == s for s in range(layer.L)]
    base_ms, _ = time_fwd_bwd(layer, base_layer, repeats)
    ours_ms, ours_grads = time_fwd_bwd(layer, ours_layer, repeats)
    op_ms, op_grads = time_fwd_bwd(layer, ours_layer_op, repeats)
    peft_ms, peft_grads = time_fwd_bwd(layer, peft_style_loop, repeats)
    agree = max(rel_err(o, p.double()) for o, p in zip(ours_grads + op_grads, peft_grads + peft_grads))
    return dict(layer=layer.name, dtype=str(layer.dtype).replace("torch.", ""), M=layer.M, base_ms=base_ms,
                ours_ms=ours_ms, layer_op_ms=op_ms, peft_loop_ms=peft_ms, lora_ours_ms=ours_ms - base_ms,
                lora_peft_ms=peft_ms - base_ms, speedup=peft_ms / ours_ms, layer_op_speedup=peft_ms / op_ms,
                grads_vs_peft_rel=agree, grads_ok=bool(agree <= TOLERANCE[layer.dtype]))   # (NaN: not ok)


# --- output


def markdown(checks, timings, meta):
    lines = [f"# lora_forward gradients ({meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, "
             f"{meta['date']})", "",
             f"Slot ranks {meta['slot_ranks']} (capacity {max(meta['slot_ranks'])}), scales {SLOT_SCALES}, "
             "10% of tokens with slot -1. Relative Frobenius errors against float64.", "",
             "| layer | dtype | M | out | dx | dA | dB | tol | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in checks:
        lines.append(f"| {r['layer']} | {r['dtype']} | {r['M']} | {r['out']:.1e} | {r['dx']:.1e} | {r['dA']:.1e} "
                     f"| {r['dB']:.1e} | {r['tol']:.0e} | {'yes' if r['ok'] else 'NO: ' + r['note']} |")
    if timings:
        lines += ["", "Forward + backward, one layer, 4 adapters in one batch (median ms, CUDA events):", "",
                  "base+ours: F.linear then lora_forward; layer op: lora_ops::lora_linear, the op LoRALinear "
                  "runs (base and delta in one op).", "",
                  "| layer | dtype | M | base | base+ours | layer op | base+PEFT loop | LoRA part ours | LoRA part PEFT "
                  "| speedup | layer op speedup | grads ours vs PEFT |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in timings:
            lines.append(f"| {r['layer']} | {r['dtype']} | {r['M']} | {r['base_ms']:.3f} | {r['ours_ms']:.3f} "
                         f"| {r['layer_op_ms']:.3f} | {r['peft_loop_ms']:.3f} | {r['lora_ours_ms']:.3f} "
                         f"| {r['lora_peft_ms']:.3f} | {r['speedup']:.2f}x | {r['layer_op_speedup']:.2f}x "
                         f"| {r['grads_vs_peft_rel']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    tokens = (tuple(int(m) for m in args.tokens.split(",")) if args.tokens
              else TINY_CHECK_TOKENS if args.tiny else CHECK_TOKENS)
    time_tokens = args.time_tokens or (TINY_TIME_TOKENS if args.tiny else TIME_TOKENS)
    layers = [tiny_layer(layer) for layer in LLAMA3_8B] if args.tiny else list(LLAMA3_8B)
    ranks = tuple(max(1, r // TINY_RANK_DIVISOR) for r in SLOT_RANKS) if args.tiny else SLOT_RANKS
    assert len(ranks) == NUM_SLOTS
    meta = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                torch=torch.__version__, triton=getattr(__import__("triton"), "__version__", None),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                slot_ranks=list(ranks), tiny=args.tiny)

    checks, timings = [], []
    for dtype in dtypes:
        for spec in layers:
            for M in tokens:
                row = check_row(Layer(spec, ranks, M, dtype, args.device, args.seed + M))
                checks.append(row)
                print(f"check {row['layer']:8s} {row['dtype']:9s} M={M:5d}  out {row['out']:.1e}  dx {row['dx']:.1e}"
                      f"  dA {row['dA']:.1e}  dB {row['dB']:.1e}  {'ok' if row['ok'] else 'FAIL ' + row['note']}",
                      flush=True)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    if not args.no_timing:
        time_dtype = torch.bfloat16 if torch.bfloat16 in dtypes else dtypes[0]
        for spec in layers:
            timings.append(timing_row(Layer(spec, ranks, time_tokens, time_dtype, args.device, args.seed),
                                      args.repeats))

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "grad_check.json"), "w") as f:
        json.dump(dict(meta=meta, checks=checks, timings=timings), f, indent=1)
    text = markdown(checks, timings, meta)
    with open(os.path.join(args.out, "grad_check.md"), "w") as f:
        f.write(text)
    failed = [r for r in checks if not r["ok"]]
    # The timing rows' gradients (base+ours and the layer op, lora_ops::lora_linear) against the PEFT-style
    # loop's: the layer op's were reported and never judged.
    failed += [dict(r, layer=f"{r['layer']} (timed, vs PEFT {r['grads_vs_peft_rel']:.1e})") for r in timings
               if not r["grads_ok"]]
    print()
    print(f"{len(checks) + len(timings) - len(failed)}/{len(checks) + len(timings)} gradient checks passed"
          + (": FAILED " + ", ".join(f"{r['layer']} {r['dtype']} M={r['M']}" for r in failed) if failed else ""))
    if timings:
        print(f"{'layer':8s} {'base ms':>8s} {'ours ms':>8s} {'op ms':>8s} {'PEFT ms':>8s} {'LoRA ours':>9s} "
              f"{'LoRA PEFT':>9s} {'speedup':>7s} {'op speedup':>10s}")
        for r in timings:
            print(f"{r['layer']:8s} {r['base_ms']:8.3f} {r['ours_ms']:8.3f} {r['layer_op_ms']:8.3f} "
                  f"{r['peft_loop_ms']:8.3f} {r['lora_ours_ms']:9.3f} {r['lora_peft_ms']:9.3f} {r['speedup']:6.2f}x "
                  f"{r['layer_op_speedup']:9.2f}x")
    print(f"wrote {args.out}/grad_check.json and grad_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
