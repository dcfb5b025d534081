"""Lab (session 18): where the stacked layer's delta goes at decode sizes (lora_linear_stacked, DESIGN §4).

Per Llama-3-8B layer, rank (4 slots) and token count (default 64 and 16), timed paired with the base layer
(Timer.measure_paired: CUDA-graph replays in turn, cold L2; deltas are medians of per-round differences):

    base              F.linear(x, W)
    stacked GEMM      F.linear(x, [W; A]) alone: the price of the stack's extra rows
    layer             lora_linear_stacked as shipped (the expand under PDL right behind the GEMM)
    layer no-PDL      the same with the expand launched without PDL
    expand alone      the stacked expand by itself on a stacked output computed once (its median, not paired)

and the bytes floor of what the delta must read beyond the base layer: the stack's rows of A and every
slot's B, at 4.1 TB/s.

    python benchmarks/lab_decode_parts.py                  # H200 (MS, RANKS)
    DEV=cpu TRITON_INTERPRET=1 MS=16 RANKS=16 python benchmarks/lab_decode_parts.py   # logic check, tiny
"""
import contextlib
from unittest import mock

import repo_path  # noqa: F401,E402
from lab_env import DEV, ints, lab_rows, problem, stacked_parts  # noqa: E402
from lora_ops import configs, launch, plan  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

TOKENS = ints("MS", "64,16")
RANKS = ints("RANKS", "16,64")
COPY_BYTES_PER_S = 4.1e12


@contextlib.contextmanager
def pdl_off():
    plan.clear()
    with mock.patch.object(launch, "STACKED_PDL_MAX_TOKENS", -1):
        yield
    plan.clear()


def main():
    timer = Timer(DEV)
    print("| layer | r | M | base | stacked GEMM extra | layer delta | layer no-PDL | expand alone | extra rows | "
          "bytes floor µs |\n|---|---|---|---|---|---|---|---|---|---|")
    for layer, rank, M in lab_rows(TOKENS, RANKS, 400):
        p = problem(layer, rank, M)
        inputs, shipped_call = stacked_parts(p)

        def call(name, k):
            i, w, ws, out = inputs(k)
            if name != "expand":
                return shipped_call("layer" if name == "layer_nopdl" else name, k)
            cfg = configs.stacked_config(M, p.N, p.S, p.R, p.L, p.K, i.x.device, i.x.dtype)
            return launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                                run=False, pdl=False)
        names = ("base", "gemm", "layer", "layer_nopdl", "expand")
        set_bytes = p.set_bytes() + p.base_set_bytes()
        med, runs = timer.measure_paired({n: (lambda k, n=n: call(n, k)) for n in names},
                                         {n: set_bytes for n in names}, {"layer_nopdl": pdl_off})
        _, w, ws, _ = inputs(0)
        extra = ws.shape[0] - w.shape[0]
        floor_us = (extra * p.K + p.L * p.N * p.R) * w.element_size() / COPY_BYTES_PER_S * 1e6
        print(f"| {layer.name} | {rank} | {M} | {med['base']:.1f} | {paired_delta(runs, 'gemm', 'base'):.1f} | "
              f"{paired_delta(runs, 'layer', 'base'):.1f} | {paired_delta(runs, 'layer_nopdl', 'base'):.1f} | "
              f"{med['expand']:.1f} | {extra} | {floor_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
