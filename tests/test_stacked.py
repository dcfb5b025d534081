"""lora_linear_stacked: every slot's A stacked under the base weight, so one GEMM gives the layer's output
and every slot's h; the expand then adds each token's slot's scaled h @ B^T (DESIGN §4). Checked against
float64 on both backends, the expand kernel's two paths on the Triton one, and the argument errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, dtype_id, expand_reference, make_case
from lora_ops import launch
from lora_ops.configs.heuristics import ExpandConfig
from test_kernels_property import (assert_delta_close, assert_one_rounding_step, assert_rows_bit_identical,
                                   assert_rows_equal)

K, N, L, S = 40, 75, 4, 3
WIDTHS = [41, 29, 5]


def stacked_problem(M, R, dtype, device, seed, with_bias=True, pad=0):
    """A case, its stacked weight [N + L·S·R + pad, K] (base weight over lora_a, then ``pad`` rows of NaN)
    and bias (zeros past N), with NaN in the rows of A past each slot's rank and in B past it (none of
    them may reach y); the base output F.linear(x, stacked, bias) as the op's GEMM computes it; the
    float64 delta."""
    case = make_case(M, K, N, L, S, R, dtype=dtype, device=device, seed=seed, slice_widths=WIDTHS,
                     ranks=[R, R // 2 + 1, 0, 3], capacity=M + 5)
    gen = torch.Generator().manual_seed(seed + 1)
    ref = case.delta_reference()
    weight = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype=dtype, device=device)
    bias = torch.randn(N, generator=gen).to(dtype=dtype, device=device) if with_bias else None
    past = torch.arange(R, device=device) >= case.rank[:, None].to(device)           # [L, R]
    lora_a = case.lora_a.masked_fill(past[:, None, :, None], math.nan)
    case.lora_b.masked_fill_(past[:, None, :], math.nan)
    stacked = torch.cat([weight, lora_a.reshape(-1, K), weight.new_full((pad, K), math.nan)])
    stacked_bias = None if bias is None else torch.cat([bias, bias.new_zeros(L * S * R + pad)])
    before = F.linear(case.x, stacked, stacked_bias)
    return case, stacked, stacked_bias, before, ref


def check_output(out, before, case, ref, dtype):
    y, y_in = out[:, :N], before[:, :N]
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")
    # Columns N.. are the GEMM's h, untouched (NaN where A held it).
    torch.testing.assert_close(out[:, N:], before[:, N:], rtol=0, atol=0, equal_nan=True)
    if dtype != torch.float32:
        # The delta of h as the GEMM wrote it (16-bit), rounded once onto y: assert_delta_close above is loose
        # enough at 16 bits to pass a delta rounded to y's dtype before the add (a second rounding; this fails it).
        delta, abs_bound = delta_of_stacked_h(before, case)
        assert_one_rounding_step(y, y_in, delta, abs_bound, case.lora_b.shape[2] + 4, dtype, None)


def delta_of_stacked_h(before, case):
    """float64 (delta, the delta with every term made positive) from columns N.. of the GEMM's output ``before``
    (each token's slot's h, as the GEMM rounded it) times the slot's scale, through B."""
    M, R = before.shape[0], case.lora_a.shape[2]
    h_all = before[:, N:N + L * S * R].double().cpu().view(M, L, S, R)
    slots = case.token_slots.cpu().clamp(min=0)                       # (slot -1 rows are not read)
    h = h_all[torch.arange(M), slots] * case.scale.double().cpu()[slots][:, None, None]
    return (expand_reference(h, case.lora_b, case.rank, case.token_slots, WIDTHS),
            expand_reference(h.abs(), case.lora_b.abs(), case.rank, case.token_slots, WIDTHS))


@pytest.mark.parametrize("with_bias,pad", [(True, 0), (False, 0), (True, 5)], ids=["bias", "no_bias", "bias-pad_5"])
@pytest.mark.parametrize("M,R", [(1, 16), (37, 24), (130, 80)], ids=["decode-r16", "M37-r24", "M130-r80"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_lora_linear_stacked_matches_reference(backend, checked_dtype, M, R, with_bias, pad):
    """pad: NaN rows after the stack (a tuned layout pads with zeros): their columns never reach y."""
    dtype = checked_dtype
    case, stacked, bias, before, ref = stacked_problem(M, R, dtype, backend.device, seed=M + R, with_bias=with_bias,
                                                       pad=pad)
    out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, bias, case.lora_b, case.scale, case.rank,
                                                 case.slice_widths, *case.meta)
    assert out.shape == (M, N + L * S * R + pad)
    check_output(out, before, case, ref, dtype)


@pytest.mark.parametrize("M", [1, 37], ids=["M1", "M37"])
def test_lora_linear_stacked_multiplies_the_prefix_the_table_pads(backend, monkeypatch, M):
    """Where the table pads this token count less than the stack holds (configs.stack_pad_at), the GEMM
    multiplies only W, A and that many padding rows: y and h as with the whole stack, the padding rows past
    it never read (NaN here)."""
    from lora_ops import configs, precision
    dtype = torch.float32
    case, stacked, _, before, ref = stacked_problem(M, 16, dtype, backend.device, seed=11, with_bias=False, pad=5)
    E = N + L * S * 16
    stacked[E:E + 2] = 0.0   # the two padding rows this count takes; the other three stay NaN
    asked, whole = [], precision.base_linear
    monkeypatch.setattr(configs, "stack_pad_at", lambda *a: asked.append(a) or 2)
    monkeypatch.setattr(precision, "base_linear", lambda *a: pytest.fail("the whole stack was multiplied"))
    # The rows the GEMM takes, counted: one padding row more leaves every column read right (padding is zero),
    # and only the GEMM's shape, the one thing the table chose, would differ.
    prefix_rows, prefix_gemm = [], precision.stack_prefix_gemm
    monkeypatch.setattr(precision, "stack_prefix_gemm",
                        lambda x, w, columns: prefix_rows.append(w.shape[1]) or prefix_gemm(x, w, columns))
    out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, None, case.lora_b, case.scale, case.rank,
                                                 case.slice_widths, *case.meta)
    assert asked and asked[0][:4] == (M, N, K, L * S * 16) and out.shape == (M, E + 5)
    assert prefix_rows == [E + 2]
    monkeypatch.setattr(precision, "base_linear", whole)
    full = F.linear(case.x, stacked[:E + 2])
    check_output(out[:, :E + 2], full, case, ref, dtype)
    assert torch.equal(out[:, E:E + 2], full.new_zeros(M, 2))
    # No entry (None) or one that pads this count fully: the whole stack, as before.
    for pad in (None, 5):
        monkeypatch.setattr(configs, "stack_pad_at", lambda *a, pad=pad: pad)
        out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, None, case.lora_b, case.scale, case.rank,
                                                     case.slice_widths, *case.meta)
        check_output(out, F.linear(case.x, stacked), case, ref, dtype)
    assert prefix_rows == [E + 2]   # (the two calls above: the whole stack's GEMM, no prefix)


def test_lora_linear_stacked_with_a_bias_multiplies_the_whole_stack(backend, monkeypatch):
    """With a bias the GEMM takes the whole stack whatever the table pads this count (stacked_prefix_rows: the
    prefix's mm into a column view has no bias to add): y keeps its bias, and every column is the whole stack's."""
    from lora_ops import configs
    dtype = torch.float32
    case, stacked, bias, before, ref = stacked_problem(37, 16, dtype, backend.device, seed=13, pad=5)
    monkeypatch.setattr(configs, "stack_pad_at", lambda *a: 2)
    out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, bias, case.lora_b, case.scale, case.rank,
                                                 case.slice_widths, *case.meta)
    check_output(out, before, case, ref, dtype)


# The expand kernel's two paths (whole rank in one block; the rank loop), each with one and two column blocks.
STACKED_PATHS = {
    "one_block-1_col_block": (ExpandConfig(16, 16, 32, 4, 2, 1), 24),
    "one_block-2_col_blocks": (ExpandConfig(16, 16, 32, 4, 2, 2), 24),
    "rank_loop-1_col_block": (ExpandConfig(32, 32, 16, 4, 3, 1), 40),
    "rank_loop-2_col_blocks": (ExpandConfig(16, 16, 16, 4, 2, 2), 40),
    "one_block-3_token_tiles": (ExpandConfig(16, 16, 32, 4, 2, 1, 3), 24),
}


@pytest.mark.parametrize("path", STACKED_PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_stacked_expand_kernel_paths(triton_backend, checked_dtype, path):
    dtype = checked_dtype
    cfg, R = STACKED_PATHS[path]
    M = 130 if cfg.m_loop > 1 else 37   # slots of more than one token tile
    case, stacked, bias, before, ref = stacked_problem(M, R, dtype, triton_backend.device, seed=5)
    out = before.clone()
    launch.launch_expand_stacked(out, N, case.lora_b, case.slice_widths, case.rank, case.scale, *case.meta, cfg)
    check_output(out, before, case, ref, dtype)


def test_stacked_h_is_the_unscaled_product_the_expand_reads(backend):
    """The op's columns N.. hold x A^T for every slot (the stack's h, unscaled), and its delta is each token's
    slot scale times that h @ B^T: checked on the op's own output against x and A in float64 (the test once
    checked only its own GEMM, and passed with the scale dropped from both backends)."""
    M, R = 9, 8
    case, stacked, bias, before, _ = stacked_problem(M, R, torch.float32, backend.device, seed=2)
    assert not torch.allclose(case.scale, torch.ones_like(case.scale))
    out = torch.ops.lora_ops.lora_linear_stacked(case.x, stacked, bias, case.lora_b, case.scale, case.rank,
                                                 case.slice_widths, *case.meta)
    h_all = out[:, N:N + L * S * R].double().cpu().view(M, L, S, R)
    a_rows = case.lora_a.double().cpu()                                        # [L, S, R, K], finite
    want = torch.einsum("mk,lsrk->mlsr", case.x.double().cpu(), a_rows)
    within = (torch.arange(R) < case.rank.cpu()[:, None])[None, :, None, :].expand_as(want)
    torch.testing.assert_close(h_all[within], want[within], rtol=1e-4, atol=1e-5)   # h from a float32 GEMM
    delta = out[:, :N].double().cpu() - before[:, :N].double().cpu()
    torch.testing.assert_close(delta, delta_of_stacked_h(out, case)[0], rtol=1e-4, atol=1e-5)


def test_stacked_weight_errors_name_the_argument():
    case, stacked, bias, _, _ = stacked_problem(5, 8, torch.float32, "cpu", seed=3)
    args = (case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
    op = torch.ops.lora_ops.lora_linear_stacked
    with pytest.raises(ValueError, match=r"stacked_weight: expected shape \[N \+ L\*S\*R \(\+ padding rows\), K\] "
                                         r"with N \+ L\*S\*R = 75 \+ 4\*3\*8 = 171"):
        op(case.x, stacked[:-1], None, *args)
    with pytest.raises(ValueError, match="stacked_weight: expected a contiguous"):
        op(case.x, torch.cat([stacked, stacked], 1)[:, :K], None, *args)
    with pytest.raises(ValueError, match=r"stacked_bias: expected shape \["):
        op(case.x, stacked, bias[:N], *args)
    with pytest.raises(ValueError, match=r"^stacked_weight \(its first N rows: the base weight\): expected shape"):
        op(case.x[:, :-1], stacked, None, *args)


# ---- LoRALinear(stack_a=True): the layer owns the stacked buffer ----------------------------------------

@pytest.fixture(autouse=True)
def toy_stacks_pay(monkeypatch):
    """The toy model's stacks (3 slots of rank 8 on 32-wide layers) are wider than half their base weight,
    where layers.stacked_token_limit leaves a layer unstacked; the tests want them stacked."""
    from lora_ops import layers
    monkeypatch.setattr(layers, "STACKED_MAX_ROWS_FRACTION", 4.0)


def stacked_models(dtype=torch.float32, device="cpu"):
    """A fused toy LM with LoRA twice, stack_a off and on, the same two adapters loaded into each."""
    from layer_helpers import PACKED, fused_copy, module_shapes, peft_tensors, toy_lm
    import lora_ops
    base = toy_lm(seed=1, dtype=dtype, device=device)
    models, ctxs = [], []
    for stack_a in (False, True):
        model = fused_copy(base).to(dtype=dtype, device=device)
        ctx = lora_ops.apply_lora(model, "all-linear", max_loras=3, max_rank=8, max_tokens=80,
                                  packed_modules=PACKED, stack_a=stack_a)
        for name, seed, r in (("a", 1, 8), ("b", 2, 4)):
            tensors = peft_tensors(module_shapes(base), r, seed, dtype=dtype)
            ctx.load_adapter_tensors(name, tensors, {"r": r, "lora_alpha": 2 * r})
        models.append(model)
        ctxs.append(ctx)
    return models, ctxs


# Whole-model logits: a float32 summation order that differs (one wider GEMM) moves the toy model's logits
# by up to ~1e-4 relative through attention; a wrong delta moves them by O(1).
MODEL_TOL = dict(rtol=1e-3, atol=1e-3)


def run_batch(model, ctx, requests, seed=0):
    ctx.set_batch(requests)
    tokens = sum(n for _, n in requests)
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids)


def stack_ops_used(monkeypatch):
    from lora_ops import ops
    used = []
    real = ops.call
    monkeypatch.setattr(ops, "call", lambda name, *a: used.append(name) or real(name, *a))
    return used


def test_stack_a_layer_matches_the_unstacked_one(monkeypatch):
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    layer = stacked.model.layers[0].self_attn.qkv_proj
    stack, _ = layer._stacked
    assert layer.base.weight.data_ptr() == stack.data_ptr()
    assert layer.lora_a.data_ptr() == stack[layer.base.weight.shape[0]:].data_ptr()
    requests = [("a", 5), (None, 3), ("b", 4)]
    used = stack_ops_used(monkeypatch)
    ours = run_batch(stacked, ctx1, requests)
    assert set(used) == {"lora_linear_stacked"}
    torch.testing.assert_close(ours, run_batch(plain, ctx0, requests), **MODEL_TOL)
    # One layer on one input: the two paths differ by float32 summation order only.
    x = torch.randn(12, layer.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), plain.model.layers[0].self_attn.qkv_proj(x), rtol=1e-5, atol=1e-5)


def test_stack_a_takes_lora_linear_past_its_token_limit_and_under_autograd(monkeypatch):
    from lora_ops import layers
    monkeypatch.setattr(layers, "STACKED_ALWAYS_TOKENS", 16)
    monkeypatch.setattr(layers, "STACKED_MAX_EXTRA_MACS", 0)
    monkeypatch.setattr(layers, "STACKED_MAX_Y_BYTES", 0)
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    assert {m.stacked_max_tokens for m in ctx1.layers.values()} == {16}
    used = stack_ops_used(monkeypatch)
    requests = [("a", 16), ("b", 1)]
    torch.testing.assert_close(run_batch(stacked, ctx1, requests), run_batch(plain, ctx0, requests), **MODEL_TOL)
    assert "lora_linear_stacked" not in used and "lora_linear" in used
    used.clear()
    run_batch(stacked, ctx1, [("a", 16)])
    assert set(used) == {"lora_linear_stacked"}
    ctx1.set_batch([("a", 6)])
    x = torch.randn(6, 32, requires_grad=True)
    layer = stacked.model.layers[0].self_attn.o_proj
    used.clear()
    layer(x).sum().backward()
    assert used[0] == "lora_linear" and "lora_linear_stacked" not in used and x.grad is not None


def test_stack_a_restacks_after_a_conversion_and_survives_loads():
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    stacked.half().float()   # two conversions, each re-stacking (values rounded alike in both models)
    plain.half().float()
    layer = stacked.model.layers[1].mlp.gate_up_proj
    stack, _ = layer._stacked
    assert stack.dtype == torch.float32 and layer.base.weight.data_ptr() == stack.data_ptr()
    assert layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)
    # A load after the conversion writes through the views into the stack.
    from layer_helpers import module_shapes, peft_tensors, toy_lm
    tensors = peft_tensors(module_shapes(toy_lm(seed=1)), 8, 9)
    for ctx in (ctx0, ctx1):
        ctx.load_adapter_tensors("a", tensors, {"r": 8, "lora_alpha": 8}, replace=True)
    requests = [("a", 7), ("b", 2)]
    # The two paths sum in different orders; through the half-rounded toy model that reached 1.8e-3 of one
    # logit of 576 on one CPU machine (2026-12-03). A stale A (a load not written through) differs by O(1).
    torch.testing.assert_close(run_batch(stacked, ctx1, requests), run_batch(plain, ctx0, requests),
                               rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("conversion", ["same_device", "half_then_float"])
def test_stack_a_keeps_its_parameters_through_conversions(conversion):
    """_stack made new parameters at every conversion: a model's .to() on its own device left an optimizer (and
    the trainer's gradient-mask hooks) on the old lora_a, which then never trained, silently. The parameters
    keep their identity now, and an optimizer built before the conversion trains the stacked layer."""
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    layers = list(ctx1.layers.values())
    before = [(layer.base.weight, layer.base.bias, layer.lora_a, layer.lora_b) for layer in layers]
    trainer = ctx1.train_slots(["a"])
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    stacked.to("cpu") if conversion == "same_device" else stacked.half().float()
    assert all(now is was for layer, params in zip(layers, before)
               for now, was in zip((layer.base.weight, layer.base.bias, layer.lora_a, layer.lora_b), params))
    assert all(layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a) for layer in layers)
    lora_a = [layer.lora_a.detach().clone() for layer in layers]
    ctx1.set_batch([("a", 6)])
    stacked(torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))).square().mean().backward()
    trainer.step(optimizer)
    trainer.close()
    a = ctx1.slot_of("a")
    assert all(not torch.equal(layer.lora_a[a], was[a]) for layer, was in zip(layers, lora_a))
    # Still the stack's views after the step (the optimizer wrote through them).
    assert all(layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a) for layer in layers)


def test_stack_a_keeps_a_tied_weight_tied():
    """A weight shared with another module (an output layer tied to the embedding) was replaced by a new
    parameter on the stacked layer: the two stopped being one tensor. Its data now becomes the view."""
    import lora_ops
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(24, 16), "head": torch.nn.Linear(16, 24, bias=False)})
    model["head"].weight = model["embed"].weight
    ctx = lora_ops.apply_lora(model, ["head"], max_loras=2, max_rank=4, max_tokens=16, stack_a=True)
    head = model["head"]
    assert head._stacked is not None and model["embed"].weight is head.base.weight
    assert model["embed"].weight.data_ptr() == head._stacked[0].data_ptr()
    del ctx


def test_a_weight_shared_by_two_stacked_layers_is_stacked_once():
    """Two wrapped layers on one weight parameter (tied, or one base layer in two models): the second stack
    re-pointed the shared parameter at itself, and the first layer's compiled graph (identity checks) read its
    own stale copy of W after an in-place update. The second layer runs unstacked, on the first one's view."""
    import lora_ops
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})
    model["b"].weight = model["a"].weight
    ctx = lora_ops.apply_lora(model, ["a", "b"], max_loras=2, max_rank=4, max_tokens=16, stack_a=True)
    a, b = model["a"], model["b"]
    assert a._stacked is not None and b._stacked is None and a.base.weight is b.base.weight
    ctx.set_batch([(None, 8)])
    x, new = torch.randn(8, 16), torch.randn(16, 16)
    with torch.no_grad():
        a.base.weight.copy_(new)

    def both(x):
        return a(x) + b(x)
    expected = 2 * x @ new.T + a.base.bias + b.base.bias
    torch._dynamo.reset()
    with torch.no_grad():
        for run in (both, torch.compile(both, fullgraph=True, backend="eager")):
            torch.testing.assert_close(run(x), expected, rtol=1e-5, atol=1e-5)
    model.half().float()            # a conversion restacks the first, leaves the second unstacked
    assert a._stacked is not None and b._stacked is None and a.base.weight is b.base.weight
    torch._dynamo.reset()


@pytest.mark.parametrize("first", ["fresh", "torch_load"])
def test_a_base_layer_wrapped_in_a_second_model_is_not_stacked_again(first):
    """One base nn.Linear in two models (an RL policy and its frozen reference): the second apply_lora stacked it
    again and re-pointed the weight, the first layer's views no longer intact. A layer restored by torch.load
    was not known as the weight's stack (its views intact, never re-stacked) and was re-pointed so."""
    import io
    import lora_ops
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(16, 16))
    lora_ops.apply_lora(policy, ["0"], max_loras=2, max_rank=4, max_tokens=16, stack_a=True)
    if first == "torch_load":
        buffer = io.BytesIO()
        torch.save(policy, buffer)
        buffer.seek(0)
        policy = torch.load(buffer, weights_only=False)
    layer = policy[0]
    reference = torch.nn.Sequential(layer.base)
    lora_ops.apply_lora(reference, ["0"], max_loras=2, max_rank=4, max_tokens=16, stack_a=True)
    assert reference[0]._stacked is None
    assert layer._stacked is not None and layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)


@pytest.mark.parametrize("parametrized", ["base_weight", "lora_a"])
@pytest.mark.parametrize("what", ["half", "deepcopy", "load_state_dict_assign"])
def test_a_parametrization_registered_after_apply_lora_unstacks_the_layer(monkeypatch, what, parametrized):
    """A parametrized base weight (or lora_a) registered after apply_lora: the re-stack of a conversion, a
    deep copy or an assigning load raised torch's "attribute 'weight' already exists". The layer runs
    unstacked from then on."""
    import copy
    import lora_ops

    class Twice(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    ctx = lora_ops.apply_lora(model, ["0"], max_loras=2, max_rank=4, max_tokens=16, stack_a=True)
    owner, name = (model[0].base, "weight") if parametrized == "base_weight" else (model[0], "lora_a")
    torch.nn.utils.parametrize.register_parametrization(owner, name, Twice())
    if what == "half":
        model = model.half().float()
    elif what == "deepcopy":
        model = copy.deepcopy(model)
    else:
        model.load_state_dict(model.state_dict(), assign=True)
    layer = model[0]
    # (A deep copy too: torch's parametrize gives a parametrized class a deepcopy of its own, which kept the
    # copied stack, unused, unless LoRALinear has one: LoRALinear.__deepcopy__.)
    assert layer._stacked is None
    layer.context.set_batch([(None, 4)])
    x = torch.randn(4, 16)
    weight = (2 * layer.base.parametrizations.weight.original if parametrized == "base_weight"
              else layer.base.weight)
    used = stack_ops_used(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ weight.T + layer.base.bias, rtol=1e-3, atol=1e-3)
    assert used and "lora_linear_stacked" not in used   # (lora_linear, or add_lora_ after a parametrized base)
    del ctx


def test_share_memory_keeps_the_stack_shared():
    """model.share_memory() moves the stack's storage in place, the views with it: _apply compared the new
    addresses with the old ones and restacked into private memory (a forked worker then served new adapters
    with lora_a stale)."""
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    stacked.share_memory()
    for layer in ctx1.layers.values():
        assert layer._stacked is not None and layer._stacked[0].is_shared()
        assert layer.base.weight.is_shared() and layer.lora_a.is_shared()
        assert layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)


def test_stack_a_falls_back_when_a_parameter_is_replaced(monkeypatch):
    """A base weight replaced by a new parameter is no longer the stack's view: that layer takes lora_linear, on
    the new weight. (New values: the stack still holds the old ones, so a layer that took it would differ.)"""
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    layer, reference = stacked.model.layers[0].self_attn.o_proj, plain.model.layers[0].self_attn.o_proj
    fresh = torch.randn(layer.base.weight.shape, generator=torch.Generator().manual_seed(4))
    layer.base.weight = torch.nn.Parameter(fresh.clone())
    with torch.no_grad():
        reference.base.weight.copy_(fresh)
    used = stack_ops_used(monkeypatch)
    requests = [("a", 4), ("b", 3)]
    torch.testing.assert_close(run_batch(stacked, ctx1, requests), run_batch(plain, ctx0, requests), **MODEL_TOL)
    x = torch.randn(7, layer.in_features, generator=torch.Generator().manual_seed(5))
    used.clear()
    with torch.no_grad():
        out = layer(x)
    assert used == ["lora_linear"]
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)   # (ctx0's batch: the same requests)


@pytest.mark.parametrize("how", ["load_state_dict_assign", "weight", "bias", "lora_a", "weight_set_then_to"])
def test_a_compiled_stacked_layer_follows_replaced_parameters(how):
    """A stacked layer under torch.compile took its stack whatever the parameters were (the pointer check is
    eager only): after load_state_dict(assign=True) or a parameter replaced by another, the compiled model
    computed with the old base weight and lora_a, silently. Now the load stacks the new tensors again, and a
    replacement compiles again, to lora_linear; both equal the unstacked model given the same parameters.
    A parameter's memory replaced in place (``set_``: remove_parametrizations(..., leave_parametrized=True)
    does it) is seen in eager mode only; the README's remedy, ``model.to(device)`` after it, stacks again."""
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    requests = [("a", 5), (None, 2), ("b", 3)]
    torch._dynamo.reset()       # (each model's layers compile their own entries: the recompile limit is shared)
    compiled = torch.compile(stacked, fullgraph=True, backend="eager")
    ctx1.set_batch(requests)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled(ids)                                   # compiled on the intact stack
        new_state = {k: torch.randn_like(v) if v.is_floating_point() and "scale" not in k else v.clone()
                     for k, v in plain.state_dict().items()}
        plain.load_state_dict(new_state)
        if how == "load_state_dict_assign":
            stacked.load_state_dict(new_state, assign=True)
            layer = stacked.model.layers[0].self_attn.qkv_proj
            assert layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)   # stacked again
        else:
            stacked.load_state_dict(new_state)
            layer, reference = stacked.model.layers[0].self_attn.o_proj, plain.model.layers[0].self_attn.o_proj
            owner, name = {"weight": (layer.base, "weight"), "bias": (layer.base, "bias"),
                           "lora_a": (layer, "lora_a"), "weight_set_then_to": (layer.base, "weight")}[how]
            fresh = torch.randn_like(getattr(owner, name))
            if how == "weight_set_then_to":
                getattr(owner, name).set_(fresh.clone())
                stacked.to(fresh.device)
                assert layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)
            else:
                setattr(owner, name, torch.nn.Parameter(fresh.clone(), requires_grad=False))
            target = reference.base if how != "lora_a" else reference
            getattr(target, name).copy_(fresh)
    with torch.no_grad():
        got = compiled(ids)
    torch._dynamo.reset()
    torch.testing.assert_close(got, run_batch(plain, ctx0, requests), **MODEL_TOL)


def test_stack_a_compiles_without_graph_breaks():
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    requests = [("a", 5), ("b", 3)]
    expected = run_batch(plain, ctx0, requests)
    ctx1.set_batch(requests)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(stacked, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), expected, **MODEL_TOL)


def test_stack_a_compiles_with_an_unbacked_token_count():
    """mark_unbacked (the README's way to serve one-token steps in the same graph): the stacked layer's branch
    on the token count took a guard on the unbacked size, and no graph compiled. It serves every count through
    lora_linear now, in one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(stacked, fullgraph=True, backend=counter)
    for tokens in (1, 2, 5):
        requests = [("a", tokens)] if tokens == 1 else [("a", tokens - 1), ("b", 1)]
        expected = run_batch(plain, ctx0, requests, seed=tokens)
        ctx1.set_batch(requests)
        ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        torch._dynamo.decorators.mark_unbacked(ids, 1)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids), expected, **MODEL_TOL)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_stacked_token_limit_on_llama_shapes(monkeypatch):
    """Where stack_a serves a layer: every batch up to STACKED_ALWAYS_TOKENS unless the stack is over half
    the base weight's rows; beyond, while y fits in STACKED_MAX_Y_BYTES and either the stack is narrow
    (STACKED_FREE_ROWS) or its extra multiply-adds stay under the budget."""
    from lora_ops import layers
    from lora_ops.layers import (STACKED_ALWAYS_TOKENS, STACKED_FREE_ROWS, STACKED_MAX_EXTRA_MACS,
                                 STACKED_MAX_Y_BYTES, stacked_token_limit)
    monkeypatch.setattr(layers, "STACKED_MAX_ROWS_FRACTION", 0.5)   # the shipped value (toy_stacks_pay raised it)
    assert STACKED_ALWAYS_TOKENS == 256 and STACKED_MAX_EXTRA_MACS == 2 ** 32
    assert STACKED_FREE_ROWS == 192 and STACKED_MAX_Y_BYTES == 64 << 20
    L = 4
    assert stacked_token_limit(6144, 4096, L * 3 * 320) == 0              # qkv, rank 320: 3840 rows > 3072
    assert stacked_token_limit(4096, 4096, L * 1 * 320) == 819            # o, rank 320: 2^32 / (4096 * 1280)
    assert stacked_token_limit(4096, 14336, L * 1 * 320) == 256           # down, rank 320: 234, raised to 256
    assert stacked_token_limit(4096, 4096, L * 1 * 64) == 4096            # o, rank 64: 2^32 / (4096 * 256)
    assert stacked_token_limit(6144, 4096, L * 3 * 64) == 1365           # qkv, rank 64
    assert stacked_token_limit(4096, 14336, L * 1 * 64) == 1170          # down, rank 64
    # Narrow stacks (<= 192 rows): while y (bf16) fits in 64 MiB, whatever the MACs.
    assert stacked_token_limit(4096, 14336, L * 1 * 16) == 8192          # down, rank 16: 64 MiB / (4096 * 2)
    assert stacked_token_limit(6144, 4096, L * 3 * 16) == 5461           # qkv, rank 16
    assert stacked_token_limit(28672, 4096, L * 2 * 16) == 1170          # gate_up, rank 16: y is wide
    assert stacked_token_limit(28672, 4096, L * 2 * 16, dtype=torch.float32) == 585
    assert stacked_token_limit(4096, 4096, L * 1 * 16, pad_rows=192) == 4096   # 256 rows: 2^32 / (4096 * 256)
    assert stacked_token_limit(4096, 4096, L * 1 * 16, pad_rows=128) == 8192   # 192 rows, still narrow: by y


def test_stack_a_pads_its_buffer_as_the_table_says(monkeypatch):
    """configs.stack_pad_rows: zero rows after A in the layer's buffer (its bias too); the layer's output,
    its token limit (the pad's MACs count) and a conversion's re-stack follow."""
    from lora_ops import configs, layers
    asked = []
    monkeypatch.setattr(configs, "stack_pad_rows", lambda N, K, E, device, dtype: asked.append((N, K, E)) or 5)
    # The toy stacks are narrow (<= STACKED_FREE_ROWS), whose limit is y's alone, padded or not: here no stack is
    # free and the MAC budget binds (between 256 tokens and y's limit), so the five padding rows lower the limit.
    monkeypatch.setattr(layers, "STACKED_FREE_ROWS", 0)
    monkeypatch.setattr(layers, "STACKED_MAX_EXTRA_MACS", 2 ** 24)
    (plain, stacked), (ctx0, ctx1) = stacked_models()
    layer = stacked.model.layers[0].self_attn.o_proj
    N, K = layer.base.weight.shape
    E = layer.lora_a.numel() // K
    stack, stack_bias = layer._stacked
    assert stack.shape == (N + E + 5, K) and (N, K, E) in asked
    assert torch.equal(stack[N + E:], stack.new_zeros(5, K))
    assert stack_bias is None or stack_bias.shape == (N + E + 5,)
    assert layer.stacked_max_tokens == layers.stacked_token_limit(N, K, E, pad_rows=5, dtype=stack.dtype)
    assert layer.stacked_max_tokens < layers.stacked_token_limit(N, K, E, dtype=stack.dtype)
    requests = [("a", 5), (None, 3), ("b", 4)]
    torch.testing.assert_close(run_batch(stacked, ctx1, requests), run_batch(plain, ctx0, requests), **MODEL_TOL)
    stacked.half().float()
    assert layer._stacked[0].shape == (N + E + 5, K) and layer._stack_intact(layer.base.weight, layer.base.bias,
                                                                              layer.lora_a)


def test_stack_entries_apply_to_their_exact_shape(pretend_gpu_table):
    """A "stack_pad" or "stack_limit" entry applies to its exact (N, K, L·S·R) on its GPU; anything else,
    the CPU, float32 and tables turned off get no padding and the rule's limit."""
    from lora_ops import configs, layers
    shape = dict(model="llama3-8b", layer="o", features=4096, in_features=4096, slices=1, rank=64, rows=256, tokens=1)
    buckets = [1, 16, 64, 256, 1024]
    entries = [dict(kind="stack_pad", pad=128, **shape),
               dict(kind="stack_pad", pad=96, buckets=[1, 16, 64, 256], bucket_pads=[32, 0, 96, 64],
                    **dict(shape, features=6144)),
               dict(kind="stack_pad", pad=160, buckets=[16, 64, 256, 1024], bucket_pads=[64, 0, 96, 160],
                    **dict(shape, layer="down", in_features=14336, rows=128)),
               dict(kind="stack_limit", max_tokens=256, buckets=[16, 64, 256, 1024],
                    **dict(shape, layer="down", in_features=14336, rows=128)),
               dict(kind="stack_limit", max_tokens=1024, buckets=buckets, **shape),              # won to 1024
               dict(kind="stack_limit", max_tokens=64, buckets=buckets, **dict(shape, rows=512))]  # lost past 64
    pretend_gpu_table(entries)
    cuda = torch.device("cuda", 0)
    rule = layers.stacked_token_limit(4096, 4096, 256)
    assert rule == 4096
    try:
        assert configs.stack_pad_rows(4096, 4096, 256, cuda, torch.bfloat16) == 128
        # One pad for every count without bucket_pads; with them, the pad of the bucket at or below the count's.
        assert [configs.stack_pad_at(M, 4096, 4096, 256, cuda, torch.bfloat16) for M in (1, 64, 4096)] == [128] * 3
        assert configs.stack_pad_rows(6144, 4096, 256, cuda, torch.bfloat16) == 96
        assert [configs.stack_pad_at(M, 6144, 4096, 256, cuda, torch.bfloat16)
                for M in (1, 2, 16, 17, 64, 200, 256, 1024, 8192)] == [32, 0, 0, 96, 96, 64, 64, 64, 64]
        # A first bucket above the count: its pad. A stack limit the layer lost past (256): the stack holds only
        # the rows of the buckets it serves, the limit's own (256: 96 rows) the most of them, and no count takes more.
        assert configs.stack_pad_at(1, 4096, 14336, 128, cuda, torch.bfloat16) == 64
        assert configs.stack_pad_rows(4096, 14336, 128, cuda, torch.bfloat16) == 96
        assert configs.stack_pad_at(1024, 4096, 14336, 128, cuda, torch.bfloat16) == 96
        assert configs.stack_pad_at(64, 6144, 4096, 512, cuda, torch.bfloat16) is None   # no entry: all of it
        assert configs.stack_limit_tokens(4096, 4096, 256, cuda, torch.bfloat16) == (1024, 1024)
        # Won at every bucket measured: the rule beyond (2^32 / (4096 * 256)); lost past 64: 64, not the rule's.
        assert layers.stacked_token_limit(4096, 4096, 256, device=cuda, dtype=torch.bfloat16) == rule
        assert layers.stacked_token_limit(4096, 4096, 512, device=cuda, dtype=torch.bfloat16) == 64
        assert layers.stacked_token_limit(4096, 4096, 512) == 2048
        for N, K, E, device, dtype in [(4096, 4096, 192, cuda, torch.bfloat16),
                                       (4096, 14336, 256, cuda, torch.bfloat16),
                                       (4096, 4096, 256, cuda, torch.float32), (4096, 4096, 256, None, torch.bfloat16)]:
            kw = {} if device is None else dict(device=device, dtype=dtype)   # None: the CPU's defaults
            assert configs.stack_pad_rows(N, K, E, **kw) == 0
            assert configs.stack_pad_at(64, N, K, E, **kw) is None
            assert configs.stack_limit_tokens(N, K, E, **kw) is None
        assert layers.stacked_token_limit(4096, 4096, 256, device=torch.device("cpu")) == rule
        configs.use_tuned_tables(False)
        assert configs.stack_pad_rows(4096, 4096, 256, cuda, torch.bfloat16) == 0
        assert layers.stacked_token_limit(4096, 4096, 256, device=cuda, dtype=torch.bfloat16) == rule
    finally:
        configs.use_tuned_tables(True)


def test_stack_a_takes_the_tables_token_limit(monkeypatch):
    """configs.stack_limit_tokens decides for the shapes it measured: a stack too wide for the rule is
    stacked up to the measured limit, a narrow one that never won is left unstacked."""
    from lora_ops import LoRAContext, LoRALinear, configs
    limits = {96: (7, 1024), 32: (0, 1024)}   # by L·S·R rows: (limit, largest bucket measured)
    monkeypatch.setattr(configs, "stack_limit_tokens", lambda N, K, E, device, dtype: limits.get(E))
    ctx = LoRAContext(4, 8)
    wide = LoRALinear(torch.nn.Linear(32, 48), ctx, 8, slice_widths=(16, 16, 16), stack_a=True)   # 96 rows > 24
    assert wide._stacked is not None and wide.stacked_max_tokens == 7
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():   # in place: lora_a is a view of the stack
        wide.lora_a.copy_(torch.randn(wide.lora_a.shape, generator=g))
        wide.lora_b.copy_(torch.randn(wide.lora_b.shape, generator=g))
        wide.rank.fill_(8)
        wide.scale.fill_(0.5)
    ctx.set_token_slots(torch.tensor([0, 3, -1, 1, 2]))
    x = torch.randn(5, 32, generator=g)
    with torch.no_grad():
        stacked = wide(x)
        wide.stacked_max_tokens = 0   # the same layer through lora_linear
        torch.testing.assert_close(stacked, wide(x), rtol=1e-5, atol=1e-5)
    narrow = LoRALinear(torch.nn.Linear(32, 64), ctx, 8, stack_a=True)                            # 32 rows
    assert narrow._stacked is None and narrow.stacked_max_tokens == 0


def test_stack_a_leaves_a_too_wide_layer_unstacked(monkeypatch):
    from lora_ops import LoRAContext, LoRALinear, layers
    monkeypatch.setattr(layers, "STACKED_MAX_ROWS_FRACTION", 0.5)
    ctx = LoRAContext(4, 8)
    base = torch.nn.Linear(32, 48)
    weight = base.weight
    wide = LoRALinear(base, ctx, 8, slice_widths=(16, 16, 16), stack_a=True)   # 4 * 3 * 8 = 96 rows > 24
    assert wide.stacked_max_tokens == 0 and wide._stacked is None and wide.base.weight is weight
    narrow = LoRALinear(torch.nn.Linear(32, 64), ctx, 8, stack_a=True)        # 32 rows <= 32
    assert narrow.stacked_max_tokens == layers.STACKED_MAX_Y_BYTES // (64 * 4) and narrow._stacked is not None
