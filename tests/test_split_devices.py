"""A model split across devices (Hugging Face's ``device_map``): one LoRAContext, each layer reading the batch on
its own device (LoRAContext.serve_device).

On the CPU machine the second device is ``meta``: its layers run the ops' fake kernels, whose device checks
refuse metadata from another device, so a layer that read the context's CPU buffers fails there; values are
checked on the CPU part, and those of a device's copy of the batch on the CPU alone, the context's buffers keyed
as ``cpu:0`` (test_each_devices_copy_of_the_batch_follows_the_context). With a GPU, a model split between the GPU
and the CPU (and between two GPUs, where there are two) against the same model on one device: outputs,
gradients, per_row and a training step.
"""
import copy

import pytest
import torch

from conftest import TOLERANCE, rel_err
from layer_helpers import ToyLM, module_shapes, peft_tensors, toy_lm
from lora_ops.layers import apply_lora

REQUESTS = [("a", 5), (None, 3), ("b", 4), ("a", 4)]      # 16 tokens: [2, 8]
PROJECTIONS = ["q_proj", "v_proj", "o_proj", "down_proj"]


class SplitLM(ToyLM):
    """ToyLM whose blocks and head may sit on different devices: each moves its input to its own device, as
    accelerate's hooks do for a dispatched model."""

    def forward(self, input_ids):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h.to(layer.norm.weight.device))
        return self.lm_head(h.to(self.lm_head.weight.device))


def lora_lms(devices, seed=0):
    """(one-device model and its context, split model and its context): the same weights and adapters a
    (rank 4, lora_dropout 0.25: seen in train mode while a trainer is open) and b (rank 2); the split model's
    block i on ``devices[i]``, its head on the last device."""
    torch.manual_seed(seed)
    one = SplitLM().eval()
    split = copy.deepcopy(one)
    split.model.embed_tokens.to(devices[0])
    for block, device in zip(split.model.layers, devices):
        block.to(device)
    split.lm_head.to(devices[-1])
    models = []
    for model in (one, split):
        ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=4, max_tokens=64)
        for i, (name, r) in enumerate([("a", 4), ("b", 2)]):
            tensors = peft_tensors(module_shapes(model, PROJECTIONS), r, seed=seed + i)
            config = {"r": r, "lora_alpha": -2.0 * r if i else 3.0, "lora_dropout": 0.0 if i else 0.25}
            ctx.load_adapter_tensors(name, tensors, config)
        models.append((model, ctx))
    return models


def block_outputs(model):
    """Forward hooks keeping each block's output; returns the list they fill."""
    outs = []
    for block in model.model.layers:
        block.register_forward_hook(lambda module, args, out: outs.append(out))
    return outs


def test_one_context_serves_a_model_split_with_the_meta_device():
    """Block 0 on the CPU, block 1 and the head on ``meta``: apply_lora gives one context on the CPU serving
    both; every path (no_grad, autograd, set_token_slots, per_row) reads each device's batch, and the CPU part
    computes what the one-device model does."""
    (one, one_ctx), (split, ctx) = lora_lms(["cpu", "meta"])
    assert ctx.device == torch.device("cpu") and list(ctx._mirrors) == [torch.device("meta")]
    for c in (one_ctx, ctx):
        c.set_batch(REQUESTS)
    ids = torch.randint(0, 64, (2, 8))
    want, got = block_outputs(one), block_outputs(split)
    with torch.no_grad():
        one(ids)
        logits = split(ids)
    assert logits.device.type == "meta" and logits.shape == (2, 8, split.lm_head.out_features)
    assert torch.equal(got[0], want[0]) and got[1].device.type == "meta"

    # Autograd on the meta part (its backward ops' fake kernels check their metadata's device too); the copy of
    # the batch set with grad mode on is taken on both devices under one serial number.
    ctx.set_batch(REQUESTS)
    copy_meta, _ = ctx._copy.on_devices[torch.device("meta")]
    assert copy_meta.sorted_token_ids._lora_batch == ctx._copy.meta.sorted_token_ids._lora_batch
    block = split.model.layers[1]
    block.self_attn.q_proj.lora_b.requires_grad_(True)
    h = torch.randn(2, 8, block.norm.weight.shape[0], device="meta", requires_grad=True)
    block(h).sum().backward()
    assert h.grad.shape == h.shape and block.self_attn.q_proj.lora_b.grad.device.type == "meta"

    # Micro-batches interleaved on the meta part: each backward reads its forward's copy of the batch there. A
    # backward that read the device's buffers, refilled by the second set_batch, is refused.
    losses = []
    for requests in (REQUESTS, REQUESTS[::-1]):
        ctx.set_batch(requests)
        losses.append(block(torch.randn_like(h, requires_grad=True)).sum())
    for loss in losses:
        loss.backward()

    # In train mode under a trainer (adapter a's dropout on) the dropout table, on the context's device, meets
    # each layer's. (No backward: the trainer's gradient hooks read from a meta gradient whether it is non-zero.)
    with ctx.train_slots(["a"]):
        split.train()
        ctx.set_batch(REQUESTS)
        assert split(ids).device.type == "meta"
        split.eval()

    ctx.set_token_slots(torch.tensor([0, 1, -1, 1] * 4))
    with torch.no_grad():
        assert split(ids).device.type == "meta"
        with ctx.per_row(["a", None, "b"]):
            assert split(torch.randint(0, 64, (3, 5))).shape[:2] == (3, 5)


def test_each_devices_copy_of_the_batch_follows_the_context():
    """The copy of the batch a layer on another device reads (serve_device's), with values: the same model and
    adapters reading the context's own buffers give the same logits and gradients after each change of the
    batch: one set before the device is served, set_token_slots, an unload and a load into the freed slot,
    micro-batches interleaved under a trainer with dropout, per_row blocks one after another."""
    (one, one_ctx), (two, ctx) = lora_lms(["cpu", "cpu"])
    for c in (one_ctx, ctx):
        c.set_batch(REQUESTS)       # grad mode on: autograd's copy taken before the device is served
    # The CPU machine has one real device. The context's buffers keyed as cpu:0 (torch.device("cpu", 0) is not
    # torch.device("cpu"); the tensors stay in CPU memory) make every layer, on "cpu", another device's: each
    # reads the copy that serve_device keeps on "cpu" as a split model's layers do, and its values can be read.
    ctx.device = torch.device("cpu", 0)
    ctx.serve_device("cpu")
    assert list(ctx._mirrors) == [torch.device("cpu")]
    ids = torch.randint(0, 64, (2, 8))

    def same_logits(rows=ids):
        with torch.no_grad():
            assert torch.equal(two(rows), one(rows))

    same_logits()       # serve_device copied the batch set before it

    # Under a trainer in train mode (dropout reads each token's slot), a forward on each of two batches, then
    # their backwards: each reads its own batch's copy on the device (taken again when the device was served).
    grads = []
    for model, c in ((one, one_ctx), (two, ctx)):
        with c.train_slots(["a", "b"]):
            model.train()
            losses = []
            for seed, requests in enumerate((REQUESTS, REQUESTS[::-1])):
                if seed:
                    c.set_batch(requests)
                torch.manual_seed(seed)     # the same dropout masks in both models
                losses.append(model(ids).square().mean())
            for loss in losses:
                loss.backward()
            model.eval()
            grads.append([stack.grad for layer in c.layers.values() for stack in (layer.lora_a, layer.lora_b)])
    assert all(want.any() for want in grads[0])     # (every stack has trained tokens in both batches)
    assert all(torch.equal(got, want) for got, want in zip(*grads[::-1]))

    for c in (one_ctx, ctx):
        c.set_token_slots(torch.tensor([0, 1, -1, 1] * 4))     # int64 slots, after a batch set per request
    same_logits()
    # b's tokens take no adapter after its unload, also once adapter c is loaded into the freed slot.
    for model, c in ((one, one_ctx), (two, ctx)):
        c.unload_adapter("b")
        tensors = peft_tensors(module_shapes(model, PROJECTIONS), 3, seed=7)
        c.load_adapter_tensors("c", tensors, {"r": 3, "lora_alpha": 5})
        assert c.slot_of("c") == 1
    same_logits()
    rows = torch.randint(0, 64, (3, 5))
    for adapters in (["a", None, "c"], ["c", "a", None]):       # each block its own rows on each device
        with one_ctx.per_row(adapters), ctx.per_row(adapters):
            same_logits(rows)


def test_a_split_model_compiles_in_one_graph():
    """torch.compile(fullgraph=True) over the CPU / meta split: each layer's lookup of its device's batch
    traces (no graph break), with set_batch and inside per_row (the batch built in the graph on each device)."""
    _, (split, ctx) = lora_lms(["cpu", "meta"])
    torch._dynamo.reset()
    compiled = torch.compile(split, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        ctx.set_batch(REQUESTS)
        logits = compiled(ids)
        with ctx.per_row(["a", None]):
            rows = compiled(ids)
    assert logits.device.type == rows.device.type == "meta" and logits.shape == rows.shape == (2, 8, 64)
    torch._dynamo.reset()


def test_a_layer_moved_to_a_device_the_context_does_not_serve_is_refused():
    """A layer moved after apply_lora to a device none of the model's layers was on: the error names the
    devices the context serves."""
    (one, ctx), _ = lora_lms(["cpu", "meta"])
    ctx.set_batch(REQUESTS)
    layer = one.model.layers[0].self_attn.q_proj.to("meta")
    with pytest.raises(ValueError, match=r"q_proj'.*the input is on meta but the LoRAContext serves cpu;"):
        layer(torch.randn(16, layer.in_features, device="meta"))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
SPLITS = {"cuda_then_cpu": ["cuda", "cpu"], "cpu_then_cuda": ["cpu", "cuda"]}
if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
    SPLITS["two_gpus"] = ["cuda:0", "cuda:1"]


@CUDA
@pytest.mark.parametrize("devices", SPLITS.values(), ids=SPLITS.keys())
def test_a_split_model_computes_what_one_device_does(devices):
    """The split model against the same model on the CPU: logits without and with autograd, the adapters'
    gradients, per_row, and the logits after an SGD step on adapter a (the trainer's masks on each device)."""
    (one, one_ctx), (split, ctx) = lora_lms(devices)
    ids = torch.randint(0, 64, (2, 8))
    for c in (one_ctx, ctx):
        c.set_batch(REQUESTS)
    with torch.no_grad():
        want, got = one(ids), split(ids.to(devices[0]))
    assert rel_err(got.cpu(), want) <= TOLERANCE[torch.float32]

    trainers = [c.train_slots(["a"]) for c in (one_ctx, ctx)]
    for c in (one_ctx, ctx):
        c.set_batch(REQUESTS)
    losses = [one(ids).square().mean(), split(ids.to(devices[0])).square().mean()]
    for loss in losses:
        loss.backward()
    for (path, a), (_, b) in zip(one_ctx.layers.items(), ctx.layers.items()):
        assert rel_err(b.lora_b.grad.cpu(), a.lora_b.grad) <= 1e-4, path
        assert rel_err(b.lora_a.grad.cpu(), a.lora_a.grad) <= 1e-4, path
    for trainer in trainers:
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        trainer.step(optimizer)
        trainer.close()
    with torch.no_grad():
        for c in (one_ctx, ctx):
            c.set_batch(REQUESTS)
        assert rel_err(split(ids.to(devices[0])).cpu(), one(ids)) <= 1e-4
        rows = torch.randint(0, 64, (3, 5))
        with one_ctx.per_row(["b", None, "a"]), ctx.per_row(["b", None, "a"]):
            assert rel_err(split(rows.to(devices[0])).cpu(), one(rows)) <= TOLERANCE[torch.float32]


@CUDA
@pytest.mark.parametrize("devices", SPLITS.values(), ids=SPLITS.keys())
def test_a_split_model_with_a_gpu_compiles_in_one_graph(devices):
    """torch.compile(fullgraph=True) over a split with a GPU (the CPU / meta split above, on real devices): the
    compiled model's logits equal the eager split model's, with set_batch and inside per_row."""
    _, (split, ctx) = lora_lms(devices)
    torch._dynamo.reset()
    compiled = torch.compile(split, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 64, (2, 8), device=devices[0])
    rows = torch.randint(0, 64, (3, 5), device=devices[0])
    with torch.no_grad():
        ctx.set_batch(REQUESTS)
        assert rel_err(compiled(ids), split(ids)) <= 1e-6
        with ctx.per_row(["b", None, "a"]):
            assert rel_err(compiled(rows), split(rows)) <= 1e-6
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_hugging_face_device_map_over_two_gpus():
    """A tiny Llama dispatched over two GPUs by accelerate (device_map), with lora_ops' adapters: generate inside
    per_row gives the tokens of the same model on one GPU."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(config).eval().to("cuda:0")
    split = copy.deepcopy(one)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                  "model.norm": 1, "lm_head": 1}
    split = accelerate.dispatch_model(split, device_map=device_map)
    targets = ["q_proj", "v_proj", "down_proj"]
    ids = torch.randint(0, 96, (2, 6), device="cuda:0")
    tokens = []
    for model in (one, split):
        ctx = apply_lora(model, targets, max_loras=2, max_rank=4, max_tokens=64)
        ctx.load_adapter_tensors("a", peft_tensors(module_shapes(model, targets), 4, seed=1), {"r": 4, "lora_alpha": 8})
        with ctx.per_row(["a", None]):
            tokens.append(model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).cpu())
    assert torch.equal(tokens[0], tokens[1])


def test_layers_accelerate_offloads_are_refused():
    """accelerate's CPU offload keeps a layer's weight on ``meta`` between forwards: apply_lora names the layer."""
    accelerate = pytest.importorskip("accelerate")
    model = accelerate.cpu_offload(toy_lm(), execution_device="cpu")
    assert model.lm_head.weight.device.type == "meta"
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.q_proj' is offloaded by accelerate"):
        apply_lora(model, PROJECTIONS, max_loras=2, max_rank=4, max_tokens=16)
