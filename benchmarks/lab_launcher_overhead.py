"""Lab (session 29): what Triton's own C launcher costs per launch, apart from the CUDA driver, on any machine.

A plan's replay calls the compiled kernel's C ``launch`` function (triton_launch.direct_launch) with ~50
arguments; on the H200 host a launch costs ~6-7 µs of host time (DESIGN §4), and a launcher that packs the
arguments once (a C extension of ours) could only save what Triton's launcher does before the driver call:
parse the arguments, convert each, build the parameter array. This times exactly that: Triton's generated
launcher source for add_lora_'s shrink and expand (Llama-3-8B qkv, rank 16, 64 tokens, bf16; the signature
Triton gives them on the GPU, tests/sm90_codegen.py), compiled against a stub libcuda.so.1 whose functions
return at once (cuLaunchKernelEx included), called as a plan's replay calls it.

    python benchmarks/lab_launcher_overhead.py      # CPU or GPU machine; gcc and Triton 3.6's NVIDIA backend

Triton 3.6 (the H200's): 0.84 µs a launch on this repository's CPU machine
(`benchmarks/results/lab-launcher-overhead-cpu-2026-12-05-session29.md`). Later releases build their launcher
otherwise (no per-kernel source: the script says so and stops).
"""
import os
import subprocess
import sys
import tempfile
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
STUB_DRIVER = r"""
#include <stdint.h>
typedef int CUresult;
static int context;
CUresult cuCtxGetCurrent(void **c) { *c = &context; return 0; }
CUresult cuCtxSetCurrent(void *c) { return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = &context; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stub"; return 0; }
CUresult cuPointerGetAttribute(void *out, int a, uint64_t p) { *(uint64_t *)out = p; return 0; }
CUresult cuFuncSetAttribute(void *f, int a, int v) { return 0; }
volatile uint64_t launches;
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { launches++; return 0; }
"""


def add_lora_launches():
    """(kernel, tensors, ints, constexprs) of add_lora_'s two launches for the shape above, recorded, not run."""
    import torch

    import lora_ops
    from lora_ops import launch, plan
    from sm90_codegen import recorded
    bf = torch.bfloat16
    x, y = torch.randn(64, 4096, dtype=bf), torch.randn(64, 6144, dtype=bf)
    lora_a, lora_b = torch.randn(4, 3, 16, 4096, dtype=bf), torch.randn(4, 6144, 16, dtype=bf)
    meta = lora_ops.LoRABatch(64, 4).update(torch.randint(-1, 4, (64,), dtype=torch.int32))
    plan.set_enabled(False)     # (a plan would ask for the current CUDA device)
    with recorded() as calls:
        launch.add_lora_(y, x, lora_a, lora_b, torch.ones(4), torch.full((4,), 16, dtype=torch.int32),
                         [4096, 1024, 1024], *meta)
    return calls


def main():
    from sm90_codegen import compile_args
    try:
        from triton.backends.nvidia.driver import include_dirs, libraries, library_dirs, make_launcher
    except ImportError:
        sys.exit("lab_launcher_overhead: this Triton builds no per-kernel launcher source (Triton 3.6 does)")
    from triton.runtime.build import compile_module_from_src
    rows = []
    for launcher, tensors, ints, constexprs in add_lora_launches():
        kernel = launcher.kernel
        signature, _, _, _ = compile_args(kernel, tensors, ints, constexprs)
        source = make_launcher({}, {i: signature[n] for i, n in enumerate(kernel.arg_names)}, None)
        c_launch = compile_module_from_src(src=source, name="__triton_launcher", library_dirs=library_dirs(),
                                           include_dirs=include_dirs, libraries=libraries).launch
        pointers = [t.data_ptr() for t in tensors]
        rest = (*ints, *[None] * (len(kernel.arg_names) - len(tensors) - len(ints)))

        def go(stream, pointers):   # as triton_launch.FastLauncher.bound's replay calls it
            c_launch(2, 3, 1, stream, 1234, 0, 1, None, None, (4, 1, 32768), None, None, None, *pointers, *rest)
        us = min(timeit.repeat(lambda: go(0, pointers), number=100000, repeat=7)) / 100000 * 1e6
        kept = sum(1 for n in kernel.arg_names if signature[n] != "constexpr")
        rows.append(f"| {kernel.fn.__name__} | {len(kernel.arg_names)} | {kept} | {us:.2f} |")
    import torch
    import triton
    print(f"# Triton's C launcher without the driver (stub libcuda), per launch (cpu, torch {torch.__version__}, "
          f"Triton {triton.__version__})\n\n| kernel | parameters | passed to the kernel | µs a call |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if os.environ.get("LORA_OPS_STUB_DRIVER"):
        sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
        import repo_path  # noqa: F401  (this checkout's lora_ops)
        main()
    else:
        with tempfile.TemporaryDirectory() as stub:
            with open(os.path.join(stub, "stub.c"), "w") as f:
                f.write(STUB_DRIVER)
            subprocess.check_call(["gcc", "-O2", "-shared", "-fPIC", "-o", os.path.join(stub, "libcuda.so.1"),
                                   os.path.join(stub, "stub.c")])
            env = dict(os.environ, LORA_OPS_STUB_DRIVER="1", TRITON_LIBCUDA_PATH=stub,
                       LD_LIBRARY_PATH=stub + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
                       TRITON_CACHE_DIR=os.path.join(stub, "cache"))
            sys.exit(subprocess.call([sys.executable, __file__], env=env))
