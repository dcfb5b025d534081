"""@triton.jit kernels only, one file per kernel family; launchers live in lora_ops.launch."""
