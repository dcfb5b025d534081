"""Launch plans: an op's host work done once per shape, replayed on every later call.

What an op decides before it launches (for add_lora_: one launch or two, the configs, the grids, the
integer arguments, the constexprs, the scratch buffers, the compiled kernels Triton chose) is a function of
the arguments' shapes, strides, dtype and device, of the current CUDA device and of the config state
(lora_ops.configs.generation), never of tensor data. :func:`op_key` names those for any op; add_lora_, the
eager decode path, has its own :func:`key` that reads only what its launches use. A :class:`Plan` keeps the
launches of the first call with a key. A later call with the key allocates the scratch, takes the
addresses of its tensors and calls the compiled kernels' C launchers: no config lookup, no grid, no
argument tuple, no Triton key. In eager mode that is most of add_lora_'s host time (DESIGN §4).

A plan is only remembered when it can be replayed exactly:
- every tensor a launch takes is one of the call's tensors or a scratch buffer the plan allocates, and the
  call's tensors are distinct objects (so the position of each is its role);
- the first call's tensors were all 16-byte aligned, so the compiled kernels assume what Triton assumes
  for aligned pointers; a later call with a misaligned tensor takes the FastLauncher path instead;
- not during CUDA-graph capture (a config resolved then may be a stand-in; see lora_ops.configs).
Replays bypass the shortcut (Triton's own path per launch, through FastLauncher) where it is off: under
the interpreter, with a launch hook set, or after ``triton_launch.set_fast_launch(False)`` (which changes
the key).
"""
import functools
import operator

import torch

from lora_ops import configs, triton_launch

MAX_PLANS = 4096      # the key holds the token count: bound the table as FastLauncher does
_PLANS = {}
_enabled = [True]


def set_enabled(on):
    """Keep and replay plans (default), or resolve every call's launches afresh (benchmarks compare)."""
    _enabled[0] = bool(on)
    _PLANS.clear()


def launch_device(x):
    """The CUDA device Triton launches on (the current one, as in its own path); -1 for CPU tensors."""
    return triton_launch._current_device() if x.is_cuda else -1


def key(y, x, lora_a, lora_b, slice_widths, sorted_token_ids):
    """Everything add_lora_'s launches derive from (given that its checks passed on these arguments)."""
    return (x.shape, x.stride(), y.shape[1], y.stride(), lora_a.shape, lora_a.stride(), lora_b.stride(),
            tuple(slice_widths), sorted_token_ids.shape[0], x.dtype, launch_device(x), configs.generation(),
            triton_launch.switches())


def op_key(name, shaped, *values):
    """The key of op ``name`` whose launches derive from the shapes, strides and dtypes of the tensors
    ``shaped`` and from ``values`` (given that the op's checks passed)."""
    return (name, *[(t.shape, t.stride(), t.dtype) for t in shaped], *values, launch_device(shaped[0]),
            configs.generation(), triton_launch.switches())


def lookup(plan_key):
    return _PLANS.get(plan_key)


def clear():
    _PLANS.clear()


def _aligned(pointers):
    return not functools.reduce(operator.or_, pointers) & 15


class _Step:
    """One launch of a plan: which pool entries are its pointers, and how to launch it both ways."""
    __slots__ = ("launch", "pick", "go")

    def __init__(self, launch, pick, go):
        self.launch, self.pick, self.go = launch, pick, go


class Plan:
    """The launches of one op call, replayable with the tensors of another call of the same key.

    The pool is the call's tensors (in the order the op lists them) followed by the scratch buffers."""

    def __init__(self, steps, scratch, device):
        self.steps = steps
        self.scratch = scratch
        self.device = device       # launch_device when built (it is in the key)
        self.fast = all(step.go is not None for step in steps)

    def run(self, tensors):
        """Launch with ``tensors``; returns this call's scratch buffers (an op's outputs among them)."""
        scratch = tuple([s.alloc(tensors[0].device) for s in self.scratch])
        pool = tensors + scratch
        if self.fast and not triton_launch._hooks_set():
            pointers = [t.data_ptr() for t in pool]
            if _aligned(pointers):
                stream = triton_launch._current_stream(self.device)
                for step in self.steps:
                    step.go(stream, step.pick(pointers))
                    step.launch.launcher.hits += 1
                return scratch
        for step in self.steps:
            launch = step.launch
            launch.launcher(launch.grid, step.pick(pool), launch.ints, **launch.constexprs)
        return scratch


def run(plan_key, tensors, build):
    """One op call: ``tensors`` (a tuple) through the plan of ``plan_key``; for a new key, through the
    launches ``build()`` returns as ``(launches, scratch specs, scratch buffers)``, which run and become
    the key's plan if they can (see :func:`remember`). Returns the call's scratch buffers."""
    known = _PLANS.get(plan_key)
    if known is not None:
        return known.run(tensors)
    launches, scratch, buffers = build()
    for launch in launches:
        launch()
    if _enabled[0]:
        remember(plan_key, launches, tensors, scratch, buffers)
    return buffers


def remember(plan_key, launches, tensors, scratch, buffers):
    """Keep a plan for ``plan_key`` if ``launches`` (already run, on ``tensors`` and the scratch
    ``buffers`` allocated from the specs ``scratch``) can be replayed exactly (see the module docstring).
    Returns the plan, or None."""
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
        _PLANS.clear()
    plan = _PLANS[plan_key] = Plan(steps, tuple(scratch), launch_device(tensors[0]))
    return plan
