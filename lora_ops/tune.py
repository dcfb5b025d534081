"""Offline tuner: times kernel configs on this GPU and writes the tuned table the library looks up.

    python -m lora_ops.tune --model llama3-8b --ranks 16 64 --out lora_ops/configs/tuned/NVIDIA_H200.json

For every layer shape, rank and token bucket it searches the shrink and the expand kernel's candidate
configs (lora_ops.configs.tuning) and records the fastest, with the heuristic's time beside it so the
table shows what tuning gains. Lookups take the nearest entry (lora_ops.configs).
"""
import argparse
import datetime
import json
import sys
import time

import torch

MODELS = {
    "llama3-8b": {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
                  "down": (14336, [4096])},
    "phi4-mini": {"qkv": (3072, [3072, 1024, 1024]), "o": (3072, [3072]), "gate_up": (3072, [8192, 8192]),
                  "down": (8192, [3072])},
}


def progress(done, total, label, width=30):
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<60.60}")
    sys.stderr.flush()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["llama3-8b"], choices=sorted(MODELS))
    ap.add_argument("--layers", nargs="*", default=None, help="subset of layer names (default: all)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="token buckets (default: all)")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=None, help="table path (default: the package's table for this GPU)")
    ap.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; stop early and write")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from lora_ops import configs
    from lora_ops.configs import heuristics, tuning

    if not torch.cuda.is_available():
        sys.exit("lora_ops.tune: needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name(device)
    buckets = args.tokens or list(heuristics.TOKEN_BUCKETS)
    jobs = [(m, name, K, widths, r, b, kind)
            for m in args.model for name, (K, widths) in MODELS[m].items() if not args.layers or name in args.layers
            for r in args.ranks for b in buckets for kind in ("shrink", "expand")]
    entries, t0 = [], time.time()
    for i, (model, name, K, widths, r, bucket, kind) in enumerate(jobs):
        if time.time() - t0 > args.time_budget:
            sys.stderr.write(f"\ntime budget reached after {i} of {len(jobs)} jobs\n")
            break
        progress(i, len(jobs), f"{model} {name} r={r} M={bucket} {kind}")
        problem = tuning.synthetic_problem(device, dtype, K, widths, r, args.slots, bucket)
        features = K if kind == "shrink" else sum(widths)
        if kind == "shrink":
            heur = heuristics.shrink_config(bucket, K, len(widths), r, args.slots)
        else:
            heur = heuristics.expand_config(bucket, features, r, args.slots)
        best, best_us, timings = tuning.search(kind, problem, tuning.candidates_for(kind, bucket, features, r, len(widths), args.slots))
        heur_us = timings.get(heur) or tuning.search(kind, problem, [heur])[1]
        entries.append(dict(kind=kind, model=model, layer=name, features=features, slices=len(widths), rank=r,
                            tokens=bucket, config=best._asdict(), us=round(best_us, 2),
                            heuristic_us=round(heur_us, 2), candidates=len(timings)))
    progress(len(entries), len(jobs), "done")
    sys.stderr.write("\n")
    table = dict(gpu=gpu, dtype=args.dtype, slots=args.slots, torch=torch.__version__,
                 triton=__import__("triton").__version__, date=datetime.date.today().isoformat(), entries=entries)
    out = args.out or configs.table_path(gpu)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    gain = [e["heuristic_us"] / e["us"] for e in entries]
    if gain:
        geo = torch.tensor(gain).log().mean().exp().item()
        print(f"wrote {len(entries)} entries to {out}; tuned vs heuristic: geomean speed-up {geo:.2f}x")
    return table


if __name__ == "__main__":
    main()
