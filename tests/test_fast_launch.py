"""The host-time shortcuts: lora_ops.triton_launch.FastLauncher and lora_ops.ops.call.

FastLauncher is tested twice: against a stand-in kernel on any machine (which launches take Triton's
path, what the shortcut passes to the C launcher), and with the real kernels on a GPU (results against
the float64 reference across token counts, misaligned views and dtypes, with the shortcut taken).
"""
import inspect

import pytest
import torch

import lora_ops
from conftest import DEVICE, TOLERANCE, make_case, rel_err
from lora_ops import launch, ops, triton_launch


class FakeCompiled:
    """What Triton's kernel[grid](...) returns: a compiled kernel whose .run is the C launcher."""
    function = "cu-function"
    packed_metadata = "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeKernel:
    """A @triton.jit stand-in: signature (x_ptr, n, stride, BLOCK: constexpr, FLAG: constexpr = 7)."""

    def __init__(self):
        self.signature = inspect.signature(lambda x_ptr, n, stride, BLOCK, FLAG=7: None)
        self.slow_launches = []
        self.compiled = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.slow_launches.append((grid, args, kwargs))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]
        return launch_


@pytest.fixture
def fake(monkeypatch):
    # Device 3's stream is 1003: a launch on another device's stream shows in the C-launcher call.
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 3)
    monkeypatch.setattr(triton_launch, "_current_stream", lambda device: 1000 + device)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", [])     # set_fast_launch elsewhere never sees this one
    kernel = FakeKernel()
    launcher = triton_launch.FastLauncher(kernel)
    launcher.enabled = True
    return kernel, launcher


def test_second_launch_of_a_key_goes_to_the_c_launcher(fake, monkeypatch):
    kernel, launcher = fake
    x, other = torch.randn(64), torch.randn(64)     # same dtype, both 16-byte aligned: one key
    launcher((3, 2), (x,), (10, 1), BLOCK=16, num_warps=4)
    assert len(kernel.slow_launches) == 1 and launcher.hits == 0
    launcher((5,), (x,), (10, 1), BLOCK=16, num_warps=4)
    assert len(kernel.slow_launches) == 1 and launcher.hits == 1
    # Another tensor, another stream and a 3-D grid: a hit launches with this call's, not the first launch's.
    monkeypatch.setattr(triton_launch, "_current_stream", lambda device: 2000 + device)
    launcher((7, 6, 4), (other,), (10, 1), BLOCK=16, num_warps=4)
    assert len(kernel.slow_launches) == 1 and launcher.hits == 2
    first, second = kernel.compiled[0].runs
    # grid padded to 3-D, the stream, the compiled function and metadata, no launch metadata or hooks,
    # then every parameter in signature order: runtime args, then constexprs (defaults filled in).
    assert first == (5, 1, 1, 1003, "cu-function", "packed", None, None, None, x, 10, 1, 16, 7)
    assert second[9] is other       # (checked by identity first: == on two tensors compares their values)
    assert second[:9] + second[10:] == (7, 6, 4, 2003, "cu-function", "packed", None, None, None, 10, 1, 16, 7)


@pytest.mark.parametrize("change", ["int value", "tensor dtype of the same size", "tensor 2 bytes off",
                                    "tensor 8 bytes off", "constexpr", "option", "current device"])
def test_a_changed_specialisation_takes_tritons_path(fake, monkeypatch, change):
    kernel, launcher = fake
    base = torch.randn(64, dtype=torch.float16)
    args, kwargs = [base, 32, 1], dict(BLOCK=16, num_warps=4)
    launcher((1,), (args[0],), (args[1], args[2]), **kwargs)
    if change == "int value":
        args[1] = 33                    # Triton specialises ints on divisibility by 16 and on == 1
    elif change == "tensor dtype of the same size":
        args[0] = base.to(torch.bfloat16)   # a key of the element size alone would take fp16's kernel
    elif change == "tensor 2 bytes off":
        args[0] = base[1:]
    elif change == "tensor 8 bytes off":
        args[0] = base[4:]              # still 8-byte aligned: only a 16-byte check tells
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        monkeypatch.setattr(triton_launch, "_current_device", lambda: 4)   # compiled kernels are per device
    launcher((1,), (args[0],), (args[1], args[2]), **kwargs)
    assert len(kernel.slow_launches) == 2 and launcher.hits == 0


def test_hooks_or_disabled_always_take_tritons_path(fake, monkeypatch):
    kernel, launcher = fake
    x = torch.randn(8)
    launcher((1,), (x,), (8, 1), BLOCK=8)       # the key is known: only the hook or the switch keeps it off
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: True)   # e.g. a profiler's launch hook
    for _ in range(3):
        launcher((1,), (x,), (8, 1), BLOCK=8)
    launcher.enabled = False
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    launcher((1,), (x,), (8, 1), BLOCK=8)
    assert len(kernel.slow_launches) == 5 and launcher.hits == 0
    assert launcher.bound((1,), (x,), (8, 1), dict(BLOCK=8)) is None     # nor does a plan's replay take it
    launcher.enabled = True
    launcher((1,), (x,), (8, 1), BLOCK=8)
    assert launcher.hits == 1                   # the key was there all along


@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"], ids=["enter", "exit"])
@pytest.mark.parametrize("hook, is_set", [(None, False), ("empty chain", False), ("chain", True), ("callable", True)])
def test_launch_hooks_are_detected(monkeypatch, which, hook, is_set):
    from triton import knobs

    class Chain:   # Triton >= 3.5 keeps the hooks in a HookChain, never None
        def __init__(self, calls):
            self.calls = calls

    value = {"empty chain": Chain([]), "chain": Chain([print]), "callable": print}.get(hook)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    monkeypatch.setattr(knobs.runtime, which, value)
    assert triton_launch._hooks_set() is is_set


def test_key_table_is_bounded(fake, monkeypatch):
    kernel, launcher = fake
    monkeypatch.setattr(triton_launch, "MAX_KEYS", 4)
    x = torch.randn(8)
    for n in range(10):
        launcher((1,), (x,), (n, 1), BLOCK=8)
    assert len(launcher._compiled) <= 4
    launcher((1,), (x,), (9, 1), BLOCK=8)       # the key that found the table full is kept all the same
    assert launcher.hits == 1


def test_interpreter_turns_the_shortcut_off():
    if DEVICE == "cuda":
        pytest.skip("the interpreter is off on the GPU run")
    assert not launch.SHRINK.enabled and not launch.EXPAND.enabled
    switches = triton_launch.switches()
    triton_launch.set_fast_launch(True)         # asking for it does not turn it on under the interpreter
    assert not any(launcher.enabled for launcher in (launch.SHRINK, launch.EXPAND, launch.FUSED))
    assert triton_launch.switches() > switches  # plans hold compiled kernels: lora_ops.plan keys on the count


@pytest.mark.parametrize("setting, enabled", [("0", False), ("1", True)])
def test_environment_switches_the_shortcut(monkeypatch, setting, enabled):
    """LORA_OPS_FAST_LAUNCH=0 turns it off where Triton would allow it."""
    monkeypatch.setattr(triton_launch, "_triton_allows_shortcut", lambda: True)
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", [])
    monkeypatch.setenv("LORA_OPS_FAST_LAUNCH", setting)
    assert triton_launch.FastLauncher(FakeKernel()).enabled is enabled


# ---- ops.call: straight to the kernel, or through the dispatcher when something needs it ----------

def _case():
    return make_case(9, 24, 20, num_slots=3, num_slices=2, max_rank=8, dtype=torch.float32, device=DEVICE, seed=3)


def _add(case, y):
    return ops.call("add_lora_", y, case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                    list(case.slice_widths), *case.meta)


def test_call_matches_the_op_and_bumps_the_version():
    case = _case()
    y_direct = case.new_y("random")
    y_op = y_direct.clone()
    version = y_direct._version
    _add(case, y_direct)
    torch.ops.lora_ops.add_lora_(y_op, case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                                 list(case.slice_widths), *case.meta)
    assert torch.equal(y_direct, y_op)
    assert y_direct._version > version
    assert ops.MUTATES_FIRST == {"add_lora_", "expand_"}   # read from the schemas' Tensor(a!)


def _in_place_args(name, case, y):
    if name == "add_lora_":
        return (y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, list(case.slice_widths), *case.meta)
    h = torch.randn(case.x.shape[0], case.lora_a.shape[1], case.lora_a.shape[2], generator=case.gen).to(DEVICE)
    return (y, h, case.lora_b, list(case.slice_widths), case.rank, *case.meta)


@pytest.mark.parametrize("route", ["torch.ops", "ops.call"])
@pytest.mark.parametrize("name", ["add_lora_", "expand_"])
def test_in_place_ops_bump_the_version_on_every_backend(backend, name, route):
    """A Triton kernel writes y through its pointer, unseen by the dispatcher: the registered kernel bumps
    y's version counter itself, so autograd refuses a backward that saved y before the write. (Through
    torch.ops the Triton path left it unmoved.)"""
    case = _case()
    y = case.new_y("random")
    version = y._version
    args = _in_place_args(name, case, y)
    if route == "torch.ops":
        getattr(torch.ops.lora_ops, name)(*args)
    else:
        ops.call(name, *args)
    assert y._version > version

    leaf = torch.randn(y.shape, device=DEVICE, requires_grad=True)
    saved = case.new_y("random")
    out = leaf * saved                          # saves `saved` for the backward
    getattr(torch.ops.lora_ops, name)(*_in_place_args(name, case, saved))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_call_under_inference_mode(backend):
    """Inference tensors have no version counter: the in-place op must not try to bump it. (On every backend:
    only the Triton kernels bump it themselves.)"""
    case = _case()
    expected = case.new_y("random")
    with torch.inference_mode():
        y = expected.clone()
        _add(case, y)
    torch.ops.lora_ops.add_lora_(expected, case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                                 list(case.slice_widths), *case.meta)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("route", ["torch.ops", "ops.call"])
@pytest.mark.parametrize("name", ["lora_linear", "shrink"])
def test_out_of_place_ops_leave_their_inputs_versions_alone(backend, name, route):
    """Only an op that writes its first argument (ops.MUTATES_FIRST) bumps a version counter: a bumped input (x,
    lora_linear's and shrink's first) would make autograd refuse a backward that saved it."""
    case = _case()
    weight = torch.randn(case.shape[2], case.shape[1], generator=case.gen).to(DEVICE)
    if name == "lora_linear":
        args = (case.x, weight, None, case.lora_a, case.lora_b, case.scale, case.rank, list(case.slice_widths),
                *case.meta)
    else:
        args = (case.x, case.lora_a, case.scale, case.rank, *case.meta)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    versions = [t._version for t in tensors]
    if route == "torch.ops":
        getattr(torch.ops.lora_ops, name)(*args)
    else:
        ops.call(name, *args)
    assert [t._version for t in tensors] == versions


def test_call_goes_through_the_dispatcher_under_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    case = _case()
    with Seen() as mode:
        _add(case, case.new_y("random"))
    assert any("lora_ops.add_lora_" in name for name in mode.ops), mode.ops


def test_the_dispatcher_runs_calls_autograd_must_see_without_a_function_of_ours():
    """ops.direct: add_lora_ (in place) has no autograd Function of ours, so a call autograd must see takes the
    dispatcher; lora_linear has one (ops.AUTOGRAD), unless it is switched off."""
    plain, wants_grad = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert not ops.direct("add_lora_", (wants_grad, plain))
    assert not ops.direct("add_lora_", (plain, plain, 3, wants_grad))     # any argument, not only the first
    with torch.no_grad():
        assert ops.direct("add_lora_", (wants_grad, plain))
    assert not ops.direct("add_lora_", (torch.nn.Parameter(torch.zeros(2), requires_grad=False),))  # a subclass
    assert ops.direct("add_lora_", (plain, plain, [1, 2]))
    assert ops.direct("lora_linear", (wants_grad, plain))
    ops.set_eager_autograd(False)
    try:
        assert not ops.direct("lora_linear", (wants_grad, plain))
    finally:
        ops.set_eager_autograd(True)


# ---- the real kernels on a GPU with the shortcut taken -------------------------------------------

@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (the shortcut is off elsewhere)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_results_with_the_shortcut(dtype):
    hits_before = launch.SHRINK.hits + launch.EXPAND.hits + launch.FUSED.hits
    for M in (1, 3, 64, 65, 300, 64, 3, 1):      # repeated sizes hit the key table
        for offset in (0, 1):                    # offset 1: x and y misaligned by one element
            case = make_case(M, 96, 80, num_slots=4, num_slices=2, max_rank=16, dtype=dtype, device="cuda",
                             seed=M + offset)
            x = torch.empty(M * 96 + offset, dtype=dtype, device="cuda")[offset:].view(M, 96)
            x.copy_(case.x)
            y = torch.full((M * 80 + offset,), float("nan"), dtype=dtype, device="cuda")[offset:].view(M, 80)
            y.zero_()
            lora_ops.add_lora(y, x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                              slice_widths=case.slice_widths)
            assert rel_err(y, case.delta_reference()) <= TOLERANCE[dtype], (M, offset)
    assert launch.SHRINK.hits + launch.EXPAND.hits + launch.FUSED.hits > hits_before


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (programmatic dependent launch)")
@pytest.mark.parametrize("M", [1, 64, 300])
def test_pdl_pair_gives_the_same_bits_eager_and_in_a_graph(M):
    from lora_ops import configs
    case = make_case(M, 96, 80, num_slots=4, num_slices=2, max_rank=16, dtype=torch.bfloat16, device="cuda",
                     seed=M)
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    outs = {}
    previous = launch._pdl["on"]
    configs.force_path("split")
    try:
        for on in (False, True):
            launch.set_pdl(on)
            y = case.new_y("zero")
            args = (y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
            pair = launch.add_lora_launches(*args)[0]
            assert [lc.constexprs["PDL"] for lc in pair] == [on and sm90] * 2
            launch.add_lora_(*args)
            eager = y.clone()
            y.zero_()
            graph = torch.cuda.CUDAGraph()
            launch.add_lora_(*args)                 # warm (compiled, planned) before the capture
            y.zero_()
            with torch.cuda.graph(graph):
                launch.add_lora_(*args)
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, eager), on
            assert rel_err(eager, case.delta_reference()) <= TOLERANCE[torch.bfloat16]
            outs[on] = eager
    finally:
        launch.set_pdl(previous)
        configs.force_path(None)
    assert torch.equal(outs[False], outs[True])   # same arithmetic, only the launch differs


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (Triton's C launcher)")
def test_gpu_plan_replay_through_the_c_launch_gives_the_same_bits(monkeypatch):
    """On Triton 3.6 a plan's replay calls the launcher's C ``launch`` itself (triton_launch.direct_launch):
    our kernels need no scratch, and y gets the bits the launcher's own ``__call__`` gives."""
    from lora_ops import plan
    allowed = triton_launch._direct_allowed()
    case = make_case(64, 96, 80, num_slots=4, num_slices=2, max_rank=16, dtype=torch.bfloat16, device="cuda",
                     seed=2)
    outs = []
    for direct in (allowed, False):
        monkeypatch.setattr(triton_launch, "_direct_allowed", lambda direct=direct: direct)
        plan.clear()
        for _ in range(2):                          # the plan, then its replay
            y = case.new_y("zero")
            launch.add_lora_(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths,
                             *case.meta)
        assert rel_err(y, case.delta_reference()) <= TOLERANCE[torch.bfloat16]
        outs.append(y)
    plan.clear()
    assert torch.equal(outs[0], outs[1])
    if allowed:   # every compiled shrink and expand of this process can take the direct launch
        monkeypatch.setattr(triton_launch, "_direct_allowed", lambda: True)
        compiled = [c for lc in (launch.SHRINK, launch.EXPAND) for c, _ in lc._compiled.values()]
        assert compiled and all(triton_launch.direct_launch(c) is not None for c in compiled)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (replays through the C launch)")
def test_gpu_replays_sharing_the_stream_workspace_keep_their_scratch_apart(monkeypatch):
    """add_lora_'s replays take h from one workspace per stream (lora_ops.plan): calls of two shapes back to
    back, PDL on, each into a fresh y, all against the float64 reference, the workspace poisoned with NaN
    first; a CUDA graph captured between them keeps scratch of its own, so eager calls in between do not
    disturb its replays."""
    from lora_ops import configs, plan
    from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig
    # Split-K partial sums (the expand adds them): h is [2, M, S, R], none of it zeroed, all in the workspace.
    monkeypatch.setattr(configs, "fused_config", lambda *a, **k: None)
    monkeypatch.setattr(configs, "shrink_config", lambda *a, **k: ShrinkConfig(16, 16, 32, 2, 4, 1))
    monkeypatch.setattr(configs, "expand_config", lambda *a, **k: ExpandConfig(16, 32, 16, 4, 1))
    cases = [make_case(M, 96, 80, num_slots=4, num_slices=2, max_rank=16, dtype=torch.bfloat16, device="cuda",
                       seed=M) for M in (64, 40)]
    refs = [case.delta_reference() for case in cases]

    def call(case, y):
        launch.add_lora_(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
        return y
    plan.clear()
    try:
        for case in cases:
            call(case, case.new_y("zero"))          # build the plans
            call(case, case.new_y("zero"))          # a replay: the stream's workspace now exists
        assert all(p.workspace is not None for p in plan._PLANS.values()) and plan._WORKSPACES
        for ws in plan._WORKSPACES.values():
            ws.fill_(255)                           # every float32 in it NaN: an unwritten read shows
        outs = [call(cases[i % 2], cases[i % 2].new_y("zero")) for i in range(40)]
        torch.cuda.synchronize()
        for i, y in enumerate(outs):
            assert rel_err(y, refs[i % 2]) <= TOLERANCE[torch.bfloat16], i
        y_graph = cases[0].new_y("zero")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(cases[0], y_graph)
        for _ in range(3):
            y_graph.zero_()
            graph.replay()
            y_eager = call(cases[1], cases[1].new_y("zero"))   # the workspace, right behind the replay
            torch.cuda.synchronize()
            assert rel_err(y_graph, refs[0]) <= TOLERANCE[torch.bfloat16]
            assert rel_err(y_eager, refs[1]) <= TOLERANCE[torch.bfloat16]
    finally:
        plan.clear()
