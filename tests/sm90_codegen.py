"""What a launch compiles to on an H100/H200 (sm_90), found on a machine without a GPU.

Run any of our launchers on CPU tensors with its FastLauncher swapped for a recorder: each recorded launch
is compiled by Triton's NVIDIA backend for sm_90 with the specialisation Triton would give it on the GPU
(pointer dtypes and 16-byte alignment; integers equal to 1 as constants, divisible by 16 as such, except
the kernel's do_not_specialize parameters), and reported: PTX, registers and spills (Triton's bundled
ptxas), and a census of the global loads by width. A rank mask on the contiguous dimension, for instance,
shows as 2-byte and 4-byte loads where 16-byte ones should be (docs/DESIGN.md §4).

    PYTHONPATH=. python tests/sm90_codegen.py --table     # every kernel's loads, registers, spills
    PYTHONPATH=. python tests/sm90_codegen.py --float32-spills   # float32's GPU configs: registers, spills
    PYTHONPATH=. python tests/sm90_codegen.py --float16-spills   # float16's GPU expand configs: the same
    PYTHONPATH=. python tests/sm90_codegen.py --ptx-hashes > a.json   # every case's PTX, hashed: a kernel
                                             # refactor whose hashes match the tree before changed no kernel
"""
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager

import torch

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                 torch.int64: "i64"}
PTXAS_NAMES = ("ptxas-blackwell", "ptxas")  # the first that accepts Triton's PTX version


@contextmanager
def recorded(launcher=None):
    """Within the block, calls of ``launcher`` (a FastLauncher; None: every one) are recorded, not run:
    yields the list of (launcher, tensors, ints, constexprs) each call passed. Other launchers run."""
    from lora_ops.triton_launch import FastLauncher
    calls = []
    original = FastLauncher.__call__

    def record(self, grid, tensors, ints, **constexprs):
        if launcher is None or self is launcher:
            calls.append((self, tuple(tensors), tuple(ints), dict(constexprs)))
        else:
            original(self, grid, tensors, ints, **constexprs)

    FastLauncher.__call__ = record
    try:
        yield calls
    finally:
        FastLauncher.__call__ = original


def jit_functions():
    """Every @triton.jit function of lora_ops.kernels, as ("module.name", function): a JITFunction, or an
    InterpretedFunction under TRITON_INTERPRET=1 (``.fn``: the Python function either way)."""
    import importlib
    import pkgutil

    import triton

    import lora_ops.kernels as kernels
    for module_info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"lora_ops.kernels.{module_info.name}")
        for name, fn in vars(module).items():
            if isinstance(fn, triton.runtime.KernelInterface) and fn.fn.__module__ == module.__name__:
                yield f"{module_info.name}.{name}", fn


def launch_constexprs(kernel, constexprs):
    """The constexpr values a launch of ``kernel`` with these keyword arguments compiles with: the given
    ones, and the kernel's defaults for the rest (ASTSource leaves a constexpr it is not given as None:
    before session 21 every expand case here compiled with ACCUMULATE None, the store mode, not add_lora_'s
    accumulating expand)."""
    params = inspect.signature(kernel.fn).parameters   # kernel.fn: the Python function (also interpreted)
    values = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    values.update({k: v for k, v in constexprs.items() if k in params})
    return values


def compile_args(kernel, tensors, ints, constexprs):
    """(signature, constants, attributes, options) of ``kernel``'s compile for the given launch arguments
    (as FastLauncher takes them), specialised as Triton's launcher would on the GPU: pointer dtypes and
    16-byte alignment, integers equal to 1 as constants and those divisible by 16 as such (except the
    kernel's do_not_specialize parameters). Plain data: it keys and pickles."""
    names = kernel.arg_names
    skip = {p.name for p in kernel.params if p.do_not_specialize}
    signature, attrs, consts = {}, {}, {}
    options = {k: constexprs[k] for k in ("num_warps", "num_stages") if k in constexprs}
    for i, (name, value) in enumerate(zip(names, list(tensors) + list(ints))):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_DTYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name not in skip and value == 1 and not isinstance(value, bool):
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i1" if isinstance(value, bool) else ("i64" if abs(value) >= 2 ** 31 else "i32")
            if name not in skip and not isinstance(value, bool) and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(tensors) + len(ints):]:
        signature[name] = "constexpr"
    consts.update(launch_constexprs(kernel, constexprs))
    return signature, consts, attrs, options


def compile_from_args(kernel, signature, consts, attrs, options):
    """Triton's compile of ``kernel`` for sm_90 (:func:`compile_args` gives the rest)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    return triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_sm90(kernel, tensors, ints, constexprs):
    """Triton's compile of ``kernel`` for sm_90 with the given launch arguments (as FastLauncher takes
    them), specialised as Triton's launcher would on the GPU."""
    return compile_from_args(kernel, *compile_args(kernel, tensors, ints, constexprs))


def _ptxas():
    import triton
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return [os.path.join(folder, n) for n in PTXAS_NAMES if os.path.exists(os.path.join(folder, n))]


def ptxas_usage(ptx):
    """(registers, spill store bytes) from ptxas -v, or (None, None) where no bundled ptxas takes it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for exe in _ptxas():
            run = subprocess.run([exe, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                regs = re.findall(r"Used (\d+) registers", run.stderr)
                spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
                return int(regs[0]), int(spills[0]) if spills else 0
    return None, None


def global_loads(ptx):
    """Global loads by kind and width in bytes, e.g. {('cp.async', 16): 24, ('ld.global', 2): 32}."""
    census = collections.Counter()
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]+\], \[[^\]]+\], (0x\w+|\d+)",
                           ptx):
        census[("cp.async", int(size, 0))] += 1
    for vec, bits in re.findall(r"ld\.global(?:\.[\w:]+)*?(?:\.v(\d))?\.[bfus](\d+)\b", ptx):
        census[("ld.global", int(vec or 1) * int(bits) // 8)] += 1
    return census


def wgmma_operands(ptx):
    """Hopper MMAs by where their left operand comes from: {'shared': n, 'registers': n}. A wgmma's operands
    follow its accumulator's {...} list: a descriptor (shared memory) or a {...} list of registers."""
    census = collections.Counter()
    for a in re.findall(r"wgmma\.mma_async[^;]*?\}\s*,\s*([{%])", ptx):
        census["registers" if a == "{" else "shared"] += 1
    return dict(census)


def _census(ptx):
    return {f"{kind} {width} B": n for (kind, width), n in sorted(global_loads(ptx).items())}


def summary(compiled):
    """{'registers', 'spill_bytes', 'loads': {'cp.async 16 B': n, 'ld.global 2 B': n, ...},
    'wgmma_a': where the MMAs' left operands come from (:func:`wgmma_operands`),
    'wgmma_waits': the wgmma.wait_group counts in PTX order (0: every MMA in flight waited for; a pipelined
    loop waits for all but its last, 1), 'shared_bytes',
    'loads_before_wait': the same census before the first griddepcontrol.wait (PDL), or None without one}"""
    ptx = compiled.asm["ptx"]
    regs, spills = ptxas_usage(ptx)
    wait = ptx.find("griddepcontrol.wait")
    return {"registers": regs, "spill_bytes": spills, "loads": _census(ptx), "wgmma_a": wgmma_operands(ptx),
            "wgmma_waits": [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
            "shared_bytes": compiled.metadata.shared,
            "loads_before_wait": _census(ptx[:wait]) if wait >= 0 else None}


def cases():
    """(name, launcher, launch) at bf16: the expand's two paths, the shrink (split-K partials), the one-launch
    kernel and the two backward kernels, each with the configs a Llama-like layer gets; the batch metadata
    fill."""
    from lora_ops import configs, launch, launch_grad
    from lora_ops.configs import tuning
    from lora_ops.configs.heuristics import ExpandConfig

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    for name, R, cfg in (("expand_one_block_r16", 16, ExpandConfig(16, 64, 16, 4, 2, 1)),
                         ("expand_one_block_r64_n_loop", 64, ExpandConfig(64, 64, 64, 4, 2, 4)),
                         ("expand_rank_loop_r320", 320, ExpandConfig(64, 256, 32, 4, 3, 1))):
        p = tuning.synthetic_problem(cpu, bf16, 64, [256, 256], R, 4, 64)

        def run(p=p, cfg=cfg):
            launch.launch_expand(p["y"], p["h"].unsqueeze(0), p["B"], p["widths"], p["rank"], *p["meta"], cfg)
        yield name, launch.EXPAND, run

    # add_lora_'s pair above rank 64 in bf16: the shrink stores h as bf16 planes, the rank loop loads them.
    p = tuning.synthetic_problem(cpu, bf16, 256, [256, 256], 320, 4, 64)
    scfg, ecfg = configs.heuristics.ShrinkConfig(64, 64, 64, 1, 4, 4), ExpandConfig(64, 256, 32, 4, 3, 1)
    planes = launch.shrink_buffer(p["x"], p["A"], scfg, ecfg)

    def shrink_planes(p=p):
        launch.launch_shrink(p["x"], p["A"], p["scale"], p["rank"], *p["meta"], planes, scfg)
    yield "shrink_planes_r320", launch.SHRINK, shrink_planes

    def expand_planes(p=p):
        launch.launch_expand(p["y"], planes, p["B"], p["widths"], p["rank"], *p["meta"], ecfg)
    yield "expand_rank_loop_planes_r320", launch.EXPAND, expand_planes

    def expand_store_planes(p=p):   # lora_linear's write-first path: y = the delta, the GEMM adds onto it
        launch.launch_expand(p["y"], planes, p["B"], p["widths"], p["rank"], *p["meta"], ecfg, accumulate=False)
    yield "expand_rank_loop_planes_store_r320", launch.EXPAND, expand_store_planes

    def expand_planes_in_turn(p=p):   # the planes taking turns (ExpandConfig.planes_in_turn): one dot a step
        launch.launch_expand(p["y"], planes, p["B"], p["widths"], p["rank"], *p["meta"],
                             ecfg._replace(planes_in_turn=True))
    yield "expand_rank_loop_planes_in_turn_r320", launch.EXPAND, expand_planes_in_turn

    # Under PDL: add_lora_'s expand (y and B loaded before its wait) and the stacked path's (behind the GEMM,
    # which writes y and h: only metadata, token ids and the scale before the wait), both code paths.
    p = tuning.synthetic_problem(cpu, bf16, 64, [256, 256], 16, 4, 64)

    def expand_pdl(p=p):
        launch.launch_expand(p["y"], p["h"].unsqueeze(0), p["B"], p["widths"], p["rank"], *p["meta"],
                             ExpandConfig(16, 64, 16, 4, 2, 1), pdl=True)
    yield "expand_pdl_r16", launch.EXPAND, expand_pdl
    for name, R, cfg in (("expand_stacked_pdl_r16", 16, ExpandConfig(16, 64, 16, 4, 2, 1)),
                         ("expand_stacked_pdl_rank_loop_r320", 320, ExpandConfig(64, 256, 32, 4, 3, 1))):
        p = tuning.synthetic_problem(cpu, bf16, 64, [256, 256], R, 4, 64)
        out = torch.randn(64, 512 + 4 * 2 * R, dtype=bf16)   # F.linear(x, [W; A]): y, then every slot's h

        def stacked(p=p, cfg=cfg, out=out):
            launch.launch_expand_stacked(out, 512, p["B"], p["widths"], p["rank"], p["scale"], *p["meta"], cfg,
                                         pdl=True)
        yield name, launch.EXPAND, stacked

    p = tuning.synthetic_problem(cpu, bf16, 256, [512, 128, 128], 16, 4, 64)
    scfg = configs.heuristics.shrink_config(64, 4096, 3, 16, 4, out_features=768)
    ecfg = configs.heuristics.expand_config(64, 768, 16, 4)

    def shrink(p=p):
        h = launch.shrink_buffer(p["x"], p["A"], scfg, ecfg)
        launch.launch_shrink(p["x"], p["A"], p["scale"], p["rank"], *p["meta"], h, scfg, partials_out=True)
    yield "shrink_split_k_r16", launch.SHRINK, shrink

    def fused(p=p):
        launch.launch_fused(p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"],
                            configs.heuristics.fused_config(1, 4096, 16))
    yield "fused_r16", launch.FUSED, fused

    p = tuning.synthetic_problem(cpu, bf16, 256, [512, 128, 128], 64, 4, 256)
    dh = torch.randn(256, 3, 64)

    def grad_x(p=p):
        launch_grad.launch_lora_grad_x(p["x"].new_zeros(256, 256), dh, p["A"], p["rank"], *p["meta"],
                                       launch_grad.grad_x_config(256, 256, 64, 3), write_all=True)
    yield "grad_x_r64", launch_grad.GRAD_X, grad_x

    def grad_x_loop(p=p):   # a program walking 4 column blocks (N_LOOP)
        launch_grad.launch_lora_grad_x(p["x"].new_zeros(256, 256), dh, p["A"], p["rank"], *p["meta"],
                                       launch_grad.grad_x_config(256, 256, 64, 3)._replace(block_n=64, n_loop=4),
                                       write_all=True)
    yield "grad_x_r64_n_loop4", launch_grad.GRAD_X, grad_x_loop

    # The tile's dh of both slices split once (ONE_RANK_BLOCK, the heuristic's from the 1024-token bucket: 2 x 64
    # columns), a program walking 4 column blocks.
    two = tuning.synthetic_problem(cpu, bf16, 256, [384, 384], 64, 4, 256)
    dh_two = torch.randn(256, 2, 64)

    def grad_x_one_block(p=two):
        cfg = launch_grad.grad_x_config(4096, 256, 64, 2)
        assert cfg.one_rank_block
        launch_grad.launch_lora_grad_x(p["x"].new_zeros(256, 256), dh_two, p["A"], p["rank"], *p["meta"],
                                       cfg._replace(n_loop=4), write_all=True)
    yield "grad_x_one_block_r64_two_slices", launch_grad.GRAD_X, grad_x_one_block

    def transpose_b(p=p):   # lora_grad_h's B^T (launch_grad.b_as_shrink_a)
        launch_grad.launch_transpose_rank(p["B"].new_empty(4, 64, 768), p["B"])
    yield "transpose_b_r64", launch_grad.TRANSPOSE, transpose_b

    def segment_outer(p=p):
        launch_grad.launch_segment_outer(p["x"].new_empty(4, 64, 256), dh[:, 0], p["x"], p["rank"], *p["meta"],
                                         launch_grad.segment_outer_config(64, 256, 4))
    yield "segment_outer_r64", launch_grad.SEGMENT_OUTER, segment_outer

    # The backward's slice ops, every slice in one launch: dA (slices on grid axis 1), dB (slices' columns on
    # axis 0, dB^T's blocks stored through its strides), dh (the shrink over each slice's own columns).
    def grad_a(p=p):
        launch_grad.launch_lora_grad_a(p["x"].new_empty(4, 3, 64, 256), dh, p["x"], p["rank"], *p["meta"],
                                       launch_grad.segment_outer_config(64, 256, 12))
    yield "grad_a_r64", launch_grad.SEGMENT_OUTER, grad_a
    grad_out = torch.randn(256, 768, dtype=bf16)

    def grad_b(p=p):
        launch_grad.launch_lora_grad_b(p["x"].new_empty(4, 768, 64), dh, grad_out, p["rank"], [512, 128, 128],
                                       *p["meta"], launch_grad.segment_outer_config(64, 768, 4))
    yield "grad_b_r64", launch_grad.SEGMENT_OUTER, grad_b

    # dA and dB from 1024 tokens on a small grid: 128-token steps, 8 warps, 3 stages (launch_grad.DEEP_STEP).
    deep = launch_grad.segment_outer_config(64, 768, 4, num_tokens=4096)
    assert deep.block_t == launch_grad.DEEP_STEP["block_t"]

    def grad_a_deep(p=p):
        launch_grad.launch_lora_grad_a(p["x"].new_empty(4, 3, 64, 256), dh, p["x"], p["rank"], *p["meta"], deep)
    yield "grad_a_deep_r64", launch_grad.SEGMENT_OUTER, grad_a_deep

    def grad_b_deep(p=p):
        launch_grad.launch_lora_grad_b(p["x"].new_empty(4, 768, 64), dh, grad_out, p["rank"], [512, 128, 128],
                                       *p["meta"], deep)
    yield "grad_b_deep_r64", launch_grad.SEGMENT_OUTER, grad_b_deep

    def grad_h(p=p):
        a = p["B"].transpose(1, 2).contiguous().unsqueeze(1).expand(4, 3, 64, 768)   # B^T, every slice's A
        cfg = configs.heuristics.shrink_config(256, 512, 3, 64, 4)._replace(slice_group=1)
        grid = launch.shrink_grid(256, 3, 64, 4, cfg)
        sums = [s.alloc(cpu) for s in launch.shrink_sum_scratch(256, 3, 64, grid, cfg)]
        launch.launch_shrink(grad_out, a, p["scale"], p["rank"], *p["meta"], torch.empty(256, 3, 64), cfg,
                             sum_scratch=sums, slice_k=launch.slice_layout([512, 128, 128], 1)[0], write_all=True)
    yield "grad_h_r64", launch.SHRINK, grad_h

    # The one-launch batch metadata fill (lora_ops.kernels.batch): a decode batch of 4 slots (int32 slots, one
    # wide step; a LoRAContext's fill from host slots) and a 64-slot one (int64 slots, narrow steps, writing
    # the per-token slots too: a LoRAContext's fill from device slots).
    from lora_ops import launch_batch
    from lora_ops.batch import LoRABatch
    for name, M, L, dtype in (("batch_meta_l4", 64, 4, torch.int32), ("batch_meta_l64", 1000, 64, torch.int64)):
        b = LoRABatch(M, L)
        out = torch.empty(M, dtype=torch.int32) if dtype == torch.int64 else None

        def fill(M=M, L=L, dtype=dtype, b=b, out=out):
            launch_batch.fill_batch_meta(torch.zeros(M, dtype=dtype), L, *b.meta, slots_out=out)
        yield name, launch_batch.BATCH_META, fill


def float32_launches():
    """(label, launcher, run) of every kernel float32 launches on a GPU, in the configs a CUDA device resolves
    for it (configs' heuristic in heuristics.float32_tiles; launch_grad's float32 configs), at ranks 16, 64 and
    320 and 1 to 4096 tokens of a small qkv-like layer: what :func:`float32_spills` compiles."""
    from lora_ops import configs, launch, launch_grad
    from lora_ops.configs import tuning
    cpu, f32, gpu = torch.device("cpu"), torch.float32, torch.device("cuda")
    widths, K = [256, 128, 128], 512
    N, S = sum(widths), len(widths)
    for R in (16, 64, 320):
        p = tuning.synthetic_problem(cpu, f32, K, widths, R, 4, 64)
        dh = torch.randn(64, S, R)
        for M in (1, 64, 256, 4096):
            label = f"r{R} m{M}"
            scfg = configs.shrink_config(M, K, S, R, 4, gpu, f32, out_features=N)
            ecfg = configs.expand_config(M, N, S, R, 4, gpu, f32)
            fcfg = configs.fused_config(M, K, N, S, R, 4, gpu, f32)
            yield label + " shrink", launch.SHRINK, lambda p=p, c=scfg: launch.launch_shrink(
                p["x"], p["A"], p["scale"], p["rank"], *p["meta"], torch.zeros(64, S, R), c)
            yield label + " expand", launch.EXPAND, lambda p=p, c=ecfg: launch.launch_expand(
                p["y"], p["h"].unsqueeze(0), p["B"], widths, p["rank"], *p["meta"], c)
            if fcfg is not None:
                yield label + " fused", launch.FUSED, lambda p=p, c=fcfg: launch.launch_fused(
                    p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], widths, *p["meta"], c)
        yield f"r{R} grad_x", launch_grad.GRAD_X, lambda p=p, dh=dh: launch_grad.launch_lora_grad_x(
            torch.zeros(64, K), dh, p["A"], p["rank"], *p["meta"], launch_grad.grad_x_config(4096, K, R, S, True),
            write_all=True)
        yield f"r{R} grad_a", launch_grad.SEGMENT_OUTER, lambda p=p, dh=dh: launch_grad.launch_lora_grad_a(
            torch.empty(4, S, R, K), dh, p["x"], p["rank"], *p["meta"],
            launch_grad.segment_outer_config(R, K, 4 * S, True))
        yield f"r{R} grad_b", launch_grad.SEGMENT_OUTER, lambda p=p, dh=dh: launch_grad.launch_lora_grad_b(
            torch.empty(4, N, R), dh, p["y"], p["rank"], widths, *p["meta"],
            launch_grad.segment_outer_config(R, N, 4, True))


def float16_launches():
    """(label, launcher, run) of float16's expands on an H200 (add_lora_'s and the store mode's), in the
    configs the GPU resolves (the shipped table), at Llama-3-8B's layer shapes, ranks 128-320 and 64-4096
    tokens, one launch per distinct config: what :func:`float16_spills` compiles. float16's expand multiplies
    its float32 h in TF32, B widened in registers: some of bf16's tiles spill there, and spill-free tiles
    were slower on the H200 (DESIGN §4), so this is a diagnostic, not a test."""
    from lora_ops import configs, launch
    from lora_ops.configs import tuning
    cpu, f16, gpu = torch.device("cpu"), torch.float16, torch.device("cuda", 0)
    layers = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
              "down": (14336, [4096])}
    seen = set()
    which_gpu, configs._gpu = configs._gpu, lambda index: ("NVIDIA H200", (9, 0), 132)   # no GPU here
    try:
        for name, (K, widths) in layers.items():
            N, S = sum(widths), len(widths)
            for R in (128, 256, 320):
                for M in (64, 256, 1024, 4096):
                    scfg = configs.shrink_config(M, K, S, R, 4, gpu, f16, out_features=N)
                    for mode, cfg in (("expand", configs.expand_config(M, N, S, R, 4, gpu, f16)),
                                      ("store", configs.store_config(M, N, S, R, 4, K, gpu, f16))):
                        if (mode, S, R, cfg) in seen:
                            continue
                        seen.add((mode, S, R, cfg))
                        p = tuning.synthetic_problem(cpu, f16, 64, widths, R, 4, 64)   # K does not reach the expand

                        def run(p=p, widths=widths, cfg=cfg, scfg=scfg, mode=mode):
                            h = launch.shrink_buffer(p["x"], p["A"], scfg, cfg)
                            launch.launch_expand(p["y"], h, p["B"], widths, p["rank"], *p["meta"], cfg,
                                                 accumulate=mode == "expand")
                        yield f"{name} r{R} m{M} {mode} {tuple(cfg)}", launch.EXPAND, run
    finally:
        configs._gpu = which_gpu
        configs.reset()


def float16_spills():
    """{label: (registers, spill bytes)} of :func:`float16_launches`, compiled for sm_90."""
    return _usage(float16_launches())


def float32_spills():
    """{label: (registers, spill bytes)} of :func:`float32_launches`, compiled for sm_90."""
    return _usage(float32_launches())


def ptx_hashes():
    """{label: hash of the PTX} of every case, float32 and float16 launch: a kernel change that leaves them all
    equal compiles to the same instructions (no GPU needed to show a refactor changed nothing). Source
    positions (.loc, .file, the debug sections and their labels) are left out: moving code changes them."""
    import hashlib
    out = {}
    for label, compiled in _compiled([*cases(), *float32_launches(), *float16_launches()]):
        ptx = compiled.asm["ptx"].split(".section\t.debug")[0].split(".section .debug")[0]
        kept = [line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:$)", line)]
        out[label] = hashlib.sha1("\n".join(kept).encode()).hexdigest()[:16]
    return out


def _compiled(launches):
    """(label, sm_90 compile) of every kernel launch each (label, launcher, run) makes; a run's later launches
    labelled "label 1", "label 2", ..."""
    for label, launcher, run in launches:
        with recorded(launcher) as calls:
            run()
        for i, call in enumerate(calls):
            yield (f"{label} {i}" if i else label), compile_sm90(launcher.kernel, *call[1:])


def _usage(launches):
    return {label: ptxas_usage(compiled.asm["ptx"]) for label, compiled in _compiled(launches)}


def main(argv):
    """Compile every case; print a JSON object {case: summary} (the tests read it) or, with --table, a line
    per case. Run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled."""
    import json
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("sm90_codegen: unset TRITON_INTERPRET (interpreted kernels do not compile)")
    if "--float32-spills" in argv:
        print(json.dumps(float32_spills()))
        return
    if "--float16-spills" in argv:
        print(json.dumps(float16_spills()))
        return
    if "--ptx-hashes" in argv:
        print(json.dumps(ptx_hashes(), indent=1))
        return
    results = {}
    for name, launcher, run in cases():
        with recorded(launcher) as calls:
            run()
        results[name] = summary(compile_sm90(launcher.kernel, *calls[0][1:]))
    if "--table" in argv:
        for name, r in results.items():
            loads = ", ".join(f"{k} x{n}" for k, n in r["loads"].items())
            print(f"{name:30s} registers {r['registers']} spills {r['spill_bytes']} B | {loads} | wgmma A "
                  f"{r['wgmma_a']}")
    else:
        print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
