"""A backward runs on its own forward's batch, whatever set_batch calls came between (LoRAContext).

set_batch refills the context's metadata in place (CUDA graphs and compiled models read it there), so a
backward after a later set_batch once ran on the wrong batch: autograd refused it (the buffers' versions
moved), and under activation checkpointing, which saves nothing and recomputes the forward in the backward,
the gradients were silently wrong. Checked here, on both CPU backends, against the same steps run one after
the other (forward, backward, next batch), bit for bit:

- micro-batches interleaved (two forwards on two batches, then their backwards), on the whole-layer op (a
  bare nn.Linear base) and on the delta op after a hooked base, with per-slot dropout (a p of its own for each
  adapter: a recompute that read another batch's per-token slots would drop other rows);
- a no-grad forward on another batch between a forward and its backward (a reference model in RL);
- non-reentrant checkpointing with ``context_fn=ctx.checkpoint_context``, a batch of another size set
  between (the recompute's token count is its own batch's); without it, a recompute on another batch raises in
  the backward instead of giving wrong gradients;
- a batch set under no_grad (no copy): autograd refuses the stale backward, as before;
- the compiled model (aot_eager): the same gradients, one compile; bound eager training calls still replay;
- SlotTrainer's step: a batch set under no_grad between steps (an evaluation) moves no slot; one set under
  no_grad that a forward with autograd then trains on counts as if set with grad mode on.
"""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import DEVICE
from lora_ops import ops, training
from lora_ops.layers import LoRAContext, LoRALinear, apply_lora

K, L, R, M = 16, 3, 4, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(K, 2 * K)
        self.down = nn.Linear(2 * K, K)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    """Two blocks; ``mode``: None, "checkpoint" (non-reentrant) or "checkpoint_context" (with context_fn)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.mode = None
        self.ctx = None

    def forward(self, x):
        for block in self.blocks:
            if self.mode is None:
                x = block(x)
            else:
                extra = {"context_fn": self.ctx.checkpoint_context} if self.mode == "checkpoint_context" else {}
                x = checkpoint(block, x, use_reentrant=False, **extra)
        return x


def make_model(hooked=False, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    model = Model().to(DEVICE)
    ctx = apply_lora(model, ["up", "down"], max_loras=L, max_rank=R, max_tokens=64)
    model.ctx = ctx
    gen = torch.Generator().manual_seed(seed)
    for i, name in enumerate(("a", "b", "c")):
        # (Each adapter's p its own: with one p for all, a token read under another slot kept its p, and a
        # copy whose per-token slots aliased the buffers recomputed the same dropout.)
        training.add_trainable_adapter(ctx, name, r=R, lora_alpha=2 * R, lora_dropout=dropout * (1 + i / 2),
                                       generator=gen)
    for layer in ctx.layers.values():
        with torch.no_grad():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen))
        if hooked:   # a forward hook: the base runs its own forward, then the delta op (add_lora)
            layer.base.register_forward_hook(lambda module, inputs, out: None)
    trainer = ctx.train_slots(["a", "b", "c"])
    model.train()
    return model, ctx, trainer


BATCHES = ([("a", 5), (None, 2), ("b", 5)], [("c", 4), ("a", 8)], [(None, 3), ("b", 9)])
# BATCHES[0], then one of fewer tokens (8): a recompute of the first must check its input against its own batch's
# token count, not the one set since; and the second's copy has stale entries of the first past its tokens.
SIZES = (BATCHES[0], [("c", 3), (None, 1), ("a", 4)])


def inputs(i, tokens=M):
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(tokens, K, generator=gen).to(DEVICE), torch.randn(tokens, K, generator=gen).to(DEVICE)


def batch_inputs(batches, i):
    """:func:`inputs` ``i`` for the tokens of ``batches[i]``."""
    return inputs(i, sum(n for _, n in batches[i]))


def grads(trainer):
    out = [p.grad.clone() for p in trainer.parameters()]
    for p in trainer.parameters():
        p.grad = None
    return out


def sequential(model, ctx, trainer, order=(0, 1), batches=BATCHES):
    """Each batch's forward and backward in turn: the gradients of each, and the dropout RNG as it was."""
    torch.manual_seed(7)
    out = []
    for i in order:
        x, w = batch_inputs(batches, i)
        ctx.set_batch(batches[i])
        (model(x) * w).sum().backward()
        out.append(grads(trainer))
    return out


def interleaved(model, ctx, trainer, batches=BATCHES):
    """Both batches' forwards, then their backwards: the gradients of each (the RNG as in :func:`sequential`)."""
    torch.manual_seed(7)
    losses = []
    for i in (0, 1):
        x, w = batch_inputs(batches, i)
        ctx.set_batch(batches[i])
        losses.append((model(x) * w).sum())
    out = []
    for loss in losses:
        loss.backward()
        out.append(grads(trainer))
    return out


def assert_same(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), (step, i, float((a - b).abs().max()))


@pytest.mark.parametrize("hooked", [False, True], ids=["whole_layer", "hooked_base"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_interleaved_micro_batches_keep_their_batches(backend, hooked, dropout):
    model, ctx, trainer = make_model(hooked, dropout)
    want = sequential(model, ctx, trainer)
    assert_same(interleaved(model, ctx, trainer), want)


def test_a_no_grad_forward_between_a_forward_and_its_backward(backend):
    """RL: the policy's forward with gradients, the reference's forward on another batch without, then the
    policy's backward."""
    model, ctx, trainer = make_model()
    (want,) = sequential(model, ctx, trainer, order=(0,))
    x, w = inputs(0)
    ctx.set_batch(BATCHES[0])
    loss = (model(x) * w).sum()
    with torch.no_grad():
        ctx.set_batch(BATCHES[2])
        model(inputs(2)[0])
    loss.backward()
    assert_same([grads(trainer)], [want])


@pytest.fixture(params=[True, False], ids=["own_function", "dispatcher"])
def autograd_path(request):
    """Eager autograd through the op's own Function (default) or the dispatcher's (ops.set_eager_autograd)."""
    ops.set_eager_autograd(request.param)
    yield request.param
    ops.set_eager_autograd(True)


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_checkpoint_context_recomputes_on_the_forwards_batch(backend, autograd_path, dropout):
    """The recompute reads the forward's batch copy whole: its metadata, its per-token slots (dropout's p: each
    adapter's own) and its token count (the batch set since has fewer tokens: SIZES)."""
    model, ctx, trainer = make_model(dropout=dropout)
    want = sequential(model, ctx, trainer, batches=SIZES)
    model.mode = "checkpoint_context"
    assert_same(interleaved(model, ctx, trainer, batches=SIZES), want)


def test_checkpoint_recompute_on_another_batch_raises(backend, autograd_path):
    """Without the context_fn the recompute reads the batch set last: refused, not wrong gradients."""
    model, ctx, trainer = make_model()
    model.mode = "checkpoint"
    x, w = inputs(0)
    ctx.set_batch(BATCHES[0])
    loss = (model(x) * w).sum()
    ctx.set_batch(BATCHES[1])
    with pytest.raises(RuntimeError, match=r"recomputed \(activation checkpointing\) on another batch.*"
                                           r"context_fn=ctx.checkpoint_context"):
        loss.backward()


def test_checkpoint_needs_nothing_without_a_new_batch(backend):
    model, ctx, trainer = make_model()
    (want,) = sequential(model, ctx, trainer, order=(0,))
    model.mode = "checkpoint"
    x, w = inputs(0)
    ctx.set_batch(BATCHES[0])
    (model(x) * w).sum().backward()
    assert_same([grads(trainer)], [want])


def test_a_batch_set_under_no_grad_is_refilled_in_place(backend):
    """No copy for a batch set under no_grad: a forward with autograd on it reads the buffers, and autograd
    refuses its backward once they are refilled (the behaviour before copies); checkpoint_context copies the
    batch when the checkpointed forward starts, so its recompute still reads it."""
    model, ctx, trainer = make_model()
    (want,) = sequential(model, ctx, trainer, order=(0,))
    x, w = inputs(0)
    with torch.no_grad():
        ctx.set_batch(BATCHES[0])
    loss = (model(x) * w).sum()
    ctx.set_batch(BATCHES[1])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    model.mode = "checkpoint_context"
    with torch.no_grad():
        ctx.set_batch(BATCHES[0])
    loss = (model(x) * w).sum()
    ctx.set_batch(BATCHES[1])
    loss.backward()
    assert_same([grads(trainer)], [want])


def copying_hooks():
    """Saved-tensor hooks that keep a copy of each saved tensor, as activation offloading does
    (torch.autograd.graph.save_on_cpu copies CUDA tensors to the host and back; CPU ones it keeps as they are)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


@pytest.mark.parametrize("hooked", [False, True], ids=["whole_layer", "hooked_base"])
@pytest.mark.parametrize("set_under", ["grad", "no_grad"])
def test_saved_tensor_hooks_that_copy_keep_the_forwards_batch(backend, hooked, set_under):
    """A forward under saved-tensor hooks that copy: its backward gets copies of the metadata, untagged, which
    the batch check once took for a recompute on another batch and refused. The copies hold the forward's
    batch (taken when the forward saved them), so the gradients are the steps' own, whatever set_batch ran
    since: micro-batches interleaved, on a batch set with grad mode on (the context's copy) or under no_grad
    (the buffers, refilled in place before the backward)."""
    model, ctx, trainer = make_model(hooked)
    want = sequential(model, ctx, trainer)
    losses = []
    for i in (0, 1):
        x, w = inputs(i)
        with torch.set_grad_enabled(set_under == "grad"):
            ctx.set_batch(BATCHES[i])
        with copying_hooks():
            losses.append((model(x) * w).sum())
    got = []
    for loss in losses:
        loss.backward()
        got.append(grads(trainer))
    assert_same(got, want)


@pytest.mark.parametrize("dynamo", ["this_torch", "is_exporting_true"])
def test_compiled_model_interleaves_without_recompiling(backend, dynamo, monkeypatch):
    """Interleaved micro-batches under torch.compile: the compiled backward of each reads its own batch's copy.
    ``is_exporting_true``: torch.compiler.is_exporting() answers True while Dynamo traces, as torch 2.11's Dynamo
    does for torch.compile too (the compiled graph once read the batch buffers there, and each backward raised
    after the next set_batch refilled them)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    if dynamo == "is_exporting_true":
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    torch._dynamo.reset()    # (the other backend's run compiled Model.forward with a counter of its own)
    model, ctx, trainer = make_model()
    want = sequential(model, ctx, trainer)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            got = interleaved(compiled, ctx, trainer)
            for g, w_ in zip(got, want):
                for a, b in zip(g, w_):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("mode", ["checkpoint", "checkpoint_context"])
def test_compiled_checkpointing_recomputes_from_its_saved_inputs(backend, mode):
    """Under torch.compile the checkpointed region's recompute runs in the compiled backward from the graph's
    saved inputs, the batch's copy among them: right without the context_fn, and with it (which hands the
    compiler two TorchDispatchModes that do nothing: all it takes there)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    model, ctx, trainer = make_model()
    want = sequential(model, ctx, trainer)
    model.mode = mode
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            for g, w in zip(interleaved(compiled, ctx, trainer), want):
                for a, b in zip(g, w):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


def test_bound_training_calls_replay_across_batches(triton_kernels):
    """The bound eager training calls (lora_ops.eager) replay on each batch's copy: a new batch every step
    takes no rebinding."""
    torch.manual_seed(0)
    ctx = LoRAContext(L, 64, device=DEVICE)
    layer = LoRALinear(nn.Linear(K, 24).to(DEVICE), ctx, R, [16, 8])
    gen = torch.Generator().manual_seed(1)
    for slot in range(L):
        slices = [(torch.randn(R, K, generator=gen), torch.randn(n, R, generator=gen)) for n in (16, 8)]
        layer.write_slot(slot, [(a.to(DEVICE), b.to(DEVICE)) for a, b in slices], 0.5, R)
    for p in (layer.lora_a, layer.lora_b):
        p.requires_grad_(True)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        ctx.set_token_slots(torch.randint(-1, L, (M,), generator=gen, dtype=torch.int32))   # a new batch each step
        replays = layer._eager.replays
        layer(inputs(step)[0]).sum().backward()
        if step >= 2:   # both signatures bound
            assert layer._eager.replays == replays + 1, step


def test_hugging_face_checkpointing_takes_the_context_fn():
    """A Hugging Face model's own activation checkpointing, given ``context_fn=ctx.checkpoint_context`` (and
    use_reentrant=False) in its kwargs: interleaved batches give the gradients of the steps run in turn."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    ctx = apply_lora(model, ["q_proj", "v_proj", "down_proj"], max_loras=L, max_rank=R, max_tokens=64)
    gen = torch.Generator().manual_seed(3)
    for name in ("a", "b"):
        training.add_trainable_adapter(ctx, name, r=R, lora_alpha=2 * R, generator=gen)
    for layer in ctx.layers.values():
        with torch.no_grad():
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen) * 0.1)
    trainer = ctx.train_slots(["a", "b"])
    model.train()
    batches = ([("a", 6), ("b", 6)], [("b", 12)])
    ids = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(i)).to(DEVICE) for i in (0, 1)]

    def loss(i):
        ctx.set_batch(batches[i])
        return model(ids[i]).logits.float().square().mean()
    want = []
    for i in (0, 1):
        loss(i).backward()
        want.append(grads(trainer))

    def checkpointing(**kwargs):
        enable = getattr(model, "activation_checkpointing_enable", None)   # (transformers 5; 4: gradient_...)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    checkpointing(use_reentrant=False)     # checkpointing is on: without the context_fn, refused
    losses = [loss(0), loss(1)]
    with pytest.raises(RuntimeError, match="recomputed"):
        losses[0].backward()
    checkpointing(use_reentrant=False, context_fn=ctx.checkpoint_context)
    losses = [loss(0), loss(1)]
    got = []
    for one in losses:
        one.backward()
        got.append(grads(trainer))
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_only_autograd_reads_the_copy(backend, monkeypatch):
    """Calls without autograd (inference, CUDA graphs, compiled serving) read the context's buffers, refilled in
    place; calls that record autograd read the batch's copy; set_batch under no_grad takes none."""
    from lora_ops import eager, ops as ops_module
    model, ctx, trainer = make_model()
    seen = []
    call = ops_module.call
    monkeypatch.setattr(ops_module, "call", lambda name, *args: (seen.append(args[-3]), call(name, *args))[1])
    eager.set_enabled(False)      # (bound calls skip ops.call)
    try:
        x, _ = inputs(0)
        ctx.set_batch(BATCHES[0])
        model(x)
        assert seen and all(t is ctx._copy.meta.sorted_token_ids for t in seen)
        seen.clear()
        with torch.no_grad():
            model(x)
            assert seen and all(t is ctx.meta.sorted_token_ids for t in seen)
            ctx.set_batch(BATCHES[1])
        assert ctx._copy is None
    finally:
        eager.set_enabled(True)


# ---- SlotTrainer: which batches count ---------------------------------------------------------------------

def slot_stacks(trainer, slot):
    return [p.detach()[slot].clone() for p in trainer.parameters()]


def adamw_steps(trainer, step_grads, steps):
    """``steps`` AdamW steps through the trainer (weight decay on: it moves any slot the optimizer is let
    move), ``step_grads(step)`` making each step's gradients; returns the stacks, flattened."""
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        step_grads(step)
        trainer.step(optimizer)
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in trainer.parameters()])


def backward_on(model, ctx, requests, seed, set_under_no_grad=False):
    x, w = inputs(seed)
    with torch.set_grad_enabled(not set_under_no_grad):
        ctx.set_batch(requests)
    (model(x) * w).sum().backward()


def test_an_evaluation_between_steps_moves_no_slot(backend):
    """A chosen slot absent from the batches trained stays put, bit for bit, even where an evaluation under
    no_grad set a batch holding it between two steps: "b" has AdamW moments from step 1 and "c" none, and
    either would move (momentum, weight decay) if that batch counted, as it did."""
    model, ctx, trainer = make_model()
    before = {}

    def step_grads(step):
        if step == 1:
            before.update({name: slot_stacks(trainer, ctx.slot_of(name)) for name in "abc"})
            with torch.no_grad():
                ctx.set_batch([("b", 4), ("c", 4), ("a", 4)])
                model(inputs(1)[0])
        backward_on(model, ctx, [("a", 8), (None, 4)] if step else [("a", 6), ("b", 6)], 2 * step)
    adamw_steps(trainer, step_grads, 2)
    after = {name: slot_stacks(trainer, ctx.slot_of(name)) for name in "abc"}
    for name in "bc":
        assert all(torch.equal(u, v) for u, v in zip(before[name], after[name])), name
    assert not all(torch.equal(u, v) for u, v in zip(before["a"], after["a"]))


def test_a_batch_set_under_no_grad_trains_where_a_forward_records_autograd_on_it(backend):
    """A batch set under no_grad, then a forward with autograd on it (allowed): its slots move as if it had
    been set with grad mode on, bit for bit."""
    stacks = []
    for set_under_no_grad in (False, True):
        model, ctx, trainer = make_model()
        stacks.append(adamw_steps(trainer, lambda step: backward_on(model, ctx, BATCHES[step], step,
                                                                    set_under_no_grad), len(BATCHES)))
    assert torch.equal(stacks[0], stacks[1])
