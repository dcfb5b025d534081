"""torch.compile and CUDA graphs over models with LoRALinear layers.

One compile (``fullgraph=True``: no graph breaks) must serve every token count from 2 up (token dim
marked dynamic), every slot mapping, and adapter loads, unloads and in-place swaps: every test counts
compiles and runs under ``error_on_recompile``. A batch of one token: ``mark_unbacked`` (one graph for
every size, for models that do not branch on the size) or padding to two tokens (any model).

Compiled results are compared with the same model run eagerly (same kernels, so equal within float32
roundoff); eager values are checked against PEFT and float64 elsewhere (test_peft_parity, test_layers). The eager
run shares the compiled run's stacks and batch, so where adapters change (loads, swaps, unloads) or a batch is
built in the graph past what set_batch can serve, the toy LM's logits are checked against float64 too: the base
weights merged with each token's adapter as PEFT computes it from the tensors loaded (:func:`float64_logits`).

The CUDA tests (skipped without a GPU) capture a model step with torch.cuda.graph, replay it with new
slots and after an in-place adapter swap, run torch.compile(mode="reduce-overhead"), and check that a
step (metadata refill + replay) makes no host sync under torch.cuda.set_sync_debug_mode("error").
"""
import contextlib
import io
import math
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import TOLERANCE, fill_setting, rel_err
from layer_helpers import PACKED, PROJECTIONS, VOCAB, fused_copy, linear_paths, module_shapes, peft_tensors, toy_lm
from lora_ops.layers import apply_lora

EXACT = 1e-6   # compiled vs eager, same kernels: float32 roundoff at most
FLOAT64 = TOLERANCE[torch.float32]     # float32 logits against the float64 reference
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own model: earlier tests' cache entries for the same forward code would
    count as recompiles under error_on_recompile."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# toy_model's adapters: name -> (seed, PEFT config): a's scale alpha / r = 8 / 4, b's (rsLoRA) 4 / sqrt(8).
TOY_ADAPTERS = {"a": (1, {"r": 4, "lora_alpha": 8}), "b": (2, {"r": 8, "lora_alpha": 4, "use_rslora": True})}


def peft_scale(config):
    """PEFT's scale of a config: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def toy_model(device="cpu", max_tokens=64, stack_a=False):
    """The fused toy LM (packed q/k/v and gate/up slices plus plain layers) with adapters a and b."""
    model = fused_copy(toy_lm(seed=5)).to(device)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=8, max_tokens=max_tokens, packed_modules=PACKED,
                     stack_a=stack_a)
    shapes = module_shapes(toy_lm())
    for name, (seed, config) in TOY_ADAPTERS.items():
        ctx.load_adapter_tensors(name, peft_tensors(shapes, config["r"], seed=seed), config)
    return model, ctx, shapes


def toy_adapters(shapes):
    """{name: (PEFT tensors, scale)} of toy_model's adapters, for :func:`float64_logits`."""
    return {name: (peft_tensors(shapes, config["r"], seed=seed), peft_scale(config))
            for name, (seed, config) in TOY_ADAPTERS.items()}


def float64_logits(ids, names, adapters):
    """float64 logits of toy_model's LM for ``ids`` [..., T], token i (row-major) through the unfused base with
    ``adapters[names[i]]`` = (PEFT tensors, scale) merged in (W + scale B A; None: the base): independent of the
    layers' stacks, slots and batch (the toy computes every token on its own)."""
    flat = ids.reshape(-1).cpu()
    out = torch.empty(flat.shape[0], VOCAB, dtype=torch.float64)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):     # (toy_lm seeds the global generator)
        for name in set(names):
            model = toy_lm(seed=5).double()
            if name is not None:
                tensors, scale = adapters[name]
                for path, layer in linear_paths(model).items():
                    a, b = (tensors[f"base_model.model.{path}.lora_{f}.weight"].double() for f in "AB")
                    layer.weight += scale * b @ a
            mine = torch.tensor([n == name for n in names])
            out[mine] = model(flat[mine])
    return out.view(*ids.shape, VOCAB)


def token_err(out, ids, names, adapters):
    """The largest relative error of one token's logits against :func:`float64_logits` (token by token: the
    adapters scale the toy's logits from ~1 to ~1e5, so an error over the whole output hid wrong tokens of the
    smaller ones, those of no adapter among them)."""
    ref = float64_logits(ids, names, adapters).view(-1, VOCAB)
    out = out.detach().double().cpu().reshape(-1, VOCAB)
    return ((out - ref).norm(dim=1) / ref.norm(dim=1)).max().item()    # (a NaN fails the <=)


@contextlib.contextmanager
def no_recompiles():
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        yield


def token_ids(num_tokens, seed, vocab=64, device="cpu", mark=None):
    """input_ids [1, num_tokens] (all requests' tokens in one row), the token dim marked dynamic."""
    ids = torch.randint(0, vocab, (1, num_tokens), generator=torch.Generator().manual_seed(seed)).to(device)
    (mark or torch._dynamo.mark_dynamic)(ids, 1)
    return ids


def check_step(compiled, model, ids):
    out = compiled(ids)
    assert rel_err(out, model(ids)) <= EXACT
    return out


def test_one_compile_serves_token_counts_slots_and_adapter_changes():
    """Each step also against float64 from the adapters' own tensors, token by token: the eager run reads the
    same stacks, so a swap (replace=True) that left the old adapter's factors or scale in its slot passed against
    it. The last count is max_tokens (the capacity) itself: every earlier count was at most 37, and a guard on
    the count above that (a graph for 41 tokens and more) passed."""
    model, ctx, shapes = toy_model()
    adapters = toy_adapters(shapes)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    def load(name, rank, seed, replace=False):      # (no config: lora_alpha = r, scale 1)
        adapters[name] = (peft_tensors(shapes, rank, seed=seed), 1.0)
        ctx.load_adapter_tensors(name, adapters[name][0], replace=replace)
    steps = [
        (None, [("a", 1), ("b", 1)]),                                   # 2 tokens: the smallest dynamic size
        (None, [("b", 3), (None, 2), ("a", 4)]),
        (lambda: load("c", 2, seed=3), [("c", 5), ("a", 2)]),
        (lambda: ctx.unload_adapter("a"), [(None, 3), ("c", 1), ("b", 6)]),
        (lambda: load("b", 6, seed=4, replace=True), [("b", 13)]),     # (b's rank and scale change too)
        (lambda: load("a", 8, seed=5), [("a", 2), ("b", 2), ("c", 2)]),
        (None, [("c", 40), (None, 20), ("a", 4)]),                     # max_tokens
    ]
    with no_recompiles():
        for i, (change, requests) in enumerate(steps):
            if change:
                change()
            num_tokens = ctx.set_batch(requests)
            ids = token_ids(num_tokens, seed=i)
            out = check_step(compiled, model, ids)
            names = [name for name, n in requests for _ in range(n)]
            assert token_err(out, ids, names, adapters) <= FLOAT64, requests
        slots = [2, -1, 0, 1, 2, 0, -1]                                  # raw per-token slots
        ctx.set_token_slots(torch.tensor(slots))
        ids = token_ids(7, seed=99)
        out = check_step(compiled, model, ids)
        assert token_err(out, ids, [ctx.slot_names[s] if s >= 0 else None for s in slots], adapters) <= FLOAT64
    assert counter.frame_count == 1


@pytest.mark.parametrize("stack_a", [False, True], ids=["lora_linear", "stack_a"])
@pytest.mark.parametrize("device, backend", [("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=cuda_only)],
                         ids=["cpu_aot_eager", "cuda_inductor"])
def test_per_row_inside_a_compiled_model(device, backend, stack_a):
    """ctx.per_row (model.generate's way) under torch.compile(fullgraph=True): each layer's batch is built in the
    graph from its input's rows. One graph serves prefills of other lengths and row counts (beams: rows
    repeated), other numbers of adapters and other adapters in the rows; a one-token decode step specialises
    once. Logits equal eager
    set_batch's with the same requests; gradients of a compiled training forward too. A prefill past max_tokens
    (its batch built in the graph with no capacity, as eager per_row builds one of its own size; set_batch
    cannot serve it) against float64, in the same graph. With stack_a the graphs trace lora_linear_stacked
    (a compiled stacked layer that fell back to lora_linear gave the same values within roundoff)."""
    model, ctx, shapes = toy_model(device, stack_a=stack_a)
    tol = EXACT if backend == "aot_eager" else 1e-5     # (Inductor fuses the model's own ops: float32 roundoff)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    def step(rows, shape, seed):
        ids = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed)).to(device)
        for dim in (0, 1) if shape[1] > 1 else (0,):
            torch._dynamo.mark_dynamic(ids, dim)
        with ctx.per_row(rows):
            got = compiled(ids)
        repeat = shape[0] // len(rows)
        ctx.set_batch([(name, shape[1]) for name in rows for _ in range(repeat)])
        assert rel_err(got, model(ids)) <= tol, (rows, shape)

    with no_recompiles():
        # (Other numbers of adapters too: with their count static, a compiled generate recompiled for each
        # batch size, past Dynamo's recompile limit after a few.)
        for i, (rows, shape) in enumerate([(["a", None, "b"], (3, 4)), (["a", None, "b"], (3, 7)),
                                           (["b", "b", None], (6, 5)), (["a", "b"], (2, 6)),
                                           (["b", None, "a", "a", None], (5, 3)), (["a", None], (4, 4)),
                                           (["b"], (4, 5))]):      # (one adapter for every row: its own graph once)
            step(rows, shape, i)
    with torch.no_grad():
        step(["a", None, "b"], (3, 1), 3)       # (one token a row: a graph of its own)
    with no_recompiles():
        step(["b", "a", "a"], (6, 1), 4)
    assert counter.frame_count == 2
    rows = ["b", None, "a"]
    ids = torch.randint(0, 64, (3, 30), generator=torch.Generator().manual_seed(8)).to(device)
    for dim in (0, 1):
        torch._dynamo.mark_dynamic(ids, dim)
    with torch.no_grad(), ctx.per_row(rows):    # 90 tokens, max_tokens 64: row a's tokens 4-29 past the capacity
        got = compiled(ids)
    assert token_err(got, ids, [n for n in rows for _ in range(30)], toy_adapters(shapes)) <= FLOAT64
    # (The same graph, unless a stacked layer serves fewer tokens: a GPU's tuned table may set its limit under 90.)
    stacked = [layer.stacked_max_tokens for layer in ctx.layers.values() if layer._stacked is not None]
    assert counter.frame_count == (2 if all(limit >= 90 for limit in stacked) else 3)
    assert bool(stacked) == stack_a or device != "cpu"      # (no tuned table on the CPU: the toy's gate_up stacks)
    traced = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes}
    assert "lora_ops.lora_linear" in traced and ("lora_ops.lora_linear_stacked" in traced) == bool(stacked), traced

    trainer = ctx.train_slots(["a", "b"])
    ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(9)).to(device)
    grads = []
    for run in ("compiled", "eager"):
        for p in trainer.parameters():
            p.grad = None
        if run == "compiled":
            with ctx.per_row(["a", None, "b"]):
                compiled(ids).square().mean().backward()
        else:
            ctx.set_batch([("a", 4), (None, 4), ("b", 4)])
            model(ids).square().mean().backward()
        grads.append([p.grad.clone() for p in trainer.parameters()])
    trainer.close()
    assert all(rel_err(g, w) <= tol for g, w in zip(*grads)) and grads[1][0].abs().sum() > 0


@pytest.mark.parametrize("grad_mode", [False, True], ids=["export_under_no_grad", "export_with_grad"])
def test_export_reads_the_contexts_batch(grad_mode):
    """torch.export traces the layers into lora_ops' ops (no Python of ours in the program) and lifts the
    context's metadata as constants that are the context's own buffers, so in this process the program serves
    whatever batch set_batch refills them with, as the model does (with grad mode on at export too: it once
    read the batch's copy for autograd, which froze the batch at export into the program). A program saved and
    loaded (torch.export.save / load) carries a copy of the batch set when it was saved."""
    model, ctx, _ = toy_model()
    ctx.set_batch([("a", 3), (None, 1), ("b", 4)])
    ids = token_ids(8, seed=3, mark=lambda t, d: None)
    with torch.no_grad():
        want = model(ids)
    with torch.set_grad_enabled(grad_mode):
        program = torch.export.export(model, (ids,), strict=False)
    ops_traced = {str(node.target) for node in program.graph.nodes if "lora_ops" in str(node.target)}
    assert ops_traced == {"lora_ops.lora_linear.default"}, ops_traced

    def save_and_load():
        saved = io.BytesIO()
        torch.export.save(program, saved)
        saved.seek(0)
        return torch.export.load(saved).module()
    loaded = save_and_load()
    with torch.no_grad():
        assert rel_err(program.module()(ids), want) <= EXACT
        ctx.set_batch([("b", 5), ("a", 3)])
        new = model(ids)
        assert rel_err(new, want) > 1e-3
        assert rel_err(program.module()(ids), new) <= EXACT
        assert rel_err(loaded(ids), want) <= EXACT
        loaded_later = save_and_load()
        ctx.set_batch([("a", 3), (None, 1), ("b", 4)])
        assert rel_err(loaded_later(ids), new) <= EXACT


def test_batch_of_one_token_with_mark_unbacked():
    """mark_unbacked: one graph for every size, 1 included (this model does not branch on the size)."""
    mark_unbacked = torch._dynamo.decorators.mark_unbacked
    model, ctx, _ = toy_model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with no_recompiles():
        for i, requests in enumerate([[("a", 1)], [("b", 2), (None, 3)], [(None, 1)], [("b", 1)]]):
            num_tokens = ctx.set_batch(requests)
            check_step(compiled, model, token_ids(num_tokens, seed=i, mark=mark_unbacked))
    assert counter.frame_count == 1


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks_allowed"])
def test_an_input_of_another_token_count_than_the_batch_raises_when_compiled(fullgraph):
    """As eagerly (check_input): a compiled model fed more or fewer tokens than the batch set raises, where its
    kernels gave the extra tokens no adapter (or dropped the batch's extra slots) without a word. The graph
    guards on the two counts being equal, so matching counts still share one graph, after the error too."""
    model, ctx, _ = toy_model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=fullgraph)
    with torch.no_grad():
        for n in (3, 7, 5):
            ctx.set_batch([("a", n - 1), ("b", 1)])
            check_step(compiled, model, token_ids(n, seed=n))
        assert counter.frame_count == 1
        for fed, batch in ((8, 4), (4, 8)):
            ctx.set_batch([("a", batch)])
            with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="the input's token count differs from "
                               "the batch's"):
                compiled(token_ids(fed, seed=0))
        ctx.set_batch([("b", 6)])
        check_step(compiled, model, token_ids(6, seed=6))
    assert counter.frame_count == 1


def test_batch_of_one_token_padded_to_two():
    """mark_dynamic specialises size 1, so a one-token step is padded with a no-adapter token at the end;
    the real token's output is unchanged."""
    model, ctx, _ = toy_model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with no_recompiles():
        ctx.set_batch([("a", 3), ("b", 2)])
        check_step(compiled, model, token_ids(5, seed=0))
        ids = token_ids(1, seed=1, mark=lambda t, d: None)
        ctx.set_batch([("b", 1)])
        alone = model(ids)
        ctx.set_batch([("b", 1), (None, 1)])
        padded = torch.cat([ids, torch.zeros_like(ids)], dim=1)
        torch._dynamo.mark_dynamic(padded, 1)
        out = compiled(padded)
        assert rel_err(out[:, :1], alone) <= EXACT
    assert counter.frame_count == 1


def test_llama_token_dim_dynamic_and_adapter_changes():
    """As the toy's test, on a Hugging Face Llama. The swap's step must also differ from b's logits before it on
    the same tokens (the eager run reads the same stacks: a swap that kept the old adapter passed against it)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ctx = apply_lora(model, PROJECTIONS, max_loras=2, max_rank=8, max_tokens=64)
    shapes = {path: (layer.in_features, layer.out_features) for path, layer in ctx.layers.items()}
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 4, seed=1, prefix=""))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda ids: model(input_ids=ids).logits, backend=counter, fullgraph=True)

    def step(requests, seed):
        num_tokens = ctx.set_batch(requests)
        ids = token_ids(num_tokens, seed, vocab=128)
        out = compiled(ids)
        assert rel_err(out, model(input_ids=ids).logits) <= EXACT
        return out

    with no_recompiles():
        step([("a", 2)], 0)
        step([(None, 3), ("a", 4)], 1)
        ctx.load_adapter_tensors("b", peft_tensors(shapes, 8, seed=2, prefix=""))
        step([("b", 5), ("a", 1), (None, 6)], 2)
        ctx.unload_adapter("a")
        ctx.set_batch([("b", 9)])
        before = model(input_ids=token_ids(9, 3, vocab=128)).logits
        ctx.load_adapter_tensors("b", peft_tensors(shapes, 2, seed=3, prefix=""), replace=True)
        assert rel_err(step([("b", 9)], 3), before) > 1e-3
        # One token, padded to two (pad last: under the causal mask the real token never sees it).
        ctx.set_batch([("b", 1)])
        alone = model(input_ids=torch.tensor([[7]])).logits
        ctx.set_batch([("b", 1), (None, 1)])
        padded = torch.tensor([[7, 0]])
        torch._dynamo.mark_dynamic(padded, 1)
        assert rel_err(compiled(padded)[:, :1], alone) <= EXACT
    assert counter.frame_count == 1


def test_inductor_compiles_once():
    model, ctx, shapes = toy_model()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with no_recompiles():
        for i, requests in enumerate([[("a", 2), (None, 3)], [("b", 4), ("a", 7)]]):
            num_tokens = ctx.set_batch(requests)
            ids = token_ids(num_tokens, seed=i)
            assert rel_err(compiled(ids), model(ids)) <= 1e-5      # inductor fuses the base ops
        ctx.load_adapter_tensors("a", peft_tensors(shapes, 3, seed=7), replace=True)
        ctx.set_batch([("a", 6)])
        ids = token_ids(6, seed=9)
        assert rel_err(compiled(ids), model(ids)) <= 1e-5
    assert counter.frame_count == 1


# ---- CUDA graphs (GPU only) -------------------------------------------------------------------------------


def capture(step, static_ids):
    """Warm up on a side stream (Triton JIT, compile), then capture ``step(static_ids)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static_ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_ids)
    return graph, out


@contextlib.contextmanager
def sync_is_an_error():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda_only
@pytest.mark.parametrize("stack_a", [False, True], ids=["lora_linear", "stack_a"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_cuda_graph_replays_new_slots_and_swapped_adapters(compiled, stack_a, monkeypatch):
    """stack_a: every layer runs lora_linear_stacked (its expand launched with PDL behind the GEMM)."""
    from lora_ops import layers
    monkeypatch.setattr(layers, "STACKED_MAX_ROWS_FRACTION", 4.0)   # the toy's stacks are wide (test_stacked)
    model, ctx, shapes = toy_model("cuda", stack_a=stack_a)
    assert all((layer._stacked is not None) == stack_a for layer in ctx.layers.values())
    if stack_a:   # the stacked model against the plain one, eagerly
        plain, plain_ctx, _ = toy_model("cuda")
        for c in (ctx, plain_ctx):
            c.set_batch([("a", 3), (None, 2), ("b", 3)])
        ids = torch.randint(0, 64, (1, 8), device="cuda")
        with torch.no_grad():
            assert rel_err(model(ids), plain(ids)) <= 1e-4
    step = torch.compile(model, fullgraph=True) if compiled else model
    requests = [("a", 3), (None, 2), ("b", 3)]
    ctx.set_batch(requests)
    static_ids = torch.randint(0, 64, (1, 8), device="cuda")
    with torch.no_grad():
        graph, out = capture(step, static_ids)
        checks = [
            (None, requests),
            (None, [("b", 5), ("a", 3)]),                                              # new slots
            (lambda: ctx.load_adapter_tensors("a", peft_tensors(shapes, 2, seed=9), replace=True),
             [("a", 4), ("b", 4)]),                                                    # adapter swapped in place
            (lambda: ctx.unload_adapter("b"), [("a", 8)]),
        ]
        for change, batch in checks:
            if change:
                change()
            static_ids.copy_(torch.randint(0, 64, (1, 8), device="cuda"))
            with sync_is_an_error():
                ctx.set_batch(batch)
                graph.replay()
            torch.cuda.synchronize()
            # An eager step replays the very kernels it captured; inductor fuses the base ops differently.
            assert rel_err(out, model(static_ids)) <= (1e-5 if compiled else EXACT)


@cuda_only
@pytest.mark.parametrize("fill", [None, False], ids=["one_launch_fill", "torch_fill"])
def test_cuda_graph_captures_the_batch_fill_from_device_slots(fill):
    """A server may capture the batch fill with the step: set_token_slots from a static device buffer inside
    the graph, so that each replay reads the slots copied there since, by either fill (the one-launch fill,
    the GPU default, compiled during the warm-up). Replays equal eager steps on the same slots."""
    with fill_setting(fill):
        model, ctx, _ = toy_model("cuda")
        a, b = ctx.slot_of("a"), ctx.slot_of("b")
        static_ids = torch.randint(0, 64, (1, 8), device="cuda")
        static_slots = torch.tensor([a, b, -1, a, b, b, -1, a], dtype=torch.int32, device="cuda")

        def step(ids):
            ctx.set_token_slots(static_slots)
            return model(ids)
        outs = []
        with torch.no_grad():
            graph, out = capture(step, static_ids)
            ids = torch.randint(0, 64, (1, 8))
            for slots in ([b, b, a, -1, a, b, a, -1], [-1] * 8, [a] * 8):     # (the last two on the same ids)
                static_slots.copy_(torch.tensor(slots, dtype=torch.int32))
                static_ids.copy_(ids if slots[0] != b else torch.randint(0, 64, (1, 8)))
                with sync_is_an_error():
                    graph.replay()
                torch.cuda.synchronize()
                outs.append(out.clone())
                ctx.set_token_slots(static_slots.clone())      # the same slots, eagerly
                assert rel_err(out, model(static_ids)) <= EXACT, slots
        assert not torch.equal(outs[1], outs[2])     # (adapter a changes the output of the same ids)


@cuda_only
def test_reduce_overhead_mode():
    model, ctx, shapes = toy_model("cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, 64, (1, 8), device="cuda")
    with torch.no_grad():
        for i, batch in enumerate([[("a", 8)], [("b", 2), (None, 6)], [("a", 4), ("b", 4)], [("a", 8)]]):
            if i == 3:
                ctx.load_adapter_tensors("a", peft_tensors(shapes, 5, seed=11), replace=True)
            ctx.set_batch(batch)
            out = compiled(ids).clone()
            assert rel_err(out, model(ids)) <= 1e-5


def test_dynamic_true_compiles_alike_whatever_the_first_count():
    """torch.compile(dynamic=True), no mark_dynamic: the batch buffers' lengths (max_loras + 1 = 4, max_tokens =
    64) were symbols too, and duck sizing tied a first token count equal to either to the buffer: a graph for
    that count alone, then another. Their shapes are static now: a first count of 4 or 64 compiles as many
    graphs as one of 3."""
    model, ctx, _ = toy_model(max_tokens=64)

    def frames(first):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
        with torch.no_grad():
            for i, n in enumerate((first, 9, 11, 13)):
                ctx.set_batch([("a", n - 2), (None, 1), ("b", 1)])
                check_step(compiled, model, token_ids(n, seed=i, mark=lambda t, d: None))
        return counter.frame_count
    assert frames(4) == frames(64) == frames(3) <= 2


def encoder_with_lora(stack_a=False):
    """nn.TransformerEncoder (batch_first) with each layer's linear1 and linear2 wrapped: LoRA layers reached
    through built-in nn modules, whose attributes Dynamo gives static shapes; two adapters loaded."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    ctx = apply_lora(model, ["linear1", "linear2"], max_loras=2, max_rank=4, max_tokens=64, stack_a=stack_a)
    gen = torch.Generator().manual_seed(1)
    for name in ("a", "b"):
        tensors = {}
        for i in range(2):
            for proj, (n, k) in (("linear1", (64, 32)), ("linear2", (32, 64))):
                tensors[f"layers.{i}.{proj}.lora_A.weight"] = torch.randn(4, k, generator=gen) * 0.3
                tensors[f"layers.{i}.{proj}.lora_B.weight"] = torch.randn(n, 4, generator=gen) * 0.3
        ctx.load_adapter_tensors(name, tensors, {"r": 4, "lora_alpha": 8})
    return model, ctx


@pytest.mark.parametrize("stack_a", [False, True], ids=["lora_linear", "stack_a"])
def test_layers_inside_builtin_modules_compile_once_across_token_counts(stack_a):
    """LoRA layers called from inside built-in nn modules (nn.TransformerEncoderLayer's linear1 / linear2):
    the token count stays dynamic. The layers read the batch's token count through the model's attributes,
    to which Dynamo gives static shapes under a built-in module: a graph per token count, past the recompile
    limit (fullgraph: a hard failure at the ninth), and an input marked dynamic was refused. Now one graph, as
    for the model without LoRA; per_row's adapters a row likewise (one graph for every row count). With stack_a
    every layer's graph call is lora_linear_stacked (each stacks: a fallback to lora_linear gave the same
    values)."""
    model, ctx = encoder_with_lora(stack_a)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with no_recompiles():
        for i, n in enumerate(range(3, 15)):
            ctx.set_batch([("a", n // 2), (None, 1), ("b", n - n // 2 - 1)])
            x = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(i))
            torch._dynamo.mark_dynamic(x, 1)
            out = compiled(x)
            assert rel_err(out, model(x)) <= EXACT
    assert counter.frame_count == 1
    traced = {str(node.target) for node in counter.graphs[0].graph.nodes if "lora_ops" in str(node.target)}
    assert traced == {"lora_ops.lora_linear_stacked" if stack_a else "lora_ops.lora_linear"}, traced
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for rows in range(2, 7):
            x = torch.randn(rows, 5, 32, generator=torch.Generator().manual_seed(rows))
            names = (["a", None, "b"] * 3)[:rows]
            with ctx.per_row(names):
                out = compiled(x)
                assert rel_err(out, model(x)) <= EXACT
            for r, name in enumerate(names):       # each row as its own batch, eagerly
                ctx.set_batch([(name, 5)])
                assert rel_err(out[r:r + 1], model(x[r:r + 1])) <= EXACT
    assert counter.frame_count <= 2     # (rows 2, then a dynamic count: Dynamo's automatic dynamic)


@pytest.mark.parametrize("checks", ["call_and_fakes", "fakes_alone"])
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks"])
def test_inductor_freezing_is_refused_while_tracing(fullgraph, checks, monkeypatch):
    """Inductor's freezing (torch._inductor.config.freezing, common for CPU inference) makes parameters and
    static-address inputs constants where grad mode is off: the compiled model kept the batch and adapters of
    its first call and ignored set_batch, loads and unloads, silently. Refused while tracing with grad mode off;
    with graph breaks allowed Dynamo may run the layers eagerly (it had compiled the ops' own frames below them,
    which kept serving the first batch: ops.call refuses it now, on every path), and the model follows the batch
    and the loads, or the compile is refused. Grad mode on (Inductor freezes nothing there) compiles and follows
    the batch. ``fakes_alone``: without ops.call's check, as torch 2.11's Dynamo dropped it (session 54, an
    H100): the fake kernels' check alone refuses."""
    import torch._inductor.config as inductor_config
    from csrc_meta import checks as contract_checks
    if checks == "fakes_alone":
        monkeypatch.setattr(contract_checks, "refuse_frozen_graphs", lambda: None)
    model, ctx, _ = toy_model()
    ids = token_ids(6, seed=1)
    refused = "lora_ops under torch.compile with torch._inductor.config.freezing on"
    with inductor_config.patch(freezing=True):
        with torch.no_grad():
            ctx.set_batch([("a", 6)])
            if fullgraph:
                with pytest.raises(Exception, match=refused):
                    torch.compile(model, fullgraph=True, backend="inductor")(ids)
            else:
                compiled = torch.compile(model, backend="inductor")
                for requests in ([("a", 6)], [("b", 6)], [(None, 6)], "load"):
                    if requests == "load":
                        ctx.load_adapter_tensors("b", peft_tensors(module_shapes(toy_lm()), 4, seed=9), replace=True)
                    else:
                        ctx.set_batch(requests)
                    try:
                        out = compiled(ids)
                    except Exception as e:      # (refused: never a frozen batch served)
                        assert refused in str(e), requests
                        break
                    assert rel_err(out, model(ids)) <= EXACT, requests
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
        for requests in ([("a", 6)], [("b", 6)]):
            ctx.set_batch(requests)
            assert rel_err(compiled(ids), model(ids)) <= EXACT


def test_export_inside_per_row_is_refused():
    """The program kept the block's adapters a row as a constant: later blocks and set_batch were ignored."""
    model, ctx, _ = toy_model()
    ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(0))
    with ctx.per_row(["a", None, "b"]):
        with pytest.raises(RuntimeError, match=r"torch.export inside ctx.per_row: the program would keep this block's "
                                               r"adapters a row as a constant"):
            torch.export.export(model, (ids,), strict=False)


@pytest.mark.parametrize("tracer", ["jit_trace", "jit_script", "fx_symbolic_trace"])
def test_torchscript_and_fx_are_refused_naming_the_supported_tracers(tracer):
    """Their errors came from deep inside (an assertion in the op checks, "try blocks aren't supported", a
    TraceError)."""
    model, ctx, _ = toy_model()
    ctx.set_batch([("a", 5)])
    ids = token_ids(5, seed=2, mark=lambda t, d: None)
    run = {"jit_trace": lambda: torch.jit.trace(model, (ids,)), "jit_script": lambda: torch.jit.script(model),
           "fx_symbolic_trace": lambda: torch.fx.symbolic_trace(model)}[tracer]
    what = {"jit_trace": "torch.jit.trace", "jit_script": "torch.jit.script",
            "fx_symbolic_trace": "torch.fx.symbolic_trace"}[tracer]
    with pytest.raises(TypeError, match=rf"LoRALinear: {what} is not supported .*use torch.compile or torch.export"):
        run()


def test_forward_mode_ad_around_or_inside_compile_runs_the_ops_eagerly():
    """jvp(torch.compile(model)) and torch.compile(jvp(model)) give eager jvp's output and tangent (Dynamo had
    compiled the ops' kernels with dual fake tensors: a torch INTERNAL ASSERT on _fw_primal); under
    fullgraph=True Dynamo refuses the graph break."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    ctx = apply_lora(model, ["0", "2"], max_loras=2, max_rank=4, max_tokens=16)
    ctx.load_adapter_tensors("a", peft_tensors({"0": (16, 16), "2": (16, 16)}, 4, seed=1, prefix=""))
    ctx.set_batch([("a", 3), (None, 3)])
    x, tangent = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    want = torch.func.jvp(model, (x,), (tangent,))
    assert rel_err(want[1], torch.func.jvp(lambda v: model[2](model[1](model[0].base(v))), (x,), (tangent,))[1]) > 1e-3
    runs = {"jvp_of_compile": lambda: torch.func.jvp(torch.compile(model), (x,), (tangent,)),
            "compile_of_jvp": lambda: torch.compile(lambda v: torch.func.jvp(model, (v,), (tangent,)))(x)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # (Dynamo's about the frames it skips)
        for how, run in runs.items():
            for got, expected in zip(run(), want):
                assert rel_err(got, expected) <= 1e-6, how
            torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported):   # (the graph break Dynamo's to refuse)
            torch.compile(lambda v: torch.func.jvp(model, (v,), (tangent,)), fullgraph=True)(x)
