"""Registration of the real kernels onto csrc_meta's ops: Triton on CUDA, vectorised torch on CPU.

The Triton launchers are imported on first use, so a machine without Triton runs the CPU kernels.
``set_cpu_backend("triton")`` (or ``LORA_OPS_CPU_BACKEND=triton``) routes CPU tensors to the Triton
kernels, which needs ``TRITON_INTERPRET=1`` set before Triton is imported: that is how CI runs the
real kernels, through the ops, on a machine with no GPU.
"""
import os

import torch

import csrc_meta  # noqa: F401  (defines the ops and their fake kernels)
from csrc_meta import checks
from lora_ops import cpu

_CPU_BACKENDS = ("torch", "triton")
_cpu_backend = os.environ.get("LORA_OPS_CPU_BACKEND", "torch")


def set_cpu_backend(name):
    """Run CPU tensors through 'torch' (default) or 'triton' (the Triton interpreter)."""
    global _cpu_backend
    if name not in _CPU_BACKENDS:
        raise ValueError(f"name: expected one of {_CPU_BACKENDS}, got {name!r}")
    _cpu_backend = name


def get_cpu_backend():
    return _cpu_backend


def _triton():
    from lora_ops import launch
    return launch


def register_kernels(op, launchers, check, cpu_kernel):
    """Register ``op``'s kernels: CUDA tensors go to the Triton launcher of the same name in the module
    ``launchers()`` returns (imported on first use); CPU tensors to ``cpu_kernel`` after ``check``, or to
    the Triton launcher under ``set_cpu_backend("triton")``. One dispatch rule for every op."""
    name = op.split("::")[1]

    def on_cuda(*args):
        return getattr(launchers(), name)(*args)

    def on_cpu(*args):
        if _cpu_backend == "triton":
            return on_cuda(*args)
        check(*args)
        return cpu_kernel(*args)

    torch.library.impl(op, "CUDA")(on_cuda)
    torch.library.impl(op, "CPU")(on_cpu)


register_kernels("lora_ops::shrink", _triton, checks.check_shrink, cpu.shrink)
register_kernels("lora_ops::expand_", _triton, checks.check_expand, cpu.expand_)
register_kernels("lora_ops::add_lora_", _triton, checks.check_add_lora, cpu.add_lora_)
