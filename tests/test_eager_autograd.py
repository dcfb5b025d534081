"""Eager calls that need autograd skip the dispatcher (lora_ops.ops.call, ops.AUTOGRAD): the op's kernel and
the formula registered with torch.library.register_autograd, run by an autograd.Function of our own.

Everything here compares that path with the dispatcher's (``ops.set_eager_autograd(False)``): outputs and
every gradient bit for bit, on both CPU backends (the torch kernels, the Triton kernels under the
interpreter). The float64 checks of the formula itself are tests/test_autograd.py's.
"""
import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import lora_ops
from csrc_meta import checks
from conftest import TOLERANCE, make_case, rel_err
from lora_ops import ops
from lora_ops.layers import LoRALinear
from lora_ops.reference import lora_forward_reference

CASE = dict(M=37, K=40, N=48, num_slots=4, num_slices=3, max_rank=16)


@pytest.fixture
def dispatcher_autograd():
    """``use(on)``: eager calls that need autograd through the dispatcher (on) or ops.AUTOGRAD (off)."""
    yield lambda on: ops.set_eager_autograd(not on)
    ops.set_eager_autograd(True)


def layer_leaves(case, needs):
    M, K, N = case.shape[:3]
    values = {"x": case.x, "weight": case.signed((N, K)) * K ** -0.5, "bias": case.signed((N,)),
              "lora_a": case.lora_a, "lora_b": case.lora_b, "y": case.signed((M, N)), "scale": case.scale}
    return {name: t.detach().clone().requires_grad_(name in needs) for name, t in values.items()}


def run(op, case, leaves, grad_out):
    """(output, its grad_fn's class name, {leaf: grad}) of one forward + backward through ops.call."""
    if op == "lora_linear":
        args = (leaves["x"], leaves["weight"], leaves["bias"])
    else:
        args = (leaves["y"], leaves["x"])
    out = ops.call(op, *args, leaves["lora_a"], leaves["lora_b"], leaves["scale"], case.rank, case.slice_widths,
                   *case.meta)
    out.backward(grad_out)
    return out.detach(), type(out.grad_fn).__name__, {n: t.grad for n, t in leaves.items() if t.requires_grad}


# ("scale",): any argument that requires grad makes autograd need the call, scale too, which the op gives no gradient
# (its output requires grad all the same, as through the dispatcher: DESIGN §4, bound eager calls).
NEEDS = {"lora_linear": [("x",), ("lora_a", "lora_b"), ("weight",), ("x", "weight", "bias", "lora_a", "lora_b"),
                         ("scale",)],
         "add_lora": [("x",), ("lora_a", "lora_b"), ("y",), ("y", "x", "lora_a", "lora_b"), ("scale",)]}
NO_GRADIENT = {"scale"}


@pytest.mark.parametrize("op, needs", [(op, needs) for op, cases in NEEDS.items() for needs in cases],
                         ids=[f"{op}-{'+'.join(needs)}" for op, cases in NEEDS.items() for needs in cases])
def test_eager_autograd_equals_dispatcher_bit_for_bit(backend, op, needs, dispatcher_autograd):
    case = make_case(**CASE, dtype=torch.float32, device=backend.device, seed=5)
    grad_out = case.signed(case.x.shape[:1] + (case.shape[2],))
    leaves = layer_leaves(case, needs)
    results = {}
    for through_dispatcher in (False, True):
        dispatcher_autograd(through_dispatcher)
        fresh = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in leaves.items()}
        results[through_dispatcher] = run(op, case, fresh, grad_out)
    (out, fn, grads), (ref_out, ref_fn, ref_grads) = results[False], results[True]
    assert fn == f"Eager_lora_ops_{op}Backward" and ref_fn.startswith("GeneratedBackwardFor_lora_ops_" + op)
    assert torch.equal(out, ref_out)
    assert set(grads) == set(ref_grads) == set(needs)
    for name in needs:
        if name in NO_GRADIENT:
            assert grads[name] is None and ref_grads[name] is None, name
        else:
            assert grads[name] is not None and torch.equal(grads[name], ref_grads[name]), name


def set_slot_ranks(layer):
    """Slots 0-2 of ``layer`` at ranks 8, 5 and 0 with scales 0.5, -1.25 and 2 (a new layer has every slot at
    rank 0: no delta, zero adapter gradients)."""
    with torch.no_grad():
        layer.rank.copy_(torch.tensor([8, 5, 0]))
        layer.scale.copy_(torch.tensor([0.5, -1.25, 2.0]))


BOUND_BACKWARD = {"lora_linear": "BoundLoRALinearBackward", "add_lora": "BoundAddLoraBackward"}


def test_layer_training_step_takes_eager_autograd(backend):
    """A LoRALinear with trainable adapters (plain nn.Linear base: lora_linear) and one whose base has a hook
    (base forward, then add_lora) both build their backward from ops.AUTOGRAD. The Triton kernels bind that call:
    the next step replays it (autograd.BoundLoRALinear, BoundAddLora) with the first step's output and every
    gradient bit for bit, the trainable base's weight and bias among them; the base's own output, which the hook
    keeps (activation capture), holds no delta (a bound add_lora adds it into a copy, as the op does)."""
    torch.manual_seed(0)
    dev = backend.device
    ctx = lora_ops.LoRAContext(3, 64, device=dev)
    plain = LoRALinear(nn.Linear(16, 24).to(dev), ctx, 8, [16, 8])
    hooked = LoRALinear(nn.Linear(16, 24).to(dev), ctx, 8, [16, 8])
    kept = []   # (the base's output the hook got, a copy taken then)
    hooked.base.register_forward_hook(lambda module, args, out: kept.append((out, out.detach().clone())))
    for layer in (plain, hooked):
        set_slot_ranks(layer)
        for p in (layer.lora_a, layer.lora_b):
            with torch.no_grad():
                p.normal_()
            p.requires_grad_(True)
    ctx.set_token_slots(torch.tensor([0, 1, -1, 2, 0, 1, 2, -1, 0]))
    x = torch.randn(9, 16, device=dev, requires_grad=True)
    grad_out = torch.randn(9, 24, device=dev)
    for layer, op in ((plain, "lora_linear"), (hooked, "add_lora")):
        leaves = {"x": x, "weight": layer.base.weight, "bias": layer.base.bias, "lora_a": layer.lora_a,
                  "lora_b": layer.lora_b}
        steps = []
        for _ in range(2):     # the op's path (which binds), then the bound call where the kernels are Triton's
            for t in leaves.values():
                t.grad = None
            out = layer(x)
            out.backward(grad_out)
            steps.append((out.detach(), type(out.grad_fn).__name__, {n: t.grad for n, t in leaves.items()}))
        (want_out, want_fn, want_grads), (out, fn, grads) = steps
        assert want_fn == f"Eager_lora_ops_{op}Backward"
        assert fn == (BOUND_BACKWARD[op] if backend.name == "triton" else want_fn)
        assert all(g.abs().sum() > 0 for g in want_grads.values()), "a zero gradient: the comparison could not fail"
        assert torch.equal(out, want_out)
        for name in leaves:
            assert grads[name] is not None and torch.equal(grads[name], want_grads[name]), (op, name)
    assert len(kept) == 2 and all(torch.equal(y, y_then) for y, y_then in kept)


class Tagged(torch.Tensor):
    """A tensor subclass with no behaviour of its own: only the dispatcher knows what to do with it."""


def test_subclass_argument_takes_the_dispatcher(backend):
    case = make_case(**CASE, dtype=torch.float32, device=backend.device, seed=6)
    leaves = layer_leaves(case, ("x", "weight"))
    weight = leaves["weight"].detach().as_subclass(Tagged).requires_grad_()
    out = ops.call("lora_linear", leaves["x"], weight, None, case.lora_a, case.lora_b, case.scale, case.rank,
                   case.slice_widths, *case.meta)
    # (The subclass's __torch_function__ wraps the op's output in an alias of itself.)
    names = [type(out.grad_fn).__name__] + [type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None]
    assert any(n.startswith("GeneratedBackwardFor_lora_ops_lora_linear") for n in names), names
    plain = ops.call("lora_linear", leaves["x"], leaves["weight"], None, case.lora_a, case.lora_b, case.scale,
                     case.rank, case.slice_widths, *case.meta)
    assert torch.equal(out.detach().as_subclass(torch.Tensor), plain.detach())


def test_input_changed_in_place_before_backward_raises(backend):
    """The saved tensors are the caller's: an adapter weight written between forward and backward makes
    autograd refuse the stale backward, as through the dispatcher."""
    case = make_case(**CASE, dtype=torch.float32, device=backend.device, seed=7)
    leaves = layer_leaves(case, ("x",))
    lora_b = case.lora_b.clone()
    out = ops.call("lora_linear", leaves["x"], leaves["weight"], None, case.lora_a, lora_b, case.scale, case.rank,
                   case.slice_widths, *case.meta)
    with torch.no_grad():
        lora_b.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_grad_needed_runs_the_kernel_alone(backend):
    case = make_case(**CASE, dtype=torch.float32, device=backend.device, seed=8)
    leaves = layer_leaves(case, ())
    out = ops.call("lora_linear", leaves["x"], leaves["weight"], leaves["bias"], case.lora_a, case.lora_b,
                   case.scale, case.rank, case.slice_widths, *case.meta)
    assert out.grad_fn is None and not out.requires_grad
    expected = lora_ops.lora_forward(F.linear(leaves["x"], leaves["weight"], leaves["bias"]), leaves["x"],
                                     case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                                     slice_widths=case.slice_widths)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def save_lora_linear_policy(seen):
    """A selective checkpointing policy: lora_linear's outputs saved, the rest recomputed; every op it is asked
    about noted in the set ``seen``."""
    def policy(ctx, op, *args, **kwargs):
        seen.add(op)
        if op is torch.ops.lora_ops.lora_linear.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def two_layers(device):
    """A context of 3 slots and two LoRALinear layers on ``device``: a packed one (16 -> 24), then a plain one;
    their slots' ranks and scales set (set_slot_ranks), the adapters' values left to the caller."""
    ctx = lora_ops.LoRAContext(3, 64, device=device)
    layers = [LoRALinear(nn.Linear(16, 24).to(device), ctx, 8, [16, 8]),
              LoRALinear(nn.Linear(24, 16).to(device), ctx, 8, [16])]
    for layer in layers:
        set_slot_ranks(layer)
    return ctx, layers


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "selective", "anomaly_mode"])
def test_activation_checkpointing_gives_the_same_gradients(backend, mode):
    """Two LoRALinear layers (a packed one, then a plain one) trained through torch.utils.checkpoint, as
    trainers recompute activations: the eager Function path (reentrant and not), the dispatcher's under
    selective checkpointing (its TorchDispatchMode), and under anomaly mode, all bit-identical to the run
    without."""
    torch.manual_seed(0)
    dev = backend.device
    ctx, layers = two_layers(dev)
    leaves = []
    for layer in layers:
        for p in (layer.lora_a, layer.lora_b):
            with torch.no_grad():
                p.normal_()
            leaves.append(p.requires_grad_(True))
    ctx.set_token_slots(torch.tensor([0, 1, -1, 2, 0, 1, 2, -1, 0]))
    x = torch.randn(9, 16, device=dev, requires_grad=True)
    leaves.append(x)

    def block(inp):
        return layers[1](torch.relu(layers[0](inp)))

    def grads(fn):
        for t in leaves:
            t.grad = None
        fn(x).square().sum().backward()
        return [t.grad.clone() for t in leaves]

    reference = grads(block)
    assert all(g.abs().sum() > 0 for g in reference), "a zero gradient: the comparison below could not fail"
    if mode == "anomaly_mode":
        with torch.autograd.set_detect_anomaly(True):
            got = grads(block)
    elif mode == "selective":
        seen = set()
        contexts = functools.partial(create_selective_checkpoint_contexts, save_lora_linear_policy(seen))
        got = grads(lambda inp: checkpoint(block, inp, use_reentrant=False, context_fn=contexts))
        # Under its TorchDispatchMode a call that needs autograd takes the dispatcher (ops.wrapped), so the
        # policy meets the op; the eager Function would hide it and the policy would save nothing of ours.
        assert torch.ops.lora_ops.lora_linear.default in seen, sorted(map(str, seen))
    else:
        got = grads(lambda inp: checkpoint(block, inp, use_reentrant=mode == "reentrant"))
    for i, (a, b) in enumerate(zip(reference, got)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("hooked", [False, True], ids=["bare_base", "hooked_base"])
def test_double_backward_through_layers_matches_float64(backend, hooked):
    """A gradient penalty through two LoRALinear layers (create_graph=True), each call in turn: the first
    binds, the next replay (lora_ops.eager), on a bare base (lora_linear) and a hooked one (add_lora after the
    base's own forward). The adapters' second-order gradients match the float64 reference's."""
    torch.manual_seed(0)
    dev = backend.device
    ctx, layers = two_layers(dev)
    for layer in layers:
        with torch.no_grad():
            layer.lora_a.normal_()
            layer.lora_b.normal_()
        if hooked:
            layer.base.register_forward_hook(lambda module, inputs, out: None)
    slots = torch.tensor([0, 1, -1, 2, 0, 1, 2, -1, 0], device=dev)
    ctx.set_token_slots(slots)
    x = torch.randn(9, 16, device=dev)
    weights = [p for layer in layers for p in (layer.lora_a, layer.lora_b)]

    def penalty_grads(block, params):
        first = torch.autograd.grad(block(x.to(params[0].dtype)).square().sum(), params, create_graph=True)
        second = torch.autograd.grad(sum(g.double().square().sum() for g in first), params)
        return first + second

    def reference(inp):
        for layer, (a, b) in zip(layers, zip(ref[0::2], ref[1::2])):
            base = F.linear(inp, layer.base.weight.double(), layer.base.bias.double())
            inp = lora_forward_reference(base, inp, a, b, layer.scale, layer.rank, slots, layer.slice_widths)
            inp = torch.relu(inp) if layer is layers[0] else inp
        return inp

    ref = [p.detach().double().requires_grad_() for p in weights]
    want = penalty_grads(reference, ref)
    assert all(w.abs().sum() > 0 for w in want)
    for p in weights:
        p.requires_grad_(True)
    for _ in range(2):
        got = penalty_grads(lambda inp: layers[1](torch.relu(layers[0](inp))), weights)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert rel_err(g, w) <= TOLERANCE[torch.float32], i
    assert all(layer._eager.replays > 0 for layer in layers) or backend.name == "torch"  # (torch kernels: no plans)


LAYER_KINDS = ["bare_base", "hooked_base", "stack_a"]


def small_layer(kind, device):
    """A packed LoRALinear with two adapted slots and one at rank 0, its batch set, called twice (bound);
    ``kind``: a bare nn.Linear base, a hooked one (the base's own forward, then add_lora), or stack_a."""
    torch.manual_seed(0)
    ctx = lora_ops.LoRAContext(3, 64, device=device)
    layer = LoRALinear(nn.Linear(16, 24).to(device).requires_grad_(False), ctx, 8, [16, 8],
                       stack_a=kind == "stack_a")
    with torch.no_grad():
        layer.lora_a.normal_()
        layer.lora_b.normal_()
    set_slot_ranks(layer)
    if kind == "hooked_base":
        layer.base.register_forward_hook(lambda module, inputs, out: None)
    ctx.set_token_slots(torch.tensor([0, 1, -1, 2, 0, 1, 2, -1, 0]))
    x = torch.randn(9, 16, device=device)
    with torch.no_grad():
        for _ in range(2):
            layer(x)
    return layer, x


def layer_reference(layer, x, lora_a, lora_b):
    """The layer's output in float64 (the base layer plus lora_forward_reference's delta)."""
    base = F.linear(x.double(), layer.base.weight.double(), layer.base.bias.double())
    return lora_forward_reference(base, x.double(), lora_a.double(), lora_b.double(), layer.scale, layer.rank,
                                  layer.context.token_slots[:x.shape[0]], layer.slice_widths)


@pytest.mark.parametrize("kind", LAYER_KINDS)
@pytest.mark.parametrize("how", ["dual_x", "func_jvp_x_and_adapters"])
def test_forward_mode_ad_through_layers_matches_float64(backend, kind, how):
    """Forward-mode AD through a layer after its calls were bound (which skip ops.call): forward_ad dual
    inputs, and torch.func.jvp over the input and both adapters (functional_call). torch.func.jvp once
    returned the base layer's tangent alone; the output's tangent now matches the float64 reference's."""
    layer, x = small_layer(kind, backend.device)
    a, b = layer.lora_a.detach().clone(), layer.lora_b.detach().clone()
    t_x, t_a, t_b = torch.randn_like(x), torch.randn_like(a), torch.randn_like(b)
    if how == "dual_x":
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t_x))).tangent
        _, want = torch.func.jvp(lambda x_: layer_reference(layer, x_, a, b), (x.double(),), (t_x.double(),))
    else:
        def ours(x_, a_, b_):
            return torch.func.functional_call(layer, {"lora_a": a_, "lora_b": b_}, (x_,))
        _, tangent = torch.func.jvp(ours, (x, a, b), (t_x, t_a, t_b))
        _, want = torch.func.jvp(lambda *p: layer_reference(layer, *p), (x.double(), a.double(), b.double()),
                                 (t_x.double(), t_a.double(), t_b.double()))
    assert rel_err(tangent, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_forward_mode_ad_after_training_calls_bound_the_layer(backend, kind):
    """A dual input after ordinary training calls (adapters requiring grad, grad mode on) bound the layer: a
    hooked base's delta replayed through BoundAddLora, which has no forward-mode rule, and raised torch's
    internal "You must implement the jvp function"; the tangent now comes from the op's path."""
    layer, x = small_layer(kind, backend.device)
    a, b = layer.lora_a.detach().clone(), layer.lora_b.detach().clone()
    layer.lora_a.requires_grad_(True)
    layer.lora_b.requires_grad_(True)
    for _ in range(2):
        layer(x).sum().backward()
    t_x = torch.randn_like(x)
    for _ in range(2):
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(layer(fwAD.make_dual(x, t_x))).tangent
        _, want = torch.func.jvp(lambda x_: layer_reference(layer, x_, a, b), (x.double(),), (t_x.double(),))
        assert rel_err(tangent, want) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("kind", LAYER_KINDS)
@pytest.mark.parametrize("how", ["func_grad", "func_vjp", "func_jacrev"])
def test_func_grad_and_vjp_through_layers_match_float64(backend, kind, how):
    """torch.func.grad, vjp and jacrev over the input and both adapters (functional_call) after the layer's calls
    were bound: the gradients match the float64 reference's (torch.func had failed inside torch on the Function
    torch.library builds for a custom op; ops.call runs ours, which has setup_context)."""
    layer, x = small_layer(kind, backend.device)
    a, b = layer.lora_a.detach(), layer.lora_b.detach()
    weights = torch.randn(x.shape[0], layer.out_features, device=x.device)

    def loss(reference, *p):
        out = reference(*p) if reference else torch.func.functional_call(layer, {"lora_a": p[1], "lora_b": p[2]},
                                                                         (p[0],))
        return (out * weights.to(out.dtype)).sum()

    primals = (x, a, b)
    if how == "func_jacrev":     # (a few outputs: the Jacobian of each against every input)
        got = torch.func.jacrev(lambda *p: torch.func.functional_call(layer, {"lora_a": p[1], "lora_b": p[2]},
                                                                      (p[0],))[:2, :3], argnums=(0, 1, 2))(*primals)
        want = torch.func.jacrev(lambda *p: layer_reference(layer, *p)[:2, :3], argnums=(0, 1, 2))(
            *(p.double() for p in primals))
    else:
        if how == "func_grad":
            got = torch.func.grad(lambda *p: loss(None, *p), argnums=(0, 1, 2))(*primals)
        else:
            out, vjp = torch.func.vjp(lambda *p: loss(None, *p), *primals)
            got = vjp(torch.ones_like(out))
        want = torch.func.grad(lambda *p: loss(lambda *q: layer_reference(layer, *q), *p), argnums=(0, 1, 2))(
            *(p.double() for p in primals))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOLERANCE[torch.float32]


def test_func_grad_under_vmap_raises_naming_the_op(backend):
    """vmap over grad (per-sample gradients) needs a vmap rule the ops' Functions lack: an error in our terms,
    not torch's."""
    layer, x = small_layer("bare_base", backend.device)
    grad = torch.func.grad(lambda a, x_: torch.func.functional_call(layer, {"lora_a": a}, (x_,)).sum())
    with pytest.raises(NotImplementedError, match=r"lora_ops::lora_linear: torch.func's grad transforms .* under vmap"):
        torch.func.vmap(grad, in_dims=(None, 0))(layer.lora_a.detach(), torch.stack([x, x.flip(0)]))


@pytest.mark.parametrize("how", ["jacfwd", "vmap_of_jvp", "jvp_of_vmap"])
def test_forward_mode_under_vmap_raises_naming_the_op(backend, how):
    """Forward-mode AD and vmap together: torch's errors named broadcast shapes ([5, 24] against [80, 5, 24]) or
    aten::_unpack_dual's missing batching rule. An error in our terms."""
    layer, x = small_layer("bare_base", backend.device)
    stacked = torch.stack([x, x.flip(0)])

    def jvp_at(x_):
        return torch.func.jvp(layer, (x_,), (torch.ones_like(x_),))[1]
    run = {"jacfwd": lambda: torch.func.jacfwd(layer)(x),
           "vmap_of_jvp": lambda: torch.func.vmap(jvp_at)(stacked),
           "jvp_of_vmap": lambda: torch.func.jvp(torch.func.vmap(layer), (stacked,), (torch.ones_like(stacked),))}
    with pytest.raises(NotImplementedError, match=r"lora_ops::lora_linear: forward-mode AD together with vmap "
                                                  r"\(torch.func.jacfwd, vmap\(jvp\), jvp\(vmap\), or vmap inside a "
                                                  r"dual level\) is not supported"):
        run[how]()


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_dual_level_without_tangents_and_vmap_still_work(backend, kind):
    """Inside a dual level, inputs without tangents run as usual; torch.func.vmap (no grad) runs the layer
    per batch element (torch's loop over custom ops), as calls one by one would."""
    layer, x = small_layer(kind, backend.device)
    with torch.no_grad():
        want = layer(x)
        with fwAD.dual_level():     # (stack_a takes lora_linear there: its forward-mode formula)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        stacked = torch.stack([x, x.flip(1)])
        got = torch.func.vmap(layer)(stacked)
        # (close, not equal: a hooked base's own nn.Linear runs batched under vmap, another GEMM's sum order)
        torch.testing.assert_close(got, torch.stack([want, layer(x.flip(1))]), rtol=1e-5, atol=1e-5)


def test_the_python_requires_grad_check_agrees_with_torchs():
    """ops.any_requires_grad is torch's private C check where torch has it; the Python loop that stands in for
    it elsewhere answers the same for what the ops take (tensors, None, ints, int lists)."""
    plain, wants = torch.zeros(2), torch.zeros(2, requires_grad=True)
    for args in [(plain, None, 3, [1, 2]), (plain, wants), (None, [4], wants), (plain,), ()]:
        assert checks._any_requires_grad_py(*args) == ops.any_requires_grad(*args), args
