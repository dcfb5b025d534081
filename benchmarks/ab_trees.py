"""A/B of lora_ops source trees: add_lora_ (or lora_linear's write-first delta) on the grid's shapes, one process
per tree and pass.

Two versions of the kernels cannot share a process (one package name), and two benchmark runs differ by
a few % on the device (host, clocks). So each tree times every shape in a process of its own, the trees
take turns, and each shape keeps its fastest pass (session 12, 2026-12-03: passes of one tree agreed
within 1-2%). Every shape is checked against float64 before it is timed (the benchmark's check).

    git archive HEAD lora_ops csrc_meta | tar -x -C /tmp/base      # a tree: lora_ops/ and csrc_meta/
    for i in 1 2; do
        python benchmarks/ab_trees.py time /tmp/base base "$OUT/ab"
        python benchmarks/ab_trees.py time . new "$OUT/ab"
    done
    python benchmarks/ab_trees.py compare "$OUT/ab" base new

Timing: the benchmark's (CUDA-graph replay medians, cold L2, inputs rotated). --path write_first times the
delta lora_linear writes first at large batches (launch._write_lora: the shrink, then the expand's store mode
into a fresh y; checked by adding it to y), at every shape given, whatever its size. --tokens picks the token
counts (default 1,16,64,256,1024), --ranks and --models the shapes (default Llama-3-8B at ranks 16 and 64;
e.g. --ranks 128,256,320 --models llama3-8b,phi4-mini for the high-rank grid's); --device cpu with
TRITON_INTERPRET=1 checks the logic on tiny shapes (bf16 in the interpreter patched as the tests patch it).
"""
import argparse
import collections
import contextlib
import glob
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def time_tree(tree, tag, out_dir, tokens, device, ranks=("16", "64"), models=("llama3-8b",), path="add_lora_"):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.abspath(tree))   # this tree's lora_ops and csrc_meta, before any other
    import torch
    import lora_ops
    if not os.path.abspath(lora_ops.__file__).startswith(os.path.abspath(tree)):
        sys.exit(f"ab_trees: imported {lora_ops.__file__}, not the tree {tree}")
    import problems
    import shapes
    from timing import Timer
    timer = Timer(device)
    by_model = {"llama3-8b": shapes.LLAMA3_8B, "phi4-mini": shapes.PHI4_MINI}
    layers = [(model, layer) for model in models for layer in by_model[model]]
    if device != "cuda":
        layers = [(model, shapes.tiny_layer(layer)) for model, layer in layers]
    rows = {}
    for M in tokens:
        for model, layer in layers:
            for rank in ranks:
                p = problems.Problem.for_case(shapes.Case(layer, shapes.rank_spec(rank), M), torch.bfloat16, device)
                sets = {0: p.inputs(0)}

                def inputs(k, p=p, sets=sets):
                    if k not in sets:
                        sets[k] = p.inputs(k)
                    return sets[k]
                ref = problems.reference_delta(p, sets[0])
                checked, timed = (problems.ours, problems.ours) if path == "add_lora_" else (write_first_adding,
                                                                                           write_first)
                check = problems.check_delta(p, sets[0], checked(p, sets[0]), ref, problems.TOLERANCE[torch.bfloat16])
                us = timer.measure(lambda k, p=p: timed(p, inputs(k)), p.set_bytes(), False)[0]
                name = layer.name if models == ("llama3-8b",) else f"{model}:{layer.name}"
                rows[f"{name} r{rank} M={M}"] = dict(us=us, ok=check.ok, err=check.err)
                del sets, ref
                if device == "cuda":
                    torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    n = len(glob.glob(os.path.join(out_dir, f"{tag}-*.json"))) + 1
    path = os.path.join(out_dir, f"{tag}-{n}.json")
    with open(path, "w") as f:
        json.dump(dict(tree=os.path.abspath(tree), tokens=list(tokens), rows=rows), f, indent=1)
    bad = [k for k, r in rows.items() if not r["ok"]]
    print(f"{tag} pass {n}: {len(rows)} shapes, " + (f"CHECK FAILED at {bad}" if bad else "all pass"), flush=True)
    return 1 if bad else 0


def write_first(problem, inp, out=None):
    """lora_linear's write-first delta (launch._write_lora) into ``out`` (default: a fresh output, as the
    layer runs it)."""
    import torch
    from lora_ops import launch
    out = torch.empty_like(inp.y) if out is None else out
    args = (out, inp.x, inp.lora_a, inp.lora_b, problem.scale, problem.rank, problem.widths, *problem.meta)
    return lambda: launch._write_lora(*args)


def write_first_adding(problem, inp):
    """:func:`write_first`, then its output added into inp.y (check_delta's form: y += delta)."""
    import torch
    out = torch.full_like(inp.y, float("nan"))   # every row the metadata names must be written
    write = write_first(problem, inp, out)
    return lambda: (write(), inp.y.add_(out))


def fastest(out_dir, tag):
    """{shape: (fastest µs over the tag's passes, every pass checked ok)}."""
    passes = [json.load(open(p))["rows"] for p in sorted(glob.glob(os.path.join(out_dir, f"{tag}-*.json")))]
    if not passes:
        sys.exit(f"ab_trees: no passes of {tag} in {out_dir}")
    return {k: (min(p[k]["us"] for p in passes), all(p[k]["ok"] for p in passes)) for k in passes[0]}


def compare(out_dir, base_tag, tags):
    def geomean(v):
        return math.exp(sum(map(math.log, v)) / len(v))
    base = fastest(out_dir, base_tag)
    runs = {tag: fastest(out_dir, tag) for tag in tags}
    for tag, run in runs.items():
        by_m = collections.defaultdict(list)
        for k, (us, _) in run.items():
            by_m[int(k.split("M=")[1])].append(us / base[k][0])
        every = [r for v in by_m.values() for r in v]
        ok = all(o for _, o in run.values())
        print(f"{tag} / {base_tag}: " + "  ".join(f"M={m} {geomean(v):.3f}" for m, v in sorted(by_m.items()))
              + f"  all {geomean(every):.3f}" + ("" if ok else "  (a check FAILED)"))
    print()
    print(f"{'shape':22s} {base_tag:>9s} " + " ".join(f"{t:>9s}" for t in tags))
    for k, (us, _) in base.items():
        print(f"{k:22s} {us:9.2f} " + " ".join(f"{runs[t][k][0]:9.2f}" for t in tags))


def bf16_patched():
    """The interpreter's own bf16 arithmetic is wrong (tests/interp_bf16.py): the CPU logic check runs patched."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import interp_bf16
    return interp_bf16.patched()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time", help="one pass of one tree")
    t.add_argument("tree")
    t.add_argument("tag")
    t.add_argument("out_dir")
    t.add_argument("--tokens", default="1,16,64,256,1024")
    t.add_argument("--device", default="cuda")
    t.add_argument("--ranks", default="16,64", help="slot ranks, shapes.rank_spec's forms (default 16,64: the "
                                                     "core grid's; mix; 100/128/320/320: one per slot)")
    t.add_argument("--models", default="llama3-8b", help="llama3-8b and/or phi4-mini (comma-separated)")
    t.add_argument("--path", default="add_lora_", choices=("add_lora_", "write_first"))
    c = sub.add_parser("compare", help="each tag's fastest pass per shape against the base tag's")
    c.add_argument("out_dir")
    c.add_argument("base_tag")
    c.add_argument("tags", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "time":
        with contextlib.nullcontext() if args.device == "cuda" else bf16_patched():
            return time_tree(args.tree, args.tag, args.out_dir, [int(m) for m in args.tokens.split(",")],
                             args.device, tuple(args.ranks.split(",")), tuple(args.models.split(",")), args.path)
    compare(args.out_dir, args.base_tag, args.tags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
