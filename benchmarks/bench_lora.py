"""Correctness and speed of lora_ops' ``add_lora_`` on real layer shapes, beside the base layer, the
bytes floor and, when their builds are present, vLLM's and SGLang's multi-LoRA ops.

Each row (layer, rank, M): check the delta against a float64 reference (ours eager, ours replayed from
a CUDA graph, each peer), then time ours, the base layer and the peers with CUDA-graph replays (and
eagerly from Python). Results are printed and written as JSON, markdown and a PNG. A failing check
never stops the run; it makes the exit code 1. See benchmarks/README.md.

    python benchmarks/bench_lora.py --grid core                       # the H200 run
    python benchmarks/bench_lora.py --grid core --subset              # a smoke run
    TRITON_INTERPRET=1 python benchmarks/bench_lora.py --device cpu --tiny --subset --dtype float16 \\
        --cpu-backend triton --peers sglang                           # logic check on a CPU
"""
import argparse
import contextlib
import datetime
import functools
import os
import platform
import sys
import time
import traceback

from repo_path import HERE, REPO  # noqa: E402  (first: this checkout's lora_ops)

import torch  # noqa: E402

import lora_ops  # noqa: E402
import lora_ops.configs  # noqa: E402,F401  (the variants set config choices; not imported by lora_ops itself)
import lora_ops.launch  # noqa: E402,F401
from lora_ops.layers import stacked_token_limit, stacked_weight  # noqa: E402
from lora_ops.precision import stacked_gemm  # noqa: E402
from lora_ops.tune import positive_int  # noqa: E402
import problems  # noqa: E402
import report  # noqa: E402
import shapes  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
DEFAULT_TIME_BUDGET_S = 330
# Extra timings of our op with one config choice changed: what the tuned tables and each add_lora_ path
# give (the plain "ours" column is the library's default choice).
VARIANTS = {
    "heuristic": lambda: lora_ops.configs.use_tuned_tables(False),   # no tuned table: heuristic configs
    # Runtime autotune (lora_ops.configs.enable_autotune): each shape bucket is tuned at its first eager call
    # (the check, before any capture); a GPU only (elsewhere the heuristic serves).
    "autotune": lambda: lora_ops.configs.enable_autotune(True),
    "two_launch": lambda: lora_ops.configs.force_path("split"),       # shrink + expand at every size
    "one_launch": lambda: lora_ops.configs.force_path("fused"),       # one launch at every size
    # The whole layer as lora_linear; the time recorded is lora_linear's minus the base layer's.
    "overlap": lambda: lora_ops.launch.set_overlap("always"),         # shrink beside the base GEMM
    "in_order": lambda: lora_ops.launch.set_overlap("never"),         # GEMM, shrink, expand in order
    "fast_bf16": lambda: lora_ops.launch.set_fast_bf16(True),         # h meets B as one bf16 term
    # The whole layer as lora_ops::lora_linear_stacked on [W; A]: one GEMM gives y and every slot's h, then
    # the expand; recorded as its time minus the base layer's (run_stacked_variant).
    "stacked": lambda: None,
}
LAYER_VARIANTS = ("overlap", "in_order", "stacked")
assert tuple(VARIANTS) == report.VARIANTS, "report.VARIANTS names the same variants, in this order"


def reset_config_choice():
    lora_ops.launch.set_fast_bf16(False)
    lora_ops.configs.enable_autotune(False)
    lora_ops.configs.use_tuned_tables(True)
    lora_ops.configs.force_path(None)
    lora_ops.launch.set_overlap("never")


@contextlib.contextmanager
def config_choice(variant):
    """The variant's config choice (VARIANTS), reset after: the layer variants are captured later than
    they are checked, beside the base layer (RowRunner.time_layers). Not per call: a choice made inside a
    capture resets the configs there (session 15: that added ~3 µs a layer at decode sizes)."""
    VARIANTS[variant]()
    try:
        yield
    finally:
        reset_config_choice()


def _csv(cast=str):
    """An argparse type: comma-separated values, each ``cast`` (named so that a bad value's error says what was
    expected, not "invalid <lambda> value")."""
    def values(s):
        return tuple(cast(v) for v in s.split(",") if v.strip())
    values.__name__ = f"comma-separated {getattr(cast, '__name__', 'value')}"
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", choices=sorted(shapes.GRIDS), default="core",
                   help="core: Llama-3-8B ranks 16/64; highrank: Llama ranks 128/256/320 and Phi-4-mini "
                        "256/320; mixed: a capacity-128 stack of ranks 8/16/64/128 (default core)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tiny", action="store_true",
                   help="shapes scaled down (features /64, ranks /8, M <= 256), for logic checks on a CPU")
    p.add_argument("--subset", action="store_true",
                   help="smoke run: layers qkv and down, two token counts, each model's first rank")
    p.add_argument("--models", type=_csv(), help="models to keep: llama3-8b, phi4-mini")
    p.add_argument("--layers", type=_csv(), help="layer names to keep, e.g. qkv,o")
    p.add_argument("--ranks", type=_csv(), help="rank labels to keep, e.g. 16 or mix")
    p.add_argument("--ms", type=_csv(positive_int), help="token counts to use, e.g. 1,64,4096")
    p.add_argument("--variants", type=_csv(), default=(),
                   help="extra timings of ours, each checked first: " + ", ".join(VARIANTS) + " (default none)")
    p.add_argument("--only-check", action="store_true", help="correctness only (no timing), every row")
    p.add_argument("--peers", type=_csv(), default=problems.PEER_NAMES,
                   help="peers to run beside ours (default vllm,sglang; '' for none)")
    p.add_argument("--peers-adapters", default=None,
                   help="folder of {vllm,sglang}_adapter.py (default .peers/adapters if present, "
                        "else /work/shared/peers); their builds are found through $LORA_PEERS "
                        "(default .peers in the repo root)")
    p.add_argument("--out", default=None, help="output folder (default $OUT if set, else benchmarks/results)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S,
                   help=f"seconds after which no new row starts; results are still written "
                        f"(default {DEFAULT_TIME_BUDGET_S})")
    p.add_argument("--cache", choices=("cold", "hot"), default="cold",
                   help="cold: rotate input sets and flush L2 before each replay (default); hot: neither")
    p.add_argument("--cpu-backend", choices=("torch", "triton"), default="torch",
                   help="with --device cpu: our op through the torch CPU kernels or the Triton launchers "
                        "(the latter needs TRITON_INTERPRET=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def _short(exc, limit=300):
    """One line: the exception, and where it was raised (asserts often carry no message)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = f"{type(exc).__name__}: {exc}{where}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


# --- the environment


def _triton_version():
    try:
        import triton
        return triton.__version__
    except Exception:
        return None


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def device_tag(device):
    """The short name used in file names (report.gpu_tag), 'cpu' off a GPU."""
    return report.gpu_tag(device_name(device)) if device.type == "cuda" else "cpu"


def environment(args, timer, dtype, notes):
    now = datetime.datetime.now(datetime.timezone.utc)
    env = {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"), "grid": args.grid, "device": str(timer.device),
        "gpu": device_name(timer.device), "torch": torch.__version__, "triton": _triton_version(),
        "cuda": torch.version.cuda, "python": platform.python_version(), "dtype": str(dtype).replace("torch.", ""),
        "git": report.git_revision(REPO), "timing": timer.method(), "cache": args.cache,
        "l2_MiB": timer.l2_bytes >> 20, "copy_GBps": None, "matmul_TFLOPs": None,
        "args": {k: v for k, v in vars(args).items()},
    }
    if timer.device.type == "cuda":   # whose tuned table "ours" looks its configs up in (None: the heuristic's)
        env["tuned_table"] = lora_ops.configs.table_source(timer.device)
    if timer.device.type == "cpu":
        env["cpu_backend"] = args.cpu_backend
        env["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
    if not args.only_check:
        try:
            env["copy_GBps"] = float(f"{timer.copy_bandwidth() / 1e9:.4g}")
        except Exception as e:
            notes.append(f"copy bandwidth not measured (no floor column): {_short(e)}")
        try:
            env["matmul_TFLOPs"] = float(f"{timer.matmul_rate(dtype) / 1e12:.4g}")
        except Exception as e:
            notes.append(f"matmul rate not measured: {_short(e)}")
    return env


# --- one row


def stack_pad(problem):
    """The zero rows LoRALinear(stack_a=True) puts after [W; A] for this problem's layer (tuned table)."""
    return lora_ops.configs.stack_pad_rows(problem.N, problem.K, problem.L * problem.S * problem.R,
                                           torch.device(problem.device), problem.dtype)


def new_record(case, problem):
    slots = problem.slots_cpu
    return {
        "model": case.layer.model, "layer": case.layer.name, "rank": case.ranks.label,
        "slot_ranks": list(problem.slot_ranks), "capacity": problem.R, "M": case.M, "K": problem.K,
        "N": problem.N, "slices": problem.widths,
        "tokens_per_slot": [problem.tokens_of(s) for s in range(problem.L)],
        "no_adapter_tokens": int((slots < 0).sum()), "status": "done", "ok": False, "notes": [], "timing": {},
    }


def skipped_record(case, why):
    return {"model": case.layer.model, "layer": case.layer.name, "rank": case.ranks.label, "M": case.M,
            "status": "skipped", "ok": None, "notes": [why]}


class RowRunner:
    def __init__(self, args, timer, peers, dtype, copy_bytes_per_s, matmul_flops_per_s=0.0):
        self.args, self.timer, self.peers, self.dtype = args, timer, peers, dtype
        self.copy_bytes_per_s = copy_bytes_per_s
        self.matmul_flops_per_s = matmul_flops_per_s
        self.tol = problems.TOLERANCE[dtype]

    def check(self, rec, name, build, problem, inp, ref):
        """Build a call and check its delta; record ok/err (or the exception). Returns the call or None."""
        try:
            run = build()
            c = problems.check_delta(problem, inp, run, ref, self.tol)
        except Exception as e:
            rec[f"{name}_ok"], rec[f"{name}_err"] = False, None
            rec["notes"].append(f"{name} check: {_short(e)}")
            self.timer.sync_quietly()
            return None
        rec[f"{name}_ok"], rec[f"{name}_err"] = c.ok, c.err
        rec.setdefault("round_err", c.round_err)
        if c.note:
            rec["notes"].append(f"{name}: {c.note}")
        return run

    def time(self, rec, name, make_call, set_bytes, eager=True):
        try:
            graph_us, eager_us, info = self.timer.measure(make_call, set_bytes, eager)
        except Exception as e:
            rec["notes"].append(f"{name} timing: {_short(e)}")
            self.timer.sync_quietly()
            return None
        rec[f"{name}_us"] = graph_us
        if eager:
            rec[f"{name}_eager_us"] = eager_us
        rec["timing"][name] = info
        return graph_us

    def graph_replay(self, problem, inp):
        """A one-call CUDA graph of our op on set 0, y restored after the capture's warm-up call."""
        y0 = inp.y.clone()
        replay = self.timer.capture([problems.ours(problem, inp)])
        inp.y.copy_(y0)
        return replay

    def run(self, case):
        problem = problems.Problem.for_case(case, self.dtype, self.args.device, self.args.seed)
        rec = new_record(case, problem)
        self.layers = {}   # the checked layer variants, timed with the base layer in time_row
        inp = problem.inputs(0)
        ref = problems.reference_delta(problem, inp)
        checked = ["ours"]
        self.check(rec, "ours", lambda: problems.ours(problem, inp), problem, inp, ref)
        if self.timer.cuda:
            checked.append("ours_graph")
            self.check(rec, "ours_graph", lambda: self.graph_replay(problem, inp), problem, inp, ref)
        if self.peers and not case.ranks.uniform:
            rec["notes"].append(f"peers run every slot at the padded rank {problem.R} (their only mode)")
        for name, module in self.peers.items():
            self.check(rec, name, lambda m=module: problems.peer(m, problem, inp), problem, inp, ref)
        for variant in self.args.variants:
            checked.append(variant)
            self.run_variant(rec, variant, problem, inp, ref)
        del ref
        if not case.ranks.uniform:
            checked.append("alone")
            self.run_alone(rec, problem)
        if not self.args.only_check:
            self.time_row(rec, problem, inp)
            if rec.get("stacked_us") is not None and rec.get("ours_us") is not None:
                # What LoRALinear(stack_a=True) runs: the stacked layer where its rule allows, else lora_linear
                # (in_order, when timed: its write-first path where launch.writes_first), else add_lora_.
                limit = stacked_token_limit(problem.N, problem.K, problem.L * problem.S * problem.R,
                                            pad_rows=stack_pad(problem), device=problem.device, dtype=problem.dtype)
                other = rec.get("in_order_us", rec["ours_us"])
                rec["stack_a_us"] = rec["stacked_us"] if case.M <= limit else other
        rec["ok"] = all(rec.get(f"{name}_ok") for name in checked)
        return rec

    def time_row(self, rec, problem, inp):
        if self.copy_bytes_per_s:
            rec["floor_bytes"] = problem.floor_bytes()
            rec["floor_us"] = rec["floor_bytes"] / self.copy_bytes_per_s * 1e6
        flops = problem.floor_flops()
        if self.matmul_flops_per_s and flops is not None:
            # The compute bound beside the bytes bound: at high ranks it is the larger (DESIGN §7).
            rec["mma_floor_us"] = flops / self.matmul_flops_per_s * 1e6

        def inputs(k):
            return inp if k == 0 else problem.inputs(k)
        self.time(rec, "ours", lambda k: problems.ours(problem, inputs(k)), problem.set_bytes())
        self.time_layers(rec, problem)
        for name, module in self.peers.items():
            if rec.get(f"{name}_err") is None:  # its build or call raised: nothing to time
                continue
            self.time(rec, name, lambda k, m=module: problems.peer(m, problem, inputs(k)), 2 * problem.set_bytes())

    def time_layers(self, rec, problem):
        """The base layer and the checked layer variants, timed interleaved (Timer.measure_paired): each
        variant's delta ({variant}_us) is the median of its per-round difference from the base layer, so
        the GPU's clock drift between timings (several % on a long GEMM) does not enter it."""
        calls = {"base": (lambda k: problems.base(*problem.base_inputs(k)), problem.base_set_bytes())}
        calls.update({f"{variant}_layer": spec for variant, spec in self.layers.items()})
        prepare = {f"{variant}_layer": functools.partial(config_choice, variant) for variant in self.layers}
        try:
            medians, runs = self.timer.measure_paired({name: c for name, (c, _) in calls.items()},
                                                      {name: b for name, (_, b) in calls.items()}, prepare)
        except Exception as e:
            rec["notes"].append(f"base and layer timing: {_short(e)}")
            self.timer.sync_quietly()
            return
        rec["base_us"] = medians["base"]
        rec["timing"]["base"] = dict(rounds=len(runs["base"]), paired_with=sorted(self.layers))
        for variant in self.layers:
            rec[f"{variant}_layer_us"] = medians[f"{variant}_layer"]
            rec[f"{variant}_us"] = paired_delta(runs, f"{variant}_layer", "base")

    def run_variant(self, rec, variant, problem, inp, ref):
        """Our op with one config choice changed (VARIANTS): checked on set 0, then graph-timed."""
        VARIANTS[variant]()
        if variant in LAYER_VARIANTS:
            run_layer = self.run_stacked_variant if variant == "stacked" else self.run_layer_variant
            try:
                run_layer(rec, variant, problem, inp, ref)
            finally:
                reset_config_choice()
            return
        try:
            self.check(rec, variant, lambda: problems.ours(problem, inp), problem, inp, ref)
            if not self.args.only_check:
                self.time(rec, variant, lambda k: problems.ours(problem, inp if k == 0 else problem.inputs(k)),
                          problem.set_bytes(), eager=False)
        finally:
            reset_config_choice()

    def run_layer_variant(self, rec, variant, problem, inp, ref):
        """lora_linear (base GEMM + delta): its output minus F.linear's is checked as the delta; the
        layer is graph-timed as {variant}_layer_us (run() subtracts the base layer's time)."""
        weights = {}

        def weight(k):
            if k not in weights:
                weights[k] = problem.base_inputs(k)[1]
            return weights[k]
        self.check_and_time_layer(rec, variant, problem, inp, ref,
                                  lambda k, i: problems.layer(problem, i, weight(k)),
                                  lambda: torch.nn.functional.linear(inp.x, weight(0)),
                                  problem.N * problem.K * problem.esize)

    def run_stacked_variant(self, rec, variant, problem, inp, ref):
        """lora_linear_stacked with every slot's A stacked under W (DESIGN §4): its first N columns minus
        the same GEMM's (precision.stacked_gemm: the wider GEMM, over the prefix of the stack this token count
        is padded to, may round y unlike F.linear(x, W) or the whole stack) are checked as the delta; the
        layer is graph-timed as stacked_layer_us (run() subtracts the base layer's time, so the delta's
        figure holds the wider GEMM's extra cost)."""
        op = torch.ops.lora_ops.lora_linear_stacked
        N = problem.N
        stacks = {}
        pad = stack_pad(problem)   # the zero rows LoRALinear(stack_a=True) would put after A

        def stacked(k, i):
            if k not in stacks:
                stacks[k] = stacked_weight(problem.base_inputs(k)[1], i.lora_a)
            return stacks[k]

        def layer(k, i):
            args = (i.x, stacked(k, i), None, i.lora_b, problem.scale, problem.rank, problem.widths, *problem.meta)
            return lambda: op(*args)[:, :N]
        E = problem.L * problem.S * problem.R
        self.check_and_time_layer(rec, variant, problem, inp, ref, layer,
                                  lambda: stacked_gemm(inp.x, stacked(0, inp), None, N, E)[:, :N],
                                  (N + E + pad) * problem.K * problem.esize)

    def check_and_time_layer(self, rec, variant, problem, inp, ref, layer, before, extra_bytes):
        """One whole-layer variant: ``layer(k, inputs)`` builds the call on input set k (it returns the
        layer's [M, N] output), ``before()`` the same layer's output without the delta on set 0. The
        output minus ``before()`` is checked as the delta (inp.y restored afterwards); then the layer is
        graph-timed as {variant}_layer_us, each set ``extra_bytes`` (its weights) larger than the delta's."""
        y0 = inp.y.clone()
        try:
            def build():
                call = layer(0, inp)
                inp.y.copy_(before())
                return lambda: inp.y.copy_(call())
            self.check(rec, variant, build, problem, inp, ref)
        finally:
            inp.y.copy_(y0)
        if not self.args.only_check:   # timed with the base layer (time_layers), under its config choice
            self.layers[variant] = (lambda k: layer(k, inp if k == 0 else problem.inputs(k)),
                                    problem.set_bytes() + extra_bytes)

    def run_alone(self, rec, problem):
        """Each used slot's tokens alone, at its own rank: checked, and (unless --only-check) timed.
        alone_us, their sum, is what a mixed batch would cost if mixing were free."""
        parts, ok = {}, True
        for slot in problem.used_slots():
            sub = problem.alone(slot)
            inp = sub.inputs(0)
            sub_rec = {"notes": [], "timing": {}}
            self.check(sub_rec, "ours", lambda: problems.ours(sub, inp), sub, inp,
                       problems.reference_delta(sub, inp))
            ok = ok and bool(sub_rec["ours_ok"])
            rec["notes"] += [f"alone slot {slot} (rank {sub.R}): {n}" for n in sub_rec["notes"]]
            if not self.args.only_check:
                t = self.time(sub_rec, "ours", lambda k: problems.ours(sub, inp if k == 0 else sub.inputs(k)),
                              sub.set_bytes(), eager=False)
                rec["notes"] += [f"alone slot {slot}: {n}" for n in sub_rec["notes"] if "timing" in n]
                parts[str(slot)] = t
        rec["alone_ok"] = ok
        if parts and all(t is not None for t in parts.values()):
            rec["alone_parts_us"] = parts
            rec["alone_us"] = sum(parts.values())


# --- the run


def default_out_dir():
    return os.environ.get("OUT") or os.path.join(HERE, "results")


def default_adapters_dir():
    local = os.path.join(REPO, ".peers", "adapters")
    return local if os.path.isdir(local) else "/work/shared/peers"


def file_stem(args, device):
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    parts = ["lora_ops", args.grid]
    if args.subset or args.models or args.layers or args.ranks or args.ms:
        parts.append("subset")
    if args.tiny:
        parts.append("tiny")
    if args.only_check:
        parts.append("check")
    return "-".join(parts + [device_tag(device), day])


def progress_line(i, n, case, rec, wall):
    def t(key):
        v = rec.get(key)
        return "-" if v is None else f"{v:.1f}"
    err = rec.get("ours_err")
    bits = [f"ours {t('ours_us')}", f"base {t('base_us')}", f"floor {t('floor_us')}"]
    bits += [f"{p} {t(p + '_us')}" for p in report.PEERS if p + "_ok" in rec]
    if "alone_ok" in rec:
        bits.append(f"alone-sum {t('alone_us')}")
    status = "ok" if rec["ok"] else "FAIL"
    err_s = "-" if err is None else f"{err:.1e}"
    return f"[{i + 1}/{n}] {case.label}: {status} (err {err_s}) | " + " ".join(bits) + f" µs | {wall:.1f} s"


def main(argv=None):
    args = parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; expected some of {sorted(VARIANTS)}")
    started = time.monotonic()
    device = torch.device(args.device)
    args.device = str(device)
    dtype = DTYPES[args.dtype]
    notes = []
    if device.type == "cpu":
        lora_ops.ops.set_cpu_backend(args.cpu_backend)
        if os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16:
            notes.append("Triton's interpreter computes bf16 wrongly (docs/DESIGN.md §6): Triton-path values "
                         "(ours with --cpu-backend triton, the peers) fail in bf16; use --dtype float16/float32")
    timer = Timer(device, args.cache)
    env = environment(args, timer, dtype, notes)
    peers = {}
    if args.peers and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        notes.append("peers skipped: on a CPU their Triton kernels need TRITON_INTERPRET=1")
    elif args.peers:
        adapters = args.peers_adapters or default_adapters_dir()
        peers, peer_notes = problems.load_peers(args.peers, adapters, os.path.join(REPO, ".peers"), device.type)
        notes += peer_notes
        env["peers"] = {"names": sorted(peers), "adapters": adapters, "builds": os.environ.get("LORA_PEERS")}
    cases = shapes.cases(args.grid, tiny=args.tiny, subset=args.subset, models=args.models, layers=args.layers,
                         ranks=args.ranks, tokens=args.ms)
    if not cases:   # (a filter that matched nothing wrote empty files and "0 rows ok")
        sys.exit(f"bench_lora: no row of the {args.grid} grid matches --models {args.models}, --layers "
                 f"{args.layers}, --ranks {args.ranks}, --ms {args.ms}")
    out_dir = args.out or default_out_dir()
    stem = file_stem(args, device)
    title = f"lora_ops {args.grid} grid on {env['gpu']} ({env['date']})"
    runner = RowRunner(args, timer, peers, dtype, (env["copy_GBps"] or 0) * 1e9, (env["matmul_TFLOPs"] or 0) * 1e12)
    for n in notes:
        print("note:", n, flush=True)
    print(f"{len(cases)} rows, grid {args.grid}, {env['dtype']}, {env['gpu']}, peers: {sorted(peers) or 'none'}; "
          f"{env['timing']}; copy {env['copy_GBps']} GB/s, matmul {env['matmul_TFLOPs']} TFLOP/s", flush=True)

    rows = []
    for i, case in enumerate(cases):
        if time.monotonic() - started > args.time_budget:
            rows.append(skipped_record(case, f"time budget of {args.time_budget:.0f} s spent"))
            continue
        t0 = time.monotonic()
        try:
            rec = runner.run(case)
        except Exception as e:  # a row that cannot even be set up: recorded as a failure, the run goes on
            rec = skipped_record(case, f"row failed: {_short(e)}")
            rec.update(status="error", ok=False)
        rec["wall_s"] = round(time.monotonic() - t0, 2)
        rows.append(rec)
        if rec["status"] == "done":
            print(progress_line(i, len(cases), case, rec, rec["wall_s"]), flush=True)
        else:
            print(f"[{i + 1}/{len(cases)}] {case.label}: {rec['notes'][0]}", flush=True)
        _free_memory(device)
        try:  # partial results survive a run that is killed later
            report.write_all(out_dir, stem, env, rows, report.summarise(rows), title, plot=False)
        except Exception as e:
            print(f"note: partial results not written: {_short(e)}", flush=True)

    env["wall_s"] = round(time.monotonic() - started, 1)
    skipped = sum(1 for r in rows if r["status"] == "skipped")
    if skipped:
        notes.append(f"{skipped} rows skipped by the time budget ({args.time_budget:.0f} s)")
    env["notes"] = notes
    summary = report.summarise(rows)
    paths, write_notes = report.write_all(out_dir, stem, env, rows, summary, title, plot=not args.no_plot)
    failed = [r for r in rows if r["ok"] is False]
    for n in notes + write_notes:
        print("note:", n)
    print("wrote", ", ".join(paths))
    detail = report.notes_text(rows)
    if detail:
        print("\nrow notes:\n" + detail)
    print()
    print(report.text_table(rows))
    text = report.summary_text(summary)
    if text:
        print()
        print(text)
    print(f"\n{len(rows) - skipped - len(failed)} rows ok, {len(failed)} failed, {skipped} skipped; "
          f"{env['wall_s']} s")
    return 1 if failed else 0


def _free_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
