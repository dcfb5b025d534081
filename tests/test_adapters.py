"""Adapters into slots: PEFT directories and in-memory tensors, unload, in-place writes, and every error.

Loaded values are checked exactly in the stacks (fp32 stacks hold the file's values bit for bit, padded
rank columns zero). Scales and ranks under rank_pattern / alpha_pattern / rsLoRA are checked against
PEFT's own layers. Every failed load must leave every slot byte-identical (tests/layer_helpers.slot_state).
"""
import copy
import math
import os
import pickle
import re

import pytest
import torch
from torch import nn

from layer_helpers import (PACKED, PROJECTIONS, assert_state_unchanged, data_ptrs, fused_copy, linear_paths,
                           lora_config, module_shapes, peft_tensors, slot_state, toy_lm, write_adapter_dir)
from lora_ops.adapters import AdapterError, UnsupportedAdapterError, read_peft_directory
from lora_ops.layers import apply_lora

MAX_RANK, MAX_LORAS = 8, 3
Q0 = "model.layers.0.self_attn.q_proj"


def lora_model(max_loras=MAX_LORAS, targets=PROJECTIONS):
    model = toy_lm()
    ctx = apply_lora(model, targets, max_loras=max_loras, max_rank=MAX_RANK, max_tokens=16)
    return model, ctx


def stored(layer, slot, slice_index=0):
    """(A [rank, K], B [n, rank], padded A rows, padded B columns) of a slot as written."""
    r = layer.slot_ranks[slot]
    lo, hi = layer.slice_offsets[slice_index], layer.slice_offsets[slice_index + 1]
    a = layer.lora_a[slot, slice_index]
    b = layer.lora_b[slot, lo:hi]
    return a[:r], b[:, :r], a[r:], b[:, r:]


def assert_loaded(ctx, slot, tensors, scale, prefix="base_model.model."):
    for path, layer in ctx.layers.items():
        a, b, a_pad, b_pad = stored(layer, slot)
        want_a = tensors[f"{prefix}{path}.lora_A.weight"]
        want_b = tensors[f"{prefix}{path}.lora_B.weight"]
        assert layer.slot_ranks[slot] == layer.rank[slot].item() == want_a.shape[0]
        assert torch.equal(a, want_a) and torch.equal(b, want_b), path
        assert not a_pad.any() and not b_pad.any(), f"{path}: padded rank must be zero"
        assert layer.scale[slot].item() == pytest.approx(scale, rel=1e-7)


# ---- loading -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_rslora", [False, True], ids=["alpha_over_r", "rslora"])
def test_load_peft_directory(tmp_path, use_rslora):
    model, ctx = lora_model()
    tensors = peft_tensors(module_shapes(model), rank=4, seed=1)
    path = write_adapter_dir(tmp_path / "sql", lora_config(4, 6, use_rslora=use_rslora), tensors)
    assert ctx.load_adapter("sql", path) == 0
    assert ctx.adapters == {"sql": 0}
    assert_loaded(ctx, 0, tensors, 6 / math.sqrt(4) if use_rslora else 6 / 4)
    for layer in ctx.layers.values():       # the other slots stay empty
        assert layer.slot_ranks[1:] == [0, 0] and not layer.lora_a[1:].any()


def test_load_in_memory_tensors_with_and_without_prefix():
    model, ctx = lora_model()
    plain = peft_tensors(module_shapes(model), rank=3, seed=2, prefix="")
    assert ctx.load_adapter_tensors("plain", plain, {"r": 3, "lora_alpha": 9}) == 0
    assert_loaded(ctx, 0, plain, 3.0, prefix="")
    # No config: each module at its tensors' rank, scale 1; bf16 tensors cast to the layer's dtype.
    half = peft_tensors(module_shapes(model), rank=5, seed=3, dtype=torch.bfloat16)
    assert ctx.load_adapter_tensors("half", half) == 1
    assert_loaded(ctx, 1, {k: v.float() for k, v in half.items()}, 1.0)


def test_peft_lora_config_object_is_accepted():
    peft = pytest.importorskip("peft")
    model, ctx = lora_model()
    tensors = peft_tensors(module_shapes(model), rank=4, seed=4)
    ctx.load_adapter_tensors("cfg", tensors, peft.LoraConfig(r=4, lora_alpha=2, target_modules=PROJECTIONS))
    assert_loaded(ctx, 0, tensors, 0.5)


def test_adapter_targeting_some_modules_leaves_others_at_rank_zero():
    model, ctx = lora_model()
    tensors = peft_tensors(module_shapes(model, ["v_proj"]), rank=2, seed=5)
    ctx.load_adapter_tensors("v_only", tensors, {"r": 2, "lora_alpha": 4})
    for path, layer in ctx.layers.items():
        assert layer.slot_ranks[0] == (2 if path.endswith("v_proj") else 0)


def test_replacing_with_an_adapter_of_fewer_modules_clears_the_others():
    """replace=True with an adapter that targets fewer modules than the one it replaces: the modules it leaves
    out go to rank 0 with zero factors in that slot, so the old adapter's weights do not keep serving under the
    new one's name (a fresh slot, as above, is empty whether or not the load clears it)."""
    model, ctx = lora_model()
    config = {"r": 2, "lora_alpha": 4}
    slot = ctx.load_adapter_tensors("a", peft_tensors(module_shapes(model, PROJECTIONS), rank=2, seed=4), config)
    assert all(layer.slot_ranks[slot] == 2 for layer in ctx.layers.values())
    assert ctx.load_adapter_tensors("a", peft_tensors(module_shapes(model, ["v_proj"]), rank=2, seed=5), config,
                                    replace=True) == slot
    for path, layer in ctx.layers.items():
        if path.endswith("v_proj"):
            assert layer.slot_ranks[slot] == 2 and layer.lora_a[slot].any()
            continue
        assert layer.slot_ranks[slot] == 0 and int(layer.rank[slot]) == 0 and float(layer.scale[slot]) == 0.0
        assert not layer.lora_a[slot].any() and not layer.lora_b[slot].any(), path


@pytest.mark.filterwarnings("ignore:The following alpha_pattern keys did not match")   # PEFT agrees: 'proj'
def test_rank_and_alpha_patterns_follow_peft(tmp_path):
    """Per-module rank and scale under rank_pattern / alpha_pattern (suffix keys and regex keys, first
    match wins), and under rsLoRA, equal those of PEFT's own layers for the same config."""
    peft = pytest.importorskip("peft")
    cases = [
        dict(r=4, lora_alpha=8, rank_pattern={"v_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
             alpha_pattern={r"layers\.0\.self_attn\.(q|k)_proj": 3, "q_proj": 5}),
        # "proj" ends no module path at a dotted boundary (a search would match them all).
        dict(r=6, lora_alpha=4, use_rslora=True, rank_pattern={"gate_proj": 3}, alpha_pattern={"proj": 7}),
    ]
    for i, kwargs in enumerate(cases):
        peft_model = peft.get_peft_model(toy_lm(), peft.LoraConfig(target_modules=PROJECTIONS, **kwargs))
        peft_model.save_pretrained(tmp_path / f"case{i}")
        model, ctx = lora_model()
        ctx.load_adapter("p", tmp_path / f"case{i}")
        checked = set()
        for path, peft_layer in peft_model.base_model.model.named_modules():
            if path in ctx.layers:
                layer = ctx.layers[path]
                assert layer.slot_ranks[0] == peft_layer.r["default"], path
                assert layer.scale[0].item() == pytest.approx(peft_layer.scaling["default"], rel=1e-7), path
                checked.add((layer.slot_ranks[0], layer.scale[0].item()))
        assert len(checked) >= 2, "the patterns must give modules different ranks or scales"


def test_fan_in_fan_out_loads_factors_as_stored(tmp_path):
    """PEFT stores lora_A [r, in] and lora_B [out, r] whatever fan_in_fan_out says (the flag is about the
    base weight's layout): they load unchanged, with shapes checked (GPT-2 parity: test_peft_parity)."""
    model, ctx = lora_model()
    tensors = peft_tensors(module_shapes(model), rank=4, seed=6)
    ctx.load_adapter("f", write_adapter_dir(tmp_path / "f", lora_config(4, 4, fan_in_fan_out=True), tensors))
    assert_loaded(ctx, 0, tensors, 1.0)


def test_legacy_bin_loads_with_weights_only(tmp_path):
    model, ctx = lora_model()
    tensors = peft_tensors(module_shapes(model), rank=4, seed=7)
    path = write_adapter_dir(tmp_path / "old", lora_config(4, 8), tensors, fmt="bin")
    ctx.load_adapter("old", path)
    assert_loaded(ctx, 0, tensors, 2.0)


def test_safetensors_is_preferred_over_bin(tmp_path):
    model, ctx = lora_model()
    good = peft_tensors(module_shapes(model), rank=4, seed=8)
    path = write_adapter_dir(tmp_path / "both", lora_config(4, 4), good)
    torch.save({"not": torch.zeros(1)}, os.path.join(path, "adapter_model.bin"))
    ctx.load_adapter("both", path)
    assert_loaded(ctx, 0, good, 1.0)


@pytest.mark.parametrize("which", [0, -1], ids=["first_layer", "last_layer"])
@pytest.mark.parametrize("stack", ["lora_a", "lora_b"])
def test_loads_refuse_a_parametrized_stack(stack, which):
    """A parametrized lora_b reads as the parametrization's computed tensor: loads and unloads wrote there and
    were lost, and the slot served the previous adapter's factors under the new name. On the last layer too:
    every layer is checked before the first write."""
    model, ctx = lora_model()
    ctx.load_adapter_tensors("old", _tensors(model, seed=1))

    class Clamp(nn.Module):
        def forward(self, t):
            return t.clamp(-10, 10)

    path, layer = list(ctx.layers.items())[which]
    torch.nn.utils.parametrize.register_parametrization(layer, stack, Clamp())
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=f"unload_adapter: {stack} of '{re.escape(path)}' is parametrized"):
        ctx.unload_adapter("old")
    with pytest.raises(AdapterError, match=f"{stack} of '{re.escape(path)}' is parametrized"):
        ctx.load_adapter_tensors("new", _tensors(model, seed=2))
    assert_state_unchanged(before, ctx)


def test_a_context_built_by_hand_says_it_has_no_layers():
    from lora_ops.layers import LoRAContext
    ctx = LoRAContext(max_loras=2, max_tokens=8)
    with pytest.raises(AdapterError, match=r"but this context serves no layers by path \(one built by hand"):
        ctx.load_adapter_tensors("a", peft_tensors({"proj": (8, 8)}, 2, seed=1, prefix=""))


def test_a_layer_replaced_after_apply_lora_is_named_and_nothing_is_written():
    """A wrapped layer replaced in the model (a block rebuilt or reloaded) stayed in the context: the load
    wrote the adapter into the old layer, listed it as loaded, and the model ran the new layer without it,
    silently. The load now names the path and writes nothing; with the layer put back it loads."""
    model, ctx = lora_model()
    old = model.model.layers[0].self_attn.q_proj
    model.model.layers[0].self_attn.q_proj = nn.Linear(old.in_features, old.out_features)
    tensors = peft_tensors(module_shapes(toy_lm()), 4, seed=3)
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=rf"the layer apply_lora wrapped at '{Q0}' is no longer in the model "
                                           rf"\(a Linear is there\).*ctx.layers\['{Q0}'\]"):
        ctx.load_adapter_tensors("a", tensors)
    assert not ctx.adapters
    assert_state_unchanged(before, ctx)
    model.model.layers[0].self_attn.q_proj = ctx.layers[Q0]
    assert_loaded(ctx, ctx.load_adapter_tensors("a", tensors), tensors, 1.0)


def test_an_adapter_of_a_multihead_attention_names_its_layer_type():
    """PEFT adapts a whole nn.MultiheadAttention (its in_proj, and its out_proj under the wrapper's base_layer):
    the load named 'attn.base_layer.out_proj' as not a module of the model, pointing at paths. It names the
    layer type, as for other unsupported layers, and writes nothing."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2, batch_first=True), "fc": nn.Linear(8, 4)})
    ctx = apply_lora(model, ["fc"], max_loras=2, max_rank=4, max_tokens=8)
    tensors = {**peft_tensors({"attn.base_layer.out_proj": (8, 8), "fc": (8, 4)}, 2, seed=1),
               **{f"base_model.model.attn.lora_{f}.weight": torch.randn(*shape)
                  for f, shape in (("A", (2, 8)), ("B", (24, 2)))}}
    before = slot_state(ctx)
    with pytest.raises(UnsupportedAdapterError, match=r"^layer type MultiheadAttention is not supported \(tensors: "
                                                      r"the adapter targets 'attn' as one module"):
        ctx.load_adapter_tensors("a", tensors)
    assert_state_unchanged(before, ctx)


def test_a_named_weights_file_is_the_one_read(tmp_path):
    """load_adapter(dir / "adapter_model.bin") in a folder holding both files read the safetensors file."""
    model, ctx = lora_model()
    good = peft_tensors(module_shapes(model), rank=4, seed=8)
    other = peft_tensors(module_shapes(model), rank=4, seed=18)
    path = write_adapter_dir(tmp_path / "both", lora_config(4, 4), other)
    torch.save(good, os.path.join(path, "adapter_model.bin"))
    ctx.load_adapter("bin", os.path.join(path, "adapter_model.bin"))
    assert_loaded(ctx, 0, good, 1.0)
    ctx.load_adapter("safetensors", os.path.join(path, "adapter_model.safetensors"))
    assert_loaded(ctx, 1, other, 1.0)


class _RunsCode:
    """A pickle payload that would create a marker file if unpickled by a full (unsafe) unpickler."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_code_is_refused(tmp_path):
    model, ctx = lora_model()
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil"
    write_adapter_dir(path, lora_config(4, 4), {})
    os.remove(path / "adapter_model.safetensors")
    tensors = peft_tensors(module_shapes(model), rank=4, seed=9)
    tensors["payload"] = _RunsCode(str(marker))
    with open(path / "adapter_model.bin", "wb") as f:
        pickle.dump(tensors, f, protocol=2)
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=r"refused by torch.load\(weights_only=True\)"):
        ctx.load_adapter("evil", path)
    assert not marker.exists(), "the pickle's code must never run"
    assert_state_unchanged(before, ctx)


# ---- unload, swap, in-place writes ---------------------------------------------------------------------

def test_unload_frees_the_slot_and_zeroes_it():
    """The freed slot is as one never loaded: factors zero, rank (device and host) and scale 0, and none of the
    context's per-slot records (the config save_peft_adapter and training read, the folded and fused layers);
    the other slot untouched, byte for byte."""
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 4, seed=1), {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1})
    ctx.load_adapter_tensors("b", peft_tensors(shapes, 4, seed=2))
    kept = slot_state(ctx)
    ctx.unload_adapter("a")
    assert ctx.adapters == {"b": 1}
    for layer in ctx.layers.values():
        assert layer.slot_ranks[0] == 0 and layer.rank[0] == 0 and layer.scale[0] == 0
        assert not layer.lora_a[0].any() and not layer.lora_b[0].any() and layer.lora_a[1].any()
    for record in ("adapter_configs", "adapter_folded_layers", "adapter_fused_sources"):
        assert 0 not in getattr(ctx, record) and getattr(ctx, record)[1] == kept[record][1], record
    for key, old in kept.items():
        if isinstance(old, torch.Tensor) and old.dim():
            assert torch.equal(old[1], slot_state(ctx)[key][1]), key
    assert ctx.load_adapter_tensors("c", peft_tensors(shapes, 2, seed=3)) == 0, "the freed slot is reused"
    with pytest.raises(ValueError, match=r"adapter 'a' is not loaded \(loaded: 'c', 'b'\)"):
        ctx.unload_adapter("a")


def test_an_adapter_loaded_into_a_freed_slot_does_not_serve_the_batch_set_before():
    """set_batch with "a", unload "a", load "c" (into a's slot), forward without a new set_batch: c served a's
    requests, silently. The unload moves the batch's tokens of that slot to no adapter; the others keep theirs."""
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 4, seed=1))
    ctx.load_adapter_tensors("b", peft_tensors(shapes, 4, seed=2))
    ctx.set_batch([("a", 3), ("b", 2), (None, 1)])
    ctx.unload_adapter("a")
    assert ctx.load_adapter_tensors("c", peft_tensors(shapes, 2, seed=3)) == 0
    assert ctx.token_slots[:6].tolist() == [-1, -1, -1, 1, 1, -1] and ctx.num_tokens == 6
    assert ctx.meta.slot_counts.tolist() == [0, 2, 0, 4]
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids)
        ctx.set_batch([(None, 3), ("b", 2), (None, 1)])
        assert torch.equal(got, model(ids))


def test_smaller_adapter_leaves_no_stale_weights():
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("big", peft_tensors(shapes, MAX_RANK, seed=1))
    ctx.unload_adapter("big")
    small = peft_tensors(shapes, 2, seed=2)
    ctx.load_adapter_tensors("small", small)
    assert_loaded(ctx, 0, small, 1.0)
    ctx.load_adapter_tensors("small", peft_tensors(shapes, MAX_RANK, seed=3), replace=True)
    smaller = peft_tensors(shapes, 1, seed=4)
    ctx.load_adapter_tensors("small", smaller, replace=True)
    assert_loaded(ctx, 0, smaller, 1.0)


def test_writes_never_move_data_pointers(tmp_path):
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ptrs = data_ptrs(ctx)
    ctx.load_adapter("a", write_adapter_dir(tmp_path / "a", lora_config(4, 8), peft_tensors(shapes, 4, seed=1)))
    ctx.load_adapter_tensors("b", peft_tensors(shapes, MAX_RANK, seed=2))
    ctx.load_adapter_tensors("a", peft_tensors(shapes, 2, seed=3), replace=True)
    ctx.unload_adapter("b")
    ctx.set_batch([("a", 3), (None, 2)])
    assert data_ptrs(ctx) == ptrs


@pytest.mark.parametrize("bad_module", [0, -1], ids=["first_module_bad", "last_module_bad"])
def test_replace_swaps_in_place_and_a_failed_replace_keeps_the_old_adapter(bad_module):
    """A failed replace keeps the old adapter whole, where the bad module comes first or last (checked after the
    others: every module is checked before the first write)."""
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("x", peft_tensors(shapes, 4, seed=1))
    ctx.load_adapter_tensors("y", peft_tensors(shapes, 4, seed=2))
    new = peft_tensors(shapes, 6, seed=3)
    assert ctx.load_adapter_tensors("x", new, {"r": 6, "lora_alpha": 3}, replace=True) == 0
    assert_loaded(ctx, 0, new, 0.5)
    before = slot_state(ctx)
    bad_path = list(shapes)[bad_module]
    bad = peft_tensors(shapes, 6, seed=4, rank_of=lambda path: MAX_RANK + 1 if path == bad_path else 6)
    with pytest.raises(AdapterError, match="exceeds the layer's capacity"):
        ctx.load_adapter_tensors("x", bad, replace=True)
    assert_state_unchanged(before, ctx)


@pytest.mark.parametrize("replace", [False, True], ids=["new_slot", "replace"])
@pytest.mark.parametrize("config", [dict(lora_alpha=1e40), dict(lora_alpha=1e39, use_rslora=True)],
                         ids=["alpha_over_r", "rslora"])
def test_a_scale_past_float32_is_refused_before_any_write(replace, config):
    """lora_alpha / r finite as a Python float but past float32's range (the slots' scales are float32): refused
    naming lora_alpha, every slot as it was. Before (session 45's input audit) write_slot raised torch's
    overflow error after it had rewritten the first layer's factors, so a replaced adapter served new factors
    under its old scale."""
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("x", peft_tensors(shapes, 4, seed=1))
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match="lora_alpha"):
        ctx.load_adapter_tensors("x" if replace else "y", peft_tensors(shapes, 4, seed=2), {"r": 4, **config},
                                 replace=replace)
    assert_state_unchanged(before, ctx)


@pytest.mark.parametrize("replace", [False, True], ids=["new_slot", "replace"])
def test_a_scale_past_float32_in_the_last_module_is_refused_before_any_write(replace):
    """As above with only the last module's scale out of range (alpha_pattern): the modules before it are
    checked, not written, so every slot stays as it was."""
    model, ctx = lora_model()
    shapes = module_shapes(model)
    ctx.load_adapter_tensors("x", peft_tensors(shapes, 4, seed=1))
    before = slot_state(ctx)
    config = {"r": 4, "lora_alpha": 8, "alpha_pattern": {re.escape(list(shapes)[-1]): 1e40}}
    with pytest.raises(AdapterError, match="lora_alpha"):
        ctx.load_adapter_tensors("x" if replace else "y", peft_tensors(shapes, 4, seed=2), config, replace=replace)
    assert_state_unchanged(before, ctx)


# ---- packed layers ---------------------------------------------------------------------------------------

def test_per_projection_adapters_load_into_packed_slices():
    """Different ranks and scales per slice: the layer's rank is the largest, the smaller slices are
    zero-padded, and each slice's scale ratio is folded into its lora_B, so every slice's delta is exact."""
    unfused = toy_lm()
    fused = fused_copy(unfused)
    ctx = apply_lora(fused, PROJECTIONS, max_loras=2, max_rank=MAX_RANK, max_tokens=16, packed_modules=PACKED)
    ranks = {"q_proj": 6, "k_proj": 2, "v_proj": 4, "gate_proj": 3, "up_proj": 5, "down_proj": 4, "o_proj": 4}
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {k: v for k, v in ranks.items() if v != 4},
              "alpha_pattern": {"k_proj": -3.0, "up_proj": 20.0}}
    tensors = peft_tensors(module_shapes(unfused), 4, seed=5, rank_of=lambda p: ranks[p.rpartition(".")[2]])
    ctx.load_adapter_tensors("p", tensors, config)
    for path in linear_paths(unfused):
        layer, i = ctx.targets[path]
        i = 0 if i is None else i          # None: the whole (unpacked) layer
        name = path.rpartition(".")[2]
        r = ranks[name]
        alpha = config["alpha_pattern"].get(name, 8)
        a = tensors[f"base_model.model.{path}.lora_A.weight"].double()
        b = tensors[f"base_model.model.{path}.lora_B.weight"].double()
        x = torch.randn(5, layer.in_features, dtype=torch.float64)
        want = (alpha / r) * (x @ a.T) @ b.T
        lo, hi = layer.slice_offsets[i], layer.slice_offsets[i + 1]
        got = layer.scale[0].double() * (x @ layer.lora_a[0, i].double().T) @ layer.lora_b[0, lo:hi].double().T
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), path
    for path, layer in ctx.layers.items():     # a packed layer's rank: the largest of its slices'
        slices = [p for p, (owner, i) in ctx.targets.items() if owner is layer and i is not None] or [path]
        assert layer.slot_ranks[0] == max(ranks[p.rpartition(".")[2]] for p in slices), path


def test_adapter_trained_on_the_fused_layer_fills_every_slice():
    fused = fused_copy(toy_lm())
    ctx = apply_lora(fused, PROJECTIONS, max_loras=2, max_rank=MAX_RANK, max_tokens=16, packed_modules=PACKED)
    path = "model.layers.0.self_attn.qkv_proj"
    tensors = peft_tensors({path: (32, 64)}, 4, seed=6)
    ctx.load_adapter_tensors("f", tensors, {"r": 4, "lora_alpha": 4})
    layer = ctx.layers[path]
    a = tensors[f"base_model.model.{path}.lora_A.weight"]
    for i in range(3):
        assert torch.equal(layer.lora_a[0, i, :4], a)
    assert torch.equal(layer.lora_b[0, :, :4], tensors[f"base_model.model.{path}.lora_B.weight"])


def test_fused_and_per_slice_keys_for_one_layer_conflict():
    fused = fused_copy(toy_lm())
    ctx = apply_lora(fused, PROJECTIONS, max_loras=2, max_rank=MAX_RANK, max_tokens=16, packed_modules=PACKED)
    tensors = peft_tensors({"model.layers.0.self_attn.qkv_proj": (32, 64),
                            "model.layers.0.self_attn.q_proj": (32, 32)}, 4, seed=7)
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match="writes slice 0 of a packed layer that another key"):
        ctx.load_adapter_tensors("both", tensors)
    assert_state_unchanged(before, ctx)


# ---- errors: each names its cause, and no slot changes -------------------------------------------------

def _tensors(model, rank=4, seed=11):
    return peft_tensors(module_shapes(model), rank, seed)


def _edit(tensors, key_suffix, fn):
    key = f"base_model.model.{Q0}.{key_suffix}"
    out = dict(tensors)
    out[key] = fn(out[key])
    return out


ERROR_CASES = {
    # name: (config changes, tensors edit, expected exception, message pattern)
    "dora_config": ({"use_dora": True}, None, UnsupportedAdapterError, r"DoRA \(use_dora\)"),
    "dora_tensor": ({}, lambda t: {**t, f"base_model.model.{Q0}.lora_magnitude_vector": torch.ones(32)},
                    UnsupportedAdapterError, r"DoRA \(lora_magnitude_vector\)"),
    "bias_all": ({"bias": "all"}, None, UnsupportedAdapterError, r"LoRA bias \(bias='all'\)"),
    "lora_bias": ({"lora_bias": True}, None, UnsupportedAdapterError, r"LoRA bias \(lora_bias\)"),
    "lora_bias_tensor": ({}, lambda t: {**t, f"base_model.model.{Q0}.lora_B.bias": torch.ones(32)},
                         UnsupportedAdapterError, r"LoRA bias \(lora_bias\)"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, UnsupportedAdapterError, "modules_to_save"),
    "embedding_layer": ({}, lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 64)},
                        UnsupportedAdapterError, "layer type Embedding"),
    # PEFT's defaults save the embedding's own weight beside its factors, first: the Embedding is still named.
    "embedding_layer_saved_with_its_weight": (
        {}, lambda t: {"base_model.model.model.embed_tokens.base_layer.weight": torch.ones(64, 32), **t,
                       "base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(4, 64)},
        UnsupportedAdapterError, "layer type Embedding"),
    "norm_layer": ({}, lambda t: {**t, **peft_tensors({"model.layers.0.norm": (32, 32)}, 4, 0)},
                   UnsupportedAdapterError, r"layer type LayerNorm is not supported .*'model.layers.0.norm'"),
    "conv_shaped": ({}, lambda t: _edit(t, "lora_A.weight", lambda a: a[:, :, None, None]),
                    UnsupportedAdapterError, "layer type other than Linear"),
    "unwrapped_linear": ({}, lambda t: {**t, **peft_tensors({"lm_head": (32, 64)}, 4, 0)},
                         AdapterError, "'lm_head', an nn.Linear that apply_lora did not wrap"),
    "unknown_module": ({}, lambda t: {**t, **peft_tensors({"model.nowhere": (32, 32)}, 4, 0)},
                       AdapterError, "'model.nowhere', which is not a module of this model"),
    # (split q/k/v adapters for a model that packs them, as Phi-3's qkv_proj: the message names packed_modules)
    "module_packed_elsewhere": ({}, lambda t: {**t, **peft_tensors({"model.layers.0.self_attn.w_proj": (32, 32)},
                                                                   4, 0)},
                                AdapterError, r"'model.layers.0.self_attn.w_proj', which is not a module of this "
                                r"model .*'model.layers.0.self_attn' holds \['k_proj', 'o_proj', 'q_proj', "
                                r"'v_proj'\]: if 'w_proj' is packed into one of them, pass apply_lora packed_modules"),
    "wrong_a_shape": ({}, lambda t: _edit(t, "lora_A.weight", lambda a: a[:, :31]),
                      AdapterError, r"lora_A has shape \(4, 31\); expected \[r, 32\]"),
    "wrong_b_shape": ({}, lambda t: _edit(t, "lora_B.weight", lambda b: b[:30]),
                      AdapterError, r"lora_B has shape \(30, 4\); expected \[32, 4\]"),
    "rank_above_capacity": ({"r": MAX_RANK + 2}, lambda t: peft_tensors(module_shapes(toy_lm()), MAX_RANK + 2, 3),
                            AdapterError, f"rank {MAX_RANK + 2} exceeds the layer's capacity max_rank={MAX_RANK}"),
    # (without r the scale divided by the rank first: a bare ZeroDivisionError)
    "rank_zero_without_r": ({"r": None}, lambda t: _edit(_edit(t, "lora_A.weight", lambda a: a[:0]), "lora_B.weight",
                                                         lambda b: b[:, :0]), AdapterError, "lora_A has rank 0"),
    "rank_disagrees_with_config": ({"r": 8}, None, AdapterError,
                                   r"lora_A has rank 4, but the adapter config gives r=8"),
    "missing_lora_b": ({}, lambda t: {k: v for k, v in t.items() if k != f"base_model.model.{Q0}.lora_B.weight"},
                       AdapterError, f"'{Q0}' has no lora_B.weight"),
    "unexpected_key": ({}, lambda t: {**t, "base_model.model.something_else": torch.ones(2)},
                       AdapterError, "unexpected tensor 'base_model.model.something_else'"),
    "nan_values": ({}, lambda t: _edit(t, "lora_B.weight", lambda b: b.index_fill(0, torch.tensor([3]), float("nan"))),
                   AdapterError, "holds NaN or infinite values"),
    "integer_tensor": ({}, lambda t: _edit(t, "lora_A.weight", lambda a: a.to(torch.int32)),
                       AdapterError, "has dtype torch.int32; expected a floating-point tensor"),
    "not_lora": ({"peft_type": "IA3"}, None, UnsupportedAdapterError, r"peft_type='IA3' is not supported"),
    "qalora": ({"use_qalora": True}, None, UnsupportedAdapterError, r"QALoRA \(use_qalora\)"),
    "no_weights": ({}, lambda t: {}, AdapterError, "no LoRA weights"),
    "bad_pattern_regex": ({"rank_pattern": {"(q_proj": 2}}, None, AdapterError, r"key '\(q_proj' is not a valid regex"),
    # Initialisations whose reload in PEFT rewrites the base weights: the factors are for that residual base.
    **{f"{init}_init": ({"init_lora_weights": init}, None, UnsupportedAdapterError,
                        f"init_lora_weights='{init}' is not supported: its factors go with base weights PEFT rewrote")
       for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "astra")},
    "rank_zero_in_config": ({"r": 0}, None, AdapterError, r"gives r=0 \(r / rank_pattern\); expected a positive"),
    "rank_nan_in_config": ({"r": float("nan")}, None, AdapterError, r"gives r=nan \(r / rank_pattern\); expected a "),
    "negative_dropout": ({"lora_dropout": -0.1}, None, AdapterError,
                         r"gives lora_dropout=-0.1; expected a probability in \[0, 1\]"),
    "dropout_above_one": ({"lora_dropout": 1.5}, None, AdapterError, r"gives lora_dropout=1.5; expected a "),
    "rank_pattern_infinite": ({"rank_pattern": {"q_proj": float("inf")}}, None, AdapterError,
                              r"gives r=inf \(r / rank_pattern\); expected a positive"),
    "rank_pattern_zero": ({"rank_pattern": {"q_proj": 0}}, None, AdapterError, r"'model.layers.0.self_attn.q_proj'"
                          r": the adapter config gives r=0"),
    "alpha_not_a_number": ({"alpha_pattern": {"q_proj": "big"}}, None, AdapterError,
                           r"gives lora_alpha='big' \(lora_alpha / alpha_pattern\); expected a finite number"),
    "base_layer_weights": ({}, lambda t: {**t, "base_model.model.lm_head.base_layer.weight": torch.ones(64, 32)},
                           UnsupportedAdapterError, r"base-layer weights saved with the adapter .*"
                                                    r"save_embedding_layers=False\) leaves them out"),
    "saved_embeddings": ({}, lambda t: {**t, "base_model.model.model.embed_tokens.weight": torch.ones(64, 32)},
                         UnsupportedAdapterError, r"base-model weights saved with the adapter are not supported .*"
                                                  r"save_embedding_layers"),
}


@pytest.mark.parametrize("case", ERROR_CASES.values(), ids=ERROR_CASES.keys())
@pytest.mark.parametrize("source", ["directory", "tensors"])
def test_invalid_adapter_is_refused_and_no_slot_changes(tmp_path, case, source):
    config_changes, edit, exc, pattern = case
    model, ctx = lora_model()
    ctx.load_adapter_tensors("kept", _tensors(model, seed=1), {"r": 4, "lora_alpha": 8})
    tensors = _tensors(model)
    tensors = edit(tensors) if edit else tensors
    config = {**lora_config(4, 8), **config_changes}
    before = slot_state(ctx)
    with pytest.raises(exc, match=pattern):
        if source == "directory":
            ctx.load_adapter("new", write_adapter_dir(tmp_path / "new", config, tensors))
        else:
            ctx.load_adapter_tensors("new", tensors, config)
    assert_state_unchanged(before, ctx)


def test_meta_tensors_are_refused_by_name_and_no_slot_changes():
    """A state dict taken from a model built without memory (on the meta device): the key is named, as for
    any other factor that holds no usable values (torch's own error named none)."""
    model, ctx = lora_model()
    ctx.load_adapter_tensors("kept", _tensors(model, seed=1), {"r": 4, "lora_alpha": 8})
    tensors = _edit(_tensors(model), "lora_B.weight", lambda b: b.to("meta"))
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=r"lora_B.weight' is on the meta device \(shape only, no values\)"):
        ctx.load_adapter_tensors("new", tensors, lora_config(4, 8))
    assert_state_unchanged(before, ctx)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"], ids=str)
def test_initialisations_that_keep_the_base_weights_load(init):
    """Only the factors' starting values differ (PEFT's reload leaves the base layer as it is)."""
    model, ctx = lora_model()
    tensors = _tensors(model)
    slot = ctx.load_adapter_tensors("a", tensors, lora_config(4, 8, init_lora_weights=init))
    assert_loaded(ctx, slot, tensors, 2.0)


def test_velora_buffers_are_skipped():
    """VeLoRA changes the backward only: its per-module buffer (lora_velora_embed) is skipped and the factors
    load as plain LoRA."""
    model, ctx = lora_model()
    tensors = _tensors(model)
    with_buffers = {**tensors, **{f"base_model.model.{path}.lora_velora_embed": torch.randn(4, 8)
                                  for path in ctx.layers}}
    slot = ctx.load_adapter_tensors("a", with_buffers, lora_config(4, 8))
    assert_loaded(ctx, slot, tensors, 2.0)


def test_peft_velora_adapter_loads(tmp_path):
    peft = pytest.importorskip("peft")
    velora = pytest.importorskip("peft.tuners.lora.config").__dict__.get("VeloraConfig")
    if velora is None:
        pytest.skip("this PEFT has no VeLoRA")
    model, ctx = lora_model()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             velora_config=velora(num_groups=4, init_type="random"))
    peft_model = peft.get_peft_model(copy.deepcopy(toy_lm()), config)
    peft_model.save_pretrained(tmp_path)
    config_, tensors = read_peft_directory(tmp_path)
    assert any("velora" in key for key in tensors)
    slot = ctx.load_adapter("v", tmp_path)
    layer = ctx.layers[Q0]
    assert layer.slot_ranks[slot] == 4 and layer.scale[slot].item() == 2.0


@pytest.mark.parametrize("missing", ["lora_alpha", "r", "both"])
def test_a_directory_config_without_r_or_alpha_takes_peft_defaults(tmp_path, missing):
    """PEFT reads adapter_config.json into a LoraConfig, whose r and lora_alpha default to 8: a file without
    them scales as PEFT's load does (it took lora_alpha = r, scale 1, silently unlike PEFT). In-memory tensors
    without a config keep their own rank and scale 1."""
    model, ctx = lora_model()
    rank = 8 if missing == "both" else 4
    tensors = _tensors(model, rank=rank)
    config = lora_config(rank, 16)
    for field in (("r", "lora_alpha") if missing == "both" else (missing,)):
        del config[field]
    path = write_adapter_dir(tmp_path / "a", config, tensors)
    if missing == "r":      # PEFT's r=8 against rank-4 tensors: PEFT's load fails too
        with pytest.raises(AdapterError, match=r"lora_A has rank 4, but the adapter config gives r=8 \(r / "
                                               r"rank_pattern, or PEFT's default where the config file has no r\)"):
            ctx.load_adapter("a", path)
        return
    slot = ctx.load_adapter("a", path)
    assert_loaded(ctx, slot, tensors, 8 / rank)
    slot = ctx.load_adapter_tensors("t", tensors)
    assert_loaded(ctx, slot, tensors, 1.0)


def test_replace_with_views_of_the_adapters_own_slot_changes_nothing():
    """replace=True fed the slot's own stored factors (views): the write clears the slot before copying, so
    views read after the clear wrote zeros."""
    model, ctx = lora_model()
    tensors = _tensors(model)
    slot = ctx.load_adapter_tensors("a", tensors, lora_config(4, 8))
    views = {}
    for path, layer in ctx.layers.items():
        views[f"{path}.lora_A.weight"] = layer.lora_a[slot, 0, :4]
        views[f"{path}.lora_B.weight"] = layer.lora_b[slot, :, :4]
    before = slot_state(ctx)
    ctx.load_adapter_tensors("a", views, lora_config(4, 8), replace=True)
    assert_state_unchanged(before, ctx)
    assert_loaded(ctx, slot, tensors, 2.0)


@pytest.mark.parametrize("replace", [False, True], ids=["new_slot", "replace"])
@pytest.mark.parametrize("factor", ["lora_A", "lora_B"])
@pytest.mark.parametrize("which", [0, -1], ids=["first_module", "last_module"])
def test_a_factor_that_overflows_the_layers_dtype_is_refused(which, factor, replace):
    """Finite in its file (float32) but past float16's range in a float16 model: refused before any write, as a
    NaN is (it would have turned that adapter's outputs to inf). In either factor, and in the last module
    written too: the cast is checked after the shape checks (the layer's dtype), and a check made layer by
    layer as each is written passed with the first module bad (nothing written before it) while the last
    one's left every other layer holding the new factors; replacing, under the old adapter's name."""
    model = toy_lm(dtype=torch.float16)
    ctx = apply_lora(model, PROJECTIONS, max_loras=2, max_rank=MAX_RANK, max_tokens=16)
    ctx.load_adapter_tensors("kept", _tensors(model, seed=1), lora_config(4, 8))
    before = slot_state(ctx)
    path = list(ctx.layers)[which]
    tensors = dict(_tensors(model))
    key = f"base_model.model.{path}.{factor}.weight"
    tensors[key] = tensors[key].float().index_fill(0, torch.tensor([2]), 1e5)
    with pytest.raises(AdapterError, match=f"'{re.escape(path)}': {factor} does not fit the layer's dtype "
                                           f"torch.float16"):
        ctx.load_adapter_tensors("kept" if replace else "new", tensors, lora_config(4, 8), replace=replace)
    assert_state_unchanged(before, ctx)


def test_a_weights_file_path_names_its_directory(tmp_path):
    model, ctx = lora_model()
    tensors = _tensors(model)
    path = write_adapter_dir(tmp_path / "a", lora_config(4, 8), tensors)
    slot = ctx.load_adapter("a", os.path.join(path, "adapter_model.safetensors"))
    assert_loaded(ctx, slot, tensors, 2.0)
    other = tmp_path / "notes.txt"
    other.write_text("not an adapter")
    with pytest.raises(AdapterError, match="path: expected a PEFT adapter directory .* got the file"):
        ctx.load_adapter("b", other)


def test_no_free_slot_and_duplicate_name():
    model, ctx = lora_model(max_loras=2)
    ctx.load_adapter_tensors("a", _tensors(model, seed=1))
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=r"an adapter named 'a' is already loaded \(slot 0\)"):
        ctx.load_adapter_tensors("a", _tensors(model, seed=2))
    assert_state_unchanged(before, ctx)
    ctx.load_adapter_tensors("b", _tensors(model, seed=3))
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match=r"no free slot for 'c': all max_loras=2 slots hold adapters \('a', 'b'\)"):
        ctx.load_adapter_tensors("c", _tensors(model, seed=4))
    assert_state_unchanged(before, ctx)
    with pytest.raises(AdapterError, match="name: expected a non-empty string"):
        ctx.load_adapter_tensors("", _tensors(model, seed=4))


def test_missing_files(tmp_path):
    model, ctx = lora_model()
    before = slot_state(ctx)
    with pytest.raises(FileNotFoundError, match="adapter directory .*nowhere' does not exist"):
        ctx.load_adapter("x", tmp_path / "nowhere")
    path = write_adapter_dir(tmp_path / "no_config", lora_config(4, 8), _tensors(model))
    os.remove(os.path.join(path, "adapter_config.json"))
    with pytest.raises(FileNotFoundError, match="adapter config .*adapter_config.json' is missing$"):
        ctx.load_adapter("x", path)
    # PEFT's save_pretrained of an adapter named "sql" writes it into the subfolder sql/: the error names it.
    write_adapter_dir(tmp_path / "saved" / "sql", lora_config(4, 8), _tensors(model))
    with pytest.raises(FileNotFoundError, match=r"adapter_config.json' is missing; its subfolder 'sql' holds one "
                                                r"\(PEFT saves an adapter not named 'default' under its name\): "
                                                r"load '.*saved/sql'"):
        ctx.load_adapter("x", tmp_path / "saved")
    path = write_adapter_dir(tmp_path / "no_weights", lora_config(4, 8), _tensors(model))
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(FileNotFoundError, match="adapter weights missing .* expected adapter_model.safetensors"):
        ctx.load_adapter("x", path)
    assert_state_unchanged(before, ctx)


@pytest.mark.parametrize("keep", [0.5, 0.999, 40], ids=["half", "last_byte", "header_only"])
def test_truncated_safetensors_is_an_error(tmp_path, keep):
    model, ctx = lora_model()
    path = write_adapter_dir(tmp_path / "t", lora_config(4, 8), _tensors(model))
    file = os.path.join(path, "adapter_model.safetensors")
    data = open(file, "rb").read()
    size = int(len(data) * keep) if isinstance(keep, float) else keep
    with open(file, "wb") as f:
        f.write(data[:size])
    before = slot_state(ctx)
    with pytest.raises(AdapterError, match="not a readable safetensors file, truncated or corrupt"):
        ctx.load_adapter("t", path)
    assert_state_unchanged(before, ctx)


def test_bad_config_json(tmp_path):
    model, ctx = lora_model()
    path = write_adapter_dir(tmp_path / "j", lora_config(4, 8), _tensors(model))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 4,')
    with pytest.raises(AdapterError, match="not a readable JSON adapter config"):
        ctx.load_adapter("j", path)


def test_directory_contents_are_read_as_data_only(tmp_path):
    """A directory with Python files next to the adapter: nothing is imported or run."""
    model, _ = lora_model()
    path = write_adapter_dir(tmp_path / "d", lora_config(4, 8), _tensors(model))
    marker = tmp_path / "imported"
    for name in ("__init__.py", "adapter_model.py", "modeling.py"):
        with open(os.path.join(path, name), "w") as f:
            f.write(f"open({str(marker)!r}, 'w')\n")
    config, tensors = read_peft_directory(path)
    assert config["r"] == 4 and len(tensors) == 2 * 14 and not marker.exists()


def test_tensors_for_a_multihead_attention_out_proj_are_skipped_with_a_warning():
    """PEFT's "all-linear" adapts nn.MultiheadAttention's out_proj, which MHA never calls (it reads the weight):
    the tensors have no effect under PEFT. apply_lora cannot wrap that layer, and the adapter was refused with
    advice that could not be followed (SigLIP's pooling head). Its tensors are skipped with a warning."""
    from layer_helpers import peft_tensors
    from lora_ops.layers import _weight_read_by_parent

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(self.attn(x, x, x, need_weights=False)[0])
    torch.manual_seed(0)
    model = Pool().eval()
    assert _weight_read_by_parent(model, "attn.out_proj")
    ctx = apply_lora(model, "all-linear", max_loras=1, max_rank=4, max_tokens=16)
    assert list(ctx.layers) == ["proj"]
    tensors = peft_tensors({"proj": (8, 8), "attn.out_proj": (8, 8)}, 4, seed=1)
    with pytest.warns(UserWarning, match=r"'attn.out_proj' are skipped: nn.MultiheadAttention never calls"):
        ctx.load_adapter_tensors("a", tensors)
    alone = peft_tensors({"proj": (8, 8)}, 4, seed=1)
    twin = copy.deepcopy(model)
    ctx.set_batch([("a", 6)])
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        got = model(x)
    twin_ctx = twin.proj.context
    twin_ctx.unload_adapter("a")
    twin_ctx.load_adapter_tensors("a", {k: v for k, v in alone.items()})
    twin_ctx.set_batch([("a", 6)])
    with torch.no_grad():
        assert torch.equal(twin(x), got)
