"""Helpers shared by the LoRALinear / adapter / compile / PEFT-parity tests (not a test file).

A toy decoder whose module paths look like a Hugging Face Llama's (``model.layers.N.self_attn.q_proj``,
``...mlp.down_proj``, ``model.embed_tokens``, ``lm_head``), in two forms computing the same function:
unfused (one Linear per projection, what PEFT adapters are trained on) and fused (``qkv_proj`` and
``gate_up_proj``, what serving code often runs). Plus PEFT-style adapter tensors and directories, and
snapshots of every slot of a context to prove that a failed load wrote nothing.
"""
import copy
import json
import os

import torch
from torch import nn

from lora_ops.adapters import CONFIG_FILE, LEGACY_BIN_FILE, SAFETENSORS_FILE
from lora_ops.layers import LoRALinear

HIDDEN, KV, INTER, VOCAB = 32, 16, 48, 64
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PACKED = {"qkv_proj": {"q_proj": HIDDEN, "k_proj": KV, "v_proj": KV},
          "gate_up_proj": {"gate_proj": INTER, "up_proj": INTER}}


class Attention(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.qkv_proj = nn.Linear(HIDDEN, HIDDEN + 2 * KV, bias=False)
        else:
            self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
            self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)

    def forward(self, x):
        if self.fused:
            q, k, v = self.qkv_proj(x).split([HIDDEN, KV, KV], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Token-local mixing (no attention across tokens), so rows of different requests stay independent.
        return self.o_proj(torch.cat([torch.tanh(q[..., :KV]) * k, v + q[..., KV:]], dim=-1))


class MLP(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up_proj = nn.Linear(HIDDEN, 2 * INTER, bias=False)
        else:
            self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
            self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.gelu(gate) * up)


class Block(nn.Module):
    def __init__(self, fused):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention(fused)
        self.mlp = MLP(fused)

    def forward(self, x):
        h = x + self.self_attn(self.norm(x))
        return h + self.mlp(h)


class Decoder(nn.Module):
    def __init__(self, fused, num_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(fused) for _ in range(num_layers))


class ToyLM(nn.Module):
    """input_ids [..., T] -> logits [..., T, VOCAB]; every token computed on its own."""

    def __init__(self, fused=False, num_layers=2):
        super().__init__()
        self.model = Decoder(fused, num_layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(h)

    def get_output_embeddings(self):
        return self.lm_head


def toy_lm(seed=0, num_layers=2, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return ToyLM(num_layers=num_layers).to(dtype=dtype, device=device).eval()


def fused_copy(model):
    """A fused ToyLM (qkv_proj, gate_up_proj) with ``model``'s weights: the same function."""
    fused = ToyLM(fused=True, num_layers=len(model.model.layers)).to(model.lm_head.weight)
    fused.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for src, dst in zip(model.model.layers, fused.model.layers):
            a, m = src.self_attn, src.mlp
            dst.self_attn.qkv_proj.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            dst.mlp.gate_up_proj.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
    return fused.eval()


def linear_paths(model, names=PROJECTIONS):
    """{module path: nn.Linear or LoRALinear} of the projections ``names``."""
    return {path: m for path, m in model.named_modules()
            if isinstance(m, (nn.Linear, LoRALinear)) and path.rpartition(".")[2] in names}


def peft_tensors(shapes, rank, seed, prefix="base_model.model.", rank_of=None, dtype=torch.float32):
    """A PEFT-style state dict for modules ``shapes`` = {path: (in_features, out_features)}: signed random
    lora_A [r, in] and non-zero lora_B [out, r]; ``rank_of(path)`` overrides the rank per module."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, (k, n) in shapes.items():
        r = rank_of(path) if rank_of else rank
        tensors[f"{prefix}{path}.lora_A.weight"] = (torch.randn(r, k, generator=gen) / k ** 0.5).to(dtype)
        tensors[f"{prefix}{path}.lora_B.weight"] = (torch.randn(n, r, generator=gen) / r ** 0.5).to(dtype)
    return tensors


def module_shapes(model, names=PROJECTIONS):
    return {path: (m.in_features, m.out_features) for path, m in linear_paths(model, names).items()}


def lora_config(r, lora_alpha, **extra):
    """The fields of a PEFT 0.21 adapter_config.json that matter here (plus any ``extra``)."""
    config = {"peft_type": "LORA", "r": r, "lora_alpha": lora_alpha, "use_rslora": False, "rank_pattern": {},
              "alpha_pattern": {}, "fan_in_fan_out": False, "bias": "none", "use_dora": False,
              "lora_bias": False, "modules_to_save": None, "target_modules": PROJECTIONS, "lora_dropout": 0.0}
    config.update(extra)
    return config


def write_adapter_dir(path, config, tensors, fmt="safetensors"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, SAFETENSORS_FILE))
    elif fmt == "bin":
        torch.save(tensors, os.path.join(path, LEGACY_BIN_FILE))
    return str(path)


def slot_state(ctx):
    """Every byte a load could touch: each layer's stacks and buffers, the host mirrors, the slot table, and the
    context's per-slot records (the config each slot was loaded with, which save_peft_adapter writes back; the
    folded and fused layers)."""
    state = {"names": list(ctx.slot_names)}
    for record in ("adapter_configs", "adapter_folded_layers", "adapter_fused_sources"):
        state[record] = copy.deepcopy(getattr(ctx, record, {}))
    for path, layer in ctx.layers.items():
        for key, t in (("a", layer.lora_a), ("b", layer.lora_b), ("scale", layer.scale), ("rank", layer.rank)):
            state[f"{path}.{key}"] = t.detach().clone()
        state[f"{path}.host_ranks"] = list(layer.slot_ranks)
    return state


def assert_state_unchanged(before, ctx):
    after = slot_state(ctx)
    assert after.keys() == before.keys()
    for key, old in before.items():
        new = after[key]
        if isinstance(old, torch.Tensor):
            assert torch.equal(old.view(torch.uint8), new.view(torch.uint8)), f"{key} changed"
        else:
            assert old == new, f"{key} changed: {old} -> {new}"


def data_ptrs(ctx):
    ptrs = {"token_slots": ctx.token_slots.data_ptr()}
    ptrs.update({f"meta{i}": t.data_ptr() for i, t in enumerate(ctx.meta)})
    for path, layer in ctx.layers.items():
        for key in ("lora_a", "lora_b", "scale", "rank"):
            ptrs[f"{path}.{key}"] = getattr(layer, key).data_ptr()
        ptrs[f"{path}.base"] = layer.base.weight.data_ptr()
    return ptrs


def request_slots(ctx, requests):
    """The per-token slots [M] (int64, CPU) that ``requests`` [(name or None, n)] mean, request-major."""
    slots = [ctx.slot_of(name) for name, n in requests for _ in range(n)]
    return torch.tensor(slots, dtype=torch.int64)
