"""Training several adapters in one mixed batch: trainable slots, masked optimizer steps, per-slot dropout.

    ctx = lora_ops.apply_lora(model, ["q_proj", "v_proj"], max_loras=4, max_rank=8, max_tokens=256)
    for name in ("sql", "chat", "math"):
        lora_ops.training.add_trainable_adapter(ctx, name, r=8, lora_alpha=16, lora_dropout=0.05)
    trainer = ctx.train_slots(["sql", "chat", "math"])      # freezes the base, hooks the stacks
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3, weight_decay=0.01)
    model.train()
    for batch in data:
        ctx.set_batch(batch.requests)                      # tokens of all three adapters (and none) mixed
        loss = loss_fn(model(batch.input_ids), batch.labels)
        loss.backward()
        trainer.step(optimizer)                            # only the chosen slots in this batch change
        optimizer.zero_grad()
    lora_ops.adapters.save_peft_adapter(ctx, "sql", "out/sql")

**Why a step helper and not only a gradient mask.** A layer's adapters live in two stacks
(``lora_a [L, S, R, K]``, ``lora_b [L, N, R]``), so the optimizer sees one tensor holding every slot.
Zeroing the gradients of the slots not trained is necessary (a slot serving requests in the same batch
gets real gradients) but not sufficient: AdamW's weight decay and any optimizer's momentum move a
parameter whose gradient is zero. So the trainer does both:

1. a gradient hook on each stack multiplies its gradient by the mask "chosen slot and rank column below
   the slot's rank", so gradient clipping and the optimizer's moments see only the trained entries;
2. :meth:`SlotTrainer.step` snapshots the stacks, runs ``optimizer.step()``, then writes the snapshot
   back everywhere outside "chosen slot, within its rank, and trained since the last step"
   (``torch.where``: bit-identical, no host sync). A slot is trained when a backward since the last step gave
   it a gradient that is not all zero (the hooks note it): so a batch set once and trained on for many steps,
   batches ``per_row`` builds inside a compiled graph, and batches set under ``torch.no_grad()`` and trained
   on anyway all count, while an evaluation between steps does not, whatever grad mode its ``set_batch`` ran
   under (a server's ``set_batch`` then ``no_grad`` forward once counted: slots were noted when set with grad
   mode on). A chosen slot absent from the batches trained stays put, as it would with its own optimizer and
   ``zero_grad(set_to_none=True)``; so does one whose tokens all fell out of the loss (a zero gradient), and
   so does a slot in a layer none of its tokens reached (an expert its router skipped): noted per layer.

The hooks follow the stacks: ``load_state_dict(assign=True)`` and a conversion that overwrites parameters
(``torch.__future__.set_overwrite_module_params_on_conversion``) hook the new ones
(:meth:`SlotTrainer.follow_stacks`); a stack replaced by hand is named at ``step``.

The cost is one copy of the stacks per step (small next to the base weights). Not claimed: equality with
one optimizer per adapter for stateful optimizers; the step count and moments are per stack, so a slot
trained on fewer steps than its stack has taken sees different bias corrections. The optimizer must be
elementwise: one that scales a tensor's update by the tensor's own norm (Adafactor, refused in
:meth:`SlotTrainer.step`; LAMB, LARS) would mix every slot of the stack into each slot's step. Its state is
per stack and so per slot id, not per adapter name: to resume from ``optimizer.state_dict()``, load the
adapters into the slots they had (the same load order) before ``optimizer.load_state_dict``. Gradients are per slot
exactly (tests/test_training.py checks them against PEFT trained one adapter at a time). An adapter whose
slices of a packed layer were loaded with different scales (``alpha_pattern`` across q/k/v of one fused
layer) holds each slice's ratio to the largest folded into its ``lora_B`` (lora_ops.adapters): the forward
is PEFT's, but the optimizer trains the rescaled factor (each slice's effective learning rate differs from
PEFT's by the ratio), and :func:`train_slots` warns of it. An adapter that targeted a packed layer as one
module (PEFT on Phi-3's ``qkv_proj``) holds a copy of its one lora_A in each slice: the first copy's gradient
is the slices' sum, PEFT's gradient of that A, the others' zero, and each step copies the first into the
others, so it trains as PEFT's, clipped alike (:meth:`SlotTrainer.refresh_ties`).

**Dropout.** In training mode (``model.train()``), while a trainer is open (the table is its: a model in
training mode with no trainer applies none), each token's LoRA input is ``dropout(x, p)`` with the
``lora_dropout`` of its slot's adapter config (PEFT's semantics: only the adapter sees the dropped x;
the base layer sees x). The per-token probabilities come from a ``[L + 1]`` table gathered by the
context's per-token slots, so it stays one elementwise op with no host sync, and compiles once. A packed
layer draws one mask for all its slices (its shrink reads one x): projections packed from separate modules
(``packed_modules``), each of which PEFT gives a dropout of its own, see the same mask, so their noise is
correlated where PEFT's is independent (the same expectation and per-element probability; a module PEFT
targets whole, Phi-3's ``qkv_proj``, draws one mask in PEFT too).

**torch.compile.** Compile the model's forward and loss (``fullgraph=True``) and call ``.backward()`` on
the result: AOTAutograd compiles the backward too. The hooks run in the autograd engine on the leaf
stacks, outside the compiled graphs; the step helper is eager.
"""
import math
import re
import warnings
import weakref

import torch


def _on(t, device):
    """``t`` on ``device`` (a model split across devices: the context's tensors meet a layer's). Without a
    host sync to a GPU; to the CPU the copy must complete before the host reads it."""
    return t if t.device == device else t.to(device, non_blocking=device.type == "cuda")


def slot_dropout(x2d, dropout_p, token_slots):
    """``x2d`` [M, K] with each row dropped out at its slot's probability (PEFT's nn.Dropout per adapter).

    ``dropout_p`` [L + 1] float32 (entry L: tokens with no adapter, p = 0); ``token_slots`` the context's
    per-token slot buffer (its first M entries are this batch's, -1 for no adapter).
    """
    M = x2d.shape[0]
    dropout_p = _on(dropout_p, x2d.device)     # (a split model's layer: on another device than the context)
    slots = token_slots[:M].long()
    slots = torch.where(slots < 0, dropout_p.shape[0] - 1, slots)
    p = dropout_p[slots][:, None]                                       # [M, 1] float32
    # Drawn and compared in float32, as torch's dropout draws: a bfloat16 draw (8 bits) against p rounded to
    # bfloat16 dropped p = 0.05 at ~0.052.
    keep = torch.rand(x2d.shape, device=x2d.device, dtype=torch.float32) >= p
    # p == 1 drops everything (1 / (1 - p) would be inf times zero). The kept rows scaled in float32, rounded
    # once (1 / (1 - p) rounded to bfloat16 first scaled them ~0.2% off at p = 0.05).
    factor = torch.where(p < 1, 1.0 / (1.0 - p).clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return (x2d * keep * factor).to(x2d.dtype)


def add_trainable_adapter(ctx, name, r, lora_alpha, *, target_modules=None, use_rslora=False, lora_dropout=0.0,
                          generator=None):
    """Load a fresh adapter ``name`` with PEFT's default initialisation (A uniform in ±1/sqrt(in_features),
    as nn.Linear's kaiming-uniform init, B zero: the adapter starts as a no-op); returns its slot.

    ``target_modules``: PEFT-style names or paths among the context's modules (a list; a string is a regex
    matching whole paths, ``"all-linear"`` every module but the model's output layer, as in PEFT); default all
    of them, a packed layer's slices as their projections. A packed layer's own name (Phi-3's ``qkv_proj``), matched by
    ``target_modules``, makes the adapter target that module as PEFT on that model does: one ``lora_A`` for
    all its slices (trained tied; saved as that module, which PEFT loads into the packed model). Its
    projections' names (``q_proj``, ...) give one A a slice, saved under the projections' names (the unpacked
    model's modules). ``use_rslora``: scale lora_alpha /
    sqrt(r) instead of lora_alpha / r; ``lora_dropout``: the adapter's dropout probability in training
    (PEFT's); ``generator``: a torch.Generator for A's initialisation (reproducible adapters).
    """
    from lora_ops.layers import ALL_LINEAR, _check_positive_int, _matches     # layers imports this module

    _check_positive_int("r", r)     # (2.7 was truncated to 2; -1 failed inside torch.empty)
    asked = target_modules
    if isinstance(target_modules, str) and target_modules == ALL_LINEAR:
        target_modules = _all_linear_paths(ctx)
    config = {"peft_type": "LORA", "r": int(r), "lora_alpha": lora_alpha, "use_rslora": bool(use_rslora),
              "lora_dropout": float(lora_dropout), "bias": "none", "rank_pattern": {}, "alpha_pattern": {}}
    tensors, done = {}, set()
    # Packed layers targeted by their own name: one A for the module (the slices' names then select nothing
    # more of it).
    whole = {id(layer): path for path, (layer, index) in ctx.targets.items()
             if index is None and len(layer.slice_widths) > 1 and target_modules is not None
             and _matches(target_modules, path)}
    for path, (layer, index) in ctx.targets.items():
        packed = len(layer.slice_widths) > 1
        if id(layer) in whole and (index is not None or whole[id(layer)] != path):
            continue        # a slice (or another name) of a packed layer targeted whole
        if index is None and packed and id(layer) not in whole:
            continue        # a packed layer's own name: its slices are the modules
        if (id(layer), index) in done:
            continue        # another name of a module registered twice (apply_lora targets each)
        if id(layer) not in whole and target_modules is not None and not _matches(target_modules, path):
            continue
        done.add((id(layer), index))
        out_features = layer.out_features if index is None else layer.slice_widths[index]
        bound = 1.0 / math.sqrt(layer.in_features)
        a = torch.empty(int(r), layer.in_features).uniform_(-bound, bound, generator=generator)
        tensors[f"{path}.lora_A.weight"] = a
        tensors[f"{path}.lora_B.weight"] = torch.zeros(out_features, int(r))
    if not tensors:
        as_name = (isinstance(asked, str) and asked != ALL_LINEAR
                   and any(_matches([asked], path) for path in ctx.targets))
        hint = (f" (a string is a regex that must match a whole module path, as in PEFT; for the modules of that "
                f"name pass a list: [{asked!r}])") if as_name else ""
        raise ValueError(f"target_modules: {asked!r} selects none of the context's modules{hint}")
    config["target_modules"] = sorted({key.rsplit(".", 2)[0].rpartition(".")[2] for key in tensors})
    return ctx.load_adapter_tensors(name, tensors, config)


def _all_linear_paths(ctx):
    """PEFT's ``"all-linear"`` among the context's modules: every one (a packed layer's slices as their
    projections) but the model's output layer (``get_output_embeddings``), which PEFT leaves out."""
    from lora_ops.layers import _output_layer     # layers imports this module
    model = ctx.model()
    output = _output_layer(model) if model is not None else None
    paths = [path for path, (layer, index) in ctx.targets.items()
             if (index is not None or len(layer.slice_widths) == 1)
             and (output is None or output not in (layer, layer.base))]
    # (a regex of the whole paths: a list entry also selects the paths ending in it, an output layer at
    # "head.proj" for a module at "proj")
    return "|".join(re.escape(path) for path in paths) or "(?!)"


class SlotTrainer:
    """Trains the slots of ``names`` in every LoRALinear of ``ctx``; see the module docstring.

    On creation: every parameter of the context's model but the LoRA stacks is frozen (``requires_grad=False``,
    as PEFT does) unless ``freeze_base=False``; this context's stacks require grad and carry the gradient-mask
    hooks; the context's per-slot dropout table is filled from the adapters' configs. :meth:`close` (or leaving a
    ``with`` block) undoes the hooks, the stacks' ``requires_grad`` and the dropout table (the base stays
    frozen: unfreeze it yourself if you need to).

    **Data parallel** (DistributedDataParallel: every rank holds the whole stacks, gradients averaged over
    the ranks): a slot with tokens on any rank gets a gradient on every rank, so every rank must let the
    optimizer move it. ``process_group`` (default: the default group, where torch.distributed is initialised
    with more than one rank) ORs the ranks' "slots with tokens" in :meth:`step`, one small all-reduce; every
    rank of the group must then call ``step`` alike. Without it the ranks' stacks drift apart (tests:
    2 ranks, 3 steps). ``process_group=None`` keeps the ranks independent. Sharded parameters (FSDP) are not
    supported: ``step`` masks whole stacks.
    """

    def __init__(self, ctx, names, *, freeze_base=True, process_group="default"):
        names = [names] if isinstance(names, str) else list(names)   # (a string's characters are no names)
        if not names or any(n is None for n in names):
            raise ValueError(f"train_slots: expected one or more adapter names, got {names!r}")
        open_trainer = getattr(ctx, "trainer", None)
        if open_trainer is not None:
            # (Two trainers' gradient masks on one stack multiply to zero, and closing one freezes the stacks
            # under the other.)
            held = [ctx.slot_names[s] for s in open_trainer.slots]
            raise RuntimeError(f"train_slots: a trainer of this context is open (adapters {held!r}); close it "
                               f"(trainer.close(), or train in a `with ctx.train_slots(...)` block) first, or "
                               f"train every adapter with one train_slots call")
        self.ctx = ctx
        self.slots = [ctx.slot_of(n) for n in names]
        _warn_folded_scales(ctx, names, self.slots)
        L = ctx.max_loras
        self._chosen = torch.zeros(L, dtype=torch.bool, device=ctx.device)
        self._chosen[self.slots] = True
        self.process_group = process_group     # resolved at each step: the group may be set up later
        if freeze_base:
            _freeze_base(ctx)
        self._layers = list(ctx.layers.values())
        self._row_of = {layer: row for row, layer in enumerate(self._layers)}    # layer -> its row of _has_grad
        # Slots trained since the last step, per layer: given a gradient there that is not all zero (the hooks).
        # Per layer, not per slot alone: a layer none of a slot's tokens reached (an expert its router skipped,
        # served through set_token_slots) keeps that slot as it was, as its own optimizer would (no gradient).
        self._has_grad = torch.zeros(len(self._layers), L, dtype=torch.bool, device=ctx.device)
        self._tied = {}     # layer -> [L] bool: slots whose adapter targeted the packed layer as one module
        self.refresh_ties()
        self._hooks = {}    # (layer, "lora_a" / "lora_b") -> (the stack hooked, its C tensor, its hook's handle)
        self._replaced = weakref.WeakValueDictionary()    # id -> a stack follow_stacks replaced (step: stale)
        for layer in self._layers:
            self.follow_stacks(layer)
        ctx.dropout_p = _dropout_table(ctx)
        ctx.trainer = self

    # ---- public ----------------------------------------------------------------------------------------

    def follow_stacks(self, layer):
        """Hook ``layer``'s stacks where they are new tensors: ``load_state_dict(assign=True)`` and a conversion
        under ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` replace a layer's parameters,
        and the replacements had no hook: every slot took gradients, unmasked, and :meth:`step`, seeing no slot
        trained, restored them all (training did nothing, silently). The layer calls this after either. Also
        where the object stayed and its contents were swapped (``set_swap_module_params_on_conversion``: the hook
        went with the old contents). An optimizer built before holds the old stacks: :meth:`step` names them."""
        for role in ("lora_a", "lora_b"):
            stack = getattr(layer, role)
            held = self._hooks.get((layer, role))
            if held is not None and held[0] is stack and held[1] == stack._cdata:
                continue
            if held is not None:
                held[2].remove()
                if held[0] is not stack:
                    self._replaced[id(held[0])] = held[0]
                else:   # (the hooks dict stayed with the object, registered with the old contents: a new one)
                    stack._backward_hooks = None
            stack.requires_grad_(True)
            self._hooks[(layer, role)] = (stack, stack._cdata, stack.register_hook(self._grad_hook(layer, role)))

    def parameters(self):
        """The stacks of every layer (each holds all slots; only the chosen ones ever change)."""
        return [stack for layer in self._layers for stack in (layer.lora_a, layer.lora_b)]

    @torch.no_grad()
    def step(self, optimizer, scaler=None, closure=None):
        """``optimizer.step()`` (``scaler.step(optimizer)`` with a ``torch.amp.GradScaler``, which unscales
        the gradients and skips the step where one is inf or NaN; ``scaler.update()`` stays the caller's;
        ``optimizer.step(closure=closure)`` with a closure, which LBFGS needs: with one chosen slot only, its
        line search coupling the slots), then every entry outside the chosen slots (within their ranks) that
        had tokens since the last step is restored bit for bit. Returns what the optimizer's step returns (the
        closure's loss)."""
        _check_elementwise(optimizer, len(self.slots))
        self._check_hooked()
        self._check_optimizer_current(optimizer)
        snapshots = [p.detach().clone() for p in self.parameters()]
        # (closure= by keyword: GradScaler.step refuses a closure only by that name)
        kwargs = {} if closure is None else {"closure": closure}
        if scaler is None:
            out = optimizer.step(**kwargs)
        else:
            out = scaler.step(optimizer, **kwargs)
        seen = self._has_grad
        group = _data_parallel_group(self.process_group)
        if group is not None:   # a slot with tokens on any rank moves on every rank
            seen = seen.to(torch.uint8)
            torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX, group=group)
            seen = seen.bool()
        for layer, layer_seen in zip(self._layers, seen):
            updatable = self._trainable(layer) & _on(layer_seen, layer.rank.device)[:, None]   # [L, R]
            for stack, mask in ((layer.lora_a, updatable[:, None, :, None]), (layer.lora_b, updatable[:, None, :])):
                stack.copy_(torch.where(mask, stack, snapshots.pop(0)))
            tied = self._tied.get(layer)
            if tied is not None:    # the other slices' copies of a fused module's A follow the first's
                a = layer.lora_a
                a.copy_(torch.where(tied[:, None, None, None], a[:, :1].expand_as(a), a))
        self._has_grad.zero_()
        return out

    def close(self):
        """Stop training: remove the gradient hooks and freeze the stacks again (the context
        takes a new trainer after this)."""
        for *_, handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        freeze_stacks(self.parameters())
        self.ctx.dropout_p = None
        if getattr(self.ctx, "trainer", None) is self:
            self.ctx.trainer = None

    def refresh_dropout(self):
        """The context's per-slot dropout table from the adapters' configs again (one was loaded, replaced or
        unloaded while this trainer is open). In place where the table stays: compiled code and captured
        graphs read the same tensor."""
        table, current = _dropout_table(self.ctx), self.ctx.dropout_p
        if current is None or (table is not None and current.shape != table.shape):
            self.ctx.dropout_p = table
        elif table is None:
            current.zero_()     # (no adapter keeps a dropout: zeros, as a captured graph reads this tensor)
        else:
            current.copy_(table)

    def refresh_ties(self):
        """Which slots of each packed layer hold an adapter that targeted it as one module (PEFT on Phi-3's
        ``qkv_proj``: one lora_A for every slice, copied into each slice's A as it loads). Their gradient hook
        gives the first slice's copy the sum of the slices' gradients, the one A's gradient in PEFT, and the
        others none, so gradient clipping's norm and GradScaler's check count it once, as PEFT's; :meth:`step`
        then copies the first slice's A into the others (each slice trained its own copy: after one step the
        model was no longer PEFT's, and saving wrote rank S·r). Called on load and unload while the trainer is
        open."""
        paths = {layer: path for path, layer in self.ctx.layers.items()}
        fused = getattr(self.ctx, "adapter_fused_sources", {})
        self._tied = {}
        for layer in self._layers:
            slots = [slot for slot, sources in fused.items() if paths.get(layer) in sources]
            if slots:
                tied = torch.zeros(self.ctx.max_loras, dtype=torch.bool, device=layer.rank.device)
                tied[slots] = True
                self._tied[layer] = tied

    def forget_slot(self, slot):
        """Stop training ``slot`` (its adapter was unloaded): an adapter loaded there later is not this
        trainer's, and step() restores it as any slot not chosen (the optimizer's moments for the stack
        would otherwise have moved it)."""
        self._chosen[slot] = False
        if slot in self.slots:
            self.slots.remove(slot)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- masks -----------------------------------------------------------------------------------------

    def _trainable(self, layer):
        """[L, R] bool: chosen slot and rank column below the slot's current rank (read on the device)."""
        device = layer.rank.device
        columns = torch.arange(layer.max_rank, device=device)
        return _on(self._chosen, device)[:, None] & (columns < layer.rank[:, None])

    def _check_hooked(self):
        """Every layer's stacks still the ones hooked (:meth:`follow_stacks`): a parameter replaced some other way
        (assigned by hand) took its gradients unmasked."""
        for layer in self._layers:
            for role in ("lora_a", "lora_b"):
                stack, cdata, _ = self._hooks[(layer, role)]
                if stack is not getattr(layer, role) or cdata != stack._cdata:
                    path = next((p for p, l in self.ctx.layers.items() if l is layer), "?")
                    raise RuntimeError(f"SlotTrainer.step: layer {path!r}'s {role} was replaced since the trainer "
                                       f"opened, and its gradients were not masked to the trained slots; call "
                                       f"trainer.follow_stacks(layer) after replacing it (load_state_dict and "
                                       f"module conversions do), then run the forward and backward again")

    def _check_optimizer_current(self, optimizer):
        """An optimizer built before load_state_dict(assign=True) replaced the stacks steps the old ones: nothing
        trained moved, silently."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self._replaced.get(id(p)) is p:
                    raise RuntimeError("SlotTrainer.step: the optimizer holds LoRA stacks that load_state_dict("
                                       "assign=True) or a conversion replaced since it was built, so the trained "
                                       "ones would not move; build the optimizer over trainer.parameters() again")

    def _grad_hook(self, layer, role):
        is_a = role == "lora_a"
        seen = self._has_grad[self._row_of[layer]]

        def hook(grad):
            mask = self._trainable(layer)
            mask = mask[:, None, :, None] if is_a else mask[:, None, :]
            # (Select, never multiply: a NaN or inf in a slot not trained, NaN times 0, reached the trained
            # slots through gradient clipping's norm and GradScaler's skip.)
            grad = torch.where(mask, grad, 0)
            tied = self._tied.get(layer) if is_a else None
            if tied is not None:   # (refresh_ties: the first slice's copy takes the one A's gradient)
                lead = torch.cat([grad.sum(1, keepdim=True), torch.zeros_like(grad[:, 1:])], 1)
                grad = torch.where(tied[:, None, None, None], lead, grad)
            seen.logical_or_(_on(grad.flatten(1).any(1), seen.device))   # (any: non-zero, no temporary)
            return grad
        return hook


def _freeze_base(ctx):
    """train_slots' freeze_base: every parameter of the context's model but the LoRA stacks, this context's (the
    trainer makes them trainable) and another's (a model with two contexts: its open trainer's stacks stayed
    frozen under the second one, silently); without the model (collected), the bases of the context's layers."""
    from lora_ops.layers import LoRALinear     # layers imports this module
    model = ctx.model()
    modules = list(model.modules()) if model is not None else list(ctx.layers.values())
    stacks = {id(p) for m in modules if isinstance(m, LoRALinear) for p in (m.lora_a, m.lora_b)}
    params = model.parameters() if model is not None else (p for m in modules for p in m.base.parameters())
    for p in params:
        if id(p) not in stacks:
            p.requires_grad_(False)


def freeze_stacks(stacks):
    """LoRA stacks back as they are without a trainer: frozen, no gradient kept (a trainer's close, and a copy of
    a layer taken while one was open)."""
    for stack in stacks:
        stack.requires_grad_(False)
        stack.grad = None


def _warn_folded_scales(ctx, names, slots, caller="train_slots"):
    """train_slots (and a load into a slot it trains) warns of an adapter whose slices of a packed layer carry
    folded scale ratios (see the module docstring): its stored lora_B is not the factor PEFT trains."""
    folded = getattr(ctx, "adapter_folded_layers", {})
    for name, slot in zip(names, slots):
        paths = folded.get(slot)
        if paths:
            warnings.warn(
                f"{caller}: adapter {name!r} was loaded with different scales for the slices of the packed "
                f"layer(s) {sorted(paths)!r} (lora_alpha / alpha_pattern / rank_pattern per projection): each "
                f"slice's ratio to the largest scale is folded into its lora_B, so the optimizer trains that "
                f"rescaled factor (the same forward, but each slice's effective learning rate differs from "
                f"PEFT's by the ratio: 1/ratio under Adam, 1/ratio² under SGD). To train as PEFT does, wrap the "
                f"projections as separate layers (apply_lora without packed_modules for them)", stacklevel=3)


def train_slots(ctx, names, *, freeze_base=True, process_group="default"):
    """A :class:`SlotTrainer` for the adapters ``names`` of ``ctx``."""
    return SlotTrainer(ctx, names, freeze_base=freeze_base, process_group=process_group)


def _check_elementwise(optimizer, num_chosen):
    """Refuse Adafactor (torch's, transformers', any class of that name): its step size and update clipping take
    each parameter's whole RMS, and a stack holds every slot, so the other slots' weights (frozen, empty,
    padding) entered the trained slots' updates: wrong values, silently. LBFGS's line search takes dot products
    over all parameters: refused for more than one chosen slot (an adapter trained beside another moved by up to
    8 against alone). Other optimizers that are not elementwise (LAMB, LARS: a trust ratio per tensor) do the
    same and cannot all be named here; the README says so."""
    name = type(optimizer).__name__
    if name == "Adafactor":
        raise TypeError(f"SlotTrainer.step: {type(optimizer).__module__}.Adafactor scales each update by the whole "
                        f"parameter's RMS, and a layer's stack holds every slot, so other slots' weights would "
                        f"change the trained ones' steps; use an elementwise optimizer (AdamW, SGD, RMSprop, ...)")
    if isinstance(optimizer, torch.optim.LBFGS) and num_chosen > 1:
        raise TypeError(f"SlotTrainer.step: LBFGS's line search couples every parameter, and a layer's stack holds "
                        f"all {num_chosen} trained slots, so each adapter's step would depend on the others; train "
                        f"one adapter a trainer with LBFGS, or use an elementwise optimizer (AdamW, SGD, ...)")


def _data_parallel_group(process_group):
    """SlotTrainer's group: the default group where torch.distributed runs more than one rank, for "default"."""
    if not (isinstance(process_group, str) and process_group == "default"):
        return process_group
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def _dropout_table(ctx):
    """[L + 1] float32 dropout probabilities per slot (the adapter config's lora_dropout), or None if all 0."""
    configs = getattr(ctx, "adapter_configs", {})
    p = [float(configs.get(slot, {}).get("lora_dropout") or 0.0) for slot in range(ctx.max_loras)] + [0.0]
    if not any(p):
        return None
    return torch.tensor(p, dtype=torch.float32, device=ctx.device)
