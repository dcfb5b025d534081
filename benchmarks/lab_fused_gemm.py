"""Lab (session 39): the whole layer as one Triton GEMM over slot-sorted rows, the expand inside its K loop.

DESIGN §7 estimated (session 38) that the high-rank target (delta <= 0.3 of the base layer at >= 1024 tokens)
needs the expand folded into the base GEMM: tiles of slot-sorted tokens run [x | h_s] . [W | B_s]^T, so K
grows by the rank only, y is written once and never read back, and the expand's launch goes. It replaces
cuBLAS's GEMM with ours, so it pays only if ours runs near cuBLAS's rate over gathered rows. This lab
measures that, at Phi-4-mini's and Llama-3-8B's layer shapes, bf16, 4 slots and ~10% tokens without:

    base        F.linear(x, W): cuBLAS, the layer without LoRA
    layer       lora_ops::lora_linear: the shipped layer (cuBLAS GEMM, then the delta's kernels)
    gemm        this file's kernel, rows in order, no h: our GEMM's own rate against cuBLAS
    gather      the same over slot-sorted rows (gathered loads, scattered stores), no h
    shrink      lora_ops::shrink alone (h [M, S, R] float32, scale applied)
    fused1      shrink, then the kernel with h as one bf16 term (launch.set_fast_bf16's precision)
    fused2      shrink, then the kernel with h as two bf16 terms hi + lo (the shipped precision)

A tile is BLOCK_M consecutive rows of the slot-sorted order (no padding per slot): after the K loop over x.W
it runs one rank loop per slot present in the tile (rows of other slots masked to zero), so a tile that spans
a slot boundary pays two rank loops. The grid is cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N): shapes only. The sorted
order is computed on the host here (a lab); the batch metadata holds it on the device in the library.
Checked against float64 (relative Frobenius error of the whole output, beside lora_linear's), timed as
CUDA-graph replays with cold L2, paired against the base layer (benchmarks/timing.py).

    python benchmarks/lab_fused_gemm.py                              # GPU (MS=1024,4096 RANKS=64,320)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_fused_gemm.py   # logic check, tiny shapes, float16
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import repo_path  # noqa: F401,E402
import problems  # noqa: E402
import shapes  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

TOKENS = ints("MS", "1024,4096" if not TINY else "40,96")
RANKS = ints("RANKS", "64,320" if not TINY else "64,320")
MODELS = os.environ.get("MODELS", "phi4-mini,llama3-8b").split(",")
RATE = os.environ.get("RATE", "0") == "1"   # only the GEMM rates: base, gemm, gather, tma (no h)

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): Hopper bf16 GEMM tiles
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
] if not TINY else [(16, 16, 16, 4, 1)]


def _autotune_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in CONFIGS]


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: GROUP_M row tiles walk the column tiles together (L2 reuse of
    W's tiles)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows


@triton.autotune(configs=_autotune_configs(), key=["M", "N", "K", "H_TERMS", "GATHER"])
@triton.jit(do_not_specialize=["M"])
def fused_layer_kernel(
    x_ptr, w_ptr, h_ptr, b_ptr, y_ptr, rows_ptr, row_slot_ptr, rank_ptr,
    M, N, K, slice_end0, slice_end1,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_hm, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    H_TERMS: tl.constexpr, GATHER: tl.constexpr,
):
    """y[rows] = x[rows] . W^T + h[rows, slice] . B[slot, cols, :rank]^T for one tile of sorted rows.

    Pointers: x [M, K], W [N, K], y [M, N] in the weights' dtype; h [M, S, R] float32 (the shrink's output,
    scale applied); B [L, N, R]; rows [M] int32 (token of each sorted position), row_slot [M] int32 (its slot,
    -1: none; sorted ascending past the -1s), rank [L] int32. slice_end0 / slice_end1: where the first two
    output slices end (N where there are fewer; slice widths are multiples of BLOCK_N). K is a multiple of
    BLOCK_K (asserted by the launcher). H_TERMS: 0 (no h), 1 (h as one bf16 term) or 2 (hi + lo). GATHER: rows
    through rows_ptr, or in order.
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < M
    if GATHER:
        rows = tl.load(rows_ptr + offs_m, mask=valid, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if H_TERMS > 0:
        slot_rows = tl.load(row_slot_ptr + offs_m, mask=valid, other=-1)
        first_slot = tl.min(tl.where(slot_rows >= 0, slot_rows, 1 << 30))
        last_slot = tl.max(slot_rows)
        col0 = pid_n * BLOCK_N
        h_slice = ((col0 >= slice_end0).to(tl.int64) + (col0 >= slice_end1).to(tl.int64)) * stride_hs
        for s in range(first_slot, last_slot + 1):
            rank = tl.load(rank_ptr + s)
            mine = slot_rows == s
            for r0 in range(0, rank, BLOCK_K):
                offs_r = r0 + offs_k
                r_in = offs_r < rank
                hv = tl.load(h_ptr + rows[:, None] * stride_hm + h_slice + offs_r[None, :] * stride_hr,
                             mask=mine[:, None] & r_in[None, :], other=0.0)
                bt = tl.load(b_ptr + s * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn
                             + offs_r[:, None] * stride_br, mask=r_in[:, None], other=0.0)
                hi = hv.to(bt.dtype)
                acc = tl.dot(hi, bt, acc)
                if H_TERMS == 2:
                    acc = tl.dot((hv - hi.to(tl.float32)).to(bt.dtype), bt, acc)

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :].to(tl.int64) * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None])


@triton.autotune(configs=_autotune_configs(), key=["M", "N", "K"])
@triton.jit(do_not_specialize=["M"])
def tma_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """y = x . W^T through tensor descriptors (TMA on sm_90): the rate a Triton 3.6 GEMM reaches when both
    operands are plain tiles, the ceiling for any kernel here. x [M, K], W [N, K], y [M, N], contiguous."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k])
        b = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, b.T, acc)
    y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


def tma_gemm(x, w):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    def run():
        tma_gemm_kernel[grid](x, w, y, M, N, K)
        return y
    return run


def _alloc(size, alignment, stream):
    # Device-side tensor descriptors need a little global scratch per launch.
    return torch.empty(size, dtype=torch.int8, device=DEV)


class SortedRows:
    """The slot-sorted order of one batch (host-computed in this lab): -1 tokens first, then by slot."""

    def __init__(self, slots_cpu, device):
        order = torch.sort(slots_cpu.long(), stable=True).indices
        self.rows = order.to(torch.int32).to(device)
        self.row_slot = slots_cpu[order].to(torch.int32).to(device)


def fused_layer(x, w, h, lora_b, rank, sorted_rows, widths, h_terms, gather):
    """The layer's output [M, N] from this file's kernel (h may be None when h_terms == 0)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    assert all(n % max(c[1] for c in CONFIGS) == 0 for n in widths) and K % max(c[2] for c in CONFIGS) == 0
    assert len(widths) <= 3
    ends = [sum(widths[:i + 1]) for i in range(len(widths))] + [N, N]
    hh = h if h is not None else x.new_zeros(1, 1, 1, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    def run():
        fused_layer_kernel[grid](
            x, w, hh, lora_b, y, sorted_rows.rows, sorted_rows.row_slot, rank, M, N, K, ends[0], ends[1],
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), hh.stride(0), hh.stride(1), hh.stride(2),
            lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
            H_TERMS=h_terms, GATHER=gather)
        return y
    return run


def check_row(problem, inp, w, outs):
    """Relative Frobenius error of each output against float64 x W^T + the reference delta."""
    ref = inp.x.double() @ w.double().T + problems.reference_delta(problem, inp)
    norm = float(torch.linalg.vector_norm(ref))
    errs = {}
    for name, y in outs.items():
        y = y()
        finite = bool(torch.isfinite(y).all())
        errs[name] = float(torch.linalg.vector_norm(y.double() - ref)) / norm if finite else float("nan")
    return errs


def row(timer, layer, rank, M):
    spec = shapes.uniform(rank) if not TINY else shapes.tiny_ranks(shapes.uniform(rank))
    p = problems.Problem.for_case(shapes.Case(layer, spec, M), DTYPE, DEV)
    sorted_rows = SortedRows(p.slots_cpu, p.device)
    shrink = torch.ops.lora_ops.shrink
    sets = {}

    def data(k):
        if k not in sets:
            i = p.inputs(k)
            sets[k] = (i, p.base_inputs(k)[1])
        return sets[k]

    def make(kind):
        def make_call(k):
            i, w = data(k)
            if kind == "base":
                return lambda: F.linear(i.x, w)
            if kind == "layer":
                return problems.layer(p, i, w)
            if kind == "tma":
                return tma_gemm(i.x, w)
            if kind in ("gemm", "gather"):
                return fused_layer(i.x, w, None, i.lora_b, p.rank, sorted_rows, p.widths, 0, kind == "gather")
            if kind == "shrink":
                return lambda: shrink(i.x, i.lora_a, p.scale, p.rank, *p.meta)
            terms = int(kind[-1])

            def call():
                h = shrink(i.x, i.lora_a, p.scale, p.rank, *p.meta)
                return fused_layer(i.x, w, h, i.lora_b, p.rank, sorted_rows, p.widths, terms, True)()
            return call
        return make_call

    if RATE:
        kinds = ("base", "gemm", "gather", "tma")
        i, w = data(0)
        ref = i.x.double() @ w.double().T
        errs = {k: float(torch.linalg.vector_norm(make(k)(0)().double() - ref) / torch.linalg.vector_norm(ref))
                for k in kinds[1:]}
    else:
        kinds = ("base", "layer", "gemm", "gather", "shrink", "fused1", "fused2")
        errs = check_row(p, *data(0), {k: make(k)(0) for k in ("layer", "fused1", "fused2")})
    w_bytes = p.N * p.K * p.esize
    set_bytes = {k: p.set_bytes() + w_bytes for k in kinds}
    med, runs = timer.measure_paired({k: make(k) for k in kinds}, set_bytes)
    sets.clear()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    base = med["base"]
    ratio = {k: paired_delta(runs, k, "base") / base for k in kinds if k != "base"}
    best = {name: str(kernel.best_config) for name, kernel in (("fused", fused_layer_kernel), ("tma", tma_gemm_kernel))
            if getattr(kernel, "best_config", None) is not None}
    return dict(model=layer.model, layer=layer.name, rank=rank, M=M, us=med, over_base=ratio, errors=errs,
                best_config_last=best)


def main():
    triton.set_allocator(_alloc)
    timer = Timer(DEV)
    rows = []
    layers = [l for l in shapes.PHI4_MINI + shapes.LLAMA3_8B if l.model in MODELS]
    if TINY:
        layers = [shapes.tiny_layer(l) for l in layers]
    if RATE:
        return rate_table(timer, layers)
    print("| model | layer | r | M | base µs | gemm/base | gather/base | layer Δ | shrink/base | fused1 Δ "
          "| fused2 Δ | err layer | err fused2 |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer in layers:
        for M in TOKENS:
            for rank in RANKS:
                r = row(timer, layer, rank, M)
                rows.append(r)
                us, o, e = r["us"], r["over_base"], r["errors"]
                print(f"| {r['model']} | {r['layer']} | {rank} | {M} | {us['base']:.1f} "
                      f"| {us['gemm'] / us['base']:.3f} "
                      f"| {us['gather'] / us['base']:.3f} | {o['layer']:.3f} | {us['shrink'] / us['base']:.3f} "
                      f"| {o['fused1']:.3f} | {o['fused2']:.3f} | {e['layer']:.1e} | {e['fused2']:.1e} |", flush=True)
    env = dict(torch=torch.__version__, triton=triton.__version__, device=DEV,
               gpu=torch.cuda.get_device_name() if DEV == "cuda" else None)
    out = os.environ.get("OUT_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    print(env, file=sys.stderr)


def rate_table(timer, layers):
    print("| model | layer | M | base µs | base TFLOP/s | gemm/base | gather/base | tma/base | err gemm | err gather "
          "| err tma |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for layer in layers:
        for M in TOKENS:
            r = row(timer, layer, RANKS[0], M)
            rows.append(r)
            us, e = r["us"], r["errors"]
            tflops = 2 * M * layer.in_features * layer.out_features / us["base"] / 1e6
            print(f"| {r['model']} | {r['layer']} | {M} | {us['base']:.1f} | {tflops:.0f} "
                  f"| {us['gemm'] / us['base']:.3f} "
                  f"| {us['gather'] / us['base']:.3f} | {us['tma'] / us['base']:.3f} | {e['gemm']:.1e} "
                  f"| {e['gather']:.1e} | {e['tma']:.1e} |", flush=True)
            print("   best:", r["best_config_last"], flush=True)
    out = os.environ.get("OUT_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(dict(env=dict(torch=torch.__version__, triton=triton.__version__), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
