"""lora_linear's write-first path (DESIGN §4): from launch.WRITE_FIRST_MIN_TOKENS tokens and an output of
launch.WRITE_FIRST_MIN_Y_BYTES, with no bias, the expand *stores* the delta into a fresh y (ACCUMULATE=False:
rows of tokens without a delta get zeros) and cuBLAS adds the base product onto it (y.addmm_, beta = 1).

The store mode must write every row the metadata names, since y starts as torch.empty: checked here on a
NaN-poisoned y, on both expand paths (the whole rank in one block, and the rank loop), with slots of rank
0, tokens with slot -1 and stale token ids past M. The layer is checked against the float64 reference with
the threshold lowered, so the interpreter runs it at small sizes, and at the shipped threshold; there too y is
NaN-poisoned before the delta is written (write_calls), so no row passes on memory that happened to hold zeros.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, TOLERANCE, dtype_id, expand_reference, make_case, rel_err
from lora_ops import launch, ops
from lora_ops.configs.heuristics import ExpandConfig
from lora_ops.reference import lora_delta_reference

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (CUDA graphs)")

# (label, max rank, config): one rank block (ranks up to block_r, several column blocks a program), the
# rank loop (max rank above block_r: a GEMM over the rank per column block), and one rank block over three
# token tiles a program (m_loop).
EXPAND_PATHS = [("one_block", 16, ExpandConfig(16, 32, 16, 4, 2, 2)),
                ("rank_loop", 48, ExpandConfig(16, 32, 16, 4, 2, 1)),
                ("token_loop", 16, ExpandConfig(16, 32, 16, 4, 2, 1, 3))]


def run_layer(case, weight, bias=None, x=None):
    return ops.call("lora_linear", case.x if x is None else x, weight, bias, case.lora_a, case.lora_b, case.scale,
                    case.rank, list(case.slice_widths), *case.meta)


def layer_reference(case, weight, bias=None):
    base = F.linear(case.x.double().cpu(), weight.double().cpu(), None if bias is None else bias.double().cpu())
    return base + case.delta_reference()


@pytest.mark.parametrize("layer,N,M,expected", [
    ("qkv", 6144, 4096, True), ("gate_up", 28672, 1024, True), ("o", 4096, 8192, True),
    ("o", 4096, 4096, False), ("down", 4096, 1024, False), ("gate_up", 28672, 512, False),
    ("gate_up", 28672, 1023, False), ("40MiB", 10240, 2048, True), ("40MiB-8cols", 10232, 2048, False)])
def test_shipped_thresholds_choose_by_tokens_and_output_size(layer, N, M, expected):
    """Llama-3-8B outputs in bf16: y of 48 MiB or more from 1024 tokens writes first; y that fits in L2 (o and
    down at 4096 tokens: 32 MiB) keeps the accumulating order, and so does any batch below 1024 tokens. Both
    bounds are inclusive, checked at their edges: 1023 tokens of a 56 MiB y do not write first; a y of exactly
    40 MiB (WRITE_FIRST_MIN_Y_BYTES) does, 8 columns fewer does not."""
    x = torch.empty(M, 4096, dtype=torch.bfloat16, device="meta")
    assert launch.writes_first(x, N, None) is expected
    assert not launch.writes_first(x, N, torch.empty(N, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("label,max_rank,cfg", EXPAND_PATHS, ids=[p[0] for p in EXPAND_PATHS])
@pytest.mark.parametrize("M", [1, 13, 70])
def test_store_mode_writes_every_row(triton_backend, label, max_rank, cfg, M):
    """y (NaN everywhere before) = the delta: adapted rows as the float64 expand, the rest exactly 0."""
    dtype = torch.float16
    case = make_case(M, 32, 80, num_slots=3, num_slices=2, max_rank=max_rank, dtype=dtype,
                     device=triton_backend.device, seed=M + max_rank, ranks=[max_rank, 0, max_rank // 2 + 3],
                     capacity=M + 5)
    gen = torch.Generator().manual_seed(M)
    h = torch.randn(1, M, 2, max_rank, generator=gen).to(triton_backend.device)
    y = torch.full((M, 80), float("nan"), dtype=dtype, device=triton_backend.device)
    launch.launch_expand(y, h, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg, accumulate=False)
    ref = expand_reference(h[0], case.lora_b, case.rank, case.token_slots, case.slice_widths)
    none = (case.token_slots.cpu() < 0) | (case.token_slots.cpu() == 1)   # slot 1 has rank 0
    assert torch.isfinite(y).all()
    assert torch.equal(y[none.to(y.device)].cpu(), torch.zeros_like(y[none.to(y.device)].cpu()))
    assert rel_err(y, ref) <= TOLERANCE[dtype]


# The rank loop computes rows of a tile's invalid tokens from token 0's h (unwritten memory when token 0 has no
# adapter) and never stores them; the interpreter (numpy) warns when such a row holds inf/NaN garbage.
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_layer_matches_reference(backend, checked_dtype, write_first_from, write_calls, M):
    write_first_from(1)
    case = make_case(M, 256, 192, num_slots=4, num_slices=3, max_rank=16, dtype=checked_dtype,
                     device=backend.device, seed=M)
    gen = torch.Generator().manual_seed(M)
    weight = (torch.randn(192, 256, generator=gen) * 256 ** -0.5).to(dtype=checked_dtype, device=backend.device)
    assert rel_err(run_layer(case, weight), layer_reference(case, weight)) <= TOLERANCE[checked_dtype]
    assert len(write_calls) == (backend.name == "triton")   # the torch backend has no write-first path


def test_layer_at_the_shipped_threshold(triton_backend, write_first_from, write_calls):
    """The default threshold's token count, small features (the size threshold lifted): the path as a model
    at that batch takes it."""
    M = launch.WRITE_FIRST_MIN_TOKENS
    write_first_from(M)
    case = make_case(M, 32, 48, num_slots=4, num_slices=2, max_rank=8, dtype=torch.float32,
                     device=triton_backend.device, seed=5)
    weight = (torch.randn(48, 32, generator=torch.Generator().manual_seed(5)) * 32 ** -0.5).to(triton_backend.device)
    assert rel_err(run_layer(case, weight), layer_reference(case, weight)) <= TOLERANCE[torch.float32]
    assert len(write_calls) == 1


def test_bias_keeps_the_accumulating_path(triton_backend, write_first_from, write_calls):
    """A layer with a bias adds the delta after F.linear (the store mode has no bias to write)."""
    write_first_from(1)
    case = make_case(9, 32, 48, num_slots=2, num_slices=1, max_rank=8, dtype=torch.float32,
                     device=triton_backend.device, seed=9)
    weight = torch.randn(48, 32, device=triton_backend.device) * 32 ** -0.5
    bias = torch.randn(48, device=triton_backend.device)
    out = run_layer(case, weight, bias)
    assert not write_calls
    assert rel_err(out, layer_reference(case, weight, bias)) <= TOLERANCE[torch.float32]


@cuda_only
def test_write_first_in_a_cuda_graph(write_first_from):
    """Captured at the threshold, replayed with new x values and new slots written in place (more tokens
    with slot -1 than at capture): every replay matches the reference, every row written."""
    M, dtype = launch.WRITE_FIRST_MIN_TOKENS, torch.bfloat16
    write_first_from(M)
    case = make_case(M, 256, 192, num_slots=4, num_slices=3, max_rank=16, dtype=dtype, device="cuda", seed=1)
    weight = (torch.randn(192, 256, generator=torch.Generator().manual_seed(1)) * 256 ** -0.5).to(dtype).cuda()
    x = case.x.clone()

    for _ in range(2):   # warm-up: compile, configs
        run_layer(case, weight, x=x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_layer(case, weight, x=x)
    for seed in (2, 3):
        fresh = make_case(M, 256, 192, num_slots=4, num_slices=3, max_rank=16, dtype=dtype, device="cuda", seed=seed,
                          token_slots=torch.randint(-1, 4, (M,), generator=torch.Generator().manual_seed(seed)))
        x.copy_(fresh.x)
        case.batch.update(fresh.token_slots)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = F.linear(fresh.x.double().cpu(), weight.double().cpu()) + lora_delta_reference(
            fresh.x, case.lora_a, case.lora_b, case.scale, case.rank, fresh.token_slots, case.slice_widths)
        assert torch.isfinite(out).all(), seed
        assert rel_err(out, expected) <= TOLERANCE[dtype], seed
