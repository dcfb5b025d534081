"""lora_ops: many LoRA adapters in one batch on ordinary PyTorch models, as torch.library ops.

Functional API::

    y = base(x)                                   # [M, N]
    lora_ops.add_lora(y, x, lora_a, lora_b, scale, rank, token_slots=slots)    # y += LoRA delta
    out = lora_ops.lora_forward(y, x, lora_a, lora_b, scale, rank, token_slots=slots)  # y + delta, autograd

See README.md for shapes, dtypes and limits, and docs/DESIGN.md for the design.
"""
from lora_ops import ops  # noqa: F401  (registers the kernels)
from lora_ops import autograd  # noqa: F401  (registers the functional op, its backward ops and autograd)
from lora_ops.batch import BatchMeta, LoRABatch, build_batch_meta
from lora_ops.functional import add_lora, expand, lora_dropout, lora_forward, shrink
from lora_ops.reference import lora_delta_reference
from lora_ops.layers import LoRAContext, LoRALinear, apply_lora, conv1d_to_linear
from lora_ops.adapters import (AdapterError, UnsupportedAdapterError, load_adapter_tensors, load_peft_adapter,
                               save_peft_adapter, unload_adapter)
from lora_ops.training import SlotTrainer, add_trainable_adapter

__all__ = ["add_lora", "shrink", "expand", "lora_forward", "lora_dropout", "LoRABatch", "BatchMeta",
           "build_batch_meta", "lora_delta_reference", "LoRALinear", "LoRAContext", "apply_lora",
           "conv1d_to_linear", "load_peft_adapter", "load_adapter_tensors", "unload_adapter",
           "save_peft_adapter", "SlotTrainer", "add_trainable_adapter", "AdapterError", "UnsupportedAdapterError"]
