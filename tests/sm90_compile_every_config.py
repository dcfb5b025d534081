"""Compile for sm_90, without a GPU, one launch of every code path the shipped configs and the heuristic take.

tests/sm90_codegen.py compiles a dozen chosen cases and reports their code; this compiles the launches a GPU
run could ask for (one per code path, :func:`path_key`; all with --all), under whatever Triton is installed,
and reports the ones that fail. Its use: the
device's Triton (3.6) refuses code that CI's (3.9) compiles (docs/DESIGN.md §6), so a change that passes CI
can still break every launch on the H200; run it under the device's Triton before a device call
(tests/device_triton_codegen.sh does).

Launches are recorded, not run (every FastLauncher records instead of launching), on CPU tensors of the
real layer shapes with few tokens; the compile specialisation is the one Triton's launcher would give
(sm90_codegen.compile_args). What is recorded:
- every entry of the shipped H200 table (bf16): add_lora_'s pair (shrink entry + expand entry, h as the
  expand takes it), the one-launch kernel where an entry names one, the stacked path's expand, the store
  mode's; each with PDL on and off, and the pair also with set_fast_bf16;
- the heuristic's configs for Llama-3-8B's layers at ranks 16 / 64 / 100 / 320 and 1-4096 tokens, in bf16,
  fp16 and float32: the pair, the one-launch kernel, the store mode and the stacked expand;
- the backward kernels (grad_x, segment_outer, and the slice ops lora_grad_h / _a / _b as the autograd
  formula calls them) at those ranks and dtypes.

    PYTHONPATH=. python tests/sm90_compile_every_config.py            # one launch per code path (path_key)
    PYTHONPATH=. python tests/sm90_compile_every_config.py --all      # every distinct launch (~1650: 15 min
                                                                      # on 2 cores; for a table change)
    PYTHONPATH=. python tests/sm90_compile_every_config.py --subset   # the heuristic's bf16 launches only
"""
import contextlib
import functools
import json
import multiprocessing
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sm90_codegen  # noqa: E402

TOKENS = 64             # the problems' token count: M is never specialised on, the configs come from entries
HEURISTIC_TOKENS = (1, 16, 64, 256, 1024, 4096)
HEURISTIC_RANKS = (16, 64, 100, 320)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@contextlib.contextmanager
def switches(pdl, fast_bf16):
    """PDL (which CPU tensors never ask for) and set_fast_bf16 as given, within the block."""
    from lora_ops import launch
    saved = launch.uses_pdl, launch.stacked_uses_pdl
    launch.uses_pdl = launch.stacked_uses_pdl = lambda x: pdl
    launch.set_fast_bf16(fast_bf16)
    try:
        yield
    finally:
        launch.uses_pdl, launch.stacked_uses_pdl = saved
        launch.set_fast_bf16(False)


class Problems:
    """Synthetic problems by (K, widths, rank, dtype), made once (the gate_up ones are large)."""

    def __init__(self):
        self._made = {}

    def get(self, K, widths, rank, dtype):
        from lora_ops.configs import tuning
        key = (K, tuple(widths), rank, dtype)
        if key not in self._made:
            self._made[key] = tuning.synthetic_problem(torch.device("cpu"), dtype, K, list(widths), rank, 4, TOKENS)
        return self._made[key]


def stacked_expand(p, cfg):
    """The stacked path's expand on an output of the GEMM's shape (the GEMM itself is cuBLAS)."""
    from lora_ops import launch
    L, N, R = p["B"].shape
    out = torch.empty(p["x"].shape[0], N + L * len(p["widths"]) * R, dtype=p["x"].dtype)
    launch.launch_expand_stacked(out, N, p["B"], p["widths"], p["rank"], p["scale"], *p["meta"], cfg,
                                 pdl=launch.stacked_uses_pdl(p["x"]))


def run_kind(kind, p, cfg, expand_cfg=None):
    from lora_ops.configs import tuning
    if kind == "stacked":
        stacked_expand(p, cfg)
    else:
        tuning.RUNNERS[kind](p, cfg, expand_cfg)()


def table_jobs():
    """(label, kind, (K, widths, rank, dtype), cfg, expand cfg) for every config of the shipped H200 table."""
    from lora_ops import configs
    from lora_ops.tune import MODELS
    with open(configs.table_path("NVIDIA H200")) as f:
        entries = json.load(f)["entries"]
    by_key = {(e["kind"], e["model"], e["layer"], e["rank"], e["tokens"]): e for e in entries}
    for e in entries:
        kind = e["kind"]
        if kind not in ("shrink", "fused", "stacked", "store") or e.get("config") is None:
            continue
        K, widths = MODELS[e["model"]][e["layer"]]
        cfg = configs._CONFIG_TYPES[kind](**e["config"])
        label = f"{e['model']} {e['layer']} r{e['rank']} M{e['tokens']} {kind}"
        expand_cfg = None
        if kind == "shrink":   # the pair, as add_lora_ runs it
            partner = by_key.get(("expand", e["model"], e["layer"], e["rank"], e["tokens"]))
            if partner is None:
                continue
            expand_cfg = configs._CONFIG_TYPES["expand"](**partner["config"])
        yield label, kind, (K, widths, e["rank"], torch.bfloat16), cfg, expand_cfg


def heuristic_jobs(dtypes):
    """The heuristic's configs for Llama-3-8B's layers (configs on CPU tensors are the heuristic's)."""
    from lora_ops import configs, launch
    from lora_ops.tune import MODELS
    cpu = torch.device("cpu")
    for dtype in dtypes:
        for layer, (K, widths) in MODELS["llama3-8b"].items():
            S, N = len(widths), sum(widths)
            for R in HEURISTIC_RANKS:
                for M in HEURISTIC_TOKENS:
                    label = f"heuristic {dtype} {layer} r{R} M{M}"
                    scfg = configs.shrink_config(M, K, S, R, 4, cpu, dtype, out_features=N)
                    ecfg = configs.expand_config(M, N, S, R, 4, cpu, dtype)
                    yield label + " pair", "shrink", (K, widths, R, dtype), scfg, ecfg
                    fcfg = configs.fused_config(M, K, N, S, R, 4, cpu, dtype)
                    if fcfg is not None:
                        yield label + " fused", "fused", (K, widths, R, dtype), fcfg, None
                    if launch.writes_first_at(M, N, torch.finfo(dtype).bits // 8) or M >= 1024:
                        yield label + " store", "store", (K, widths, R, dtype), configs.store_config(
                            M, N, S, R, 4, K, cpu, dtype), None
                    yield label + " stacked", "stacked", (K, widths, R, dtype), configs.stacked_config(
                        M, N, S, R, 4, K, cpu, dtype), None


def grad_launches(dtypes, problems):
    from lora_ops import launch_grad, plan
    for dtype in dtypes:
        for R in HEURISTIC_RANKS:
            p = problems.get(4096, [4096, 1024, 1024], R, dtype)
            M = p["x"].shape[0]
            dh = torch.randn(M, 3, R)
            launch_grad.launch_lora_grad_x(torch.zeros(M, 4096, dtype=dtype), dh, p["A"], p["rank"], *p["meta"],
                                           launch_grad.grad_x_config(M, 4096, R, 3), write_all=True)
            launch_grad.launch_segment_outer(torch.empty(4, R, 4096, dtype=dtype), dh[:, 0], p["x"], p["rank"],
                                             *p["meta"], launch_grad.segment_outer_config(R, 4096, 4))
            # The backward's slice ops as the autograd formula calls them (their configs, their scratch), with
            # plans off: a recorded launch compiles nothing a plan could keep.
            grad_out = torch.randn(M, 6144, dtype=dtype)
            plan.set_enabled(False)
            try:
                launch_grad.lora_grad_h(grad_out, p["B"], p["scale"], p["rank"], [4096, 1024, 1024], *p["meta"])
                launch_grad.lora_grad_a(dh, p["x"], p["rank"], *p["meta"])
                launch_grad.lora_grad_b(grad_out, dh, p["rank"], [4096, 1024, 1024], *p["meta"])
            finally:
                plan.set_enabled(True)


def path_key(name, args):
    """What decides a launch's code path, not its tiles: the kernel, its pointer dtypes, its bool and str
    constexprs, and of each int constexpr whether it is 0, 1 or more (N_LOOP, M_LOOP, H_PLANES, split-K
    ...). Triton's front end fails by path (session 21's string default failed every expand); tile sizes
    change layouts, which --all compiles too."""
    signature, consts, _, _ = args

    def flag(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return min(v, 2)
        return ("tuple", len(v)) if isinstance(v, tuple) else v   # a tuple (slice widths): by its length
    flags = {k: flag(v) for k, v in consts.items()}
    return repr((name, sorted(v for v in signature.values() if v.startswith("*")), sorted(flags.items())))


def remember(found, calls, label, every_launch):
    """Add the recorded ``calls`` (sm90_codegen.recorded's) to ``found`` under their key, first label kept."""
    for launcher, tensors, ints, constexprs in calls:
        name, args = launcher.kernel.__name__, sm90_codegen.compile_args(launcher.kernel, tensors, ints, constexprs)
        found.setdefault(repr((name, args)) if every_launch else path_key(name, args), (name, args, label))


def record_everything(subset, every_launch=False):
    """{key: (kernel name, compile args, first label)} and the recording's failures; the key is the whole
    compile specialisation with ``every_launch``, else :func:`path_key`."""
    problems, found, failures = Problems(), {}, []
    jobs = list(heuristic_jobs((torch.bfloat16,) if subset else DTYPES))
    if not subset:
        jobs += list(table_jobs())
    for label, kind, (K, widths, R, dtype), cfg, expand_cfg in jobs:
        p = problems.get(K, widths, R, dtype)
        for pdl in (False, True):
            for fast in ((False, True) if kind == "shrink" and dtype == torch.bfloat16 else (False,)):
                with sm90_codegen.recorded() as calls, switches(pdl, fast):
                    try:
                        run_kind(kind, p, cfg, expand_cfg)
                    except Exception as e:   # noqa: BLE001 - reported, the rest still compiles
                        failures.append((f"{label} pdl={pdl} fast={fast}: recording", repr(e)))
                remember(found, calls, f"{label} pdl={pdl} fast={fast}", every_launch)
    if not subset:
        with sm90_codegen.recorded() as calls:
            grad_launches(DTYPES, problems)
        remember(found, calls, "backward", every_launch)
    return found, failures


@functools.lru_cache(maxsize=None)
def _kernels():
    """The kernels by name, once per worker process."""
    return {fn.__name__: fn for _, fn in sm90_codegen.jit_functions()}


def _compile_one(item):
    name, args, label = item
    try:
        sm90_codegen.compile_from_args(_kernels()[name], *args)
        return None
    except Exception:   # noqa: BLE001
        return label, name, traceback.format_exc()[-1200:]   # the tail: the root error


def main(argv):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("sm90_compile_every_config: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    import triton
    t0 = time.time()
    found, failures = record_everything("--subset" in argv, "--all" in argv)
    print(f"triton {triton.__version__}: {len(found)} distinct launches recorded in {time.time() - t0:.0f} s",
          flush=True)
    if "--record-only" in argv:   # the tests' check of the recording: kernels and labels, nothing compiled
        print(json.dumps({"failures": failures, "kernels": sorted({name for name, _, _ in found.values()}),
                          "labels": sorted({label.split()[0] for _, _, label in found.values()}),
                          "pdl": sorted({label.split("pdl=")[1][:4] for _, _, label in found.values()
                                         if "pdl=" in label})}))
        return 1 if failures else 0
    workers = max(1, min(os.cpu_count() or 1, 8))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for i, bad in enumerate(pool.imap_unordered(_compile_one, list(found.values())), 1):
            if bad is not None:
                failures.append((f"{bad[0]}: {bad[1]}", bad[2]))
            if i % 25 == 0:
                print(f"  {i} / {len(found)} compiled, {len(failures)} failed, {time.time() - t0:.0f} s", flush=True)
    for where, why in failures:
        print(f"FAILED {where}\n{why}")
    print(f"{len(found)} launches, {len(failures)} failures, {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
