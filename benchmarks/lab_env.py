"""What the paired labs (lab_write_first, lab_token_loop) share: their settings from the environment, the
Llama-3-8B rows they walk within a time budget, and the run's environment for their JSON.

Environment: DEV (default cuda; cpu, with TRITON_INTERPRET=1, runs tiny shapes as a logic check), BUDGET
(seconds), MS (token counts) and RANKS (comma-separated), each lab giving its defaults; LAYERS (names,
e.g. qkv,gate_up; default all four).
"""
import os
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
