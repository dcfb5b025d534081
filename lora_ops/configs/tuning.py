"""Timing kernel configs on the GPU: the candidate spaces, the timer, and the search used by both the
offline tuner (``python -m lora_ops.tune``) and the opt-in runtime autotune.

Each candidate is timed as CUDA-graph replays of a run of launches on a synthetic batch of the key's
shapes (``num_slots`` adapters sharing the tokens, about 10% with no adapter, shuffled); the median
per launch counts. Candidates that fail to compile or exceed the GPU's resources are skipped.
"""
import itertools
import math
import statistics
import sys

import torch

from lora_ops.batch import LoRABatch
from lora_ops.configs import heuristics
from lora_ops.configs.heuristics import ExpandConfig, FusedConfig, ShrinkConfig, cdiv

TUNE_SLOTS = 4
# The one-launch kernel is tried up to this token bucket (on the H200 it lost at 16 and 64 already).
FUSED_TUNE_MAX_BUCKET = 64
# Launch runs in a timed graph rotate over copies of the problem until they hold this many bytes, so
# weights come from HBM as in a model (whose other layers evict them from L2), not from a warm L2.
# (2026-12-02: 16 copies of a decode-size problem still fit the H200's 50 MB L2, so the first table was
# tuned on warm weights at M <= 64; 64 copies of 200 MB in all do not.)
COLD_BYTES = 200 * 2 ** 20
MAX_COPIES = 64


def _block_ms(bucket):
    """Token tiles around the heuristic's: half, same, double (16..128)."""
    bm = heuristics.block_m_for(bucket)
    return sorted({max(16, bm // 2), bm, min(128, bm * 2)})


def shrink_rank_blocks(max_rank):
    """Rank blocks the shrink tries: the heuristic's, and above rank 64 also 128 (a wider dot per x tile;
    rank 320 then pads to 384)."""
    br = heuristics.rank_block(max_rank)
    return (br, 128) if max_rank > 64 else (br,)


# From this bucket the shrink also tries 2 and 4 splits: its token axis of ~cdiv(M, block_m) + slots tiles
# fills 132 SMs unevenly (H200, 2026-12-03: Llama down r64 at 4096 tokens, 68 tiles, 2 splits: pair 84 -> 68
# µs). Every slice in one program (a 256-wide dot at rank 64) was tried there too and won at no shape.
FEW_SPLITS_MIN_BUCKET = 1024


def shrink_candidates(bucket, in_features, max_rank, num_slices=1, num_slots=TUNE_SLOTS):
    # split_k is a run-time argument (no recompile), so it is searched widely; the other knobs compile.
    for br in shrink_rank_blocks(max_rank):
        groups = sorted({1, heuristics.slice_group_for(num_slices, br)})
        for bm, bk, group in itertools.product(_block_ms(bucket), (64, 128, 256), groups):
            programs = (cdiv(num_slices, group) * cdiv(max_rank, br)
                        * heuristics.max_token_tiles(bucket, num_slots, bm))
            most = min(heuristics.MAX_SPLIT_K, cdiv(in_features, bk))
            base = max(1, heuristics.TARGET_PROGRAMS // programs)
            # Where `base` passes `most` (one token tile, long K), the counts below `most` still get a try.
            splits = (1, max(1, base // 4), max(1, base // 2), base, base * 2, max(1, most // 2), max(1, most // 4))
            if bucket >= FEW_SPLITS_MIN_BUCKET:
                splits += (2, 4)
            for sk in sorted({min(most, s) for s in splits}):
                # A 128-wide rank block holds a 64 x 128 fp32 accumulator at least: 8 warps only.
                for warps, stages in itertools.product((4, 8) if br <= 64 else (8,), shrink_stages(bucket)):
                    yield ShrinkConfig(bm, br, bk, sk, warps, stages, group)


# From this bucket the shrink also tries a 4-stage pipeline: its K loop is long (4096-14336 features) and
# its token tiles many. H200, session 19 (lab_shrink_tiles.py, 4096 tokens, shrink alone): Llama qkv r320
# 85 -> 74 µs, Phi-4-mini qkv r320 64 -> 58; 5 stages lost everywhere, and wider tiles (128 x 128, 128 x 256)
# cut the L2 traffic by up to 40% and lost or tied.
DEEP_PIPELINE_MIN_BUCKET = 1024


def shrink_stages(bucket):
    return (3, 4) if bucket >= DEEP_PIPELINE_MIN_BUCKET else (3,)


# Above rank 64, up to this bucket, the tuner also tries the expand with the whole rank in one block
# (heuristics.one_block_rank: rank 320 takes 512): it adds the shrink's split-K partial sums itself, which
# spares the shrink its own summing (an arrival counter zero-filled by a launch of its own, then a round
# trip through memory), and narrow output tiles give decode sizes enough programs.
ONE_BLOCK_TUNE_MAX_BUCKET = 256


# From this bucket the whole-rank expands also walk several token tiles with their block of B held (m_loop;
# kernels.expand). H200 lab, session 16 (`benchmarks/lab_token_loop.py`), against the shipped configs at
# 1024 tokens: the stacked expand of Llama qkv r64 24.4 -> 20.3 µs (32 x 64, 4 tiles), gate_up r16 39.3 ->
# 33.1 (32 x 128, 2 tiles); add_lora_'s expand 7-14% faster on 5 of 8 rows; slower at 256 tokens, so not
# tried there. (block_m, block_n, m_loop), 4 warps, one column block.
TOKEN_LOOP_MIN_BUCKET = 1024
TOKEN_LOOP_SHAPES = ((16, 128, 4), (32, 64, 4), (32, 128, 2), (16, 128, 8))


def token_loop_candidates(bucket, max_rank):
    if bucket >= TOKEN_LOOP_MIN_BUCKET:
        for bm, bn, m_loop in TOKEN_LOOP_SHAPES:
            yield ExpandConfig(bm, bn, heuristics.rank_block(max_rank), 4, 2, 1, m_loop)


def expand_candidates(bucket, out_features, max_rank):
    # Up to rank 64 the whole rank is one block and from 256 tokens a program streams n_loop column blocks
    # (kernels.expand); above rank 64 the rank loop runs and large output tiles pay (fewer re-reads of h, B).
    full = heuristics.rank_block(max_rank)
    if heuristics.rank_loops(max_rank):
        for bm, bn, br in itertools.product(_block_ms(bucket), (128, 256), (32, full)):
            # sm_90 PTX (2026-12-03): 4 warps on a 128 x 256 tile spill kilobytes of registers; deeper
            # pipelines are worth a try now that the loop's loads are 16-byte cp.async.
            for warps, stages in ((4, 3), (8, 3), (8, 4)):
                if warps == 4 and bm * bn > 128 * 128:
                    continue
                yield ExpandConfig(bm, bn, br, warps, stages)
        if bucket <= ONE_BLOCK_TUNE_MAX_BUCKET:
            br = heuristics.one_block_rank(max_rank)
            for bm, bn, warps in itertools.product(sorted({16, *_block_ms(bucket)}), (32, 64, 128), (4, 8)):
                if bm * br <= heuristics.ONE_BLOCK_MAX_H_TILE:
                    yield ExpandConfig(bm, bn, br, warps, 2)
        return
    # Below 256 tokens up to 4 column blocks per program: fewer re-reads of the split-K partial sums (search_pair).
    n_loops = (1, 4, 8) if bucket >= heuristics.EXPAND_N_LOOP_MIN_BUCKET else (1, 2, 4)
    for bm, bn, n_loop in itertools.product(_block_ms(bucket), (64, 128), n_loops):
        for warps, stages in ((4, 2), (8, 2)):
            yield ExpandConfig(bm, bn, full, warps, stages, n_loop)
    yield from token_loop_candidates(bucket, max_rank)


# The stacked path's expand (launch.lora_linear_stacked) reads bf16 h from the GEMM's output and adds no
# partial sums. H200 lab (session 13): its best tiles differ from add_lora_'s expand by up to 2x at a shape
# (Llama down, rank 64, 256 tokens: 15.3 -> 7.5 µs), from 16-token tiles with 256-wide column blocks to
# 64-token tiles with 32-wide ones.
STACKED_ONE_BLOCK_SHAPES = ((32, 1, 4), (64, 1, 4), (64, 2, 4), (128, 1, 4), (128, 1, 8), (128, 2, 4), (256, 1, 8))


def stacked_candidates(bucket, out_features, max_rank):
    if heuristics.rank_loops(max_rank):   # the rank loop's space (and one block where h's tile fits)
        yield from expand_candidates(bucket, out_features, max_rank)
        return
    shapes = STACKED_ONE_BLOCK_SHAPES
    if bucket >= heuristics.EXPAND_N_LOOP_MIN_BUCKET:
        shapes += ((64, 4, 4), (128, 4, 4))
    for bm in sorted({16, *_block_ms(bucket)}):
        for bn, n_loop, warps in shapes:
            yield ExpandConfig(bm, bn, heuristics.rank_block(max_rank), warps, 2, n_loop)
    yield from token_loop_candidates(bucket, max_rank)


# Zero rows the tuner tries after stack_a's [W; A] (configs.stack_pad_rows), timed as the wider GEMM alone at
# the token buckets where the stacked path serves the layer (H200 lab, session 13: Llama o with 256 rows of
# A, 16.3 µs at 64 tokens; 384 rows, 13.0). A bucket keeps a pad only where it beats none there by
# STACK_PAD_MIN_GAIN (configs.stack_pad_at). Steps of 32 rows (session 42, H100, lab_stack_pad_buckets: the
# best pads of Llama's layers at 1-256 tokens were 32, 64, 96, 160, 224 and 352 rows, most between the
# 64-row steps tried before).
STACK_PAD_ROWS = tuple(range(0, 513, 32))
STACK_PAD_MIN_GAIN = 0.97


def stack_pad_times(device, dtype, out_features, in_features, stack_rows, buckets):
    """{pad: [µs of F.linear(x, [W; A; pad zero rows]) at each bucket]} for each of STACK_PAD_ROWS (weights
    in enough copies to keep L2 cold, as the kernels are timed; the pads of a bucket timed in turn:
    :func:`paired_graph_times_us`)."""
    g = torch.Generator(device=device).manual_seed(0)
    K = in_features
    weights = {}
    for pad in STACK_PAD_ROWS:
        rows = out_features + stack_rows + pad
        count = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / (rows * K * dtype.itemsize))))
        weights[pad] = [(torch.randn(rows, K, generator=g, device=device) * K ** -0.5).to(dtype)
                        for _ in range(count if device.type == "cuda" else 1)]
    times = {pad: [] for pad in STACK_PAD_ROWS}
    for bucket in buckets:
        x = torch.randn(bucket, K, generator=g, device=device).to(dtype)
        got = times_us({pad: [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                        for pad, ws in weights.items()}, device)
        for pad in times:
            times[pad].append(got[pad])
    return times


def best_stack_pads(times):
    """The pad of each bucket (``times``: {pad: [µs at each bucket]}): its fastest, if that beats no pad there
    by STACK_PAD_MIN_GAIN; else 0 (ties: the fewer rows)."""
    pads = []
    for i in range(len(times[0])):
        best = min(times, key=lambda pad: (times[pad][i], pad))
        pads.append(best if times[best][i] < STACK_PAD_MIN_GAIN * times[0][i] else 0)
    return pads


def layer_path_times(device, dtype, in_features, slice_widths, max_rank, num_slots, buckets):
    """{"stacked": [µs], "linear": [µs]} at each bucket: the layer as LoRALinear(stack_a=True) runs it
    through the ops with this GPU's table, stacked (lora_linear_stacked over [W; A] and the table's
    padding rows) and not (lora_linear: the base GEMM and add_lora_). Base weights in enough copies to
    keep L2 cold."""
    from lora_ops.layers import stacked_weight
    N = sum(slice_widths)
    K = in_features
    times = {"stacked": [], "linear": []}
    for bucket in buckets:
        problems = problem_copies(device, dtype, K, slice_widths, max_rank, num_slots, bucket,
                                  extra_bytes=2 * N * K * dtype.itemsize)   # W, and W in [W; A]
        stacked_fns, linear_fns = [], []
        for i, p in enumerate(problems):
            W = base_weight(N, K, device, dtype, seed=100 + i)
            Wst = stacked_weight(W, p["A"])
            args = (p["B"], p["scale"], p["rank"], p["widths"], *p["meta"])
            stacked_fns.append(lambda p=p, Wst=Wst, args=args: torch.ops.lora_ops.lora_linear_stacked(
                p["x"], Wst, None, *args))
            linear_fns.append(lambda p=p, W=W, args=args: torch.ops.lora_ops.lora_linear(
                p["x"], W, None, p["A"], *args))
        got = times_us({"stacked": stacked_fns, "linear": linear_fns}, device)
        for path in times:
            times[path].append(got[path])
        del problems, stacked_fns, linear_fns
    return times


# The stack_limit kind times buckets up to here only: it compares whole layers, and past ~1024 tokens the
# base GEMM's run-to-run spread (H200: 5-10% at 4096-8192) is as large as the delta it would decide on
# (session 14: its calls there disagreed with the grid's on 7 of 21 rows). Beyond, the rule decides
# (layers.stacked_token_limit).
STACK_LIMIT_MAX_BUCKET = 1024


def best_stack_limit(buckets, times):
    """The token limit for stack_a (0 or one of ``buckets``, ascending): stacked up to it, lora_linear past
    it, the one of least geomean time over the buckets (ties: the smaller limit)."""
    def cost(limit):
        return sum(math.log(max(times["stacked" if b <= limit else "linear"][i], 1e-9)) for i, b in enumerate(buckets))
    return min([0, *buckets], key=lambda limit: (cost(limit), limit))


def fused_candidates(bucket, in_features, max_rank):
    """The one-launch kernel's space; empty past the buckets where it can win (one tile's h is recomputed
    by every column block)."""
    if bucket > FUSED_TUNE_MAX_BUCKET:
        return
    br = heuristics.rank_block(max_rank)
    for bn, bk in itertools.product((64, 128, 256), (128, 256)):
        yield FusedConfig(heuristics.block_m_for(bucket), bn, br, bk, 8 if bn == 256 else 4, 3)


def synthetic_problem(device, dtype, in_features, slice_widths, max_rank, num_slots, num_tokens, seed=0):
    """Random signed inputs of the given shapes and a batch of `num_slots` adapters, ~10% no adapter (never
    token 0)."""
    g = torch.Generator(device=device).manual_seed(seed)
    S, N = len(slice_widths), sum(slice_widths)

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    x = rnd(num_tokens, in_features, std=1.0)
    A = rnd(num_slots, S, max_rank, in_features, std=in_features ** -0.5)
    B = rnd(num_slots, N, max_rank, std=max_rank ** -0.5)
    y = rnd(num_tokens, N, std=1.0)
    scale = torch.ones(num_slots, device=device)
    rank = torch.full((num_slots,), max_rank, dtype=torch.int32, device=device)
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g, device=device)
    slots = torch.where(torch.rand(num_tokens, generator=g, device=device) < 0.1, -1, slots)
    # Token 0 always has an adapter: a one-token problem whose token drew -1 had a zero delta, against which the
    # output check (check_candidate) passed a config that wrote nothing.
    slots[:1].clamp_(min=0)
    batch = LoRABatch(num_tokens, num_slots, device)
    batch.update(slots)
    h = torch.randn(num_tokens, S, max_rank, generator=g, device=device)
    return dict(x=x, A=A, B=B, y=y, scale=scale, rank=rank, meta=batch.meta, h=h, widths=list(slice_widths),
                slots=slots)


def base_weight(out_features, in_features, device, dtype, seed):
    """A random base-layer weight [N, K] of unit-scale outputs (the stacked layer's timings)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g, device=device) * in_features ** -0.5).to(dtype)


def problem_copies(device, dtype, in_features, slice_widths, max_rank, num_slots, num_tokens, extra_bytes=0):
    """Enough independent copies of one synthetic problem to hold COLD_BYTES (at most MAX_COPIES), each
    copy counted with ``extra_bytes`` more (what the caller adds to it); one off the GPU (interpreter dry
    runs: no cache to keep cold, and every copy runs the interpreter again)."""
    first = synthetic_problem(device, dtype, in_features, slice_widths, max_rank, num_slots, num_tokens)
    size = sum(first[k].numel() * first[k].element_size() for k in ("x", "A", "B", "y", "h")) + extra_bytes
    count = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / max(size, 1)))) if first["x"].is_cuda else 1
    return [first] + [synthetic_problem(device, dtype, in_features, slice_widths, max_rank, num_slots, num_tokens,
                                        seed=i) for i in range(1, count)]


def graph_time_us(fns, launches=None, replays=5):
    """Median µs per launch from CUDA-graph replays of `launches` calls (default: one per copy, at least
    16) cycling over `fns` (the same work on different copies of the data), each warmed up first."""
    return paired_graph_times_us({0: fns}, launches, replays)[0]


def paired_graph_times_us(fn_lists, launches=None, replays=9):
    """{name: median µs per launch} as :func:`graph_time_us` times each list, but with the graphs' replays
    taken in turn (one of each per round): whole layers' times follow the GPU's clock, which its power
    cap moves while long GEMMs run (H200: 1515-1980 MHz), so two layers timed one after the other can
    differ by as much as the LoRA delta that tells them apart (session 15)."""
    graphs = {}
    for name, fns in fn_lists.items():
        n = launches or max(16, len(fns))
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                fns[i % len(fns)]()
        graphs[name] = (graph, n)
    events = {name: [] for name in graphs}
    for _ in range(replays):
        for name, (graph, _) in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1000 / graphs[name][1] for s, e in pairs)
            for name, pairs in events.items()}


def times_us(fn_lists, device):
    """{name: µs per call} of each list: :func:`paired_graph_times_us` on a GPU, else host wall time (the
    tuner's dry runs)."""
    if device.type == "cuda":
        return paired_graph_times_us(fn_lists)
    return {name: wall_time_us(fns) for name, fns in fn_lists.items()}


def wall_time_us(fns):
    """Host wall time per call (CPU / interpreter dry runs of the tuner: checks the code, not speed)."""
    import time
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


def shrink_runner(p, cfg, expand_cfg=None):
    """The shrink op alone (it adds its split-K partial sums itself), or, given the expand's config, the
    pair as add_lora_ runs it: a shrink's split count is only as good as the expand that reads its
    partial sums (each column block of a token tile re-reads all of them). The pair launches with
    programmatic dependent launch where add_lora_ would (launch.uses_pdl): under it the expand's loads
    before its wait run beside the shrink, which changes which pair is fastest (DESIGN §4)."""
    from lora_ops import launch
    if expand_cfg is None:
        # Its own output: p["h"] stays the expand's input (check_candidate's reference is computed from it).
        if "h_shrink" not in p:
            p["h_shrink"] = torch.zeros_like(p["h"])
        h = p["h_shrink"]

        def run():
            launch.launch_shrink(p["x"], p["A"], p["scale"], p["rank"], *p["meta"], h, cfg)
        return run
    h = launch.shrink_buffer(p["x"], p["A"], cfg, expand_cfg)
    pdl = launch.uses_pdl(p["x"])

    def run_pair():
        launch.launch_shrink_expand(p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"],
                                    h, cfg, expand_cfg, pdl=pdl)
    return run_pair


def expand_runner(p, cfg, expand_cfg=None):
    """The expand alone on p["h"], in the form add_lora_ hands it to ``cfg``: float32, or bf16 planes where
    the rank loop takes them (launch.h_planes)."""
    from lora_ops import launch
    planes = launch.h_planes(cfg, p["B"].shape[2], p["B"].dtype)
    h = p["h"]
    if planes:
        key = f"h_planes{planes}"
        if key not in p:
            hi = p["h"].to(p["B"].dtype)
            p[key] = torch.stack([hi, (p["h"] - hi.float()).to(hi.dtype)][:planes])
        h = p[key]

    def run():
        launch.launch_expand(p["y"], h, p["B"], p["widths"], p["rank"], *p["meta"], cfg)
    return run


def fused_runner(p, cfg, expand_cfg=None):
    from lora_ops import launch

    def run():
        launch.launch_fused(p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"], cfg)
    return run


def stacked_runner(p, cfg, expand_cfg=None):
    """The stacked layer as launch.lora_linear_stacked runs it: the GEMM over [W; A] (and the padding rows
    LoRALinear would add: configs.stack_pad_rows; precision.stacked_gemm takes this count's), then the expand
    with ``cfg`` (its PDL as there). The GEMM's time is the same for every candidate."""
    from lora_ops import launch
    from lora_ops.layers import stacked_weight
    from lora_ops.precision import stacked_gemm
    N, rows = p["B"].shape[1], p["A"].numel() // p["x"].shape[1]
    if "Wst" not in p:
        x = p["x"]
        p["Wst"] = stacked_weight(base_weight(N, x.shape[1], x.device, x.dtype, seed=7), p["A"])
    pdl = launch.stacked_uses_pdl(p["x"])

    def run():
        out = p["stacked_out"] = stacked_gemm(p["x"], p["Wst"], None, N, rows)
        launch.launch_expand_stacked(out, N, p["B"], p["widths"], p["rank"], p["scale"], *p["meta"], cfg, pdl=pdl)
    return run


def store_runner(p, cfg, expand_cfg=None):
    """lora_linear's write-first delta (launch.writes_first) as it runs: the shrink with the config add_lora_
    resolves for the shape, then the expand with ``cfg`` in its store mode (y = the delta, never read), PDL
    as add_lora_ takes it."""
    from lora_ops import configs, launch
    x, A = p["x"], p["A"]
    (M, K), (L, S, R, _) = x.shape, A.shape
    shrink_cfg = configs.shrink_config(M, K, S, R, L, x.device, x.dtype, out_features=p["y"].shape[1])
    h = launch.shrink_buffer(x, A, shrink_cfg, cfg)
    pdl = launch.uses_pdl(x)

    def run():
        launch.launch_shrink_expand(p["y"], x, A, p["B"], p["scale"], p["rank"], p["widths"], *p["meta"], h,
                                    shrink_cfg, cfg, pdl=pdl, accumulate=False)
    return run


RUNNERS = {"shrink": shrink_runner, "expand": expand_runner, "fused": fused_runner, "stacked": stacked_runner,
           "store": store_runner}


def time_config(kind, problems, cfg, expand_cfg=None, check=True):
    """µs per launch of `cfg` on `problems` (copies), or None if it does not compile or run, or (``check``)
    if its output on the first copy is wrong (:func:`passes_check`). A shrink given ``expand_cfg`` is
    timed with that expand after it (shrink_runner)."""
    try:
        _keep_first_y(problems[0])   # before any run adds into it: the check's baseline
        if check and not passes_check(kind, problems, cfg, expand_cfg):
            return None
        fns = [RUNNERS[kind](p, cfg, expand_cfg) for p in problems]
        return graph_time_us(fns) if problems[0]["x"].is_cuda else wall_time_us(fns)
    except Exception:  # noqa: BLE001 — out of resources / compile failure: not a candidate
        if problems[0]["x"].is_cuda:
            torch.cuda.synchronize()
        return None


def passes_check(kind, problems, cfg, expand_cfg=None):
    """Whether ``cfg`` writes the right values on the first copy (check_candidate); if not, a line to stderr."""
    try:
        wrong = check_candidate(kind, problems[0], cfg, expand_cfg)
    except Exception as e:  # noqa: BLE001 — a config that cannot run is not a candidate either
        wrong = f"the check's run raised {type(e).__name__}"
    if wrong:
        sys.stderr.write(f"\nlora_ops.tune: {kind} {tuple(cfg)}"
                         + (f" before expand {tuple(expand_cfg)}" if expand_cfg else "")
                         + f": wrong result ({wrong}); not a candidate\n")
    return not wrong


# A candidate's output is checked on a problem's first copy (search: each one that times faster than all before it;
# time_config: before it is timed), because the compiler can get a config wrong that the shipped ones never exercised,
# and a table must never hold it. H200, session 20: its first real run dropped the rank-loop expand (64, 128, 32, 4
# warps, 3 stages) on Llama down r320 at 4096 tokens (3066 values off, by up to 187) and the table's own pair there
# (333 off): a race between an asynchronous wgmma and the registers it read (kernels.work.dot_t, since fixed). A check
# sees one run, so a race can pass it; the grids' runs and benchmarks/race_sweep.py repeat them. An element fails
# where it is off its exact value (full-precision float32 references: _reference) by more than CHECK_ULPS rounding
# steps of the output's dtype (at least 2^-10: float32 sums differ by order), relative to that value plus the delta's
# RMS (rounded h, partial sums); NaN or inf fails. A right kernel stays within one or two steps; a wrong row, tile or
# garbage is off by about the delta itself.
CHECK_ULPS = 4
CHECK_RUNS = 2          # runs of a candidate the check compares bit for bit (check_candidate)
CHECK_CHUNK = 1 << 24   # elements compared at a time: float64 temporaries stay bounded at any shape


def check_candidate(kind, p, cfg, expand_cfg=None):
    """None if CHECK_RUNS runs of ``cfg`` (``kind``'s runner) on problem ``p`` write the same bits and the
    right values, else a short reason. Runs that differ are a race (session 20: the rank loop's wgmma race
    wrote wrong values in some runs and not in others), whatever the values. y is reset first to its value
    before the tuner's first run on ``p`` (timing replays keep adding into it, which would loosen a check
    relative to y), and after. bf16 off a GPU is run but not judged: Triton's interpreter (the tuner's
    --dry-run) computes bf16 wrongly itself (DESIGN §6)."""
    run = RUNNERS[kind](p, cfg, expand_cfg)
    shrink_alone = kind == "shrink" and expand_cfg is None
    outs = [output_of_one_run(kind, p, run, shrink_alone) for _ in range(CHECK_RUNS)]
    differ = max(int((bits_of(o) != bits_of(outs[0])).sum()) for o in outs[1:]) if len(outs) > 1 else 0
    if differ:
        return f"{CHECK_RUNS} runs differ in up to {differ} of {outs[0].numel()} values (a race)"
    if not p["x"].is_cuda and p["x"].dtype == torch.bfloat16:
        return None
    out = outs[0]
    if shrink_alone:
        ref = _reference(p, "h")
        written = ref != 0   # slot -1 rows and columns past a slot's rank are never written
        return _mismatch(out[written], None, ref[written], 2 ** -10)
    delta = _reference(p, "expand" if kind == "expand" else "delta")
    if kind == "stacked":
        return _mismatch(out, _reference(p, "base"), delta)
    return _mismatch(out, None if kind == "store" else p["y_first"], delta)


def output_of_one_run(kind, p, run, shrink_alone):
    """A copy of what one run of a candidate writes (the shrink's h alone, the stacked layer's y columns, or
    y), each run from the same start: h poisoned with NaN, y as first seen (store: NaN: every row must be
    written); y is put back after."""
    if shrink_alone:
        p["h_shrink"].fill_(float("nan"))
        run()
        return p["h_shrink"].clone()
    _keep_first_y(p)
    p["y"].copy_(p["y_first"])
    if kind == "store":
        p["y"].fill_(float("nan"))
    run()
    out = (p["stacked_out"][:, :p["B"].shape[1]] if kind == "stacked" else p["y"]).clone()
    p["y"].copy_(p["y_first"])
    return out


def bits_of(t):
    """``t``'s bits as integers: runs compared bit for bit, NaN included."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _keep_first_y(p):
    """Keep y as it was before the tuner's first run on this copy (check_candidate resets y to it)."""
    if "y_first" not in p:
        p["y_first"] = p["y"].clone()


def allowed_error(exact, rms, eps):
    """How far a value may be off ``exact`` and pass the check: CHECK_ULPS rounding steps (``eps``, at least
    2^-10) relative to |exact| plus the delta's RMS (see above)."""
    return CHECK_ULPS * max(eps, 2 ** -10) * (exact.abs() + rms)


def off_mask(out, exact, rms, eps):
    """Where ``out`` is off ``exact`` (float64) by more than allowed_error; NaN and inf count as off. The one
    definition of a wrong value: the tuner's check, the benchmark's (problems.values_off), the labs and
    benchmarks/race_sweep.py all ask it."""
    return ~((out.double() - exact).abs() <= allowed_error(exact, rms, eps))


def _mismatch(out, base, delta, eps=None):
    """Why ``out`` is not base + delta (base None: zero) within allowed_error, or None."""
    eps = torch.finfo(out.dtype).eps if eps is None else eps
    out, delta = out.reshape(-1), delta.reshape(-1)
    base = None if base is None else base.reshape(-1)
    if not bool(torch.isfinite(out).all()):
        return f"{int((~torch.isfinite(out)).sum())} of {out.numel()} values not finite"
    rms = delta.double().pow(2).mean().sqrt() if delta.numel() else torch.zeros((), dtype=torch.float64)
    bad = torch.zeros((), dtype=torch.int64, device=out.device)
    worst = torch.zeros((), dtype=torch.float64, device=out.device)
    for i in range(0, out.numel(), CHECK_CHUNK):   # one host sync at the end, not one per chunk
        exact = delta[i:i + CHECK_CHUNK].double()
        if base is not None:
            exact = exact + base[i:i + CHECK_CHUNK].double()
        chunk = out[i:i + CHECK_CHUNK]
        bad += off_mask(chunk, exact, rms, eps).sum()
        worst = torch.maximum(worst, (chunk.double() - exact).abs().max())
    if int(bad):
        return f"{int(bad)} of {out.numel()} values off, by up to {float(worst):.3g} (delta RMS {float(rms):.3g})"
    return None


def _reference(p, what):
    """What a candidate's output is checked against, computed once per problem copy: "delta" (the LoRA
    delta of x), "expand" (p["h"] B^T: what the expand alone adds), "h" (the shrink's output), in float32
    at full precision (no TF32: errors ~1e-6 relative, far inside the check's 2^-10; float64 runs at 1/64
    of the rate on many GPUs, where the runtime autotune checks too); "base" (F.linear(x, W): the stacked
    GEMM's first columns, up to rounding)."""
    key = "ref_" + what
    if key not in p:
        from lora_ops import reference
        args = (p["rank"], p["slots"])
        zeros = torch.zeros(p["y"].shape, dtype=torch.float32, device=p["y"].device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            if what == "delta":
                value = reference.lora_forward_reference(zeros, p["x"], p["A"], p["B"], p["scale"], *args,
                                                         p["widths"], dtype=torch.float32)
            elif what == "expand":
                value = reference.expand_forward_reference(zeros, p["h"], p["B"], *args, p["widths"],
                                                           dtype=torch.float32)
            elif what == "h":
                value = reference.shrink_grouped_reference(p["x"], p["A"], p["scale"], *args, dtype=torch.float32)
            else:
                value = torch.nn.functional.linear(p["x"], p["Wst"][:p["B"].shape[1]])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        p[key] = value
    return p[key]


def search(kind, problems, candidates, expand_cfg=None):
    """(best config, its µs, {config: µs}) over the candidates that run; (None, inf, {}) if none does.
    A candidate is checked (passes_check) when it times faster than every one before it: so the best is
    always a checked one, at a few checks per search; a wrong one is dropped from the timings."""
    timings, best_us = {}, math.inf
    for cfg in candidates:
        us = time_config(kind, problems, cfg, expand_cfg, check=False)
        if us is None or (us < best_us and not passes_check(kind, problems, cfg, expand_cfg)):
            continue
        timings[cfg] = us
        best_us = min(best_us, us)
    if not timings:
        return None, math.inf, timings
    best = min(timings, key=timings.get)
    return best, timings[best], timings


# Shrink shapes (all but the split count) from a path's full search that are timed again, at every split
# count, before its expands streaming another count of column blocks (search_pair).
PAIR_RETIME_SHAPES = 4


def search_pair(problems, shrink_candidates, expand_timings, max_rank):
    """The fastest shrink + expand pair. Per expand path (kernels.expand: one rank block adds the shrink's
    split-K partial sums itself; the rank loop has the shrink sum them), the path's fastest expand is timed
    after every shrink candidate. An expand streaming another count of column blocks per program (n_loop)
    reads its tile's partial sums once for all of its blocks, so timed alone on one part it hides what it
    saves after a shrink of many splits: the path's fastest expand of each other count is timed after the
    PAIR_RETIME_SHAPES fastest shrink shapes of the full search, at every split count.
    Returns (shrink, pair µs, the shrink's timings, expand, expand µs)."""
    from lora_ops import launch
    fastest = {}   # (path, n_loop) -> the fastest expand
    for cfg, us in expand_timings.items():
        key = (launch.takes_partials(cfg, max_rank), cfg.n_loop)
        if key not in fastest or us < expand_timings[fastest[key]]:
            fastest[key] = cfg
    best = (None, math.inf, {}, None, math.inf)
    for path in {path for path, _ in fastest}:
        expands = sorted((cfg for (p, _), cfg in fastest.items() if p == path), key=expand_timings.get)
        shrinks = shrink_candidates
        for i, expand in enumerate(expands):
            shrink, pair_us, timings = search("shrink", problems, shrinks, expand)
            if pair_us < best[1]:
                best = (shrink, pair_us, timings, expand, expand_timings[expand])
            if i == 0:
                shapes = {c._replace(split_k=0) for c in sorted(timings, key=timings.get)[:PAIR_RETIME_SHAPES]}
                shrinks = [c for c in shrink_candidates if c._replace(split_k=0) in shapes]
    return best


def candidates_for(kind, bucket, features, max_rank, num_slices=1, num_slots=TUNE_SLOTS):
    if kind == "shrink":
        return list(shrink_candidates(bucket, features, max_rank, num_slices, num_slots))
    if kind == "expand":
        return list(expand_candidates(bucket, features, max_rank))
    if kind == "stacked":
        return list(stacked_candidates(bucket, features, max_rank))
    if kind == "store":
        return list(expand_candidates(bucket, features, max_rank))
    return list(fused_candidates(bucket, features, max_rank))


def split_widths(out_features, num_slices):
    widths = [out_features // num_slices] * (num_slices - 1)
    return widths + [out_features - sum(widths)]


def precompile(device, dtype, in_features, slice_widths, max_rank, num_slots, bucket, items):
    """Compile (and run once) each (kind, config) of `items` on one shape: fills Triton's on-disk cache, so
    worker processes can compile in parallel and the timing process only loads. Returns the count."""
    p = synthetic_problem(device, dtype, in_features, slice_widths, max_rank, num_slots, bucket)
    # Shrinks run as the tuner times them, before an expand of each path among the candidates: one that
    # adds their split-K partial sums (the shrink compiles to write them) and one that does not.
    if heuristics.rank_loops(max_rank) and bucket <= ONE_BLOCK_TUNE_MAX_BUCKET:
        pairs = [ExpandConfig(16, 64, heuristics.rank_block(max_rank), 4, 3),
                 ExpandConfig(16, 64, heuristics.one_block_rank(max_rank), 8, 2)]
    else:
        pairs = [heuristics.expand_config(bucket, sum(slice_widths), max_rank, num_slots)]
    done = 0
    for kind, cfg in items:
        try:
            for pair in pairs if kind == "shrink" else (None,):
                RUNNERS[kind](p, cfg, pair)()
            done += 1
        except Exception:  # noqa: BLE001 — the timing pass skips it too
            pass
    if p["x"].is_cuda:
        torch.cuda.synchronize()
    return done


def autotune(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features=None,
             fused_only=False):
    """The fastest config for one key, on synthetic problems of the bucket's token count. For "fused":
    the fastest one-launch config, or None when shrink + expand (each at its best) is faster. The expand
    is chosen by its own time (its key holds no input width to time pairs with), so above rank 64 its two
    code paths are compared without the shrink work each implies; the one-launch key and the offline
    tuner compare pairs (search_pair)."""
    from lora_ops import configs
    if kind == "shrink" and out_features:  # timed with the expand that adds its partial sums
        problems = problem_copies(device, dtype, features, split_widths(out_features, num_slices), max_rank,
                                  num_slots, bucket)
        expand_cfg = configs.expand_config(bucket, out_features, num_slices, max_rank, num_slots, device, dtype)
        return search(kind, problems, candidates_for(kind, bucket, features, max_rank, num_slices, num_slots),
                      expand_cfg)[0]
    if kind == "shrink":
        problems = problem_copies(device, dtype, features, [64] * num_slices, max_rank, num_slots, bucket)
    elif kind == "expand":
        problems = problem_copies(device, dtype, 64, split_widths(features, num_slices), max_rank, num_slots, bucket)
    elif kind in configs.EXPAND_MODES:   # features: the output's; out_features: the input's (configs.*_config)
        problems = problem_copies(device, dtype, out_features, split_widths(features, num_slices), max_rank,
                                  num_slots, bucket)
    else:
        problems = problem_copies(device, dtype, features, split_widths(out_features, num_slices), max_rank,
                                  num_slots, bucket)
    if kind != "fused":
        return search(kind, problems, candidates_for(kind, bucket, features, max_rank, num_slices, num_slots))[0]
    best, fused_us, _ = search("fused", problems, candidates_for("fused", bucket, features, max_rank))
    if fused_only or best is None:
        return best
    _, _, expand_timings = search("expand", problems, candidates_for("expand", bucket, out_features, max_rank))
    _, pair_us, _, _, _ = search_pair(problems, candidates_for("shrink", bucket, features, max_rank, num_slices,
                                                               num_slots), expand_timings, max_rank)
    return best if fused_us < pair_us else None
