"""Lab (session 28): the batch metadata fill, the torch path (about a dozen small launches: argsort, scatter_add,
cumsum, ...) against the one-launch kernel (lora_ops.kernels.batch, the GPU default: batch.set_one_launch_fill).

Per slot count L and token count M (random slots in [-1, L), int32, on the device), LoRABatch.update by each
path:
    same        the two paths' metadata equal (counts, starts, the first M token ids)
    host µs     enqueue time alone (host_overhead.enqueue_us_per_call: 50 calls from an idle GPU), median of
                7 rounds, the paths in turn
    GPU µs      one update captured in a CUDA graph, the median of 200 replays (event-timed)
    set_batch   LoRAContext.set_batch host µs alone (as host µs; under no_grad), what a server calls: the
                requests (one token each up to 256 tokens, else 8 requests; every L+1-th without an adapter)
                to per-token slots on the host, the pinned copy, the fill

A server calls set_batch once a step, outside its CUDA graph: both columns are on its critical path.

    python benchmarks/lab_batch_fill.py                          # on a GPU (writes to $OUT or benchmarks/results)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_batch_fill.py   # logic check: tiny shapes, no timing
"""
import datetime
import os
import statistics

import torch

from repo_path import HERE  # noqa: E402  (first: this checkout's lora_ops)

import report  # noqa: E402
from host_overhead import enqueue_us_per_call  # noqa: E402
from timing import Timer  # noqa: E402
from lora_ops import batch as batch_module  # noqa: E402
from lora_ops import launch_batch, ops  # noqa: E402
from lora_ops.batch import LoRABatch  # noqa: E402
from lora_ops.layers import LoRAContext  # noqa: E402

DEV = torch.device(os.environ.get("DEV", "cuda"))
CUDA = DEV.type == "cuda"
SLOTS = (4, 16, 64) if CUDA else (3,)
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 32768) if CUDA else (1, 37)
ROUNDS = 7


def graph_us(fn):
    """Median µs of 200 replays of a CUDA graph holding one call of ``fn``."""
    replay = Timer(DEV).capture([fn])
    times = []
    for _ in range(200):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def update_with(one_launch, batch, slots):
    def fn():
        batch_module.set_one_launch_fill(one_launch)
        batch.update(slots)
    return fn


def set_batch_with(one_launch, L, M):
    """A call of LoRAContext.set_batch on M tokens over L adapters, by the chosen fill (under no_grad)."""
    ctx = LoRAContext(L, M, device=DEV)
    ctx.slot_names = [f"adapter{i}" for i in range(L)]
    sizes = [1] * M if M <= 256 else [M // 8] * 7 + [M - 7 * (M // 8)]
    requests = [(None if i % (L + 1) == L else f"adapter{i % (L + 1)}", n) for i, n in enumerate(sizes)]

    def fn():
        batch_module.set_one_launch_fill(one_launch)
        with torch.no_grad():
            ctx.set_batch(requests)
    return fn


def row(L, M, gen):
    slots = torch.randint(-1, L, (M,), generator=gen, dtype=torch.int32).to(DEV)
    batches = {path: LoRABatch(max(M, 1), L, device=DEV) for path in ("torch", "one_launch")}
    calls = {path: update_with(path == "one_launch", batches[path], slots) for path in batches}
    for fn in calls.values():
        fn()
    same = all(torch.equal(a[:M] if name == "sorted_token_ids" else a, b[:M] if name == "sorted_token_ids" else b)
               for name, a, b in zip(batches["torch"].meta._fields, batches["torch"].meta, batches["one_launch"].meta))
    out = dict(slots=L, tokens=M, same=same)
    if CUDA:
        set_batch = {path: set_batch_with(path == "one_launch", L, M) for path in calls}
        host = {(kind, path): [] for kind in ("update", "set_batch") for path in calls}
        for _ in range(ROUNDS):
            for path in calls:
                host[("update", path)].append(enqueue_us_per_call(calls[path], DEV))
                host[("set_batch", path)].append(enqueue_us_per_call(set_batch[path], DEV))
        for path, fn in calls.items():
            out[f"{path}_host_us"] = round(statistics.median(host[("update", path)]), 2)
            out[f"{path}_set_batch_us"] = round(statistics.median(host[("set_batch", path)]), 2)
            batch_module.set_one_launch_fill(path == "one_launch")
            try:
                out[f"{path}_gpu_us"] = round(graph_us(lambda b=batches[path]: b.update(slots)), 2)
            except RuntimeError as e:      # (a path that cannot be captured: its GPU column stays empty)
                print(f"L {L} M {M} {path}: not captured: {e}", flush=True)
    return out


def main():
    if not CUDA:
        ops.set_cpu_backend("triton")
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for L in SLOTS:
            for M in TOKENS:
                if launch_batch.fits(M, L):
                    rows.append(row(L, M, gen))
                    print(rows[-1], flush=True)
    finally:
        batch_module.set_one_launch_fill(None)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name(DEV) if CUDA else "cpu"
    lines = [f"# Batch metadata fill: torch path against one launch ({gpu}, torch {torch.__version__}, Triton "
             f"{__import__('triton').__version__}, {date})", "",
             "LoRABatch.update on random int32 slots in [-1, L) on the device; host µs: enqueue time alone (50 calls "
             "from an idle GPU, median of 7 rounds, paths in turn); GPU µs: one update in a CUDA graph, median of "
             "200 replays; set_batch µs: LoRAContext.set_batch's host time alone (requests to slots on the host, "
             "the pinned copy, the fill; under no_grad).", "",
             "| L | M | same | torch host µs | one launch host µs | torch GPU µs | one launch GPU µs | "
             "torch set_batch µs | one launch set_batch µs |",
             "|---|---|---|---|---|---|---|---|---|"]
    columns = ("torch_host_us", "one_launch_host_us", "torch_gpu_us", "one_launch_gpu_us", "torch_set_batch_us",
               "one_launch_set_batch_us")
    lines += [f"| {r['slots']} | {r['tokens']} | {'yes' if r['same'] else 'NO'} | "
              + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if CUDA:
        report.write_run_files(os.environ.get("OUT") or os.path.join(HERE, "results"), "lab_batch_fill",
                               {"gpu": gpu, "date": date, "torch": torch.__version__, "rows": rows}, text)
    assert all(r["same"] for r in rows), "the two paths' metadata differ"


if __name__ == "__main__":
    main()
