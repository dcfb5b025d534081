"""How the benchmark times things: CUDA-graph replay medians, eager host time, and the machine's ceilings.

GPU method (one place, documented in benchmarks/README.md):
  * A call list of n_calls calls (2-20, enough for ~1 ms of work) is captured in one CUDA graph.
    The calls rotate over n_sets independent input sets (x, y, adapter weights, or x and W for the base
    layer), as many as memory allows up to n_calls, so within a replay no call finds its data in L2.
  * Before every replay the L2 cache is flushed by writing a buffer of max(256 MiB, 4x L2), OUTSIDE
    the timed region: the start event is recorded after the flush on the same stream, and the graph
    is launched while the flush still runs, so neither the flush nor the launch latency is timed.
  * Time per call = (end - start) / n_calls; the reported number is the median over the repeats.
  This is a cold-cache number: in a model, the other layers evict this layer's weights between two
  of its calls. ``cache="hot"`` (one input set, no flush) gives the warm-cache number instead.
  * Eager: from Python, n back-to-back calls (no graph) between two synchronisations, divided by n:
    host overhead per call when it dominates, GPU time when that does.

CPU (--device cpu, a logic check only): "graph" time is a plain loop of the same calls.
"""
import contextlib
import math
import statistics
import time

import torch

MIB = 1 << 20
TARGET_REPLAY_US = 1000.0     # work per replay: amortises event resolution and the replay's own start
REPLAY_BUDGET_US = 200_000.0  # replays of one implementation on one row stop near this much GPU time
EAGER_BUDGET_US = 50_000.0
ROTATE_BYTES = 2 * 1024 * MIB  # most memory one implementation's input sets may take on one row


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


def paired_delta(runs, name, base):
    """Median over rounds of runs[name][i] - runs[base][i] (:meth:`Timer.measure_paired`'s rounds)."""
    return statistics.median(a - b for a, b in zip(runs[name], runs[base]))


class Timer:
    """Times calls on one device; see the module docstring for the method."""

    def __init__(self, device, cache="cold"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cold = cache == "cold"
        if self.cuda:
            self.min_calls, self.max_calls, self.min_repeats, self.max_repeats = 2, 20, 5, 30
            self.min_eager, self.max_eager = 10, 200
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * MIB)
            self._flush_buf = torch.empty(max(256 * MIB, 4 * self.l2_bytes), dtype=torch.uint8, device=self.device)
        else:
            self.min_calls, self.max_calls, self.min_repeats, self.max_repeats = 1, 2, 2, 3
            self.min_eager, self.max_eager = 2, 4
            self.l2_bytes = 0
            self._flush_buf = None

    def method(self):
        if not self.cuda:
            return "cpu: plain loops (logic check only, not a measurement)"
        if self.cold:
            return (f"CUDA-graph replay medians, inputs rotated over up to {self.max_calls} sets, L2 flushed "
                    f"({self._flush_buf.numel() // MIB} MiB write) before each replay outside the timed region; "
                    f"the base layer and whole-layer variants replayed in turn, round by round, their deltas the "
                    f"medians of per-round differences")
        return "CUDA-graph replay medians, one input set, no L2 flush (warm cache)"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def sync_quietly(self):
        """After a failed launch or capture: wait for the device, ignoring an error it reports again."""
        try:
            self.sync()
        except Exception:
            pass

    def flush(self):
        if self._flush_buf is not None and self.cold:
            self._flush_buf.zero_()

    # --- building blocks

    def span_us(self, fn, n=1):
        """Wall time of fn() n times in a row, on the device (events) or the host, per call."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n

    def warm_up(self, calls):
        """Run each call once on a side stream (JIT compiles, autotuning, lazy caches) before a capture."""
        if not self.cuda:
            for c in calls:
                c()
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()

    def capture(self, calls):
        """A replay function for the call list: a CUDA graph on the GPU, a plain loop on the CPU."""
        self.warm_up(calls)
        if not self.cuda:
            def loop():
                for c in calls:
                    c()
            return loop
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        self.sync()

        def replay():  # the closure keeps the graph (and its memory pool) alive as long as it is used
            graph.replay()
        return replay

    def round_times_us(self, replays, rounds):
        """{name: [µs per call, one per round]} for ``replays`` = {name: (replay, calls per replay)}: each
        round replays every graph once, in turn, each after its own L2 flush (one name: plain repeats)."""
        for replay, _ in replays.values():
            replay()  # the first replay uploads the graph
        self.sync()
        runs = {name: [] for name in replays}
        if not self.cuda:
            for _ in range(rounds):
                for name, (replay, n_calls) in replays.items():
                    runs[name].append(self.span_us(replay) / n_calls)
            return runs
        events = []
        for _ in range(rounds):
            for name, (replay, n_calls) in replays.items():
                self.flush()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                replay()
                end.record()
                events.append((name, n_calls, start, end))
        self.sync()
        for name, n_calls, start, end in events:
            runs[name].append(start.elapsed_time(end) * 1e3 / n_calls)
        return runs

    def eager_us(self, calls, n):
        self.sync()
        t0 = time.perf_counter()
        for i in range(n):
            calls[i % len(calls)]()
        self.sync()
        return (time.perf_counter() - t0) * 1e6 / n

    # --- the one entry point the benchmark uses

    def measure(self, make_call, set_bytes, eager=True):
        """(graph µs per call, eager µs per call or None, details) for the calls make_call(k) builds.

        make_call(k) returns a no-argument callable working on input set k (k = 0, 1, ...); set_bytes is
        the memory one set takes, which bounds how many sets are made.
        """
        (replay, n_calls, sets), per_replay = self._capture_sets(make_call, set_bytes)
        repeats = int(_clamp(REPLAY_BUDGET_US // per_replay, self.min_repeats, self.max_repeats))
        graph_us = statistics.median(self.round_times_us({0: (replay, n_calls)}, repeats)[0])
        del replay
        eager_us = None
        if eager:
            n = int(_clamp(EAGER_BUDGET_US // (per_replay / n_calls), self.min_eager, self.max_eager))
            eager_us = self.eager_us(sets, n)
        return graph_us, eager_us, dict(n_calls=n_calls, n_sets=len(sets), repeats=repeats)

    def measure_paired(self, make_calls, set_bytes, prepare=None):
        """Several implementations timed interleaved: ({name: graph µs per call}, {name: [µs per round]}).

        make_calls: {name: make_call(k)} as for :meth:`measure`; set_bytes: {name: bytes of one set}. Each
        is captured as in :meth:`measure`; then every round replays each graph once, in turn, each after
        its own L2 flush. A GPU's clock follows its power and temperature: a long GEMM timed after a run
        of other long GEMMs can be several % slower than the same GEMM timed after light work, which is
        as large as a LoRA delta at large M. Timed in turn, each round's implementations share the state,
        so per-round differences (``paired_delta``) measure the delta, not the drift.
        prepare: {name: a context manager factory} under which that implementation is built, warmed up and
        captured (a config choice; a graph keeps what was captured, so its replays need no context).
        """
        replays, per_call = {}, {}
        for name, make_call in make_calls.items():
            with (prepare or {}).get(name, contextlib.nullcontext)():
                replays[name], per_call[name] = self._capture_sets(make_call, set_bytes[name])
        rounds = int(_clamp(REPLAY_BUDGET_US // sum(per_call.values()), self.min_repeats, self.max_repeats))
        runs = self.round_times_us({name: (replay, n_calls) for name, (replay, n_calls, _) in replays.items()},
                                   rounds)
        del replays
        return {name: statistics.median(t) for name, t in runs.items()}, runs

    def _capture_sets(self, make_call, set_bytes):
        """((replay, calls per replay, the calls), estimated µs per replay) as :meth:`measure` captures."""
        first = make_call(0)
        first()  # compile
        est = max(self.span_us(first, n=2 if self.cuda else 1), 1.0)
        n_calls = int(_clamp(math.ceil(TARGET_REPLAY_US / est), self.min_calls, self.max_calls))
        n_sets = 1
        if self.cold and self.cuda:
            n_sets = int(_clamp(ROTATE_BYTES // max(set_bytes, 1), 1, n_calls))
        sets = [first] + [make_call(k) for k in range(1, n_sets)]
        # The calls stay referenced while their graph lives: a graph replays into the memory its calls'
        # closures hold (scratch made outside the capture), which must not be freed and reused.
        return (self.capture([sets[i % n_sets] for i in range(n_calls)]), n_calls, sets), est * n_calls

    # --- ceilings measured in the same run

    def copy_bandwidth(self):
        """Bytes read + written per second by a large device-to-device copy (median of 10)."""
        nbytes = (1024 if self.cuda else 64) * MIB
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = [self.span_us(lambda: dst.copy_(src)) for _ in range(10 if self.cuda else 3)]
        return 2 * nbytes / (statistics.median(times) * 1e-6)

    def matmul_rate(self, dtype):
        """FLOP/s of one large square matmul in dtype (median of 5)."""
        n = 8192 if self.cuda else 256
        a = torch.randn(n, n, device=self.device, dtype=dtype)
        b = torch.randn(n, n, device=self.device, dtype=dtype)
        a @ b
        times = [self.span_us(lambda: a @ b) for _ in range(5 if self.cuda else 2)]
        return 2 * n ** 3 / (statistics.median(times) * 1e-6)
