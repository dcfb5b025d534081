"""PEFT LoRA adapters into the slots of a :class:`lora_ops.layers.LoRAContext`.

Sources: a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, or a legacy
``adapter_model.bin`` read only through ``torch.load(weights_only=True)``), or in-memory tensors keyed
like PEFT's state dict (``<module path>.lora_A.weight`` / ``.lora_B.weight``, with or without the
``base_model.model.`` prefix). Adapter files are data: nothing in a directory is executed or imported.

**All checks run before the first write**: on any error, every slot of every layer is exactly as it
was. Writes are in place, so data pointers never move.

Config fields honoured (PEFT 0.21 semantics):

- ``r`` / ``lora_alpha``, and ``use_rslora``: scale = alpha / r, or alpha / sqrt(r).
- ``rank_pattern`` / ``alpha_pattern``: per-module overrides. A pattern key matches a module path when
  the path ends in it at a dotted boundary, the key read as a regex (``re.match(r"(.*\\.)?(KEY)$",
  path)``); the first matching key, in the dict's order, wins.
- ``fan_in_fan_out``: describes the *base* weight's layout (GPT-2's Conv1D keeps ``[in, out]``); PEFT
  stores ``lora_A [r, in]`` and ``lora_B [out, r]`` either way, so the factors load as stored and only
  their shapes are checked against the nn.Linear they land in.
- ``target_modules`` / ``layers_to_transform`` / ``exclude_modules``: applied by PEFT when it saved the
  adapter; the tensors present are the modules targeted, each of which must be a LoRALinear here.

Unsupported (an :class:`UnsupportedAdapterError` naming the feature): DoRA, LoRA bias (``lora_bias`` or
``bias != "none"``), ``modules_to_save``, trainable tokens, ``target_parameters``, layer replication,
and the variants that change the forward (aLoRA, QALoRA, MonteCLoRA, BD-LoRA, Arrow, KaSA); layer types
other than Linear (embeddings, convolutions), and base-layer weights saved with the adapter; adapters saved
with ``init_lora_weights`` PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA or Astra, which subtract the initial factors from the
base weights (convert them to plain LoRA when saving). VeLoRA (a backward-only change) and the initialisations
that leave the base weights alone (MiCA, EVA, orthogonal, Gaussian) compute LoRA's own forward, so they
load. A factor that is finite in its file but overflows the layer's dtype is refused, as NaN is.

``path`` may also name the directory's weights file (``adapter_model.safetensors`` / ``.bin``).

A packed layer (several output slices, see ``apply_lora(packed_modules=...)``) holds one rank and one
scale per slot: its rank is the largest of its slices' ranks (the others are zero-padded) and, when
the slices' scales differ, each slice's ratio to the largest scale is folded into its ``lora_B``.
"""
import hashlib
import json
import math
import os
import pickle
import re
import warnings

import torch

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
LEGACY_BIN_FILE = "adapter_model.bin"


class AdapterError(ValueError):
    """An adapter that cannot be loaded: bad shapes, ranks, names, slots or files."""


class UnsupportedAdapterError(AdapterError):
    """An adapter that uses a PEFT feature lora_ops does not implement; the message names the feature."""


# Config fields whose truthy values change what the adapter computes beyond plain LoRA.
_UNSUPPORTED_FIELDS = (
    ("use_dora", "DoRA (use_dora)"),
    ("lora_bias", "LoRA bias (lora_bias)"),
    ("modules_to_save", "modules_to_save"),
    ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
    ("target_parameters", "parameter targets (target_parameters)"),
    ("layer_replication", "layer replication (layer_replication)"),
    ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("monteclora_config", "MonteCLoRA (monteclora_config)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("arrow_config", "Arrow routing (arrow_config)"),
    ("kasa_config", "KaSA (kasa_config)"),
)

# init_lora_weights values whose reload in PEFT rewrites the base weights (PiSSA, CorDA, OLoRA, LoftQ, LoRA-GA,
# Astra): the adapter's factors are meant for that residual base, not for the model's own weights.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga", "astra")

# Tensor keys of unsupported features, tried before the plain lora_A / lora_B pattern.
_UNSUPPORTED_KEYS = (
    (re.compile(r"lora_magnitude_vector"), "DoRA (lora_magnitude_vector)"),
    (re.compile(r"lora_embedding_[AB]"), "layer type Embedding (lora_embedding_A/B)"),
    (re.compile(r"modules_to_save"), "modules_to_save"),
    (re.compile(r"trainable_tokens"), "trainable tokens (trainable_token_indices)"),
    (re.compile(r"\.base_layer\.weight$"), "base-layer weights saved with the adapter (PEFT saves them for "
     "targeted embed_tokens / lm_head layers; save_pretrained(..., save_embedding_layers=False) leaves them out)"),
    (re.compile(r"\.lora_B(\.[^.]+)?\.bias$"), "LoRA bias (lora_bias)"),
    (re.compile(r"\.bias$"), "LoRA bias (bias != 'none': the adapter carries base-layer biases)"),
)

# Tensors that change nothing the forward computes, skipped: VeLoRA's per-module buffer (its embedding of the
# activations, read by its backward only).
_SKIPPED_KEYS = re.compile(r"\.lora_velora_embed(\.[^.]+)?$")

# PEFT's LoraConfig defaults for the fields a config file may leave out (PEFT reads the file into a LoraConfig).
PEFT_CONFIG_DEFAULTS = {"r": 8, "lora_alpha": 8}

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


# ---- public API ----------------------------------------------------------------------------------------

def load_peft_adapter(ctx, name, path, *, replace=False):
    """Load the PEFT adapter directory ``path`` into ``ctx`` as ``name``; returns its slot.

    ``replace=True`` swaps a loaded adapter of that name in place (same slot), after every check passed.
    """
    config, tensors = read_peft_directory(path)
    return load_adapter_tensors(ctx, name, tensors, config, replace=replace, source=str(path))


def load_adapter_tensors(ctx, name, tensors, config=None, *, replace=False, source="tensors"):
    """Load a PEFT-style state dict ``{key: tensor}`` into ``ctx`` as ``name``; returns its slot.

    ``config``: an adapter_config dict or a ``peft.LoraConfig``. Without one (or without ``r`` /
    ``lora_alpha`` in it) each module's rank is its tensors' and ``lora_alpha`` equals it (scale 1); a PEFT
    directory's config file takes PEFT's defaults instead (:func:`read_peft_directory`).
    ``source``: what error messages call the tensors' origin (load_adapter passes the weights file's path).
    """
    slot = _pick_slot(ctx, name, replace)
    config = _config_dict(config)
    check_config_supported(config)
    _check_dropout(config, source)
    modules = {path: ab for path, ab in _group_by_module(tensors, source).items() if not _never_called(ctx, path)}
    if not modules:
        raise AdapterError(f"{source}: no LoRA weights (keys '<module>.lora_A.weight' / '.lora_B.weight') found")
    plan = _plan_writes(ctx, modules, config, source)
    _check_stacks_writable(ctx, source)
    _write(ctx, slot, name, plan)
    _configs(ctx)[slot] = config      # for save_peft_adapter (use_rslora) and training (lora_dropout)
    # Packed layers whose slices' scale ratios were folded into lora_B: training warns of them.
    paths = {layer: path for path, layer in ctx.layers.items()}
    _folded_layers(ctx)[slot] = {paths[layer] for layer, (_, _, _, folded) in plan.items() if folded}
    # Packed layers the adapter targeted as one module (Phi-3's qkv_proj): saved back that way, trained tied.
    _fused_sources(ctx)[slot] = {path for path in modules if ctx.targets[path][1] is None
                                 and len(ctx.targets[path][0].slice_widths) > 1}
    _configs_changed(ctx, slot)
    return slot


def unload_adapter(ctx, name):
    """Free ``name``'s slot: weights zeroed, rank and scale set to 0, in place."""
    if name is None:
        raise AdapterError("unload_adapter: expected an adapter name, got None")
    slot = ctx.slot_of(name)
    if slot in getattr(ctx, "row_slots", ()):
        # (per_row holds slots, not names: another adapter loaded into the freed slot would serve these rows)
        raise AdapterError(f"unload_adapter: adapter {name!r} serves rows of the active per_row block; unload it "
                           f"after the block (replacing it, load_adapter(..., replace=True), keeps its slot)")
    _check_stacks_writable(ctx, "unload_adapter")
    for layer in ctx.layers.values():
        layer.clear_slot(slot)
    ctx._drop_from_batch(slot)      # (else an adapter loaded into the slot next would serve the batch's tokens)
    trainer = getattr(ctx, "trainer", None)
    if trainer is not None:
        trainer.forget_slot(slot)
    ctx.slot_names[slot] = None
    _configs(ctx).pop(slot, None)
    _folded_layers(ctx).pop(slot, None)
    _fused_sources(ctx).pop(slot, None)
    _configs_changed(ctx)


def read_peft_directory(path):
    """(config dict, {key: tensor}) of a PEFT adapter directory, reading data only. The config's missing ``r`` /
    ``lora_alpha`` take PEFT's defaults (8 and 8), as PEFT's own load does (in-memory tensors loaded without
    them take their tensors' rank and scale 1 instead: :func:`load_adapter_tensors`)."""
    return {**PEFT_CONFIG_DEFAULTS, **read_adapter_config(path)}, _read_weights(path)


def read_adapter_config(path):
    """The adapter_config.json of a PEFT adapter directory, as a dict."""
    path = _adapter_directory(path)
    return _read_config(os.path.join(path, CONFIG_FILE))


def _adapter_directory(path):
    """The adapter directory ``path`` names: itself, or the folder of its weights file."""
    path = os.fspath(path)
    if os.path.isfile(path) and os.path.basename(path) in (SAFETENSORS_FILE, LEGACY_BIN_FILE):
        return os.path.dirname(path) or "."
    if os.path.isfile(path):
        raise AdapterError(f"path: expected a PEFT adapter directory (holding {CONFIG_FILE} and {SAFETENSORS_FILE}), "
                           f"got the file {path!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"adapter directory {path!r} does not exist")
    return path


def check_config_supported(config):
    """Raise UnsupportedAdapterError naming the first PEFT feature of ``config`` we do not implement."""
    peft_type = getattr(config.get("peft_type"), "value", config.get("peft_type"))
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise UnsupportedAdapterError(f"peft_type={peft_type!r} is not supported: only LoRA adapters load")
    for field, feature in _UNSUPPORTED_FIELDS:
        if config.get(field):
            raise UnsupportedAdapterError(f"{feature} is not supported (adapter config {field}={config[field]!r})")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise UnsupportedAdapterError(f"LoRA bias (bias={bias!r}) is not supported: only bias='none' loads")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise UnsupportedAdapterError(
            f"an adapter initialised with init_lora_weights={init!r} is not supported: its factors go with base "
            f"weights PEFT rewrote at initialisation (the residual of the initial factors), so on the unchanged "
            f"base layer it computes something else. Save it converted to plain LoRA (PEFT: save_pretrained(..., "
            f"path_initial_model_for_weight_conversion=...)) and load that")


# ---- files ---------------------------------------------------------------------------------------------

def _read_config(file):
    if not os.path.isfile(file):
        # PEFT's save_pretrained writes an adapter not named "default" into a subfolder of that name.
        folder = os.path.dirname(file)
        inner = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, CONFIG_FILE)))
        hint = (f"; its subfolder{'s' if len(inner) > 1 else ''} {', '.join(repr(d) for d in inner)} "
                f"hold{'' if len(inner) > 1 else 's'} one (PEFT saves an adapter not named 'default' under "
                f"its name): load {os.path.join(folder, inner[0])!r}") if inner else ""
        raise FileNotFoundError(f"adapter config {file!r} is missing{hint}")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{file}: not a readable JSON adapter config ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def _read_weights(path):
    """The tensors of the adapter at ``path``: the weights file it names (one of a directory holding both was
    read as the safetensors file), else its directory's safetensors file, else its legacy .bin."""
    directory, named = _adapter_directory(path), os.fspath(path)
    if os.path.isfile(named):
        return _read_safetensors(named) if os.path.basename(named) == SAFETENSORS_FILE else _read_legacy_bin(named)
    safetensors_file = os.path.join(directory, SAFETENSORS_FILE)
    if os.path.isfile(safetensors_file):
        return _read_safetensors(safetensors_file)
    bin_file = os.path.join(directory, LEGACY_BIN_FILE)
    if os.path.isfile(bin_file):
        return _read_legacy_bin(bin_file)
    raise FileNotFoundError(f"adapter weights missing in {path!r}: expected {SAFETENSORS_FILE} "
                            f"(or a legacy {LEGACY_BIN_FILE})")


def _read_safetensors(file):
    from safetensors import safe_open
    try:
        # safe_open + get_tensor reads every tensor's bytes now, so a truncated file fails here.
        with safe_open(file, framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise AdapterError(f"{file}: not a readable safetensors file, truncated or corrupt "
                           f"({type(e).__name__}: {e})") from None


def _read_legacy_bin(file):
    """A legacy pickle read with weights_only=True: tensors and plain containers only, never code."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise AdapterError(f"{file}: refused by torch.load(weights_only=True), which loads tensors only "
                           f"and never runs code ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise AdapterError(f"{file}: not a readable torch checkpoint, truncated or corrupt ({e})") from None
    if not isinstance(state, dict):
        raise AdapterError(f"{file}: expected a dict of tensors, got {type(state).__name__}")
    return state


# ---- checks and the write plan ---------------------------------------------------------------------------

def _pick_slot(ctx, name, replace):
    if not isinstance(name, str) or not name:
        raise AdapterError(f"name: expected a non-empty string, got {name!r}")
    if name in ctx.slot_names:
        if replace:
            return ctx.slot_names.index(name)
        raise AdapterError(f"an adapter named {name!r} is already loaded (slot {ctx.slot_names.index(name)}); "
                           f"unload it first or pass replace=True")
    if None not in ctx.slot_names:
        raise AdapterError(f"no free slot for {name!r}: all max_loras={ctx.max_loras} slots hold adapters "
                           f"({', '.join(map(repr, ctx.slot_names))}); unload one first")
    return ctx.slot_names.index(None)


def _config_dict(config):
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"config: expected an adapter_config dict or a peft.LoraConfig, got {type(config).__name__}")


def _group_by_module(tensors, source):
    """{module path: (lora_A, lora_B)}; any key that is not a plain LoRA factor is an error."""
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors: expected a dict of tensors, got {type(tensors).__name__}")
    # Each feature over every key in turn, the first feature first: an Embedding adapter saved with PEFT's
    # defaults also holds the embedding's own weight, and the message named that instead of the Embedding.
    for pattern, feature in _UNSUPPORTED_KEYS:
        for key in tensors:
            if pattern.search(key) and not _SKIPPED_KEYS.search(key):
                raise UnsupportedAdapterError(f"{feature} is not supported ({source}: tensor {key!r})")
    factors = {}
    for key, t in tensors.items():
        if _SKIPPED_KEYS.search(key):
            continue
        match = _LORA_KEY.match(key)
        if match is None:
            if key.endswith(".weight") and "lora_" not in key:
                raise UnsupportedAdapterError(
                    f"base-model weights saved with the adapter are not supported ({source}: tensor {key!r}; PEFT "
                    f"saves them for modules_to_save, and the embeddings with save_embedding_layers or when the "
                    f"vocabulary was resized)")
            raise AdapterError(f"{source}: unexpected tensor {key!r} (expected '<module>.lora_A.weight' "
                               f"and '<module>.lora_B.weight' only)")
        _check_factor(key, t, source)
        module, factor = match["module"], match["factor"]
        pair = factors.setdefault(module, {})
        if factor in pair:
            raise AdapterError(f"{source}: module {module!r} has two lora_{factor} tensors")
        pair[factor] = t
    for module, pair in factors.items():
        missing = {"A", "B"} - pair.keys()
        if missing:
            raise AdapterError(f"{source}: module {module!r} has no lora_{missing.pop()}.weight")
    return {module: (pair["A"], pair["B"]) for module, pair in factors.items()}


def _check_factor(key, t, source):
    if not isinstance(t, torch.Tensor):
        raise AdapterError(f"{source}: {key!r} is a {type(t).__name__}, not a tensor")
    if not t.is_floating_point():
        raise AdapterError(f"{source}: {key!r} has dtype {t.dtype}; expected a floating-point tensor")
    if t.dim() != 2:
        raise UnsupportedAdapterError(f"layer type other than Linear is not supported ({source}: {key!r} has "
                                      f"shape {tuple(t.shape)}; a Linear layer's LoRA factors are 2-D)")
    if t.is_meta:       # (a state dict of a model built without memory: torch's own error named no key)
        raise AdapterError(f"{source}: {key!r} is on the meta device (shape only, no values); expected a tensor "
                           f"holding the adapter's values")
    if not bool(torch.isfinite(t).all()):
        raise AdapterError(f"{source}: {key!r} holds NaN or infinite values")


def _pattern_value(patterns, path, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that ends ``path`` at a dotted boundary."""
    for key, value in (patterns or {}).items():
        try:
            if re.match(rf"(.*\.)?({key})$", path):
                return value
        except re.error as e:
            raise AdapterError(f"rank_pattern / alpha_pattern: key {key!r} is not a valid regex ({e})") from None
    return default


def _module_scale(config, path, rank, source):
    """(expected rank or None, scale) of module ``path`` under ``config`` (PEFT's rules)."""
    r = _pattern_value(config.get("rank_pattern"), path, config.get("r"))
    alpha = _pattern_value(config.get("alpha_pattern"), path, config.get("lora_alpha"))
    if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r)
                          or r != int(r) or r < 1):
        raise AdapterError(f"{source}: {path!r}: the adapter config gives r={r!r} (r / rank_pattern); expected a "
                           f"positive integer")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not math.isfinite(alpha)):
        raise AdapterError(f"{source}: {path!r}: the adapter config gives lora_alpha={alpha!r} (lora_alpha / "
                           f"alpha_pattern); expected a finite number")
    r_eff = rank if r is None else int(r)
    if r_eff < 1:       # (a rank-0 factor and no r in the config: before the scale divides by it)
        raise AdapterError(f"{source}: {path!r}: lora_A has rank 0")
    alpha = r_eff if alpha is None else float(alpha)
    scale = alpha / math.sqrt(r_eff) if config.get("use_rslora") else alpha / r_eff
    if not abs(scale) <= torch.finfo(torch.float32).max:   # the slots' scales are float32 (checked before any write)
        raise AdapterError(f"{source}: {path!r}: lora_alpha={alpha!r} over r={r_eff} gives the scale {scale:g}, "
                           f"beyond float32's range (the layers keep each slot's scale in float32)")
    return r, scale


def _never_called(ctx, path):
    """Whether ``path`` is an nn.Linear that apply_lora does not wrap because its parent never calls it
    (nn.MultiheadAttention's out_proj: the attention function reads its weight). PEFT's "all-linear" adapts
    it, to no effect on the output (PEFT's own forward never runs the adapter there): its tensors are skipped,
    with a warning, so that the adapter loads and computes what it computes under PEFT."""
    from lora_ops.layers import _weight_read_by_parent     # layers imports this module
    model = ctx.model()
    if path in ctx.targets or model is None:
        return False
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    if not (isinstance(module, torch.nn.Linear) and _weight_read_by_parent(model, path)):
        return False
    warnings.warn(f"lora_ops: the adapter's tensors for {path!r} are skipped: nn.MultiheadAttention never calls "
                  f"its out_proj (it reads the weight), so they have no effect, under PEFT too", stacklevel=3)
    return True


def _packed_hint(model, path):
    """Where a missing module's parent holds wrapped layers (an adapter of q_proj / k_proj / v_proj for a model
    that packs them into qkv_proj, as Phi-3 does): those layers, and packed_modules."""
    from lora_ops.layers import LoRALinear     # layers imports this module
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path)
    except AttributeError:
        return ""
    wrapped = sorted(name for name, child in parent.named_children() if isinstance(child, LoRALinear))
    if not wrapped:
        return ""
    return (f"; {parent_path or 'the model'!r} holds {wrapped}: if {leaf!r} is packed into one of them, pass "
            f"apply_lora packed_modules={{<packed layer>: {{{leaf!r}: <its output features>, ...}}}}")


def _resolve_target(ctx, path, source):
    target = ctx.targets.get(path)
    if target is not None:
        return target
    model = ctx.model()
    module = None
    if model is not None:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
    if module is None and model is None and not ctx.targets:
        raise AdapterError(f"{source}: the adapter targets {path!r}, but this context serves no layers by path "
                           f"(one built by hand, not by apply_lora): adapters load by module path into the layers "
                           f"apply_lora wrapped; wrap a model with apply_lora(model, target_modules, ...)")
    if module is None and model is not None and ".base_layer." in path:
        # PEFT's key of a module inside a layer it wrapped whole (nn.MultiheadAttention: its out_proj under the
        # wrapper's base_layer): the outer layer is what the adapter targets.
        outer = path.partition(".base_layer.")[0]
        try:
            outer_type = type(model.get_submodule(outer)).__name__
        except AttributeError:
            outer_type = None
        if outer_type is not None:
            raise UnsupportedAdapterError(f"layer type {outer_type} is not supported ({source}: the adapter targets "
                                          f"{outer!r} as one module, {path!r} inside it; only nn.Linear layers "
                                          f"take LoRA here)")
    if module is None:
        raise AdapterError(f"{source}: the adapter targets {path!r}, which is not a module of this model "
                           f"(paths are relative to the model apply_lora wrapped){_packed_hint(model, path)}")
    if isinstance(module, torch.nn.Linear):
        raise AdapterError(f"{source}: the adapter targets {path!r}, an nn.Linear that apply_lora did not wrap; "
                           f"add it to target_modules")
    from lora_ops.layers import LoRALinear     # layers imports this module
    if isinstance(module, LoRALinear):
        raise AdapterError(f"{source}: the adapter targets {path!r}, which another LoRAContext wraps (apply_lora "
                           f"called on the model more than once): load the adapter there")
    raise UnsupportedAdapterError(f"layer type {type(module).__name__} is not supported ({source}: the adapter "
                                  f"targets {path!r}; only nn.Linear layers take LoRA here)")


def _plan_writes(ctx, modules, config, source):
    """{layer: (per-slice (A, B) or None, scale, rank, whether the slices' scales differed)}, every shape, rank
    and scale checked (:func:`_fold_slices`)."""
    plan = {}
    for path, (a, b) in modules.items():
        layer, index = _resolve_target(ctx, path, source)
        rank = a.shape[0]
        expected_rank, scale = _module_scale(config, path, rank, source)
        _check_shapes(layer, index, path, a, b, expected_rank, source)
        slices = plan.setdefault(layer, [None] * len(layer.slice_widths))
        offsets = layer.slice_offsets
        indices = range(len(slices)) if index is None else [index]
        for i in indices:
            if slices[i] is not None:
                raise AdapterError(f"{source}: {path!r} writes slice {i} of a packed layer that another key of "
                                   f"the adapter also writes")
            b_i = b if index is not None else b[offsets[i]:offsets[i + 1]]
            slices[i] = (a, b_i, rank, scale, path)
    _check_still_in_model(ctx, plan, source)
    return {layer: (*_fold_slices(layer, slices, source), _scales_differ(slices)) for layer, slices in plan.items()}


def _check_still_in_model(ctx, layers, source):
    """Each layer the adapter writes still a module of the model: one replaced after apply_lora (a block rebuilt
    or reloaded) stayed in the context, and the adapter went into it, unused, while the model ran the new layer
    without it, silently. (Present anywhere in the model: a layer inside a wrapped one sits under its base.)"""
    model = ctx.model()
    if model is None:
        return
    present = {id(module) for module in model.modules()}
    for path, layer in ctx.layers.items():
        if layer in layers and id(layer) not in present:
            try:
                now = f"a {type(model.get_submodule(path)).__name__} is"
            except AttributeError:
                now = "no module is"
            raise AdapterError(f"{source}: the layer apply_lora wrapped at {path!r} is no longer in the model "
                               f"({now} there): it was replaced after apply_lora, and the adapter would go into "
                               f"the old layer, unused: put the context's layer back (ctx.layers[{path!r}]), or "
                               f"replace layers before apply_lora")


def _check_dropout(config, source):
    """lora_dropout a probability, as PEFT's nn.Dropout takes it (a negative one scaled the delta by 1 / (1 - p)
    in training, silently)."""
    p = config.get("lora_dropout")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1):
        raise AdapterError(f"{source}: the adapter config gives lora_dropout={p!r}; expected a probability in "
                           f"[0, 1]")


def _scales_differ(slices):
    return len({s[3] for s in slices if s is not None}) > 1


def _check_shapes(layer, index, path, a, b, expected_rank, source):
    rank, in_features = a.shape
    out_features = layer.out_features if index is None else layer.slice_widths[index]
    what = f"{source}: {path!r}"
    if rank < 1:
        raise AdapterError(f"{what}: lora_A has rank 0 (shape {tuple(a.shape)})")
    if expected_rank is not None and rank != int(expected_rank):
        # (A config file without r takes PEFT's default, which the message names: nothing in the file says 8.)
        default = (", or PEFT's default where the config file has no r" if int(expected_rank)
                   == PEFT_CONFIG_DEFAULTS["r"] else "")
        raise AdapterError(f"{what}: lora_A has rank {rank}, but the adapter config gives r={expected_rank} "
                           f"(r / rank_pattern{default}) for it")
    if rank > layer.max_rank:
        raise AdapterError(f"{what}: rank {rank} exceeds the layer's capacity max_rank={layer.max_rank}")
    if in_features != layer.in_features:
        raise AdapterError(f"{what}: lora_A has shape {tuple(a.shape)}; expected [r, {layer.in_features}] "
                           f"(the layer's in_features)")
    if tuple(b.shape) != (out_features, rank):
        raise AdapterError(f"{what}: lora_B has shape {tuple(b.shape)}; expected [{out_features}, {rank}] "
                           f"(the {'slice' if index is not None else 'layer'}'s out features, lora_A's rank)")


def _fold_slices(layer, slices, source):
    """(per-slice (A, B) in the layer's dtype or None, layer scale, layer rank). A factor finite in its file
    but not in the layer's dtype (a float32 value past float16's range) is an error, as a NaN in the file is."""
    used = [s for s in slices if s is not None]
    rank = max(s[2] for s in used)
    scale = max((s[3] for s in used), key=abs)
    dtype = layer.lora_a.dtype
    prepared = []
    for s in slices:
        if s is None:
            prepared.append(None)
            continue
        a, b, _, slice_scale, path = s
        ratio = slice_scale / scale if scale != 0 else 0.0
        b = b.float() * ratio if ratio != 1.0 else b
        # (Copies, always: write_slot clears the slot first, and the source may be a view of it, as a
        # replace=True load of the slot's own tensors is.)
        a, b = a.detach().to(dtype, copy=True), b.detach().to(dtype, copy=True)
        for factor, t in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"{source}: {path!r}: {factor} does not fit the layer's dtype {dtype} (values "
                                   f"overflow to infinity when cast)")
        prepared.append((a, b))
    return prepared, scale, rank


def _check_stacks_writable(ctx, what):
    """Loads and unloads write the layers' lora_a / lora_b in place: a parametrized one (torch.nn.utils.
    parametrize) reads as the parametrization's computed tensor, and the writes went there and were lost (the
    slot kept the previous adapter's factors under the new name)."""
    for path, layer in ctx.layers.items():
        for stack in ("lora_a", "lora_b"):
            if getattr(layer, stack).is_inference():     # (checked before any write: a failure halfway lost a slot)
                raise AdapterError(f"{what}: {stack} of {path!r} is an inference tensor (made under "
                                   f"torch.inference_mode), which cannot be written outside it")
            if torch.nn.utils.parametrize.is_parametrized(layer, stack):
                raise AdapterError(f"{what}: {stack} of {path!r} is parametrized (torch.nn.utils.parametrize): a "
                                   f"load or unload would write the parametrization's output, not the parameter; "
                                   f"remove the parametrization to change the adapters")


def _write(ctx, slot, name, plan):
    """The only writes: every layer's slot (cleared where the adapter has no weights), then the name."""
    for layer in ctx.layers.values():
        if layer in plan:
            layer.write_slot(slot, *plan[layer][:3])
        else:
            layer.clear_slot(slot)
    key = slot_key(name)
    for layer in ctx.layers.values():    # (every layer: the state dict's record of which name the slot holds)
        # (one slot a name: an unnamed slot a checkpoint filled may carry this name's key from then)
        layer.slot_keys.masked_fill_(layer.slot_keys == key, 0)
        layer.slot_keys[slot] = key
    ctx.slot_names[slot] = name


def slot_key(name):
    """A nonzero int64 naming adapter ``name`` in the state dict (LoRALinear.slot_keys); 0 for no adapter."""
    if name is None:
        return 0
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True) or 1


def _slot_record(ctx, attr):
    """One of the context's {slot: ...} records (a context built by hand, or pickled before it had it, may lack
    it): ``adapter_configs`` (the config each slot was loaded with) or ``adapter_fused_sources`` (the packed
    layers its adapter targeted as one module)."""
    if not hasattr(ctx, attr):
        setattr(ctx, attr, {})
    return getattr(ctx, attr)


def _configs(ctx):
    return _slot_record(ctx, "adapter_configs")


def _folded_layers(ctx):
    return _slot_record(ctx, "adapter_folded_layers")


def _configs_changed(ctx, slot=None):
    """An open trainer's per-slot dropout and tied slices follow the adapters as they are loaded and unloaded;
    an adapter loaded into one of its slots (``slot``: load_adapter(replace=True)) warns as train_slots does
    of folded scales."""
    trainer = getattr(ctx, "trainer", None)
    if trainer is not None:
        trainer.refresh_dropout()
        trainer.refresh_ties()
        if slot in trainer.slots:
            from lora_ops.training import _warn_folded_scales
            _warn_folded_scales(ctx, [ctx.slot_names[slot]], [slot], "load_adapter")


def _fused_sources(ctx):
    return _slot_record(ctx, "adapter_fused_sources")


# ---- saving --------------------------------------------------------------------------------------------

def save_peft_adapter(ctx, name, directory):
    """Write the slot of adapter ``name`` as a PEFT adapter directory; returns the directory.

    ``adapter_model.safetensors`` holds ``base_model.model.<module>.lora_A.weight [r, in]`` and
    ``.lora_B.weight [out, r]`` in the stacks' dtype. A packed layer is saved in the form the adapter was
    loaded in: split back into its projections (a slice with all-zero factors, i.e. a projection the adapter
    does not target, is left out), or, where the adapter targeted the packed module itself (Phi-3's
    ``qkv_proj``: PEFT on that model has no ``q_proj``), as that module: at its rank while every slice holds
    the same ``lora_A`` (as loaded), else at the slices' ranks summed, ``lora_A`` the slices' stacked and
    ``lora_B`` block-diagonal (the same function; reloading it here needs that rank's capacity).
    ``adapter_config.json``: ``r`` / ``lora_alpha`` the most common rank and alpha across modules, with
    ``rank_pattern`` / ``alpha_pattern`` for the others (keys ``^`` + the escaped module path: each matches its
    module alone, under PEFT's suffix matching too); ``use_rslora`` and ``lora_dropout`` as loaded. Each module's
    alpha is its slot scale times r (or sqrt(r) for rsLoRA), so PEFT computes the scale the slot computes with.
    A packed layer stores one rank for all its slices (the largest), so its slices are saved at that rank,
    zero-padded, with the folded scale; the function is the same. Reloading the directory with
    :func:`load_peft_adapter` reproduces the slot.
    """
    slot = ctx.slot_of(name) if name is not None else None
    if slot is None:
        raise AdapterError("save_peft_adapter: expected an adapter name, got None")
    loaded = _configs(ctx).get(slot, {})
    use_rslora = bool(loaded.get("use_rslora"))
    modules = _saved_modules(ctx, slot)
    if not modules:
        raise AdapterError(f"save_peft_adapter: adapter {name!r} has no weights in any layer")
    ranks = {path: a.shape[0] for path, (a, _, _) in modules.items()}
    alphas = {path: _alpha(scale, ranks[path], use_rslora) for path, (_, _, scale) in modules.items()}
    r, alpha = _most_common(ranks.values()), _most_common(alphas.values())
    config = {
        "peft_type": "LORA", "task_type": loaded.get("task_type"),
        "base_model_name_or_path": loaded.get("base_model_name_or_path"),
        "r": r, "lora_alpha": alpha, "use_rslora": use_rslora,
        "rank_pattern": {_exact_path_key(p): v for p, v in ranks.items() if v != r},
        "alpha_pattern": {_exact_path_key(p): v for p, v in alphas.items() if v != alpha},
        "target_modules": sorted(modules), "lora_dropout": float(loaded.get("lora_dropout") or 0.0),
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
    }
    tensors = {}
    for path, (a, b, _) in modules.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.detach().cpu().contiguous().clone()
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.detach().cpu().contiguous().clone()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    from safetensors.torch import save_file
    save_file(tensors, os.path.join(directory, SAFETENSORS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return directory


def _exact_path_key(path):
    """A rank_pattern / alpha_pattern key that matches module ``path`` alone. PEFT (and _pattern_value) match a
    key against every path that ends in it at a dot, so a bare path would also claim the paths it ends
    (``0`` those of ``2.0``, ``o_proj`` those of ``x.o_proj``); ``^`` pins the match to the path's start."""
    return "^" + re.escape(path)


def _saved_modules(ctx, slot):
    """{module path: (A [r, in], B [out, r], scale)} of every module where the slot has weights."""
    slice_paths = {}
    for path, (layer, index) in ctx.targets.items():
        if index is not None:
            slice_paths.setdefault(layer, {})[index] = path
    modules = {}
    fused = _fused_sources(ctx).get(slot, ())
    for path, layer in ctx.layers.items():
        r = layer.slot_ranks[slot]
        if r == 0:
            continue
        scale = float(layer.scale[slot])
        a, b = layer.lora_a[slot, :, :r], layer.lora_b[slot, :, :r]
        offsets = layer.slice_offsets
        if path in fused:
            modules[path] = (*_fused_factors(a, b, offsets), scale)
            continue
        named = slice_paths.get(layer, {0: path})
        for i, slice_path in sorted(named.items()):
            a_i, b_i = a[i], b[offsets[i]:offsets[i + 1]]
            if len(named) > 1 and not (a_i.any() or b_i.any()):
                continue
            modules[slice_path] = (a_i, b_i, scale)
    return modules


def _fused_factors(a, b, offsets):
    """(A, B) of a packed layer's slot as one module: A [S, r, K] and B [N, r] as stored. One A when every
    slice holds the same (as a fused adapter loads); else A [S·r, K] and B [N, S·r] block-diagonal."""
    if all(torch.equal(a[0], a_i) for a_i in a[1:]):
        return a[0], b
    S, r = a.shape[0], a.shape[1]
    return a.reshape(S * r, a.shape[2]), torch.block_diag(*(b[offsets[i]:offsets[i + 1]] for i in range(S)))


def _alpha(scale, r, use_rslora):
    """lora_alpha giving ``scale`` at rank r; a float32 scale's roundoff is snapped to the nearest integer."""
    alpha = scale * (math.sqrt(r) if use_rslora else r)
    nearest = round(alpha)
    return int(nearest) if abs(alpha - nearest) <= 1e-5 * max(1.0, abs(alpha)) else alpha


def _most_common(values):
    values = list(values)
    return max(values, key=values.count)
