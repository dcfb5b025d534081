"""lora_linear: the base GEMM plus the delta in one op, with the shrink on a side stream beside the GEMM.

On the CPU (both backends) the op runs the two in order; these tests check its results there too. The
side stream needs a GPU: eager with overlap forced on, and a CUDA graph captured in "auto" mode (where
the fork and join become graph edges), both against the float64 reference.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, TOLERANCE, dtype_id, make_case, rel_err
from lora_ops import launch, ops
from lora_ops.reference import lora_delta_reference

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (streams are CUDA's)")


def problem(M, dtype, device, seed):
    case = make_case(M, 256, 192, num_slots=4, num_slices=3, max_rank=16, dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(192, 256, generator=gen) * 256 ** -0.5).to(dtype=dtype, device=device)
    bias = torch.randn(192, generator=gen).to(dtype=dtype, device=device)
    return case, weight, bias


def run(case, weight, bias, x=None):
    return ops.call("lora_linear", case.x if x is None else x, weight, bias, case.lora_a, case.lora_b, case.scale,
                    case.rank, list(case.slice_widths), *case.meta)


def reference(case, weight, bias):
    base = F.linear(case.x.double().cpu(), weight.double().cpu(), bias.double().cpu())
    return base + case.delta_reference()


@pytest.fixture
def overlap_mode():
    yield launch.set_overlap
    launch.set_overlap("never")


# Rows of invalid tokens computed from unwritten h and never stored: see test_write_first's filter.
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_lora_linear_matches_reference(backend, checked_dtype, M):
    case, weight, bias = problem(M, checked_dtype, backend.device, seed=M)
    assert rel_err(run(case, weight, bias), reference(case, weight, bias)) <= TOLERANCE[checked_dtype]


@cuda_only
@pytest.mark.parametrize("M", [7, 64, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_side_stream_in_eager_matches_in_order(overlap_mode, dtype, M):
    case, weight, bias = problem(M, dtype, "cuda", seed=M)
    overlap_mode("never")
    in_order = run(case, weight, bias)
    overlap_mode("always")
    beside = run(case, weight, bias)
    torch.cuda.synchronize()
    assert torch.equal(beside, in_order)
    assert rel_err(beside, reference(case, weight, bias)) <= TOLERANCE[dtype]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=dtype_id)
def test_side_stream_in_a_cuda_graph(overlap_mode, dtype):
    """Captured in auto mode (the shrink forks to the side stream), replayed with new x values and new
    slots written in place: every replay matches the reference."""
    overlap_mode("auto")
    M = 64
    case, weight, bias = problem(M, dtype, "cuda", seed=1)
    x = case.x.clone()
    for _ in range(2):                           # warm-up: compile, configs
        run(case, weight, bias, x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(case, weight, bias, x)
    for seed in (2, 3):
        fresh, _, _ = problem(M, dtype, "cuda", seed=seed)
        x.copy_(fresh.x)
        case.batch.update(fresh.token_slots)     # in place: the captured kernels read the new metadata
        graph.replay()
        torch.cuda.synchronize()
        expected = F.linear(fresh.x.double().cpu(), weight.double().cpu(), bias.double().cpu()) + \
            lora_delta_reference(fresh.x, case.lora_a, case.lora_b, case.scale, case.rank, fresh.token_slots,
                                 case.slice_widths)
        assert rel_err(out, expected) <= TOLERANCE[dtype], seed


def test_a_layers_bound_call_stays_off_the_side_stream(triton_kernels, monkeypatch):
    """LoRALinear's bound eager calls (lora_ops.eager) replay an in-order plan: wherever lora_linear puts the
    shrink on a side stream (launch._overlaps: CUDA streams, pretended here so the CPU suite checks it), a
    layer neither replays a call bound in order nor binds one; the op's own path (which forks) serves it.
    In order again, the layer binds and replays, with the float64 reference's values."""
    from test_eager import call, fresh_input, make_layer, reference as layer_reference
    layer = make_layer(21)
    x = fresh_input(10, 0)
    out = call(layer, x)                                # bound in order
    assert layer._eager._calls
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(launch, "_overlaps", lambda t: True)
        assert layer._eager.replay(layer, x) is None
        layer._eager.clear()
        layer._eager.bind(layer, x, layer.base.weight, layer.base.bias, out, stacked=False)
    assert not layer._eager._calls and layer._eager.replays == 0
    call(layer, x)
    for seed in (1, 2):
        x = fresh_input(10, seed)
        assert rel_err(call(layer, x), layer_reference(layer, x)) <= TOLERANCE[torch.float32]
    assert layer._eager.replays == 2
