"""LoRALinear, the shared batch context and apply_lora.

Values: a layer's output against float64 (base product + lora_ops.reference's delta, both from the same
rounded inputs), on both CPU backends (torch kernels; Triton kernels under the interpreter) and every
dtype, with packed slices, per-slot ranks (one at the capacity) and signed scales, a mixed batch with
requests of no adapter, and an empty slot. Rows without an adapter must equal the base layer bit for bit.
"""
import copy
import re

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import lora_ops
from conftest import DTYPES, TOLERANCE, dtype_id, fill_setting, rel_err
from layer_helpers import PACKED, data_ptrs, module_shapes, peft_tensors, request_slots, toy_lm
from lora_ops.adapters import AdapterError
from lora_ops.layers import LoRAContext, LoRALinear, apply_lora, slot_key
from lora_ops.reference import lora_delta_reference

K, N, MAX_RANK, MAX_LORAS = 24, 40, 8, 4
SLICINGS = {"one_slice": None, "qkv_3_slices": {"q": 20, "k": 12, "v": 8}}
# Slot use across a 12-token batch [3, 4, K]: every adapter, 'no adapter' twice, interleaved.
REQUESTS = [("a", 3), (None, 2), ("b", 4), ("c", 1), (None, 0), ("a", 2)]


# one_layer_model's adapters, (name, rank, lora_alpha), loaded into slots 0, 1, 2 in this order.
ADAPTERS = [("a", 2, 3.0), ("b", MAX_RANK, -12.0), ("c", 5, 5.0)]


def adapter_tensors(slicing, i, seed=0):
    """The PEFT tensors one_layer_model loads as ADAPTERS[i]: one (lora_A, lora_B) pair per packed slice."""
    shapes = {name: (K, n) for name, n in slicing.items()} if slicing else {"proj": (K, N)}
    return peft_tensors(shapes, ADAPTERS[i][1], seed=i + 10 * seed)


def one_layer_model(slicing, dtype, device, seed=0):
    """{"proj": LoRALinear} with adapters a (rank 2), b (rank MAX_RANK, negative alpha), c (rank 5);
    slot 3 stays empty."""
    torch.manual_seed(seed)
    model = nn.ModuleDict({"proj": nn.Linear(K, N, bias=True)}).to(dtype=dtype, device=device)
    packed = {"proj": slicing} if slicing else None
    ctx = apply_lora(model, ["proj"], max_loras=MAX_LORAS, max_rank=MAX_RANK, max_tokens=32, packed_modules=packed)
    for i, (name, r, alpha) in enumerate(ADAPTERS):
        ctx.load_adapter_tensors(name, adapter_tensors(slicing, i, seed), {"r": r, "lora_alpha": alpha})
    return model, ctx


def peft_delta(slicing, x2d, names, seed=0):
    """float64 [M, N]: token t's adapter ``names[t]`` (None: zero) as PEFT computes it from the tensors
    one_layer_model loaded, rounded to x's dtype as the stacks hold them: lora_alpha / r * x A^T B^T, each
    slice's pair on that slice's columns. Read from the adapters, not the layer's stacks (layer_reference
    reads those, so a load that put a slice's A or B in the wrong place passed against it)."""
    x64 = x2d.detach().double().cpu()
    delta = torch.zeros(x64.shape[0], N, dtype=torch.float64)
    for i, (name, r, alpha) in enumerate(ADAPTERS):
        rows = torch.tensor([n == name for n in names])
        tensors, col = adapter_tensors(slicing, i, seed), 0
        for module, width in (slicing or {"proj": N}).items():
            a, b = (tensors[f"base_model.model.{module}.lora_{ab}.weight"].to(x2d.dtype).double() for ab in "AB")
            delta[rows, col:col + width] = alpha / r * (x64[rows] @ a.T) @ b.T
            col += width
    return delta


def layer_reference(layer, x2d, token_slots):
    """float64 [M, N]: x W^T + b + the LoRA delta of each token's slot."""
    base = x2d.double() @ layer.base.weight.double().T + layer.base.bias.double()
    delta = lora_delta_reference(x2d, layer.lora_a, layer.lora_b, layer.scale, layer.rank, token_slots,
                                 layer.slice_widths)
    return base.cpu() + delta


@pytest.mark.parametrize("slicing", SLICINGS.values(), ids=SLICINGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_matches_float64(backend, checked_dtype, slicing):
    """The mixed batch against float64: the reference of the layer's stacks, and PEFT's math from the adapters'
    own tensors (peft_delta), so a load that wrote a slice's A or B into another slice's place fails here too."""
    dtype = checked_dtype
    model, ctx = one_layer_model(slicing, dtype, backend.device)
    layer = model["proj"]
    x = torch.randn(3, 4, K, dtype=dtype, device=backend.device)
    ctx.set_batch(REQUESTS)
    with torch.no_grad():
        y = layer(x)
        base = layer.base(x)
    slots = request_slots(ctx, REQUESTS)
    assert y.shape == (3, 4, N) and y.dtype == dtype
    y2d, base2d = y.reshape(-1, N).cpu(), base.reshape(-1, N).cpu()
    assert rel_err(y2d, layer_reference(layer, x.reshape(-1, K), slots)) <= TOLERANCE[dtype]
    # The same against the adapters' own tensors (PEFT's math), not what the loads wrote into the stacks.
    names = [name for name, n in REQUESTS for _ in range(n)]
    base64 = layer_reference(layer, x.reshape(-1, K), torch.full_like(slots, -1))     # (slot -1: no delta)
    assert rel_err(y2d, base64 + peft_delta(slicing, x.reshape(-1, K), names)) <= TOLERANCE[dtype]
    none = slots < 0
    assert torch.equal(y2d[none], base2d[none]), "rows without an adapter must be the base output, untouched"
    # The delta is material: every adapter row differs from the base output.
    assert (y2d[~none] != base2d[~none]).any(dim=1).all()


@pytest.mark.parametrize("route", ["inference_mode", "hooked_base", "grad_enabled"])
def test_every_forward_route_gives_the_same_output(backend, route):
    """LoRALinear runs lora_linear for a plain nn.Linear base (no_grad reference here), the base layer
    then the in-place op when the base carries a hook, and autograd ops when grad is needed: one result."""
    model, ctx = one_layer_model(SLICINGS["qkv_3_slices"], torch.float32, backend.device)
    layer = model["proj"]
    x = torch.randn(12, K, device=backend.device)
    ctx.set_batch(REQUESTS)
    with torch.no_grad():
        expected = layer(x)
    if route == "inference_mode":
        with torch.inference_mode():
            y = layer(x)
    elif route == "hooked_base":
        seen = []
        handle = layer.base.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
        with torch.no_grad():
            y = layer(x)
        handle.remove()
        assert seen == [(12, N)], "the base layer's own forward (and its hook) must run"
    else:
        y = layer(x.requires_grad_())
        assert y.requires_grad
    assert torch.equal(y.detach(), expected)


@pytest.mark.parametrize("hook", ["module", "pre", "global"])
def test_backward_hooks_on_the_base_layer_fire(backend, hook):
    """A full backward hook on the wrapped nn.Linear (or a global one) fired never: the layer ran lora_linear in
    place of the base's forward, where the hook lives. The base's own forward now runs, the hook fires once a
    backward with the base's gradients, and the gradients are unchanged."""
    model, ctx = one_layer_model(None, torch.float32, backend.device)
    layer = model["proj"]
    ctx.set_batch(REQUESTS)
    x = torch.randn(12, K, device=backend.device, requires_grad=True)
    weight = layer.base.weight
    weight.requires_grad_(True)
    want = torch.autograd.grad(layer(x).square().sum(), (weight, x))
    seen = []
    record = lambda module, *grads: seen.append(module) if module is layer.base else None   # noqa: E731
    handle = (layer.base.register_full_backward_hook(record) if hook == "module" else
              layer.base.register_full_backward_pre_hook(record) if hook == "pre" else
              torch.nn.modules.module.register_module_full_backward_hook(record))
    try:
        got = torch.autograd.grad(layer(x).square().sum(), (weight, x))
    finally:
        handle.remove()
    assert seen == [layer.base]
    assert all(rel_err(g, w) <= TOLERANCE[torch.float32] for g, w in zip(got, want))


@pytest.mark.parametrize("stack_a", [False, True], ids=["plain", "stack_a"])
def test_a_context_built_under_inference_mode_serves_outside_it(stack_a):
    """apply_lora, loads and set_batch under torch.inference_mode made the batch buffers and stacks inference
    tensors, and a later set_batch under no_grad raised torch's "Inplace update to inference tensor outside
    InferenceMode" (a plain nn.Linear built there serves anywhere). They are built as normal tensors."""
    with torch.inference_mode():
        model, ctx = one_layer_model(None, torch.float32, "cpu")
        if stack_a:
            model["proj"]._stack()
        ctx.set_batch(REQUESTS)
        x = torch.randn(12, K)
        inside = model["proj"](x)
    with torch.no_grad():
        ctx.set_batch(REQUESTS)
        ctx.load_adapter_tensors("d", peft_tensors({"proj": (K, N)}, 2, seed=5))
        assert torch.equal(model["proj"](x.clone()), inside)
    slots = request_slots(ctx, REQUESTS)
    assert rel_err(inside, layer_reference(model["proj"], x.clone(), slots)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("stack_a", [False, True], ids=["plain", "stack_a"])
def test_a_copy_taken_under_inference_mode_serves_outside_it(stack_a, tmp_path):
    """copy.deepcopy of a model under torch.inference_mode made the copy's batch buffers and stacks inference
    tensors: its set_batch and loads outside that mode failed on torch's message. The copy's are normal tensors.
    torch.load under inference mode makes every tensor one: the load warns, naming the way out."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    if stack_a:
        model["proj"]._stack()
    x = torch.randn(12, K)
    with torch.inference_mode():
        twin = copy.deepcopy(model)
    twin_ctx = twin["proj"].context
    with torch.no_grad():
        twin_ctx.set_batch(REQUESTS)
        twin_ctx.load_adapter_tensors("d", peft_tensors({"proj": (K, N)}, 2, seed=5))
        ctx.set_batch(REQUESTS)
        ctx.load_adapter_tensors("d", peft_tensors({"proj": (K, N)}, 2, seed=5))
        assert torch.equal(twin["proj"](x), model["proj"](x))
    torch.save(model, tmp_path / "model.pt")
    with torch.inference_mode(), pytest.warns(UserWarning, match=r"unpickled under torch.inference_mode .*load "
                                                                 r"the model outside torch.inference_mode"):
        torch.load(tmp_path / "model.pt", weights_only=False)


def test_a_model_sent_to_another_process_owns_its_batch():
    """torch.multiprocessing pickles tensors into shared memory, the context's batch buffers too: spawned workers
    (a DataLoader's) and the parent set one batch, each forward reading another process's (734 of 3000 steps
    wrong with two workers; session 54). An unpickled context owns its batch; the stacks stay shared, as torch
    shares parameters. (ForkingPickler in one process: the same shared memory a spawned worker maps.)"""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing    # noqa: F401  (torch's reductions for ForkingPickler)
    model = nn.Sequential(nn.Linear(8, 8))
    ctx = _one_adapter(model, ["0"])
    ctx.set_batch([("a", 3)])
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(model)
    twin = pickle.loads(buffer.getvalue())
    twin_ctx = twin[0].context
    assert twin[0].lora_a.is_shared() and not any(t.is_shared() for t in (*twin_ctx.meta, twin_ctx.token_slots))
    twin_ctx.set_batch([(None, 2), ("a", 3)])
    assert ctx.token_slots[:3].tolist() == [0, 0, 0] and ctx.num_tokens == 3
    assert ctx.meta.slot_counts.tolist()[:1] == [3]
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert rel_err(model(x), layer_reference(model[0], x, torch.zeros(3, dtype=torch.int64))) <= 1e-5


def test_a_copy_taken_inside_per_row_is_not_in_the_block():
    """copy.deepcopy / torch.save of a model inside a per_row block gave a copy whose context stayed in per_row
    forever (only the original's block ends): set_batch on it was ignored, silently."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    x = torch.randn(2, 3, K)
    with ctx.per_row(["a", None]):
        copied = copy.deepcopy(model)
    copy_ctx = copied["proj"].context
    assert copy_ctx._rows is None and copy_ctx.row_slots == frozenset()
    copy_ctx.set_batch([(None, 6)])
    with torch.no_grad():
        assert torch.equal(copied["proj"](x), copied["proj"].base(x))
    with copy_ctx.per_row(["b", "a"]):
        pass


def test_a_part_of_the_model_is_not_deep_copied_alone():
    """A block or layer deep-copied alone took a private copy of the whole model and its context: a block
    duplicated into the model (depth up-scaling) kept serving the adapters and batch of the moment of the copy,
    whatever set_batch said after. Refused, naming the layer; the whole model, and a container holding the
    context before the model, still copy."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"copy.deepcopy of part of a model wrapped by apply_lora \(reached "
                                           r"LoRALinear 'proj'\).*Copy the whole model"):
        copy.deepcopy(model["proj"])
    for root in (model, {"ctx": ctx, "model": model}):
        twin = copy.deepcopy(root)
        twin_model = twin["model"] if isinstance(root, dict) else twin
        twin_ctx = twin_model["proj"].context
        assert twin_model is not model and twin_ctx is not ctx and twin_ctx.layers["proj"] is twin_model["proj"]
        assert twin_ctx.adapters == ctx.adapters
        if isinstance(root, dict):
            assert twin["ctx"] is twin_ctx


def test_apply_lora_warns_of_selected_layers_another_context_serves():
    model = nn.Sequential(nn.Linear(K, K), nn.Linear(K, K), nn.Linear(K, K))
    first = apply_lora(model, ["0", "1"], max_loras=2, max_rank=4, max_tokens=8)
    with pytest.warns(UserWarning, match=r"apply_lora: target_modules also selects 1 layer\(s\) already wrapped "
                                         r"\('1'\): they stay with the context that wrapped them; this one serves "
                                         r"only the 1 it wraps now"):
        second = apply_lora(model, ["1", "2"], max_loras=2, max_rank=4, max_tokens=8)
    assert list(first.layers) == ["0", "1"] and list(second.layers) == ["2"]


def test_unload_under_inference_mode_then_a_training_forward():
    """unload_adapter under torch.inference_mode after a batch set with grad mode on rebuilt the batch's
    autograd copy as inference tensors: every later autograd forward raised "Inference tensors do not track
    version counter" until the next set_batch."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    ctx.set_batch([("a", 3), ("b", 2)])
    with torch.inference_mode():
        ctx.unload_adapter("b")
    x = torch.randn(5, K, requires_grad=True)
    model["proj"](x).sum().backward()
    assert x.grad is not None and ctx.token_slots[:5].tolist() == [0, 0, 0, -1, -1]


def test_a_step_function_that_sets_the_batch_compiles():
    """torch.compile of a function that calls set_batch (or set_token_slots) raised Dynamo's "forbidden
    callable maybe_mark_dynamic" even without fullgraph; the calls are left out of the graph now."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def step(x, slots):
        ctx.set_batch([("a", 2), (None, 1)])
        first = model["proj"](x)
        ctx.set_token_slots(slots)
        return first, model["proj"](x)

    x, slots = torch.randn(3, K), torch.tensor([2, 0, -1])
    with torch.no_grad():
        first, second = step(x, slots)
        assert rel_err(first, layer_reference(model["proj"], x, torch.tensor([0, 0, -1]))) <= 1e-6
        assert rel_err(second, layer_reference(model["proj"], x, slots)) <= 1e-6
    torch._dynamo.reset()


@pytest.mark.parametrize("what, match", [
    ("meta", r"apply_lora: the selected layers have their weights on the meta device \('0' first\): .* "
             r"Materialise the model first"),
    ("float64", r"apply_lora: '0' has dtype torch.float64; the LoRA ops take float16, bfloat16 or float32"),
    ("twice", r"selects no nn.Linear in Sequential \(it selects '0', already a LoRALinear: apply_lora wraps a "
              r"layer once"),
    ("other_context", r"the adapter targets '0', which another LoRAContext wraps"),
])
def test_apply_lora_refuses_what_it_cannot_serve(what, match):
    model = nn.Sequential(nn.Linear(8, 8, device="meta" if what == "meta" else None,
                                    dtype=torch.float64 if what == "float64" else None), nn.Linear(8, 8))
    with pytest.raises((ValueError, TypeError), match=match):
        if what in ("twice", "other_context"):
            apply_lora(model, ["0"], max_loras=1, max_rank=2, max_tokens=4)
            other = apply_lora(model, ["1"] if what == "other_context" else ["0"], max_loras=1, max_rank=2,
                               max_tokens=4)
            other.load_adapter_tensors("a", peft_tensors({"0": (8, 8)}, 2, seed=1, prefix=""))
        else:
            apply_lora(model, ["0"], max_loras=1, max_rank=2, max_tokens=4)


@pytest.mark.parametrize("argument", ["max_loras", "max_tokens", "max_rank"])
def test_apply_lora_names_a_capacity_below_one(argument):
    """They reached LoRABatch, whose message named neither the argument nor which number was which."""
    kw = {**dict(max_loras=2, max_rank=2, max_tokens=4), argument: 0}
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match=f"^{argument}: expected an int >= 1, got 0$"):
        apply_lora(model, ["0", "1"], **kw)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]      # no layer wrapped


def test_an_assigning_load_of_a_half_checkpoint_keeps_scale_and_rank_dtypes():
    """load_state_dict(assign=True) kept a converted checkpoint's float16 scale (and an int64 rank): the load
    passed and every forward raised. A rank outside [0, max_rank] in a state dict is a load error."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    state = {k: v.half() if v.is_floating_point() else v.long() if k.endswith("rank") else v
             for k, v in model.state_dict().items()}
    model.half().load_state_dict(state, assign=True)
    assert (layer.scale.dtype, layer.rank.dtype) == (torch.float32, torch.int32)
    ctx.set_batch(REQUESTS)
    x = torch.randn(12, K, dtype=torch.float16)
    with torch.no_grad():
        assert rel_err(layer(x), layer_reference(layer, x, request_slots(ctx, REQUESTS))) <= 2e-2
    state["proj.rank"] = state["proj.rank"].clone().fill_(layer.max_rank + 1)
    with pytest.raises(RuntimeError, match=r"proj.rank: slot ranks .* outside \[0, max_rank="):
        model.load_state_dict(state)


def test_apply_lora_refuses_a_peft_model():
    """A PeftModel's LoRA layers are wrappers of their own: "all-linear" wrapped their factor layers, a name
    selected one with an error about a "Linear" that was not nn.Linear, and loads blamed another context."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                                peft.LoraConfig(r=2, target_modules=["0"]))
    for targets in (["0"], ["1"], "all-linear"):
        with pytest.raises(TypeError, match=r"apply_lora: the model holds PEFT's adapter layers \('base_model' is "
                                            r"a peft\.tuners\..*: a PeftModel\)\. lora_ops serves PEFT adapters "
                                            r"itself"):
            apply_lora(model, targets, max_loras=2, max_rank=2, max_tokens=4)


def test_context_repr_names_its_slots():
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    assert repr(ctx) == (f"LoRAContext(max_loras={ctx.max_loras}, max_tokens={ctx.max_tokens}, device=cpu, layers=1, "
                         f"adapters={ {s: n for s, n in enumerate(ctx.slot_names) if n} })")
    assert "'a'" in repr(ctx)


def test_set_batch_takes_numpy_token_counts():
    np = pytest.importorskip("numpy")
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    assert ctx.set_batch([("a", np.int64(3)), (None, np.int32(1))]) == 4
    assert ctx.token_slots[:4].tolist() == [ctx.slot_of("a")] * 3 + [-1]
    with pytest.raises(ValueError, match=r"request 0's num_tokens must be an int >= 0, got tensor\(3\)"):
        ctx.set_batch([("a", torch.tensor(3))])


def test_weight_and_bias_are_read_only_on_the_wrapper():
    model, _ = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    for name, value in (("weight", nn.Parameter(torch.randn(N, K))), ("bias", torch.randn(N))):
        with pytest.raises(AttributeError, match=rf"LoRALinear.{name} is the base layer's, read-only here: set "
                                                 rf"layer.base.{name} instead"):
            setattr(layer, name, value)
    assert layer.weight is layer.base.weight


def test_empty_slot_and_raw_token_slots(backend):
    """Per-token slots in any order; a slot with no adapter (rank 0) leaves its rows alone, bit for bit, as slot
    -1 does. The empty slot is one unload_adapter freed (its adapter's data was there), and every other slot,
    the last one included, holds an adapter: with the last slot empty (one_layer_model's), -1 served as the
    last slot (an index from the end) or a freed slot still serving its old adapter passed."""
    model, ctx = one_layer_model(None, torch.float32, backend.device)
    ctx.load_adapter_tensors("d", peft_tensors({"proj": (K, N)}, 3, seed=7), {"r": 3, "lora_alpha": 4.5})
    ctx.unload_adapter("b")
    assert ctx.slot_names == ["a", None, "c", "d"]
    layer = model["proj"]
    x = torch.randn(10, K, device=backend.device)
    slots = torch.tensor([3, 0, -1, 2, 3, 1, 0, 2, -1, 1])          # slot 1 is empty
    ctx.set_token_slots(slots)
    with torch.no_grad():
        y = layer(x).cpu()
        base = layer.base(x).cpu()
    assert rel_err(y, layer_reference(layer, x, slots)) <= TOLERANCE[torch.float32]
    untouched = (slots == 1) | (slots == -1)
    assert torch.equal(y[untouched], base[untouched])
    assert (y[~untouched] != base[~untouched]).any(dim=1).all(), "every loaded slot's rows take its delta"


def dx_reference(layer, grad_y, token_slots):
    """float64 d(sum(grad_y * y))/dx [M, K]: the base layer's term plus each token's LoRA term."""
    g = grad_y.detach().double().cpu()
    a, b = layer.lora_a.detach().double().cpu(), layer.lora_b.detach().double().cpu()
    dx = g @ layer.base.weight.detach().double().cpu()
    offsets = layer.slice_offsets
    for t, s in enumerate(token_slots.tolist()):
        r = layer.slot_ranks[s] if s >= 0 else 0
        for i in range(len(layer.slice_widths)):
            if r:
                lo, hi = offsets[i], offsets[i + 1]
                dx[t] += layer.scale[s].item() * (g[t, lo:hi] @ b[s, lo:hi, :r]) @ a[s, i, :r]
    return dx


def test_gradient_reaches_the_input_through_the_lora_path(backend):
    """With grad mode on and an input that requires grad, the layer uses the out-of-place op with autograd:
    dx holds the LoRA term (the in-place op is invisible to autograd and would drop it)."""
    model, ctx = one_layer_model({"q": 20, "k": 12, "v": 8}, torch.float32, backend.device)
    layer = model["proj"]
    x = torch.randn(3, 4, K, device=backend.device, requires_grad=True)
    grad_y = torch.randn(3, 4, N, device=backend.device)
    ctx.set_batch(REQUESTS)
    y = layer(x)
    slots = request_slots(ctx, REQUESTS)
    assert rel_err(y.detach().reshape(-1, N), layer_reference(layer, x.detach().reshape(-1, K), slots)) <= \
        TOLERANCE[torch.float32]
    y.backward(grad_y)
    want = dx_reference(layer, grad_y.reshape(-1, N), slots)
    assert rel_err(x.grad.reshape(-1, K), want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("route", ["no_grad", "hooked_base", "grad_enabled"])
def test_columns_past_a_slots_rank_are_never_read(backend, route):
    """Each slot computes at its own rank, the ``rank`` buffer, whatever its stacks hold past it. The loads
    zero-fill those columns, so elsewhere a layer passing max_rank for every slot (the rank ignored) gives the
    same output and passes. Filled with values here (a state dict or a hand write may leave them), on each
    forward route (lora_linear; the base's own forward then add_lora_; autograd's op, and its dx): against
    float64 at each slot's rank, and the empty slot (rank 0, values in all its columns) and slot -1 keep the
    base output bit for bit."""
    dev = backend.device
    model, ctx = one_layer_model(SLICINGS["qkv_3_slices"], torch.float32, dev)
    layer = model["proj"]
    gen = torch.Generator().manual_seed(3)
    past = torch.arange(MAX_RANK, device=dev) >= layer.rank[:, None]           # [L, R]: columns past each rank
    assert past.any(dim=1).tolist() == [True, False, True, True]               # (b is at MAX_RANK)
    with torch.no_grad():
        for stack, mask in ((layer.lora_a, past[:, None, :, None]), (layer.lora_b, past[:, None, :])):
            stack.copy_(torch.where(mask, torch.randn(stack.shape, generator=gen).to(dev), stack))
    slots = torch.tensor([3, 0, -1, 2, 3, 1, 0, 2, -1, 1, 0, 2])
    ctx.set_token_slots(slots)
    x = torch.randn(12, K, device=dev)
    if route == "grad_enabled":
        x.requires_grad_(True)
        y = layer(x)
        grad_y = torch.randn(12, N, device=dev)
        y.backward(grad_y)
        # (dx_reference reads each slot's A and B up to its rank only)
        assert rel_err(x.grad, dx_reference(layer, grad_y, slots)) <= TOLERANCE[torch.float32]
    else:
        seen = []
        handle = layer.base.register_forward_hook(lambda *args: seen.append(1)) if route == "hooked_base" else None
        with torch.no_grad():
            y = layer(x)
        if handle is not None:
            handle.remove()
            assert seen == [1], "the base layer's own forward must run"
    y, base = y.detach().cpu(), layer.base(x).detach().cpu()
    assert rel_err(y, layer_reference(layer, x, slots)) <= TOLERANCE[torch.float32]
    untouched = (slots == 3) | (slots == -1)
    assert torch.equal(y[untouched], base[untouched])


def test_set_batch_is_request_major_and_in_place():
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    ptrs = data_ptrs(ctx)
    assert ctx.set_batch(REQUESTS) == 12
    a, b, c = (ctx.slot_of(n) for n in "abc")
    assert ctx.token_slots[:12].tolist() == [a] * 3 + [-1] * 2 + [b] * 4 + [c] + [a] * 2
    counts = ctx.meta.slot_counts.tolist()
    assert counts[a] == 5 and counts[b] == 4 and counts[c] == 1 and counts[MAX_LORAS] == 2
    ctx.set_batch([("c", 7)])
    assert ctx.num_tokens == 7 and ctx.meta.slot_counts.tolist()[c] == 7
    assert data_ptrs(ctx) == ptrs, "set_batch must refill the metadata in place"


@pytest.mark.parametrize("requests", [
    [("a", 1), (None, 1), ("c", 1), ("a", 1), ("b", 1)],          # decode: one token a request
    [("a", 1), ("b", 0), ("c", 2), (None, 1), ("b", 1)],          # as many tokens as requests, not one each
    [],
], ids=["one_token_each", "a_request_without_tokens", "no_requests"])
def test_set_batch_gives_the_slots_of_set_token_slots(requests):
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    slots = torch.tensor([ctx.slot_of(name) for name, n in requests for _ in range(n)], dtype=torch.int32)
    assert ctx.set_batch(requests) == len(slots)
    assert ctx.token_slots[:len(slots)].tolist() == slots.tolist()
    got = [t.clone() for t in ctx.meta]
    ctx.set_token_slots(slots)
    assert all(torch.equal(a, b) for a, b in zip(got, ctx.meta))


@pytest.mark.parametrize("requests, match", [
    ([("nope", 2)], r"adapter 'nope' is not loaded \(loaded: 'a', 'b', 'c'\)"),
    ([("a", 40)], r"40 tokens exceed the context's capacity max_tokens=32"),
    ([("a", -1)], r"request 0's num_tokens must be an int >= 0"),
    ([("a", 2.0)], r"request 0's num_tokens must be an int >= 0"),
    ([("a", 1), (3, 1)], r"request 1's adapter must be a name or None"),
    (["a"], r"request 0 must be \(adapter name or None, num_tokens\)"),
], ids=["unknown_name", "over_capacity", "negative_count", "float_count", "slot_number_as_name", "bare_name"])
def test_set_batch_errors_leave_the_batch_alone(requests, match):
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    ctx.set_batch([("a", 2), (None, 1)])
    before = [t.clone() for t in ctx.meta]
    with pytest.raises((ValueError, TypeError), match=match):
        ctx.set_batch(requests)
    assert ctx.num_tokens == 3 and all(torch.equal(b, t) for b, t in zip(before, ctx.meta))


def test_raw_slot_out_of_range_is_an_error():
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"slot 4 at token 1 is outside \[-1, max_loras=4\)"):
        ctx.set_token_slots(torch.tensor([0, 4]))


def test_forward_checks_the_token_count():
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    ctx.set_batch([("a", 5)])
    with pytest.raises(ValueError, match="the input has 6 tokens but the batch was set for 5"):
        model["proj"](torch.randn(2, 3, K))


def test_a_layer_over_some_tokens_is_named_in_the_error():
    """A pooler (one token a sequence, as BERT's) selected by "all-linear" sees fewer rows than the batch's
    tokens: the error names the layer's path and why it cannot take per-token adapters."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(K, K)
            self.pooler = nn.Linear(K, K)
            self.head = nn.Linear(K, 3)

        def forward(self, x):               # x [batch, seq, K]
            h = self.proj(x)
            pooled = self.pooler(h[:, 0])
            return h, pooled, self.head(torch.tanh(pooled))
    model = Encoder()
    ctx = apply_lora(model, "all-linear", max_loras=2, max_rank=4, max_tokens=16)
    ctx.set_batch([(None, 5), (None, 5)])
    with pytest.raises(ValueError, match=r"LoRALinear 'pooler': the input has 2 tokens but the batch was set for "
                                         r"10.*a pooler or a classification head.*takes its rows' adapters inside "
                                         r"ctx.per_row"):
        model(torch.randn(2, 5, K))
    # Inside per_row the pooler takes each row's adapter for the row's one token, and so does the head over
    # the pooled token (a tensor of its own: BERT's classifier, which "all-linear" adapts too, was refused).
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (K, K), "pooler": (K, K), "head": (K, 3)}, 2, seed=5))
    x = torch.randn(2, 5, K)
    with torch.no_grad():
        with ctx.per_row(["a", None]):
            h, pooled, logits = model(x)
        ctx.set_batch([("a", 1), (None, 1)])
        want = ctx.layers["pooler"](h[:, 0])
        assert rel_err(want, model.pooler.base(h[:, 0])) > 1e-3       # (the adapter matters)
        want_logits = ctx.layers["head"](torch.tanh(want))
        assert rel_err(want_logits, model.head.base(torch.tanh(want))) > 1e-3
    assert torch.equal(pooled, want) and torch.equal(logits, want_logits)
    # Rows' worth of gathered tokens (a routed expert's, say) after an input with rows are no view of a row
    # each: refused, not served by row.
    with torch.no_grad(), ctx.per_row(["a", None]):
        h = model.proj(x)
        with pytest.raises(ValueError, match=r"LoRALinear 'pooler': inside per_row .* got shape \(2, 24\)"):
            model.pooler(h.reshape(-1, K)[torch.tensor([0, 5])])
    ctx = apply_lora(Encoder(), ["proj"], max_loras=2, max_rank=4, max_tokens=16)
    ctx.set_batch([(None, 5), (None, 5)])
    assert ctx.layers["proj"](torch.randn(2, 5, K)).shape == (2, 5, K)


class TwoLengths(nn.Module):
    """An encoder-decoder in miniature: ``proj`` over the source rows [B, S, K], ``cross`` over the target rows
    [B, T, K] (after adding the source's mean, so both shapes meet in one forward)."""

    def __init__(self, proj):
        super().__init__()
        self.proj, self.cross = proj, nn.Linear(N, N)

    def forward(self, src, tgt_embeds):
        src_out = self.proj(src)
        # (the source's tokens flattened before a layer, as Qwen2-MoE's shared expert sees them: its batch)
        flat = self.proj(src.reshape(-1, src.shape[-1])).view(src_out.shape)
        return src_out + flat, self.cross(tgt_embeds + src_out.mean(1, keepdim=True))


def test_per_row_gives_each_layer_the_batch_of_its_own_input(backend):
    """Inside ctx.per_row(adapters) each layer takes its batch from its own input's rows: a prefill of 4 tokens a
    row, a decode step of 1, beam-style rows repeated in place, and one forward whose layers see two lengths
    (an encoder and a decoder). Outputs equal set_batch's with the same requests; the context's own batch is
    left as it was, and per_row's batches go with the block. Each call twice: the second replays the first's
    bound call (the Triton kernels) on the batch of its shape."""
    dev = backend.device
    layers, ctx = one_layer_model(None, torch.float32, dev)
    proj = layers["proj"]
    rows = ["a", None, "b"]
    ctx.set_batch([("c", 5)])
    before = [t.clone() for t in ctx.meta]
    cases = [(torch.randn(3, 4, K, device=dev), 1), (torch.randn(3, 1, K, device=dev), 1),
             (torch.randn(6, 2, K, device=dev), 2)]
    two = TwoLengths(proj).to(dev)
    src, tgt = torch.randn(3, 5, K, device=dev), torch.randn(3, 2, N, device=dev)
    with torch.no_grad():
        with ctx.per_row(rows):
            got = [proj(x) for x, _ in cases]
            got_two = two(src, tgt)
            assert all(torch.equal(proj(x), out) for (x, _), out in zip(cases, got))
            assert proj._eager.replays > 0 or backend.name == "torch"    # (torch kernels: no plans)
            assert len(ctx._row_batches) == 4
        assert all(torch.equal(b, t) for b, t in zip(before, ctx.meta)) and ctx.num_tokens == 5
        assert not ctx._row_batches
        for (x, repeat), out in zip(cases, got):
            ctx.set_batch([(name, x.shape[1]) for name in rows for _ in range(repeat)])
            assert torch.equal(out, proj(x))
            assert rel_err(out, proj.base(x)) > 1e-3       # (the adapters changed the rows they cover)
        ctx.set_batch([(name, 5) for name in rows])
        want = proj(src)
        assert torch.equal(got_two[0], want + want)
        ctx.set_batch([(name, 2) for name in rows])
        assert torch.equal(got_two[1], two.cross(tgt + want.mean(1, keepdim=True)))


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant", "backward_after_the_block"])
def test_per_row_training_step_matches_set_batch(checkpointing):
    """Gradients through per_row's batches (a forward and its backward in the block) equal set_batch's, with
    activation checkpointing too, and a forward of another shape between the forward and its backward (in the
    block): reentrant checkpointing's recompute (Hugging Face's default) reads the batch of its input's shape,
    never refilled in the block."""
    from torch.utils.checkpoint import checkpoint
    layers, ctx = one_layer_model(None, torch.float32, "cpu")
    proj = layers["proj"]
    for p in (proj.lora_a, proj.lora_b):
        p.requires_grad_(True)
    x = torch.randn(3, 4, K, requires_grad=checkpointing == "reentrant")   # (reentrant: an input needing grad)

    def grads(between=None):
        proj.lora_a.grad = proj.lora_b.grad = None
        out = proj(x) if checkpointing is None else checkpoint(proj, x, use_reentrant=checkpointing == "reentrant")
        if between is not None:
            with torch.no_grad():
                proj(between)
        out.square().sum().backward()
        return proj.lora_a.grad.clone(), proj.lora_b.grad.clone()

    if checkpointing == "backward_after_the_block":
        # The recompute runs after the block, another batch set: checkpoint_context gives it the block's rows.
        with ctx.per_row(["a", None, "b"]):
            out = checkpoint(proj, x, use_reentrant=False, context_fn=ctx.checkpoint_context)
        ctx.set_batch([("c", 12)])
        out.square().sum().backward()
        got = proj.lora_a.grad.clone(), proj.lora_b.grad.clone()
        assert ctx._rows is None and ctx.num_tokens == 12
    else:
        with ctx.per_row(["a", None, "b"]):
            got = grads(between=torch.randn(3, 1, K))
    ctx.set_batch([("a", 4), (None, 4), ("b", 4)])
    want = grads()
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and want[0].abs().sum() > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_row_serves_more_tokens_than_max_tokens(backend, compiled):
    """A block's input past the context's max_tokens (a long prompt under generate): eager and compiled both
    serve it (the compiled path computes its batch in the graph with no capacity; eager builds a batch of the
    input's size), equal to the float64 reference and to each other."""
    dev = backend.device
    layers, ctx = one_layer_model(None, torch.float32, dev)
    proj = layers["proj"]
    x = torch.randn(3, 13, K, device=dev)                 # 39 tokens, max_tokens=32
    run = torch.compile(proj, backend="aot_eager", fullgraph=True) if compiled else proj
    torch._dynamo.reset()
    with torch.no_grad(), ctx.per_row(["a", None, "b"]):
        got = run(x)
        assert torch.equal(run(x), got)
    slots = torch.tensor([0] * 13 + [-1] * 13 + [1] * 13, dtype=torch.int32)
    want = layer_reference(proj, x.reshape(-1, K), slots)
    assert rel_err(got.reshape(-1, N).cpu(), want) < TOLERANCE[torch.float32]
    torch._dynamo.reset()


def test_per_row_under_torch_compile_takes_flattened_tokens_after_their_rows():
    """A layer that sees its block's tokens flattened [M, K] (Qwen2-MoE's shared expert) inside per_row under
    torch.compile(fullgraph=True): the rows of the input before it in the graph, as eagerly. One graph serves
    other prefill lengths and row counts; a flattened input of another size than that input's raises."""
    layers, ctx = one_layer_model(None, torch.float32, "cpu")
    two = TwoLengths(layers["proj"])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(two, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    cases = [(["a", None, "b"], (3, 5, 2)), (["a", None, "b"], (3, 3, 2)), (["b", None, "a"], (6, 4, 3))]
    for rows, (B, S, T) in cases:
        src, tgt = torch.randn(B, S, K), torch.randn(B, T, N)
        for t in (src, tgt):
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(t, 1)
        with torch.no_grad(), ctx.per_row(rows):
            got = compiled(src, tgt)
            want = two(src, tgt)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (rows, B, S)
    assert counter.frame_count == 1

    def mismatched(x):
        layers["proj"](x)
        return layers["proj"](x[:, :-1].reshape(-1, K))
    torch._dynamo.reset()
    with pytest.raises((ValueError, RuntimeError), match=r"the flattened tokens of the last such input, or one "
                                                         r"token a row of it \[rows, features\] "
                                                         r"\(a view: input\[:, i\]\), got shape \(8, 24\)"):
        with torch.no_grad(), ctx.per_row(["a", "b"]):
            torch.compile(mismatched, backend="aot_eager", fullgraph=True)(torch.randn(2, 5, K))
    torch._dynamo.reset()


@pytest.mark.parametrize("what, match", [
    ("unknown_adapter", r"adapter 'nope' is not loaded"),
    ("no_adapters", r"per_row: adapters is empty"),
    ("rows_not_a_multiple", r"LoRALinear 'proj': the input has 4 rows; per_row expects a multiple of its 3 adapters"),
    ("flat_input", r"LoRALinear 'proj': inside per_row a layer's input must be \[rows, tokens, \.\.\., features\], "
                   r"the flattened tokens of the last such input, or one token a row of it \[rows, features\] "
                   r"\(a view: input\[:, i\]\), got shape \(5, 24\)"),
    ("nested", r"per_row: already active on this context"),
    ("compiled_flat_input", r"LoRALinear 'proj': inside per_row a layer's input must be \[rows, tokens, \.\.\., "
                            r"features\], the flattened tokens of the last such input, or one token a row of it "
                            r"\[rows, features\] \(a view: input\[:, i\]\), got shape \(6, 24\)"),
    ("compiled_rows_not_a_multiple", r"LoRALinear 'proj': the input has 4 rows; per_row expects a multiple of its "
                                     r"3 adapters"),
    ("a_string", r"per_row: adapters must be a list of adapter names \(or None\), one per row; got the string 'ab'"),
    ("unload_in_block", r"unload_adapter: adapter 'b' serves rows of the active per_row block"),
    ("set_batch_in_block", r"set_batch: per_row is active on this context, and inside its block each layer takes "
                           r"its batch from its input's rows; call set_batch after the block"),
    ("set_token_slots_in_block", r"set_token_slots: per_row is active on this context"),
])
def test_per_row_errors(what, match):
    layers, ctx = one_layer_model(None, torch.float32, "cpu")
    proj = layers["proj"]
    rows = {"unknown_adapter": ["a", "nope"], "no_adapters": [], "a_string": "ab"}.get(what, ["a", None, "b"])
    x = {"rows_not_a_multiple": torch.randn(4, 2, K), "flat_input": torch.randn(5, K), "compiled_flat_input":
         torch.randn(6, K), "compiled_rows_not_a_multiple":
         torch.randn(4, 2, K)}.get(what, torch.randn(3, 2, K))
    run = torch.compile(proj, backend="eager", fullgraph=True) if what.startswith("compiled") else proj
    torch._dynamo.reset()
    with pytest.raises((ValueError, RuntimeError, TypeError), match=match):
        with ctx.per_row(rows):
            if what == "nested":
                with ctx.per_row(rows):
                    pass
            if what == "unload_in_block":
                ctx.unload_adapter("b")
            if what == "set_batch_in_block":    # (it was accepted and ignored: the rows set every layer's batch)
                ctx.set_batch([("a", 6)])
            if what == "set_token_slots_in_block":
                ctx.set_token_slots(torch.zeros(6, dtype=torch.int32))
            run(x)
    assert ctx._rows is None and ctx.row_slots == frozenset()
    if what == "unload_in_block":
        ctx.unload_adapter("b")      # after the block


def test_base_layer_is_reused_not_copied():
    torch.manual_seed(0)
    base = nn.Linear(K, N)
    ptr = base.weight.data_ptr()
    ctx = LoRAContext(max_loras=2, max_tokens=8)
    layer = LoRALinear(base, ctx, max_rank=4)
    assert layer.base is base and layer.base.weight.data_ptr() == ptr
    model = toy_lm()
    linears = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    ctx = apply_lora(model, ["q_proj", "down_proj"], max_loras=2, max_rank=4, max_tokens=8)
    for path, layer in ctx.layers.items():
        assert layer.base is linears[path] and model.get_submodule(path) is layer


def test_stacks_are_frozen_parameters_and_dtype_casts_keep_scale_fp32():
    model, ctx = one_layer_model({"q": 20, "k": 12, "v": 8}, torch.float32, "cpu")
    layer = model["proj"]
    assert isinstance(layer.lora_a, nn.Parameter) and not layer.lora_a.requires_grad
    assert isinstance(layer.lora_b, nn.Parameter) and not layer.lora_b.requires_grad
    assert tuple(layer.lora_a.shape) == (MAX_LORAS, 3, MAX_RANK, K) and tuple(layer.lora_b.shape) == (MAX_LORAS, N,
                                                                                                     MAX_RANK)
    scale = layer.scale.clone()
    model.to(torch.float16)
    assert layer.lora_a.dtype == torch.float16 and layer.base.weight.dtype == torch.float16
    assert layer.scale.dtype == torch.float32 and torch.equal(layer.scale, scale)
    assert layer.rank.dtype == torch.int32
    names = dict(model.named_buffers())
    assert names["proj.scale"] is layer.scale and layer.context is ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_module_type_keeps_rank_int32_and_the_layer_serving(dtype):
    """nn.Module.type(dtype) casts integer buffers too: rank became float and every later forward raised
    "rank: expected dtype torch.int32", which named neither the layer nor the conversion."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    model.type(dtype)
    assert layer.rank.dtype == torch.int32 and layer.scale.dtype == torch.float32
    assert layer.lora_a.dtype == dtype and layer.base.weight.dtype == dtype
    ctx.set_batch(REQUESTS)
    x = torch.randn(12, K, dtype=dtype)
    with torch.no_grad():
        got = layer(x)
    want = layer_reference(layer, x, request_slots(ctx, REQUESTS))
    assert rel_err(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("stack_a", [False, True], ids=["plain", "stack_a"])
def test_a_conversion_under_inference_mode_leaves_the_adapters_writable(stack_a):
    """model.half() inside torch.inference_mode made the adapter stacks inference tensors: later loads,
    unloads and train_slots failed on torch's "Inplace update to inference tensor", and with stack_a a
    replace failed halfway, its slot's A already cleared (a failed load must leave every slot as it was).
    The conversion makes normal tensors; a stack that is an inference tensor anyway is refused before any
    write."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    if stack_a:
        layer._stack()
    with torch.inference_mode():
        model.half()
    assert not layer.lora_a.is_inference() and not layer.lora_b.is_inference()
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (K, N)}, 3, seed=9), replace=True)
    ctx.unload_adapter("b")
    ctx.set_batch([("a", 4), ("c", 4)])
    x = torch.randn(8, K, dtype=torch.float16)
    with torch.no_grad():
        got = layer(x)
    assert rel_err(got, layer_reference(layer, x, request_slots(ctx, [("a", 4), ("c", 4)]))) <= TOLERANCE[torch.float16]
    with torch.inference_mode():
        frozen = layer.lora_b.detach().clone()
    lora_b = layer.lora_b
    lora_b.data = frozen
    before = [t.clone() for t in (layer.lora_a, layer.lora_b, layer.scale, layer.rank)]
    with pytest.raises(AdapterError, match=r"lora_b of 'proj' is an inference tensor"):
        ctx.load_adapter_tensors("a", peft_tensors({"proj": (K, N)}, 2, seed=10), replace=True)
    assert all(torch.equal(t, u) for t, u in zip(before, (layer.lora_a, layer.lora_b, layer.scale, layer.rank)))


@pytest.mark.parametrize("stack_a", [False, True], ids=["plain", "stack_a"])
def test_to_empty_after_meta_empties_the_slots_and_unloads_the_names(stack_a):
    """model.to("meta") then to_empty(): the stacks, ranks and scales held whatever the memory held, the
    context still listed the adapters, and set_batch served the garbage (ranks of -1551737373) silently. Every
    slot is emptied, with a warning naming the adapters unloaded; loads work again."""
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    if stack_a:
        layer._stack()
    base = {k: v.clone() for k, v in layer.base.state_dict().items()}
    model.to("meta")
    with pytest.warns(UserWarning, match=r"the model left the meta device \(to_empty\): the adapter slots hold no "
                                         r"data, and \['a', 'b', 'c'\] are unloaded; load them again"):
        model.to_empty(device="cpu")
    layer.base.load_state_dict(base)
    assert ctx.adapters == {} and layer.rank.tolist() == [0] * MAX_LORAS and layer.slot_ranks == [0] * MAX_LORAS
    assert not layer.lora_a.any() and not layer.lora_b.any() and not layer.scale.any()
    with pytest.raises(ValueError, match="adapter 'a' is not loaded"):
        ctx.set_batch([("a", 2)])
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (K, N)}, 3, seed=9), {"r": 3, "lora_alpha": 6})
    ctx.set_batch([("a", 4), (None, 2)])
    x = torch.randn(6, K)
    with torch.no_grad():
        got = layer(x)
    want = layer_reference(layer, x, request_slots(ctx, [("a", 4), (None, 2)]))
    assert rel_err(got, want) <= TOLERANCE[torch.float32]


def test_a_wrapped_layer_refuses_resizing_naming_it():
    """Hugging Face's resize_token_embeddings sets lm_head.out_features: torch's "property 'out_features' of
    'LoRALinear' object has no setter" named nothing to act on."""
    model, _ = one_layer_model(None, torch.float32, "cpu")
    for name in ("out_features", "in_features"):
        with pytest.raises(AttributeError, match=rf"LoRALinear 'proj': {name} is the base layer's, and the adapter "
                                                 rf"stacks are sized by it; a wrapped layer cannot be resized \(to "
                                                 rf"7\): resize the model \(resize_token_embeddings\) before "
                                                 rf"apply_lora"):
            setattr(model["proj"], name, 7)


def test_apply_lora_keeps_the_models_eval_mode():
    """A new module is in training mode: apply_lora on a model in eval() (from_pretrained's) left its wrapped
    layers training, so an open trainer's adapter dropout ran in the eval model's forwards."""
    model = nn.Sequential(nn.Linear(K, N), nn.Linear(N, K)).eval()
    model[1].train()
    apply_lora(model, ["0", "1"], max_loras=2, max_rank=4, max_tokens=8)
    assert not model[0].training and not model[0].base.training
    assert model[1].training


def test_ranks_per_slot_and_host_mirror():
    model, ctx = one_layer_model(None, torch.float32, "cpu")
    layer = model["proj"]
    expected = [2, MAX_RANK, 5, 0]
    assert layer.rank.tolist() == expected and layer.slot_ranks == expected
    assert layer.scale.tolist() == pytest.approx([3.0 / 2, -12.0 / MAX_RANK, 5.0 / 5, 0.0])


# ---- apply_lora: which modules it wraps ---------------------------------------------------------------

def wrapped(model, target_modules, **kw):
    ctx = apply_lora(model, target_modules, max_loras=2, max_rank=4, max_tokens=8, **kw)
    return sorted(ctx.layers)


def test_target_names_match_whole_dotted_suffixes():
    assert wrapped(toy_lm(), ["q_proj", "model.layers.1.mlp.down_proj"]) == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    # "proj" is not a dotted suffix of "q_proj": PEFT's rule, so nothing matches.
    with pytest.raises(ValueError, match=r"target_modules: \['proj'\] selects no nn.Linear in ToyLM"):
        wrapped(toy_lm(), ["proj"])


def test_target_regex_must_match_the_whole_path():
    assert wrapped(toy_lm(), r".*\.1\.self_attn\.(q|v)_proj") == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    with pytest.raises(ValueError, match=r"selects no nn.Linear in ToyLM \(a string is a regex that must match a "
                                         r"whole module path, as in PEFT; for the modules of that name pass a list: "
                                         r"\['q_proj'\]\)"):
        wrapped(toy_lm(), r"q_proj")        # a regex is a full match, not a search
    with pytest.raises(ValueError, match="not a valid regex"):
        wrapped(toy_lm(), r"(q_proj")


def test_all_linear_skips_the_output_layer():
    paths = wrapped(toy_lm(), "all-linear")
    assert len(paths) == 2 * 7 and "lm_head" not in paths


@pytest.mark.parametrize("targets, kind", [(["embed_tokens"], "torch.nn.modules.sparse.Embedding"),
                                           (["norm"], "torch.nn.modules.normalization.LayerNorm"),
                                           (r"model\.layers\.0", "layer_helpers.Block"),
                                           (["q_proj"], "torch.ao.nn.quantized.dynamic.modules.linear.Linear")],
                         ids=["embedding", "norm", "block", "quantized"])
def test_non_linear_target_is_an_error_naming_the_layer_type(targets, kind):
    """Named by module and class: a dynamic-quantized layer, also a "Linear", read "a Linear: only nn.Linear
    layers are supported" (session 54)."""
    model = toy_lm()
    if kind.startswith("torch.ao"):
        model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(TypeError, match=f"a {re.escape(kind)}: only nn.Linear layers are supported"):
        wrapped(model, targets)
    assert not any(isinstance(m, LoRALinear) for m in model.modules()), "a failed apply_lora must change nothing"


def test_an_uninitialised_lazy_linear_is_named_and_nothing_is_wrapped():
    """An nn.LazyLinear before its first forward: apply_lora failed in torch's own code after wrapping the layers
    before it, leaving the model half wrapped; it names the layer now, before wrapping any."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"'1', an nn.LazyLinear whose weight is not initialised: run one forward"):
        apply_lora(model, "all-linear", max_loras=1, max_rank=2, max_tokens=4)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    model(torch.randn(2, 4))
    assert len(apply_lora(model, ["0", "1"], max_loras=1, max_rank=2, max_tokens=4).layers) == 2


def test_multihead_attention_out_proj_is_refused_or_skipped():
    """nn.MultiheadAttention never calls its out_proj (it passes the weight and bias to the attention
    function), so a LoRALinear there would not run: naming it is an error (it was an AttributeError at the
    first forward), and "all-linear" leaves it alone."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = nn.Linear(16, 16)
    model = Block()
    with pytest.raises(TypeError, match="'attn.out_proj', the output projection of an nn.MultiheadAttention"):
        apply_lora(model, ["out_proj"], max_loras=2, max_rank=4, max_tokens=8)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert sorted(apply_lora(model, "all-linear", max_loras=2, max_rank=4, max_tokens=8).layers) == ["mlp"]


def test_packed_layers_are_selected_by_their_slice_names():
    from layer_helpers import fused_copy
    fused = fused_copy(toy_lm())
    ctx = apply_lora(fused, ["q_proj", "v_proj", "down_proj"], max_loras=2, max_rank=4, max_tokens=8,
                     packed_modules=PACKED)
    assert sorted(ctx.layers) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.qkv_proj",
                                  "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.qkv_proj"]
    layer, index = ctx.targets["model.layers.1.self_attn.k_proj"]
    assert layer is ctx.layers["model.layers.1.self_attn.qkv_proj"] and index == 1
    assert layer.slice_widths == (32, 16, 16)


def test_packed_widths_must_sum_to_the_layer():
    from layer_helpers import fused_copy
    with pytest.raises(ValueError, match=r"slice widths of 'model.layers.0.mlp.gate_up_proj' sum to 50"):
        apply_lora(fused_copy(toy_lm()), ["gate_up_proj"], max_loras=2, max_rank=4, max_tokens=8,
                   packed_modules={"gate_up_proj": {"gate_proj": 25, "up_proj": 25}})


def test_lora_linear_argument_errors():
    ctx = LoRAContext(max_loras=2, max_tokens=8)
    with pytest.raises(TypeError, match="base: expected an nn.Linear, got Conv1d"):
        LoRALinear(nn.Conv1d(2, 2, 1), ctx, max_rank=4)
    with pytest.raises(ValueError, match=r"slice_widths: expected positive widths summing to out_features=40"):
        LoRALinear(nn.Linear(K, N), ctx, max_rank=4, slice_widths=[20, 10])
    for max_rank in (0, 2.5, True, "8", None):
        with pytest.raises(ValueError, match=f"^max_rank: expected an int >= 1, got {re.escape(repr(max_rank))}$"):
            LoRALinear(nn.Linear(K, N), ctx, max_rank=max_rank)


def test_public_exports():
    for name in ("LoRALinear", "LoRAContext", "apply_lora", "load_peft_adapter", "load_adapter_tensors",
                 "unload_adapter"):
        assert name in lora_ops.__all__ and hasattr(lora_ops, name)


def test_lora_ops_works_on_a_cpu_install_without_triton():
    """The main example's install has no Triton (README): importing lora_ops, building layers and calling
    them on CPU tensors must not import it (a session-24 module imported the launchers at import time)."""
    import os
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['triton'] = None\n"     # `import triton` now raises ImportError
        "import torch, lora_ops\n"
        "from torch import nn\n"
        "ctx = lora_ops.LoRAContext(2, 8)\n"
        "layer = lora_ops.LoRALinear(nn.Linear(16, 24), ctx, 4)\n"
        "ctx.set_token_slots(torch.tensor([0, -1, 1, 0], dtype=torch.int32))\n"
        "x = torch.randn(4, 16)\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(layer(x), layer(x))\n"
        "assert 'lora_ops.launch' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LORA_OPS_CPU_BACKEND")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_pinned_staging_is_copied_fresh(monkeypatch):
    """A CUDA context stages per-token slots through pinned buffers with CUDA events, which cannot be pickled
    or deep-copied: copy.deepcopy(model) failed on a GPU. A copy gets its own fresh buffers and events."""
    import copy
    import pickle

    from lora_ops import layers

    class Event:                       # as torch.cuda.Event: refuses to be copied
        def __reduce__(self):
            raise TypeError("cannot pickle 'Event' object")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # (a CPU-only torch cannot pin)
    staging = layers._PinnedStaging(12, depth=3)
    for twin in (copy.deepcopy(staging), pickle.loads(pickle.dumps(staging))):
        assert [b.shape for b in twin._buffers] == [(12,)] * 3 and len(twin._copied) == 3
        assert all(isinstance(e, Event) for e in twin._copied)
        assert not any(a.data_ptr() == b.data_ptr() for a in twin._buffers for b in staging._buffers)


@pytest.mark.parametrize("stack_a", [False, True], ids=["plain", "stack_a"])
@pytest.mark.parametrize("how", ["torch_save", "deepcopy", "torch_save_context", "deepcopy_context"])
def test_a_whole_model_saved_or_copied_keeps_its_adapters_and_points_at_itself(how, stack_a, tmp_path):
    """torch.save of a model after apply_lora raised (the context's weakref to the model cannot be pickled);
    a deep copy's context pointed at the original model, so the copy's train_slots froze the original's base
    weights. Either copy now holds the adapters by name and its context the copied model. With stack_a, a deep
    copy's parameters were clones apart from its stack (Parameter.__deepcopy__): compiled, the copy served the
    adapters as they were at the copy, whatever was loaded into it after. A context copied or saved alone
    copies the model with it: the copy's model was collected at once (held weakly), its model() None (session
    54); a copy holds its model now."""
    import copy
    import gc
    model = toy_lm(seed=3)
    ctx = apply_lora(model, ["q_proj", "down_proj"], max_loras=2, max_rank=4, max_tokens=32, stack_a=stack_a)
    shapes = module_shapes(model, ["q_proj", "down_proj"])
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 4, seed=1))
    ctx.set_batch([("a", 3), (None, 2)])
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    if how == "torch_save":
        torch.save(model, tmp_path / "model.pt")
        twin = torch.load(tmp_path / "model.pt", weights_only=False)
    elif how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        if how == "torch_save_context":
            torch.save(ctx, tmp_path / "context.pt")
            twin_ctx = torch.load(tmp_path / "context.pt", weights_only=False)
        else:
            twin_ctx = copy.deepcopy(ctx)
        gc.collect()
        twin = twin_ctx.model()
        assert twin is not None and twin is not model
    twin_ctx = twin.model.layers[0].self_attn.q_proj.context
    assert twin_ctx is not ctx and twin_ctx.model() is twin and twin_ctx.slot_names == ["a", None]
    twin_ctx.set_batch([("a", 3), (None, 2)])
    with torch.no_grad():
        assert torch.equal(twin(ids), want)
    if stack_a:
        for layer in twin_ctx.layers.values():
            assert layer._stacked is not None and layer._stack_intact(layer.base.weight, layer.base.bias,
                                                                      layer.lora_a)
        twin_ctx.load_adapter_tensors("a", peft_tensors(shapes, 4, seed=2), replace=True)
        torch._dynamo.reset()
        with torch.no_grad():
            eager, compiled = twin(ids), torch.compile(twin, backend="eager")(ids)
        assert rel_err(eager, want) > 1e-3 and rel_err(compiled, eager) <= 1e-5
    twin_ctx.train_slots(["a"])        # (freeze_base: the copy's base weights, not the original's)
    assert not twin.model.layers[0].self_attn.q_proj.base.weight.requires_grad
    assert model.model.layers[0].self_attn.q_proj.base.weight.requires_grad


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_forward_hook_on_the_base_layer_keeps_the_base_output(grad):
    """A hook on the base nn.Linear that keeps its output (activation capture) sees the base layer's output,
    as under PEFT: under no_grad the delta was added in place into the tensor the hook held."""
    torch.manual_seed(0)
    base = nn.Linear(16, 24)
    captured = []
    base.register_forward_hook(lambda module, args, out: captured.append(out))
    model = nn.Sequential(base)
    ctx = apply_lora(model, ["0"], max_loras=1, max_rank=4, max_tokens=8)
    ctx.load_adapter_tensors("a", peft_tensors({"0": (16, 24)}, 4, seed=1, prefix=""))
    ctx.set_batch([("a", 5)])
    x = torch.randn(5, 16)
    with torch.set_grad_enabled(grad):
        out = model(x)
    assert torch.equal(captured[0], nn.functional.linear(x, base.weight, base.bias))
    want = layer_reference(model[0], x, torch.zeros(5, dtype=torch.int32)).float()
    assert rel_err(out.detach(), want) <= 1e-5


def test_load_state_dict_restores_the_slots_and_their_host_ranks():
    """A state dict carries each layer's stacks, scale and rank (not the names, the context's): loaded into a
    fresh model, slots addressed by id compute as before, and the host mirror of the ranks (read by
    save_adapter and the checks) follows the rank buffer it loaded, where it stayed at zero."""
    def build():
        model = toy_lm(seed=3)
        return model, apply_lora(model, ["q_proj", "down_proj"], max_loras=2, max_rank=4, max_tokens=32)
    model, ctx = build()
    shapes = module_shapes(model, ["q_proj", "down_proj"])
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 3, seed=1))
    twin, twin_ctx = build()
    twin.load_state_dict(model.state_dict())
    assert all(layer.slot_ranks == [3, 0] for layer in twin_ctx.layers.values())
    slots = torch.tensor([0, -1, 0, 0], dtype=torch.int32)
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    ctx.set_token_slots(slots)
    twin_ctx.set_token_slots(slots)
    with torch.no_grad():
        assert torch.equal(twin(ids), model(ids))


def _named_model(names_and_seeds):
    """toy_lm with q_proj / down_proj wrapped and adapters loaded by name, in order ({name: (seed, r, alpha)})."""
    model = toy_lm(seed=3)
    ctx = apply_lora(model, ["q_proj", "down_proj"], max_loras=3, max_rank=4, max_tokens=32)
    shapes = module_shapes(model, ["q_proj", "down_proj"])
    for name, (seed, r, alpha) in names_and_seeds.items():
        ctx.load_adapter_tensors(name, peft_tensors(shapes, r, seed=seed),
                                 {"r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "down_proj"]})
    return model, ctx


def _outputs_by_name(model, ctx, names):
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in names:
        ctx.set_batch([(name, 4)])
        with torch.no_grad():
            out[name] = model(ids)
    return out


NAMED = {"a": (1, 2, 4), "b": (2, 4, 2), "c": (3, 3, 3)}


@pytest.mark.parametrize("part", ["whole_model", "one_block", "strict_false_one_layer"])
def test_load_state_dict_puts_each_adapter_in_its_names_slot(part):
    """A checkpoint's slots in another order than this context's (another process loaded the adapters in another
    order): load_state_dict wrote a's weights into b's slot, and each name served the other adapter, silently.
    The state dict holds each slot's name key: every layer it loads puts each adapter in its name's slot here,
    so a load of part of the model (one block, or strict=False) leaves every name its own adapter in every layer.
    The context's names and configs do not move."""
    source, source_ctx = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    want = _outputs_by_name(source, source_ctx, ["a", "b"])
    model, ctx = _named_model({"b": NAMED["b"], "a": NAMED["a"]})
    before = _outputs_by_name(model, ctx, ["a", "b"])
    assert all(torch.equal(before[n], want[n]) for n in want)      # (the same adapters, other slots)
    with torch.no_grad():       # the checkpoint's adapters trained further: other weights
        for layer in source_ctx.layers.values():
            layer.lora_b.mul_(2)
    want = _outputs_by_name(source, source_ctx, ["a", "b"])
    configs = copy.deepcopy(ctx.adapter_configs)
    if part == "whole_model":
        model.load_state_dict(source.state_dict())
    elif part == "one_block":
        model.model.layers[0].load_state_dict(source.model.layers[0].state_dict())
    else:
        path = "model.layers.1.mlp.down_proj."
        model.load_state_dict({k: v for k, v in source.state_dict().items() if k.startswith(path)}, strict=False)
    assert ctx.adapters == {"b": 0, "a": 1} and ctx.adapter_configs == configs
    got = _outputs_by_name(model, ctx, ["a", "b"])
    for name in ("a", "b"):
        if part == "whole_model":
            assert torch.equal(got[name], want[name]), name
        else:   # (part of the model loaded: its own adapter, the loaded layers' weights doubled)
            assert not torch.equal(got[name], want[name]) and not torch.equal(got[name], before[name]), name
    for layer in ctx.layers.values():
        assert layer.slot_keys.tolist() == [slot_key("b"), slot_key("a"), 0]
        assert layer.slot_ranks == [NAMED["b"][1], NAMED["a"][1], 0]


def test_load_state_dict_of_an_earlier_checkpoint_keeps_names_it_does_not_hold():
    """A server rolled back to a checkpoint after unloading a and loading c into a's slot: c's name served a's
    weights. Now c keeps its adapter (the checkpoint holds none of that name), b takes the checkpoint's, and a,
    which this context no longer knows by name, is not loaded (warned): load it by name."""
    model, ctx = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    want = _outputs_by_name(model, ctx, ["b"])
    ctx.unload_adapter("a")
    ctx.load_adapter_tensors("c", peft_tensors(module_shapes(model, ["q_proj", "down_proj"]), 3, seed=3))
    with torch.no_grad():
        for layer in ctx.layers.values():
            layer.lora_b[ctx.slot_of("b")].mul_(3)      # b trained on since the checkpoint
    c_before = _outputs_by_name(model, ctx, ["c"])
    assert ctx.slot_of("c") == 0
    with pytest.warns(UserWarning, match=r"the checkpoint's slot\(s\) \[0\] hold adapters this context does not "
                                         r"know by name, and those slots hold others here: not loaded"):
        model.load_state_dict(checkpoint)
    assert ctx.adapters == {"c": 0, "b": 1}
    got = _outputs_by_name(model, ctx, ["b", "c"])
    assert torch.equal(got["b"], want["b"]) and torch.equal(got["c"], c_before["c"])


@pytest.mark.parametrize("what", ["model", "context"])
def test_a_model_pickled_before_slot_keys_loads_with_the_keys_of_its_names(what, tmp_path):
    """A model (or its context) pickled before the layers had slot_keys: the layers unpickled inside the
    context's state, before it, read its names to make their keys and failed (AttributeError). They take them
    once the context is unpickled; then a state dict round trip keeps every name."""
    import gc
    model, ctx = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    for layer in ctx.layers.values():
        del layer._buffers["slot_keys"]         # (as pickled before session 54)
    torch.save(model if what == "model" else ctx, tmp_path / "old.pt")
    loaded = torch.load(tmp_path / "old.pt", weights_only=False)
    gc.collect()
    twin = loaded if what == "model" else loaded.model()
    twin_ctx = twin.model.layers[0].self_attn.q_proj.context
    want = torch.tensor([slot_key(n) for n in twin_ctx.slot_names])
    assert twin_ctx.slot_names == ["a", "b", None]
    assert all(torch.equal(layer.slot_keys, want) for layer in twin_ctx.layers.values())
    twin.load_state_dict(twin.state_dict())
    assert twin_ctx.slot_names == ["a", "b", None]


def test_a_name_takes_one_slot_after_a_checkpoint_left_its_key_in_another():
    """A fresh model loaded a checkpoint (slots unnamed, their keys a and b), then b by name into slot 0: slot 1
    kept b's key, and restoring a snapshot named both slots b, set_batch serving the old b. A load clears its
    key elsewhere, and a name takes one slot."""
    source, _ = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    model, ctx = _named_model({})
    model.load_state_dict(source.state_dict())
    ctx.load_adapter_tensors("b", peft_tensors(module_shapes(model, ["q_proj", "down_proj"]), 4, seed=7))
    assert ctx.slot_names == ["b", None, None]
    model.load_state_dict(model.state_dict())
    assert ctx.slot_names == ["b", None, None] and ctx.adapters == {"b": 0}
    keys = [slot_key("b"), 0, 0]
    first = ctx.layers["model.layers.0.self_attn.q_proj"]
    assert first.slot_keys[1] == 0 and first.slot_keys[0] == keys[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_a_checkpoint_cast_whole_keeps_the_names(dtype):
    """{k: v.half()}: the keys no longer name anything (int64 through a 16-bit float); every name was dropped.
    The layer keeps its own keys and the names stay, as for a checkpoint without keys."""
    import warnings
    model, ctx = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    keys = ctx.layers["model.layers.0.self_attn.q_proj"].slot_keys.clone()
    for assign in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.load_state_dict({k: v.to(dtype) if v.is_floating_point() or k.endswith("slot_keys") else v
                                   for k, v in model.state_dict().items()}, assign=assign)
        assert ctx.slot_names == ["a", "b", None]
        assert all(layer.slot_keys.dtype == torch.int64 and torch.equal(layer.slot_keys, keys)
                   for layer in ctx.layers.values())
        model.float()


def test_a_failed_load_state_dict_leaves_the_layers_slots_as_they_were():
    """A checkpoint of another max_rank: its stacks fail to load, and torch had loaded its rank and scale beside
    the old stacks (each name then served its adapter at another's rank). The layer's slots stay as they were."""
    model, ctx = _named_model({"b": NAMED["b"], "a": NAMED["a"]})
    want = _outputs_by_name(model, ctx, ["a", "b"])
    other = toy_lm(seed=3)
    other_ctx = apply_lora(other, ["q_proj", "down_proj"], max_loras=3, max_rank=8, max_tokens=32)
    shapes = module_shapes(other, ["q_proj", "down_proj"])
    for name in ("a", "b"):
        other_ctx.load_adapter_tensors(name, peft_tensors(shapes, 2, seed=5))
    with pytest.raises(RuntimeError, match="size mismatch for model.layers.0.self_attn.q_proj.lora_a"):
        model.load_state_dict(other.state_dict())
    got = _outputs_by_name(model, ctx, ["a", "b"])
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert all(layer.slot_ranks == [NAMED["b"][1], NAMED["a"][1], 0] for layer in ctx.layers.values())


def test_load_state_dict_inside_per_row_keeps_each_rows_adapter():
    """Inside a per_row block the rows hold slots: a checkpoint of another slot order (which once moved the names)
    leaves every row its own adapter, the checkpoint's weights of it."""
    source, source_ctx = _named_model({"b": NAMED["b"], "a": NAMED["a"]})
    model, ctx = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), source_ctx.per_row(["a", "b"]):
        want = source(ids)
    with torch.no_grad(), ctx.per_row(["a", "b"]):
        model.load_state_dict(source.state_dict())
        assert torch.equal(model(ids), want)


@pytest.mark.parametrize("how", ["same_names", "fresh_model", "checkpoint_without_keys"])
def test_load_state_dict_keeps_names_where_nothing_moved(how):
    """Resuming (the same adapters loaded by name, then their trained weights), a fresh model with no names
    (slots by id, as before), and a checkpoint written before the state dict held the keys (strict load: not
    a missing key; the names stay): no warning, no name changes."""
    import warnings
    source, _ = _named_model({"a": NAMED["a"], "b": NAMED["b"]})
    state = source.state_dict()
    if how == "checkpoint_without_keys":
        state = {k: v for k, v in state.items() if not k.endswith("slot_keys")}
    model, ctx = _named_model({} if how == "fresh_model" else {"a": NAMED["a"], "b": NAMED["b"]})
    before = list(ctx.slot_names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(state)
    assert ctx.slot_names == before


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("one_launch_fill", [False, True], ids=["torch_fill", "one_launch_fill"])
def test_a_layer_on_another_gpu_than_the_current_one(one_launch_fill):
    """Models on several GPUs of one process (a LoRAContext each): a layer's tensors need not be on the
    current device, where Triton launches. Forward (op path, then bound calls), backward and the batch fill
    run on the tensors' GPU: outputs and gradients as with that GPU current, the current one left as it was."""
    model, ctx = one_layer_model(None, torch.float32, "cuda:1")
    layer = model["proj"]
    layer.lora_a.requires_grad_(True)
    layer.lora_b.requires_grad_(True)
    x = torch.randn(12, K, device="cuda:1")
    grad_out = torch.randn(12, N, device="cuda:1")

    def run():
        ctx.set_batch(REQUESTS)
        leaf = x.clone().requires_grad_(True)
        outs = [layer(leaf) for _ in range(3)]     # the op's path, then bound calls
        outs[-1].backward(grad_out)
        with torch.no_grad():
            outs += [layer(x) for _ in range(3)]
        return outs, leaf.grad, layer.lora_b.grad.clone()
    with fill_setting(one_launch_fill):
        with torch.cuda.device(1):
            want = run()
        layer.lora_b.grad = None
        torch.cuda.set_device(0)
        got = run()
        assert torch.cuda.current_device() == 0
    for a, b in zip(want[0] + [want[1], want[2]], got[0] + [got[1], got[2]]):
        assert torch.equal(a, b)
    ref = layer_reference(layer, x, request_slots(ctx, REQUESTS))
    assert rel_err(got[0][-1].cpu(), ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("wrap", ["weight_norm", "orthogonal", "legacy_spectral_norm", "legacy_weight_norm"])
def test_stack_a_leaves_a_computed_weight_unstacked(wrap):
    """stack_a replaces a layer's weight by a view of its stack; a parametrized weight (torch.nn.utils.
    parametrize) or one a pre-hook computes (the legacy weight_norm / spectral_norm) is not a parameter to
    replace: apply_lora raised torch's KeyError, or the first forward a TypeError. Such a layer runs unstacked,
    with its adapters."""
    import warnings
    from torch.nn.utils import parametrizations
    make = {"weight_norm": parametrizations.weight_norm, "orthogonal": parametrizations.orthogonal,
            "legacy_spectral_norm": nn.utils.spectral_norm, "legacy_weight_norm": nn.utils.weight_norm}[wrap]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # (the legacy weight_norm's deprecation)
        model = nn.ModuleDict({"proj": make(nn.Linear(16, 16))})
    ctx = apply_lora(model, ["proj"], max_loras=2, max_rank=4, max_tokens=8, stack_a=True)
    assert model["proj"]._stacked is None
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (16, 16)}, 4, seed=1, prefix=""))
    ctx.set_batch([("a", 3), (None, 2)])
    x = torch.randn(5, 16)
    with torch.no_grad():
        out = model["proj"](x)
        want = layer_reference(model["proj"], x, torch.tensor([0, 0, 0, -1, -1])).float()
    assert rel_err(out, want) <= 1e-5


def _delta64(layer, z):
    """float64 z W^T + b + slot 0's delta, for a one-slot layer whose every token takes slot 0."""
    return layer_reference(layer, z, torch.zeros(z.shape[0], dtype=torch.int64))


def _one_adapter(model, targets, seed=1):
    """apply_lora on ``targets`` (8 -> 8 layers) with adapter "a" of rank 4 (signed A and B) loaded."""
    ctx = apply_lora(model, targets, max_loras=2, max_rank=4, max_tokens=64)
    ctx.load_adapter_tensors("a", peft_tensors({t: (8, 8) for t in targets}, 4, seed=seed, prefix=""))
    return ctx


def _rows_reference(layer, z, rows):
    """float64 z W^T + b + each row's delta (z [rows, tokens, K], rows: slot per row)."""
    slots = torch.tensor(rows, dtype=torch.int64).repeat_interleave(z.shape[1])
    return layer_reference(layer, z.reshape(-1, z.shape[-1]), slots).view(*z.shape[:-1], -1)


def test_a_wrapped_layer_a_subclass_calls_on_another_shape_leaves_its_rows_batch():
    """per_row, eager: a Linear subclass whose forward calls a wrapped inner layer on an input of another shape
    ([rows, 1, K]): the inner call set the block's current batch to its own, and the outer delta took it (tokens
    past the first lost their row's adapter, silently). The outer layer takes its batch before its base runs."""
    class Gated(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)
            self.gate = nn.Linear(8, 8)

        def forward(self, x):
            return super().forward(x) * torch.sigmoid(self.gate(x.mean(1, keepdim=True)))
    torch.manual_seed(0)
    model = nn.Sequential()
    model.proj = Gated()
    ctx = _one_adapter(model, ["proj", "proj.gate"])
    outer, inner = ctx.layers["proj"], ctx.layers["proj.gate"]
    x, rows = torch.randn(2, 3, 8), [0, -1]
    base = (x.double() @ outer.base.weight.double().T + outer.base.bias.double())
    gate = torch.sigmoid(_rows_reference(inner, x.mean(1, keepdim=True), rows))
    want = base * gate + (_rows_reference(outer, x, rows) - base)
    with torch.no_grad(), ctx.per_row(["a", None]):
        assert rel_err(model(x), want) <= 1e-5


@pytest.mark.parametrize("how", ["subclass", "forward_hook"])
@pytest.mark.parametrize("change", ["float32_output", "transposed_output"])
def test_a_base_output_of_another_dtype_or_layout_takes_the_delta(how, change):
    """A base returning float32 from a bfloat16 model (logits), or a row-major-incompatible [B, T, N] view: the
    delta op raised 'y: expected dtype torch.bfloat16 (the dtype of x)', or torch's view error. The delta goes in
    the output's dtype (as PEFT adds it), into a row-major copy of such a view."""
    dtype = torch.bfloat16 if change == "float32_output" else torch.float32
    fix = ((lambda out: out.float()) if change == "float32_output"
           else (lambda out: out.transpose(0, 1).contiguous().transpose(0, 1)))

    class Odd(nn.Linear):
        def forward(self, x):
            return fix(super().forward(x))
    torch.manual_seed(0)
    model = nn.Sequential(Odd(8, 8) if how == "subclass" else nn.Linear(8, 8)).to(dtype)
    if how == "forward_hook":
        model[0].register_forward_hook(lambda module, args, out: fix(out))
    ctx = _one_adapter(model, ["0"])
    x = torch.randn(2, 3, 8).to(dtype)
    ctx.set_batch([("a", 3), (None, 3)])
    with torch.no_grad():
        out = model(x)
    assert out.dtype == (torch.float32 if change == "float32_output" else dtype) and out.shape == (2, 3, 8)
    want = _rows_reference(ctx.layers["0"], x, [0, -1])
    assert rel_err(out, want) <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_one_dimensional_input_inside_per_row_has_no_row():
    """A 1-D input [K] inside per_row (a head over the mean of every row) whose K equals rows x tokens was taken
    for that many tokens and served row 0's adapter; it is refused as for any other K."""
    model = nn.ModuleDict({"proj": nn.Linear(8, 8), "head": nn.Linear(8, 8)})
    ctx = _one_adapter(model, ["proj", "head"])
    for tokens in (3, 4):      # (2 rows x 4 tokens = K = 8)
        with torch.no_grad(), ctx.per_row(["a", None]):
            h = model["proj"](torch.randn(2, tokens, 8))
            with pytest.raises(ValueError, match=r"'head': inside per_row a layer's input must be"):
                model["head"](h.mean((0, 1)))


def test_the_wrapped_layer_takes_its_input_by_nn_linears_keyword_and_a_tie_again():
    """nn.Linear's forward takes ``input=``: the wrapped layer raised TypeError for it. Hugging Face's
    tie_weights sets a tied lm_head's weight to the one it already is: refused as read-only; a no-op now (another
    weight is still refused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    ctx = _one_adapter(model, ["0"])
    ctx.set_batch([("a", 2)])
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model[0](input=x), model[0](x))
    layer = model[0]
    layer.weight = layer.base.weight
    assert layer.base.weight is layer.weight
    with pytest.raises(AttributeError, match="LoRALinear.weight is the base layer's, read-only here"):
        layer.weight = nn.Parameter(torch.zeros(8, 8))


@pytest.mark.parametrize("registered", ["tied_names", "listed_twice"])
def test_a_module_registered_under_two_names_gets_its_delta_under_both(registered):
    """named_modules() lists a shared module once: only its first name was wrapped, and calls through the other
    names ran the bare layer (PEFT does the same). Selected by any of its names (here the second), it is one
    LoRALinear wherever it is registered."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Module()
    if registered == "tied_names":
        model.enc_proj, model.dec_proj = shared, shared
        target, calls = "dec_proj", lambda x: model.dec_proj(torch.tanh(model.enc_proj(x)))
    else:
        model.layers = nn.ModuleList([shared, shared])
        target, calls = "layers.1", lambda x: model.layers[1](torch.tanh(model.layers[0](x)))
    ctx = apply_lora(model, [target], max_loras=1, max_rank=4, max_tokens=8)
    ctx.load_adapter_tensors("a", peft_tensors({target: (8, 8)}, 4, seed=1, prefix=""))
    layer = ctx.layers[target]
    assert all(m is layer for m in ([model.enc_proj, model.dec_proj] if registered == "tied_names" else model.layers))
    ctx.set_batch([("a", 5)])
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = _delta64(layer, torch.tanh(_delta64(layer, x)).float())
        assert rel_err(calls(x), want) <= 1e-5
    # An adapter keyed by the other name loads into the same layer (it was refused, "layer type LoRALinear is
    # not supported"); keys for both names write it twice: refused; a new trainable adapter writes it once.
    other = "enc_proj" if registered == "tied_names" else "layers.0"
    tensors = peft_tensors({other: (8, 8)}, 4, seed=2, prefix="")
    ctx.load_adapter_tensors("a", tensors, replace=True)
    assert torch.equal(layer.lora_a[0, 0, :4], tensors[f"{other}.lora_A.weight"])
    both = {**tensors, **peft_tensors({target: (8, 8)}, 4, seed=3, prefix="")}
    with pytest.raises(AdapterError, match="that another key of the adapter also writes"):
        ctx.load_adapter_tensors("a", both, replace=True)
    ctx.unload_adapter("a")
    lora_ops.training.add_trainable_adapter(ctx, "t", r=2, lora_alpha=2)
    assert layer.slot_ranks == [2]
    ctx.unload_adapter("t")
    lora_ops.training.add_trainable_adapter(ctx, "t", r=3, lora_alpha=3, target_modules=[other])   # (its other name)
    assert layer.slot_ranks == [3]


def test_a_linear_inside_a_selected_linear_subclass_runs_its_delta():
    """A targeted nn.Linear inside a targeted nn.Linear subclass: the inner LoRALinear was put on the outer
    LoRALinear, where nothing called it, and the inner delta was dropped silently (PEFT raises there)."""
    class Gated(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)
            self.gate = nn.Linear(8, 8)

        def forward(self, x):
            return super().forward(x) * torch.sigmoid(self.gate(x))
    torch.manual_seed(0)
    model = nn.Sequential()
    model.proj = Gated()
    ctx = apply_lora(model, ["proj", "gate"], max_loras=1, max_rank=4, max_tokens=8)
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (8, 8), "proj.gate": (8, 8)}, 4, seed=1, prefix=""))
    outer, inner = ctx.layers["proj"], ctx.layers["proj.gate"]
    assert model.proj is outer and outer.base.gate is inner
    ctx.set_batch([("a", 5)])
    x = torch.randn(5, 8)
    with torch.no_grad():
        base = x.double() @ outer.base.weight.double().T + outer.base.bias.double()
        want = base * torch.sigmoid(_delta64(inner, x)) + (_delta64(outer, x) - base)
        assert rel_err(model(x), want) <= 1e-5


def test_transformer_encoder_layers_fast_path_runs_the_delta():
    """nn.TransformerEncoderLayer's fused inference path (eval, no grad) reads linear1's and linear2's weights
    itself and never calls them: the delta was skipped there (PEFT too). The layer takes its ordinary path."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True,
                                                             dropout=0.0), num_layers=1).eval()
    ctx = apply_lora(model, ["linear1", "linear2"], max_loras=1, max_rank=4, max_tokens=8)
    paths = {"layers.0.linear1": (16, 32), "layers.0.linear2": (32, 16)}
    ctx.load_adapter_tensors("a", peft_tensors(paths, 4, seed=1, prefix=""))
    x = torch.randn(1, 6, 16)
    ctx.set_batch([(None, 6)])
    with torch.no_grad():
        without = model(x)
    ctx.set_batch([("a", 6)])
    with torch.no_grad():
        fast = model(x)
    with torch.enable_grad():
        slow = model(x).detach()    # (autograd on: the ordinary path, which calls the layers)
    assert rel_err(slow, without) > 1e-2 and rel_err(fast, slow) <= 1e-5


@pytest.mark.parametrize("returns", ["a_cached_tensor", "its_input"])
def test_a_subclass_output_it_keeps_is_not_written(returns):
    """A Linear subclass may return a tensor it keeps (a cached projection) or its very input: the delta,
    added in place, piled up across calls in its cache or rewrote the caller's tensor. It goes into a copy
    (as PEFT adds it out of place)."""
    class Keeping(nn.Linear):
        cache = None

        def forward(self, x):
            if returns == "its_input":
                return x
            if self.cache is None:
                self.cache = super().forward(x)
            return self.cache
    torch.manual_seed(0)
    model = nn.Sequential()
    model.proj = Keeping(8, 8)
    ctx = apply_lora(model, ["proj"], max_loras=1, max_rank=4, max_tokens=8)
    ctx.load_adapter_tensors("a", peft_tensors({"proj": (8, 8)}, 4, seed=1, prefix=""))
    layer = ctx.layers["proj"]
    ctx.set_batch([("a", 5)])
    x = torch.randn(5, 8)
    x0 = x.clone()
    base = x.double() if returns == "its_input" else x.double() @ layer.base.weight.double().T + layer.base.bias
    want = base + _delta64(layer, x) - (x.double() @ layer.base.weight.double().T + layer.base.bias)
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(model(x), want) <= 1e-5
    assert torch.equal(x, x0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_row_refuses_a_sequence_first_view(compiled):
    """Longformer and LED call their attention projections on hidden_states.transpose(0, 1), [tokens, rows, K]:
    per_row took its tokens for rows (a multiple of the adapters, so beam copies) and gave them the wrong
    adapters, silently. An input of 3 or more dimensions whose first is not its outer one in memory is refused,
    naming the layer; a batch-first input of the same shape is served."""
    class SeqFirstInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Linear(8, 8)

        def forward(self, x):                    # x [rows, tokens, 8]
            return self.query(x.transpose(0, 1)).transpose(0, 1)    # the projection on [tokens, rows, 8]
    torch.manual_seed(0)
    model = SeqFirstInside()
    ctx = apply_lora(model, ["query"], max_loras=2, max_rank=4, max_tokens=64)
    ctx.load_adapter_tensors("a", peft_tensors({"query": (8, 8)}, 4, seed=1, prefix=""))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    with torch.no_grad(), ctx.per_row(["a", None]):
        with pytest.raises(Exception, match=r"LoRALinear 'query': inside per_row the input \(6, 4, 8\) is a "
                                            r"transposed view"):
            run(torch.randn(4, 6, 8))
        with pytest.raises(Exception, match=r"LoRALinear 'query': inside per_row the input \(4, 2, 3, 8\) is a "
                                            r"transposed view"):     # (4-D: was served, tokens taken for rows)
            model.query(torch.randn(2, 4, 3, 8).transpose(0, 1))
        model.query(torch.randn(6, 4, 8))       # (batch-first: 6 rows, 3 for each adapter)
        model.query(torch.randn(1, 6, 8).expand(4, 6, 8))    # (an expanded row: stride 0, every row alike)


def test_forward_mode_ad_through_layers_whose_base_weights_require_grad():
    """torch.func.jvp / forward_ad through a LoRA model with nn.Linear's default requires_grad weights: the
    delta's tangent is added by add_lora_ into a tangent that then requires grad, which add_lora_ refuses (it
    has no gradient); the tangent is computed under no_grad. Against the same model's math in torch ops."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    ctx = apply_lora(model, ["0", "2"], max_loras=1, max_rank=4, max_tokens=8)
    ctx.load_adapter_tensors("a", peft_tensors({"0": (8, 16), "2": (16, 8)}, 4, seed=1, prefix=""))
    ctx.set_batch([("a", 5)])

    def plain(x):
        for i in (0, 2):
            layer = model[i]
            a, b, scale = layer.lora_a[0, 0, :4], layer.lora_b[0, :, :4], layer.scale[0]
            x = nn.functional.linear(x, layer.base.weight, layer.base.bias) + scale * (x @ a.T) @ b.T
            x = torch.relu(x) if i == 0 else x
        return x
    x, v = torch.randn(5, 8), torch.randn(5, 8)
    out, tangent = torch.func.jvp(model, (x,), (v,))
    want_out, want_tangent = torch.func.jvp(plain, (x,), (v,))
    assert rel_err(out, want_out) <= 1e-5 and rel_err(tangent, want_tangent) <= 1e-5


def test_a_shallow_copy_of_a_stacked_layer_leaves_the_original_stacked():
    """copy.copy shares the parameters, still the stack's views: unpickling's restack (for deep copies) must not
    replace the original's parameters (its optimizer's) and drop it off the stacked path."""
    import copy
    model = nn.Sequential(nn.Linear(16, 16))
    apply_lora(model, ["0"], max_loras=2, max_rank=4, max_tokens=8, stack_a=True)
    layer = model[0]
    weight, lora_a = layer.base.weight, layer.lora_a
    twin = copy.copy(layer)
    assert layer.base.weight is weight and layer.lora_a is lora_a and twin.lora_a is lora_a
    assert layer._stack_intact(layer.base.weight, layer.base.bias, layer.lora_a)


def test_set_token_slots_names_slots_on_another_device():
    _, ctx = one_layer_model(None, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"token_slots: expected a tensor on the CPU, got one on meta"):
        ctx.set_token_slots(torch.zeros(4, dtype=torch.int64, device="meta"))
