"""Lab (session 34): the stacked layer's expand at decode sizes with one dependent round trip, not three.

Why: at 16-64 tokens the stacked expand (kernels.expand, SCALE_BY_SLOT) costs a fixed ~3 µs a layer on top of
its bytes (session 18, `lab_decode_parts.py`): a program first reads the slots' counts and starts to find its
tile, then the tile's token ids, then h and y, then stores. Under PDL behind cuBLAS's GEMM those pre-wait reads
did not overlap the GEMM (layer delta = GEMM extra + expand alone). The decode target (a step within 15% of the
no-LoRA step) needs ~1.5 µs a layer back at rank 64.

The variant here takes the per-token slots (the batch's input, [M] ints) instead of the sorted metadata: one
program covers every token (M <= 64) for one column block, and the K axis of its one dot runs over every
slot's rank, h masked to each token's own slot. Before the PDL wait it loads the slots, the stack's B block
for all slots, the ranks and scales (none of them the GEMM's); after it, h and y together; then one store.
The price: the dot is L times wider than the work (masked zeros), and B is read for every slot of the stack,
used or not.

Per Llama-3-8B layer, rank and token count, paired with the base layer (Timer.measure_paired: CUDA-graph
replays in turn, cold L2), µs:

    base              F.linear(x, W)
    gemm              F.linear(x, [W; A]): the stacked GEMM alone (its extra over base)
    layer             lora_linear_stacked as shipped (the expand under PDL right behind the GEMM)
    layer_ts<N>       the stacked GEMM, then this lab's expand under PDL, BLOCK_N = N
    expand            the shipped stacked expand alone on a stacked output computed once (median, no PDL)
    expand_ts<N>      this lab's expand alone (median, no PDL)

Every variant's y is checked against float64 first (the delta's relative error within problems.TOLERANCE's
bound, rows without an adapter untouched, no NaN).

Found (H100, session 34, `benchmarks/results/lab-token-slot-expand-h100-2026-12-05-session34.md`): it lost.
Alone 1.1-1.4x the shipped expand's time at rank 16 and 1.2-2x at rank 64; behind the GEMM it tied at best.
The fixed cost is not the metadata chain (DESIGN §4, the decode target). Not shipped.

    python benchmarks/lab_token_slot_expand.py                          # GPU; MS, RANKS, LAYERS, BLOCKS
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_token_slot_expand.py   # logic check, tiny
"""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import repo_path  # noqa: F401,E402  (first: this checkout's lora_ops)
import problems  # noqa: E402
from lab_env import DEV, TINY, ints, lab_rows, problem, stacked_parts  # noqa: E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs.heuristics import next_power_of_2  # noqa: E402
from lora_ops.kernels.work import find_slice_chunk, gdc_wait  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

TOKENS = ints("MS", "64,16" if not TINY else "13")
RANKS = ints("RANKS", "16,64")
BLOCKS = ints("BLOCKS", "32,64" if not TINY else "16")
PDL_OK = DEV == "cuda" and launch.uses_pdl(torch.empty(1, device=DEV))


@triton.jit(do_not_specialize=["M"])
def token_slot_expand_kernel(
    y_ptr, b_ptr, slots_ptr, rank_ptr, scale_ptr,
    M, num_slots, h_offset,
    stride_ym, stride_yn, stride_hl, stride_hs, stride_hr,
    stride_bl, stride_bn, stride_br,
    stride_slots, stride_rank, stride_scale,
    SLICE_COLS: tl.constexpr, SLICE_CHUNKS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    """One program: every token (BLOCK_M >= M) times one BLOCK_N column block of one output slice.

    Pointers: y [M, N + L·S·R (+ padding)] the stacked GEMM's output (y in columns [0, N), slot l's unscaled h
    for slice i at columns h_offset + l·stride_hl + i·stride_hs + r·stride_hr); B [L, N, R]; slots [M] ints (a
    token's slot, or -1); rank [L] int32; scale [L] float32. NUM_SLOTS: L rounded up to a power of two.
    The K axis of the dot is NUM_SLOTS * BLOCK_R long: entry k is rank row k % BLOCK_R of slot k // BLOCK_R,
    B loaded for every slot, h masked to the token's own slot and to that slot's rank.
    """
    pid_n = tl.program_id(0)
    if pid_n >= SLICE_CHUNKS[len(SLICE_CHUNKS) - 1]:
        return
    slice_id, col0, col_hi = find_slice_chunk(pid_n, SLICE_COLS, SLICE_CHUNKS, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = col0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < col_hi
    offs_k = tl.arange(0, NUM_SLOTS * BLOCK_R)
    slot_k = offs_k // BLOCK_R
    r_k = offs_k % BLOCK_R
    # Before the wait: nothing the GEMM writes.
    slot_t = tl.load(slots_ptr + offs_m * stride_slots, mask=m_ok, other=-1).to(tl.int32)
    rank_k = tl.load(rank_ptr + slot_k * stride_rank, mask=slot_k < num_slots, other=0)
    k_ok = r_k < rank_k
    bt = tl.load(b_ptr + slot_k[:, None].to(tl.int64) * stride_bl + r_k[:, None] * stride_br
                 + offs_n[None, :].to(tl.int64) * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    adapted = m_ok & (slot_t >= 0) & (slot_t < num_slots)
    scale_t = tl.load(scale_ptr + slot_t * stride_scale, mask=adapted, other=0.0)
    if PDL:
        gdc_wait()   # y and h are the GEMM's
    rows = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym
    y_ptrs = rows + offs_n[None, :].to(tl.int64) * stride_yn
    mask = adapted[:, None] & n_ok[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    h_mask = adapted[:, None] & (slot_t[:, None] == slot_k[None, :]) & k_ok[None, :]
    h = tl.load(rows + h_offset + slot_k[None, :] * stride_hl + slice_id * stride_hs + r_k[None, :] * stride_hr,
                mask=h_mask, other=0.0)
    acc = tl.dot(h, bt, out_dtype=tl.float32) * scale_t[:, None]
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def token_slot_expand(out, N, lora_b, widths, rank, scale, slots, block_n, pdl=False):
    """Launch the lab's expand on the stacked GEMM's output ``out`` (as launch.launch_expand_stacked)."""
    M = out.shape[0]
    L, _, R = lora_b.shape
    S = len(widths)
    row, col = out.stride()
    cols, chunks = launch.slice_layout(widths, block_n)
    extra = dict(launch_pdl=True) if pdl else {}
    token_slot_expand_kernel[(chunks[-1],)](
        out, lora_b, slots, rank, scale, M, L, N * col, row, col, S * R * col, R * col, col, *lora_b.stride(),
        slots.stride(0), rank.stride(0), scale.stride(0),
        SLICE_COLS=cols, SLICE_CHUNKS=chunks, NUM_SLOTS=next_power_of_2(L),
        BLOCK_M=max(16, next_power_of_2(M)), BLOCK_N=block_n, BLOCK_R=max(16, next_power_of_2(R)), PDL=pdl,
        num_warps=4, **extra)


def main():
    timer = Timer(DEV)
    ts_names = [f"ts{b}" for b in BLOCKS]
    print("| layer | r | M | base | gemm extra | layer delta | " + " | ".join(f"layer_{n} delta" for n in ts_names)
          + " | expand alone | " + " | ".join(f"expand_{n} alone" for n in ts_names) + " |")
    print("|---" * (6 + 2 * len(ts_names) + 1) + "|")
    for layer, rank, M in lab_rows(TOKENS, RANKS, int(os.environ.get("BUDGET", "400"))):
        p = problem(layer, rank, M)
        inputs, shipped_call = stacked_parts(p)

        def stacked_then(i, ws, go):
            def run():
                out = F.linear(i.x, ws)
                go(out)
                return out
            return run

        def call(name, k):
            i, w, ws, out = inputs(k)
            if name in ("base", "gemm", "layer"):
                return shipped_call(name, k)
            if name.startswith("layer_ts"):
                bn = int(name[len("layer_ts"):])
                return stacked_then(i, ws, lambda o: token_slot_expand(o, p.N, i.lora_b, p.widths, p.rank, p.scale,
                                                                       p.slots, bn, pdl=PDL_OK))
            if name.startswith("expand_ts"):
                bn = int(name[len("expand_ts"):])
                return lambda: token_slot_expand(out, p.N, i.lora_b, p.widths, p.rank, p.scale, p.slots, bn)
            cfg = configs.stacked_config(M, p.N, p.S, p.R, p.L, p.K, i.x.device, i.x.dtype)
            return launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                                run=False, pdl=False)

        check(p, inputs)
        names = ["base", "gemm", "layer"] + [f"layer_{n}" for n in ts_names] + ["expand"] + \
            [f"expand_{n}" for n in ts_names]
        set_bytes = p.set_bytes() + p.base_set_bytes()
        med, runs = timer.measure_paired({n: (lambda k, n=n: call(n, k)) for n in names},
                                         {n: set_bytes for n in names})
        deltas = [paired_delta(runs, f"layer_{n}", "base") for n in ts_names]
        print(f"| {layer.name} | {rank} | {M} | {med['base']:.1f} | {paired_delta(runs, 'gemm', 'base'):.1f} | "
              f"{paired_delta(runs, 'layer', 'base'):.1f} | " + " | ".join(f"{d:.1f}" for d in deltas)
              + f" | {med['expand']:.1f} | " + " | ".join(f"{med[f'expand_{n}']:.1f}" for n in ts_names) + " |",
              flush=True)


def check(p, inputs):
    """Each expand on a fresh stacked output of input set 0 against float64 (problems.TOLERANCE's bound)."""
    i, _, ws, _ = inputs(0)
    ref = problems.reference_delta(p, i)
    for bn in BLOCKS:
        for shipped in (True, False):
            out = F.linear(i.x, ws)
            before = out[:, :p.N].clone()
            if shipped:
                cfg = configs.stacked_config(p.M, p.N, p.S, p.R, p.L, p.K, i.x.device, i.x.dtype)
                launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg)
            else:
                token_slot_expand(out, p.N, i.lora_b, p.widths, p.rank, p.scale, p.slots, bn)
            delta = out[:, :p.N].double() - before.double()
            # the stacked path's own reference: h as the GEMM rounded it
            err = float((delta - ref).norm() / ref.norm())
            none = p.slots < 0
            untouched = torch.equal(out[none, :p.N], before[none])
            finite = bool(torch.isfinite(out[:, :p.N]).all())
            name = "shipped" if shipped else f"ts{bn}"
            ok = err < problems.TOLERANCE[out.dtype] * 3 and untouched and finite
            if not ok:
                raise AssertionError(f"{p.layer.name} r{p.R} M{p.M} {name}: err {err:.2e}, untouched {untouched}, "
                                     f"finite {finite}")


if __name__ == "__main__":
    main()
