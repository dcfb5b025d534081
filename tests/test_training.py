"""Training several adapters in one mixed batch (lora_ops.training) and saving them for PEFT.

- Gradients: a batch mixing rows of three trained adapters, one adapter only served (in the batch, not
  trained) and rows with none; one backward. Each trained slot's gradients must equal PEFT's, trained
  one adapter at a time on that adapter's rows only (an independent implementation); the served slot,
  padded rank and the base get nothing. Unfused and packed (fused q/k/v, gate/up) layers, each also with a
  forward hook on the bases (the base's own forward, then add_lora's autograd, not lora_linear's).
- Steps: AdamW with weight decay over every parameter of the model; after several steps every trained slot
  that had tokens has moved in every layer (within its rank), and everything else is bit-identical, the
  frozen base weights too.
- Compile: model + loss compiled (fullgraph, aot_eager), backward through the compiled graph, token
  counts {2, 7, 33}: one compile, recompiles fail, gradients equal eager's.
- Saving: adapters trained here are saved in PEFT format; PEFT loads them and reproduces our logits,
  and our loader reloads them bit for bit (a tiny Llama, and a packed model saved per projection).
- Dropout: each slot's lora_dropout from its config, in training mode only, on the adapter's input only.
- Fresh adapters: PEFT's scale (rsLoRA's too) and initialisation, reproducible with a generator.
"""
import copy
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import DEVICE, TOLERANCE, dtype_id, rel_err
from layer_helpers import PACKED, PROJECTIONS, VOCAB, fused_copy, module_shapes, peft_tensors, toy_lm
from lora_ops import training
from lora_ops.adapters import load_peft_adapter, save_peft_adapter
from lora_ops.layers import apply_lora

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOL = TOLERANCE[torch.float32]
TRAINED = {"alpha": dict(r=4, lora_alpha=8), "beta": dict(r=8, lora_alpha=4, use_rslora=True),
           "gamma": dict(r=2, lora_alpha=3)}
SERVED = {"served": dict(r=6, lora_alpha=6)}
ROWS = ["alpha", None, "beta", "served", "gamma", "alpha", None, "gamma", "beta"]
SEQ = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def peft_model_with(base, adapters, tmp_path):
    """PEFT holding ``adapters`` (random non-zero A and B), each saved as a directory."""
    torch.manual_seed(7)
    model = None
    for name, kwargs in adapters.items():
        config = peft.LoraConfig(target_modules=PROJECTIONS, init_lora_weights=False, **kwargs)
        if model is None:
            model = peft.get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    model.save_pretrained(tmp_path)
    return model, {name: str(tmp_path / name) for name in adapters}


def ours_with(model, paths, packed=False, max_rank=8):
    ctx = apply_lora(model, PROJECTIONS, max_loras=len(paths) + 2, max_rank=max_rank, max_tokens=64,
                     packed_modules=PACKED if packed else None)
    for name, path in paths.items():
        ctx.load_adapter(name, path)
    return ctx


def batch(rows, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen),
            torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen))


def loss_of(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def peft_grads(peft_model, name, rows, input_ids, labels):
    """{module path: (dA, dB)} of adapter ``name`` trained alone on its own rows."""
    peft_model.set_adapter(name)
    peft_model.zero_grad(set_to_none=True)
    mine = [i for i, n in enumerate(rows) if n == name]
    loss_of(peft_model(input_ids[mine]), labels[mine]).backward()
    inner = peft_model.base_model.model
    grads = {}
    for path, module in inner.named_modules():
        if path.rpartition(".")[2] in PROJECTIONS:
            grads[path] = (module.lora_A[name].weight.grad, module.lora_B[name].weight.grad)
    return grads


def our_grad(ctx, path, slot, r):
    layer, index = ctx.targets[path]
    i = index or 0
    lo, hi = layer.slice_offsets[i], layer.slice_offsets[i + 1]
    return layer.lora_a.grad[slot, i, :r], layer.lora_b.grad[slot, lo:hi, :r]


@pytest.mark.parametrize("hooked", [False, True], ids=["plain_base", "hooked_base"])
@pytest.mark.parametrize("packed", [False, True], ids=["unfused", "packed"])
def test_mixed_batch_grads_match_peft_per_adapter(tmp_path, packed, hooked):
    """(hooked_base: a forward hook on each base, which lora_linear's fused GEMM would skip, runs the base's own
    forward and the delta through add_lora: that op's backward is checked against PEFT as lora_linear's is.)"""
    base = toy_lm(seed=1)
    peft_model, paths = peft_model_with(base, {**TRAINED, **SERVED}, tmp_path)
    model = fused_copy(base) if packed else copy.deepcopy(base)
    ctx = ours_with(model, paths, packed)
    calls = []
    if hooked:
        for layer in ctx.layers.values():
            layer.base.register_forward_hook(lambda module, args, out: calls.append(module))
    trainer = ctx.train_slots(list(TRAINED))
    input_ids, labels = batch(ROWS)
    ctx.set_batch([(name, SEQ) for name in ROWS])
    model.train()
    loss_of(model(input_ids), labels).backward()
    assert len(calls) == (len(ctx.layers) if hooked else 0)     # (the hooked path did run)

    for name, spec in TRAINED.items():
        slot = ctx.slot_of(name)
        for path, (want_a, want_b) in peft_grads(peft_model, name, ROWS, input_ids, labels).items():
            got_a, got_b = our_grad(ctx, path, slot, spec["r"])
            assert want_a.abs().sum() > 0 and want_b.abs().sum() > 0
            assert rel_err(got_a, want_a) <= TOL, f"{name} {path} dA"
            assert rel_err(got_b, want_b) <= TOL, f"{name} {path} dB"
    trainable = torch.zeros(ctx.max_loras, 8, dtype=torch.bool)
    for name, spec in TRAINED.items():
        trainable[ctx.slot_of(name), :spec["r"]] = True
    for layer in ctx.layers.values():    # the served slot, empty slots and padded rank: exactly zero
        assert not layer.lora_a.grad[~trainable[:, None, :, None].expand_as(layer.lora_a)].any()
        assert not layer.lora_b.grad[~trainable[:, None, :].expand_as(layer.lora_b)].any()
        assert layer.base.weight.grad is None and not layer.base.weight.requires_grad
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    trainer.close()
    assert not any(p.requires_grad for layer in ctx.layers.values() for p in (layer.lora_a, layer.lora_b))


@pytest.mark.parametrize("batching", ["set_batch", "per_row"])
def test_adamw_changes_only_trained_slots_with_tokens(tmp_path, batching):
    """Each trained slot moves in every layer, packed (qkv, gate/up) and not, wherever it is within its rank; the
    rest stays bit for bit. The optimizer holds every parameter of the model, as PEFT's scripts give it
    ``model.parameters()``: the base stays put only because train_slots froze it (no gradient), which a trainer
    leaving it trainable would break. (per_row: the batches each layer builds from its input's rows tell the
    trainer which slots had tokens, as set_batch's do.)"""
    base = toy_lm(seed=2)
    _, paths = peft_model_with(base, {**TRAINED, **SERVED}, tmp_path)
    model = fused_copy(base)
    ctx = ours_with(model, paths, packed=True)
    trainer = ctx.train_slots(list(TRAINED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # gamma trains in the first two steps only: afterwards AdamW's momentum and decay must not move it.
    steps = [ROWS, ROWS, [n for n in ROWS if n != "gamma"], [n for n in ROWS if n != "gamma"]]
    model.train()
    for i, rows in enumerate(steps):
        input_ids, labels = batch(rows, seed=i)
        if batching == "per_row":
            with ctx.per_row(rows):
                loss_of(model(input_ids), labels).backward()
        else:
            ctx.set_batch([(name, SEQ) for name in rows])
            loss_of(model(input_ids), labels).backward()
        trainer.step(optimizer)
        optimizer.zero_grad()
        if i == 1:
            after_gamma = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = torch.zeros(ctx.max_loras, 8, dtype=torch.bool)
    for name, spec in TRAINED.items():
        moved[ctx.slot_of(name), :spec["r"]] = True
    gamma = ctx.slot_of("gamma")
    for n, p in model.named_parameters():
        old = before[n]
        if n.endswith("lora_a") or n.endswith("lora_b"):
            mask = moved[:, None, :, None] if n.endswith("lora_a") else moved[:, None, :]
            mask = mask.expand_as(p)
            assert torch.equal(p[~mask], old[~mask]), f"{n}: an untrained entry changed"
            # Slot by slot, every entry: one slot moving somewhere hid another restored (in the packed layers).
            for name, spec in TRAINED.items():
                slot, r = ctx.slot_of(name), spec["r"]
                rows = (slot, ..., slice(r), slice(None)) if n.endswith("lora_a") else (slot, slice(None), slice(r))
                assert (p[rows] != old[rows]).all(), f"{n}: {name} did not move everywhere within its rank"
            assert torch.equal(p[gamma], after_gamma[n][gamma]), f"{n}: gamma moved without tokens"
        else:
            assert p.grad is None and torch.equal(p, old), f"base parameter {n} changed"
    trainer.close()


def test_compiled_training_step_compiles_once(tmp_path):
    base = toy_lm(seed=3)
    _, paths = peft_model_with(base, TRAINED, tmp_path)
    model = fused_copy(base)
    ctx = ours_with(model, paths, packed=True)
    trainer = ctx.train_slots(list(TRAINED))
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def step_loss(input_ids, labels):
        return loss_of(model(input_ids), labels)

    model.train()
    names = list(TRAINED) + [None]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for M in (2, 7, 33):
            slots = [names[(3 * t) % len(names)] for t in range(M)]
            gen = torch.Generator().manual_seed(M)
            input_ids = torch.randint(0, VOCAB, (1, M), generator=gen)
            labels = torch.randint(0, VOCAB, (1, M), generator=gen)
            torch._dynamo.mark_dynamic(input_ids, 1)
            torch._dynamo.mark_dynamic(labels, 1)
            ctx.set_batch([(name, 1) for name in slots])
            step_loss(input_ids, labels).backward()
            compiled_grads = [p.grad.clone() for p in trainer.parameters()]
            for p in trainer.parameters():
                p.grad = None
            loss_of(model(input_ids), labels).backward()     # the same model, eagerly
            for got, want in zip(compiled_grads, [p.grad for p in trainer.parameters()]):
                assert rel_err(got, want) <= 1e-6, M
            for p in trainer.parameters():
                p.grad = None
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} compiles for 3 token counts"
    trainer.close()


def tiny_llama():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def slot_factors(ctx, slot, targeted_only=False):
    """{layer path: (lora_a[slot], lora_b[slot]) copied}; ``targeted_only``: the layers the slot's adapter targets
    (its A not all zero)."""
    return {path: (layer.lora_a[slot].clone(), layer.lora_b[slot].clone()) for path, layer in ctx.layers.items()
            if not targeted_only or layer.lora_a[slot].any()}


def assert_slot_moved(ctx, slot, before):
    """Both factors of ``slot`` differ from ``before`` (slot_factors) in every layer it holds."""
    for path, (a, b) in before.items():
        layer = ctx.layers[path]
        assert not torch.equal(layer.lora_a[slot], a) and not torch.equal(layer.lora_b[slot], b), (path, slot)


def assert_slot_kept(ctx, slot, before):
    """Both factors of ``slot`` equal ``before`` (slot_factors) in every layer."""
    for path, (a, b) in before.items():
        layer = ctx.layers[path]
        assert torch.equal(layer.lora_a[slot], a) and torch.equal(layer.lora_b[slot], b), (path, slot)


def train_a_little(model, ctx, names, rows, vocab, steps=3):
    """A few AdamW steps on ``rows``; every adapter of ``names`` then differs in each layer it targets, A and B
    (else a saving test would compare the adapter loaded with itself, and pass whatever training did)."""
    before = {ctx.slot_of(name): slot_factors(ctx, ctx.slot_of(name), targeted_only=True) for name in names}
    trainer = ctx.train_slots(names)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=2e-2, weight_decay=0.01)
    model.train()
    for i in range(steps):
        gen = torch.Generator().manual_seed(100 + i)
        input_ids = torch.randint(0, vocab, (len(rows), SEQ), generator=gen)
        ctx.set_batch([(name, SEQ) for name in rows])
        out = model(input_ids)
        logits = getattr(out, "logits", out)
        loss_of(logits, torch.randint(0, vocab, (len(rows), SEQ), generator=gen)).backward()
        trainer.step(optimizer)
        optimizer.zero_grad()
    trainer.close()
    model.eval()
    for slot, factors in before.items():
        assert_slot_moved(ctx, slot, factors)


def assert_peft_reproduces(base, ctx, model, directory, name, input_ids):
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), directory, adapter_name=name).eval()
    ctx.set_batch([(name, input_ids.shape[1])] * input_ids.shape[0])
    with torch.no_grad():
        ours = model(input_ids)
        theirs = peft_model(input_ids)
        plain = base(input_ids)
    ours, theirs, plain = (getattr(t, "logits", t) for t in (ours, theirs, plain))
    assert rel_err(theirs, plain) > 1e-3, f"{name}: the trained adapter does nothing"
    assert rel_err(ours, theirs) <= TOL, f"{name}: PEFT does not reproduce our output"


def assert_reload_identical(ctx, name, directory):
    slot = ctx.slot_of(name)
    saved = {p: (layer.lora_a[slot].clone(), layer.lora_b[slot].clone(), layer.scale[slot].clone(),
                 layer.slot_ranks[slot]) for p, layer in ctx.layers.items()}
    load_peft_adapter(ctx, name, directory, replace=True)
    for p, layer in ctx.layers.items():
        a, b, scale, r = saved[p]
        assert torch.equal(layer.lora_a[slot], a) and torch.equal(layer.lora_b[slot], b), p
        assert layer.slot_ranks[slot] == r and rel_err(layer.scale[slot], scale) <= 1e-6, p


def test_trained_llama_adapters_round_trip_through_peft(tmp_path):
    base = tiny_llama()
    model = copy.deepcopy(base)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=8, max_tokens=64)
    gen = torch.Generator().manual_seed(5)
    training.add_trainable_adapter(ctx, "plain", r=4, lora_alpha=8, generator=gen)
    training.add_trainable_adapter(ctx, "rs", r=8, lora_alpha=5, use_rslora=True, generator=gen,
                                   target_modules=["q_proj", "v_proj", "down_proj"])
    train_a_little(model, ctx, ["plain", "rs"], ["plain", None, "rs", "plain"], vocab=128)
    input_ids = torch.randint(0, 128, (3, 6), generator=gen)
    for name in ("plain", "rs"):
        directory = save_peft_adapter(ctx, name, tmp_path / name)
        assert_peft_reproduces(base, ctx, model, directory, name, input_ids)
        assert_reload_identical(ctx, name, directory)


def nested_net():
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), inner, torch.nn.Linear(8, 8))


def test_saved_patterns_match_their_own_module_alone(tmp_path):
    """Module paths where one ends another ("0" and "2.0"): a path's rank_pattern / alpha_pattern key must not
    also claim the longer path (PEFT matches keys as dotted suffixes, first key wins), so the directory
    reloads here and in PEFT at every module's own rank and alpha."""
    paths, ranks = ["0", "2.0", "2.2", "3"], [2, 4, 4, 4]
    model = nested_net()
    ctx = apply_lora(model, paths, max_loras=2, max_rank=8, max_tokens=16)
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for path, r in zip(paths, ranks):
        tensors[f"{path}.lora_A.weight"] = torch.randn(r, 8, generator=gen)
        tensors[f"{path}.lora_B.weight"] = torch.randn(8, r, generator=gen)
    ctx.load_adapter_tensors("a", tensors, {"r": 4, "lora_alpha": 8, "rank_pattern": {"^0": 2},
                                            "alpha_pattern": {"^0": 3}})
    directory = save_peft_adapter(ctx, "a", tmp_path / "a")
    saved = json.load(open(os.path.join(directory, "adapter_config.json")))
    assert saved["r"] == 4 and len(saved["rank_pattern"]) == 1 and len(saved["alpha_pattern"]) == 1, saved
    assert_reload_identical(ctx, "a", directory)
    x = torch.randn(3, 8, generator=gen)
    ctx.set_batch([("a", 3)])
    peft_model = peft.PeftModel.from_pretrained(nested_net(), directory).eval()
    with torch.no_grad():
        assert rel_err(model(x), peft_model(x)) <= TOL


@pytest.mark.parametrize("r", [0, -1, 2.7, True, "4"], ids=repr)
def test_fresh_adapter_names_a_bad_rank_and_takes_no_slot(r):
    """r must be an int >= 1 (2.7 was truncated to 2, -1 failed inside torch.empty); target_modules that select
    nothing are named; neither takes a slot."""
    ctx = apply_lora(toy_lm(seed=2), PROJECTIONS, max_loras=2, max_rank=8, max_tokens=16)
    with pytest.raises(ValueError, match=f"^r: expected an int >= 1, got {re.escape(repr(r))}$"):
        training.add_trainable_adapter(ctx, "a", r=r, lora_alpha=8)
    with pytest.raises(ValueError, match=r"^target_modules: \['nope'\] selects none of the context's modules"):
        training.add_trainable_adapter(ctx, "a", r=4, lora_alpha=8, target_modules=["nope"])
    assert not ctx.adapters and all(not layer.lora_a.any() for layer in ctx.layers.values())


def test_fresh_adapter_takes_all_linear_as_peft_does():
    """target_modules="all-linear" (PEFT's, and apply_lora's) was matched as a regex and refused as selecting
    nothing; it takes every module of the context but the output layer, as PEFT's does. A bare name as a string
    (a whole-path regex, as in PEFT) selects nothing here, and the message says how to name the modules."""
    model = toy_lm(seed=2)
    ctx = apply_lora(model, [*PROJECTIONS, "lm_head"], max_loras=2, max_rank=8, max_tokens=16)
    slot = training.add_trainable_adapter(ctx, "a", r=4, lora_alpha=8, target_modules="all-linear")
    held = {path for path, layer in ctx.layers.items() if layer.lora_a[slot].any()}
    assert held == set(ctx.layers) - {"lm_head"} and len(held) == len(PROJECTIONS) * 2
    assert ctx.adapter_configs[slot]["target_modules"] == sorted(PROJECTIONS)
    # Whole paths: a module at "proj" does not select the output layer at "head.proj" (session 54's review).
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4),
                                 "head": torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4)})})
    model.get_output_embeddings = lambda: model["head"]["proj"]
    small = apply_lora(model, ["proj"], max_loras=1, max_rank=2, max_tokens=4)
    slot = training.add_trainable_adapter(small, "a", r=2, lora_alpha=2, target_modules="all-linear")
    assert small.layers["proj"].lora_a[slot].any() and not small.layers["head.proj"].lora_a[slot].any()
    with pytest.raises(ValueError, match=r"'q_proj' selects none of the context's modules \(a string is a regex "
                                         r"that must match a whole module path.*pass a list: \['q_proj'\]\)"):
        training.add_trainable_adapter(ctx, "b", r=4, lora_alpha=8, target_modules="q_proj")


def test_fresh_adapter_is_peft_initialised_and_reproducible():
    """add_trainable_adapter as PEFT's LoraConfig: scale lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)), A uniform
    in +-1/sqrt(in_features) (nn.Linear's kaiming-uniform bound, nearly reached by this many draws), B zero; with
    a generator the same A whatever the global seed. (The round trip through PEFT cannot tell: a wrong scale or
    init is saved, and reloaded, as it was made.)"""
    model = toy_lm(seed=2)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=8, max_tokens=64)
    torch.manual_seed(0)
    rs = training.add_trainable_adapter(ctx, "rs", r=8, lora_alpha=5, use_rslora=True,
                                        generator=torch.Generator().manual_seed(5))
    plain = training.add_trainable_adapter(ctx, "plain", r=4, lora_alpha=8)
    for path, layer in ctx.layers.items():
        assert layer.scale[rs].item() == pytest.approx(5 / 8 ** 0.5) and layer.scale[plain].item() == 2.0, path
        bound = layer.in_features ** -0.5
        for slot, r in ((rs, 8), (plain, 4)):
            a = layer.lora_a[slot, :, :r].abs()
            assert 0.9 * bound < a.max() <= bound and a.min() > 0, path
            assert not layer.lora_b[slot].any(), path
    torch.manual_seed(123)     # another global seed: the generator alone decides A
    again = training.add_trainable_adapter(ctx, "rs_again", r=8, lora_alpha=5, use_rslora=True,
                                           generator=torch.Generator().manual_seed(5))
    for path, layer in ctx.layers.items():
        assert torch.equal(layer.lora_a[again], layer.lora_a[rs]), path


def test_packed_slices_saved_per_projection(tmp_path):
    """A fused model's adapter (per-slice ranks and alphas: padded and folded in the slot) is saved as
    per-projection modules that PEFT loads on the unfused model and reproduces."""
    unfused = toy_lm(seed=4)
    adapters = {"p": dict(r=4, lora_alpha=8, rank_pattern={"k_proj": 2}, alpha_pattern={"v_proj": -3})}
    _, paths = peft_model_with(unfused, adapters, tmp_path / "in")
    fused = fused_copy(unfused)
    ctx = ours_with(fused, paths, packed=True)
    # (The slices' scales differ, folded into lora_B: the trainer warns that it trains the folded factor.)
    with pytest.warns(UserWarning, match=r"train_slots: adapter 'p' was loaded with different scales for the "
                                         r"slices of the packed layer\(s\) \['model.layers.0.self_attn.qkv_proj'"):
        train_a_little(fused, ctx, ["p"], ["p", None, "p"], vocab=VOCAB)
    directory = save_peft_adapter(ctx, "p", tmp_path / "out")
    input_ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(unfused), directory, adapter_name="p").eval()
    ctx.set_batch([("p", 5)] * 3)
    with torch.no_grad():
        assert rel_err(fused(input_ids), peft_model(input_ids)) <= TOL
    assert_reload_identical(ctx, "p", directory)


def test_adapter_of_packed_modules_trains_and_saves_as_those_modules(tmp_path):
    """An adapter PEFT trained on a fused model's packed modules (Phi-3's qkv_proj: one lora_A for all of q, k
    and v) loads a copy of that A into each slice. Each copy trained on its own slice's gradient: after one step
    the model was no longer PEFT's, and saving wrote rank 3r with a block-diagonal lora_B. The copies take the
    sum of the slices' gradients now, PEFT's gradient of the one A: trained alike, ours and PEFT's models agree,
    and the adapter is saved under the packed modules at its rank, which PEFT on that model loads."""
    fused = fused_copy(toy_lm(seed=4))
    torch.manual_seed(7)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv_proj", "gate_up_proj", "o_proj"],
                             init_lora_weights=False)
    peft_model = peft.get_peft_model(copy.deepcopy(fused), config)
    peft_model.save_pretrained(tmp_path / "in")
    model = copy.deepcopy(fused)
    ctx = ours_with(model, {"f": str(tmp_path / "in")}, packed=True)
    rows = ["f", None, "f"]
    trainer = ctx.train_slots(["f"])
    ours = torch.optim.AdamW(trainer.parameters(), lr=2e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-2, weight_decay=0.01)
    model.train()
    peft_model.train()
    for i in range(3):     # the row without the adapter gives it no gradient: PEFT trains on the other two
        gen = torch.Generator().manual_seed(100 + i)
        input_ids = torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen)
        ctx.set_batch([(name, SEQ) for name in rows])
        loss_of(model(input_ids), labels).backward()
        keep = torch.tensor([r is not None for r in rows])
        loss_of(peft_model(input_ids[keep]), labels[keep]).backward()
        # Clipped: the norm counts the fused module's A once, as PEFT's does (each slice's copy counted it).
        norms = [torch.nn.utils.clip_grad_norm_(params, 0.5) for params in
                 (trainer.parameters(), [p for p in peft_model.parameters() if p.requires_grad])]
        assert rel_err(*norms) <= 1e-5, norms
        trainer.step(ours)
        theirs.step()
        ours.zero_grad()
        theirs.zero_grad()
    trainer.close()
    model.eval()
    peft_model.eval()
    input_ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    ctx.set_batch([("f", 5)] * 3)
    with torch.no_grad():
        assert rel_err(model(input_ids), peft_model(input_ids)) <= 1e-4
    for layer in ctx.layers.values():   # the slices' copies of A stayed equal
        a = layer.lora_a[ctx.slot_of("f")]
        assert all(torch.equal(a[0], a_i) for a_i in a[1:])
    directory = save_peft_adapter(ctx, "f", tmp_path / "trained")
    saved = json.load(open(os.path.join(directory, "adapter_config.json")))
    assert all(path.rsplit(".", 1)[-1] in ("qkv_proj", "gate_up_proj", "o_proj")
               for path in saved["target_modules"]), saved["target_modules"]
    assert saved["r"] == 2 and not saved["rank_pattern"], saved
    assert_peft_reproduces(fused, ctx, model, directory, "f", input_ids)
    assert_reload_identical(ctx, "f", directory)


def test_fresh_adapter_of_packed_modules_by_their_own_names_saves_as_those_modules(tmp_path):
    """add_trainable_adapter naming a packed layer itself (Phi-3's qkv_proj; the slices' names are the
    unpacked model's) makes one A for the module, trained tied and saved as that module: PEFT on the packed
    model loads it and reproduces ours. (target_modules=["qkv_proj"] selected nothing before; by default the
    slices' names were saved, which the packed model lacks: PEFT applied the rest of the adapter silently.)"""
    fused = fused_copy(toy_lm(seed=4))
    model = copy.deepcopy(fused)
    ctx = apply_lora(model, PROJECTIONS, max_loras=2, max_rank=8, max_tokens=64, packed_modules=PACKED)
    gen = torch.Generator().manual_seed(3)
    targets = ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"]
    training.add_trainable_adapter(ctx, "f", r=4, lora_alpha=8, target_modules=targets, generator=gen)
    slot = ctx.slot_of("f")
    for layer in ctx.layers.values():
        a = layer.lora_a[slot]
        assert all(torch.equal(a[0], a_i) for a_i in a[1:])       # one A over the slices
    train_a_little(model, ctx, ["f"], ["f", None, "f"], vocab=VOCAB)
    directory = save_peft_adapter(ctx, "f", tmp_path / "f")
    saved = json.load(open(os.path.join(directory, "adapter_config.json")))
    assert {path.rsplit(".", 1)[-1] for path in saved["target_modules"]} == set(targets), saved["target_modules"]
    input_ids = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(6))
    assert_peft_reproduces(fused, ctx, model, directory, "f", input_ids)
    assert_reload_identical(ctx, "f", directory)
    # The projections' names keep selecting the slices (the unpacked model's modules).
    training.add_trainable_adapter(ctx, "q", r=2, lora_alpha=2, target_modules=["q_proj"], generator=gen)
    qkv = next(layer for path, layer in ctx.layers.items() if path.endswith("qkv_proj"))
    ranks_of_q = qkv.lora_a[ctx.slot_of("q")].abs().sum(-1).ne(0).sum(-1)
    assert ranks_of_q.tolist() == [2, 0, 0]


def test_train_slots_takes_one_name_as_a_string():
    model = toy_lm(seed=2)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=4, max_tokens=64)
    for name in ("ab", "a", "b"):
        training.add_trainable_adapter(ctx, name, r=2, lora_alpha=2)
    with ctx.train_slots("ab") as trainer:        # the adapter "ab", not "a" and "b"
        assert trainer.slots == [ctx.slot_of("ab")]


def test_a_folded_adapter_loaded_into_a_trained_slot_warns(tmp_path):
    """train_slots warns of an adapter whose packed slices carry folded scales; loading one into a slot an open
    trainer trains (replace=True) warns alike."""
    unfused = toy_lm(seed=4)
    _, folded = peft_model_with(unfused, {"p": dict(r=4, lora_alpha=8, alpha_pattern={"v_proj": -3})},
                                tmp_path / "folded")
    _, plain = peft_model_with(unfused, {"p": dict(r=4, lora_alpha=8)}, tmp_path / "plain")
    fused = fused_copy(unfused)
    ctx = ours_with(fused, plain, packed=True)
    with ctx.train_slots(["p"]):
        with pytest.warns(UserWarning, match=r"load_adapter: adapter 'p' was loaded with different scales for the "
                                             r"slices of the packed layer\(s\)"):
            ctx.load_adapter("p", folded["p"], replace=True)


def _trainable_model(names, seed=9):
    model = toy_lm(seed=seed)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=4, max_tokens=64)
    gen = torch.Generator().manual_seed(seed)
    for name in names:
        training.add_trainable_adapter(ctx, name, r=4, lora_alpha=4, generator=gen)
        for layer in ctx.layers.values():     # non-zero B: the adapters' A get gradients too
            with torch.no_grad():
                layer.lora_b[ctx.slot_of(name)].normal_(generator=gen)
    return model, ctx


def _step(model, ctx, trainer, optimizer, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx.set_batch([(name, SEQ) for name in rows])
    loss_of(model(torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen)),
            torch.randint(0, VOCAB, (len(rows), SEQ), generator=gen)).backward()
    trainer.step(optimizer)
    optimizer.zero_grad()


def _moved(trainer, before):
    return sum(int((p != b).sum()) for p, b in zip(trainer.parameters(), before))


@pytest.mark.parametrize("how", ["set_once", "compiled_per_row"])
def test_every_step_trains_a_batch_not_set_since_the_last(fresh_dynamo, how):
    """The trainer counted only batches *set* since the last step: a batch set once and trained on for many
    steps moved at the first step only, and per_row's batches under torch.compile (built in the graph, no
    fill) never; every later step restored the update. A slot a backward gives a gradient now counts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32))
    ctx = apply_lora(model, ["0"], max_loras=2, max_rank=4, max_tokens=64)
    for name in ("a", "b"):
        training.add_trainable_adapter(ctx, name, r=4, lora_alpha=8)
    trainer = ctx.train_slots(["a", "b"])
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    x, target = torch.randn(2, 4, 16), torch.randn(2, 4, 32)
    forward = model
    if how == "set_once":
        ctx.set_batch([("a", 4), ("b", 4)])
    else:
        forward = torch.compile(model, fullgraph=True, backend="aot_eager")
    losses = []
    for _ in range(3):
        before = [p.detach().clone() for p in trainer.parameters()]
        if how == "set_once":
            loss = F.mse_loss(forward(x), target)
            loss.backward()
        else:
            with ctx.per_row(["a", "b"]):
                loss = F.mse_loss(forward(x), target)
                loss.backward()
        trainer.step(optimizer)
        optimizer.zero_grad()
        assert _moved(trainer, before) == 2 * (16 * 4 + 32 * 4), "a step restored the trained slots"
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]
    trainer.close()


def test_a_batch_set_before_the_trainer_opened_counts_only_if_trained():
    """A batch set under no_grad before train_slots (an evaluation) was noted as trained when the trainer
    opened: a chosen slot of it with no tokens in the batch trained moved by AdamW's weight decay."""
    model, ctx = _trainable_model(["a", "b"])
    ctx.set_batch([("b", SEQ)])
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, SEQ)))
    trainer = ctx.train_slots(["a", "b"])
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    a, b = ctx.slot_of("a"), ctx.slot_of("b")
    before_a, before_b = slot_factors(ctx, a), slot_factors(ctx, b)
    _step(model, ctx, trainer, optimizer, ["a", None], seed=1)
    assert_slot_kept(ctx, b, before_b)
    # ... while the slot the batch trained moved (a step that moved nothing would pass the above).
    assert_slot_moved(ctx, a, before_a)
    trainer.close()


@pytest.mark.parametrize("eval_set_batch", ["under_no_grad", "with_grad_on"])
def test_an_evaluation_between_steps_never_counts_as_training(eval_set_batch):
    """A server's evaluation: set_batch with grad mode on, then a forward under no_grad. Its slots were noted as
    trained at set_batch, and AdamW's weight decay and moments moved a chosen slot no batch trained (a PPO loop's
    old-logprob pass over every adapter moved them all at each minibatch step)."""
    model, ctx = _trainable_model(["a", "b"])
    trainer = ctx.train_slots(["a", "b"])
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    _step(model, ctx, trainer, optimizer, ["a", "b"], seed=1)      # both trained once: moments for both
    ctx.set_batch([("a", SEQ)])
    loss_of(model(torch.randint(0, VOCAB, (1, SEQ))), torch.randint(0, VOCAB, (1, SEQ))).backward()
    with torch.no_grad() if eval_set_batch == "under_no_grad" else torch.enable_grad():
        ctx.set_batch([("b", SEQ), ("a", SEQ)])
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (2, SEQ)))
    b = ctx.slot_of("b")
    before = slot_factors(ctx, b)
    a_before = [layer.lora_b[ctx.slot_of("a")].clone() for layer in ctx.layers.values()]
    trainer.step(optimizer)
    assert_slot_kept(ctx, b, before)
    assert not all(torch.equal(layer.lora_b[ctx.slot_of("a")], was) for layer, was in zip(ctx.layers.values(),
                                                                                          a_before))
    trainer.close()


def test_a_nan_in_a_served_slot_never_reaches_the_trained_ones():
    """The gradient mask multiplied: a NaN (or an overflow's inf) in the gradient of a slot only served, NaN
    times 0, stayed NaN, and gradient clipping's norm then made every trained slot NaN."""
    model, ctx = _trainable_model(["a", "b"])
    b = ctx.slot_of("b")
    with torch.no_grad():
        next(iter(ctx.layers.values())).lora_b[b, 0, 0] = float("nan")
    trainer = ctx.train_slots(["a"])
    optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    a = ctx.slot_of("a")
    before = slot_factors(ctx, a)
    ctx.set_batch([("a", SEQ), ("b", SEQ)])
    logits = model(torch.randint(0, VOCAB, (2, SEQ)))
    loss_of(logits[:1], torch.randint(0, VOCAB, (1, SEQ))).backward()    # b's row out of the loss: finite
    grads = [p.grad for p in trainer.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.isfinite(torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0))
    trainer.step(optimizer)
    for path, layer in ctx.layers.items():
        assert torch.isfinite(layer.lora_a[a]).all() and torch.isfinite(layer.lora_b[a]).all(), path
    assert_slot_moved(ctx, a, before)       # (a step restoring everything is finite too)
    trainer.close()


def test_a_copy_of_a_model_in_training_has_no_trainer():
    """copy.deepcopy with a trainer open gave the copy a trainer without its gradient hooks (the copy's
    gradients unmasked) that refused a new train_slots; the copy now starts with none, the original trains on."""
    model, ctx = _trainable_model(["a", "b"])
    trainer = ctx.train_slots(["a"])
    copied = copy.deepcopy(model)
    copy_ctx = next(m for m in copied.modules() if hasattr(m, "context")).context
    assert copy_ctx is not ctx and copy_ctx.trainer is None
    # Its stacks frozen, as without a trainer (they kept requires_grad, taking gradients into every slot with no
    # hook to mask them: session 45's audit); the original's stay trainable.
    assert all(not s.requires_grad and s.grad is None for layer in copy_ctx.layers.values()
               for s in (layer.lora_a, layer.lora_b))
    assert all(s.requires_grad for layer in ctx.layers.values() for s in (layer.lora_a, layer.lora_b))
    with copy_ctx.train_slots(["b"]) as copy_trainer:
        copy_ctx.set_batch([("a", SEQ), ("b", SEQ)])
        loss_of(copied(torch.randint(0, VOCAB, (2, SEQ))), torch.randint(0, VOCAB, (2, SEQ))).backward()
        a = copy_ctx.slot_of("a")
        assert all(not layer.lora_b.grad[a].any() for layer in copy_ctx.layers.values())
        assert copy_trainer.slots == [copy_ctx.slot_of("b")]
    assert ctx.trainer is trainer
    trainer.close()


def _two_layer_trainer(trained=("a", "b")):
    """Two layers (called on their own tokens, as a router calls experts), adapters "a" and "b" (non-zero B), a
    trainer of ``trained`` open."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"e0": torch.nn.Linear(8, 16), "e1": torch.nn.Linear(8, 16)})
    ctx = apply_lora(model, ["e0", "e1"], max_loras=2, max_rank=4, max_tokens=16)
    gen = torch.Generator().manual_seed(1)
    for name in ("a", "b"):
        training.add_trainable_adapter(ctx, name, r=4, lora_alpha=8, generator=gen)
    with torch.no_grad():
        for layer in ctx.layers.values():
            layer.lora_b.normal_(generator=gen)
    return model, ctx, ctx.train_slots(list(trained))


def _expert_step(model, ctx, trainer, optimizer, routes, check_grads=lambda: None):
    """One step: layer ``path`` of ``routes`` takes tokens of the adapters it lists (``check_grads`` called
    before the optimizer's step)."""
    loss = 0
    for path, names in routes.items():
        ctx.set_token_slots(torch.tensor([ctx.slot_of(n) for n in names], dtype=torch.int32))
        loss = loss + model[path](torch.randn(len(names), 8)).square().sum()
    loss.backward()
    check_grads()
    trainer.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def test_a_layer_no_token_of_a_slot_reached_keeps_that_slot():
    """A trained slot whose tokens all skipped a layer this step (an expert its router did not pick) was moved
    there by weight decay: the trainer noted one "had a gradient" flag per slot for the whole model. With its
    own optimizer that expert never ran for the adapter (no gradient, no decay); the flag is per layer now."""
    model, ctx, trainer = _two_layer_trainer()
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1, weight_decay=0.5)
    a, b = ctx.slot_of("a"), ctx.slot_of("b")
    before = slot_factors(ctx, a), slot_factors(ctx, b)
    _expert_step(model, ctx, trainer, optimizer, {"e0": ["a", "b"], "e1": ["b", "b"]})
    assert_slot_kept(ctx, a, {"e1": before[0]["e1"]})
    assert_slot_moved(ctx, a, {"e0": before[0]["e0"]})
    assert_slot_moved(ctx, b, before[1])
    trainer.close()


@pytest.mark.parametrize("how", ["load_state_dict_assign", "conversion_overwriting_params",
                                 "conversion_swapping_params", "by_hand"])
def test_an_open_trainer_follows_stacks_a_load_or_conversion_replaced(how):
    """load_state_dict(assign=True) (resuming from torch.load(..., mmap=True)) and a dtype round trip under
    torch's overwrite_module_params_on_conversion replace the stacks: the replacements had none of the trainer's
    gradient hooks, every slot took gradients unmasked and step(), seeing none trained, restored all of them
    (training did nothing, silently). The trainer now follows them; a stack replaced by hand is named at step().
    A swapping conversion keeps the objects and swaps their contents, and the hooks went with the old contents.
    An optimizer built before the stacks were replaced steps the old ones: step() names it."""
    model, ctx, trainer = _two_layer_trainer(["a"])
    old = model["e1"].lora_a
    if how == "load_state_dict_assign":
        stale = torch.optim.SGD(trainer.parameters(), lr=0.1)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        with pytest.raises(RuntimeError, match=r"the optimizer holds LoRA stacks that load_state_dict\(assign=True\) "
                                               r"or a conversion replaced"):
            trainer.step(stale)
    elif how.startswith("conversion"):
        switch = (torch.__future__.set_swap_module_params_on_conversion if how == "conversion_swapping_params"
                  else torch.__future__.set_overwrite_module_params_on_conversion)
        switch(True)
        try:
            model.to(torch.float64).to(torch.float32)
        finally:
            switch(False)
    else:
        model["e1"].lora_a = torch.nn.Parameter(old.detach().clone())
    assert (model["e1"].lora_a is old) == (how == "conversion_swapping_params")
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    a, b = ctx.slot_of("a"), ctx.slot_of("b")
    before = slot_factors(ctx, a), slot_factors(ctx, b)
    if how == "by_hand":
        with pytest.raises(RuntimeError, match=r"layer 'e1''s lora_a was replaced since the trainer opened"):
            _expert_step(model, ctx, trainer, optimizer, {"e0": ["a", "a"], "e1": ["a", "a"]})
        trainer.follow_stacks(model["e1"])
        optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
        optimizer.zero_grad(set_to_none=True)

    def b_masked():
        assert all(not layer.lora_b.grad[b].any() for layer in ctx.layers.values()), "b's gradients not masked"

    _expert_step(model, ctx, trainer, optimizer, {"e0": ["a", "b"], "e1": ["a", "b"]}, b_masked)
    assert_slot_moved(ctx, a, before[0])
    assert_slot_kept(ctx, b, before[1])
    trainer.close()
    assert not any(s.requires_grad for layer in ctx.layers.values() for s in (layer.lora_a, layer.lora_b))


def test_a_second_contexts_trainer_leaves_the_first_ones_stacks_trainable():
    """Two contexts in one model (an encoder's, and the whole model's for the decoder), each training its own
    adapter: the second train_slots froze the whole model, the first trainer's stacks included, and its adapter
    got no gradient, silently. freeze_base freezes every parameter but the LoRA stacks (and, with the model
    collected, the context's bases)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"enc": torch.nn.Sequential(torch.nn.Linear(8, 8)), "dec": torch.nn.Linear(8, 8)})
    enc = apply_lora(model["enc"], "all-linear", max_loras=2, max_rank=2, max_tokens=16)
    dec = apply_lora(model, ["dec"], max_loras=2, max_rank=2, max_tokens=16)
    for ctx, name in ((enc, "e"), (dec, "d")):
        training.add_trainable_adapter(ctx, name, r=2, lora_alpha=2)
        for layer in ctx.layers.values():
            with torch.no_grad():
                layer.lora_b.normal_()
    first, second = enc.train_slots(["e"]), dec.train_slots(["d"])
    assert all(p.requires_grad for p in first.parameters() + second.parameters())
    assert not any(p.requires_grad for p in (model["enc"][0].base.weight, model["dec"].base.bias))
    enc.set_batch([("e", 4)])
    dec.set_batch([("d", 4)])
    x = torch.randn(4, 8)
    model["dec"](torch.tanh(model["enc"](x))).square().sum().backward()
    assert model["enc"][0].lora_b.grad[0].abs().sum() > 0 and model["dec"].lora_b.grad[0].abs().sum() > 0
    first.close()
    second.close()


def test_one_open_trainer_a_context():
    """A second train_slots while one was open raised nothing and zeroed every gradient (the two trainers'
    masks multiplied on the stacks); it now names the open one, and after close() a new one trains."""
    model, ctx = _trainable_model(["a", "b"])
    first = ctx.train_slots(["a"])
    with pytest.raises(RuntimeError, match=r"train_slots: a trainer of this context is open \(adapters \['a'\]\)"):
        ctx.train_slots(["b"])
    first.close()
    b = ctx.slot_of("b")
    with ctx.train_slots(["b"]) as second:
        ctx.set_batch([("b", SEQ)])
        loss_of(model(torch.randint(0, VOCAB, (1, SEQ))), torch.randint(0, VOCAB, (1, SEQ))).backward()
        assert all(layer.lora_b.grad[b].abs().sum() > 0 for layer in ctx.layers.values())
        assert second.slots == [b]
    assert ctx.trainer is None


def test_an_adapter_loaded_where_a_trained_one_was_unloaded_is_not_trained():
    """The trainer held slots by number: an adapter loaded into the slot of one unloaded during training was
    moved by the next step (the stack's AdamW moments and weight decay), though never chosen."""
    model, ctx = _trainable_model(["a", "c"])
    trainer = ctx.train_slots(["a", "c"])
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
    model.train()
    _step(model, ctx, trainer, optimizer, ["a", "c", None], seed=1)
    slot = ctx.slot_of("c")
    ctx.unload_adapter("c")
    assert ctx.load_adapter_tensors("e", peft_tensors(module_shapes(model), 2, seed=3)) == slot
    before = slot_factors(ctx, slot)
    a_before = next(iter(ctx.layers.values())).lora_b[ctx.slot_of("a")].clone()
    _step(model, ctx, trainer, optimizer, ["a", "e"], seed=2)
    assert_slot_kept(ctx, slot, before)
    assert not torch.equal(next(iter(ctx.layers.values())).lora_b[ctx.slot_of("a")], a_before)
    trainer.close()


def test_per_slot_dropout_in_training_mode_only():
    """Each row's adapter input dropped at its adapter's lora_dropout, in training mode only, the base's input
    never. An adapter with p = 1 makes that exact: its adapter sees zeros, so in training mode its rows are the
    base model's bit for bit (a dropped base input would change them), and in evaluation they are not (a dropout
    applied in eval too would give the base model's there)."""
    model = toy_lm(seed=5)
    plain = copy.deepcopy(model)
    ctx = apply_lora(model, PROJECTIONS, max_loras=3, max_rank=4, max_tokens=64)
    gen = torch.Generator().manual_seed(8)
    training.add_trainable_adapter(ctx, "wet", r=4, lora_alpha=4, lora_dropout=0.5, generator=gen)
    training.add_trainable_adapter(ctx, "dry", r=4, lora_alpha=4, generator=gen)
    training.add_trainable_adapter(ctx, "soaked", r=4, lora_alpha=4, lora_dropout=1.0, generator=gen)
    for layer in ctx.layers.values():     # non-zero B, so the adapters' inputs matter
        with torch.no_grad():
            layer.lora_b.normal_(generator=gen)
    trainer = ctx.train_slots(["wet", "dry", "soaked"])
    input_ids = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    ctx.set_batch([("wet", SEQ), ("dry", SEQ), (None, SEQ), ("soaked", SEQ)])
    model.eval()
    with torch.no_grad():
        clean = model(input_ids)
        base_out = plain(input_ids)
    assert rel_err(clean[3], base_out[3]) > 1e-2, "in evaluation, the p=1 adapter's rows saw dropout"
    model.train()
    torch.manual_seed(0)
    dropped = model(input_ids).detach()
    assert rel_err(dropped[0], clean[0]) > 1e-2, "the p=0.5 adapter's rows saw no dropout"
    assert rel_err(dropped[1:3], clean[1:3]) <= 1e-6, "rows of a p=0 adapter or no adapter changed"
    assert torch.equal(dropped[3], base_out[3]), "the p=1 adapter's rows are not the base model's"
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    compiled_dropped = compiled(input_ids)          # training mode: the dropout compiles too
    assert rel_err(compiled_dropped[0], clean[0]) > 1e-2
    assert rel_err(compiled_dropped[1:3], clean[1:3]) <= 1e-6 and counter.frame_count == 1
    assert torch.equal(compiled_dropped[3], base_out[3])
    x = torch.randn(4000, 8, generator=gen)
    slots = torch.tensor([0, 1, -1, 0] * 1000, dtype=torch.int32)
    out = training.slot_dropout(x, ctx.dropout_p, slots)
    assert torch.equal(out[slots != 0], x[slots != 0])
    kept = out[slots == 0] != 0
    assert abs(kept.float().mean().item() - 0.5) < 0.03
    assert rel_err(out[slots == 0][kept], 2 * x[slots == 0][kept]) <= 1e-7
    trainer.close()
    assert ctx.dropout_p is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_slot_dropout_drops_at_its_probability_in_every_dtype(dtype):
    """Each slot's rows dropped at its p, kept rows scaled by 1 / (1 - p) in float32 and rounded once: in bfloat16
    too, where a draw in that dtype against p rounded to it dropped p = 0.05 at ~0.052 (2.6 million draws: std
    ~1.4e-4) and the factor rounded to bfloat16 scaled ~0.2% off."""
    torch.manual_seed(0)
    x = torch.randn(2 ** 16, 40).to(dtype)
    slots = torch.tensor([0, 1, -1, 0], dtype=torch.int32).repeat(2 ** 14)
    out = training.slot_dropout(x, torch.tensor([0.05, 0.0, 0.0]), slots)
    assert out.dtype == dtype and torch.equal(out[slots != 0], x[slots != 0])
    dropped = out[slots == 0] == 0
    assert abs(dropped.double().mean().item() - 0.05) < 6e-4
    factor = 1.0 / (1.0 - torch.tensor(0.05))         # (float32)
    assert torch.equal(out[slots == 0][~dropped], (x[slots == 0][~dropped].float() * factor).to(dtype))


def test_dropout_follows_adapters_loaded_while_a_trainer_is_open():
    """The per-slot dropout table is rebuilt as adapters are loaded, replaced and unloaded under an open
    trainer (it was built once when the trainer opened: a replacement's lora_dropout went unused), in place
    while a table is needed (compiled code reads that tensor)."""
    model = toy_lm(seed=5)
    ctx = apply_lora(model, PROJECTIONS, max_loras=2, max_rank=4, max_tokens=64)
    gen = torch.Generator().manual_seed(8)
    training.add_trainable_adapter(ctx, "a", r=4, lora_alpha=4, generator=gen)
    trainer = ctx.train_slots(["a"])
    assert ctx.dropout_p is None
    tensors = peft_tensors(module_shapes(model), 4, seed=3)
    slot = ctx.load_adapter_tensors("a", tensors, {"r": 4, "lora_alpha": 4, "lora_dropout": 0.5}, replace=True)
    table = ctx.dropout_p
    assert table is not None and table.tolist() == [0.5 if s == slot else 0.0 for s in range(3)]
    other = ctx.load_adapter_tensors("b", tensors, {"r": 4, "lora_alpha": 4, "lora_dropout": 0.25})
    assert ctx.dropout_p is table and table[other].item() == 0.25
    ctx.unload_adapter("b")
    assert ctx.dropout_p is table and table.tolist() == [0.5 if s == slot else 0.0 for s in range(3)]
    ctx.load_adapter_tensors("a", tensors, {"r": 4, "lora_alpha": 4}, replace=True)
    assert ctx.dropout_p is table and not table.any()     # (zeros in place: a captured graph reads the tensor)
    trainer.close()
    assert ctx.dropout_p is None


def test_grad_scaler_steps_through_the_trainer():
    """trainer.step(optimizer, scaler): a torch.amp.GradScaler unscales (a power of two: the same update bit for
    bit as without it) and skips the step where a gradient is inf, every stack then unchanged."""
    from test_batch_copies import BATCHES, inputs, make_model
    stacks = {}
    for use_scaler in (False, True):
        model, ctx, trainer = make_model()
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.1)
        scaler = torch.amp.GradScaler(torch.device(DEVICE).type, init_scale=2.0 ** 8) if use_scaler else None
        initial = [p.detach().clone() for p in trainer.parameters()]
        x, w = inputs(0)
        ctx.set_batch(BATCHES[0])
        loss = (model(x) * w).sum()
        (scaler.scale(loss) if use_scaler else loss).backward()
        trainer.step(optimizer, scaler)
        stacks[use_scaler] = [p.detach().clone() for p in trainer.parameters()]
        if use_scaler:
            scaler.update()
            optimizer.zero_grad()
            ctx.set_batch(BATCHES[1])
            scaler.scale((model(inputs(1)[0]) * w).sum()).backward()
            trainer.parameters()[0].grad.view(-1)[0] = float("inf")
            trainer.step(optimizer, scaler)             # skipped: nothing moves
            for p, before in zip(trainer.parameters(), stacks[True]):
                assert torch.equal(p, before)
            scaler.update()
            assert scaler.get_scale() < 2.0 ** 8
        trainer.close()
    for a, b in zip(stacks[False], stacks[True]):
        assert torch.equal(a, b)
    assert all(not torch.equal(p, q) for p, q in zip(stacks[True], initial)), "the first step moved nothing"


def test_a_closure_steps_through_the_trainer():
    """trainer.step(optimizer, closure=...): LBFGS needs a closure (the step took none, and LBFGS raised torch's
    missing-argument TypeError). One chosen slot moves, the others stay bit for bit. LBFGS's line search couples
    every parameter: with more than one chosen slot it is refused (an adapter trained beside another moved by up
    to 8 against alone); a closure with a GradScaler is torch's refusal (it was passed by position, which
    GradScaler's check missed)."""
    from test_batch_copies import BATCHES, inputs, make_model
    model, ctx, trainer = make_model()
    trainer.close()
    trainer = ctx.train_slots(["a"])
    optimizer = torch.optim.LBFGS(trainer.parameters(), lr=0.1, max_iter=3)
    before = [p.detach().clone() for p in trainer.parameters()]
    x, w = inputs(0)
    ctx.set_batch(BATCHES[0])

    def closure():
        optimizer.zero_grad()
        loss = (model(x) * w).sum()
        loss.backward()
        return loss
    loss = trainer.step(optimizer, closure=closure)
    assert isinstance(loss, torch.Tensor) and torch.isfinite(loss)
    a = ctx.slot_of("a")
    for p, q in zip(trainer.parameters(), before):
        assert not torch.equal(p[a], q[a])
        others = [s for s in range(p.shape[0]) if s != a]
        assert torch.equal(p[others], q[others])
    scaler = torch.amp.GradScaler(torch.device(DEVICE).type)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
        trainer.step(optimizer, scaler, closure=closure)
    trainer.close()
    trainer = ctx.train_slots(["a", "b"])
    with pytest.raises(TypeError, match=r"SlotTrainer.step: LBFGS's line search couples every parameter"):
        trainer.step(torch.optim.LBFGS(trainer.parameters()), closure=closure)
    trainer.close()


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch without Adafactor")
def test_adafactor_is_refused():
    """Adafactor scales each update by the whole parameter's RMS: other slots' weights in the stack changed the
    trained slot's steps (1.4e-2 off PEFT trained alone; 8.6e-2 once a frozen slot's A was scaled), silently."""
    from test_batch_copies import make_model
    _, _, trainer = make_model()
    optimizer = torch.optim.Adafactor(trainer.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match=r"SlotTrainer.step: torch.optim.Adafactor scales each update by "
                                        r"the whole parameter's RMS"):
        trainer.step(optimizer)
    transformers = pytest.importorskip("transformers")
    optimizer = transformers.optimization.Adafactor(trainer.parameters(), lr=1e-2, relative_step=False)
    with pytest.raises(TypeError, match=r"SlotTrainer.step: transformers.optimization.Adafactor scales"):
        trainer.step(optimizer)
    trainer.close()
