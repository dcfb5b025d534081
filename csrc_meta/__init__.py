"""The operator contract of lora_ops: op schemas and their fake (meta) kernels.

Torch only: importable, traceable and exportable with no Triton and no GPU. Importing this package
defines the ops in the ``lora_ops`` namespace; ``lora_ops.ops`` registers the CPU and CUDA kernels
onto them.
"""
from csrc_meta.schemas import LIB, OPS  # noqa: F401  (defines the ops)
from csrc_meta import fake  # noqa: F401  (registers the fake kernels)

__all__ = ["LIB", "OPS"]
