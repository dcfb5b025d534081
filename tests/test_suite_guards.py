"""Checks on the test suite itself: a test meant for the GPU must run there. Session 48's first GPU run of two
aliasing tests found them building their case on the CPU, so their "triton-cuda" ids had only ever run the
interpreter; only Triton 3.6's interpreter refusing numpy 2 on the GPU machine showed it."""
import ast
import importlib.util
import pathlib
import re

import pytest

import conftest
import lora_ops
from conftest import Backend, make_case, refuse_cpu_tensors_on_gpu_runs
from lora_ops import ops

TESTS = pathlib.Path(__file__).parent
TRITON_ON_CUDA = Backend("triton", "cuda")
DEVICE_FIXTURES = {"backend", "triton_backend", "triton_kernels"}   # conftest's: their tensors go on their device
CPU_ONLY = {   # tests that take a device fixture, build CPU tensors on purpose and skip off the CPU
    "test_x_sharing_y_memory_through_another_storage_is_read_as_it_was",   # numpy memory
}


def _device_fixture_cases(paths):
    """(file, test, line, whether it passes ``device=``) of each make_case call inside a test that takes a device
    fixture."""
    found = []
    for path in paths:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or fn.name in CPU_ONLY:
                continue
            if not DEVICE_FIXTURES & {a.arg for a in fn.args.args}:
                continue
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "make_case":
                    found.append((path.name, fn.name, call.lineno, any(k.arg == "device" for k in call.keywords)))
    return found


def _cases_without_a_device(paths):
    """(file, test, line) of each make_case call without ``device=`` inside a test that takes a device fixture."""
    return [(name, test, line) for name, test, line, on_device in _device_fixture_cases(paths) if not on_device]


def test_every_case_of_a_device_fixture_test_is_built_on_its_device():
    paths = sorted(TESTS.glob("test_*.py"))
    # (A scan that found no files or no such tests would pass on anything: the suite holds dozens.)
    assert len(_device_fixture_cases(paths)) >= 20
    assert _cases_without_a_device(paths) == []


def test_the_scan_sees_a_case_without_a_device(tmp_path):
    """The scan above finds what it looks for (a check that cannot fail is none): under each of conftest's device
    fixtures, also where the call passes other keywords."""
    probes = "".join(f"def test_probe_{fixture}({fixture}):\n    case = make_case(3, 4, 5, 2, 1, 4, seed=1)\n\n"
                     for fixture in ("backend", "triton_backend", "triton_kernels"))
    (tmp_path / "test_probe.py").write_text(
        probes + "def test_fine(backend):\n    case = make_case(3, 4, 5, 2, 1, 4, device=backend.device)\n\n"
        "def test_no_fixture():\n    case = make_case(3, 4, 5, 2, 1, 4)\n")
    assert _cases_without_a_device([tmp_path / "test_probe.py"]) == [
        ("test_probe.py", "test_probe_backend", 2), ("test_probe.py", "test_probe_triton_backend", 5),
        ("test_probe.py", "test_probe_triton_kernels", 8)]


def _shrink_on_cpu_tensors_is_refused():
    case = make_case(3, 8, 6, num_slots=2, num_slices=1, max_rank=4, seed=1, token_slots=[0, -1, 1],
                     device="cpu")   # (on purpose: what the guard refuses)
    with pytest.raises(RuntimeError, match="device=backend.device"):
        lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)


def test_cpu_tensors_under_the_cuda_backend_raise(triton_kernels, monkeypatch):
    """On a GPU run CPU tensors that reach the Triton kernels raise, naming the fix; checked here with the guard
    installed for a CUDA backend by hand (CPU tensors go to the Triton kernels)."""
    refuse_cpu_tensors_on_gpu_runs(monkeypatch, TRITON_ON_CUDA)
    _shrink_on_cpu_tensors_is_refused()


@pytest.mark.parametrize("backend", [TRITON_ON_CUDA], ids=[TRITON_ON_CUDA.id], indirect=True)
def test_the_backend_fixtures_install_the_guard_on_a_gpu_run(triton_backend):
    """``backend`` (and ``triton_backend`` through it) given the CUDA Triton backend, as on a GPU run, installs the
    guard itself (its CPU tensors still reach the Triton kernels here, the interpreter, without it)."""
    _shrink_on_cpu_tensors_is_refused()


def test_triton_kernels_installs_the_guard_on_a_gpu_run(request, monkeypatch):
    """``triton_kernels`` where conftest's Triton backend is CUDA's (a GPU run) installs the guard itself."""
    monkeypatch.setattr(conftest, "BACKENDS", [Backend("torch", "cpu"), TRITON_ON_CUDA])
    request.getfixturevalue("triton_kernels")
    _shrink_on_cpu_tensors_is_refused()


def test_the_documented_gpu_run_makes_the_triton_backend_cudas(monkeypatch):
    """The variable the README's GPU command and gpu_session.sh set (``...=cuda python -m pytest``) is the one
    conftest reads: under it conftest's Triton backend is CUDA's. Another name there left a GPU run on the
    interpreter, every test passing. (conftest run again as a module of its own, with the variable set.)"""
    root = TESTS.parent
    variables = {path: set(re.findall(r"\b([A-Z_]+)=cuda\b", (root / path).read_text()))
                 for path in ("README.md", "benchmarks/gpu_session.sh")}
    for path, names in variables.items():
        assert names, f"no `NAME=cuda` in {path}'s test commands"
        for name in sorted(names):   # each file's variable alone (set together, one right name hid a wrong one)
            with monkeypatch.context() as env:
                for other in set.union(*variables.values()):
                    env.delenv(other, raising=False)
                env.setenv(name, "cuda")
                spec = importlib.util.spec_from_file_location("conftest_on_a_gpu", TESTS / "conftest.py")
                on_a_gpu = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(on_a_gpu)
            assert on_a_gpu.DEVICE == "cuda", f"{path}: {name}=cuda"
            assert ("triton", "cuda") in [(b.name, b.device) for b in on_a_gpu.BACKENDS], f"{path}: {name}=cuda"


def test_the_guard_leaves_cpu_backends_alone(monkeypatch):
    before = ops._check_interpreter
    for backend in (Backend("triton", "cpu"), Backend("torch", "cpu"), Backend("torch", "cuda")):
        refuse_cpu_tensors_on_gpu_runs(monkeypatch, backend)
    assert ops._check_interpreter is before
