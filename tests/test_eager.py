"""lora_ops.eager: LoRALinear's bound eager calls.

A layer's second plain eager call with an input signature replays the plan its first call took, skipping
the op's checks and plan key. Checked here: on every path (accumulate, write-first, stack_a) the bound
call gives the op's output bit for bit and the float64 reference within tolerance, with fresh data per
call and the allocator's free memory poisoned; and each guard, when what it watches changes, sends the
call back down the op's own path (which then errors where the op errors, or binds again).
"""
import copy
import itertools
import re

import pytest
import torch
from torch import nn

from conftest import DEVICE, TOLERANCE, rel_err
from lora_ops import autograd, configs, eager, launch, ops, plan
from lora_ops.layers import LoRAContext, LoRALinear

K, WIDTHS, L, R = 32, (24, 8, 16), 3, 8
N = sum(WIDTHS)
RANKS = (8, 3, 0)


def make_layer(seed, bias=False, stack_a=False, M=10):
    gen = torch.Generator().manual_seed(seed)
    ctx = LoRAContext(L, 64, device=DEVICE)
    base = nn.Linear(K, N, bias=bias).to(DEVICE)
    layer = LoRALinear(base, ctx, R, WIDTHS)
    if stack_a:
        layer._stack()
        layer.stacked_max_tokens = 64
    for slot, r in enumerate(RANKS):
        slices = [(torch.randn(r, K, generator=gen), torch.randn(w, r, generator=gen) * 0.5) for w in WIDTHS]
        layer.write_slot(slot, [(a.to(DEVICE), b.to(DEVICE)) for a, b in slices], 0.5 + slot, r)
    set_slots(layer, M, seed)
    return layer


def set_slots(layer, M, seed):
    slots = torch.randint(-1, L, (M,), generator=torch.Generator().manual_seed(seed + 100), dtype=torch.int32)
    layer.context.set_token_slots(slots)
    return slots


def reference(layer, x, widths=None):
    """float64: the base layer plus each token's slot's scaled (x A^T) B^T per slice, at the slot's rank; the
    slices the layer's (``widths``: those instead)."""
    x64 = x.double().cpu()
    y = x64 @ layer.base.weight.detach().double().cpu().T
    if layer.base.bias is not None:
        y += layer.base.bias.detach().double().cpu()
    slots = layer.context.token_slots[:x.shape[0]].cpu()
    a, b = layer.lora_a.detach().double().cpu(), layer.lora_b.detach().double().cpu()
    offsets = layer.slice_offsets if widths is None else [0, *itertools.accumulate(widths)]
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        r = int(layer.rank[s])
        for i in range(len(WIDTHS)):
            lo, hi = offsets[i], offsets[i + 1]
            y[t, lo:hi] += float(layer.scale[s].detach()) * (x64[t] @ a[s, i, :r].T) @ b[s, lo:hi, :r].T
    return y


def fresh_input(M, seed):
    torch.full((1 << 16,), float("nan"), device=DEVICE)     # freed memory a skipped write would show
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def call(layer, x):
    with torch.no_grad():
        return layer(x)


def op_output(layer, x):
    """The same call down the op's own path (no bound calls)."""
    bound = dict(layer._eager._calls)
    layer._eager.clear()
    out = call(layer, x)
    layer._eager._calls = bound
    return out


PATHS = {"accumulate": dict(), "accumulate_bias": dict(bias=True), "write_first": dict(write_first=True),
         "stack_a": dict(stack_a=True), "stack_a_prefix": dict(stack_a=True, prefix=True)}


@pytest.mark.parametrize("path", list(PATHS))
def test_bound_calls_give_the_ops_output(triton_kernels, monkeypatch, path):
    opts = dict(PATHS[path])
    if opts.pop("write_first", False):
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 1)
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    prefix = opts.pop("prefix", False)
    if prefix:   # a stack of 5 padding rows of which these counts' GEMM takes 2 (configs.stack_pad_at)
        from lora_ops import configs
        monkeypatch.setattr(configs, "stack_pad_rows", lambda *args, **kw: 5)
        monkeypatch.setattr(configs, "stack_pad_at", lambda *args, **kw: 2)
    layer = make_layer(1, **opts)
    if prefix:
        assert layer._stacked[0].shape[0] == N + L * len(WIDTHS) * R + 5
    for M in (10, 7):
        set_slots(layer, M, M)
        call(layer, fresh_input(M, 0))                  # binds this signature
        for seed in (1, 2):
            x = fresh_input(M, seed)
            if seed == 2:   # weights changed in place replay with their new values (stack_a: W's rows of the stack)
                with torch.no_grad():
                    layer.base.weight.mul_(-1.5)
                    layer.lora_a.mul_(0.5)
            replays = layer._eager.replays
            out = call(layer, x)
            assert layer._eager.replays == replays + 1, (M, seed)
            assert torch.equal(out, op_output(layer, x)), (M, seed)
            assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32], (M, seed)
    assert len(layer._eager._calls) == 2      # one per input signature
    if prefix:   # the replays' GEMM took the prefix the table gives these counts, resolved when bound
        # (a view of the layer's own stack, taken when bound)
        stack = layer._stacked[0]
        assert {(b.stack_prefix.shape, b.stack_prefix.data_ptr()) for b in layer._eager._calls.values()} == {
            ((K, N + L * len(WIDTHS) * R + 2), stack.data_ptr())}


def test_the_torch_cpu_kernels_bind_nothing():
    if DEVICE == "cuda":
        pytest.skip("CPU tensors only")
    layer = make_layer(2)
    x = fresh_input(10, 0)
    call(layer, x)
    call(layer, x)
    assert layer._eager.replays == 0 and not layer._eager._calls


def replays_after(layer, x, change):
    """(replays of the call after ``change()``, its output): the signature bound first."""
    call(layer, x)
    change()
    before = layer._eager.replays
    out = call(layer, x)
    return layer._eager.replays - before, out


def _replace(layer, name, seed):
    """A new object for ``name`` (the base's weight or bias, an adapter Parameter, the scale or rank buffer, the
    context and so its metadata buffers), same shape, other values."""
    gen = torch.Generator().manual_seed(seed)
    if name in ("weight", "bias"):
        old = getattr(layer.base, name)
        setattr(layer.base, name, nn.Parameter(torch.randn(old.shape, generator=gen).to(DEVICE), requires_grad=False))
    elif name in ("lora_a", "lora_b"):
        new = torch.randn(getattr(layer, name).shape, generator=gen) * 0.5
        setattr(layer, name, nn.Parameter(new.to(DEVICE), requires_grad=False))
    elif name == "context":
        layer.context = LoRAContext(L, 64, device=DEVICE)
        set_slots(layer, 10, seed)
    elif name == "scale":
        layer.scale = torch.tensor([2.0, -1.0, 0.25], device=DEVICE)
    else:
        layer.rank = torch.tensor([4, 2, 0], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name", ["weight", "bias", "lora_a", "lora_b", "scale", "rank", "context"])
def test_every_replaced_tensor_takes_the_op_path_and_binds_again(triton_kernels, name):
    """Each tensor the bound call was bound to, replaced by a new object of the same shape and other values:
    the next call takes the op's path (a replay of the old binding is stale; the identity guards), with the
    new values, and the call after it replays its new binding with them too."""
    layer = make_layer(3, bias=True)
    x = fresh_input(10, 0)
    n, out = replays_after(layer, x, lambda: _replace(layer, name, 7))
    assert n == 0 and rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    n, out = replays_after(layer, x, lambda: None)
    assert n == 1 and rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]


def test_new_slice_widths_take_the_op_path(triton_kernels):
    """The slice widths are baked into the plan (its key holds them; a replay passes none): other widths of the
    same count and sum must not replay the old plan, whose slices would pair lora_a's rows with the old
    columns of lora_b."""
    layer = make_layer(3)
    x = fresh_input(10, 0)
    n, out = replays_after(layer, x, lambda: setattr(layer, "slice_widths", (8, 24, 16)))
    assert n == 0 and rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    assert rel_err(out, reference(layer, x, WIDTHS)) > 0.01       # (the widths change the output)
    n, out = replays_after(layer, x, lambda: None)
    assert n == 1 and rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]


def test_an_input_of_other_strides_or_dtype_does_not_replay_anothers_plan(triton_kernels):
    """The input's strides and dtype are in the bound call's key: an input of the bound shape laid out
    column-major must not replay the row-major plan (its kernels index x by the strides they were built for);
    it binds a call of its own, each right on the next calls. A float16 input reaches the op's dtype check."""
    layer = make_layer(3)
    rows = fresh_input(10, 0)
    call(layer, rows)
    for seed in (1, 2):
        cols = fresh_input(10, seed).t().contiguous().t()        # [10, K], strides (1, 10)
        before = layer._eager.replays
        out = call(layer, cols)
        assert layer._eager.replays == before + (seed - 1), seed
        assert rel_err(out, reference(layer, cols)) <= TOLERANCE[torch.float32], seed
    assert len(layer._eager._calls) == 2
    with pytest.raises(TypeError, match=re.escape("weight: expected dtype torch.float16 (the dtype of x)")):
        call(layer, rows.half())


@pytest.mark.parametrize("name,swap,message", [
    ("lora_a", lambda t: t[:, :, :R - 1], "lora_b: expected shape [L, N, R]"),   # same address, fewer rows
    ("lora_b", lambda t: t[:, :N - 8], "lora_b: expected shape [L, N, R]"),
    ("rank", lambda t: t[:L - 1], "rank: expected 3 entries"),
], ids=["lora_a", "lora_b", "rank"])
def test_data_swapped_under_a_parameter_reaches_the_ops_checks(triton_kernels, name, swap, message):
    layer = make_layer(4)
    x = fresh_input(10, 0)
    call(layer, x)
    tensor = getattr(layer, name)
    tensor.data = swap(tensor.data)       # the same Parameter / buffer object, another shape
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        call(layer, x)


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA layer: its adapters' data moved to the CPU")
@pytest.mark.parametrize("name", ["lora_a", "lora_b", "scale", "rank"])
def test_data_swapped_to_another_device_reaches_the_ops_checks(triton_kernels, name):
    """``param.data = t.cpu()`` keeps the identity, shape, strides and dtype: the bound call must not hand a
    kernel the CPU tensor's address (the guard holds devices too); the op's checks name it."""
    layer = make_layer(4)
    x = fresh_input(10, 0)
    call(layer, x)
    call(layer, x)
    assert layer._eager.replays == 1
    tensor = getattr(layer, name)
    tensor.data = tensor.data.cpu()
    with pytest.raises(ValueError, match=f"^{name}: .*device"):
        call(layer, x)


@pytest.mark.parametrize("name", ["scale", "rank"])
def test_data_swapped_to_another_stride_takes_the_op_path(triton_kernels, name):
    layer = make_layer(4)
    x = fresh_input(10, 0)
    call(layer, x)
    tensor = getattr(layer, name)
    wide = tensor.data.repeat_interleave(2)
    tensor.data = wide[::2]               # the same buffer object and values, stride 2
    before = layer._eager.replays
    out = call(layer, x)
    assert layer._eager.replays == before
    assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    wide[1::2] = 0                        # what a plan keyed on the old stride would read instead
    assert torch.equal(call(layer, x), out) and layer._eager.replays == before + 1


def test_a_weight_swapped_to_other_rows_is_caught_after_the_gemm(triton_kernels):
    layer = make_layer(5)
    x = fresh_input(10, 0)
    call(layer, x)
    layer.base.weight.data = layer.base.weight.data[:N - 8]
    with pytest.raises(ValueError, match="lora_b: expected shape"):
        call(layer, x)


BASE_SWAPS = {
    "weight_rows": (lambda w, b: (w[:N - 8], b), ValueError,    # (with a bias: the bias is checked first)
                    rf"lora_b: expected shape|bias: expected {N} entries \(weight's rows\)|bias: expected {N - 8}"),
    "weight_features": (lambda w, b: (torch.cat([w, w], dim=1), b), ValueError,
                        re.escape(f"weight: expected shape [N, K] with K = {K} (x's features), got ({N}, {2 * K})")),
    "weight_dtype": (lambda w, b: (w.half(), b), TypeError,
                     re.escape("weight: expected dtype torch.float32 (the dtype of x), got torch.float16")),
    "bias_one_entry": (lambda w, b: (w, b[:1]), ValueError, re.escape(f"bias: expected {N} entries")),
    "bias_2d": (lambda w, b: (w, b[None]), ValueError, re.escape("bias: expected a 1-D tensor")),
}


@pytest.mark.parametrize("path", ["accumulate_bias", "write_first", "stack_a"])
@pytest.mark.parametrize("swap", list(BASE_SWAPS))
def test_a_base_parameter_swapped_in_place_is_refused_as_by_the_op(triton_kernels, monkeypatch, path, swap):
    """``param.data = ...`` keeps the base weight's and bias's identity: a bound call replayed torch's GEMM on the
    new tensors (the write-first path: torch's raw shape and dtype errors; a bias of one entry or [1, N] broadcast
    silently; stack_a served a narrower output, its views' addresses unchanged). The op's own error now, as
    without the binding."""
    edit, error, message = BASE_SWAPS[swap]
    if path == "write_first":
        if swap.startswith("bias"):
            pytest.skip("the write-first path takes no bias")
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 1)
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    layer = make_layer(5, bias=path != "write_first", stack_a=path == "stack_a")
    x = fresh_input(10, 0)
    call(layer, x)
    call(layer, x)                      # (a replay: the call is bound)
    assert layer._eager.replays == 1
    base = layer.base
    weight, bias = edit(base.weight.data, None if base.bias is None else base.bias.data)
    base.weight.data = weight
    if bias is not None:
        base.bias.data = bias
    with pytest.raises(error, match=message):
        call(layer, x)


def test_a_base_weight_kept_as_a_buffer_serves(triton_kernels):
    """A frozen base whose weight is a buffer (``del lin.weight; lin.register_buffer("weight", w)``, which
    nn.Linear serves): the layer's forward read it from the base's parameters and raised a KeyError."""
    layer = make_layer(7, bias=True)
    weight = layer.base.weight.detach().clone()
    del layer.base.weight
    layer.base.register_buffer("weight", weight)
    x = fresh_input(10, 0)
    for _ in range(2):
        assert rel_err(call(layer, x), reference(layer, x)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("change", ["configs", "plans", "base_hook", "train_with_dropout", "cpu_backend"])
def test_state_changes_take_the_op_path(triton_kernels, change):
    """(cpu_backend: a layer bound under the Triton backend kept replaying its Triton plan after
    set_cpu_backend('torch'), silently: the switch drops the plans now.)"""
    layer = make_layer(6)
    x = fresh_input(10, 0)
    hooked = []

    def do():
        if change == "configs":
            configs.reset()
        elif change == "plans":
            plan.clear()
        elif change == "base_hook":
            layer.base.register_forward_hook(lambda *a: hooked.append(1))
        elif change == "cpu_backend":
            ops.set_cpu_backend("torch")
        else:
            layer.train()
            layer.context.dropout_p = torch.zeros(L + 1, device=DEVICE)
    n, out = replays_after(layer, x, do)
    assert n == 0
    assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    if change == "base_hook":
        assert hooked == [1]


def trainable(layer):
    for p in (layer.lora_a, layer.lora_b):
        p.requires_grad_(True)
    return layer


def train_step(layer, x, grad_out):
    """(output, x.grad, lora_a.grad, lora_b.grad, the output's grad_fn class name) of a forward + backward."""
    for t in (layer.lora_a, layer.lora_b):
        t.grad = None
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad_out)
    return out.detach(), x.grad, layer.lora_a.grad.clone(), layer.lora_b.grad.clone(), type(out.grad_fn).__name__


@pytest.mark.parametrize("path", ["accumulate", "accumulate_bias", "write_first"])
def test_training_calls_replay_with_the_ops_output_and_gradients(triton_kernels, monkeypatch, path):
    """A call that needs autograd binds and replays too (lora_ops.autograd.BoundLoRALinear): its output and
    every gradient equal the op path's bit for bit."""
    opts = dict(PATHS[path])
    if opts.pop("write_first", False):
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 1)
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    layer = trainable(make_layer(7, **opts))
    assert_training_replays(layer, "BoundLoRALinearBackward", "Eager_lora_ops_lora_linearBackward", reference)
    assert len(layer._eager._calls) == 2


OP_PATHS = {"plain": (make_layer, reference, "lora_linear"),     # (the delta: a base with its own forward)
            "forward_hook": (lambda seed: hooked_layer(seed, "forward_hook"), lambda *a: hooked_reference(*a),
                             "add_lora")}


@pytest.mark.parametrize("kind", list(OP_PATHS))
def test_a_scale_that_requires_grad_takes_the_op_path(triton_kernels, kind):
    """The bound training Functions take only the op's differentiable tensors; a scale that requires grad is an
    input of the op's Function (its output then requires grad, though the op gives scale no gradient), so
    such a call takes the op's path, whose output is the same."""
    make, expected, op = OP_PATHS[kind]
    layer = trainable(make(9))
    x = fresh_input(10, 0)
    train_step(layer, x, torch.ones(10, N, device=DEVICE))     # binds
    layer.lora_a.requires_grad_(False)
    layer.lora_b.requires_grad_(False)
    layer.scale.requires_grad_(True)
    replays = layer._eager.replays
    out = layer(x)
    assert layer._eager.replays == replays and out.requires_grad
    assert type(out.grad_fn).__name__ == f"Eager_lora_ops_{op}Backward"
    assert rel_err(out.detach(), expected(layer, x)) <= TOLERANCE[torch.float32]


def assert_training_replays(layer, bound_backward, op_backward, expected):
    """At two token counts: a training call binds, and the next ones replay (their output's grad_fn a
    ``bound_backward``) with the output and every gradient of the op path (``op_backward``) bit for bit, and
    within tolerance of ``expected(layer, x)`` (float64); the replays' backwards find their inputs as the
    forward saw them (the signature the binding took: autograd._unchanged), so their op calls skip checks."""
    unchanged = []
    real = autograd._unchanged
    autograd._unchanged = lambda ctx, tensors: unchanged.append(real(ctx, tensors)) or unchanged[-1]
    try:
        _training_replays(layer, bound_backward, op_backward, expected)
    finally:
        autograd._unchanged = real
    assert unchanged and all(unchanged)


def _training_replays(layer, bound_backward, op_backward, expected):
    for M in (10, 7):
        set_slots(layer, M, M)
        grad_out = fresh_input(M, 50)[:, :1].expand(M, N).contiguous() * torch.linspace(-1, 1, N, device=DEVICE)
        train_step(layer, fresh_input(M, 0), grad_out)        # binds this signature
        for seed in (1, 2):
            x = fresh_input(M, seed)
            replays = layer._eager.replays
            got = train_step(layer, x, grad_out)
            assert layer._eager.replays == replays + 1 and got[4] == bound_backward, (M, seed)
            eager.set_enabled(False)
            try:
                want = train_step(layer, x, grad_out)
            finally:
                eager.set_enabled(True)
            assert want[4] == op_backward
            for i, name in enumerate(("out", "dx", "dA", "dB")):
                assert torch.equal(got[i], want[i]), (M, seed, name)
            assert rel_err(got[0], expected(layer, x)) <= TOLERANCE[torch.float32]


def test_forward_mode_ad_takes_the_op_path(triton_kernels):
    """A bound plain call replays no tangent: under forward-mode AD the call takes the op's path (ops.FORWARD_AD),
    whose output carries the tangent, the layer's linear map of the input's tangent."""
    from torch.autograd import forward_ad
    layer = make_layer(18, bias=True)
    x, tangent = fresh_input(10, 0), fresh_input(10, 1)
    call(layer, x)
    call(layer, x)
    assert layer._eager.replays == 1
    with torch.no_grad(), forward_ad.dual_level():
        out, out_tangent = forward_ad.unpack_dual(layer(forward_ad.make_dual(x, tangent)))
    assert layer._eager.replays == 1 and out_tangent is not None
    assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    linear = reference(layer, tangent) - layer.base.bias.detach().double().cpu()
    assert rel_err(out_tangent, linear) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", ["plain", "forward_hook"])
def test_a_training_replays_backward_reads_its_forwards_batch(triton_kernels, kind):
    """The next batch set between a bound training call's forward and its backward (a step's batch set before
    the last backward ran): the replay's forward took the batch's copy (LoRAContext.batch_for with grad), as
    the op's path does, so its backward computes the forward's batch: output and gradients equal the op path's
    bit for bit, and the float64 reference of the forward's slots."""
    layer = trainable(make_layer(19) if kind == "plain" else hooked_layer(19, kind))
    expected = reference if kind == "plain" else hooked_reference
    grad_out = fresh_input(10, 50)[:, :1].expand(10, N).contiguous()
    train_step(layer, fresh_input(10, 0), grad_out)             # binds
    x = fresh_input(10, 1)
    results = []
    for enabled in (True, False):
        eager.set_enabled(enabled)
        try:
            set_slots(layer, 10, 10)
            replays = layer._eager.replays
            for t in (layer.lora_a, layer.lora_b):
                t.grad = None
            xr = x.clone().requires_grad_()
            out = layer(xr)
            want = expected(layer, x)
            set_slots(layer, 10, 11)                             # the next step's batch
            out.backward(grad_out)
            results.append((out.detach(), xr.grad, layer.lora_a.grad, layer.lora_b.grad))
            assert layer._eager.replays == replays + enabled
            assert rel_err(out.detach(), want) <= TOLERANCE[torch.float32]
        finally:
            eager.set_enabled(True)
    for name, got, op in zip(("out", "dx", "dA", "dB"), *results):
        assert torch.equal(got, op), name


def test_stack_a_keeps_its_binding_beside_the_training_one(triton_kernels):
    """stack_a takes the stacked op without autograd and lora_linear with it: alternating the two (rollouts
    and training steps) replays both, each its own path."""
    layer = trainable(make_layer(12, stack_a=True))
    x = fresh_input(10, 0)
    grad_out = fresh_input(10, 1)[:, :1].expand(10, N).contiguous()
    want = reference(layer, x)
    for _ in range(3):
        out = call(layer, x)
        assert out.stride() != (N, 1)                 # the stack's column view
        assert rel_err(out, want) <= TOLERANCE[torch.float32]
        got = train_step(layer, x, grad_out)
        assert got[4] in ("Eager_lora_ops_lora_linearBackward", "BoundLoRALinearBackward")
        assert rel_err(got[0], want) <= TOLERANCE[torch.float32]
    assert len(layer._eager._calls) == 2 and layer._eager.replays == 4
    assert rel_err(call(layer, x), reference(layer, x)) <= TOLERANCE[torch.float32]


def test_training_replay_falls_back_to_the_op_where_the_gemm_changed(triton_kernels):
    """A weight swapped to other rows under its Parameter: the bound training call's GEMM output guard sends
    it to the op's kernel, inside the same autograd Function, which raises as the op does."""
    layer = trainable(make_layer(13))
    x = fresh_input(10, 0)
    grad_out = fresh_input(10, 1)[:, :1].expand(10, N).contiguous()
    train_step(layer, x, grad_out)
    layer.base.weight.data = layer.base.weight.data[:N - 8]
    with pytest.raises(ValueError, match="lora_b: expected shape"):
        train_step(layer, x, grad_out)


@pytest.mark.parametrize("kind", list(OP_PATHS))
def test_training_without_eager_autograd_takes_the_op_path(triton_kernels, kind):
    make, expected, op = OP_PATHS[kind]
    layer = trainable(make(14))
    x = fresh_input(10, 0)
    grad_out = fresh_input(10, 1)[:, :1].expand(10, N).contiguous()
    train_step(layer, x, grad_out)
    ops.set_eager_autograd(False)
    try:
        before = layer._eager.replays
        got = train_step(layer, x, grad_out)
        assert layer._eager.replays == before and got[4].startswith(f"GeneratedBackwardFor_lora_ops_{op}")
        assert rel_err(got[0], expected(layer, x)) <= TOLERANCE[torch.float32]
    finally:
        ops.set_eager_autograd(True)


def test_stack_a_replaced_weight_drops_to_lora_linear(triton_kernels):
    layer = make_layer(8, stack_a=True)
    x = fresh_input(10, 0)
    call(layer, x)
    call(layer, x)
    assert layer._eager.replays == 1
    layer.base.weight = nn.Parameter(layer.base.weight.detach().clone(), requires_grad=False)
    out = call(layer, x)
    assert layer._eager.replays == 1
    assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]
    assert out.stride() == (N, 1)        # lora_linear's own output, not the stack's column view


def test_copies_start_without_bound_calls(triton_kernels):
    layer = make_layer(9)
    x = fresh_input(10, 0)
    call(layer, x)
    twin = copy.deepcopy(layer)
    assert not twin._eager._calls and layer._eager._calls
    with torch.no_grad():
        twin.lora_b.mul_(2)
    assert rel_err(call(twin, x), reference(twin, x)) <= TOLERANCE[torch.float32]
    assert rel_err(call(layer, x), reference(layer, x)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("name", ["weight", "bias", "lora_a"])
def test_stack_a_data_swapped_drops_to_lora_linear(triton_kernels, name):
    """``param.data = param.data * 2``: the same Parameter, of the same shape, no longer the stack's view. The
    stack still holds the old values, so a replay (or the layer's own stacked call) would serve them: the
    call drops to lora_linear with the new ones (_stack_intact: each view's address)."""
    layer = make_layer(10, bias=True, stack_a=True)
    x = fresh_input(10, 0)
    call(layer, x)
    tensor = layer.lora_a if name == "lora_a" else getattr(layer.base, name)
    tensor.data = tensor.data * 2
    out = call(layer, x)
    assert layer._eager.replays == 0 and out.stride() == (N, 1)
    assert rel_err(out, reference(layer, x)) <= TOLERANCE[torch.float32]


def test_a_layer_pickled_without_bound_calls_loads_with_them(triton_kernels):
    import pickle
    layer = make_layer(11)
    x = fresh_input(10, 0)
    expected = call(layer, x)
    state = layer.__getstate__()
    del state["_eager"]                   # as a layer pickled before session 24 holds it
    old = LoRALinear.__new__(LoRALinear)
    old.__setstate__(state)
    restored = pickle.loads(pickle.dumps(old))
    assert torch.equal(call(restored, x), expected) and torch.equal(call(restored, x), expected)
    assert restored._eager.replays == 1


class ScaledLinear(nn.Linear):
    """A subclass of nn.Linear (as a quantized linear is): the layer runs its forward, then the delta op."""

    def forward(self, x):
        return super().forward(x) * 0.5


def hooked_layer(seed, kind):
    layer = make_layer(seed)
    if kind == "subclass":
        base = ScaledLinear(K, N, bias=False).to(DEVICE)
        with torch.no_grad():
            base.weight.copy_(layer.base.weight)
        layer.base = base
    else:
        layer.base.register_forward_hook(lambda module, args, out: out * 0.5)
    return layer


def hooked_reference(layer, x):
    """float64: a hooked_layer's output for ``x`` [M, K] (its base's output halved, then the delta)."""
    return reference(layer, x) - 0.5 * x.double().cpu() @ layer.base.weight.detach().double().cpu().T


@pytest.mark.parametrize("kind", ["forward_hook", "subclass"])
def test_a_base_with_its_own_forward_binds_the_delta(triton_kernels, kind):
    """A base that is not a bare nn.Linear runs its own forward on every call (hooks fire); the add_lora_ call
    after it binds and replays: the output and its version counter equal the op path's."""
    layer = hooked_layer(15, kind)
    for shape in ((10, K), (2, 5, K)):
        M = shape[0] * (shape[1] if len(shape) == 3 else 1)
        set_slots(layer, M, M)
        call(layer, fresh_input(M, 0).view(shape))
        for seed in (1, 2):
            x = fresh_input(M, seed).view(shape)
            replays = layer._eager.replays
            out = call(layer, x)
            assert layer._eager.replays == replays + 1, (shape, seed)
            want = op_output(layer, x)
            assert torch.equal(out, want) and out._version == want._version, (shape, seed)
            assert rel_err(out.reshape(M, N), hooked_reference(layer, x.reshape(M, K))) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", ["forward_hook", "subclass"])
def test_a_base_with_its_own_forward_binds_the_training_delta(triton_kernels, kind):
    """Where autograd needs the delta of such a base (a quantized base with trainable adapters), add_lora's call
    binds too (lora_ops.autograd.BoundAddLora): its output and every gradient equal the op path's bit for bit."""
    layer = trainable(hooked_layer(17, kind))
    assert_training_replays(layer, "BoundAddLoraBackward", "Eager_lora_ops_add_loraBackward", hooked_reference)
    x = fresh_input(7, 3)
    with torch.no_grad():                                      # the in-place delta keeps a binding of its own
        call(layer, x)
        replays = layer._eager.replays
        out = call(layer, x)
    assert layer._eager.replays == replays + 1 and len(layer._eager._calls) == 3
    assert rel_err(out, hooked_reference(layer, x)) <= TOLERANCE[torch.float32]


def test_a_bound_delta_follows_the_layers_state(triton_kernels):
    layer = hooked_layer(16, "forward_hook")
    x = fresh_input(10, 0)
    n, out = replays_after(layer, x, lambda: None)
    assert n == 1 and rel_err(out, hooked_reference(layer, x)) <= TOLERANCE[torch.float32]
    new_b = torch.randn(layer.lora_b.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    n, out = replays_after(layer, x, lambda: setattr(layer, "lora_b", nn.Parameter(new_b, requires_grad=False)))
    assert n == 0 and torch.equal(out, op_output(layer, x))
    # Another output dtype: the delta in it (session 54: the op refused it), never the bound float32 replay.
    layer.base.register_forward_hook(lambda module, args, out: out.half())
    replays = layer._eager.replays
    out = call(layer, x)
    assert layer._eager.replays == replays and out.dtype == torch.float16
    assert rel_err(out, hooked_reference(layer, x)) <= TOLERANCE[torch.float16]
