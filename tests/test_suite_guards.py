"""Checks on the test suite itself: a test meant for the GPU must run there. Session 48's first GPU run of two
aliasing tests found them building their case on the CPU, so their "triton-cuda" ids had only ever run the
interpreter; only Triton 3.6's interpreter refusing numpy 2 on the GPU machine showed it."""
import ast
import pathlib

import pytest

import lora_ops
from conftest import Backend, make_case, refuse_cpu_tensors_on_gpu_runs
from lora_ops import ops

TESTS = pathlib.Path(__file__).parent
DEVICE_FIXTURES = {"backend", "triton_backend", "triton_kernels"}   # conftest's: their tensors go on their device
CPU_ONLY = {   # tests that take a device fixture, build CPU tensors on purpose and skip off the CPU
    "test_x_sharing_y_memory_through_another_storage_is_read_as_it_was",   # numpy memory
}


def _cases_without_a_device(paths):
    """(file, test, line) of each make_case call without ``device=`` inside a test that takes a device fixture."""
    found = []
    for path in paths:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or fn.name in CPU_ONLY:
                continue
            if not DEVICE_FIXTURES & {a.arg for a in fn.args.args}:
                continue
            for call in ast.walk(fn):
                if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "make_case"
                        and not any(k.arg == "device" for k in call.keywords)):
                    found.append((path.name, fn.name, call.lineno))
    return found


def test_every_case_of_a_device_fixture_test_is_built_on_its_device():
    assert _cases_without_a_device(sorted(TESTS.glob("test_*.py"))) == []


def test_the_scan_sees_a_case_without_a_device(tmp_path):
    """The scan above finds what it looks for (a check that cannot fail is none)."""
    (tmp_path / "test_probe.py").write_text(
        "def test_probe(backend):\n    case = make_case(3, 4, 5, 2, 1, 4)\n\n"
        "def test_fine(backend):\n    case = make_case(3, 4, 5, 2, 1, 4, device=backend.device)\n\n"
        "def test_no_fixture():\n    case = make_case(3, 4, 5, 2, 1, 4)\n")
    assert _cases_without_a_device([tmp_path / "test_probe.py"]) == [("test_probe.py", "test_probe", 2)]


def test_cpu_tensors_under_the_cuda_backend_raise(triton_kernels, monkeypatch):
    """On a GPU run the backend fixtures make CPU tensors that reach the Triton kernels raise, naming the fix;
    checked here with the guard installed for a CUDA backend by hand (CPU tensors go to the Triton kernels)."""
    refuse_cpu_tensors_on_gpu_runs(monkeypatch, Backend("triton", "cuda"))
    case = make_case(3, 8, 6, num_slots=2, num_slices=1, max_rank=4, seed=1, token_slots=[0, -1, 1],
                     device="cpu")   # (on purpose: what the guard refuses)
    with pytest.raises(RuntimeError, match="device=backend.device"):
        lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)


def test_the_guard_leaves_cpu_backends_alone(monkeypatch):
    before = ops._check_interpreter
    for backend in (Backend("triton", "cpu"), Backend("torch", "cpu"), Backend("torch", "cuda")):
        refuse_cpu_tensors_on_gpu_runs(monkeypatch, backend)
    assert ops._check_interpreter is before
