"""Eager host time per call: what LoRA adds on the host to one layer, and where it goes.

One LoRALinear (default: Llama-3-8B qkv, K 4096 -> 4096/1024/1024, rank 16, 4 adapters, M = 64, bf16)
called back to back without CUDA graphs; wall time per call once the GPU work is small enough that the
host is the bottleneck. Rows, each the median of --rounds rounds of --calls calls:

  F.linear                 the base layer alone
  LoRALinear               the layer as users call it (bound eager calls, dispatcher skipped, fast launches)
  ... stack_a              the same layer with apply_lora(stack_a=True): one GEMM over [W; A], the expand
                           (what it adds is against F.linear over the stack, its own base GEMM)
  ... without bound calls  the op's own path on every call: checks, path, plan key (before session 24's
                           lora_ops.eager); each LoRALinear row below it turns one more thing off from there
  ... via torch.ops        the same through the torch dispatcher (what lora_ops did before ops.call)
  ... Triton's launch path the same with lora_ops.triton_launch's shortcut off
  ... both                 neither shortcut (the baseline before 2026-12-02's change)
  ... without launch plans every call resolves configs, grids and arguments (before 2026-12-03's plans)
  ... no workspace         plan replays allocate their scratch (before session 18's per-stream workspace)
  ... plans replayed through Triton's CudaLauncher   not its C launch function (triton_launch.direct_launch)
  and the pieces: the argument checks, the config lookups, one expand launch each way.

Usage: python benchmarks/host_overhead.py [--device cpu --tiny] [--subset]  (results to benchmarks/results/)
"""
import argparse
import datetime
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from repo_path import HERE, REPO  # noqa: E402  (first: this checkout's lora_ops)

import lora_ops  # noqa: E402
import report  # noqa: E402
from bench_decode import host_us_per_call  # noqa: E402
from csrc_meta import checks  # noqa: E402
from lora_ops import configs, eager, launch, ops, plan, triton_launch  # noqa: E402


# Calls per enqueue-time sample: at most 3 launches each, far below the ~1000 launches CUDA queues before a
# launch blocks, so the loop never waits for the GPU.
ENQUEUE_CALLS = 50
# --subset: what LoRA adds, with and without stack_a (an A/B of two trees runs this in turns).
SUBSET = ("F.linear", "LoRALinear", "F.linear over the stack (stack_a's GEMM)",
          "LoRALinear, stack_a (lora_linear_stacked)")


def enqueue_us_per_call(fn, device):
    """Host µs per call with the GPU out of the way: the GPU idle at the start (synchronize), then the wall
    time of ENQUEUE_CALLS calls, stopped before the GPU has run them. The wall-time rows take the larger
    of host and GPU time per call; at M = 64 the qkv GEMM alone takes ~17 µs on the GPU, so F.linear's wall
    time is its GPU time, and what LoRA adds on the host is this column's difference."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(ENQUEUE_CALLS):
        fn()
    return (time.perf_counter() - t0) * 1e6 / ENQUEUE_CALLS


def profile_calls(layer, x, calls):
    """cProfile of `calls` LoRALinear calls (profiler overhead included), top functions by own time."""
    import cProfile
    import io
    import pstats
    launchers = (launch.SHRINK, launch.EXPAND, launch.FUSED)
    hits = sum(launcher.hits for launcher in launchers)
    with torch.no_grad():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            layer(x)
        prof.disable()
    buf = io.StringIO()
    print(f"fast launches enabled: {[launcher.enabled for launcher in launchers]}, "
          f"shortcut hits during the profile: {sum(launcher.hits for launcher in launchers) - hits}", file=buf)
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def build(args, device, dtype, stack_a=False):
    K, widths = (64, [64, 16, 16]) if args.tiny else (4096, [4096, 1024, 1024])
    base = nn.Linear(K, sum(widths), bias=False, device=device, dtype=dtype)
    ctx = lora_ops.LoRAContext(4, args.tokens, device=device)
    layer = lora_ops.LoRALinear(base, ctx, args.rank, slice_widths=widths, stack_a=stack_a)
    with torch.no_grad():
        layer.lora_a.normal_(0, K ** -0.5)
        layer.lora_b.normal_(0, args.rank ** -0.5)
        layer.rank.fill_(args.rank)
        layer.scale.fill_(1.0)
    ctx.set_token_slots(torch.arange(args.tokens, device=device, dtype=torch.int32) % 4)
    x = torch.randn(args.tokens, K, device=device, dtype=dtype)
    return layer, x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="also write a cProfile of LoRALinear calls")
    ap.add_argument("--subset", action="store_true", help=f"only the rows {', '.join(SUBSET)} (A/B of trees)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    layer, x = build(args, device, dtype)
    stacked_layer, _ = build(args, device, dtype, stack_a=not args.tiny)   # the tiny stack is too wide to stack
    y = layer.base(x)
    stacked_weight = stacked_layer._stacked[0] if stacked_layer._stacked is not None else stacked_layer.base.weight
    op_args = (y, x, layer.lora_a, layer.lora_b, layer.scale, layer.rank, list(layer.slice_widths),
               *layer.context.meta)
    M, K = x.shape
    L, S, R, _ = layer.lora_a.shape
    N = y.shape[1]

    ecfg = configs.expand_config(M, N, S, R, L, device, dtype)
    h = torch.zeros(M, S, R, dtype=torch.float32, device=device)

    def expand():
        launch.launch_expand(y, h, layer.lora_b, list(layer.slice_widths), layer.rank, *layer.context.meta, ecfg)

    real_wrapped = ops.wrapped
    real_direct_allowed = triton_launch._direct_allowed

    real_workspace_bytes = plan.WORKSPACE_BYTES

    def state(fast=True, dispatcher=False, plans=True, direct=True, workspace=True, bound=True):
        triton_launch.set_fast_launch(fast)
        eager.set_enabled(bound)      # off: every LoRALinear call takes the op's path (checks, plan key)
        # off: every replay allocates its scratch (lora_ops.plan's workspace holds none)
        plan.WORKSPACE_BYTES = real_workspace_bytes if workspace else 0
        # on: ops.call sends every call through torch.ops, as for a traced or wrapped one
        ops.wrapped = (lambda first: True) if dispatcher else real_wrapped
        # off: plan replays call Triton's CudaLauncher, not its C launch function (triton_launch.direct_launch)
        triton_launch._direct_allowed = real_direct_allowed if direct else (lambda: False)
        plan.set_enabled(plans)       # off: every call resolves its launches (and plans are rebuilt)

    # name: (state, call). Rounds interleave the variants, so a drift of the host's speed hits them alike.
    variants = {
        "F.linear": ({}, lambda: F.linear(x, layer.base.weight)),
        "LoRALinear": ({}, lambda: layer(x)),
        "LoRALinear without bound calls": (dict(bound=False), lambda: layer(x)),
        "F.linear over the stack (stack_a's GEMM)": ({}, lambda: F.linear(x, stacked_weight)),
        "LoRALinear, stack_a (lora_linear_stacked)": ({}, lambda: stacked_layer(x)),
        "LoRALinear, stack_a, without bound calls": (dict(bound=False), lambda: stacked_layer(x)),
        "LoRALinear without launch plans": (dict(plans=False, bound=False), lambda: layer(x)),
        "LoRALinear, scratch allocated every call (no workspace)": (dict(workspace=False, bound=False),
                                                                    lambda: layer(x)),
        "LoRALinear, plans replayed through Triton's CudaLauncher": (dict(direct=False, bound=False),
                                                                     lambda: layer(x)),
        "LoRALinear via torch.ops": (dict(dispatcher=True, bound=False), lambda: layer(x)),
        "LoRALinear, Triton's launch path": (dict(fast=False, bound=False), lambda: layer(x)),
        "LoRALinear via torch.ops, Triton's launch path (before)": (dict(fast=False, dispatcher=True, bound=False),
                                                                    lambda: layer(x)),
        "op add_lora_ (torch.ops)": ({}, lambda: torch.ops.lora_ops.add_lora_(*op_args)),
        "checks only": ({}, lambda: checks.check_add_lora(*op_args)),
        "config lookups (3)": ({}, lambda: (configs.fused_config(M, K, N, S, R, L, device, dtype),
                                            configs.shrink_config(M, K, S, R, L, device, dtype, out_features=N),
                                            configs.expand_config(M, N, S, R, L, device, dtype))),
    }
    if cuda:
        variants["launch.add_lora_ (checks, plan replay)"] = ({}, lambda: launch.add_lora_(*op_args))
        variants["plan replay alone (key, scratch, 2 C launches)"] = ({}, lambda: launch._add_lora(*op_args))
        variants["plan replay alone, scratch allocated (no workspace)"] = (dict(workspace=False),
                                                                          lambda: launch._add_lora(*op_args))
        variants["plan replay alone, through CudaLauncher"] = (dict(direct=False), lambda: launch._add_lora(*op_args))
        variants["launch.add_lora_ without plans"] = (dict(plans=False), lambda: launch.add_lora_(*op_args))
        variants["one expand launch, fast"] = ({}, expand)
        variants["one expand launch, Triton's path"] = (dict(fast=False), expand)
    if args.subset:
        variants = {name: variants[name] for name in SUBSET}
    samples = {name: [] for name in variants}
    enqueue = {name: [] for name in variants}
    with torch.no_grad():
        try:
            for _ in range(args.rounds):
                for name, (kw, fn) in variants.items():
                    state(**kw)
                    samples[name].append(host_us_per_call(fn, args.calls, device, rounds=1))
                    enqueue[name].append(enqueue_us_per_call(fn, device))
        finally:
            state()
    rows = {name: statistics.median(v) for name, v in samples.items()}
    host_rows = {name: statistics.median(v) for name, v in enqueue.items()}

    profile = profile_calls(layer, x, args.calls) if args.profile else None
    added = rows["LoRALinear"] - rows["F.linear"]
    host_added = host_rows["LoRALinear"] - host_rows["F.linear"]
    stack_base = "F.linear over the stack (stack_a's GEMM)"
    host_added_stacked = host_rows["LoRALinear, stack_a (lora_linear_stacked)"] - host_rows[stack_base]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "triton": getattr(__import__("triton"), "__version__", None), "git": report.git_revision(REPO),
              "tokens": M, "rank": args.rank,
              "in_features": K, "out_features": N, "rows_us": {k: round(v, 2) for k, v in rows.items()},
              "enqueue_us": {k: round(v, 2) for k, v in host_rows.items()},
              "lora_added_us": round(added, 2), "lora_added_enqueue_us": round(host_added, 2),
              "stack_a_added_enqueue_us": round(host_added_stacked, 2)}
    lines = [f"# Eager host time per call ({result['gpu']}, torch {result['torch']}, Triton {result['triton']}, "
             f"{result['date']})", "",
             f"qkv-shaped LoRALinear K {K} -> N {N} ({S} slices), rank {args.rank}, 4 adapters, M = {M}, {dtype}; "
             f"back-to-back eager calls under no_grad, µs per call: wall time (median of {args.rounds} x "
             f"{args.calls}; the larger of host and GPU time) and host time alone (enqueue: {ENQUEUE_CALLS} calls "
             f"timed from an idle GPU, before it ran them; median of {args.rounds}).",
             "", "| call | wall µs | host µs |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {host_rows[k]:.1f} |" for k, v in rows.items()]
    lines += ["", f"LoRA adds {host_added:.1f} µs of host time per layer call (LoRALinear - F.linear, enqueue "
              f"column); {added:.1f} µs of wall time. With stack_a: {host_added_stacked:.1f} µs of host time over "
              f"F.linear over the stack."]
    text = "\n".join(lines)
    print(text)
    stem = report.write_run_files(args.out or os.environ.get("OUT") or os.path.join(HERE, "results"),
                                  "host_overhead", result, text)
    if profile:
        with open(stem + "-profile.txt", "w") as f:
            f.write(profile)


if __name__ == "__main__":
    main()
