"""What the paired labs (lab_write_first, lab_token_loop) share: their settings from the environment, the
Llama-3-8B rows they walk within a time budget, and the run's environment for their JSON.

Environment: DEV (default cuda; cpu, with TRITON_INTERPRET=1, runs tiny shapes as a logic check), BUDGET
(seconds), MS (token counts) and RANKS (comma-separated), each lab giving its defaults; LAYERS (names,
e.g. qkv,gate_up; default all four).
"""
import os
import sys
import time

import torch

import problems
import shapes

DEV = os.environ.get("DEV", "cuda")
TINY = DEV != "cuda"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
_KEEP = os.environ.get("LAYERS", "").split(",")
LAYERS = [layer if not TINY else shapes.tiny_layer(layer) for layer in shapes.LLAMA3_8B
          if _KEEP == [""] or layer.name in _KEEP]
T0 = time.time()


def ints(var, default):
    """Environment variable ``var`` (else ``default``) as a list of ints."""
    return [int(v) for v in os.environ.get(var, default).split(",")]


def problem(layer, rank, M):
    """The benchmark's problem for one row: 4 slots of ``rank`` (tiny ranks on the CPU), ~10% tokens without."""
    spec = shapes.uniform(rank) if not TINY else shapes.tiny_ranks(shapes.uniform(rank))
    return problems.Problem.for_case(shapes.Case(layer, spec, M), DTYPE, DEV)


def rank_loop_rows(rows, tokens):
    """For each (layer, rank) of ``rows`` and token count: (layer, rank, M, problem, its input set 0, h,
    the expand's config), h written by add_lora_'s shrink on the shipped config; rows where add_lora_ does
    not take the shrink + rank-loop expand path are skipped with a line. The expand labs (lab_h_planes,
    lab_expand_stages) time expands on this h."""
    from lora_ops import configs, launch
    for layer, rank in rows:
        for M in tokens:
            p = problems.Problem.for_case(shapes.Case(layer, shapes.uniform(rank), M), DTYPE, DEV)
            i = p.inputs(0)
            launches, _, buffers = launch.add_lora_launches(i.y, i.x, i.lora_a, i.lora_b, p.scale, p.rank,
                                                            p.widths, *p.meta)
            if len(launches) != 2 or launches[1].constexprs["ONE_RANK_BLOCK"]:
                print(f"| {layer.name} | {rank} | {M} | (not the rank loop) |")
                continue
            launches[0]()
            yield layer, rank, M, p, i, buffers[0], configs.expand_config(M, p.N, p.S, p.R, p.L, i.x.device, DTYPE)


def stacked_parts(p):
    """For the stacked-layer labs (lab_decode_parts, lab_token_slot_expand): (inputs, call) over problem ``p``.
    inputs(k) -> (input set k, base weight W, the stack [W; A], its GEMM computed once), cached;
    call(name, k) -> the callable of "base" (F.linear(x, W)), "gemm" (precision.stacked_gemm over [W; A]) or "layer"
    (lora_linear_stacked as shipped), else None."""
    from lora_ops.layers import stacked_weight
    from lora_ops.precision import stacked_gemm
    sets = {}

    def gemm(x, ws):   # the stacked GEMM as the op runs it (over the prefix of the stack its count's pad takes)
        return stacked_gemm(x, ws, None, p.N, p.L * p.S * p.R)

    def inputs(k):
        if k not in sets:
            i = p.inputs(k)
            w = p.base_inputs(k)[1]
            ws = stacked_weight(w, i.lora_a)
            sets[k] = (i, w, ws, gemm(i.x, ws))
        return sets[k]

    def call(name, k):
        i, w, ws, _ = inputs(k)
        if name == "base":
            return lambda: torch.nn.functional.linear(i.x, w)
        if name == "gemm":
            return lambda: gemm(i.x, ws)
        if name == "layer":
            op = torch.ops.lora_ops.lora_linear_stacked
            args = (i.x, ws, None, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
            return lambda: op(*args)
        return None
    return inputs, call


def lab_rows(tokens, ranks, budget):
    """(layer, rank, M) for every token count, rank and layer, in that nesting, while fewer than ``budget``
    seconds have passed since the lab started; the GPU's cache is emptied after each row."""
    cases = [(layer, r, M) for M in tokens for r in ranks for layer in LAYERS]
    for i, case in enumerate(cases):
        if time.time() - T0 > budget:
            print(f"budget spent: {i} of {len(cases)} rows", flush=True)
            return
        yield case
        if DEV == "cuda":
            torch.cuda.empty_cache()


def run_env():
    return dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
                triton=__import__("triton").__version__, dtype=str(DTYPE))


def model_rows(models, layer_names, ranks, keep=lambda model, rank: True):
    """(layer, rank) of the expand labs (lab_persistent_expand, lab_planes_in_turn): the layers named of each
    model at each rank where ``keep(model, rank)``; tiny shapes (two Llama layers) on the CPU."""
    if TINY:
        return [(shapes.tiny_layer(layer), r) for layer in shapes.LLAMA3_8B[:2] for r in ranks]
    by_model = {"llama3-8b": shapes.LLAMA3_8B, "phi4-mini": shapes.PHI4_MINI}
    return [(layer, r) for m in models for layer in by_model[m] if layer.name in layer_names for r in ranks
            if keep(m, r)]


def run_rank_loop_lab(run):
    """``run(Timer)`` on the GPU; on the CPU (a logic check) with the rank loop at tiny shapes (a rank block
    smaller than the rank) in bf16 (planes h), the interpreter's bf16 arithmetic patched (tests/interp_bf16)."""
    from timing import Timer
    if not TINY:
        return run(Timer(DEV))
    from lora_ops import configs
    from lora_ops.configs.heuristics import ExpandConfig
    global DTYPE
    configs.expand_config = lambda *a, **k: ExpandConfig(16, 32, 16, 4, 3)
    DTYPE = torch.bfloat16
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import interp_bf16
    with interp_bf16.patched():
        return run(Timer(DEV))


def checked_modes(p, i, modes):
    """For each of the expand's ``modes`` ("accumulate": y += delta, add_lora_'s; "store": y = delta, the
    write-first path's): (mode, accumulate, ``run_checked``). ``run_checked(go)`` resets y to its value now,
    runs ``go()``, and returns (relative Frobenius error of y against the float64 result, how many values are
    off by more than y's dtype allows: tuning.off_mask)."""
    from lora_ops.configs import tuning
    y0 = i.y.clone()
    exact = problems.reference_delta(p, i)
    rms = float(exact.pow(2).mean().sqrt())
    for mode in modes:
        accumulate = mode == "accumulate"
        want = (y0.double() if accumulate else 0) + exact   # the store mode writes y whole

        def run_checked(go, want=want):
            i.y.copy_(y0)
            go()
            err = float((i.y.double() - want).norm() / exact.norm())
            return err, int(tuning.off_mask(i.y, want, rms, torch.finfo(i.y.dtype).eps).sum())
        yield mode, accumulate, run_checked
