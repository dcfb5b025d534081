"""Lab (not a library path): the delta written first, the base GEMM accumulating onto it (DESIGN §4).

At large M add_lora_'s expand reads and writes y once more after the base GEMM wrote it: 4·M·N bytes,
~0.085 of the base layer at K = 4096 on the H200 by itself. Turned round:

    write_first:  shrink; expand *stores* scale·h·Bᵀ into an empty y (kernels.expand ACCUMULATE=False);
                  y.addmm_(x, Wᵀ) — cuBLAS with beta = 1 reads y once in its epilogue.

Session 15 measured this here and built it into lora_linear (launch.WRITE_FIRST_MIN_TOKENS). Variants per
Llama-3-8B layer, each timed against the base layer F.linear:

    layer / layer_accumulate   lora_linear as shipped (write-first from 1024 tokens) / with that path off
    layer_nopdl                lora_linear with add_lora_'s pair launched without PDL
    add_lora                   the delta op alone (the grid's "ours")
    stacked / stacked_pdl      lora_linear_stacked, its expand with PDL as shipped / at any token count
    write_first                the three steps above, composed here (its slot -1 rows are not zeroed)
    beta1                      y.addmm_(x, Wᵀ) alone: the price of beta = 1
    shrink                     add_lora_'s shrink alone (its h as the expand reads it)
    expand_rmw / expand_store  the expand alone, reading and writing y / storing it

All interleaved round by round (Timer.measure_paired), CUDA-graph replay medians, cold L2
(benchmarks/timing.py); deltas are medians of the per-round differences from the base layer.
write_first's adapted rows are checked against lora_linear's.

    python benchmarks/lab_write_first.py out.json                # H200 (BUDGET s, default 240; MS, RANKS)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_write_first.py /tmp/x.json   # logic check, tiny
"""
import contextlib
import json
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F

import repo_path  # noqa: F401,E402
from lora_ops import launch, plan  # noqa: E402
from lora_ops.layers import stacked_weight  # noqa: E402
from lab_env import DEV, TINY, ints, lab_rows, problem, run_env  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

BUDGET = float(os.environ.get("BUDGET", "240"))
TOKENS = ints("MS", "4096,8192,1024,256" if not TINY else "256,64")
RANKS = ints("RANKS", "16,64")


@contextlib.contextmanager
def setting(obj, attr, value):
    """``obj.attr`` = ``value`` within the block, with no launch plan kept across (plans hold launch options)."""
    plan.clear()
    with mock.patch.object(obj, attr, value):
        yield
    plan.clear()


@contextlib.contextmanager
def pdl_off():
    launch.set_pdl(False)
    try:
        yield
    finally:
        launch.set_pdl(True)


# Variants captured under a setting (Timer.measure_paired's prepare), their calls the plain layer's:
SETTINGS = {
    "layer_accumulate": lambda: setting(launch, "WRITE_FIRST_MIN_TOKENS", 1 << 62),   # write-first off
    "layer_nopdl": pdl_off,                                                           # add_lora_'s pair without PDL
    "stacked_pdl": lambda: setting(launch, "STACKED_PDL_MAX_TOKENS", 1 << 62),        # PDL at any token count
}


class Row:
    """One (layer, rank, M): input sets made on demand, and each variant's call on set k."""

    def __init__(self, layer, rank, M):
        self.p = problem(layer, rank, M)
        self.sets = {}

    def inputs(self, k):
        if k not in self.sets:
            p = self.p
            i = p.inputs(k)
            w = p.base_inputs(k)[1]
            self.sets[k] = dict(i=i, w=w, ws=stacked_weight(w, i.lora_a), y=torch.empty_like(i.y))
        return self.sets[k]

    def add_lora_launches(self, s, y):
        p = self.p
        launches, _, buffers = launch.add_lora_launches(y, s["i"].x, s["i"].lora_a, s["i"].lora_b, p.scale, p.rank,
                                                        p.widths, *p.meta)
        return launches, buffers

    def call(self, name, k):
        s, p = self.inputs(k), self.p
        i, w = s["i"], s["w"]
        if name == "base":
            return lambda: F.linear(i.x, w)
        if name == "beta1":
            return lambda: s["y"].addmm_(i.x, w.t())
        if name in ("layer", "layer_accumulate", "layer_nopdl"):   # the last two under SETTINGS
            op = torch.ops.lora_ops.lora_linear
            args = (i.x, w, None, i.lora_a, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
            return lambda: op(*args)
        if name == "add_lora":      # the delta alone, in place (what the grid's "ours" times)
            op = torch.ops.lora_ops.add_lora_
            args = (s["y"], i.x, i.lora_a, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
            return lambda: op(*args)
        if name in ("stacked", "stacked_pdl"):
            op = torch.ops.lora_ops.lora_linear_stacked
            args = (i.x, s["ws"], None, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
            return lambda: op(*args)
        launches, buffers = self.add_lora_launches(s, s["y"])
        if len(launches) != 2:
            return None   # the one-launch path (small batches): not this lab's question
        shrink, expand = launches
        store = expand._replace(constexprs={**expand.constexprs, "ACCUMULATE": False})
        if name == "write_first":
            def run():
                shrink()
                store()
                s["y"].addmm_(i.x, w.t())
            run.buffers = buffers   # h lives as long as the call
            return run
        if name == "shrink":
            return lambda: (shrink(), buffers)
        shrink()   # h for the expand-alone timings
        chosen = expand if name == "expand_rmw" else store
        return lambda: (chosen(), buffers)
    VARIANTS = ("base", "beta1", "layer", "layer_accumulate", "layer_nopdl", "add_lora", "stacked", "stacked_pdl",
                "write_first", "shrink", "expand_rmw", "expand_store")

    def check(self):
        """write_first's adapted rows against the shipped layer's (relative Frobenius error)."""
        s, p = self.inputs(0), self.p
        fn = self.call("write_first", 0)
        if fn is None:
            return None
        fn()
        ref = self.call("layer", 0)()
        keep = p.slots >= 0
        got, want = s["y"][keep].double(), ref[keep].double()
        return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))

    def set_bytes(self):
        p = self.p
        return p.set_bytes() + p.base_set_bytes() + p.M * p.N * p.esize


def main(out_path):
    timer = Timer(DEV)
    rows = []
    for layer, rank, M in lab_rows(TOKENS, RANKS, BUDGET):
        row = Row(layer, rank, M)
        err = row.check()
        if err is None:
            continue
        med, times = timer.measure_paired({v: (lambda k, v=v, row=row: row.call(v, k)) for v in Row.VARIANTS},
                                          {v: row.set_bytes() for v in Row.VARIANTS}, SETTINGS)
        delta = {v: paired_delta(times, v, "base")
                 for v in ("beta1", "layer", "layer_accumulate", "layer_nopdl", "stacked", "stacked_pdl",
                           "write_first")}
        delta["add_lora"] = med["add_lora"]
        rec = dict(layer=layer.name, rank=rank, M=M, err=err, median_us=med, delta_us=delta, runs_us=times)
        rows.append(rec)
        shown = ("layer", "layer_accumulate", "layer_nopdl", "stacked", "stacked_pdl", "write_first", "beta1")
        print(f"{layer.name:8s} r{rank:<3d} M={M:<5d} base {med['base']:8.1f} | delta: "
              f"add_lora_ {med['add_lora']:7.1f} " + " ".join(f"{v} {delta[v]:7.1f}" for v in shown)
              + f" | shrink {med['shrink']:6.1f} expand rmw {med['expand_rmw']:7.1f} store {med['expand_store']:7.1f}"
              f" | err {err:.1e}", flush=True)
        del row
    env = run_env()
    with open(out_path, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print("\n| layer | rank | M | base | add_lora_/base | layer/base | accumulating | no PDL | stacked/base | "
          "stacked PDL | write_first/base | beta1/base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["median_us"]["base"]
        d = r["delta_us"]
        print(f"| {r['layer']} | {r['rank']} | {r['M']} | {b:.1f} | {d['add_lora'] / b:.3f} | {d['layer'] / b:.3f} | "
              f"{d['layer_accumulate'] / b:.3f} | {d['layer_nopdl'] / b:.3f} | {d['stacked'] / b:.3f} | "
              f"{d['stacked_pdl'] / b:.3f} | "
              f"{d['write_first'] / b:.3f} | {d['beta1'] / b:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lab_write_first.json")
