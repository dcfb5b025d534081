"""lora_ops: many LoRA adapters in one batch on ordinary PyTorch models, as torch.library ops.

Functional API::

    y = base(x)                                   # [M, N]
    lora_ops.add_lora(y, x, lora_a, lora_b, scale, rank, token_slots=slots)    # y += LoRA delta

See README.md for shapes, dtypes and limits, and docs/DESIGN.md for the design.
"""
from lora_ops import ops  # noqa: F401  (registers the kernels)
from lora_ops.batch import BatchMeta, LoRABatch, build_batch_meta
from lora_ops.functional import add_lora, expand, shrink
from lora_ops.reference import lora_delta_reference

__all__ = ["add_lora", "shrink", "expand", "LoRABatch", "BatchMeta", "build_batch_meta", "lora_delta_reference"]
