"""LoRALinear's eager calls, bound: the op's checks, path choice and plan lookup done once per layer state.

In eager mode a LoRALinear call on the plain path (no dropout, a bare ``nn.Linear`` base, not traced) is the
base GEMM and one op whose own host work is its checks, its path choice and its plan key; measured on the
H200 host (session 22) that work cost more than the op's two C launches. All of it is a function of what the
layer holds and of the input's shape, so each layer keeps, per input signature (shape, strides, dtype, and
whether autograd needs the call), the outcome of its first such call: which path the op took and the
:class:`lora_ops.plan.Plan` it replayed. A later call with that signature replays the plan directly while
these guards hold (DESIGN §4 Host cost):

- nothing needs the dispatcher (no tensor subclass, no TorchDispatchMode, no functorch transform; a call
  that needs autograd runs lora_linear's formula through lora_ops.autograd.BoundLoRALinear, as ops.call
  runs it through the op's own Function) and the layer still takes the plain path (eval or no dropout,
  a bare ``nn.Linear`` with no hooks, no side-stream overlap);
- the layer's tensors are the objects the op checked (the base weight and bias, lora_a, lora_b, scale,
  rank, the context's metadata tuple, the slice widths; stack_a's stack and its views still intact, their
  shapes too), and the ones a kernel indexes by the layer's shape (lora_a, lora_b, scale, rank) still have
  the shapes, strides, dtypes and devices they had, the base weight and bias, which torch's GEMM takes, their
  shapes, strides and dtypes (``param.data = ...`` keeps a tensor's identity, not its shape);
- the config state, the launch switches, the plan table and the current CUDA device are the ones the
  plan was built under (``configs.generation()``, ``triton_launch.switches()``, ``plan.epoch()``);
- the base GEMM's output has the shape and strides the plan was built for (checked after it runs).

A guard that fails sends the call down the op's own path (checks, path, plan), which binds again. The
plan itself still takes each call's addresses and checks their alignment (lora_ops.plan).
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.nn.modules.module import (_global_backward_hooks, _global_backward_pre_hooks, _global_forward_hooks,
                                     _global_forward_pre_hooks)

from lora_ops import autograd, configs, ops, plan, triton_launch
from lora_ops.precision import stack_prefix, stack_prefix_gemm, stacked_prefix_rows

MAX_SIGNATURES = 64     # per layer: input signatures seen (token counts, mostly); cleared when full
_enabled = [True]
_LAUNCH = []     # lora_ops.launch, imported by the first bind: it imports Triton, which a CPU-only install lacks


def _launch():
    if not _LAUNCH:
        from lora_ops import launch
        _LAUNCH.append(launch)
    return _LAUNCH[0]


def set_enabled(on):
    """Bind and replay eager calls (default), or take the op's path on every call (benchmarks compare)."""
    _enabled[0] = bool(on)


def plain_linear(module):
    """A bare nn.Linear (no subclass, no hooks): lora_linear may run its GEMM in place of its forward. Backward
    hooks too (register_full_backward_hook on the base, or global ones): they fire only where the base's own
    forward runs."""
    params = module._parameters
    # (Its weight and bias parameters: a weight kept as a buffer raised a KeyError in the layer's forward.)
    return (type(module) is nn.Linear and params.get("weight") is not None and "bias" in params
            and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks
            and not _global_forward_hooks and not _global_forward_pre_hooks
            and not _global_backward_hooks and not _global_backward_pre_hooks)


def output_may_be_kept(module):
    """Whether ``module``'s output may be a tensor something else holds: a forward hook's (activation capture),
    or whatever a subclass's forward returns (a tensor it caches, its input). The delta then goes into a copy,
    as PEFT adds it out of place, not into that tensor. nn.Linear's own forward returns a fresh one."""
    return bool(module._forward_hooks or _global_forward_hooks) or type(module) is not nn.Linear


def _shaped(t):
    return t.shape, t.stride(), t.dtype


def _state():
    return configs.generation(), triton_launch.switches(), plan.epoch()


class _Bound:
    """One input signature's call: the path ("add", "write", "stacked" or "delta"), its plan, what it was bound
    to, and for a call autograd needs, the delta's signature for its backward (autograd.delta_signature: a
    function of what the guards hold, taken once)."""
    __slots__ = ("path", "plan", "objects", "shapes", "out_shape", "state", "device", "signature", "base_shapes",
                 "stack_prefix")

    def __init__(self, path, bound_plan, objects, shapes, out_shape, device, signature=None, base_shapes=None,
                 stack_prefix=None):
        self.path, self.plan, self.objects, self.shapes = path, bound_plan, objects, shapes
        self.out_shape, self.state, self.device, self.signature = out_shape, _state(), device, signature
        self.base_shapes = base_shapes
        self.stack_prefix = stack_prefix    # precision.stack_prefix, or None: the whole stack


class EagerCalls:
    """A layer's bound eager calls, keyed by the input's (shape, strides, dtype)."""

    def __init__(self):
        self._calls = {}
        self.replays = 0        # calls served by a bound plan (tests read it)

    def clear(self):
        self._calls.clear()

    def __reduce__(self):
        # copy.deepcopy(model) and pickling start a copy with none: a bound call holds the original's
        # tensors and plans (compiled kernels), which are neither the copy's nor picklable.
        return EagerCalls, ()

    def replay(self, layer, x):
        """The layer's output for ``x`` [M, K] through a bound call, or None where none applies (the caller
        then takes the op's own path). ``layer.context.check_input(x)`` has passed; not while compiling."""
        if not _enabled[0] or ops.wrapped_untraced(x) or forward_ad._current_level >= 0:
            return None         # (forward-mode AD: the op's path, which carries the tangents: ops.FORWARD_AD)
        context = layer.context
        base = layer._modules["base"]
        if (layer.training and context.dropout_p is not None) or not plain_linear(base):
            return None
        weight, bias = base._parameters.get("weight"), base._parameters.get("bias")
        lora_a, lora_b, scale, rank = _adapters(layer)
        grad = _needs_grad(x, weight, bias, lora_a, lora_b, scale)
        bound = self._calls.get((x.shape, x.stride(), x.dtype, grad))
        if bound is None:
            return None
        objects = bound.objects
        if not (weight is objects[0] and bias is objects[1] and layer._stacked is objects[8]
                and _adapters_hold(bound, layer, x, lora_a, lora_b, scale, rank)):
            return None
        # (bind imported launch.) A scale that requires grad is an input of the op's Function, where its output
        # then requires grad too; the bound Function takes only the differentiable tensors: the op's path.
        if _LAUNCH[0]._overlaps(x) or (grad and (not ops.eager_autograd() or scale.requires_grad)):
            return None
        # (The batch's copy for autograd: the buffers' shapes and alignment.)
        meta = context.batch_for(grad, x)[0]
        if bound.path == "stacked":     # (bound without autograd only: the stacked op has none)
            if not layer._stack_intact(weight, bias, lora_a):
                return None
            stacked, stacked_bias = layer._stacked
            prefix_t = bound.stack_prefix
            out = (F.linear(x, stacked, stacked_bias) if prefix_t is None
                   else stack_prefix_gemm(x, prefix_t, stacked.shape[0]))
            if (out.shape, out.stride(), out.dtype) != bound.out_shape:
                return None
            bound.plan.run((out, lora_b, rank, scale, *meta))
            self.replays += 1
            return out[:, :weight.shape[0]]
        # (Written out, as in _adapters_hold; the stacked path's _stack_intact compares its views' shapes.)
        if ((weight.shape, weight.stride(), weight.dtype) != bound.base_shapes[0]
                or (bias is not None and (bias.shape, bias.stride(), bias.dtype) != bound.base_shapes[1])):
            return None
        if grad:
            self.replays += 1
            rest = (scale, rank, layer.slice_widths, *meta)
            return autograd.BoundLoRALinear.apply(
                x, weight, bias, lora_a, lora_b, rest,
                lambda: _run(bound, x, weight, bias, lora_a, lora_b, scale, rank, meta), bound.signature)
        out = _run(bound, x, weight, bias, lora_a, lora_b, scale, rank, meta)
        if out is not None:
            self.replays += 1
        return out

    def replay_delta(self, layer, x, y, grad=False):
        """For a layer whose base is not a bare nn.Linear (hooks, a subclass such as a quantized linear: its own
        forward has run and returned ``y`` [M, N]): the delta through a bound add_lora_ call, or None where none
        applies (the caller then calls the op). Without autograd (``grad`` False) the delta is added into ``y``
        in place (add_lora_) and y is returned; with it, y + delta as add_lora computes it, through
        lora_ops.autograd.BoundAddLora (add_lora's autograd). Without dropout, and not where the caller takes
        add_lora for another reason than autograd (vmap, forward-mode AD): the caller's conditions. The base's
        own forward is never bound."""
        if not _enabled[0] or ops.wrapped_untraced(x) or type(y) is not torch.Tensor or forward_ad._current_level >= 0:
            return None         # (forward-mode AD: as in replay; BoundAddLora has no jvp)
        bound = self._calls.get(("delta", *_shaped(x), *_shaped(y), grad))
        if bound is None or (grad and not ops.eager_autograd()):
            return None
        lora_a, lora_b, scale, rank = _adapters(layer)
        if not _adapters_hold(bound, layer, x, lora_a, lora_b, scale, rank) or (grad and scale.requires_grad):
            return None     # (a scale that requires grad: as in replay)
        meta = layer.context.batch_for(grad, x)[0]
        self.replays += 1
        if grad:
            return autograd.BoundAddLora.apply(y, x, lora_a, lora_b, (scale, rank, layer.slice_widths, *meta),
                                               lambda out: bound.plan.run((out, x, lora_a, lora_b, scale, rank, *meta)),
                                               bound.signature)
        bound.plan.run((y, x, lora_a, lora_b, scale, rank, *meta))
        if not y.is_inference():    # add_lora_ writes y in place: its version counter moves, as through the op
            torch.autograd.graph.increment_version(y)
        return y

    def bind_delta(self, layer, x, y, out):
        """After the delta op ran without the dispatcher on ``x`` and ``y`` (the base layer's output), giving
        ``out`` (add_lora_: y itself; add_lora, under autograd: y's contiguous copy plus the delta): keep the
        call for their signatures where the op's add_lora_ launches have a plan (:meth:`replay_delta`)."""
        if not _enabled[0] or not (x.is_cuda or ops.get_cpu_backend() == "triton"):
            return
        lora_a, lora_b, scale, rank = _adapters(layer)
        if lora_a is None or lora_b is None or scale is None or rank is None:
            return
        grad = out is not y
        meta, widths = layer.context.meta_on(x), layer.slice_widths
        read = layer.context.batch_for(grad, x)[0]
        found = plan.lookup(plan.key(out, x, lora_a, lora_b, scale, rank, widths, *read))
        if found is not None:
            self._keep(("delta", *_shaped(x), *_shaped(y), grad), _Bound(
                "delta", found, (None, None, lora_a, lora_b, scale, rank, meta, widths, None),
                _adapter_shapes(lora_a, lora_b, scale, rank), _shaped(y), plan.launch_device(x),
                autograd.delta_signature(x, lora_a, lora_b, scale, rank, read) if grad else None))

    def _keep(self, key, bound):
        if len(self._calls) >= MAX_SIGNATURES:
            self._calls.clear()
        self._calls[key] = bound

    def bind(self, layer, x, weight, bias, out, stacked):
        """After the op's own eager call on ``x``, made without the dispatcher, returned ``out``
        (lora_linear's y, or lora_linear_stacked's whole output when ``stacked``): keep the call for ``x``'s
        signature where the op has a plan. Costs a plan key on the calls it runs after."""
        if not _enabled[0] or not (x.is_cuda or ops.get_cpu_backend() == "triton"):
            return              # (the CPU kernels keep no plans)
        launch = _launch()
        lora_a, lora_b, scale, rank = _adapters(layer)
        if lora_a is None or lora_b is None or scale is None or rank is None or launch._overlaps(x):
            return
        meta = layer.context.meta_on(x)
        widths = layer.slice_widths
        prefix_t = None
        if stacked:
            path, key = "stacked", launch.stacked_plan_key(out, lora_b, scale, rank, widths, *meta)
            L, S, R, _ = lora_a.shape
            # The rows the GEMM takes at this count and their view (the stack is checked by the replay's identity
            # test and _stack_intact, the table's answer by the bound state's configs.generation()): resolved
            # once, off the replay's path.
            rows = stacked_prefix_rows(x.shape[0], *layer._stacked, weight.shape[0], L * S * R)
            prefix_t = None if rows is None else stack_prefix(layer._stacked[0], rows)
        elif launch.writes_first(x, out.shape[1], bias):
            path, key = "write", launch.write_plan_key(out, x, lora_a, lora_b, scale, rank, widths, *meta)
        else:
            path, key = "add", plan.key(out, x, lora_a, lora_b, scale, rank, widths, *meta)
        found = plan.lookup(key)
        if found is not None:
            grad = _needs_grad(x, weight, bias, lora_a, lora_b, scale)
            signature = (autograd.delta_signature(x, lora_a, lora_b, scale, rank,
                                                  layer.context.batch_for(True, x)[0])
                         if grad else None)
            self._keep((*_shaped(x), grad), _Bound(
                path, found, (weight, bias, lora_a, lora_b, scale, rank, meta, widths, layer._stacked),
                _adapter_shapes(lora_a, lora_b, scale, rank), _shaped(out), plan.launch_device(x), signature,
                _base_shapes(weight, bias), prefix_t))


def _adapters(layer):
    """(lora_a, lora_b, scale, rank) from the layer's dicts (None where something moved one)."""
    params, buffers = layer._parameters, layer._buffers
    return params.get("lora_a"), params.get("lora_b"), buffers.get("scale"), buffers.get("rank")


def _base_shapes(weight, bias):
    """The base weight's and bias's shapes, strides and dtypes: ``param.data = ...`` keeps a parameter's
    identity, and a replay then ran torch's GEMM on another shape (raw shape or dtype errors on the write-first
    path, a bias of one entry broadcast silently) where the op names the argument. (Not their devices: only
    torch's GEMM takes them, which names a device mismatch itself; no kernel gets their pointers.)"""
    return _shaped(weight), None if bias is None else _shaped(bias)


def _adapter_shapes(lora_a, lora_b, scale, rank):
    # (get_device: ``param.data = t.cpu()`` keeps the identity, shape and dtype; a kernel must not get its pointer)
    return (*_shaped(lora_a), *_shaped(lora_b), *_shaped(scale), *_shaped(rank),
            lora_a.get_device(), lora_b.get_device(), scale.get_device(), rank.get_device())


def _adapters_hold(bound, layer, x, lora_a, lora_b, scale, rank):
    """Whether the adapter tensors, the metadata and the slice widths are the objects ``bound`` was bound to,
    with the shapes, strides, dtypes and devices it saw (:func:`_adapter_shapes`, written out: a helper call per
    tensor costs more than the reads), under the same config state and on the same device."""
    objects = bound.objects
    return (lora_a is objects[2] and lora_b is objects[3] and scale is objects[4] and rank is objects[5]
            and layer.context.meta_on(x) is objects[6] and layer.slice_widths is objects[7]
            and (lora_a.shape, lora_a.stride(), lora_a.dtype, lora_b.shape, lora_b.stride(), lora_b.dtype,
                 scale.shape, scale.stride(), scale.dtype, rank.shape, rank.stride(), rank.dtype,
                 lora_a.get_device(), lora_b.get_device(), scale.get_device(), rank.get_device()) == bound.shapes
            and _state() == bound.state and plan.launch_device(x) == bound.device)


def _needs_grad(x, weight, bias, lora_a, lora_b, scale):
    """Whether autograd needs a lora_linear call on these (part of a bound call's key: a stack_a layer takes
    the stacked op without autograd and lora_linear with it, so each keeps its own binding)."""
    return torch.is_grad_enabled() and ops.any_requires_grad(x, weight, bias, lora_a, lora_b, scale)


def _run(bound, x, weight, bias, lora_a, lora_b, scale, rank, meta):
    """lora_linear's output through ``bound`` (its "add" or "write" path), or None where the base GEMM's
    output is not the one the plan was built for."""
    if bound.path == "write":
        y = x.new_empty(bound.out_shape[0])     # (x's dtype: as lora_linear's)
        bound.plan.run((y, x, lora_a, lora_b, scale, rank, *meta))
        return y.addmm_(x, weight.t())
    y = F.linear(x, weight, bias)
    if (y.shape, y.stride(), y.dtype) != bound.out_shape:
        return None
    bound.plan.run((y, x, lora_a, lora_b, scale, rank, *meta))
    return y
