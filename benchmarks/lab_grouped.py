"""Lab (not a library path): would PyTorch's grouped GEMM (torch._grouped_mm, CUTLASS on sm_90) beat our
kernels at high ranks and many tokens, where the delta is compute-bound (DESIGN §4)?

The delta as grouped GEMMs over the tokens sorted by slot (lora_ops.batch's sorted_token_ids, 'no adapter'
last): gather x in slot order, one grouped GEMM against every slot's A (a zero group for the tokens with no
adapter), one per slice against the slot's B (scale folded into a copy of B), then add each slice's rows
back into y (index_add_). h is bf16 here, as in the stacked path. Timed against the base layer and add_lora_
on the high-rank grid at 1024 and 4096 tokens; CUDA-graph replay medians, cold L2 (benchmarks/timing.py);
each grouped call is first checked against the float64 delta.

    python benchmarks/lab_grouped.py out.json                       # H200 (BUDGET s, default 200)
    DEV=cpu python benchmarks/lab_grouped.py /tmp/x.json            # logic check, tiny shapes
"""
import json
import math
import os
import sys
import time

import torch

import repo_path  # noqa: F401
import problems  # noqa: E402
import shapes  # noqa: E402
from timing import Timer  # noqa: E402

DEV = os.environ.get("DEV", "cuda")
TINY = DEV != "cuda"
DTYPE = torch.bfloat16
BUDGET = float(os.environ.get("BUDGET", "200"))
T0 = time.time()


def grouped_weights(p, inp):
    """A as [L + 1, K, S·R] and each slice's scaled B as [L + 1, R, n_i] (K-major views), group L zero."""
    L, S, R, K = p.L, p.S, p.R, p.K
    a = torch.zeros(L + 1, S * R, K, dtype=p.dtype, device=p.device)
    a[:L] = inp.lora_a.reshape(L, S * R, K)
    b = torch.zeros(L + 1, p.N, R, dtype=p.dtype, device=p.device)
    b[:L] = (inp.lora_b.float() * p.scale[:, None, None]).to(p.dtype)
    cols = [0]
    for n in p.widths:
        cols.append(cols[-1] + n)
    return a.transpose(1, 2), [b[:, c0:c1].transpose(1, 2) for c0, c1 in zip(cols, cols[1:])], cols


def slot_order(p):
    """(token ids in slot order, each group's end offset) from the batch metadata: the grouped GEMMs' rows."""
    return p.meta.sorted_token_ids[:p.M].long(), (p.meta.slot_starts + p.meta.slot_counts).to(torch.int32)


def grouped_call(p, inp):
    a_t, b_ts, cols = grouped_weights(p, inp)
    ids, ends = slot_order(p)
    R = p.R

    def run():
        xs = inp.x.index_select(0, ids)
        hs = torch._grouped_mm(xs, a_t, offs=ends)
        for i, b_t in enumerate(b_ts):
            ys = torch._grouped_mm(hs[:, i * R:(i + 1) * R], b_t, offs=ends)
            inp.y[:, cols[i]:cols[i + 1]].index_add_(0, ids, ys)
    return run


def grouped_shrink_call(p, inp):
    """The gather and the grouped shrink alone (where the grouped path's time goes)."""
    a_t, _, _ = grouped_weights(p, inp)
    ids, ends = slot_order(p)
    return lambda: torch._grouped_mm(inp.x.index_select(0, ids), a_t, offs=ends)


def main(out):
    timer = Timer(DEV)
    rows = []
    Ms = (1024, 4096) if not TINY else (64,)
    try:
        for case in shapes.cases("highrank", tiny=TINY, tokens=Ms):
            if time.time() - T0 > BUDGET:
                break
            p = problems.Problem.for_case(case, DTYPE, DEV)
            inp = p.inputs(0)
            ref = problems.reference_delta(p, inp)
            check = problems.check_delta(p, inp, grouped_call(p, inp), ref, 2e-2)
            base = timer.measure(lambda k: problems.base(*p.base_inputs(k)), p.base_set_bytes(), False)[0]
            ours = timer.measure(lambda k: problems.ours(p, p.inputs(k)), p.set_bytes(), False)[0]
            grouped = timer.measure(lambda k: grouped_call(p, p.inputs(k)), 2 * p.set_bytes(), False)[0]
            shrink = timer.measure(lambda k: grouped_shrink_call(p, p.inputs(k)), 2 * p.set_bytes(), False)[0]
            row = dict(label=case.label, model=case.layer.model, layer=case.layer.name, rank=case.ranks.label,
                       M=case.M, base=base, ours=ours, grouped=grouped, grouped_shrink=shrink, ok=check.ok,
                       err=check.err, note=check.note)
            rows.append(row)
            print(f"{case.label:34s} base {base:8.1f} ours {ours:7.1f} ({ours / base:.2f}) grouped {grouped:7.1f} "
                  f"({grouped / base:.2f}; shrink {shrink:6.1f}) {'ok' if check.ok else 'FAIL ' + check.note} err {check.err:.1e}",
                  flush=True)
            if DEV == "cuda":
                torch.cuda.empty_cache()
    finally:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    summary(rows)


def gm(v):
    v = [x for x in v if x > 0]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan


def summary(rows):
    print("== X/base geomean over layers, by model, rank, M")
    for key in sorted({(r["model"], r["rank"], r["M"]) for r in rows}):
        part = [r for r in rows if (r["model"], r["rank"], r["M"]) == key]
        print(f"{key[0]:10s} r{key[1]:4s} M={key[2]:<5d} ours {gm([r['ours'] / r['base'] for r in part]):.3f} "
              f"grouped {gm([r['grouped'] / r['base'] for r in part]):.3f} (n={len(part)}, "
              f"{sum(r['ok'] for r in part)} ok)")


if __name__ == "__main__":
    main(sys.argv[1])
