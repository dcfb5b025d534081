"""CUDA-graph check of a model with LoRALinear layers (GPU only): one command, a short table last.

    python benchmarks/graph_check.py                    # bf16, writes to $OUT or benchmarks/results/
    python benchmarks/graph_check.py --dtype float16 --out /tmp/results

A decoder-like stack (fused q/k/v and gate/up Linears holding per-projection adapters in packed slices,
plus plain o/down Linears), four adapters of ranks 8 to 64 in eight slots. Checks:

1. An eager step captured with ``torch.cuda.graph``, replayed: with the captured slots, with new slots,
   after an adapter is swapped in place (``replace=True``) and after one is unloaded; each replay is
   compared with the same step run eagerly. Every step (``ctx.set_batch`` from a request list, then the
   replay) runs under ``torch.cuda.set_sync_debug_mode("error")``: no host sync.
2. The same with the step compiled (``torch.compile(fullgraph=True)``, inductor) and then captured.
3. ``torch.compile(mode="reduce-overhead")``: the same sequence, no recompile.
4. Graphs captured at several token counts (1 to 512), replayed against eager.

Exits 1 if any check fails. Results (JSON and the table) go to ``--out`` with the date, GPU, torch,
Triton and CUDA versions.
"""
import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import traceback

import torch
from torch import nn

import lora_ops

DEVICE = "cuda"
EXACT = 1e-6                                    # the same kernels replayed: float32 roundoff at most
# Compiled vs eager at model level: inductor fuses norms, rotary and attention differently, so a bf16 model of
# several blocks drifts by a few 1e-2 whatever LoRA does. The LoRA-specific checks are exact: an eager step
# replayed from a graph equals eager bit for bit, and a compiled step replayed equals the same compiled step
# run without a graph.
DTYPE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


# ---- the model --------------------------------------------------------------------------------------------

class Block(nn.Module):
    """Token-local decoder block: fused q/k/v, o, fused gate/up, down (no attention: the LoRA layers are
    what is checked)."""

    def __init__(self, hidden, kv, inter):
        super().__init__()
        self.kv, self.inter = kv, inter
        self.norm = nn.LayerNorm(hidden)
        self.qkv_proj = nn.Linear(hidden, hidden + 2 * kv, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.qkv_proj(self.norm(x)).split([x.shape[-1], self.kv, self.kv], dim=-1)
        h = x + self.o_proj(torch.cat([q[..., :self.kv] * k, v, q[..., 2 * self.kv:]], dim=-1))
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


def build(args, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.hidden, args.kv, args.inter) for _ in range(args.layers)])
    for p in model.parameters():
        nn.init.normal_(p, std=args.hidden ** -0.5) if p.dim() == 2 else None
    model = model.to(device=DEVICE, dtype=dtype).eval()
    packed = {"qkv_proj": {"q_proj": args.hidden, "k_proj": args.kv, "v_proj": args.kv},
              "gate_up_proj": {"gate_proj": args.inter, "up_proj": args.inter}}
    ctx = lora_ops.apply_lora(model, "all-linear", max_loras=8, max_rank=64, max_tokens=args.max_tokens,
                              packed_modules=packed)
    for i, (name, rank) in enumerate([("r8", 8), ("r16", 16), ("r64", 64), ("r32", 32)]):
        ctx.load_adapter_tensors(name, adapter_tensors(ctx, rank, seed=i), {"r": rank, "lora_alpha": 2 * rank})
    return model, ctx


def adapter_tensors(ctx, rank, seed):
    """Random PEFT-style tensors for every projection (the packed layers' slices by their own names)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (layer, index) in ctx.targets.items():
        if index is None and len(layer.slice_widths) > 1:
            continue                                   # a packed layer: its slices' entries cover it
        n = layer.out_features if index is None else layer.slice_widths[index]
        k = layer.in_features
        tensors[f"{path}.lora_A.weight"] = torch.randn(rank, k, generator=gen) / k ** 0.5
        tensors[f"{path}.lora_B.weight"] = torch.randn(n, rank, generator=gen) / rank ** 0.5
    return tensors


# ---- helpers -------------------------------------------------------------------------------------------

def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


@contextlib.contextmanager
def sync_is_an_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def capture(step, static_x):
    """Warm up on a side stream (Triton JIT, compile), then capture one step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_x)
    return graph, out


def time_ms(fn, iters=50):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


class Table:
    def __init__(self):
        self.rows = []

    def add(self, check, ok, err=None, note=""):
        self.rows.append({"check": check, "ok": bool(ok), "rel_err_vs_eager": err, "note": note})
        print(f"  {'PASS' if ok else 'FAIL'}  {check}" + (f"  (rel err {err:.1e})" if err is not None else "")
              + (f"  {note}" if note else ""), flush=True)

    def guarded(self, check, fn):
        """Run one check; an exception is a failed row, not the end of the run."""
        try:
            fn()
        except Exception as e:  # report and continue with the other checks
            traceback.print_exc()
            self.add(check, False, note=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")

    def text(self):
        lines = [f"{'check':<66} {'result':<6} {'rel err vs eager':>16}  note", "-" * 110]
        for r in self.rows:
            err = "" if r["rel_err_vs_eager"] is None else f"{r['rel_err_vs_eager']:.1e}"
            lines.append(f"{r['check']:<66} {'PASS' if r['ok'] else 'FAIL':<6} {err:>16}  {r['note']}")
        return "\n".join(lines)


# The replay sequence every graph check runs: (label, change before the step, requests of the step).
def scenario(ctx, M, seed=100):
    quarter = M // 4
    rest = M - 3 * quarter
    return [
        ("captured slots", None, [("r8", quarter), (None, quarter), ("r64", quarter), ("r16", rest)]),
        ("new slots", None, [("r32", rest), ("r8", quarter), ("r16", quarter), (None, quarter)]),
        ("adapter swapped in place",
         lambda: ctx.load_adapter_tensors("r8", adapter_tensors(ctx, 24, seed), {"r": 24, "lora_alpha": 12},
                                          replace=True),
         [("r8", M - quarter), ("r64", quarter)]),
        ("adapter unloaded",
         lambda: ctx.unload_adapter("r16"), [(None, M - quarter), ("r32", quarter)]),
    ]


def restore(ctx):
    """Back to the four original adapters (the scenario swaps and unloads)."""
    if "r16" not in ctx.adapters:
        ctx.load_adapter_tensors("r16", adapter_tensors(ctx, 16, 1), {"r": 16, "lora_alpha": 32})
    ctx.load_adapter_tensors("r8", adapter_tensors(ctx, 8, 0), {"r": 8, "lora_alpha": 16}, replace=True)


# ---- the checks ------------------------------------------------------------------------------------------

def check_graph(table, title, model, ctx, step, M, dtype, tol_vs_eager):
    """Capture ``step`` at M tokens, then replay the scenario; each replay against eager (and, for a
    compiled step, against the same compiled step run without a graph)."""
    restore(ctx)
    static_x = torch.randn(M, model[0].norm.normalized_shape[0], device=DEVICE, dtype=dtype)
    ctx.set_batch(scenario(ctx, M)[0][2])
    ptrs = [t.data_ptr() for t in ctx.meta]
    with torch.no_grad():
        graph, out = capture(step, static_x)
        for label, change, requests in scenario(ctx, M):
            if change:
                change()
            static_x.copy_(torch.randn_like(static_x))
            synced = None
            try:
                with sync_is_an_error():
                    ctx.set_batch(requests)
                    graph.replay()
            except RuntimeError as e:
                synced = str(e).splitlines()[0][:100]
            torch.cuda.synchronize()
            err = rel_err(out, model(static_x))
            note = f"host sync: {synced}" if synced else "no host sync"
            if step is not model:
                err_same = rel_err(out, step(static_x))
                note += f"; vs compiled without graph {err_same:.1e}"
                ok = err_same <= EXACT and err <= tol_vs_eager
            else:
                ok = err <= tol_vs_eager
            table.add(f"{title}: {label}", ok and not synced, err, note)
    table.add(f"{title}: metadata buffers never reallocated", ptrs == [t.data_ptr() for t in ctx.meta])
    return graph


def check_reduce_overhead(table, model, ctx, M, dtype):
    restore(ctx)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(M, model[0].norm.normalized_shape[0], device=DEVICE, dtype=dtype)
    with torch.no_grad():
        for label, change, requests in scenario(ctx, M):
            if change:
                change()
            ctx.set_batch(requests)
            for _ in range(3):             # cudagraph trees: warm-up, record, then replays
                out = compiled(x).clone()
            synced = None
            try:
                with sync_is_an_error():
                    ctx.set_batch(requests)
                    replayed = compiled(x)
            except RuntimeError as e:
                synced = str(e).splitlines()[0][:100]
            torch.cuda.synchronize()
            err = rel_err(out, model(x))
            ok = err <= DTYPE_TOL[dtype] and not synced and rel_err(replayed, out) <= EXACT
            table.add(f"reduce-overhead: {label}", ok, err, f"host sync: {synced}" if synced else "no host sync")
    graphs = counters["stats"]["unique_graphs"]
    table.add("reduce-overhead: one graph for the whole sequence", graphs == 1, note=f"{graphs} Dynamo graph(s)")


def check_token_counts(table, model, ctx, dtype, counts):
    restore(ctx)
    hidden = model[0].norm.normalized_shape[0]
    with torch.no_grad():
        for M in counts:
            x = torch.randn(M, hidden, device=DEVICE, dtype=dtype)
            names = [None, "r8", "r16", "r64", "r32"]
            ctx.set_batch([(names[i % 5], 1) for i in range(M)])
            graph, out = capture(model, x)
            x.copy_(torch.randn_like(x))
            ctx.set_batch([(names[(i * 3 + 1) % 5], 1) for i in range(M)])
            graph.replay()
            err = rel_err(out, model(x))
            eager_ms, graph_ms = time_ms(lambda: model(x)), time_ms(graph.replay)
            table.add(f"eager step in torch.cuda.graph at M={M}", err <= EXACT, err,
                      f"step {eager_ms:.3f} ms eager, {graph_ms:.3f} ms replay")
            del graph


# ---- main -----------------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description="CUDA-graph check of LoRALinear models")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--inter", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="token count of the scenario checks")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    return ap.parse_args()


def environment():
    import triton
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_check needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    env = environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    model, ctx = build(args, dtype)
    table = Table()
    M = args.tokens

    table.guarded("eager step in torch.cuda.graph",
                  lambda: check_graph(table, "eager step in torch.cuda.graph", model, ctx, model, M, dtype, EXACT))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    table.guarded("compiled step in torch.cuda.graph",
                  lambda: check_graph(table, "compiled step in torch.cuda.graph", model, ctx, compiled, M,
                                      dtype, DTYPE_TOL[dtype]))
    table.guarded("reduce-overhead", lambda: check_reduce_overhead(table, model, ctx, M, dtype))
    table.guarded("token counts", lambda: check_token_counts(table, model, ctx, dtype,
                                                             [c for c in (1, 7, 64, 512) if c <= args.max_tokens]))

    text = table.text()
    header = (f"graph_check {env['date']}  {env['gpu']}  torch {env['torch']}  triton {env['triton']}  "
              f"cuda {env['cuda']}\nmodel: {args.layers} blocks, hidden {args.hidden}, kv {args.kv}, "
              f"inter {args.inter}, {args.dtype}; 8 slots, 4 adapters (ranks 8-64), scenario at {M} tokens")
    os.makedirs(args.out, exist_ok=True)
    stamp = env["date"].replace(":", "").replace("-", "")[:15]
    base = os.path.join(args.out, f"graph_check_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"environment": env, "args": vars(args), "checks": table.rows}, f, indent=1)
    with open(base + ".txt", "w") as f:
        f.write(header + "\n\n" + text + "\n")
    print("\n" + header + "\n\n" + text)
    print(f"\nwritten: {base}.json, {base}.txt")
    if not all(r["ok"] for r in table.rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
