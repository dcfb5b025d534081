"""lora_ops.plan: add_lora_'s launches kept per shape key and replayed with other tensors.

Replays are checked against the float64 reference on every path add_lora_ takes (one launch; two with
split-K partial sums; two with a shrink that sums its own splits in zeroed scratch), with fresh data and
poisoned outputs each call. What the key holds is checked by changing each part of it. The fast replay
(the compiled kernels' C launchers called with addresses) is checked against a stand-in compiled kernel
on any machine: the addresses and integers it passes, and the fallback for a misaligned tensor.
"""
import threading

import pytest
import torch

from conftest import DEVICE, TOLERANCE, add_lora_paths, force_add_lora_path, make_case, rel_err
from lora_ops import batch, configs, launch, ops, plan, triton_launch

R = 32
PATHS = add_lora_paths(R)


@pytest.fixture
def path_configs(monkeypatch, request):
    force_add_lora_path(monkeypatch, PATHS[request.param])
    return request.param


def call(case, y=None, x=None):
    y = case.new_y("zero") if y is None else y
    launch.add_lora_(y, case.x if x is None else x, case.lora_a, case.lora_b, case.scale, case.rank,
                     case.slice_widths, *case.meta)
    return y


def the_plan(case, y):
    return plan.lookup(plan.key(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths,
                                *case.meta))


@pytest.mark.parametrize("path_configs", list(PATHS), indirect=True)
def test_replays_match_the_reference(triton_kernels, path_configs):
    case = make_case(37, 48, 40, num_slots=3, num_slices=2, max_rank=R, device=DEVICE, seed=1,
                     ranks=[R, 5, 17])
    expected_scratch = {"fused": 0, "split": 1, "split_k_partials": 1, "split_k_summed": 3}[path_configs]
    for seed in range(3):   # the first call builds the plan, the others replay it with fresh data
        gen = torch.Generator().manual_seed(seed)
        case.x.copy_(torch.randn(case.x.shape, generator=gen))
        y = case.new_y("zero")
        y_poison = torch.full_like(y, float("nan"))   # a replay writing the wrong tensor shows here
        call(case, y)
        assert rel_err(y, case.delta_reference()) <= TOLERANCE[torch.float32], (path_configs, seed)
        assert torch.isnan(y_poison).all()
        known = the_plan(case, y)
        assert known is not None and len(known.scratch) == expected_scratch
        assert len(known.steps) == (1 if path_configs == "fused" else 2)
    assert len(plan._PLANS) == 1


def test_every_part_of_the_key_makes_its_own_plan(triton_kernels):
    """Each variant changes one part of add_lora_'s key (plan.key), or of an op's (plan.op_key: the shrink's
    dtypes), from a call made before it under the same config generation (the last two change that)."""
    case = make_case(20, 32, 24, num_slots=2, num_slices=2, max_rank=8, device=DEVICE, seed=2, ranks=[8, 3],
                     slice_widths=[16, 8])
    y = call(case)
    first = the_plan(case, y)
    assert first is not None
    sorted_ids, starts, counts = case.meta
    launch.shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta)
    x_strided = torch.empty(20, 64, device=DEVICE)[:, ::2]
    x_strided.copy_(case.x)
    b_strided = torch.empty(2, 8, 24, device=DEVICE).transpose(1, 2)
    b_strided.copy_(case.lora_b)
    counts_strided = torch.empty(2 * counts.shape[0], dtype=counts.dtype, device=DEVICE)[::2]
    counts_strided.copy_(counts)
    half = make_case(20, 32, 24, num_slots=2, num_slices=2, max_rank=8, dtype=torch.float16, device=DEVICE, seed=2,
                     ranks=[8, 3], slice_widths=[16, 8])

    def with_args(lora_b=case.lora_b, slice_widths=case.slice_widths, meta=case.meta):
        launch.add_lora_(case.new_y("zero"), case.x, case.lora_a, lora_b, case.scale, case.rank, slice_widths, *meta)
    variants = {
        "strided x": lambda: call(case, x=x_strided),
        "y's strides": lambda: call(case, y=torch.zeros(24, 20, device=DEVICE).t()),
        "B's strides": lambda: with_args(lora_b=b_strided),
        "slice widths": lambda: with_args(slice_widths=[8, 16]),
        "1-D strides": lambda: with_args(meta=(sorted_ids, starts, counts_strided)),
        "dtypes": lambda: call(half),
        "an op's dtypes": lambda: launch.shrink(half.x, half.lora_a, half.scale, half.rank, *half.meta),
        "config reset": lambda: (configs.reset(), call(case)),
        "shortcut switched": lambda: (triton_launch.set_fast_launch(True), call(case)),
    }
    for name, run in variants.items():
        before = len(plan._PLANS)
        run()
        assert len(plan._PLANS) == before + 1, name
    y = call(case)
    assert rel_err(y, case.delta_reference()) <= TOLERANCE[torch.float32]


def test_plans_switched_off_are_neither_kept_nor_used(triton_kernels):
    case = make_case(12, 16, 16, num_slots=2, num_slices=1, max_rank=4, device=DEVICE, seed=7)
    call(case)
    assert len(plan._PLANS) == 1
    try:
        plan.set_enabled(False)
        y = call(case)
        assert len(plan._PLANS) == 0
        assert rel_err(y, case.delta_reference()) <= TOLERANCE[torch.float32]
    finally:
        plan.set_enabled(True)
    call(case)
    assert len(plan._PLANS) == 1


def test_aliased_arguments_are_not_remembered(triton_kernels):
    case = make_case(8, 16, 16, num_slots=2, num_slices=1, max_rank=4, device=DEVICE, seed=3)
    sorted_ids, starts, counts = case.meta
    y = case.new_y("zero")
    # slot_counts passed as slot_starts too: a plan would replay a later call's slot_starts as its counts
    launch.add_lora_(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths, sorted_ids,
                     counts, counts)
    assert len(plan._PLANS) == 0


def test_a_misaligned_first_call_is_not_remembered(triton_kernels):
    """A plan's fast replay takes its kernels to be the ones Triton compiles for 16-byte-aligned tensors (a
    misaligned later call falls back): a first call with x 4 bytes off keeps no plan, and adds its delta."""
    case = make_case(24, 32, 32, num_slots=2, num_slices=1, max_rank=8, device=DEVICE, seed=5)
    x = torch.empty(24 * 32 + 1, device=DEVICE)[1:].view(24, 32)
    x.copy_(case.x)
    y = call(case, x=x)
    assert len(plan._PLANS) == 0
    assert rel_err(y, case.delta_reference()) <= TOLERANCE[torch.float32]


def test_the_table_of_plans_is_bounded(triton_kernels, monkeypatch):
    monkeypatch.setattr(plan, "MAX_PLANS", 2)
    for M in (3, 5, 7, 9):
        call(make_case(M, 16, 16, num_slots=2, num_slices=1, max_rank=4, device=DEVICE, seed=M))
        assert len(plan._PLANS) <= 2


def _op_calls(case, gen):
    """(name, Triton launcher call, torch CPU kernel call) for each op but add_lora_, on fresh data."""
    from lora_ops import cpu, cpu_grad, launch_grad
    M, K, N, L, S, R = case.shape
    meta = tuple(case.meta)
    cpu_meta = tuple(t.cpu() for t in meta)
    h = torch.randn(M, S, R, generator=gen).to(DEVICE)
    y = torch.randn(M, N, generator=gen).to(DEVICE)
    v = torch.randn(M, N, generator=gen).to(DEVICE)
    c = lambda t: t.cpu()  # noqa: E731

    def in_place(op, out, *args):
        op(out, *args)
        return out
    return [
        ("shrink", lambda: launch.shrink(case.x, case.lora_a, case.scale, case.rank, *meta),
         lambda: cpu.shrink(c(case.x), c(case.lora_a), c(case.scale), c(case.rank), *cpu_meta)),
        ("expand_", lambda: in_place(launch.expand_, y.clone(), h, case.lora_b, case.slice_widths, case.rank, *meta),
         lambda: in_place(cpu.expand_, c(y), c(h), c(case.lora_b), case.slice_widths, c(case.rank), *cpu_meta)),
        ("lora_grad_x", lambda: launch_grad.lora_grad_x(h, case.lora_a, case.rank, *meta),
         lambda: cpu_grad.lora_grad_x(c(h), c(case.lora_a), c(case.rank), *cpu_meta)),
        ("segment_outer", lambda: launch_grad.segment_outer(h[:, 1], v, case.rank, *meta),
         lambda: cpu_grad.segment_outer(c(h)[:, 1], c(v), c(case.rank), *cpu_meta)),
        ("lora_grad_h", lambda: launch_grad.lora_grad_h(y, case.lora_b, case.scale, case.rank, case.slice_widths,
                                                        *meta),
         lambda: cpu_grad.lora_grad_h(c(y), c(case.lora_b), c(case.scale), c(case.rank), case.slice_widths,
                                      *cpu_meta)),
        ("lora_grad_a", lambda: launch_grad.lora_grad_a(h, case.x, case.rank, *meta),
         lambda: cpu_grad.lora_grad_a(c(h), c(case.x), c(case.rank), *cpu_meta)),
        ("lora_grad_b", lambda: launch_grad.lora_grad_b(v, h, case.rank, case.slice_widths, *meta),
         lambda: cpu_grad.lora_grad_b(c(v), c(h), c(case.rank), case.slice_widths, *cpu_meta)),
    ]


def test_every_op_replays_its_plan(triton_kernels):
    case = make_case(29, 40, 36, num_slots=3, num_slices=2, max_rank=16, device=DEVICE, seed=6, ranks=[16, 0, 7])
    for seed in range(3):   # the first round builds each op's plan, the others replay them with fresh data
        gen = torch.Generator().manual_seed(seed)
        case.x.copy_(torch.randn(case.x.shape, generator=gen))
        for name, ours, reference in _op_calls(case, gen):
            # Memory the allocator may hand back to the replay's outputs: a zero-fill skipped shows as NaN.
            torch.full((1 << 16,), float("nan"), device=DEVICE)
            out, ref = ours(), reference()
            assert rel_err(out, ref) <= TOLERANCE[torch.float32], (name, seed)
        assert len(plan._PLANS) == len(_op_calls(case, gen)), seed


# ---- the fast replay against a stand-in compiled kernel --------------------------------------------

class FakeCompiled:
    function = "cu-function"
    packed_metadata = "packed"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


@pytest.fixture
def fake_compiled(monkeypatch, triton_kernels):
    """Every launcher enabled, its first launch of a key recorded instead of run; C-launcher calls in
    ``runs``: (grid x 3, stream, function, metadata, None x 3, pointers..., ints...)."""
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 5)
    monkeypatch.setattr(plan, "launch_device", lambda x: 5)       # as for CUDA tensors
    # Every tensor is on the faked current device (on a GPU run the case's CUDA tensors would otherwise be
    # "on another device" than 5, and the launchers' device switch could not make it current).
    # The batch metadata by the torch path: a Triton launch outside the recorded launchers would go to the
    # faked stream.
    monkeypatch.setattr(ops, "on_other_device", lambda t: None)
    monkeypatch.setattr(batch, "_one_launch", [False])
    # The stream of the device launched on (a wrong device shows in the C-launcher call)
    monkeypatch.setattr(triton_launch, "_current_stream", lambda device: 1234 if device == 5 else device)
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    runs, slow = [], []
    for launcher in (launch.SHRINK, launch.EXPAND, launch.FUSED):
        monkeypatch.setattr(launcher, "enabled", True)

        def first_launch(key, grid, tensors, ints, constexprs, launcher=launcher):
            slow.append(launcher)
            launcher._compiled[key] = (FakeCompiled(runs), ())
        monkeypatch.setattr(launcher, "_first_launch", first_launch)
        monkeypatch.setattr(launcher, "_compiled", {})
    return runs, slow


@pytest.mark.parametrize("path_configs", ["fused", "split_k_summed"], indirect=True)
def test_fast_replay_passes_this_calls_addresses(fake_compiled, path_configs):
    runs, slow = fake_compiled
    case = make_case(24, 32, 32, num_slots=2, num_slices=2, max_rank=R, device=DEVICE, seed=4)
    call(case)
    assert len(runs) == 0 and len(slow) > 0
    y, x = case.new_y("zero"), case.x.clone()      # another call: other tensors, same key
    call(case, y=y, x=x)
    # What the launches of this call are, built afresh (their scratch is theirs, not the replay's).
    launches, _, buffers = launch.add_lora_launches(y, x, case.lora_a, case.lora_b, case.scale, case.rank,
                                                    case.slice_widths, *case.meta)
    scratch = {id(b) for b in buffers}
    assert len(runs) == len(launches)
    for args, want in zip(runs, launches):
        grid = (tuple(want.grid) + (1, 1))[:3]
        assert args[:9] == (*grid, 1234, "cu-function", "packed", None, None, None)
        pointers = args[9:9 + len(want.tensors)]
        assert all(type(p) is int for p in pointers)
        assert [p for p, t in zip(pointers, want.tensors) if id(t) not in scratch] == [
            t.data_ptr() for t in want.tensors if id(t) not in scratch]
        assert args[9 + len(want.tensors):] == want.ints


class FakeCudaLauncher:
    """Triton 3.6's CudaLauncher as the replay sees it: ``__call__`` allocates scratch and calls ``launch``
    with the two launch flags and the scratch pointers in front of its arguments."""
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, direct, slow, scratch_size):
        self.global_scratch_size, self.profile_scratch_size = scratch_size, 0
        self.launch = lambda *args: direct.append(args)
        self.slow = slow

    def __call__(self, *args):
        self.slow.append(args)


@pytest.mark.parametrize("scratch_size", [0, 64], ids=["no_scratch", "scratch"])
@pytest.mark.parametrize("path_configs", ["split_k_summed"], indirect=True)
def test_fast_replay_calls_the_c_launch_where_triton_allows(fake_compiled, path_configs, monkeypatch,
                                                            scratch_size):
    """Where triton_launch.direct_launch allows it (Triton 3.6, no kernel scratch) a replay calls the
    launcher's C ``launch`` with the flags and no scratch in front, as CudaLauncher.__call__ would; a kernel
    that needs scratch goes through ``__call__``."""
    _, slow = fake_compiled
    direct, through_call = [], []
    monkeypatch.setattr(triton_launch, "_direct_allowed", lambda: True)
    for launcher in (launch.SHRINK, launch.EXPAND):
        def first_launch(key, grid, tensors, ints, constexprs, launcher=launcher):
            compiled = FakeCompiled([])
            compiled.run = FakeCudaLauncher(direct, through_call, scratch_size)
            launcher._compiled[key] = (compiled, ("tail",))
        monkeypatch.setattr(launcher, "_first_launch", first_launch)
    case = make_case(24, 32, 32, num_slots=2, num_slices=2, max_rank=R, device=DEVICE, seed=6)
    call(case)
    y, x = case.new_y("zero"), case.x.clone()
    call(case, y=y, x=x)
    launches, _, _ = launch.add_lora_launches(y, x, case.lora_a, case.lora_b, case.scale, case.rank,
                                              case.slice_widths, *case.meta)
    runs = direct if scratch_size == 0 else through_call
    assert len(runs) == len(launches) == 2 and not (through_call if scratch_size == 0 else direct)
    for args, want in zip(runs, launches):
        grid = (tuple(want.grid) + (1, 1))[:3]
        if scratch_size == 0:
            assert args[:13] == (*grid, 1234, "cu-function", False, True, None, None, "packed", None, None, None)
            args = args[13:]
        else:
            assert args[:9] == (*grid, 1234, "cu-function", "packed", None, None, None)
            args = args[9:]
        assert args[len(want.tensors):] == (*want.ints, "tail")
        assert x.data_ptr() in args[:len(want.tensors)] or y.data_ptr() in args[:len(want.tensors)]


@pytest.mark.parametrize("offset", [1, 2], ids=["4_bytes", "8_bytes"])
@pytest.mark.parametrize("path_configs", ["split"], indirect=True)
def test_fast_replay_falls_back_for_a_misaligned_tensor(fake_compiled, path_configs, offset):
    """x 4 or 8 bytes off (aligned to 8: only a 16-byte check tells) replays through FastLauncher."""
    runs, slow = fake_compiled
    case = make_case(24, 32, 32, num_slots=2, num_slices=1, max_rank=R, device=DEVICE, seed=5)
    call(case)
    call(case)
    assert len(runs) == 2                           # the replay: two C-launcher calls
    x = torch.empty(24 * 32 + offset, device=DEVICE)[offset:].view(24, 32)   # same key, misaligned
    x.copy_(case.x)
    slow_before, runs_before = len(slow), len(runs)
    call(case, x=x)
    # FastLauncher's path, whose key holds the alignment: the shrink (it reads x) compiles for a misaligned
    # x; the expand (it does not) finds its kernel.
    assert len(slow) == slow_before + 1 and len(runs) == runs_before + 1


# ---- scratch from the stream's workspace ------------------------------------------------------------

def _scratch_pointers(run_args, tensors):
    """The pointers of a C-launcher call that are none of ``tensors``' addresses (its scratch)."""
    known = {t.data_ptr() for t in tensors}
    return {p for p in run_args[9:] if type(p) is int and p > 4096 and p not in known}


@pytest.mark.parametrize("path_configs", ["split", "split_k_partials"], indirect=True)
def test_replays_take_add_lora_scratch_from_the_stream_workspace(fake_compiled, path_configs, monkeypatch):
    runs, _ = fake_compiled
    monkeypatch.setattr(plan, "_WORKSPACES", {})
    case = make_case(24, 32, 32, num_slots=2, num_slices=2, max_rank=R, device=DEVICE, seed=8)
    call(case)
    known = the_plan(case, case.new_y("zero"))
    assert known.workspace == (0,)                  # h alone, at the workspace's start
    for stream in (1234, 1234, 77):
        monkeypatch.setattr(triton_launch, "_current_stream", lambda device, s=stream: s)
        y, x = case.new_y("zero"), case.x.clone()
        before = len(runs)
        assert known.run((y, x, case.lora_a, case.lora_b, case.scale, case.rank, *case.meta)) == ()
        base = plan._WORKSPACES[(5, stream, threading.get_ident())].data_ptr()
        tensors = (y, x, case.lora_a, case.lora_b, case.scale, case.rank, *case.meta)
        shrink_args, expand_args = runs[before:]
        # the shrink writes h and the expand reads it at the workspace's start, on this stream
        assert shrink_args[3] == expand_args[3] == stream
        assert _scratch_pointers(shrink_args, tensors) == _scratch_pointers(expand_args, tensors) == {base}
    assert set(plan._WORKSPACES) == {(5, 1234, threading.get_ident()), (5, 77, threading.get_ident())}
    # Another host thread on the same stream takes a workspace of its own (threads enqueueing on one stream
    # interleave their launches); past MAX_WORKSPACES a call allocates its scratch.
    other = []
    thread = threading.Thread(target=lambda: other.append(plan.workspace_address(5, 77, case.x.device)))
    thread.start()
    thread.join()
    assert other[0] not in (plan._WORKSPACES[(5, 77, threading.get_ident())].data_ptr(), None)
    monkeypatch.setattr(plan, "MAX_WORKSPACES", len(plan._WORKSPACES))
    assert plan.workspace_address(5, 99, case.x.device) is None
    monkeypatch.setattr(triton_launch, "_current_stream", lambda device: 99)
    y, x = case.new_y("zero"), case.x.clone()
    assert len(known.run((y, x, case.lora_a, case.lora_b, case.scale, case.rank, *case.meta))) == 1


@pytest.mark.parametrize("path_configs", ["split"], indirect=True)
def test_replays_during_graph_capture_allocate_their_scratch(fake_compiled, path_configs, monkeypatch):
    """A graph keeps the addresses it was captured with: its scratch comes from the graph's own pool, never
    from the stream's workspace, which the stream's eager calls reuse."""
    runs, _ = fake_compiled
    monkeypatch.setattr(plan, "_WORKSPACES", {})
    case = make_case(24, 32, 32, num_slots=2, num_slices=2, max_rank=R, device=DEVICE, seed=10)
    call(case)
    known = the_plan(case, case.new_y("zero"))
    monkeypatch.setattr(plan, "_capturing", lambda x: True)
    y, x = case.new_y("zero"), case.x.clone()
    tensors = (y, x, case.lora_a, case.lora_b, case.scale, case.rank, *case.meta)
    before = len(runs)
    scratch = known.run(tensors)
    assert [tuple(t.shape) for t in scratch] == [tuple(s.shape) for s in known.scratch]
    assert not plan._WORKSPACES
    for args in runs[before:]:
        assert _scratch_pointers(args, tensors) == {scratch[0].data_ptr()}


def test_workspace_layout_aligns_and_refuses_what_it_cannot_hold(monkeypatch):
    h = launch.Scratch((8, 5, 3, 7), torch.float32)          # 3360 bytes
    parts = launch.Scratch((2, 5, 3, 7), torch.float32)
    counters = launch.Scratch((6,), torch.int32, zero=True)
    assert plan.workspace_layout((h, parts)) == (0, 3584)     # each start 256-byte aligned
    assert plan.workspace_layout((h, counters)) is None       # must start zeroed: allocated every call
    assert plan.workspace_layout(()) is None
    monkeypatch.setattr(plan, "WORKSPACE_BYTES", 4096)
    assert plan.workspace_layout((h,)) == (0,)
    assert plan.workspace_layout((h, parts)) is None          # 3584 + 840 > 4096


@pytest.mark.parametrize("path_configs", ["split_k_summed"], indirect=True)
def test_zeroed_scratch_is_allocated_every_call(fake_compiled, path_configs):
    case = make_case(24, 32, 32, num_slots=2, num_slices=2, max_rank=R, device=DEVICE, seed=9)
    call(case)
    known = the_plan(case, case.new_y("zero"))
    assert known.workspace is None
    scratch = known.run((case.new_y("zero"), case.x, case.lora_a, case.lora_b, case.scale, case.rank, *case.meta))
    assert [tuple(t.shape) for t in scratch] == [tuple(s.shape) for s in known.scratch]


def test_ops_that_return_their_scratch_never_take_the_workspace(fake_compiled, monkeypatch):
    """Every op but add_lora_ hands its scratch (h, dh, ...) to its caller: no workspace for it, also where
    its plan is fast (only then could it take one; here the ops on the stand-in launchers: the shrink and
    lora_grad_h) and its scratch would fit."""
    monkeypatch.setattr(plan, "WORKSPACE_BYTES", 1 << 30)
    case = make_case(29, 40, 36, num_slots=3, num_slices=2, max_rank=16, device=DEVICE, seed=6)
    gen = torch.Generator().manual_seed(0)
    kept = {}
    for name, ours, _ in _op_calls(case, gen):
        with plan.recording() as calls:
            ours()
        kept[name] = calls[-1][0]
    assert len(plan._PLANS) == len(kept) and None not in kept.values()
    for name in ("shrink", "lora_grad_h"):
        assert kept[name].fast and plan.workspace_layout(kept[name].scratch) is not None, name
    assert all(p.workspace is None for p in kept.values())
