"""Every Triton path gives the same bits on every run of the same inputs (no float atomics anywhere).

On the H200 the expand's rank loop once raced (session 20: a pipelined wgmma read registers the next rank
step overwrote; docs/DESIGN.md §4) and wrote wrong values into a few rows in some runs only: the value
checks passed whenever a run was lucky. Runs compared bit for bit catch that. On a GPU
(LORA_OPS_TEST_DEVICE=cuda) the shapes are the high-rank grid's with the shipped configs (Llama-3-8B o at
rank 320, 4096 tokens: the racing rows), where a race shows in a few runs; on the CPU, through the
interpreter, tiny shapes with the same code paths (there every run is sequential: the test checks that the
paths themselves hold no run-dependent state). The split-K shrink's sums (partials added in split order; for
lora_grad_h and the shrink op, by the last split to arrive, counted in zeroed counters) are run-dependent state
of their own: a case forces them where the heuristic never splits (every CPU shape here).
"""
import pytest
import torch

import lora_ops
from conftest import DEVICE, TOLERANCE, make_case, rel_err
from lora_ops import launch
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig
from lora_ops.configs.tuning import bits_of
from lora_ops.reference import lora_forward_reference

RUNS = 5
ON_GPU = DEVICE == "cuda"
# (M, K, N, slices, max rank, expand config or None for the table's / heuristic's); on the CPU tiny, with
# configs that take the same paths (the rank loop: rank 40 in steps of 16).
SHAPES = {
    "rank_loop": (4096, 4096, 4096, 1, 320, None) if ON_GPU else (40, 32, 48, 1, 40, ExpandConfig(16, 16, 16, 4, 2)),
    "rank_loop_qkv": ((1024, 3072, 5120, 3, 256, None) if ON_GPU
                      else (40, 32, 48, 3, 40, ExpandConfig(16, 16, 16, 4, 2))),
    "one_block": (1024, 4096, 4096, 1, 64, None) if ON_GPU else (40, 32, 48, 1, 16, None),
    "split_k": (1024, 4096, 4096, 1, 64, None) if ON_GPU else (24, 48, 48, 1, 16, None),
}
# Shrink configs forced per shape (the others take the table's / heuristic's): K in parts (on the CPU three
# 16-wide parts of 48 features: the shrink op's and lora_grad_h's, which count arrivals, and the forward's).
SHRINK_CONFIGS = {"split_k": ShrinkConfig(64, 64, 64, 4, 8, 3) if ON_GPU else ShrinkConfig(64, 16, 16, 3, 4, 2)}


def case_for(shape, dtype):
    M, K, N, S, R, _ = SHAPES[shape]
    return make_case(M, K, N, 4, S, R, dtype=dtype, device=DEVICE, seed=3, ranks=[R] * 4)


@pytest.fixture
def fresh_plans():
    """Plans hold the configs they were made with: none made under a forced config outlives the test."""
    launch.plan.clear()
    yield
    launch.plan.clear()


def forced_configs(shape, monkeypatch):
    """The shape's forced configs (its expand config, SHRINK_CONFIGS); returns the list of the shrink configs
    resolved since, forced or not."""
    cfg = SHAPES[shape][5]
    if cfg is not None:
        monkeypatch.setattr(lora_ops.configs, "expand_config", lambda *a, **k: cfg)
    resolved = []
    real = lora_ops.configs.shrink_config

    def shrink_config(*a, **k):
        resolved.append(SHRINK_CONFIGS.get(shape) or real(*a, **k))
        return resolved[-1]
    monkeypatch.setattr(lora_ops.configs, "shrink_config", shrink_config)
    return resolved


@pytest.mark.parametrize("shape", SHAPES)
def test_add_lora_gives_the_same_bits_every_run(triton_backend, bf16_interpreter, fresh_plans, shape, monkeypatch):
    shrinks = forced_configs(shape, monkeypatch)
    case = case_for(shape, torch.bfloat16)
    y_in = case.new_y("random")
    outs = []
    for _ in range(RUNS):
        y = y_in.clone()
        lora_ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                          slice_widths=case.slice_widths)
        outs.append(bits_of(y))
    differ = [int((o != outs[0]).sum()) for o in outs[1:]]
    assert not any(differ), f"values that differ from the first run, per run: {differ}"
    assert shape != "split_k" or shrinks, "the forward took the one-launch kernel: no split-K shrink ran"


@pytest.mark.parametrize("shape", ["rank_loop", "one_block", "split_k"])
def test_gradients_give_the_same_bits_every_run(triton_backend, bf16_interpreter, fresh_plans, shape,
                                                monkeypatch):
    shrinks = forced_configs(shape, monkeypatch)
    case = case_for(shape, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.lora_a, case.lora_b)]
    y = case.new_y("random")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(y.dtype).to(y.device)
    outs = []
    for _ in range(RUNS):
        for t in leaves:
            t.grad = None
        out = lora_ops.lora_forward(y, *leaves, case.scale, case.rank, batch=case.meta,
                                    slice_widths=case.slice_widths)
        out.backward(dy)
        outs.append([bits_of(t.grad.clone()) for t in leaves])
    for name, i in (("dx", 0), ("dA", 1), ("dB", 2)):
        differ = [int((o[i] != outs[0][i]).sum()) for o in outs[1:]]
        assert not any(differ), f"{name}: values that differ from the first run, per run: {differ}"
    # The same bits every run, and the right ones (the last run's, the first's bit for bit): against float64.
    ref = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = lora_forward_reference(y.double(), *ref, case.scale, case.rank, case.token_slots, case.slice_widths)
    ref_out.backward(dy.double())
    assert rel_err(out, ref_out) <= TOLERANCE[torch.bfloat16], "forward"
    for name, got, want in zip(("dx", "dA", "dB"), leaves, ref):
        assert rel_err(got.grad, want.grad) <= TOLERANCE[torch.bfloat16], (name, rel_err(got.grad, want.grad))
    if shape == "split_k":    # the forward's shrink, lora_grad_h's and dB's h (the backward's shrink op)
        assert len(shrinks) >= 3 and all(cfg.split_k > 1 for cfg in shrinks), shrinks
