"""End-to-end decode step and eager host cost: a stack of Llama-3-8B-shaped layers with and without LoRA.

Decode step: `--layers` decoder blocks of Llama-3-8B's projection shapes (qkv 4096 -> 6144 packed q/k/v, o
4096 -> 4096, gate_up 4096 -> 28672 packed gate/up, down 14336 -> 4096; attention itself is replaced by
taking q, the MLP is SiLU-gated), bf16, a batch of `--batch` tokens spread round-robin over 4 adapters.
The same model is timed without LoRA, then with every projection a LoRALinear (apply_lora; each rank in a
stack of its own capacity, max_rank = rank), each step captured into one CUDA graph; tokens/s = batch /
median replay time. (Before 2026-12-03 session 12 both ranks shared one capacity-64 stack, so the rank-16
row ran rank-64 configs.)

Host cost: eager calls of one qkv LoRALinear at `--batch` tokens, back to back, wall time per call,
against the bare nn.Linear; the difference is what LoRA adds on the host per layer.

Synced step (since session 28): a server that reads each step's output (sampling) runs the next batch's host
work, the replay and a synchronize in turn, so LoRA's set_token_slots (the pinned copy and the metadata
fill, outside the graph) and the launch latency count too: wall per step, median of 200, base (no batch
work) against LoRA.

    python benchmarks/bench_decode.py                        # the H200 run (writes to $OUT or benchmarks/results)
    python benchmarks/bench_decode.py --device cpu --tiny    # logic check on a CPU
"""
import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from repo_path import HERE, REPO  # noqa: E402  (first: this checkout's lora_ops)

import lora_ops  # noqa: E402
import report  # noqa: E402
from timing import Timer  # noqa: E402

LLAMA = dict(hidden=4096, q=4096, kv=1024, inter=14336)
TINY = dict(hidden=64, q=64, kv=16, inter=128)


class Block(nn.Module):
    """The projections of one Llama decoder block; attention is stood in for by q itself."""

    def __init__(self, d, dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q_width = d["q"]
        self.inter = d["inter"]
        self.qkv_proj = nn.Linear(d["hidden"], d["q"] + 2 * d["kv"], **kw)
        self.o_proj = nn.Linear(d["q"], d["hidden"], **kw)
        self.gate_up_proj = nn.Linear(d["hidden"], 2 * d["inter"], **kw)
        self.down_proj = nn.Linear(d["inter"], d["hidden"], **kw)
        for lin in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)

    def forward(self, x):
        q = self.qkv_proj(x)[:, :self.q_width]
        x = x + self.o_proj(q)
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


def packed(d):
    return {"qkv_proj": {"q_proj": d["q"], "k_proj": d["kv"], "v_proj": d["kv"]},
            "gate_up_proj": {"gate_proj": d["inter"], "up_proj": d["inter"]}}


def build_model(d, layers, dtype, device):
    """`layers` blocks, their weights from one fixed seed (every call builds the same model)."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d, dtype, device) for _ in range(layers)])


def fill_adapters(ctx, rank, num_adapters, gen):
    """Random signed adapters of `rank` in slots 0..num_adapters-1 of every layer (written in place)."""
    for layer in ctx.layers.values():
        layer.lora_a.normal_(0, layer.in_features ** -0.5, generator=gen)
        layer.lora_b.normal_(0, rank ** -0.5, generator=gen)
        layer.rank[:num_adapters] = rank
        layer.scale[:num_adapters] = 1.0


def graph_step_us(fn, replays):
    """Median µs of one CUDA-graph replay of fn (the tuner's timer: warmed up, captured, replayed)."""
    from lora_ops.configs.tuning import graph_time_us
    return graph_time_us([fn], launches=1, replays=replays)


def synced_step_us(fn, before=None, steps=200):
    """Median wall µs of a step as a server that reads every step's output runs it: ``before()`` (the next
    batch's host work: LoRA's set_token_slots), the step's CUDA-graph replay, a synchronize. Unlike the
    replay median this counts the host's work before the step and the launch latency; None (the error
    printed) where the step cannot be captured."""
    try:
        replay = Timer(torch.device("cuda", torch.cuda.current_device())).capture([fn])
    except RuntimeError as e:
        print(f"synced_step_us: not captured: {e}", flush=True)
        return None
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if before is not None:
            before()
        replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def host_us_per_call(fn, calls, device, rounds=5):
    """Wall µs per call of back-to-back eager calls (host bound when the GPU work is small): the median
    over `rounds` rounds of `calls // rounds` calls, so one slow stretch of the host does not decide it."""
    for _ in range(10):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_round = max(1, calls // rounds)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6 / per_round)
    return statistics.median(times)


def _batch_fill(device, tokens, adapters):
    """How set_token_slots fills this benchmark's batch metadata (lora_ops.batch.set_one_launch_fill): "one
    launch" (lora_ops.kernels.batch, where it serves the shape) or "torch ops"."""
    from lora_ops import batch
    return "torch ops" if batch._launch_batch(device, tokens, adapters) is None else "one launch"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, for logic checks on a CPU")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--stack-a", action="store_true",
                    help="apply_lora(stack_a=True): one GEMM over [W; A] per layer where it pays (DESIGN §4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    d = TINY if args.tiny else LLAMA
    gen = torch.Generator(device=device).manual_seed(0)
    model = build_model(d, args.layers, dtype, device)
    x = torch.randn(args.batch, d["hidden"], device=device, dtype=dtype, generator=gen)
    slots = torch.arange(args.batch, device=device) % 4
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "triton": getattr(__import__("triton"), "__version__", None), "git": report.git_revision(REPO),
              "dtype": str(dtype).replace("torch.", ""), "layers": args.layers,
              "batch": args.batch, "adapters": 4, "batch_fill": _batch_fill(device, args.batch, 4), "rows": []}

    def step():
        with torch.no_grad():
            return model(x)

    base_lin = model[0].qkv_proj
    time_step = (lambda: graph_step_us(step, args.replays)) if cuda else (lambda: host_us_per_call(step, 5, device))
    base_step = time_step()
    base_synced = synced_step_us(step) if cuda else None
    with torch.no_grad():
        base_host = host_us_per_call(lambda: base_lin(x), args.calls, device)
    for i, rank in enumerate(args.ranks):
        # Each rank in a stack of its own capacity (max_rank = rank), as a server of such adapters sets it;
        # the same base weights (a fresh model of the same seed) under every row.
        if i:
            model = build_model(d, args.layers, dtype, device)
        ctx = lora_ops.apply_lora(model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], max_loras=4,
                                  max_rank=rank, max_tokens=args.batch, packed_modules=packed(d),
                                  stack_a=args.stack_a)
        ctx.set_token_slots(slots)
        lora_lin = model[0].qkv_proj
        fill_adapters(ctx, rank, 4, gen)
        lora_step = time_step()
        host_slots = slots.cpu()

        def next_batch():
            with torch.no_grad():
                ctx.set_token_slots(host_slots)
        lora_synced = synced_step_us(step, next_batch) if cuda else None
        with torch.no_grad():
            lora_host = host_us_per_call(lambda: lora_lin(x), args.calls, device)
        row = {"rank": rank, "capacity": rank, "stack_a": args.stack_a, "base_step_us": round(base_step, 1),
               "lora_step_us": round(lora_step, 1),
               "base_tokens_per_s": round(args.batch / base_step * 1e6),
               "lora_tokens_per_s": round(args.batch / lora_step * 1e6),
               "slowdown": round(lora_step / base_step, 3),
               "base_linear_host_us": round(base_host, 1), "lora_linear_host_us": round(lora_host, 1),
               "lora_added_host_us": round(lora_host - base_host, 1),
               "base_synced_step_us": base_synced and round(base_synced, 1),
               "lora_synced_step_us": lora_synced and round(lora_synced, 1),
               "synced_slowdown": round(lora_synced / base_synced, 3) if base_synced and lora_synced else None}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)

    lines = [f"# Decode step, {args.layers} Llama-3-8B-shaped blocks, batch {args.batch}, 4 adapters "
             f"({result['gpu']}, torch {result['torch']}, Triton {result['triton']}, {result['date']})", "",
             "CUDA-graph replay of one step (median); each rank in a stack of its own capacity; host: eager qkv layer "
             "calls back to back, wall per call; synced: a server's step (LoRA: set_token_slots from the host, then "
             f"the replay, then a synchronize), wall, median of 200; batch metadata fill: {result['batch_fill']}.", "",
             "| rank | base step µs | LoRA step µs | base tok/s | LoRA tok/s | LoRA/base | base Linear host µs | "
             "LoRALinear host µs | LoRA adds µs | synced base µs | synced LoRA µs | synced LoRA/base |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        synced = r["synced_slowdown"]
        lines.append(f"| {r['rank']} | {r['base_step_us']} | {r['lora_step_us']} | {r['base_tokens_per_s']} | "
                     f"{r['lora_tokens_per_s']} | {r['slowdown']:.3f} | {r['base_linear_host_us']} | "
                     f"{r['lora_linear_host_us']} | {r['lora_added_host_us']} | {r['base_synced_step_us']} | "
                     f"{r['lora_synced_step_us']} | {'' if synced is None else f'{synced:.3f}'} |")
    text = "\n".join(lines)
    print(text)
    report.write_run_files(args.out or os.environ.get("OUT") or os.path.join(HERE, "results"),
                           "decode_step-stacked" if args.stack_a else "decode_step", result, text)


if __name__ == "__main__":
    main()
