"""Kernel launches with less host time: Triton's launch path, cut short once a specialisation is known.

Triton's ``kernel[grid](...)`` binds every argument, asks the compiler's native code for its
specialisation (dtype and 16-byte alignment of pointers; integers equal to 1 or divisible by 16),
builds a cache key from that list and the options, and only then calls the compiled kernel's C
launcher. On the H200 host that Python path costs 25-40 µs per launch (Triton 3.6), more than the
kernel itself at decode sizes.

:class:`FastLauncher` keeps, per kernel, the compiled kernel Triton chose for each *argument key*: the
exact value of every integer, the dtype and alignment of every tensor, and the constexprs and options.
Triton's specialisation is a function of exactly those (bar the type of a bool passed where an int of
equal value was, which computes the same), so an equal key means an equivalent compiled kernel; a new
key goes through Triton's own path once. A hit calls the C launcher directly. A plan's replay
(:meth:`FastLauncher.bound`) goes one step further where Triton 3.6 allows it (:func:`direct_launch`): it
calls the launcher's C ``launch`` function itself.

The shortcut is off (every launch takes Triton's path) under the interpreter, on Triton versions whose
launcher calling convention it was not written for, while a Triton launch hook is set (profilers such
as Proton rely on it), and with ``LORA_OPS_FAST_LAUNCH=0``. It skips Triton's check that the kernel's
global variables did not change since compilation (our kernels read none) and ignores a change of
``triton.knobs.runtime.debug`` after the first launch of a key.
"""
import functools
import os

import torch

_SUPPORTED_TRITON = ((3, 4), (3, 9))  # launcher calling convention checked in these releases (inclusive)
# Releases whose CudaLauncher.__call__ only allocates the kernel's scratch and calls its C ``launch`` with
# the launch flags put in front (checked in Triton 3.6): a plan replay calls that ``launch`` itself.
_DIRECT_TRITON = ((3, 6), (3, 6))
MAX_KEYS = 4096                       # per kernel; the key holds the token count, so bound the table


def _triton_allows_shortcut():
    try:
        from triton import knobs
    except ImportError:
        return False
    if not _SUPPORTED_TRITON[0] <= _triton_version() <= _SUPPORTED_TRITON[1]:
        return False
    return not knobs.runtime.interpret and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _triton_version():
    import triton
    return tuple(int(v) for v in triton.__version__.split(".")[:2])


def interpreter_problem():
    """Why Triton's interpreter cannot run our kernels in this environment, or None. Before 3.7 the
    interpreter turns a loop bound (held in a 1-element array) into an int with ``int(array)``, which
    numpy 2 refuses: every kernel with a run-time loop bound fails with "only 0-dimensional arrays can be
    converted to Python scalars" (Triton 3.6 with numpy 2, the H200 image, 2026-12-03)."""
    import numpy
    import triton
    if _triton_version() < (3, 7) and int(numpy.__version__.split(".")[0]) >= 2:
        return (f"Triton {triton.__version__}'s interpreter cannot run the lora_ops kernels with numpy "
                f"{numpy.__version__}: install numpy<2 or Triton >= 3.7 (compiled kernels on a GPU are not affected)")
    # Triton takes TRITON_INTERPRET when a kernel is defined: its own helpers (tl.cumsum) when triton.language is
    # first imported, ours when lora_ops.kernels is. Defined without it, they fail on CPU tensors with errors
    # that do not name it (no CUDA device; "Cannot call @triton.jit'd outside of the scope of a kernel").
    from triton.runtime.interpreter import InterpretedFunction
    from lora_ops.kernels import shrink
    if not (isinstance(shrink.shrink_kernel, InterpretedFunction)
            and isinstance(getattr(triton.language, "cumsum", None), InterpretedFunction)):
        return ("Triton's interpreter is off (TRITON_INTERPRET=" + repr(os.environ.get("TRITON_INTERPRET")) +
                " when Triton or lora_ops' kernels were imported): set TRITON_INTERPRET=1 in the environment "
                "before anything imports Triton (torch.compile and torch.utils.flop_counter do), then "
                "set_cpu_backend('triton')")
    return None


def _direct_allowed():
    return _DIRECT_TRITON[0] <= _triton_version() <= _DIRECT_TRITON[1]


def direct_launch(compiled):
    """(C launch function, cooperative-grid flag, PDL flag) of a compiled kernel whose Python launcher a
    replay may skip, or None. In Triton 3.6 ``compiled.run`` is a CudaLauncher whose ``__call__`` allocates
    the kernel's global and profile scratch (none for our kernels) and calls ``launch`` with those and the
    two flags in front of its own arguments; calling ``launch`` directly saves that Python frame (3.8 µs
    for a replay's two launches on a slow H200 host, 2026-12-03). Elsewhere, or for a kernel that needs
    scratch: None."""
    if not _direct_allowed():
        return None
    run = compiled.run
    try:
        fn, coop, pdl = run.launch, run.launch_cooperative_grid, run.launch_pdl
        scratch = run.global_scratch_size or run.profile_scratch_size
    except AttributeError:
        return None
    return None if scratch else (fn, coop, pdl)


def _current_device():
    """The device Triton launches on (the current one, as in its own path). Only asked for with CUDA
    tensors in hand, so CUDA is initialised: torch's C getter, without torch.cuda.current_device's lazy-init
    frames (~0.3 µs of host time a call; several calls per eager layer call)."""
    return torch._C._cuda_getDevice()


def capturing():
    """Whether a CUDA graph is being captured on the current stream (torch.cuda.is_current_stream_capturing
    without its Python frame; it creates no CUDA context). Only asked for with CUDA tensors in hand."""
    return torch._C._cuda_isCurrentStreamCapturing()


def _current_stream(device):
    return torch._C._cuda_getCurrentRawStream(device)


def _hooks_set():
    """Whether a launch hook is installed: a callable, or (Triton >= 3.5) a HookChain holding one."""
    runtime = _knobs_runtime()
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _knobs_runtime():
    # Imported once: an import statement in a function costs ~1 µs per call.
    from triton import knobs
    return knobs.runtime


_LAUNCHERS = []
_switches = [0]


def switches():
    """How many times set_fast_launch ran: lora_ops.plan keys on it (its plans hold compiled kernels)."""
    return _switches[0]


def set_fast_launch(on):
    """Turn the shortcut on (where Triton allows it) or off for every FastLauncher; benchmarks compare."""
    _switches[0] += 1
    for launcher in _LAUNCHERS:
        launcher.enabled = bool(on) and _triton_allows_shortcut()


class FastLauncher:
    """``FastLauncher(kernel)(grid, tensors, ints, **constexprs)`` launches ``kernel`` like
    ``kernel[grid](*tensors, *ints, **constexprs)``: the kernel's parameters are its pointers, then its
    integers, then its constexprs (num_warps / num_stages go with the constexprs). Returns nothing."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.enabled = _triton_allows_shortcut() and os.environ.get("LORA_OPS_FAST_LAUNCH", "1") != "0"
        self._params = None
        self._compiled = {}     # argument key -> (compiled kernel, constexpr values in signature order)
        self.hits = 0           # launches that took the shortcut (tests read it)
        _LAUNCHERS.append(self)

    def __call__(self, grid, tensors, ints, **constexprs):
        if not self.enabled or _hooks_set():
            self.kernel[grid](*tensors, *ints, **constexprs)
            return
        device = _current_device()
        key = self._key(device, tensors, ints, constexprs)
        entry = self._compiled.get(key)
        if entry is None:
            self._first_launch(key, grid, tensors, ints, constexprs)
            return
        compiled, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, _current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *tensors, *ints, *tail)
        self.hits += 1

    @staticmethod
    def _key(device, tensors, ints, constexprs):
        # ints by exact value (a bool equal to an int shares its key: same value, same arithmetic).
        return (device, tuple(constexprs.items()), ints, tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]))

    def bound(self, grid, tensors, ints, constexprs):
        """For arguments a launch already ran with (on the current device): a function ``go(stream,
        pointers)`` that launches the same compiled kernel on ``grid`` with the same ints and constexprs and
        other pointers of the same dtypes and alignment (tensors or their addresses as ints: an int skips
        the C launcher's ``data_ptr`` call and pointer query). None where the shortcut is off or Triton
        handed back no compiled kernel. lora_ops.plan keeps these."""
        if not self.enabled:
            return None
        entry = self._compiled.get(self._key(_current_device(), tensors, ints, constexprs))
        if entry is None:
            return None
        compiled, tail = entry
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        rest = (*ints, *tail)
        direct = direct_launch(compiled)
        if direct is not None:
            c_launch, coop, pdl = direct

            def go(stream, pointers):
                c_launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None, None, None, *pointers,
                         *rest)
            return go

        def go(stream, pointers):
            run(g0, g1, g2, stream, function, metadata, None, None, None, *pointers, *rest)
        return go

    def _first_launch(self, key, grid, tensors, ints, constexprs):
        compiled = self.kernel[grid](*tensors, *ints, **constexprs)
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            return                  # not a compiled kernel Triton handed back: this key stays on Triton's path
        if self._params is None:
            self._params = list(self.kernel.signature.parameters.values())
        # The C launcher takes every parameter in signature order and skips the constexprs itself.
        tail = tuple(constexprs[p.name] if p.name in constexprs else p.default
                     for p in self._params[len(tensors) + len(ints):])
        if len(self._compiled) >= MAX_KEYS:
            self._compiled.clear()
        self._compiled[key] = (compiled, tail)
