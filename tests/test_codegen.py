"""The kernels' loads as compiled for sm_90 (H100/H200), checked without a GPU (tests/sm90_codegen.py).

A run-time rank mask on the contiguous dimension once made every h and B load a 2- or 4-byte one and kept
the rank loop from pipelining them (H200: the high-rank grid 30-40% slower, docs/DESIGN.md §4). These
tests hold the fix in every kernel: bf16 operands never load 2 bytes at a time, no cp.async is narrower
than 16 bytes, and the rank loop streams its operands with 16-byte cp.async.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def codegen():
    try:
        import triton.backends
        has_nvidia = "nvidia" in triton.backends.backends
    except (ImportError, AttributeError):
        has_nvidia = False
    if not has_nvidia:
        pytest.skip("Triton's NVIDIA backend is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(HERE, "sm90_codegen.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


CASES = ["expand_one_block_r16", "expand_one_block_r64_n_loop", "expand_rank_loop_r320", "shrink_split_k_r16",
         "fused_r16", "grad_x_r64", "segment_outer_r64"]


def test_every_compiled_case_is_checked(codegen):
    """CASES names the cases of sm90_codegen.cases() for readable ids: a case added there is checked here."""
    assert sorted(codegen) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_no_two_byte_loads(codegen, case):
    assert "ld.global 2 B" not in codegen[case]["loads"], codegen[case]


@pytest.mark.parametrize("case", CASES)
def test_no_narrow_cp_async(codegen, case):
    narrow = {k: n for k, n in codegen[case]["loads"].items() if k.startswith("cp.async") and k != "cp.async 16 B"}
    assert not narrow, codegen[case]


def test_rank_loop_streams_its_operands(codegen):
    assert codegen["expand_rank_loop_r320"]["loads"].get("cp.async 16 B", 0) > 0, codegen["expand_rank_loop_r320"]
