"""Lab (session 42): bench_decode's step under two tuned tables, paired.

The decode step (4 Llama-3-8B-shaped blocks, batch 64 round-robin over 4 adapters, LoRALinear(stack_a=True),
each rank in a stack of its own capacity) with its tables looked up from each folder of TABLES, and the model
without LoRA, each captured in a CUDA graph of STEPS steps and replayed in turn, round by round (a GPU's clock
moves with its power: steps timed apart differ by as much as what tells two tables apart). A folder stands for
$LORA_OPS_TUNED_DIR ("" for none: the package's tables); each model is built, its stacks padded and its graph
captured under its own folder. Prints each table's tokens/s over the base model's.

    TABLES=before=/tmp/before,after= python benchmarks/lab_decode_tables.py out.json
    DEV=cpu TABLES=a=,b= python benchmarks/lab_decode_tables.py /tmp/x.json     # logic check, tiny
"""
import json
import os
import statistics
import sys

import torch

import repo_path  # noqa: F401,E402
import bench_decode  # noqa: E402
import lora_ops  # noqa: E402
from lab_env import DEV, TINY, ints, run_env  # noqa: E402
from lora_ops import configs  # noqa: E402

RANKS = ints("RANKS", "16,64")
TABLES = dict(item.split("=", 1) for item in os.environ.get("TABLES", "shipped=").split(","))
STEPS = 8 if DEV == "cuda" else 1
ROUNDS = 21 if DEV == "cuda" else 2


def use_tables(folder):
    if folder:
        os.environ[configs.TUNED_DIR_ENV] = folder
    else:
        os.environ.pop(configs.TUNED_DIR_ENV, None)
    configs.reset()


def padding_rows(layer):
    """The zero rows after [W; A] in a stacked LoRALinear's buffer."""
    return layer._stacked[0].shape[0] - layer.out_features - layer.lora_a.numel() // layer.in_features


def capture(fn):
    """A replay of STEPS calls of ``fn``: a CUDA graph on the GPU, a loop on the CPU."""
    for _ in range(3):
        fn()
    if DEV != "cuda":
        return lambda: [fn() for _ in range(STEPS)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(STEPS):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def time_in_turn(replays):
    """{name: median µs per step}, the replays taken in turn, ROUNDS rounds."""
    times = {name: [] for name in replays}
    for _ in range(ROUNDS):
        for name, replay in replays.items():
            if DEV == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / STEPS)
            else:
                import time
                t0 = time.perf_counter()
                replay()
                times[name].append((time.perf_counter() - t0) * 1e6 / STEPS)
    return {name: statistics.median(t) for name, t in times.items()}


def main(path):
    device = torch.device(DEV)
    d = bench_decode.TINY if TINY else bench_decode.LLAMA
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    batch = 64 if not TINY else 16
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, d["hidden"], device=device, dtype=dtype, generator=gen)
    slots = torch.arange(batch, device=device) % 4
    rows = []
    for rank in RANKS:
        models, replays = {}, {}
        base = bench_decode.build_model(d, 4, dtype, device)
        with torch.no_grad():
            replays["base"] = capture(lambda: base(x))
        for name, folder in TABLES.items():
            use_tables(folder)
            model = models[name] = bench_decode.build_model(d, 4, dtype, device)
            ctx = lora_ops.apply_lora(model, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], max_loras=4,
                                      max_rank=rank, max_tokens=batch, packed_modules=bench_decode.packed(d),
                                      stack_a=True)
            ctx.set_token_slots(slots)
            bench_decode.fill_adapters(ctx, rank, 4, torch.Generator(device=device).manual_seed(rank))
            with torch.no_grad():
                replays[name] = capture(lambda m=model: m(x))
            pads = sorted({(n.split(".")[-1], padding_rows(m)) for n, m in model.named_modules()
                           if getattr(m, "_stacked", None) is not None})
            print(f"r{rank} {name}: stack pads {pads}, table {configs.table_source()}", flush=True)
        with torch.no_grad():
            outs = [models[n](x).float() for n in TABLES]
        diff = max((o - outs[0]).abs().max().item() for o in outs)
        t = time_in_turn(replays)
        row = dict(rank=rank, **{f"{n}_us": round(v, 1) for n, v in t.items()}, max_diff=diff,
                   **{f"{n}_ratio": round(t["base"] / t[n], 4) for n in TABLES})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del models, replays
        use_tables(None)
    with open(path, "w") as f:
        json.dump(dict(env=run_env(), tables=TABLES, rows=rows), f, indent=1)
    print("\n| rank | base µs | " + " | ".join(f"{n} µs | {n} tok/s ratio" for n in TABLES) + " |")
    print("|---|---|" + "---|---|" * len(TABLES))
    for r in rows:
        print(f"| {r['rank']} | {r['base_us']} | " + " | ".join(f"{r[n + '_us']} | {r[n + '_ratio']:.3f}"
                                                              for n in TABLES) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
