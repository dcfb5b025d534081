"""Timing kernel configs on the GPU: the candidate spaces, the timer, and the search used by both the
offline tuner (``python -m lora_ops.tune``) and the opt-in runtime autotune.

Each candidate is timed as CUDA-graph replays of a run of launches on a synthetic batch of the key's
shapes (``num_slots`` adapters sharing the tokens, about 10% with no adapter, shuffled); the median
per launch counts. Candidates that fail to compile or exceed the GPU's resources are skipped.
"""
import itertools

import torch

from lora_ops.batch import LoRABatch
from lora_ops.configs import heuristics
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig, cdiv

TUNE_SLOTS = 4


def _block_ms(bucket):
    """Token tiles around the heuristic's: half, same, double (16..128)."""
    bm = heuristics.block_m_for(bucket)
    return sorted({max(16, bm // 2), bm, min(128, bm * 2)})


def shrink_candidates(bucket, in_features, max_rank, num_slices=1, num_slots=TUNE_SLOTS):
    # split_k is a run-time argument (no recompile), so it is searched widely; the other knobs compile.
    br = heuristics.rank_block(max_rank)
    groups = sorted({1, heuristics.slice_group_for(num_slices, br), heuristics.next_power_of_2(num_slices)})
    for bm, bk, group in itertools.product(_block_ms(bucket), (64, 128, 256), groups):
        if group * br > 256:
            continue
        programs = cdiv(num_slices, group) * cdiv(max_rank, br) * heuristics.max_token_tiles(bucket, num_slots, bm)
        base = max(1, heuristics.TARGET_PROGRAMS // programs)
        for sk in sorted({1, max(1, base // 4), max(1, base // 2), base, base * 2}):
            if sk > min(32, cdiv(in_features, bk)):
                continue
            for warps, stages in ((4, 2), (4, 3), (8, 3)):
                yield ShrinkConfig(bm, br, bk, sk, warps, stages, group)


def expand_candidates(bucket, out_features, max_rank):
    for bm, bn in itertools.product(_block_ms(bucket), (64, 128, 256)):
        for warps, stages in ((4, 2), (8, 2), (4, 3)):
            yield ExpandConfig(bm, bn, heuristics.rank_block(max_rank), warps, stages)


def synthetic_problem(device, dtype, in_features, slice_widths, max_rank, num_slots, num_tokens, seed=0):
    """Random signed inputs of the given shapes and a batch of `num_slots` adapters, ~10% no adapter."""
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
    batch = LoRABatch(num_tokens, num_slots, device)
    batch.update(slots)
    h = torch.randn(num_tokens, S, max_rank, generator=g, device=device)
    return dict(x=x, A=A, B=B, y=y, scale=scale, rank=rank, meta=batch.meta, h=h, widths=list(slice_widths))


def graph_time_us(fn, launches=10, replays=5):
    """Median µs per call of `fn`, from CUDA-graph replays of `launches` calls (fn warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return sorted(times)[len(times) // 2]


def shrink_runner(p, cfg):
    from lora_ops import launch
    h = torch.empty(p["x"].shape[0], p["A"].shape[1], p["A"].shape[2], dtype=torch.float32, device=p["x"].device)

    def run():
        launch.launch_shrink(p["x"], p["A"], p["scale"], p["rank"], *p["meta"], h, cfg)
    return run


def expand_runner(p, cfg):
    from lora_ops import launch

    def run():
        launch.launch_expand(p["y"], p["h"], p["B"], p["widths"], p["rank"], *p["meta"], cfg)
    return run


def search(kind, problem, candidates):
    """(best config, its µs, {config: µs}) over the candidates that run."""
    runner = shrink_runner if kind == "shrink" else expand_runner
    timings = {}
    for cfg in candidates:
        try:
            timings[cfg] = graph_time_us(runner(problem, cfg))
        except Exception:  # noqa: BLE001 — out of resources / compile failure: not a candidate
            torch.cuda.synchronize()
            continue
    best = min(timings, key=timings.get)
    return best, timings[best], timings


def candidates_for(kind, bucket, features, max_rank, num_slices=1, num_slots=TUNE_SLOTS):
    if kind == "shrink":
        return shrink_candidates(bucket, features, max_rank, num_slices, num_slots)
    return expand_candidates(bucket, features, max_rank)


def autotune(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket):
    """The fastest config for one key, on a synthetic problem of the bucket's token count."""
    if kind == "shrink":
        problem = synthetic_problem(device, dtype, features, [64] * num_slices, max_rank, num_slots, bucket)
    else:
        widths = [features // num_slices] * (num_slices - 1)
        widths.append(features - sum(widths))
        problem = synthetic_problem(device, dtype, 64, widths, max_rank, num_slots, bucket)
    best, _, _ = search(kind, problem, candidates_for(kind, bucket, features, max_rank, num_slices, num_slots))
    return best
