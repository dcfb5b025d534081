"""@triton.jit kernels only, one file per kernel family; launchers live in lora_ops.launch (forward),
lora_ops.launch_grad (backward) and lora_ops.launch_batch (batch metadata)."""
