"""Launch plans: an op's host work done once per shape, replayed on every later call.

What an op decides before it launches (for add_lora_: one launch or two, the configs, the grids, the
integer arguments, the constexprs, the scratch buffers, the compiled kernels Triton chose) is a function of
the arguments' shapes, strides, dtype and device, of the current CUDA device and of the config state
(lora_ops.configs.generation), never of tensor data. :func:`op_key` names those for any op; add_lora_, the
eager decode path, has its own :func:`key` that reads only what its launches use. A :class:`Plan` keeps the
launches of the first call with a key. A later call with the key allocates the scratch (or takes it from
the stream's workspace, below), takes the addresses of its tensors and calls the compiled kernels' C
launchers: no config lookup, no grid, no argument tuple, no Triton key. In eager mode that is most of
add_lora_'s host time (DESIGN §4).

A plan is only remembered when it can be replayed exactly:
- every tensor a launch takes is one of the call's tensors or a scratch buffer the plan allocates, and the
  call's tensors are distinct objects (so the position of each is its role);
- the first call's tensors were all 16-byte aligned, so the compiled kernels assume what Triton assumes
  for aligned pointers; a later call with a misaligned tensor takes the FastLauncher path instead;
- not during CUDA-graph capture (a config resolved then may be a stand-in; see lora_ops.configs).
Replays bypass the shortcut (Triton's own path per launch, through FastLauncher) where it is off: under
the interpreter, with a launch hook set, or after ``triton_launch.set_fast_launch(False)`` (which changes
the key).

An op that never hands its scratch to its caller (add_lora_ and lora_linear's write-first delta: h and the
split-K partial sums) takes it, on the fast replay, from one workspace per stream and host thread instead of
the caching allocator (:data:`WORKSPACE_BYTES`). That is safe because a stream runs our launches in order: a kernel
launched with PDL waits (``gdc_wait``) for the kernel before it to finish before it writes anything, so a
call's scratch is dead once the next call's first kernel writes. Not while a CUDA graph is captured (a graph
keeps addresses; its scratch comes from its own pool), and not for scratch that must start zeroed.
"""
import contextlib
import functools
import operator
import threading

import torch

from lora_ops import configs, triton_launch

MAX_PLANS = 4096      # the key holds the token count: bound the table as FastLauncher does
_PLANS = {}
_enabled = [True]
_epoch = [0]          # bumped whenever plans are dropped: what holds a Plan outside the table checks it
# Per stream (a few per process), kept for the process's life: never freed while a launch may use it. Scratch
# of up to this many bytes per call comes from it (add_lora_'s h at decode: 24 KiB for Llama qkv, rank 16, 64
# tokens, 8 split-K parts); torch.empty cost 5.3 µs of host time a call on the H200 host (session 18), a
# fifth of add_lora_'s plan replay. Larger scratch goes with kernels long enough to hide the allocation.
WORKSPACE_BYTES = 1 << 20
_WORKSPACE_ALIGN = 256
_WORKSPACES = {}      # (device index, raw stream, host thread) -> uint8 tensor of WORKSPACE_BYTES
# Workspaces at most (1 MiB each, kept for the process's life): past them a call allocates its scratch.
MAX_WORKSPACES = 64
_RECORDERS = []       # the lists recording() hands out: each plan run appends (plan or None, tensors)


def set_enabled(on):
    """Keep and replay plans (default), or resolve every call's launches afresh (benchmarks compare)."""
    _enabled[0] = bool(on)
    clear()


def launch_device(x):
    """The CUDA device Triton launches on (the current one, as in its own path); -1 for CPU tensors."""
    return triton_launch._current_device() if x.is_cuda else -1


def key(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """Everything add_lora_'s launches derive from (given that its checks passed on these arguments)."""
    return (x.shape, x.stride(), y.shape[1], y.stride(), lora_a.shape, lora_a.stride(), lora_b.stride(),
            tuple(slice_widths), sorted_token_ids.shape[0],
            strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts), x.dtype, y.dtype, launch_device(x),
            configs.generation(), triton_launch.switches())


def strides_1d(*tensors):
    """The strides of 1-D tensors (per-slot values, batch metadata): the kernels' stride_scale .. stride_counts
    arguments, and a key's part for them (their dtypes and lengths being fixed by the checks). Stride 1, the
    usual value, is specialised by Triton."""
    return tuple([t.stride(0) for t in tensors])


def op_key(name, shaped, *values):
    """The key of op ``name`` whose launches derive from the shapes, strides and dtypes of the tensors
    ``shaped`` and from ``values`` (given that the op's checks passed)."""
    return (name, *[(t.shape, t.stride(), t.dtype) for t in shaped], *values, launch_device(shaped[0]),
            configs.generation(), triton_launch.switches())


def lookup(plan_key):
    return _PLANS.get(plan_key)


def clear():
    _PLANS.clear()
    _epoch[0] += 1


def epoch():
    """How many times the plans were dropped (lora_ops.eager keeps plans and compares it)."""
    return _epoch[0]


def _aligned(pointers):
    return not functools.reduce(operator.or_, pointers) & 15


def workspace_layout(specs):
    """Byte offsets in a stream's workspace for the scratch ``specs`` of an op that keeps its scratch to
    itself, or None where they do not all fit or one must start zeroed (those are allocated every call)."""
    offsets, end = [], 0
    for spec in specs:
        if spec.zero:
            return None
        offsets.append(end)
        nbytes = spec.dtype.itemsize * functools.reduce(operator.mul, spec.shape, 1)
        end += -(-nbytes // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    return tuple(offsets) if offsets and end <= WORKSPACE_BYTES else None


def _capturing(x):
    """Whether a CUDA graph is being captured on the current stream (CPU tensors: never)."""
    return x.is_cuda and triton_launch.capturing()


def workspace_address(device_index, stream, device):
    """The address of this host thread's workspace on ``stream`` (a raw handle: the default stream's is 0 on
    every device) on the device of index ``device_index``, ``device`` as a torch.device; allocated on first
    use; None once :data:`MAX_WORKSPACES` exist (the caller allocates). Per thread: two threads enqueueing on
    one stream interleave their launches (shrink A, shrink B, expand A), and one workspace between them had
    expand A read B's h (a static review). A thread's ident may be reused after it ends; its launches were
    enqueued before the new thread's, on the same stream."""
    key = (device_index, stream, threading.get_ident())
    ws = _WORKSPACES.get(key)
    if ws is None:
        if len(_WORKSPACES) >= MAX_WORKSPACES:
            return None
        ws = _WORKSPACES[key] = _outside_graph_pools(WORKSPACE_BYTES, device)
    return ws.data_ptr()


def _outside_graph_pools(nbytes, device):
    """A buffer kept for the process's life, from the caching allocator's ordinary memory. torch.compile's CUDA
    graphs (mode="reduce-overhead") send every allocation of the thread that warms a graph up into the graph's
    private pool (torch._inductor.cudagraph_trees: ``_cuda_beginAllocateCurrentThreadToPool``), and a buffer
    of that pool still alive after the warm-up fails their check ("tensor(s) in the cudagraph pool not tracked
    as outputs"). Allocations of another thread are not sent there."""
    made = []
    thread = threading.Thread(target=lambda: made.append(torch.empty(nbytes, dtype=torch.uint8, device=device)))
    thread.start()
    thread.join()
    if not made:    # (the thread's allocation raised, out of memory say: raise it here)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return made[0]


class _Step:
    """One launch of a plan: which pool entries are its pointers, and how to launch it both ways."""
    __slots__ = ("launch", "pick", "go")

    def __init__(self, launch, pick, go):
        self.launch, self.pick, self.go = launch, pick, go


class Plan:
    """The launches of one op call, replayable with the tensors of another call of the same key.

    The pool is the call's tensors (in the order the op lists them) followed by the scratch buffers."""

    def __init__(self, steps, scratch, device, workspace=None):
        self.steps = steps
        self.scratch = scratch
        self.device = device       # launch_device when built (it is in the key)
        self.fast = all(step.go is not None for step in steps)
        self.workspace = workspace if self.fast else None   # workspace_layout's offsets, or None

    def _allocate(self, device):
        return tuple([s.alloc(device) for s in self.scratch])

    def run(self, tensors):
        """Launch with ``tensors``; returns this call's scratch buffers (an op's outputs among them; empty
        where they came from the workspace)."""
        if self.fast and not triton_launch._hooks_set():
            stream = triton_launch._current_stream(self.device)
            pointers = [t.data_ptr() for t in tensors]
            if _aligned(pointers):
                scratch = ()
                x = tensors[0]
                base = (workspace_address(self.device, stream, x.device)
                        if self.workspace is not None and not _capturing(x) else None)
                if base is not None:
                    pointers += [base + offset for offset in self.workspace]
                else:
                    scratch = self._allocate(x.device)
                    pointers += [t.data_ptr() for t in scratch]
                for step in self.steps:
                    step.go(stream, step.pick(pointers))
                    step.launch.launcher.hits += 1
                return scratch
        scratch = self._allocate(tensors[0].device)
        pool = tensors + scratch
        for step in self.steps:
            launch = step.launch
            launch.launcher(launch.grid, step.pick(pool), launch.ints, **launch.constexprs)
        return scratch


def run(plan_key, tensors, build, scratch_out=True):
    """One op call: ``tensors`` (a tuple) through the plan of ``plan_key``; for a new key, through the
    launches ``build()`` returns as ``(launches, scratch specs, scratch buffers)``, which run and become
    the key's plan if they can (see :func:`remember`). Returns the call's scratch buffers.
    ``scratch_out=False``: the op never hands its scratch to its caller, so replays may take it from the
    stream's workspace (and return none)."""
    known = _PLANS.get(plan_key)
    if known is not None:
        if _RECORDERS:
            _RECORDERS[-1].append((known, tensors))
        return known.run(tensors)
    launches, scratch, buffers = build()
    for launch in launches:
        launch()
    kept = remember(plan_key, launches, tensors, scratch, buffers, scratch_out) if _enabled[0] else None
    if _RECORDERS:
        _RECORDERS[-1].append((kept, tensors))
    return buffers


@contextlib.contextmanager
def recording():
    """Within it, every op call's :func:`run` appends to the list it yields ``(plan, tensors)``: the plan it
    ran or kept (None where none was kept) and the call's tensors, in launch order (lora_ops.autograd binds
    a backward's op calls to their plans this way)."""
    calls = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.pop()


def remember(plan_key, launches, tensors, scratch, buffers, scratch_out=True):
    """Keep a plan for ``plan_key`` if ``launches`` (already run, on ``tensors`` and the scratch
    ``buffers`` allocated from the specs ``scratch``) can be replayed exactly (see the module docstring);
    ``scratch_out`` as in :func:`run`. Returns the plan, or None."""
    pool = tuple(tensors) + tuple(buffers)
    position = {id(t): i for i, t in enumerate(pool)}
    if len(position) != len(pool) or not _aligned([t.data_ptr() for t in tensors]):
        return None
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    steps = []
    for launch in launches:
        where = [position.get(id(t)) for t in launch.tensors]
        if None in where:
            return None
        go = launch.launcher.bound(launch.grid, launch.tensors, launch.ints, launch.constexprs)
        steps.append(_Step(launch._replace(tensors=None), operator.itemgetter(*where), go))
    if len(_PLANS) >= MAX_PLANS:
        clear()
    workspace = None if scratch_out else workspace_layout(scratch)
    plan = _PLANS[plan_key] = Plan(steps, tuple(scratch), launch_device(tensors[0]), workspace)
    return plan
