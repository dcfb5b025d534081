"""The kernels' loads as compiled for sm_90 (H100/H200), checked without a GPU (tests/sm90_codegen.py).

A run-time rank mask on the contiguous dimension once made every h and B load a 2- or 4-byte one and kept
the rank loop from pipelining them (H200: the high-rank grid 30-40% slower, docs/DESIGN.md §4). These
tests hold the fix in every kernel: bf16 operands never load 2 bytes at a time, no cp.async is narrower
than 16 bytes, and the rank loop streams its operands with 16-byte cp.async. Under PDL, the stacked
path's expand must not read y before it waits for the GEMM that writes it. The MMAs of the loops that
multiply a float32 operand split in registers read it from shared memory (kernels.work.dot_t: read from
registers by a pipelined wgmma, it raced on the H200).
"""
import json
import os
import subprocess
import sys

import pytest

import sm90_codegen

HERE = os.path.dirname(os.path.abspath(__file__))


def compiled(*flags):
    """sm90_codegen.py's JSON output for ``flags``, compiled in a subprocess without the interpreter."""
    try:
        import triton.backends
        has_nvidia = "nvidia" in triton.backends.backends
    except (ImportError, AttributeError):
        has_nvidia = False
    if not has_nvidia:
        pytest.skip("Triton's NVIDIA backend is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(HERE, "sm90_codegen.py"), *flags], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def codegen():
    return compiled()


def test_float32_gpu_configs_compile_without_spills():
    """float32's IEEE dots hold whole operand tiles in registers: in the bf16 tiles they spilled up to 53 KB a
    thread (DESIGN §4). Every kernel float32 launches on a GPU, in the configs a CUDA device resolves for it
    (heuristics.float32_tiles, launch_grad's float32 configs), at ranks 16-320 and 1-4096 tokens."""
    usage = compiled("--float32-spills")
    assert len(usage) >= 30
    spilled = {label: regs_spills for label, regs_spills in usage.items() if regs_spills[1]}
    assert not spilled, spilled


CASES = ["expand_one_block_r16", "expand_one_block_r64_n_loop", "expand_rank_loop_r320", "shrink_planes_r320",
         "expand_rank_loop_planes_r320", "expand_rank_loop_planes_store_r320",
         "expand_rank_loop_planes_in_turn_r320", "expand_pdl_r16",
         "expand_stacked_pdl_r16", "expand_stacked_pdl_rank_loop_r320", "shrink_split_k_r16", "fused_r16",
         "grad_x_r64", "grad_x_r64_n_loop4", "grad_x_one_block_r64_two_slices", "segment_outer_r64", "grad_a_r64",
         "grad_b_r64", "grad_a_deep_r64", "grad_b_deep_r64", "grad_h_r64", "transpose_b_r64", "batch_meta_l4",
         "batch_meta_l64"]
# segment_outer's 128-token steps on 3 stages (launch_grad.DEEP_STEP) issue as cp.async the 4-byte loads the
# 2-stage configs issue as ld.global (16 a stage against 20-23 there): not a narrowing of theirs, so the
# narrow cp.async check leaves them out, and test_deep_steps_pipeline_on_wgmma checks what they are for.
DEEP_CASES = ["grad_a_deep_r64", "grad_b_deep_r64"]


def test_every_compiled_case_is_checked(codegen):
    """CASES names the cases of sm90_codegen.cases() for readable ids: a case added there is checked here."""
    assert sorted(codegen) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_no_two_byte_loads(codegen, case):
    assert "ld.global 2 B" not in codegen[case]["loads"], codegen[case]


@pytest.mark.parametrize("case", [c for c in CASES if c not in DEEP_CASES])
def test_no_narrow_cp_async(codegen, case):
    narrow = {k: n for k, n in codegen[case]["loads"].items() if k.startswith("cp.async") and k != "cp.async 16 B"}
    assert not narrow, codegen[case]


@pytest.mark.parametrize("case", DEEP_CASES)
def test_deep_steps_pipeline_on_wgmma(codegen, case):
    """dA and dB in 128-token steps on 8 warps: a wgmma pipeline (the 2-stage 64-token configs compile to none),
    its 4-byte loads as many a stage as the 2-stage config's ld.global ones or fewer, no spills."""
    deep, shallow = codegen[case], codegen[case.replace("_deep", "")]
    assert deep["wgmma_a"] and not shallow["wgmma_a"], (deep, shallow)
    assert deep["loads"].get("cp.async 16 B", 0) > 0 and deep["spill_bytes"] == 0, deep
    assert deep["loads"]["cp.async 4 B"] // 3 <= shallow["loads"]["ld.global 4 B"], (deep, shallow)


@pytest.mark.parametrize("case", ["expand_rank_loop_r320", "expand_rank_loop_planes_r320",
                                  "expand_rank_loop_planes_store_r320", "expand_rank_loop_planes_in_turn_r320"])
def test_rank_loop_streams_its_operands(codegen, case):
    assert codegen[case]["loads"].get("cp.async 16 B", 0) > 0, codegen[case]


def test_planes_in_turn_pipeline_their_mmas(codegen):
    """The rank loop's lab variant with the planes taking turns (one dot a step) keeps a wgmma group in flight
    across steps (wait_group 1), which the shipped loop's two dots a step did not under Triton 3.6 and 3.9
    (only wait_group 0: the hi plane's MMAs run exposed, DESIGN §4); a stage holds one h block and B's, not
    two h blocks and B's, so less shared memory; no spills, no register operand."""
    turns, shipped = codegen["expand_rank_loop_planes_in_turn_r320"], codegen["expand_rank_loop_planes_r320"]
    assert 1 in turns["wgmma_waits"], turns["wgmma_waits"]
    assert turns["shared_bytes"] < shipped["shared_bytes"], (turns["shared_bytes"], shipped["shared_bytes"])
    assert turns["spill_bytes"] == 0 and turns["wgmma_a"].get("registers", 0) == 0, turns


def test_store_mode_loads_no_y(codegen):
    """The expand's store mode (y = the delta) compiles without the accumulating mode's y loads (16-byte
    vectors): no load at all, not a masked-off one, which still cost it 5-20% on the H200 (session 23).
    The two cases differ only in the mode; their other 16-byte loads are the same (token ids)."""
    store = codegen["expand_rank_loop_planes_store_r320"]["loads"]
    accumulate = codegen["expand_rank_loop_planes_r320"]["loads"]
    assert store.get("ld.global 16 B", 0) < accumulate["ld.global 16 B"], (store, accumulate)


@pytest.mark.parametrize("case", ["expand_stacked_pdl_r16", "expand_stacked_pdl_rank_loop_r320"])
def test_stacked_expand_reads_nothing_of_the_gemm_before_its_wait(codegen, case):
    """Behind the stacked GEMM (PDL), only the slot metadata, the token ids and the slot's scale (4-byte
    scalar loads) come before griddepcontrol.wait: y and h, which the GEMM writes, load as 16-byte vectors
    after it. add_lora_'s expand, whose y nobody writes meanwhile, loads y before its wait: the check can
    fail. One rank block: exactly add_lora_'s scalar loads plus the scale."""
    before = codegen[case]["loads_before_wait"]
    assert before is not None and set(before) == {"ld.global 4 B"}, codegen[case]
    reference = codegen["expand_pdl_r16"]["loads_before_wait"]
    assert any(k != "ld.global 4 B" for k in reference), reference
    if case == "expand_stacked_pdl_r16":
        assert before["ld.global 4 B"] == reference["ld.global 4 B"] + 1, (before, reference)


@pytest.mark.parametrize("case", ["expand_rank_loop_r320", "expand_rank_loop_planes_r320",
                                  "expand_rank_loop_planes_store_r320", "expand_rank_loop_planes_in_turn_r320",
                                  "grad_x_r64", "segment_outer_r64", "grad_a_r64", "grad_b_r64"])
def test_looped_mmas_read_the_float32_operand_from_shared_memory(codegen, case):
    """No wgmma of these kernels' loops takes its left operand from registers (before session 20 every one
    of them did, and the rank loop's wrote wrong values on the H200 in some runs). The float32 rank loop's
    last, partial rank block (masked operands, run once after the loop, not pipelined) still does: there
    the register operands are as many as the loop's shared ones. The planes' last block does not (the
    shrink stored zeros past the rank, so it multiplies them as loaded: session 22)."""
    a = codegen[case]["wgmma_a"]
    if case == "expand_rank_loop_r320":
        assert a.get("shared", 0) > 0 and a.get("registers", 0) <= a["shared"], a
    else:
        assert a.get("shared", 0) > 0 or not case.startswith("expand"), a
        assert a.get("registers", 0) == 0, a


def test_no_constexpr_has_a_string_default():
    """The device's Triton (3.6) hands a called @triton.jit function's string default in as a plain str and
    fails to compile it ("'str' object has no attribute 'type'"); Triton 3.9, which CI runs, wraps it. Session
    21 (2026-12-04) found every expand kernel broken on the H200 this way: kernels.work._mma's default
    "tf32". Callers pass every string constexpr."""
    import inspect
    functions = dict(sm90_codegen.jit_functions())
    found = [(name, p.name) for name, fn in functions.items() for p in inspect.signature(fn.fn).parameters.values()
             if isinstance(p.default, str)]
    assert functions, "no @triton.jit functions found"
    assert not found, found


def test_codegen_compiles_with_the_kernels_defaults():
    """A constexpr the launch leaves to its default compiles with that default (as a launch does), not None."""
    from lora_ops import launch
    values = sm90_codegen.launch_constexprs(launch.EXPAND.kernel, {"BLOCK_M": 64, "num_warps": 4})
    assert values["ACCUMULATE"] is True and values["H_PLANES"] == 0 and values["M_LOOP"] == 1
    assert values["BLOCK_M"] == 64 and "num_warps" not in values


def test_every_config_check_records_every_kernel_and_path():
    """tests/sm90_compile_every_config.py (run under the device's Triton before a device call) records the
    table's and the heuristic's launches of every kernel, with PDL on and off, none failing to record
    (compiling them all takes minutes: not here)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(HERE, "sm90_compile_every_config.py"), "--record-only"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["failures"] == []
    assert seen["kernels"] == ["expand_kernel", "fused_add_lora_kernel", "lora_grad_x_kernel", "segment_outer_kernel",
                               "shrink_kernel", "transpose_rank_kernel"]
    # labels of each path's first launch: the heuristic's, the table's (Llama-3-8B's entries first) and the backward
    assert {"backward", "heuristic", "llama3-8b"} <= set(seen["labels"]) and seen["pdl"] == ["Fals", "True"]


def test_grad_x_one_rank_block_loads_dh_in_vectors(codegen):
    """lora_grad_x's ONE_RANK_BLOCK path (two slices' dh, 2 x 64 columns, split once): dh loads once as 16-byte
    vectors (its slice and rank come from one index, j // 64 and j % 64), A streams through 16-byte cp.async, no
    spills. Its MMAs take dh's terms as a register operand, reloaded from shared memory each column block: safe
    only because every MMA is waited for (wait_group 0) before the next block; a pipelined one (wait_group 1)
    reading registers that the next step rewrites is the pattern that raced (kernels.work.dot_t)."""
    case = codegen["grad_x_one_block_r64_two_slices"]
    assert case["loads"].get("ld.global 16 B", 0) > 0 and case["loads"].get("cp.async 16 B", 0) > 0, case
    assert case["spill_bytes"] == 0 and case["wgmma_a"].get("registers", 0) > 0, case
    assert case["wgmma_waits"] and set(case["wgmma_waits"]) == {0}, case


def test_transpose_b_loads_vectors(codegen):
    """lora_grad_h's B^T copy (transpose_rank_kernel): B loads along the rank as 16-byte vectors only (torch's
    copy of the transposed view read element by element: 57 µs for Llama gate_up r64 on the H100, session 41)."""
    case = codegen["transpose_b_r64"]
    assert set(case["loads"]) == {"ld.global 16 B"} and case["spill_bytes"] == 0, case
