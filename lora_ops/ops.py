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


@torch.library.impl("lora_ops::shrink", "CUDA")
def _shrink_cuda(*args):
    return _triton().shrink(*args)


@torch.library.impl("lora_ops::expand_", "CUDA")
def _expand_cuda(*args):
    _triton().expand_(*args)


@torch.library.impl("lora_ops::add_lora_", "CUDA")
def _add_lora_cuda(*args):
    _triton().add_lora_(*args)


@torch.library.impl("lora_ops::shrink", "CPU")
def _shrink_cpu(*args):
    if _cpu_backend == "triton":
        return _triton().shrink(*args)
    checks.check_shrink(*args)
    return cpu.shrink(*args)


@torch.library.impl("lora_ops::expand_", "CPU")
def _expand_cpu(*args):
    if _cpu_backend == "triton":
        return _triton().expand_(*args)
    checks.check_expand(*args)
    cpu.expand_(*args)


@torch.library.impl("lora_ops::add_lora_", "CPU")
def _add_lora_cpu(*args):
    if _cpu_backend == "triton":
        return _triton().add_lora_(*args)
    checks.check_add_lora(*args)
    cpu.add_lora_(*args)
