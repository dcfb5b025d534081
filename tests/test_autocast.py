"""torch.autocast: a LoRALinear under autocast computes as nn.Linear does there (its floating inputs cast
to autocast's dtype, the output in that dtype, gradients back to the parameters in their own dtype), and
the ops themselves compute in their inputs' dtype whatever autocast says (as their fake kernels say).

Before session 24 the ops' base GEMM was recast by an ambient autocast while the delta kept the inputs'
dtype: a fresh launch failed to compile (bf16 y against fp32 B) and a plan built outside autocast was
replayed on the bf16 y with fp32 kernels (twice y's bytes written: out of bounds on a GPU).
"""
import copy

import pytest
import torch
from torch import nn

from conftest import DEVICE
from lora_ops.layers import LoRAContext, LoRALinear

K, WIDTHS, L, R, M = 32, (24, 8), 3, 8, 10
N = sum(WIDTHS)
LOW = torch.bfloat16


def device_of(backend):
    return torch.device(backend.device)


def make_layer(device, bias=True, stack_a=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = LoRAContext(L, 32, device=device)
    base = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        base.weight.copy_(torch.randn(N, K, generator=gen) * K ** -0.5)
        if bias:
            base.bias.copy_(torch.randn(N, generator=gen))
    layer = LoRALinear(base.to(device), ctx, R, WIDTHS)
    if stack_a:
        layer._stack()
        layer.stacked_max_tokens = 32
    for slot, r in enumerate((R, 3, 5)):
        slices = [(torch.randn(r, K, generator=gen) * K ** -0.5, torch.randn(w, r, generator=gen))
                  for w in WIDTHS]
        layer.write_slot(slot, [(a.to(device), b.to(device)) for a, b in slices], 0.5 + slot, r)
    ctx.set_token_slots(torch.tensor([0, 1, -1, 2, 0, 0, 1, -1, 2, 1], dtype=torch.int32))
    return layer, torch.randn(M, K, generator=gen).to(device)


def low_precision_twin(layer):
    """The same layer converted to LOW, taking lora_linear (not the stack) like the layer under autocast."""
    twin = copy.deepcopy(layer).to(LOW)
    twin.stacked_max_tokens = 0
    return twin


@pytest.fixture
def low_interpreter(backend, request):
    if backend.interpreted:
        request.getfixturevalue("bf16_interpreter")
    return backend


@pytest.fixture
def write_first_calls(write_first_from, write_calls):
    """lora_linear takes the write-first path at this test's sizes; returns the list of launch._write_lora calls
    (conftest's write_calls: the calls still run, each on a y first filled with NaN)."""
    write_first_from(1)
    return write_calls


def written_dtypes(calls):
    """The dtype of y in each launch._write_lora call of ``calls`` (write_first_calls)."""
    return [y.dtype for y, *_ in calls]


def hook_base(layer):
    layer.base.register_forward_hook(lambda module, args, out: None)   # not a bare nn.Linear: base(x), then add_lora_


PATHS = {"lora_linear": {}, "no_bias": dict(bias=False), "stack_a": dict(stack_a=True),
         "write_first": dict(bias=False), "hooked_base": {}}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_layer_under_autocast_computes_as_its_low_precision_twin(low_interpreter, request, path):
    """Bit for bit the twin's output (lora_linear in LOW, outside autocast): a delta computed in float32 and then
    cast, or an input left uncast, rounds differently. The write_first path is seen to take it (the Triton
    side: the torch kernels have none) in LOW, on the twin and under autocast, on a NaN-poisoned y."""
    device = device_of(low_interpreter)
    calls = request.getfixturevalue("write_first_calls") if path == "write_first" else None
    layer, x = make_layer(device, **PATHS[path])
    if path == "hooked_base":
        hook_base(layer)
    twin = low_precision_twin(layer)
    with torch.no_grad():
        expected = twin(x.to(LOW))
        with torch.autocast(device.type, dtype=LOW):
            out = layer(x)
    assert out.dtype == LOW and torch.equal(out, expected)
    if calls is not None:
        assert written_dtypes(calls) == ([LOW, LOW] if low_interpreter.name == "triton" else [])
    with torch.no_grad():                 # and outside autocast the layer is its float32 self again
        assert layer(x).dtype == torch.float32


GRAD_PATHS = ("lora_linear", "hooked_base", "write_first")


@pytest.mark.parametrize("path", GRAD_PATHS)
def test_autocast_gradients_reach_the_parameters_in_their_dtype(low_interpreter, request, path):
    """Every gradient (x, A, B, the base weight and bias) reaches its float32 tensor, bit for bit the twin's
    LOW gradient: a cast that cut the graph (a detached bias, x or adapter) leaves a gradient missing or short.
    On the lora_linear op (with a bias, and on its write-first path: no bias) and on add_lora after a hooked
    base layer (autograd through the cast x and adapters there). There x is cast twice (by the base layer's
    autocast and for the delta): its gradient is the float32 sum of two LOW gradients where the twin's is their
    LOW sum, so the two are held one LOW rounding apart; a delta's gradient lost is the delta's size off."""
    device = device_of(low_interpreter)
    calls = request.getfixturevalue("write_first_calls") if path == "write_first" else None
    layer, x = make_layer(device, bias=path != "write_first")
    if path == "hooked_base":
        hook_base(layer)
    twin = low_precision_twin(layer)
    for module in (layer, twin):
        module.lora_a.requires_grad_(True)
        module.lora_b.requires_grad_(True)
    xg = x.clone().requires_grad_()
    with torch.autocast(device.type, dtype=LOW):
        out = layer(xg)
    out.float().square().sum().backward()
    x_low = x.to(LOW).requires_grad_()
    twin(x_low).float().square().sum().backward()
    if calls is not None:
        assert written_dtypes(calls) == ([LOW, LOW] if low_interpreter.name == "triton" else [])
    pairs = [(layer.lora_a.grad, twin.lora_a.grad), (layer.lora_b.grad, twin.lora_b.grad),
             (layer.base.weight.grad, twin.base.weight.grad)]
    if layer.base.bias is not None:
        pairs.append((layer.base.bias.grad, twin.base.bias.grad))
    if path != "hooked_base":
        pairs.append((xg.grad, x_low.grad))
    else:
        assert xg.grad.dtype == torch.float32
        assert (xg.grad - x_low.grad.float()).abs().max() <= 2 ** -8 * x_low.grad.float().abs().max()
    for ours, theirs in pairs:
        assert ours is not None and theirs.dtype == LOW
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs.float())


@pytest.mark.parametrize("op", ["lora_linear", "lora_linear_write_first", "lora_linear_stacked"])
def test_the_ops_compute_in_their_inputs_dtype_under_autocast(backend, request, op):
    """float32 inputs under a bf16 autocast: bit for bit the op's output outside it (its base GEMM not recast).
    lora_linear_write_first is seen to take that path (the Triton side), on a NaN-poisoned y."""
    device = device_of(backend)
    calls = request.getfixturevalue("write_first_calls") if op == "lora_linear_write_first" else None
    layer, x = make_layer(device, bias=op == "lora_linear")
    meta = tuple(layer.context.meta)
    common = (layer.lora_b, layer.scale, layer.rank, list(WIDTHS), *meta)
    if op == "lora_linear_stacked":
        stacked = torch.cat([layer.base.weight.detach(), layer.lora_a.detach().reshape(-1, K)])
        call = lambda: torch.ops.lora_ops.lora_linear_stacked(x, stacked, None, *common)  # noqa: E731
    else:
        call = lambda: torch.ops.lora_ops.lora_linear(  # noqa: E731
            x, layer.base.weight.detach(), None if layer.base.bias is None else layer.base.bias.detach(),
            layer.lora_a.detach(), *common)
    plain = call()
    with torch.autocast(device.type, dtype=LOW):
        under = call()
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    if calls is not None:
        assert written_dtypes(calls) == ([torch.float32] * 2 if backend.name == "triton" else [])


def test_bound_calls_step_aside_under_autocast(triton_kernels, bf16_interpreter):
    """A layer bound in float32 is not replayed under autocast, whose output is the LOW twin's (not float32
    launches or plans on LOW tensors), and replays again after it."""
    layer, x = make_layer(torch.device(DEVICE))
    twin = low_precision_twin(layer)
    with torch.no_grad():
        first = layer(x)                  # binds
        replays = layer._eager.replays
        with torch.autocast(torch.device(DEVICE).type, dtype=LOW):
            low = layer(x)
        assert low.dtype == LOW and layer._eager.replays == replays
        assert torch.equal(low, twin(x.to(LOW)))
        again = layer(x)
    assert layer._eager.replays == replays + 1 and torch.equal(again, first)


def test_a_compiled_model_under_autocast_has_no_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    layer, x = make_layer(torch.device("cpu"))
    twin = low_precision_twin(layer)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=LOW):
        out = compiled(x)
    with torch.no_grad():
        expected = twin(x.to(LOW))
    torch._dynamo.reset()
    assert counter.frame_count == 1 and out.dtype == LOW and torch.equal(out, expected)


def test_a_layer_already_in_autocasts_dtype_keeps_its_bound_calls(triton_kernels, bf16_interpreter):
    layer, x = make_layer(torch.device(DEVICE))
    layer, x = layer.to(LOW), x.to(LOW)
    with torch.no_grad():
        first = layer(x)                  # binds
        with torch.autocast(torch.device(DEVICE).type, dtype=LOW):
            replays = layer._eager.replays
            again = layer(x)
    assert layer._eager.replays == replays + 1 and torch.equal(again, first)
