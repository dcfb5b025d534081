"""Every Triton launch of lora_ops made a no-op, for timing lora_ops' own host work on any CPU
(host_python.py, host_train_trees.py). Imports lora_ops when called, so the caller picks which checkout's."""


def stub_launches():
    """Route CPU tensors to the Triton launchers (every op's) and make each launch a no-op: the launchers'
    own path (FastLauncher) and a plan's replay (the function ``bound`` returns) do everything but call
    Triton's C launcher. Plans are built and replayed as on a GPU."""
    from lora_ops import launch, launch_grad, ops, triton_launch
    triton_launch._current_stream = lambda device: 0
    ops._cpu_backend = "triton"       # not set_cpu_backend: that asks for the interpreter
    for name in ops.KERNELS:
        module = launch_grad if hasattr(launch_grad, name) else launch
        if hasattr(module, name):
            ops.KERNELS[name]["cpu"] = getattr(module, name)
    triton_launch.FastLauncher.__call__ = lambda self, grid, tensors, ints, **constexprs: None
    triton_launch.FastLauncher.bound = lambda self, grid, tensors, ints, constexprs: lambda stream, pointers: None
