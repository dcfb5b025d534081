"""The operator contract of lora_ops: op schemas, their fake (meta) kernels and FLOP formulas.

Torch only: importable, traceable and exportable with no Triton and no GPU. Importing this package
defines the ops in the ``lora_ops`` namespace; ``lora_ops.ops`` registers the CPU and CUDA kernels
onto them.
"""
from csrc_meta.schemas import LIB, OPS  # noqa: F401  (defines the ops)
from csrc_meta import fake  # noqa: F401  (registers the fake kernels)
from csrc_meta import flops  # noqa: F401  (registers the FLOP formulas FlopCounterMode reads)

__all__ = ["LIB", "OPS"]
