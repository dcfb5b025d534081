"""Registration of the real kernels onto csrc_meta's ops: Triton on CUDA, vectorised torch on CPU; and
:func:`call`, which runs an op on real tensors without the dispatcher's cost when nothing needs it (with
autograd too: :data:`AUTOGRAD`).

The Triton launchers are imported on first use, so a machine without Triton runs the CPU kernels.
``set_cpu_backend("triton")`` (or ``LORA_OPS_CPU_BACKEND=triton``) routes CPU tensors to the Triton
kernels, which needs ``TRITON_INTERPRET=1`` set before Triton is imported: that is how CI runs the
real kernels, through the ops, on a machine with no GPU.
"""
import os

import torch
from torch.autograd import forward_ad

import csrc_meta  # noqa: F401  (defines the ops and their fake kernels)
from csrc_meta import checks
from lora_ops import cpu, triton_launch

_CPU_BACKENDS = ("torch", "triton")
_cpu_backend = os.environ.get("LORA_OPS_CPU_BACKEND", "torch")


def set_cpu_backend(name):
    """Run CPU tensors through 'torch' (default) or 'triton' (Triton's interpreter: TRITON_INTERPRET=1 must be
    set in the environment before anything imports Triton; the first call on CPU tensors says so otherwise)."""
    global _cpu_backend
    if name not in _CPU_BACKENDS:
        raise ValueError(f"name: expected one of {_CPU_BACKENDS}, got {name!r}")
    if name != _cpu_backend:
        from lora_ops import plan
        plan.clear()    # (a layer's bound eager calls replay plans of the other backend's kernels: lora_ops.eager)
    _cpu_backend = name


def get_cpu_backend():
    return _cpu_backend


def _triton():
    from lora_ops import launch
    return launch


_interpreter_checked = []
# Triton's interpreter (3.6-3.9) computes bfloat16 on its raw bit patterns as integers (garbage, no error:
# DESIGN.md §6). A bf16 call there raises unless this is set: tests/interp_bf16.py's patch redoes that
# arithmetic in float32 and sets it while active.
INTERPRETER_BF16 = {"patched": False}


def _check_interpreter():
    """Once per process, before CPU tensors first reach the Triton kernels (the interpreter): a clear error
    where this Triton's interpreter cannot run them (triton_launch.interpreter_problem)."""
    if not _interpreter_checked:
        from lora_ops import triton_launch
        problem = triton_launch.interpreter_problem()
        if problem:
            raise RuntimeError(f"set_cpu_backend('triton'): {problem}")
        _interpreter_checked.append(True)


# op name -> {"cuda": kernel, "cpu": kernel}, the functions registered below
KERNELS = {}
# op name -> {"cuda": kernel, "cpu": kernel} without the argument checks, for the ops registered with
# trusted=True: what :func:`call_trusted` runs
TRUSTED = {}
# op name -> a torch.autograd.Function that runs the op's kernel and its registered autograd formula
# (lora_ops.autograd fills it): what :func:`call` runs for an eager call that needs autograd and nothing
# else of the dispatcher.
AUTOGRAD = {}
# op name -> (the argument positions that may carry a tangent, tangent(primals, tangents, out)): the op's
# forward-mode formula (lora_ops.autograd fills it), which :func:`call` runs under forward-mode AD.
FORWARD_AD = {}
_eager_autograd = [True]
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


any_requires_grad = checks.any_requires_grad      # (the contract's checks use it too)
# Ops whose schema marks the first argument written in place (Tensor(a!)), read from the schemas.
MUTATES_FIRST = set()


def on_other_device(t):
    """The index of ``t``'s CUDA device where it is not the current one, else None (CPU tensors: None).
    Triton launches on the current device, as do our plans: a call on a tensor of another GPU (models on
    several GPUs of one process) must run with its device made current (``torch.cuda.device``)."""
    index = t.get_device()
    return index if index >= 0 and index != triton_launch._current_device() else None


_UNCHECKED = {"checked": False}


def register_kernels(op, launchers, check, cpu_kernel, trusted=False):
    """Register ``op``'s kernels: CUDA tensors go to the Triton launcher of the same name in the module
    ``launchers()`` returns (imported on first use); CPU tensors to ``cpu_kernel`` after ``check``, or to
    the Triton launcher under ``set_cpu_backend("triton")``. One dispatch rule for every op.
    ``trusted``: the launcher takes ``checked=False``, and :data:`TRUSTED` gets the op's kernels without
    their checks (:func:`call_trusted`)."""
    name = op.split("::")[1]

    launcher = []   # resolved on first use: importing the launchers imports Triton

    def launch(args, unchecked):
        if not launcher:
            launcher.append(getattr(launchers(), name))
        kwargs = _UNCHECKED if unchecked else {}
        other = on_other_device(args[0])
        if other is None:
            out = launcher[0](*args, **kwargs)
        else:
            with torch.cuda.device(other):
                out = launcher[0](*args, **kwargs)
        _bump_written(name, args[0])
        return out

    def on_cpu_tensors(args, unchecked):
        if _cpu_backend == "triton":
            _check_interpreter()
            if not INTERPRETER_BF16["patched"] and any(getattr(a, "dtype", None) is torch.bfloat16 for a in args):
                raise RuntimeError(f"lora_ops::{name}: bfloat16 tensors on the CPU with set_cpu_backend('triton'): "
                                   f"Triton's interpreter computes bfloat16 wrongly (it does arithmetic on the bit "
                                   f"patterns; triton-lang/triton#11584). Use float16 or float32 there, or the torch "
                                   f"CPU backend (set_cpu_backend('torch'))")
            return launch(args, unchecked)
        if not unchecked:
            check(*args)
        return cpu_kernel(*args)

    def on_cuda(*args):
        if forward_ad._current_level >= 0:
            _refuse_tangents(name, args)
        return launch(args, False)

    def on_cpu(*args):
        if forward_ad._current_level >= 0:
            _refuse_tangents(name, args)
        return on_cpu_tensors(args, False)

    def on_cuda_trusted(*args):
        return launch(args, True)

    def on_cpu_trusted(*args):
        return on_cpu_tensors(args, True)

    torch.library.impl(op, "CUDA")(on_cuda)
    torch.library.impl(op, "CPU")(on_cpu)
    KERNELS[name] = {"cuda": on_cuda, "cpu": on_cpu}
    if trusted:
        TRUSTED[name] = {"cuda": on_cuda_trusted, "cpu": on_cpu_trusted}
    first = getattr(torch.ops.lora_ops, name).default._schema.arguments[0]
    if first.alias_info is not None and first.alias_info.is_write:
        MUTATES_FIRST.add(name)


def _bump_written(name, first):
    """A Triton kernel writes an in-place op's output through its pointer, which the dispatcher does not see:
    bump the output's version counter as a torch in-place op would (the CPU kernels' torch ops bump their own),
    so autograd refuses a backward that saved the tensor before the write."""
    if name in MUTATES_FIRST and not first.is_inference():   # inference tensors have no version counter
        torch.autograd.graph.increment_version(first)


def kernel_for(name, t, table=KERNELS):
    """The kernel registered for op ``name`` on ``t``'s device (CUDA or CPU), or None for another device
    (``table``: :data:`KERNELS`, or :data:`TRUSTED`, where an op without trusted kernels has none)."""
    kernels = table.get(name)
    return kernels.get("cuda" if t.is_cuda else "cpu" if t.is_cpu else None) if kernels else None


def wrapped(first):
    """Whether an op call whose first argument is ``first`` must go through torch.ops for a reason other
    than autograd: tracing, a tensor subclass, a TorchDispatchMode or a functorch transform."""
    return torch.compiler.is_compiling() or wrapped_untraced(first)


def wrapped_untraced(first):
    """:func:`wrapped` for a call its caller knows is not traced (lora_ops.eager's bound calls, which
    LoRALinear makes only outside torch.compile): is_compiling costs two Python frames a call."""
    return (type(first) is not torch.Tensor or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active())


def set_eager_autograd(on):
    """Run eager calls that need autograd through the op's own autograd.Function (default) or through the
    dispatcher's autograd for the op (the same formula; benchmarks and tests compare)."""
    _eager_autograd[0] = bool(on)


def eager_autograd():
    return _eager_autograd[0]


def direct(name, args):
    """Whether :func:`call` runs op ``name`` on ``args`` without the dispatcher: its kernel, or its
    :data:`AUTOGRAD` Function where autograd needs the call (LoRALinear binds such calls: lora_ops.eager).
    Not while tracing (torch.compile, export), for tensor subclasses (fake, functional, user subclasses;
    judged by the first argument), under a TorchDispatchMode (FlopCounterMode, debug modes) or a functorch
    transform (vmap, grad) (:func:`wrapped`), nor where autograd needs the call and the op has no Function
    of ours for it (or the Function is switched off, or an argument is a subclass)."""
    if wrapped(args[0]):
        return False
    if torch.is_grad_enabled() and any_requires_grad(*args):
        return _autograd_function(name, args) is not None
    return True


def _autograd_function(name, args):
    """The :data:`AUTOGRAD` Function :func:`call` runs for an eager call of ``name`` on ``args`` that needs
    autograd, or None where the dispatcher runs it (no Function, switched off, a tensor subclass)."""
    function = AUTOGRAD.get(name)
    if function is None or not _eager_autograd[0] or not _plain(args):
        return None
    return function


def _plain(args):
    """Whether every tensor in ``args`` is a plain tensor or nn.Parameter (no subclass anywhere)."""
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TYPES:
            return False
    return True


def call(name, *args):
    """``torch.ops.lora_ops.<name>(*args)``, straight to the registered kernel when the dispatcher adds
    nothing (see :func:`direct`): in eager mode the dispatcher costs ~25 µs of host time per
    call on the H200 host (benchmarks/host_overhead.py), about one whole Triton launch. The kernel is the
    one the dispatcher would run, with its checks (an in-place op's kernel bumps its output's version counter).

    A call that needs autograd (grad mode on, an argument requiring grad) runs the op's :data:`AUTOGRAD`
    Function where it has one and every tensor argument is a plain tensor or nn.Parameter: the kernel and
    the formula torch.library.register_autograd gave the dispatcher, without the dispatcher's autograd
    wrapper (its redispatch and argument re-binding cost ~45 µs of host time per training step on this
    repository's CPU machine, benchmarks/host_python.py)."""
    first = args[0]
    if torch.compiler.is_dynamo_compiling():     # (not AOT tracing a backward formula, under no_grad)
        checks.refuse_frozen_graphs()       # (every traced layer path; and this frame below a layer run eagerly)
    if forward_ad._current_level >= 0:      # in torch.autograd.forward_ad.dual_level or torch.func.jvp
        if torch.compiler.is_compiling():   # (torch.compile(jvp(...)): the graph breaks, the call runs eagerly)
            return _not_compiled(_call_eagerly)(name, *args)
        if torch._C._are_functorch_transforms_active():
            _refuse_vmapped_tangents(name)
        tangents = [forward_ad.unpack_dual(a).tangent if isinstance(a, torch.Tensor) else None for a in args]
        if any(t is not None for t in tangents):
            return _not_compiled(_call_with_tangents)(name, args, tangents)
    kernel = kernel_for(name, first)
    if kernel is None or wrapped(first):
        if torch._C._are_functorch_transforms_active():
            function = _functorch_grad_function(name)
            if function is not None:
                return function.apply(*args)
        return getattr(torch.ops.lora_ops, name)(*args)
    if torch.is_grad_enabled() and any_requires_grad(*args):
        function = _autograd_function(name, args)
        if function is None:
            return getattr(torch.ops.lora_ops, name)(*args)
        return function.apply(*args)
    return kernel(*args)


# Never compiled, either: under forward-mode AD around torch.compile (jvp(torch.compile(model)),
# torch.compile(jvp(...))) Dynamo skipped the frames above, but compiled the ones below (the op's kernel, the CPU
# kernels' helpers) with dual fake tensors, and torch's unpacking of them failed an INTERNAL ASSERT (_fw_primal),
# or traced the transforms' stack (get_interpreter_stack), which it cannot. They run as in eager mode; under
# fullgraph=True, Dynamo refuses the graph break (naming this reason where an earlier call made the wrapper).
_NOT_COMPILED = "lora_ops: forward-mode AD runs the ops eagerly, carrying their tangents itself"
_NOT_COMPILED_WRAPPERS = {}


def _not_compiled(fn):
    """``fn`` under torch.compiler.disable, wrapped on first use: the decorator imports torch._dynamo, which imports
    Triton, and importing lora_ops must import neither (the tuner sets TRITON_INTERPRET after importing it)."""
    wrapper = _NOT_COMPILED_WRAPPERS.get(fn)
    if wrapper is None:
        wrapper = _NOT_COMPILED_WRAPPERS[fn] = torch.compiler.disable(fn, reason=_NOT_COMPILED)
    return wrapper


def _call_eagerly(name, *args):
    return call(name, *args)


def _call_with_tangents(name, args, tangents):
    """Forward-mode AD (``forward_ad.dual_level``, torch.func.jvp): the op on the primals, its output made dual
    with the tangent its :data:`FORWARD_AD` formula gives. torch's custom-op autograd has no forward mode: it
    returned outputs without their inputs' tangents (torch.func.jvp through a LoRA layer gave the base layer's
    tangent alone), so an op without a formula, or a tangent on an argument its formula does not
    differentiate (scale, rank, metadata), raises instead."""
    positions, formula = FORWARD_AD.get(name, ((), None))
    for i, tangent in enumerate(tangents):
        if tangent is not None and i not in positions:
            why = "" if formula else ": the op has no forward-mode formula (lora_linear and add_lora have one)"
            raise NotImplementedError(
                f"lora_ops::{name}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) through argument "
                f"{i} is not supported{why}. Reverse mode (backward, torch.autograd.grad) is")
    primals = tuple(forward_ad.unpack_dual(a).primal if isinstance(a, torch.Tensor) else a for a in args)
    out = call(name, *primals)
    return forward_ad.make_dual(out, formula(primals, tangents, out))


def _refuse_vmapped_tangents(name):
    """Forward-mode AD and vmap together (torch.func.jacfwd, vmap(jvp), jvp(vmap)): the tangent formulas add into
    tensors of the unbatched shape, and unpacking a batched dual has no batching rule; torch's errors named
    broadcast shapes or aten::_unpack_dual. Refused in our terms."""
    if torch._C._functorch.TransformType.Vmap in _functorch_transforms():
        raise NotImplementedError(
            f"lora_ops::{name}: forward-mode AD together with vmap (torch.func.jacfwd, vmap(jvp), jvp(vmap), or vmap "
            f"inside a dual level) is not supported; torch.func.jacrev, jvp, vjp, grad, and vmap outside forward-mode "
            f"AD are")


def _functorch_transforms():
    """The kinds of torch.func transforms active now (torch._C._functorch.TransformType members)."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return {i.key() for i in retrieve_all_functorch_interpreters()}


def _refuse_tangents(name, args):
    """A kernel reached through ``torch.ops.lora_ops.<name>`` with dual tensors (forward_ad.dual_level): torch's
    custom-op autograd would return the output without their tangents, a silently wrong derivative. :func:`call`
    (and so the functional API and LoRALinear) hands kernels the primals and carries the tangents itself."""
    if any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None for a in args):
        raise NotImplementedError(
            f"lora_ops::{name}: torch.ops.lora_ops.{name} under forward-mode AD (torch.autograd.forward_ad) would "
            f"drop its inputs' tangents (torch's custom ops have no forward mode). Call lora_ops.ops.call({name!r}, "
            f"...), lora_ops' functional API or LoRALinear, which carry them")


def _functorch_grad_function(name):
    """Under torch.func transforms: the op's :data:`AUTOGRAD` Function where a grad transform (grad, vjp) is on
    and no vmap, else None (torch.ops then; vmap alone is fine: torch loops over the batch). torch.func runs an
    autograd.Function only where it defines setup_context, which the one torch.library builds for a custom op
    does not (torch raised about autograd.Function); ours do (lora_linear, add_lora). A grad transform through
    another op, or inside vmap (vmap(grad): the Functions have no vmap rule), raises in our terms. jacrev is
    fine: its vmap runs over the vjp function, after the forward, where torch loops over our backward ops."""
    kinds = _functorch_transforms()
    if torch._C._functorch.TransformType.Grad not in kinds:
        return None
    function = AUTOGRAD.get(name)
    if function is None or torch._C._functorch.TransformType.Vmap in kinds:
        raise NotImplementedError(
            f"lora_ops::{name}: torch.func's grad transforms are supported as grad, vjp and jacrev through "
            f"lora_linear and add_lora (LoRALinear, lora_ops.lora_forward), not inside vmap (vmap(grad)); here "
            f"{'the op has no autograd Function' if function is None else 'under vmap'}. torch.autograd.grad "
            f"works everywhere (create_graph=True for second derivatives)")
    return function


def call_trusted(name, *args):
    """:func:`call` for a call whose arguments are valid by construction, as the backward formula's are
    (lora_ops.autograd: the forward's checked inputs, autograd's output gradient, the outputs of the ops
    before): where :func:`call` would run the kernel directly, run it without its argument checks (the
    backward ops' checks took ~20 µs of a LoRALinear training step's host time on this repository's CPU
    machine, benchmarks/host_python.py). Otherwise, or for an op without trusted kernels, :func:`call`."""
    first = args[0]
    kernel = kernel_for(name, first, TRUSTED)
    if kernel is None or wrapped(first) or (torch.is_grad_enabled() and any_requires_grad(*args)):
        return call(name, *args)
    return kernel(*args)


register_kernels("lora_ops::shrink", _triton, checks.check_shrink, cpu.shrink, trusted=True)
register_kernels("lora_ops::expand_", _triton, checks.check_expand, cpu.expand_)
register_kernels("lora_ops::add_lora_", _triton, checks.check_add_lora_, cpu.add_lora_)
register_kernels("lora_ops::lora_linear", _triton, checks.check_lora_linear, cpu.lora_linear)
register_kernels("lora_ops::lora_linear_stacked", _triton, checks.check_lora_linear_stacked, cpu.lora_linear_stacked)
