"""FlopCounterMode counts the LoRA ops (csrc_meta/flops.py): each adapted token at its slot's rank, tokens with
no adapter and empty slots not at all, the max rank for every token where the values cannot be read (fake
tensors); a LoRA model's forward and backward add up."""
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import lora_ops
from conftest import DEVICE, make_case
from csrc_meta.schemas import OPS

# (M, K, N, L, S, R)
SHAPES = [(37, 24, 40, 4, 3, 8), (9, 16, 12, 2, 1, 5), (0, 8, 6, 2, 2, 4)]
SHAPE_IDS = ["M37-S3", "M9-S1", "M0"]


def token_ranks(case):
    """Sum over tokens of their slot's rank (0 for slot -1; a rank outside [0, R] as the kernels clamp it):
    counted token by token."""
    R = case.shape[5]
    ranks = [min(max(r, 0), R) for r in case.rank.tolist()]
    return sum(ranks[s] for s in case.token_slots.tolist() if s >= 0)


def op_call(name, case):
    """(args of torch.ops.lora_ops.<name>, FLOPs per token-rank): random signed inputs of the case's shapes."""
    M, K, N, L, S, R = case.shape
    meta, widths, gen = tuple(case.meta), case.slice_widths, case.gen
    h = torch.randn(M, S, R, generator=gen)
    grad_out = torch.randn(M, N, generator=gen)
    if name == "shrink":
        return (case.x, case.lora_a, case.scale, case.rank, *meta), S * K
    if name == "expand_":
        return (case.new_y("random"), h, case.lora_b, widths, case.rank, *meta), N
    if name in ("add_lora_", "add_lora"):
        return (case.new_y("random"), case.x, case.lora_a, case.lora_b, case.scale, case.rank, widths, *meta), S * K + N
    if name == "lora_linear":
        weight = torch.randn(N, K, generator=gen)
        return (case.x, weight, torch.randn(N, generator=gen), case.lora_a, case.lora_b, case.scale, case.rank, widths,
                *meta), S * K + N
    if name == "lora_linear_stacked":
        stacked = torch.cat([torch.randn(N, K, generator=gen), case.lora_a.reshape(-1, K)])
        return (case.x, stacked, None, case.lora_b, case.scale, case.rank, widths, *meta), N
    if name in ("lora_grad_x", "lora_grad_a"):
        second = case.lora_a if name == "lora_grad_x" else case.x
        return (h, second, case.rank, *meta), S * K
    if name == "segment_outer":
        return (torch.randn(M, R, generator=gen), grad_out, case.rank, *meta), N
    if name == "lora_grad_h":
        return (grad_out, case.lora_b, case.scale, case.rank, widths, *meta), N
    assert name == "lora_grad_b"
    return (grad_out, h, case.rank, widths, *meta), N


def dense_flops(name, case):
    """What an op counts for every token whatever its slot: the base GEMM (lora_linear), the stacked GEMM."""
    M, K, N, L, S, R = case.shape
    return {"lora_linear": 2 * M * N * K, "lora_linear_stacked": 2 * M * (N + L * S * R) * K}.get(name, 0)


def counted(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops(), counter.get_flop_counts()["Global"]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_each_op_counts_its_tokens_at_their_slots_ranks(name, shape):
    case = make_case(*shape, seed=5)
    args, per_token_rank = op_call(name, case)
    total, by_op = counted(lambda: getattr(torch.ops.lora_ops, name)(*args))
    expected = dense_flops(name, case) + 2 * per_token_rank * token_ranks(case)
    assert total == expected
    nonzero = {op: n for op, n in by_op.items() if n}
    assert nonzero == ({getattr(torch.ops.lora_ops, name): expected} if expected else {})


def test_tokens_without_an_adapter_and_empty_slots_count_nothing():
    M, K, N, L, S, R = 12, 16, 20, 3, 2, 8
    case = make_case(M, K, N, L, S, R, ranks=[0, 8, 3], token_slots=[-1, 0, 0, 1, 2, -1, 1, 0, 2, 2, -1, 0], seed=2)
    args, per_token_rank = op_call("add_lora_", case)
    total, _ = counted(lambda: torch.ops.lora_ops.add_lora_(*args))
    assert token_ranks(case) == 2 * 8 + 3 * 3
    assert total == 2 * per_token_rank * (2 * 8 + 3 * 3)


# Every op: each formula passes its own R to the clamp and the bound (a width of another operand there, K or N,
# clamps nothing at these ranks and counted the bound at that width).
@pytest.mark.parametrize("name", sorted(OPS))
def test_ranks_outside_the_stack_count_as_the_kernels_clamp_them(name):
    """torch.ops does not check rank values (that would sync): the kernels clamp them to [0, R], and so does
    the count."""
    case = make_case(37, 24, 40, 4, 3, 8, ranks=[9, -1, 3, 100], seed=5)
    args, per_token_rank = op_call(name, case)
    total, _ = counted(lambda: getattr(torch.ops.lora_ops, name)(*args))
    assert 0 < token_ranks(case) < 37 * 8
    assert total == dense_flops(name, case) + 2 * per_token_rank * token_ranks(case)


@pytest.mark.parametrize("unreadable", ["fake_tensors", "meta_tensors"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_fake_and_meta_tensors_count_every_token_at_the_max_rank(name, unreadable):
    """No values to read: the count is the bound M * R token-ranks (plus lora_linear's base GEMM, the stacked
    GEMM), for fake tensors and for meta tensors outside any fake mode (a split model's layers on ``meta``)."""
    case = make_case(37, 24, 40, 4, 3, 8, seed=5)
    args, per_token_rank = op_call(name, case)
    M, K, N, L, S, R = case.shape
    if unreadable == "meta_tensors":
        meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        total, _ = counted(lambda: getattr(torch.ops.lora_ops, name)(*meta_args))
    else:
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            total, _ = counted(lambda: getattr(torch.ops.lora_ops, name)(*fake_args))
    assert total == dense_flops(name, case) + 2 * per_token_rank * M * R
    assert token_ranks(case) < M * R      # the real count is below the bound


def lora_model(K=16, H=24, N=8, adapted=7, M=10):
    """Two Linears with LoRA (ranks 4 and 3), `adapted` of M tokens on the adapter; returns (model, ctx)."""
    model = torch.nn.Sequential(torch.nn.Linear(K, H), torch.nn.Linear(H, N))
    ctx = lora_ops.apply_lora(model, ["0", "1"], max_loras=2, max_rank=4, max_tokens=32)
    ctx.load_adapter_tensors("a", {
        "base_model.model.0.lora_A.weight": torch.randn(4, K), "base_model.model.0.lora_B.weight": torch.randn(H, 4),
        "base_model.model.1.lora_A.weight": torch.randn(3, H), "base_model.model.1.lora_B.weight": torch.randn(N, 3)},
        {"r": 4, "lora_alpha": 8, "rank_pattern": {"1": 3}})
    ctx.set_batch([("a", adapted), (None, M - adapted)])
    return model, ctx


def test_a_real_model_under_a_fake_mode_counts_the_bound():
    """FlopCounterMode inside FakeTensorMode over a real model (its batch real, x fake): a read of the real
    counts would come back fake, so the count takes the bound, as for fake metadata."""
    torch.manual_seed(0)
    model, _ = lora_model()
    with FakeTensorMode(allow_non_fake_inputs=True):
        total, _ = counted(lambda: model(torch.randn(10, 16)))
    assert total == 2 * 10 * (16 * 24 + 24 * 8) + 2 * 10 * 4 * ((16 + 24) + (24 + 8))   # both stacks' R: 4


def test_a_lora_model_counts_base_and_delta_forward_and_backward():
    """apply_lora on two Linears (ranks 4 and 3, 7 of 10 tokens adapted): the forward counts each base GEMM and
    each delta; training the adapter, the backward counts each delta op at its tokens' ranks."""
    torch.manual_seed(0)
    K, H, N, M, adapted = 16, 24, 8, 10, 7
    model, ctx = lora_model(K, H, N, adapted, M)
    x = torch.randn(M, K)
    layers = [(K, H, adapted * 4), (H, N, adapted * 3)]     # (in, out, token-ranks)
    total, _ = counted(lambda: model(x))
    assert total == sum(2 * M * k * n + 2 * tr * (k + n) for k, n, tr in layers)

    x.requires_grad_(True)
    with ctx.train_slots("a"):
        y = model(x)
        _, by_op = counted(lambda: y.sum().backward())
    lora = {str(op).split(".")[-1]: n for op, n in by_op.items() if "lora_ops" in str(op)}
    assert lora == {
        "lora_grad_h": sum(2 * tr * n for k, n, tr in layers),       # dh = dy B
        "lora_grad_x": sum(2 * tr * k for k, n, tr in layers),       # the delta's dx = dh A
        "lora_grad_a": sum(2 * tr * k for k, n, tr in layers),       # dA = dh^T x
        "shrink": sum(2 * tr * k for k, n, tr in layers),            # h again, for dB
        "lora_grad_b": sum(2 * tr * n for k, n, tr in layers),       # dB = dy^T h
    }, by_op


REGISTERED = ("assert all(getattr(torch.ops.lora_ops, n) in sys.modules['torch.utils.flop_counter'].flop_registry "
              "for n in csrc_meta.OPS), 'not registered'\n")
IMPORT_ORDERS = {
    # torch.utils.flop_counter imports Triton, and Triton imported before TRITON_INTERPRET is set cannot
    # interpret (the tuner's --dry-run sets it after importing lora_ops): importing lora_ops imports neither.
    "lora_ops_first": "import lora_ops, csrc_meta\n"
                      "assert 'triton' not in sys.modules and 'torch.utils.flop_counter' not in sys.modules\n"
                      "import torch.utils.flop_counter\n",
    "flop_counter_first": "import torch.utils.flop_counter, lora_ops, csrc_meta\n",
    # a find_spec that loads nothing, then the import; a reload (which rebuilds the module's registry)
    "find_spec_first": "import importlib.util, lora_ops, csrc_meta\n"
                       "importlib.util.find_spec('torch.utils.flop_counter')\nimport torch.utils.flop_counter\n",
    "reloaded": "import importlib, lora_ops, csrc_meta, torch.utils.flop_counter as fc\nimportlib.reload(fc)\n",
}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_the_formulas_register_whichever_is_imported_first(order):
    import subprocess
    import sys
    code = "import sys, torch\n" + IMPORT_ORDERS[order] + REGISTERED
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda")
def test_cuda_tensors_count_exactly_and_a_capture_counts_the_bound():
    """On the GPU the count reads the device's rank and counts (a sync); inside a CUDA graph capture, where a
    sync is an error, it takes the bound instead."""
    case = make_case(37, 24, 40, 4, 3, 8, seed=5, device="cuda")
    args, per_token_rank = op_call("add_lora_", case)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    total, _ = counted(lambda: torch.ops.lora_ops.add_lora_(*args))
    assert total == 2 * per_token_rank * token_ranks(case)
    torch.ops.lora_ops.add_lora_(*args)        # compiled and warm before the capture
    torch.cuda.synchronize()
    with FlopCounterMode(display=False) as counter, torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.ops.lora_ops.add_lora_(*args)
    assert counter.get_total_flops() == 2 * per_token_rank * 37 * 8
