"""Offline tuner: times kernel configs on this GPU and writes the tuned table the library looks up.

    python -m lora_ops.tune --model llama3-8b --ranks 16 64 --out lora_ops/configs/tuned/NVIDIA_H200.json

For every layer shape, rank and token bucket it searches the expand's candidate configs, then the shrink's,
each timed before the best expand of each expand code path (as add_lora_ runs them: one rank block adds the
shrink's split-K partial sums, the rank loop has the shrink sum them), keeping the fastest pair, then the
one-launch kernel's (lora_ops.configs.tuning); it records the fastest of each, with the heuristic's time
beside it so the table shows what tuning gains; the "fused" entry names the one-launch config where it
beats the best shrink + expand, else null (two launches). The "stacked" entry is the expand's config in
the stacked path (launch.lora_linear_stacked), timed as that whole layer: the GEMM over [W; A], then the
expand (``--kinds stacked`` tunes only these). The "store" entry is the expand's config in its store mode,
where lora_linear writes the delta first (launch.writes_first_at), timed after add_lora_'s shrink. Once per
layer and rank, "stack_pad" holds the zero rows that make cuBLAS's GEMM over [W; A] fastest at each token
bucket (``bucket_pads``; the stack holds the most of them, configs.stack_pad_rows), and
"stack_limit" the token count up to which stack_a takes the stacked path, from both layer paths timed at
the buckets up to 1024 with the table this run writes. With --merge --min-gain, a retuned shape keeps its
new entries only where their path beats the one the table gives it, timed in turn. Lookups take the
nearest entry (lora_ops.configs). Candidates are compiled first by parallel worker processes (Triton's disk
cache), then timed one by one in this process as CUDA-graph replays.
"""
import argparse
import contextlib
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time

import torch

MODELS = {
    "llama3-8b": {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
                  "down": (14336, [4096])},
    "phi4-mini": {"qkv": (3072, [3072, 1024, 1024]), "o": (3072, [3072]), "gate_up": (3072, [8192, 8192]),
                  "down": (8192, [3072])},
    "tiny": {"qkv": (48, [32, 16, 16]), "down": (80, [32])},  # --dry-run
}


def progress(done, total, label, width=30):
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<60.60}")
    sys.stderr.flush()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lora_ops.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=None, choices=sorted(MODELS),
                    help="default: llama3-8b (tiny with --dry-run)")
    ap.add_argument("--layers", nargs="*", default=None, help="subset of layer names (default: all)")
    ap.add_argument("--ranks", nargs="+", type=positive_int, default=[16, 64])
    ap.add_argument("--tokens", nargs="+", type=positive_int, default=None, help="token buckets (default: all)")
    ap.add_argument("--slots", type=positive_int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=None, help="table path (default: this GPU's table in the first folder of "
                    "$LORA_OPS_TUNED_DIR, else in the package, where the library looks it up; a --dry-run's in a "
                    "new temporary folder unless $LORA_OPS_TUNED_DIR is set)")
    ap.add_argument("--time-budget", type=float, default=float("inf"),
                    help="seconds; stop early and write (checked between shapes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU + Triton interpreter on the tiny model's shapes unless --model, and token buckets "
                         "up to 64 unless --tokens: checks the tuner's code path, times nothing real")
    ap.add_argument("--merge", action="store_true",
                    help="keep the entries of an existing table at --out that this run does not retune (where --out "
                         "is this GPU's default path and holds none yet: the table it takes from its "
                         "kind, e.g. an H100 SXM the H200's)")
    ap.add_argument("--skip-tuned", action="store_true",
                    help="with --merge: leave the shapes the table at --out already holds as they are (finishes "
                         "a tune that its time budget cut short)")
    ap.add_argument("--min-gain", type=float, default=None,
                    help="with --merge: time each retuned shape's path against the one the table at --out gives it "
                         "(CUDA-graph replays taken in turn) and keep the new entries only where they take at most "
                         "1 - MIN_GAIN of its time (e.g. 0.02); elsewhere the table's entries stay")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                    help="pair: add_lora_'s shrink, expand and one-launch entries; stacked: the stacked path's "
                         "expand; store: the expand's store mode, where lora_linear writes the delta first; "
                         "stack_pad: zero rows after stack_a's [W; A] (once per layer and rank, a pad per token "
                         "bucket); "
                         "stack_limit: the token count up to which stack_a stacks (once per layer and rank, "
                         "timed last, with the table this run writes)")
    ap.add_argument("--max-candidates", type=positive_int, default=None,
                    help="search only the first N candidates of each kernel (smoke runs; default all)")
    ap.add_argument("--workers", type=int, default=None, help="compile processes (default: CPUs - 2; 0: none)")
    args = ap.parse_args(argv)
    if args.model is None:   # (a dry run of Llama's shapes on the interpreter took minutes a shape)
        args.model = ["tiny"] if args.dry_run else ["llama3-8b"]
    if args.layers:   # (a name that selects nothing wrote an empty table over the GPU's own)
        known = {name for m in args.model for name in MODELS[m]}
        unknown = [name for name in args.layers if name not in known]
        if unknown:
            ap.error(f"--layers: {unknown} not among {', '.join(args.model)}'s layers ({', '.join(sorted(known))})")
    return args


def positive_int(text):
    """An argparse type: an integer >= 1 (0 divided by zero deep in a run, -1 cut candidate lists silently)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


KINDS = ("pair", "stacked", "store", "stack_pad", "stack_limit")
# The entry a tuned shape of each kind ends with (stack_pad, stack_limit: one per layer and rank, at its
# first bucket).
_LAST_ENTRY = {"pair": "fused", "stacked": "stacked", "store": "store", "stack_pad": "stack_pad",
               "stack_limit": "stack_limit"}
_PER_LAYER = ("stack_pad", "stack_limit")


def _entry_shape(e):
    """(model, layer, rank, tokens) of a table entry; tokens None for the kinds of one entry per layer and
    rank, whatever bucket tuned it."""
    return e.get("model"), e["layer"], e["rank"], None if e["kind"] in _PER_LAYER else e["tokens"]


def _job_shape(job, kind):
    return job[0], job[1], job[4], None if kind in _PER_LAYER else job[5]


def _tuned_shapes(path, kind):
    """_entry_shape of the shapes a table holds for ``kind`` (of "pair": its "fused" entry, written last)."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {_entry_shape(e) for e in json.load(f)["entries"] if e["kind"] == _LAST_ENTRY[kind]}


def _shape_jobs(args, buckets):
    """Smallest token buckets first: if the time budget ends the run, decode shapes (where configs matter
    most) are tuned for every layer."""
    jobs = [(m, name, K, tuple(widths), r, b) for m in args.model for name, (K, widths) in MODELS[m].items()
            if not args.layers or name in args.layers for r in args.ranks for b in buckets]
    return sorted(jobs, key=lambda job: job[5])


def _precompile_one(job, items, slots, dtype_name):
    from lora_ops.configs import tuning
    _, _, K, widths, r, bucket = job
    return tuning.precompile(torch.device("cuda"), getattr(torch, dtype_name), K, widths, r, slots, bucket, items)


def compile_work(jobs, args, todo):
    """{job: [(kind, config), ...]} holding each distinct compile once, for the kinds ``todo`` tunes at each
    job (split_k is a run-time argument; the slice layout is compiled into the expand and one-launch
    kernels, the slice count into the shrink)."""
    from lora_ops.configs import tuning
    seen, work = set(), {}

    def kinds(job, K, N):
        return (((("shrink", K), ("expand", N), ("fused", K)) if job in todo.get("pair", ()) else ())
                + ((("stacked", N),) if job in todo.get("stacked", ()) else ())
                + ((("store", N),) if job in todo.get("store", ()) else ()))
    for job in jobs:
        _, _, K, widths, r, bucket = job
        N = sum(widths)
        for kind, features in kinds(job, K, N):
            for cfg in tuning.candidates_for(kind, bucket, features, r, len(widths), args.slots)[:args.max_candidates]:
                compiled = cfg._replace(split_k=min(cfg.split_k, 2)) if kind == "shrink" else cfg
                key = (kind, compiled, len(widths) if kind == "shrink" else tuple(widths))
                if key not in seen:
                    seen.add(key)
                    work.setdefault(job, []).append((kind, cfg))
    return work


def precompile_all(jobs, args, todo):
    """Compile every distinct candidate in worker processes (fills Triton's disk cache, so the timing pass
    only loads); returns seconds spent."""
    import concurrent.futures
    import multiprocessing
    import os
    workers = args.workers if args.workers is not None else max(1, (os.cpu_count() or 2) - 2)
    if workers <= 0:
        return 0.0
    t0 = time.time()
    tasks = []
    for job, items in compile_work(jobs, args, todo).items():  # chunks of a few compiles, so workers stay busy
        tasks += [(job, items[i:i + 4]) for i in range(0, len(items), 4)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = [pool.submit(_precompile_one, job, items, args.slots, args.dtype) for job, items in tasks]
        for i, _ in enumerate(concurrent.futures.as_completed(futures)):
            progress(i + 1, len(tasks), "compiling candidates")
    sys.stderr.write(f"\n{sum(len(items) for _, items in tasks)} distinct compiles in {time.time() - t0:.0f} s\n")
    return time.time() - t0


def tune_shape(job, args, device, dtype, problems):
    """Table entries (shrink, expand, fused) for one layer shape, rank and token bucket, timed on
    ``problems`` (tuning.problem_copies of the job)."""
    from lora_ops.configs import heuristics, tuning

    def candidates(kind, features):
        return tuning.candidates_for(kind, bucket, features, r, S, args.slots)[:args.max_candidates]
    model, name, K, widths, r, bucket = job
    S, N = len(widths), sum(widths)
    key = dict(model=model, layer=name, slices=S, rank=r, tokens=bucket)
    heur_shrink = heuristics.shrink_config(bucket, K, S, r, args.slots, out_features=N)
    heur_expand = heuristics.expand_config(bucket, N, r, args.slots)
    # The expand first (on a random h); then each shrink candidate with the best expand (of each code path)
    # adding its split-K partial sums, as add_lora_ runs them: the shrink's entry holds the pair's time less
    # the expand's.
    _, _, expand_timings = tuning.search("expand", problems, candidates("expand", N))
    heur_expand_us = expand_timings.get(heur_expand) or tuning.time_config("expand", problems, heur_expand)
    shrink, split_us, timings, expand, expand_us = tuning.search_pair(problems, candidates("shrink", K),
                                                                      expand_timings, r)
    if shrink is None:   # every candidate raised or failed its check (their errors are above, on stderr)
        sys.stderr.write(f"\nlora_ops.tune: no shrink + expand pair ran for {key}: shape skipped\n")
        return []
    heur_pair_us = tuning.time_config("shrink", problems, heur_shrink, heur_expand)
    # The shrink's share is a difference of two timings, which noise can make negative (a CPU dry run wrote
    # -141949 µs): at least 0; the pair's own time is pair_us.
    entries = [
        dict(kind="shrink", features=K, out_features=N, **key, config=shrink._asdict(),
             us=round(max(split_us - expand_us, 0.0), 2), pair_us=round(split_us, 2),
             heuristic_us=_us(None if None in (heur_pair_us, heur_expand_us) else max(heur_pair_us - heur_expand_us,
                                                                                      0.0)),
             candidates=len(timings)),
        dict(kind="expand", features=N, **key, config=expand._asdict(), us=round(expand_us, 2),
             heuristic_us=_us(heur_expand_us), candidates=len(expand_timings)),
    ]
    fused, fused_us, timings = tuning.search("fused", problems, candidates("fused", K))
    heur_fused = heuristics.fused_config(bucket, K, r)
    heur_path_us = (timings.get(heur_fused) or tuning.time_config("fused", problems, heur_fused)
                    if heuristics.prefers_fused(bucket, K, r) else heur_pair_us)
    use = fused is not None and fused_us < split_us
    entries.append(dict(kind="fused", features=K, out_features=N, **key, config=fused._asdict() if use else None,
                        us=round(min(fused_us, split_us), 2), one_launch_us=round(fused_us, 2) if fused else None,
                        two_launch_us=round(split_us, 2), heuristic_us=_us(heur_path_us),
                        candidates=len(timings)))
    return entries


def _us(t):
    """A time for the table, rounded; None where the config did not run or failed its check."""
    return None if t is None else round(t, 2)


def tune_stacked(job, args, device, dtype, problems):
    """The "stacked" entry for one layer shape, rank and token bucket: the expand's config in the stacked
    path, timed as the whole layer (tuning.stacked_runner), beside the configs it falls back to without
    the entry (add_lora_'s expand: the table's, and the heuristic's)."""
    return _tune_expand_mode("stacked", job, args, device, dtype, problems)


def tune_store(job, args, device, dtype, problems):
    """The "store" entry for one layer shape, rank and token bucket (main tunes it only where lora_linear
    writes the delta first: launch.writes_first_at): the expand's config in its store mode, timed after
    add_lora_'s shrink (tuning.store_runner), beside the configs it falls back to without the entry."""
    return _tune_expand_mode("store", job, args, device, dtype, problems)


def _tune_expand_mode(kind, job, args, device, dtype, problems):
    """The entry of ``kind`` ("stacked" or "store": the expand's config in another mode than add_lora_'s,
    tuning.RUNNERS[kind]) for one shape, with the times of add_lora_'s expand config (the table's, the
    heuristic's), which serve the mode without the entry."""
    from lora_ops import configs
    from lora_ops.configs import heuristics, tuning
    model, name, K, widths, r, bucket = job
    S, N = len(widths), sum(widths)
    cands = tuning.candidates_for(kind, bucket, N, r, S, args.slots)[:args.max_candidates]
    best, best_us, timings = tuning.search(kind, problems, cands)
    if best is None:
        return []

    def us_of(cfg):
        return timings.get(cfg) or tuning.time_config(kind, problems, cfg)
    fallback = configs.expand_config(bucket, N, S, r, args.slots, device, dtype)
    return [dict(kind=kind, features=N, in_features=K, model=model, layer=name, slices=S, rank=r,
                 tokens=bucket, config=best._asdict(), us=round(best_us, 2),
                 expand_entry_us=_us(us_of(fallback)),
                 heuristic_us=_us(us_of(heuristics.expand_config(bucket, N, r, args.slots))),
                 candidates=len(timings))]


def _buckets_up_to(buckets, limit):
    """The buckets a per-layer kind times: those up to ``limit``, else the smallest."""
    return [b for b in buckets if b <= limit] or [min(buckets)]


def _per_layer_entry(kind, job, args, timed, times, **result):
    """The entry of a kind tuned once per layer and rank (_PER_LAYER): the layer's shape and stack rows
    (L·S·R at args.slots slots), the buckets timed, ``times`` ({key: µs at each bucket}) and ``result``."""
    model, name, K, widths, r, bucket = job
    S = len(widths)
    return dict(kind=kind, model=model, layer=name, features=sum(widths), in_features=K, slices=S, rank=r,
                rows=args.slots * S * r, tokens=bucket, **result, buckets=timed,
                us={str(key): [round(t, 2) for t in ts] for key, ts in times.items()})


def tune_stack_pad(job, args, device, dtype, buckets):
    """The "stack_pad" entry of one layer shape and rank: the zero rows after [W; A] (L·S·R rows of A at
    args.slots slots) that make cuBLAS's wider GEMM fastest at each bucket the stacked path serves
    (layers.stacked_token_limit without padding; the smallest bucket where it serves none): ``bucket_pads``,
    one per bucket, and ``pad``, the most of them (the rows the stack holds; configs.stack_pad_at)."""
    from lora_ops.configs import tuning
    from lora_ops.layers import stacked_token_limit
    _, _, K, widths, r, _ = job
    N, rows = sum(widths), args.slots * len(widths) * r
    timed = _buckets_up_to(buckets, stacked_token_limit(N, K, rows))
    times = tuning.stack_pad_times(device, dtype, N, K, rows, timed)
    pads = tuning.best_stack_pads(times)
    return [_per_layer_entry("stack_pad", job, args, timed, times, pad=max(pads), bucket_pads=pads)]


def tune_stack_limit(job, args, device, dtype, buckets):
    """The "stack_limit" entry of one layer shape and rank: the token count up to which LoRALinear's
    stack_a takes the stacked path, from both layer paths timed at every bucket up to
    tuning.STACK_LIMIT_MAX_BUCKET (tuning.layer_path_times: the ops with the table this run writes)."""
    from lora_ops.configs import tuning
    _, _, K, widths, r, _ = job
    timed = _buckets_up_to(buckets, tuning.STACK_LIMIT_MAX_BUCKET)
    times = tuning.layer_path_times(device, dtype, K, widths, r, args.slots, timed)
    return [_per_layer_entry("stack_limit", job, args, timed, times,
                             max_tokens=tuning.best_stack_limit(timed, times))]


def _path_runner(kind, p, cfgs):
    """A runner of a shape's path of ``kind`` given its ``cfgs`` ({entry kind: config dict or None}): the
    stacked layer or the write-first delta with their expand config, or add_lora_'s one launch where
    "fused" names one, else its shrink + expand."""
    from lora_ops import configs
    from lora_ops.configs import heuristics, tuning
    if kind in configs.EXPAND_MODES:
        return tuning.RUNNERS[kind](p, heuristics.ExpandConfig(**cfgs[kind]))
    if cfgs.get("fused"):
        return tuning.fused_runner(p, heuristics.FusedConfig(**cfgs["fused"]))
    return tuning.shrink_runner(p, heuristics.ShrinkConfig(**cfgs["shrink"]), heuristics.ExpandConfig(**cfgs["expand"]))


def _library_configs(kind, job, args, device, dtype):
    """{entry kind: config dict or None} the library resolves for the shape now (its table's entry, the
    nearest one, or the heuristic), as a tuned entry of ``kind`` would replace them."""
    from lora_ops import configs
    _, _, K, widths, r, bucket = job
    S, N, L = len(widths), sum(widths), args.slots
    if kind == "stacked":
        return {"stacked": configs.stacked_config(bucket, N, S, r, L, K, device, dtype)._asdict()}
    if kind == "store":
        return {"store": configs.store_config(bucket, N, S, r, L, K, device, dtype)._asdict()}
    fused = configs.fused_config(bucket, K, N, S, r, L, device, dtype)
    return {"fused": fused._asdict() if fused else None,
            "shrink": configs.shrink_config(bucket, K, S, r, L, device, dtype, out_features=N)._asdict(),
            "expand": configs.expand_config(bucket, N, S, r, L, device, dtype)._asdict()}


def against_table(kind, job, new, problems, table, gpu, args, device, dtype):
    """``new`` (one shape's entries of ``kind``) where its path takes at most 1 - args.min_gain of the time
    of the path the library runs with ``table`` (the shape's entry, the nearest one, or the heuristic),
    both timed in turn on ``problems`` (the search's); else the same entries holding the table's configs (``kept``:
    "table"), so the shape keeps what was measured even where its config came from a neighbour's entry or a
    fallback, which a later entry nearby could change. Both times go into the entries (``table_us``,
    ``retimed_us``; the other times are the search's) and a line to stdout. The search times each candidate
    once, minutes apart, so a winner within a few % of the table's is as likely noise as gain (sessions
    11-12, 2026-12-03: timed in turn, 5 of 24 and 4 of 12 retuned shapes did not win by 2%)."""
    from lora_ops.configs import tuning
    if args.min_gain is None or not new:
        return new
    r, bucket = job[4:]
    with _lookups_from(table, gpu):
        before = _library_configs(kind, job, args, device, dtype)
    after = {e["kind"]: e["config"] for e in new}
    us = tuning.times_us({path: [_path_runner(kind, p, cfgs) for p in problems]
                          for path, cfgs in (("table", before), ("new", after))}, device)
    kept = "new" if us["new"] <= (1 - args.min_gain) * us["table"] else "table"
    print("{} {} r={} M={} {}: table {:.1f} us, new {:.1f} us, new/table {:.3f} -> {}".format(
        *job[:2], r, bucket, kind, us["table"], us["new"], us["new"] / us["table"], kept))
    return [dict(e, table_us=round(us["table"], 2), retimed_us=round(us["new"], 2), kept=kept,
                 **({} if kept == "new" else {"config": before[e["kind"]]})) for e in new]


def _default_out(gpu):
    """The table a run writes without --out: this GPU's in the first of configs.table_dirs (the package's
    folder unless $LORA_OPS_TUNED_DIR names others)."""
    from lora_ops import configs
    return configs.table_path(gpu, configs.table_dirs()[0])


def _merge_base(args, out, gpu, kind):
    """The table whose entries --merge keeps: the one at ``out``; where there is none and ``out`` is this GPU's
    own default path (_default_out), the table it takes from its kind (``kind``: configs.load_table), so that tuning a
    few shapes on, say, an H100 keeps the H200 table's entries for the rest, which its own table would
    otherwise hide. None without --merge."""
    from lora_ops import configs
    if not args.merge:
        return None
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    if not kind or pathlib.Path(out) != _default_out(gpu):
        return None
    return configs.load_table(gpu, tuple(kind["capability"]), kind["multiprocessors"])


def _table(args, out, gpu, entries, compile_s, t0):
    """The table this run writes: its entries, over the table at ``out`` with --merge."""
    from lora_ops import configs
    # The GPU's kind: a GPU without a table of its own takes one of its kind (configs.load_table).
    kind = {} if args.dry_run else configs.gpu_kind()
    table = dict(gpu=gpu, **kind, dtype=args.dtype, slots=args.slots, torch=torch.__version__,
                 triton=__import__("triton").__version__, date=datetime.date.today().isoformat(),
                 seconds=dict(compile=round(compile_s), total=round(time.time() - t0)), entries=entries)
    old = _merge_base(args, out, gpu, kind)
    if old is not None:
        def key(e):
            return (e["kind"], *_entry_shape(e))
        # A retuned entry takes its old one's place (a table's diff shows what changed); new shapes follow.
        retuned = {key(e): e for e in entries}
        kept = [retuned.pop(key(e), e) for e in old["entries"]]
        table["entries"] = kept + [e for e in entries if key(e) in retuned]
        # The runs merged into it, oldest first: "seconds" is this run's alone, the history keeps the others'.
        history = old.get("merged_from") or []
        history = [history] if isinstance(history, dict) else list(history)   # tables before session 23: one
        table["merged_from"] = history + [{k: old.get(k) for k in ("gpu", "date", "torch", "triton", "seconds")}]
    configs.check_table(table, out)     # what the library will refuse to load, refused before it is written
    return table


@contextlib.contextmanager
def _lookups_from(table, gpu):
    """Within the block the library's config lookups read ``table`` as this GPU's, whatever the package
    holds (the stack_limit kind times the layer paths as the table being written will run them)."""
    from lora_ops import configs, plan
    saved = configs.table_dirs

    def forget():   # cached tables, resolved configs and the launch plans that hold them
        configs.reset()
        plan.clear()
    with tempfile.TemporaryDirectory() as tmp:
        configs.table_dirs = lambda: [pathlib.Path(tmp)]    # (not the user's folders: they come first)
        configs.table_path(gpu, tmp).write_text(json.dumps(table))
        forget()
        try:
            yield
        finally:
            configs.table_dirs = saved
            forget()


def _use_the_interpreter():
    """--dry-run runs the kernels on the CPU through Triton's interpreter, which Triton takes from
    TRITON_INTERPRET when each kernel is defined: set it here, before the kernels are imported."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    # (Triton's own helpers, tl.cumsum, are defined when triton.language is imported: by then too late, and the
    # check of every candidate failed, silently leaving the kernels' entries out of the table)
    if "triton" in sys.modules or any(name.startswith("lora_ops.kernels") for name in sys.modules):
        sys.exit("lora_ops.tune --dry-run: Triton or lora_ops' kernels were imported without Triton's interpreter; "
                 "set TRITON_INTERPRET=1 before importing them")
    os.environ["TRITON_INTERPRET"] = "1"


def _check_writable(out):
    """Before any tuning: the table's folder made (a new $LORA_OPS_TUNED_DIR folder) and the path writable, else
    an error naming --out (it was found after the whole run, its results lost to os.makedirs' traceback)."""
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        sys.exit(f"lora_ops.tune: --out {out!r}: cannot write the table there ({e})")
    if os.path.isdir(out) or not os.access(folder, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        sys.exit(f"lora_ops.tune: --out {out!r}: cannot write the table there (not a writable file path)")


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        _use_the_interpreter()
    from lora_ops import launch
    from lora_ops.configs import heuristics, tuning

    if args.dry_run:
        device, gpu, args.workers = torch.device("cpu"), "dry-run", 0
        if args.dtype == "bfloat16":
            # (check_candidate: the interpreter computes bf16 wrongly itself)
            sys.stderr.write("lora_ops.tune --dry-run: bfloat16 candidates are run but their outputs not checked "
                             "on the interpreter; --dtype float16 checks them\n")
    elif not torch.cuda.is_available():
        sys.exit("lora_ops.tune: needs a CUDA GPU (or --dry-run)")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        gpu = torch.cuda.get_device_name(device)
    dtype = getattr(torch, args.dtype)
    buckets = args.tokens or [b for b in heuristics.TOKEN_BUCKETS if b <= 64 or not args.dry_run]
    out = args.out or _default_out(gpu)
    if args.dry_run and not args.out and not os.environ.get("LORA_OPS_TUNED_DIR"):
        # (a dry run's table, timed on the interpreter, has no place among the tables the library looks up)
        out = os.path.join(tempfile.mkdtemp(prefix="lora_ops_dry_run_"), os.path.basename(out))
    _check_writable(out)
    jobs = _shape_jobs(args, buckets)
    todo = {kind: set(jobs) for kind in args.kinds}   # the shapes each kind tunes
    for kind in _PER_LAYER:   # once per layer and rank: its first (smallest) bucket's job
        if kind in todo:
            todo[kind] = {job for job in jobs if job[5] == min(buckets)}
    if "store" in todo:   # the store mode runs only where lora_linear writes the delta first
        todo["store"] = {job for job in todo["store"] if launch.writes_first_at(job[5], sum(job[3]), dtype.itemsize)}
    if args.skip_tuned:
        if not args.merge:
            sys.exit("lora_ops.tune: --skip-tuned keeps a table's entries: it needs --merge")
        for kind in args.kinds:
            done = _tuned_shapes(out, kind)
            todo[kind] = {job for job in todo[kind] if _job_shape(job, kind) not in done}
        jobs = [job for job in jobs if any(job in shapes for shapes in todo.values())]
        sys.stderr.write(f"{len(jobs)} shapes not yet in {out}\n")
    if args.min_gain is not None and not args.merge:
        sys.exit("lora_ops.tune: --min-gain compares with the table at --out: it needs --merge")
    table = _table(args, out, gpu, [], 0, time.time()) if args.min_gain is not None else None
    t0 = time.time()
    compile_s = precompile_all(jobs, args, todo)
    entries = []
    for i, job in enumerate(jobs):
        if time.time() - t0 > args.time_budget:
            sys.stderr.write(f"\ntime budget reached after {i} of {len(jobs)} shapes\n")
            break
        progress(i, len(jobs), "{} {} r={} M={}".format(*job[:2], *job[4:]))
        problems = None   # the job's problem copies, made once for every kind below that tunes it
        for kind, tune_kind in (("pair", tune_shape), ("stacked", tune_stacked), ("store", tune_store)):
            if job in todo.get(kind, ()):
                problems = problems or tuning.problem_copies(device, dtype, *job[2:5], args.slots, job[5])
                entries += against_table(kind, job, tune_kind(job, args, device, dtype, problems), problems, table,
                                         gpu, args, device, dtype)
        del problems
        if job in todo.get("stack_pad", ()):
            entries += tune_stack_pad(job, args, device, dtype, buckets)
    # Last: the two layer paths as the ops run them, with the table this run writes (its configs and padding).
    limit_jobs = sorted(todo.get("stack_limit", ()), key=jobs.index)
    if limit_jobs:
        with _lookups_from(_table(args, out, gpu, entries, compile_s, t0), gpu):
            for job in limit_jobs:
                if time.time() - t0 > args.time_budget:
                    sys.stderr.write("\ntime budget reached before every stack_limit shape\n")
                    break
                progress(len(jobs), len(jobs), "{} {} r={}: stack_limit".format(*job[:2], job[4]))
                entries += tune_stack_limit(job, args, device, dtype, buckets)
    progress(len(jobs), len(jobs), "done")
    sys.stderr.write("\n")
    table = _table(args, out, gpu, entries, compile_s, t0)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    # The speed-ups are the search's: entries that kept the table's configs (--min-gain) hold the search's
    # times of a config they do not hold, so they are left out.
    searched = [e for e in entries if e.get("kept") != "table"]
    if args.min_gain is not None:
        compared = [e for e in entries if e["kind"] in _LAST_ENTRY.values() and "kept" in e]
        print(f"--min-gain {args.min_gain}: the search's configs kept at "
              f"{sum(e['kept'] == 'new' for e in compared)} of {len(compared)} shapes")
    by_layer = {}
    for e in searched:
        if e["kind"] == "fused" and e["heuristic_us"]:  # per layer call: the heuristic's path against the tuned one
            by_layer[(e["layer"], e["rank"], e["tokens"])] = e["heuristic_us"] / e["us"]
    speed_up = ""
    if by_layer:
        geo = torch.tensor(list(by_layer.values())).log().mean().exp().item()
        speed_up = f"; per add_lora_ call, tuned vs heuristic: geomean speed-up {geo:.2f}x over {len(by_layer)} shapes"
    print(f"wrote {len(entries)} entries to {out}{speed_up}")
    limits = [e for e in entries if e["kind"] == "stack_limit"]
    if limits:
        print("stack_a token limits: " + ", ".join(f"{e['layer']} r{e['rank']} {e['max_tokens']}" for e in limits))
    pads = [e for e in entries if e["kind"] == "stack_pad"]
    if pads:
        padded = ", ".join(f"{e['layer']} r{e['rank']} +{e['bucket_pads']}" for e in pads if e["pad"])
        print(f"stack_a padding: {sum(1 for e in pads if e['pad'])} of {len(pads)} layer shapes padded ({padded})")
    for kind, what in (("stacked", "stacked layer"), ("store", "write-first delta")):
        gains = [e["expand_entry_us"] / e["us"] for e in searched if e["kind"] == kind]
        if gains:
            geo = torch.tensor(gains).log().mean().exp().item()
            print(f"{what}, tuned vs add_lora_'s expand config: geomean speed-up {geo:.2f}x over "
                  f"{len(gains)} shapes")
    return table


if __name__ == "__main__":
    main()
