"""LoRALinear, the batch context all of a model's LoRA layers share, and the helper that applies them.

    ctx = lora_ops.apply_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj"],
                              max_loras=8, max_rank=16, max_tokens=512)
    ctx.load_adapter("sql", "adapters/sql")           # a PEFT directory into a free slot (lora_ops.adapters)
    ctx.set_batch([("sql", 5), (None, 3), ("sql", 2)])  # per step: each request's adapter and token count
    logits = model(input_ids)                          # every LoRALinear reads the same metadata

Data, per layer (L = max_loras slots, S output slices, R = max_rank, K/N the base's in/out features):
``lora_a [L, S, R, K]`` and ``lora_b [L, N, R]`` (slices stacked along N) as ``nn.Parameter``s with
``requires_grad=False`` (until ``ctx.train_slots``), ``scale [L]`` float32 and ``rank [L]`` int32
buffers. A slot of rank 0 does no work. Adapters are written in place (``copy_`` into slices of the
stacks), so data pointers never move and a captured CUDA graph or a compiled model keeps working
across adapter loads, unloads and swaps.

The hot path (:meth:`LoRALinear.forward`) is the base layer plus one op call: no host sync, no
``.item()``, no allocation that depends on data, and nothing mutable on the Python side, so
``torch.compile(fullgraph=True)`` compiles it once (see :class:`LoRAContext` for dynamic token counts
and batches of one token). Under ``torch.no_grad()`` / ``torch.inference_mode()`` that op adds the
delta into the base output in place; when autograd needs gradients through the layer (its input or
the stacks require grad) it is the out-of-place op, which has a backward.

Training (lora_ops.training): ``ctx.train_slots(names)`` freezes the base, makes the stacks require grad
and masks gradients and optimizer steps so that only the chosen slots change, several adapters trained
in one mixed batch; in ``model.train()``, while a trainer is open, each slot's adapter sees its own
``lora_dropout``.
``ctx.save_adapter(name, directory)`` writes a slot back as a PEFT adapter directory.
"""
import contextlib
import copy
import functools
import itertools
import math
import numbers
import re
import sys
import warnings
import weakref
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.utils._python_dispatch import TorchDispatchMode

from lora_ops import adapters, configs, ops, training
from lora_ops.adapters import slot_key
from lora_ops import eager as eager_ops
from lora_ops.precision import autocast_cast, autocast_dtype
from lora_ops.batch import BatchMeta, LoRABatch, batch_meta_of, check_token_slots

ALL_LINEAR = "all-linear"


class BatchCopy(NamedTuple):
    """A batch as set_batch left it, for autograd: copies of the metadata and the per-token slots
    ([max_tokens]: its first num_tokens entries are the batch's), never written again; ``on_devices`` holds
    the same on each other device the context serves ({device: (metadata, per-token slots)})."""
    meta: BatchMeta
    token_slots: torch.Tensor
    num_tokens: int
    on_devices: dict


def _check_positive_int(name, value):
    """A capacity (max_loras, max_tokens, max_rank) or a fresh adapter's rank (training.add_trainable_adapter's r)
    is an int >= 1: not a float silently truncated, not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def _device(device):
    """``device`` as a torch.device, "cuda" with the current GPU's index (the key the context's buffers have)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _never_traced(cls, names):
    """Wrap methods of ``cls`` in torch.compiler.disable, once, at its first instance (decorating them at class
    definition imported torch._dynamo with lora_ops, ~0.7 s, for the functional API too): host work on the
    context, which a compiled function calling it runs outside its graph (Dynamo refused the compile markers
    set inside)."""
    if not cls.__dict__.get("_untraced", False):
        for name in names:
            setattr(cls, name, torch.compiler.disable(cls.__dict__[name]))
        cls._untraced = True


def _copy_buffers(meta, token_slots, src_meta, src_token_slots):
    """The batch's buffers ``src_*`` into another device's (no host sync but into CPU memory, which must wait)."""
    non_blocking = token_slots.device.type != "cpu"
    for dst, src in zip((*meta, token_slots), (*src_meta, src_token_slots)):
        dst.copy_(src, non_blocking=non_blocking)


class _PinnedStaging:
    """Pinned host buffers for per-token slots on their way to a GPU, reused round-robin.

    A non-blocking copy reads its pinned source later, when the stream reaches it. Each buffer has an
    event recorded after its copy, and is refilled only once that event has completed, which it has
    unless the host runs ``depth`` steps ahead of the GPU. That is a wait on an event (no device-wide
    synchronisation, and none at all in the usual case); it keeps a refill from racing an in-flight copy.
    """

    def __init__(self, capacity, depth=4):
        self._buffers = [torch.empty(capacity, dtype=torch.int32).pin_memory() for _ in range(depth)]
        self._copied = [torch.cuda.Event() for _ in range(depth)]
        self._next = 0

    def copy_to_device(self, host_slots, device_slots):
        """device_slots[:M] <- host_slots [M] (CPU), asynchronously, through a pinned buffer."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        self._copied[i].synchronize()       # returns at once for an event never recorded or long done
        buf = self._buffers[i][:host_slots.shape[0]]
        buf.copy_(host_slots)
        device_slots[:buf.shape[0]].copy_(buf, non_blocking=True)
        # On the stream the copy went to, the destination's current one: a context on another GPU than the
        # current one recorded the event on the current GPU's stream, which did not track the copy (a refill
        # could then overwrite the pinned buffer under it).
        self._copied[i].record(torch.cuda.current_stream(device_slots.device))

    def __reduce__(self):
        # The pinned buffers and events belong to this process and hold nothing worth keeping between
        # steps (CUDA events cannot be pickled or deep-copied): a copy of a model gets fresh ones.
        return type(self), (self._buffers[0].shape[0], len(self._buffers))


def _static_shape(t):
    """Mark a batch buffer's (or its copy's) shape static for torch.compile, and return it. Under
    torch.compile(dynamic=True) their lengths (max_tokens, max_loras + 1) were symbols of their own, and
    Dynamo's duck sizing gave an input dimension of the same size the same symbol: a first token count equal
    to either was tied to the buffer, and the next count compiled again (found by a probe)."""
    torch._dynamo.mark_static(t)
    return t


def _mark_buffers(tensors):
    """The batch buffers (a context's own or a device mirror's): never reallocated, so
    torch.compile(mode="reduce-overhead") reads them in place; their shapes static (:func:`_static_shape`).
    (Attributes of the tensors, which a copy of them does not carry.)"""
    for t in tensors:
        torch._dynamo.mark_static_address(t, guard=True)
        _static_shape(t)


class _TracedState:
    """What compiled code reads of a context with a dynamic length: the batch's token-count view and per_row's
    adapters a row. Reached through :data:`_TRACED` (a global), never through the model: Dynamo gives a tensor
    found through a module's attributes static shapes wherever a built-in nn module is on the path
    (``force_nn_module_property_static_shapes``), and a layer called from inside one (nn.TransformerEncoderLayer's
    linear1, or one held by a bare nn.Module()) compiled a graph for every token count, past the recompile
    limit, and refused an input marked dynamic."""
    __slots__ = ("batch_tokens", "rows")

    def __init__(self):
        self.batch_tokens = None
        self.rows = None


_TRACED = {}                    # LoRAContext._serial -> its _TracedState (dropped with the context)
_SERIALS = itertools.count()


class LoRAContext:
    """State shared by every :class:`LoRALinear` of a model: the slot table and the batch metadata.

    - **Slots.** ``max_loras`` slots, each empty or holding one named adapter across all layers.
      Occupancy lives here on the host (``slot_names``), so validating a load or a batch reads no
      device data. Load with :meth:`load_adapter` / :meth:`load_adapter_tensors`, free with
      :meth:`unload_adapter`.
    - **Batch.** One :class:`lora_ops.LoRABatch` whose buffers (capacity ``max_tokens``) are refilled
      in place each step by :meth:`set_batch` (per request) or :meth:`set_token_slots` (per token). Inside
      :meth:`per_row` each layer reads instead a batch built from its own input's rows (``model.generate``).
      Every layer's forward reads them, and its input, flattened to ``[M, K]``, must have the M
      tokens of the last call, in the same order. In a model split across devices (``device_map``) a layer on
      another device reads a copy of them there, refreshed at each fill (:meth:`serve_device`). The batch is
      this context's, so it serves one thread at a time (threads serving at once take a context each).

    **Autograd keeps each forward's batch.** A call that records autograd reads a copy of the metadata and the
    per-token slots that :meth:`set_batch` takes when grad mode is on (a few small copies per step, never
    written again), so a backward runs on its own forward's batch whatever ``set_batch`` calls came between:
    micro-batches may be interleaved (two forwards, then their backwards), a no-grad forward on another
    batch may run between a forward and its backward (a reference model in RL). A batch set under
    ``torch.no_grad()`` has no copy: a forward with autograd on it reads the buffers refilled in place, and
    autograd refuses its backward once they are refilled. Activation checkpointing recomputes a forward
    during the backward, after any later ``set_batch``: with ``torch.utils.checkpoint(...,
    use_reentrant=False, context_fn=ctx.checkpoint_context)`` the recompute reads the batch its forward
    read; without it, a recompute on another batch raises in the backward (it would give wrong gradients).
    Reentrant checkpointing (``use_reentrant=True``) cannot be checked: its recompute reads the current batch.

    **torch.compile.** The layers read only tensors that never change identity, shape or address (the
    stacks, ``scale``, ``rank`` and the metadata), so loads, unloads, swaps and new slot mappings never
    recompile; calls that record autograd read the batch's copy, a graph input of the same fixed shapes.
    Mark the token dimension dynamic (``torch._dynamo.mark_dynamic(input_ids, dim)``) and one compile
    serves every token count from 2 up. A batch of **one token** specialises (Dynamo
    treats sizes 0 and 1 as constants), which would compile a second graph. Two ways out:

    - pad a one-token step to two tokens with a request that has no adapter,
      ``ctx.set_batch([(name, 1), (None, 1)])``, and drop the pad's output (works for any model);
    - or ``torch._dynamo.decorators.mark_unbacked(x, dim)`` instead of ``mark_dynamic``: one graph for
      every size including 1, for models whose Python code does not branch on the token count (Hugging
      Face attention masks do, which is why padding is the general answer). For a causal LM put the pad
      last: the real token never attends to it.
    """

    # (Not inference tensors, even when built under torch.inference_mode: the batch buffers are refilled in
    # place, which torch refuses for an inference tensor outside that mode; the same for the layers' stacks.)
    @torch.inference_mode(False)
    def __init__(self, max_loras, max_tokens, device=None):
        _never_traced(LoRAContext, ("set_batch", "set_token_slots"))
        self._register_traced()
        _check_positive_int("max_loras", max_loras)
        _check_positive_int("max_tokens", max_tokens)
        self.device = _device(device)
        self.max_loras = int(max_loras)
        self.max_tokens = int(max_tokens)
        self.batch = LoRABatch(self.max_tokens, self.max_loras, device=self.device)
        # The layers read this tuple; its tensors are refilled in place, never replaced.
        self.meta = self.batch.meta
        self.token_slots = torch.full((self.max_tokens,), -1, dtype=torch.int32, device=self.device)
        # Never read: its views' lengths carry the batch's token count into compiled code (_set_batch_tokens).
        self._count_base = torch.empty(self.max_tokens + 2, dtype=torch.uint8, device=self.device)
        self._set_batch_tokens(0)
        self._staging = _PinnedStaging(self.max_tokens) if self.device.type == "cuda" else None
        self.slot_names = [None] * self.max_loras
        self.layers = {}      # module path -> LoRALinear
        self.targets = {}     # adapter module path -> (LoRALinear, slice index, or None for the whole layer)
        self._model = None    # weakref to the model apply_lora wrapped (for error messages)
        self.adapter_configs = {}   # slot -> the adapter config it was loaded with (saving, dropout)
        self.adapter_fused_sources = {}   # slot -> packed layers its adapter targeted as one module (saving)
        self.dropout_p = None       # [L + 1] per-slot lora_dropout while training (lora_ops.training)
        self._copy = None           # the batch's BatchCopy for autograd (set_batch with grad mode on)
        self._restored = None       # the BatchCopy a checkpoint's recompute reads (checkpoint_context)
        self._copies = 0            # BatchCopy serial numbers
        self.trainer = None         # the open lora_ops.training.SlotTrainer (train_slots), one at a time
        # per_row, while a block runs: {device served: each adapter's slot [len(adapters)]} (also read under
        # torch.compile, which builds the batches in the graph from it): the _rows property
        self._row_batches = {}      # per_row: (rows, tokens per row, device) -> (metadata, per-token slots)
        self._row_current = None    # per_row: the batch of the input check_input saw last
        self._row_shape = None      # per_row: (rows, tokens per row) of the last input with rows
        self.row_slots = frozenset()  # per_row: the slots its rows take, while a block runs
        # A model split across devices (Hugging Face's device_map): the batch's buffers on each other device a
        # layer is on, {device: (metadata, per-token slots)}, copied from this device's at each fill.
        self._mirrors = {}
        # context_fn for torch.utils.checkpoint: a partial, not a bound method, which torch.compile's
        # checkpoint cannot call (it loses self), nor a callable object (not supported there).
        self.checkpoint_context = functools.partial(_checkpoint_contexts, self)
        _mark_buffers((*self.meta, self.token_slots))

    def __getstate__(self):
        # torch.save of a whole model and copy.deepcopy reach the context through its layers. The model's
        # weakref cannot be pickled, and a deep copy must point at the copied model (training's freeze_base
        # and the error messages read it), so the state holds the model itself: both keep one object per id,
        # and the copy's model is the copy.
        state = dict(self.__dict__)
        del state["_serial"]            # (a copy or an unpickled context registers its own)
        state.pop("_copied_model", None)
        state["_model"] = self._model() if self._model is not None else None
        # An open trainer stays with the original: its gradient hooks are on the original's stacks, so the
        # copy's would be a trainer without them (unmasked gradients) that refuses a new train_slots.
        # A copy taken inside a per_row block is not in it: only the original's block ends (its finally).
        state.update(_row_batches={}, _row_current=None, _row_shape=None, row_slots=frozenset())
        if state.get("trainer") is not None:
            state["trainer"], state["dropout_p"] = None, None
        return state

    def __deepcopy__(self, memo):
        """As the default deep copy (:meth:`__getstate__`), but refused for part of the model: a block or layer
        copied alone reaches the context through its layers, and copying it copied the whole model into a
        private context that this context's set_batch and loads never reach (a block duplicated into the model
        kept serving the adapters and batch of the moment it was copied, silently). A part is told by the copy
        reaching the context through one of its layers before the model: a container holding a layer before
        the model (``[model[1], model]``) is refused too, the model first passes."""
        model = self._model() if self._model is not None else None
        if model is not None and id(model) not in memo:
            through = next((path for path, layer in self.layers.items() if id(layer) in memo), None)
            if through is not None:
                raise RuntimeError(
                    f"copy.deepcopy of part of a model wrapped by apply_lora (reached LoRALinear {through!r}): "
                    f"its layers belong to the whole model's LoRAContext, and the part's copy would take a private "
                    f"copy of the whole model and context, which set_batch and load_adapter here never reach. Copy "
                    f"the whole model (copy.deepcopy(model): the copy's context serves the copy; a container copied "
                    f"with it must hold the model before its parts), or copy blocks before apply_lora")
        new = LoRAContext.__new__(type(self))
        memo[id(self)] = new
        # (Not inference tensors, as __init__ makes none: a copy taken under torch.inference_mode had its batch
        # buffers and stacks made so, and set_batch and loads outside that mode failed on torch's message.)
        with torch.inference_mode(False):
            new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __setstate__(self, state):
        _never_traced(LoRAContext, ("set_batch", "set_token_slots"))    # (a context unpickled in a new process)
        self._register_traced()
        model = state.pop("_model")
        for stale in ("_serial", "_rows", "_batch_tokens"):    # (pickled before session 39: in the dict then)
            state.pop(stale, None)
        self.__dict__.update(state)
        self._model = weakref.ref(model) if model is not None else None
        # A copy holds its model: a context copied or unpickled alone (copy.deepcopy(ctx), torch.save(ctx))
        # copies the model with it, and through the weak reference alone the copy was collected at once (the
        # context's model() None, its loads and batches for layers no model runs). The original's stays weak;
        # a copy's cycle (model, layers, context) goes at Python's next cycle collection, as the layers' did.
        self._copied_model = model
        for layer in self.layers.values():      # (layers pickled before session 54, unpickled before this)
            if layer.__dict__.pop("_keys_pending", False):
                layer._keys_from_names()
        self._own_batch()
        if self.token_slots.is_inference():
            warnings.warn("LoRAContext: unpickled under torch.inference_mode (torch.load inside it): its batch buffers "
                          "and the layers' stacks are inference tensors, which set_batch and adapter loads can write "
                          "only inside that mode; load the model outside torch.inference_mode", stacklevel=2)
        _mark_buffers((*self.meta, self.token_slots))
        self._set_batch_tokens(self.batch.num_tokens)

    def _own_batch(self):
        """The batch buffers (set_batch's) as this context's own memory: torch.multiprocessing pickles tensors into
        shared memory, and a model sent to spawned workers (a DataLoader's too) had one batch for every process,
        each forward reading another's set_batch, silently (session 54). The adapter stacks stay shared, as
        torch shares parameters: load adapters in one process."""
        if not any(t.is_shared() for t in (*self.meta, self.token_slots)):
            return
        with torch.inference_mode(False):
            self.meta = self.batch.own_copies()
            self.token_slots = self.token_slots.clone()
            self._mirrors = {device: (BatchMeta(*[t.clone() for t in m]), slots.clone())
                             for device, (m, slots) in self._mirrors.items()}

    def _register_traced(self):
        self._serial = next(_SERIALS)
        _TRACED[self._serial] = _TracedState()
        weakref.finalize(self, _TRACED.pop, self._serial, None)

    @property
    def _batch_tokens(self):
        """The batch's token-count view (:meth:`_set_batch_tokens`)."""
        return _TRACED[self._serial].batch_tokens

    @property
    def _rows(self):
        """per_row's {device: each adapter's slot}, None outside a block."""
        return _TRACED[self._serial].rows

    @_rows.setter
    def _rows(self, rows):
        _TRACED[self._serial].rows = rows

    # ---- slots ---------------------------------------------------------------------------------------

    @property
    def adapters(self):
        """{adapter name: slot} of the loaded adapters."""
        return {name: slot for slot, name in enumerate(self.slot_names) if name is not None}

    def slot_of(self, name):
        """The slot of adapter ``name``; None stands for 'no adapter' (slot -1)."""
        if name is None:
            return -1
        try:
            return self.slot_names.index(name)
        except ValueError:
            loaded = ", ".join(repr(n) for n in self.adapters) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (loaded: {loaded})") from None

    def load_adapter(self, name, path, *, replace=False):
        """Load the PEFT adapter directory ``path`` into a free slot as ``name``; returns the slot.
        ``replace=True`` swaps the adapter already loaded as ``name`` in place (same slot), or loads it into a
        free slot where none is (load or replace). Not between a training forward and its backward: a load
        writes the stacks the backward reads, which autograd then refuses."""
        return adapters.load_peft_adapter(self, name, path, replace=replace)

    def load_adapter_tensors(self, name, tensors, config=None, *, replace=False):
        """Load a PEFT-style state dict (``...lora_A.weight`` / ``...lora_B.weight``) as ``name``."""
        return adapters.load_adapter_tensors(self, name, tensors, config, replace=replace)

    def unload_adapter(self, name):
        """Free ``name``'s slot (its weights are zeroed and its rank set to 0, in place). Tokens of the batch
        set now that took it take no adapter (-1): an adapter loaded into the freed slot later does not serve
        them unless a new batch names it."""
        adapters.unload_adapter(self, name)

    def _drop_from_batch(self, slot):
        """The batch set now, with ``slot``'s tokens moved to no adapter (device ops, no host sync)."""
        M = self.num_tokens
        if M:
            # (Autograd's copy of the batch again where set_batch took one, in normal tensors under inference_mode
            # too: later autograd forwards read it.)
            with torch.inference_mode(False), torch.set_grad_enabled(self._copy is not None):
                slots = self.token_slots[:M].clone()
                self._fill(slots.masked_fill_(slots == slot, -1))

    def _forget_adapters(self, why):
        """Unload every adapter, with a warning: the layers' slots no longer hold them (``why``)."""
        names = [name for name in self.slot_names if name is not None]
        if names:
            warnings.warn(f"LoRAContext: {why}: the adapter slots hold no data, and {names} are unloaded; load "
                          f"them again", stacklevel=3)
            for name in names:
                adapters.unload_adapter(self, name)

    def model(self):
        """The model the context wraps (held weakly: None once it is gone)."""
        return self._model() if self._model is not None else None

    def train_slots(self, names, *, freeze_base=True, process_group="default"):
        """Make the adapters ``names`` trainable: a :class:`lora_ops.training.SlotTrainer` (its
        ``parameters()`` for the optimizer, its ``step(optimizer)`` changing only those slots; under
        DistributedDataParallel the same slots on every rank of ``process_group``)."""
        return training.train_slots(self, names, freeze_base=freeze_base, process_group=process_group)

    def save_adapter(self, name, directory):
        """Write adapter ``name`` as a PEFT adapter directory (lora_ops.adapters.save_peft_adapter)."""
        return adapters.save_peft_adapter(self, name, directory)

    def __repr__(self):
        loaded = {slot: name for slot, name in enumerate(self.slot_names) if name is not None}
        return (f"LoRAContext(max_loras={self.max_loras}, max_tokens={self.max_tokens}, device={self.device}, "
                f"layers={len(self.layers)}, adapters={loaded})")

    # ---- batch ---------------------------------------------------------------------------------------

    @property
    def num_tokens(self):
        """The token count of the batch set last (set_batch / set_token_slots)."""
        return self.batch.num_tokens

    def set_batch(self, requests):
        """Per step: ``requests`` = ``[(adapter name or None, num_tokens), ...]`` in the order their tokens
        appear in the flattened input (request-major: request 0's tokens, then request 1's, ...).

        Builds the per-token slots on the host and copies them through a pinned buffer, so no host
        synchronisation happens even on a GPU. Returns the token count.
        """
        self._refuse_in_rows("set_batch")
        # One dict lookup a request (a server's decode step has one request a token): a request that is not
        # a loaded name or None with an int count takes the checks below, which name what is wrong.
        slot_of = {name: slot for slot, name in enumerate(self.slot_names) if name is not None}
        slot_of[None] = -1
        slots, counts = [], []
        for i, request in enumerate(requests):
            try:
                name, n = request
                slot = slot_of[name]
            except (TypeError, ValueError, KeyError):
                name, n = _unpack_request(i, request)
                slot = self.slot_of(name)
            if type(n) is not int or n < 0:
                name, n = _unpack_request(i, request)
            slots.append(slot)
            counts.append(n)
        total = sum(counts)
        if total > self.max_tokens:
            raise ValueError(f"set_batch: {total} tokens exceed the context's capacity max_tokens={self.max_tokens}")
        host = torch.tensor(slots, dtype=torch.int32)
        if counts.count(1) != len(counts):   # (one token a request, as at decode: the slots as they are)
            host = torch.repeat_interleave(host, torch.tensor(counts, dtype=torch.int64), output_size=total)
        self._fill(host)
        return total

    def set_token_slots(self, token_slots):
        """Per step, per token: ``token_slots [M]`` int32/int64 slots in [-1, max_loras) (-1: no adapter),
        on the CPU or on this context's device. An empty slot behaves like -1 (rank 0)."""
        self._refuse_in_rows("set_token_slots")
        check_token_slots(token_slots, self.max_loras, self.max_tokens, self.device)
        self._fill(token_slots)
        return token_slots.shape[0]

    def _refuse_in_rows(self, what):
        # Inside per_row every layer takes its batch from its input's rows: a batch set there would be ignored.
        if self._rows is not None:
            raise RuntimeError(f"{what}: per_row is active on this context, and inside its block each layer takes "
                               f"its batch from its input's rows; call {what} after the block")

    @contextlib.contextmanager
    def per_row(self, adapters):
        """For code that steps the model itself, with no place to set each step's batch (Hugging Face
        ``generate``, evaluation harnesses): inside the block every layer takes its batch from its own input's
        rows, every token of row b to ``adapters[b]`` (an adapter name or None):

            with ctx.per_row(["sql", None, "chat"]):
                out = model.generate(input_ids, max_new_tokens=32)

        A layer's input is ``[rows, tokens, ..., features]``, row-major (Hugging Face models keep the batch
        dimension; flattened tokens ``[M, features]`` take the batch of the last input with rows, where it had
        M tokens, and a view of one token a row of it, ``[rows, features]`` (BERT's pooler), each row's
        adapter), so a prefill, each cached decode step, an encoder and a decoder (its cross-attention
        projections over the encoder's tokens included) each get the batch of their own shape, built once per
        shape in the block and never refilled. Rows may be a multiple k of ``len(adapters)``: beam search and
        ``num_return_sequences`` repeat each row k times in place, so each adapter takes k rows. Under
        torch.compile a layer builds its input's batch in the graph (:meth:`traced_row_batch`; flattened tokens
        as above), one graph for every number of rows. ``set_batch`` and ``set_token_slots`` raise inside the
        block. A backward after the block ends: a non-reentrant checkpoint with
        ``context_fn=ctx.checkpoint_context`` recomputes on the block's batches; without it the recompute
        reads the context's own batch and raises, and a reentrant one's cannot be checked (run its backward
        in the block)."""
        if isinstance(adapters, str):
            raise TypeError(f"per_row: adapters must be a list of adapter names (or None), one per row; got the "
                            f"string {adapters!r}")
        names = list(adapters)
        if not names:
            raise ValueError("per_row: adapters is empty; expected an adapter name or None per row")
        slots = [self.slot_of(name) for name in names]   # (a name not loaded raises here, not mid-generate)
        if self._rows is not None:
            raise RuntimeError("per_row: already active on this context")
        # One entry past the adapters (never read: _row_token_slots indexes below it), so that one adapter is a
        # length of 2: Dynamo specialises a dynamic length of 1, and one adapter for every row compiled graphs of
        # its own.
        host = torch.tensor(slots + [-1], dtype=torch.int32)
        self._rows = {device: host.to(device) for device in (self.device, *self._mirrors)}
        self.row_slots = frozenset(slots)   # (unload_adapter refuses these while the block runs)
        self._row_batches, self._row_current, self._row_shape = {}, None, None
        for t in self._rows.values():
            # Its length dynamic: a compiled generate then serves blocks of any number of rows with its graphs,
            # where a static length compiled two more (prefill, decode) for each new count, past Dynamo's
            # recompile limit after a few batch sizes.
            torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            yield self
        finally:
            self._rows, self._row_batches, self._row_current, self._row_shape = None, {}, None, None
            self.row_slots = frozenset()

    def _row_batch(self, x, layer):
        """per_row: the (metadata, per-token slots) for ``x`` [rows, tokens, ..., K], built on first use of its
        shape in the block (the buffers' shapes, capacity max_tokens or the input's tokens where more, so bound
        calls' plans apply; a serial of its own, so a
        backward that recomputes on another batch is refused as for set_batch's copies)."""
        rows, tokens = self._row_shape_of(x, layer)
        key = (rows, tokens, x.device)      # (a model split across devices: each device's own)
        found = self._row_batches.get(key)
        if found is None:
            slots = self._row_token_slots(self._rows[x.device], rows, tokens, layer)
            # Past max_tokens (a long prompt in generate) a batch of its own size: the compiled path computes
            # the batch in the graph with no capacity, and the two must serve the same inputs.
            capacity = max(self.max_tokens, rows * tokens)
            batch = LoRABatch(capacity, self.max_loras, device=x.device)
            token_slots = torch.full((capacity,), -1, dtype=torch.int32, device=x.device)
            token_slots[:rows * tokens].copy_(slots)
            batch.update(token_slots[:rows * tokens])
            found = self._row_batches[key] = (self._tag(batch.meta), token_slots)
        return found

    def traced_row_batch(self, x, layer):
        """per_row under torch.compile: (metadata, per-token slots) of ``x`` [rows, tokens, ..., K] computed in
        the graph from the adapters' slots (a few small ops; the layers of one input shape compute the same,
        which Inductor computes once). Their number is dynamic (per_row marks it): the graph guards on neither
        how many adapters there are nor which."""
        if torch.compiler._is_exporting_flag:
            # (The block's rows would be a constant of the program: later blocks and set_batch ignored, silently.)
            raise RuntimeError(f"{self._name(layer)}: torch.export inside ctx.per_row: the program would keep this "
                               f"block's adapters a row as a constant and ignore later blocks and set_batch; export "
                               f"outside per_row (the program then serves the batch set_batch sets)")
        rows, tokens = self._row_shape_of(x, layer)
        token_slots = self._row_token_slots(self._rows[x.device], rows, tokens, layer)
        return batch_meta_of(token_slots, self.max_loras), token_slots

    def _row_shape_of(self, x, layer):
        """per_row: (rows, tokens a row) of the layer input ``x`` [rows, tokens, ..., K], remembered; or, for
        flattened tokens [M, K] (Qwen2-MoE's shared expert, after a view(-1, hidden)), those of the last input
        with rows, where it had M tokens: nothing else says which row a token is in; or (rows, 1) for one token
        a row of it, [rows, K] (BERT's pooler), and then (rows, 1) for [rows, K] inputs after it (a classification
        head over the pooled token) until the next input with rows. Under torch.compile the
        shape remembered is the traced one (Dynamo carries the attribute through the graph), so the flattened
        layer's batch follows its block's input within one graph, whatever the prefill's length. An input of 3
        or more dimensions whose first is not its outer one in memory is refused: a transposed view, [tokens,
        rows, K] as Longformer's and LED's attention call their projections, whose tokens were taken for rows (a
        multiple of the adapters: beam copies) and served the wrong adapters, silently. Which of its dimensions
        holds the rows cannot be told from the shape."""
        if x.dim() >= 3:
            inner = zip(x.shape[1:-1], x.stride()[1:-1])
            if x.shape[0] > 1 and any(n > 1 and 0 < x.stride(0) < s for n, s in inner):
                raise ValueError(f"{self._name(layer)}: inside per_row the input {tuple(x.shape)} is a transposed "
                                 f"view (strides {tuple(x.stride())}): the layer is called sequence first, as "
                                 f"Longformer's and LED's attention call theirs, and its rows cannot be told from "
                                 f"its tokens. Such a model takes one adapter for the whole batch (set_batch)")
            self._row_shape = (x.shape[0], math.prod(x.shape[1:-1]))
            return self._row_shape
        if self._row_shape is not None and x.dim() == 2:     # (a 1-D input [K] has no row: its K is no count)
            rows, tokens = self._row_shape
            if x.shape[0] == rows * tokens:
                return self._row_shape
            if x.shape[0] == rows and x.stride(0) == tokens * x.shape[1] * x.stride(1):
                # One token a row, a view of the rows' input ([rows, tokens, K][:, i]: BERT's pooler takes each
                # row's first token; PEFT's "all-linear" adapts it): each takes its row's adapter. Only such a
                # view: a routed expert's gathered tokens (a tensor of their own) whose count equals the rows
                # would take wrong adapters silently. From here on the rows have one token each, until the next
                # input with rows: the head over the pooled token (BERT's and RoBERTa's classifier, which
                # "all-linear" adapts too, sees tanh(pooler(...)), a tensor of its own) takes its row's adapter.
                self._row_shape = (rows, 1)
                return self._row_shape
        raise ValueError(f"{self._name(layer)}: inside per_row a layer's input must be [rows, tokens, ..., "
                         f"features], the flattened tokens of the last such input, or one token a row of it "
                         f"[rows, features] (a view: input[:, i]), got shape {tuple(x.shape)} (no row is known for "
                         f"its tokens: a layer that sees some tokens of some rows cannot take per-row adapters, so "
                         f"leave it out of target_modules; for other inputs call set_batch instead)")

    def _row_token_slots(self, padded, rows, tokens, layer):
        """per_row: the slot of each of ``rows`` x ``tokens`` tokens, row-major, from ``padded`` [adapters + 1]
        (per_row's slots and one unread entry; a multiple k of the adapters in rows: each adapter takes k rows
        in a row, as beam search repeats them)."""
        adapters = padded.shape[0] - 1     # (no tensor of that length: its size-1 case would guard again)
        if rows % adapters:
            raise ValueError(f"{self._name(layer)}: the input has {rows} rows; per_row expects a multiple of "
                             f"its {adapters} adapters (one per row, or each repeated for beam search / "
                             f"num_return_sequences)")
        # Token i's adapter is i // (its tokens an adapter): an index, not repeat_interleave, whose broadcast
        # guards on a repeat count of 1 under torch.compile (one graph for rows == adapters, another for beams).
        return padded[torch.arange(rows * tokens, device=padded.device) // (rows // adapters * tokens)]

    def _fill(self, token_slots):
        M = token_slots.shape[0]
        # (Checked by the caller: set_token_slots, set_batch.)
        if self._staging is not None and token_slots.device.type == "cpu":
            self._staging.copy_to_device(token_slots, self.token_slots)
            self.batch._refill(self.token_slots[:M])
        else:
            # Slots on this device (or a CPU context's): the fill writes the per-token buffer as it reads them
            # (one launch, not a copy and then the fill), and a CUDA int64 slot past int32's range, which
            # nothing checks there, is served no adapter like any other outside [0, L), where a copy would
            # have wrapped it into one in range.
            self.batch._refill(token_slots, slots_out=self.token_slots)
        self._set_batch_tokens(M)
        for mirror in self._mirrors.values():
            _copy_buffers(*mirror, self.meta, self.token_slots)
        # (Not while a CUDA graph captures: graphs read the buffers, and the copy would be the graph's memory.)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self._copy = self._copy_batch() if torch.is_grad_enabled() and not capturing else None

    def _set_batch_tokens(self, num_tokens):
        """Keep a view of ``num_tokens`` + 2 elements, for compiled code to compare its input's token count
        with (:meth:`traced_check_input`). Marked dynamic, so that the comparison guards on the two counts being
        equal, not on either's value: one graph serves every count. Two longer than the batch: a dimension of
        size 0 or 1 is never dynamic, and its static guard would recompile the graphs of an input marked
        unbacked. A static address: CUDA graphs do not copy it."""
        view = self._count_base[:num_tokens + 2]
        torch._dynamo.maybe_mark_dynamic(view, 0)
        torch._dynamo.mark_static_address(view, guard=False)
        _TRACED[self._serial].batch_tokens = view

    def _copy_batch(self):
        """The batch as it is now, in tensors of its own (never written again; their shapes, strides and
        alignment those of the buffers), tagged with a serial number the backward checks (lora_ops.autograd)."""
        meta = self._tag(BatchMeta(*(_static_shape(t.clone()) for t in self.meta)))
        on_devices = {}
        for device, (mirror_meta, mirror_slots) in self._mirrors.items():
            copy = BatchMeta(*(_static_shape(t.clone()) for t in mirror_meta))
            copy.sorted_token_ids._lora_batch = meta.sorted_token_ids._lora_batch   # (one batch: one serial)
            on_devices[device] = (copy, _static_shape(mirror_slots.clone()))
        return BatchCopy(meta, _static_shape(self.token_slots.clone()), self.batch.num_tokens, on_devices)

    def _tag(self, meta):
        """``meta`` tagged with the next serial number: metadata never written again, which autograd's batch
        check tells from any other (lora_ops.autograd._check_batch)."""
        self._copies += 1
        meta.sorted_token_ids._lora_batch = self._copies
        return meta

    def batch_for(self, grad, x=None):
        """(metadata, per-token slots) a layer's call on ``x``'s device (default: the context's) reads: the
        checkpoint recompute's batch while one runs, else, where autograd records the call (``grad``), the
        batch's copy if set_batch took one, else the buffers refilled in place. (``x``, not its device: a
        one-device model's call never reads ``x.device``, which costs host time.)"""
        if self._rows is not None:
            return self._row_current      # (per_row: the batch of the input check_input saw, this call's)
        copy = self._restored
        # (Not while torch.export traces: a program reads the buffers set_batch refills, as inference does, not
        # one batch's copy, which would freeze the batch at export into it. The flag export sets, not
        # torch.compiler.is_exporting(): Dynamo in torch 2.11 answers that True while torch.compile traces too,
        # which made compiled training read the buffers and its backwards raise after the next set_batch.)
        if copy is None and grad and not torch.compiler._is_exporting_flag:
            copy = self._copy
        if self._mirrors and x is not None and x.device != self.device:
            return self._mirrors[x.device] if copy is None else copy.on_devices[x.device]
        return (self.meta, self.token_slots) if copy is None else (copy.meta, copy.token_slots)

    def meta_on(self, x):
        """The batch's metadata buffers (refilled in place) on ``x``'s device."""
        return self.meta if not self._mirrors or x.device == self.device else self._mirrors[x.device][0]

    def serve_device(self, device):
        """Keep the batch on ``device`` too, for layers there (a model split across devices, as Hugging Face's
        ``device_map`` splits one): each fill copies the metadata and the per-token slots there, without a host
        sync unless ``device`` is the CPU. LoRALinear calls it for its weight's device."""
        device = _device(device)
        if device == self.device or device in self._mirrors:
            return
        meta = BatchMeta(*(torch.empty_like(t, device=device) for t in self.meta))
        meta.sorted_token_ids._lora_batch = 0   # (a batch's own buffers, as LoRABatch tags them)
        token_slots = torch.empty_like(self.token_slots, device=device)
        _copy_buffers(meta, token_slots, self.meta, self.token_slots)
        _mark_buffers((*meta, token_slots))
        self._mirrors[device] = (meta, token_slots)
        if self._copy is not None:      # (a batch set with grad mode on: its copy there too)
            self._copy = self._copy_batch()

    def _checkpoint_contexts(self):
        """``ctx.checkpoint_context()``, the ``context_fn`` for ``torch.utils.checkpoint(...,
        use_reentrant=False)``: the recompute of a checkpointed forward reads the batch that forward read,
        whatever ``set_batch`` ran since (without it such a recompute raises in the backward). Returns (forward
        context, recompute context). Under torch.compile, which takes only TorchDispatchModes there, two
        that do nothing: the compiled backward recomputes from the graph's saved inputs, the batch's copy
        among them."""
        # Where torch.utils.checkpoint requires modes: while AOTAutograd traces (a proxy mode active: its own
        # test), which torch 2.11 does outside Dynamo's is_compiling(); 2.13 calls it while Dynamo traces too.
        tracing = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
        if torch.compiler.is_compiling() or tracing:
            return _Passthrough(), _Passthrough()
        if self._rows is not None:
            # per_row's batches are never refilled: the recompute reads the same, in the block or after it.
            return contextlib.nullcontext(), self._in_rows((self._rows, self._row_batches))
        if self._restored is not None:
            copy = self._restored           # a checkpoint nested in a recompute: that batch
        else:
            if self._copy is None:          # set under no_grad: copy it now (the forward reads the copy)
                self._copy = self._copy_batch()
            copy = self._copy
        return contextlib.nullcontext(), self._restore(copy)

    @contextlib.contextmanager
    def _in_rows(self, rows):
        """A checkpoint's recompute of a forward run inside per_row: that block's rows and batches again."""
        saved = (self._rows, self._row_batches, self._row_current, self._row_shape)
        self._rows, self._row_batches = rows
        try:
            yield
        finally:
            self._rows, self._row_batches, self._row_current, self._row_shape = saved

    @contextlib.contextmanager
    def _restore(self, copy):
        before, self._restored = self._restored, copy
        try:
            yield
        finally:
            self._restored = before

    def check_input(self, x2d, layer=None, x=None):
        """Eager-mode check of ``layer``'s flattened input against the batch (skipped while compiling); inside
        :meth:`per_row`, picks the batch of the input ``x``'s shape for the call."""
        if x2d.device != self.device and x2d.device not in self._mirrors:
            served = ", ".join(str(d) for d in (self.device, *self._mirrors))
            raise ValueError(f"{self._name(layer)}: the input is on {x2d.device} but the LoRAContext serves "
                             f"{served}; call apply_lora after moving the model to its devices")
        if self._rows is not None:
            self._row_current = self._row_batch(x2d if x is None else x, layer)
            return
        num_tokens = self.batch.num_tokens if self._restored is None else self._restored.num_tokens
        if x2d.shape[0] != num_tokens:
            raise self._token_count_error(x2d.shape[0], num_tokens, layer)

    def traced_check_input(self, x2d, layer):
        """check_input's token count under torch.compile, against the length of the view :meth:`_fill` keeps:
        the graph guards on the two counts being equal, so an input of another count than the batch's retraces
        and raises (Dynamo's TorchRuntimeError holding this message) where the kernels would have given its
        extra tokens no adapter, or dropped the batch's extra slots. Not while torch.export traces: a program's
        inputs are its own, the batch's buffers a constant of it."""
        if torch.compiler._is_exporting_flag:
            return
        # torch._check, not a raise: Dynamo runs it on the retrace's fake tensors and reports its message, the
        # compiled frame kept (a raise inside the trace made Dynamo skip the frame for good without
        # fullgraph); the message a constant (a closure over the counts does not trace).
        torch._check(x2d.shape[0] == self._batch_tokens.shape[0] - 2, lambda: _TRACED_COUNT_MESSAGE)

    def _token_count_error(self, got, num_tokens, layer):
        return ValueError(
            f"{self._name(layer)}: the input has {got} tokens but the batch was set for {num_tokens}; "
            f"{_TOKEN_COUNT_REMEDY}. (A layer that sees one token a row, such as a pooler or a "
            f"classification head over each row's first or last token, takes its rows' adapters inside "
            f"ctx.per_row(...), which set_batch's per-token batch cannot describe; or leave it out of "
            f"target_modules)")

    def _name(self, layer):
        """'LoRALinear' and the layer's path in the model where apply_lora put it there (for messages)."""
        path = next((p for p, known in self.layers.items() if known is layer), None)
        return "LoRALinear" if path is None else f"LoRALinear {path!r}"


# (Their errors came from deep inside: an assertion in the op checks, "try blocks aren't supported", a TraceError.)
_TRACERS_REFUSED = ("LoRALinear: {what} is not supported (the batch is the context's state, and the ops read it "
                    "through Python); use torch.compile or torch.export, which trace it")


_TOKEN_COUNT_REMEDY = ("call set_batch / set_token_slots for this step's tokens, or run code that steps the model "
                       "itself (model.generate) inside ctx.per_row(adapters)")
_TRACED_COUNT_MESSAGE = ("LoRALinear under torch.compile: the input's token count differs from the batch's (the last "
                         "set_batch / set_token_slots); " + _TOKEN_COUNT_REMEDY)


def _checkpoint_contexts(context):
    return context._checkpoint_contexts()


class _Passthrough(TorchDispatchMode):
    """A TorchDispatchMode that changes nothing (LoRAContext._checkpoint_contexts under torch.compile)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _unpack_request(i, request):
    try:
        name, n = request
    except (TypeError, ValueError):
        raise TypeError(f"set_batch: request {i} must be (adapter name or None, num_tokens), got {request!r}") from None
    if name is not None and not isinstance(name, str):
        raise TypeError(f"set_batch: request {i}'s adapter must be a name or None, got {type(name).__name__}")
    # (numbers.Integral: a numpy integer too, as a server's arrays give; not a tensor, whose value may be a GPU's.)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"set_batch: request {i}'s num_tokens must be an int >= 0, got {n!r}")
    return name, int(n)


class LoRALinear(nn.Module):
    """An ``nn.Linear`` plus the LoRA delta of each token's adapter slot, in one op call.

    ``base`` is reused (its weight is not copied); ``context`` is the :class:`LoRAContext` shared by
    the model's layers (slot capacity and batch); ``max_rank`` the largest rank a slot can hold.
    ``slice_widths`` splits the output into packed slices (e.g. a fused q/k/v projection holding
    adapters trained per projection); by default one slice of all ``out_features``.

    ``stack_a`` (opt-in; docs/DESIGN.md §4): the base weight and ``lora_a`` become views of one buffer
    ``[N + L·S·R, K]`` (plus the zero rows a tuned table asks for: :func:`lora_ops.configs.stack_pad_rows`;
    the bias, if any, of one as long, with zeros past N), so at up to
    ``stacked_max_tokens`` tokens (:func:`stacked_token_limit`: where it paid, measured per layer shape in
    the GPU's tuned table, else by a rule; 0, and nothing stacked, where it never pays), without autograd or
    dropout, one GEMM gives the output and every slot's h (``lora_ops::lora_linear_stacked``) and no shrink
    runs. h is then rounded to the weights' dtype once, as PEFT rounds it. The base layer's parameters keep
    their identity, their data becoming the views (an optimizer over them, hooks on them and a module a weight
    is tied to keep them); ``.to()`` and the other conversions that move or cast them re-stack. The output
    at those sizes is a column view of the wider GEMM result (row stride N + L·S·R + P, P the padding rows).
    """

    @torch.inference_mode(False)
    def __init__(self, base, context, max_rank, slice_widths=None, stack_a=False):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base: expected an nn.Linear, got {type(base).__name__}")
        _check_positive_int("max_rank", max_rank)
        N, K = base.out_features, base.in_features
        widths = tuple(int(w) for w in (slice_widths if slice_widths is not None else (N,)))
        if not widths or any(w <= 0 for w in widths) or sum(widths) != N:
            raise ValueError(f"slice_widths: expected positive widths summing to out_features={N}, got {list(widths)}")
        weight = base.weight
        context.serve_device(weight.device)    # (a layer on another device than the context's: a split model)
        L, S, R = context.max_loras, len(widths), int(max_rank)
        self.base = base
        self.context = context          # a plain object: shared, not a submodule, not in the state dict
        self.slice_widths = widths
        self.lora_a = nn.Parameter(weight.new_zeros(L, S, R, K), requires_grad=False)
        self.lora_b = nn.Parameter(weight.new_zeros(L, N, R), requires_grad=False)
        self.register_buffer("scale", torch.zeros(L, dtype=torch.float32, device=weight.device))
        self.register_buffer("rank", torch.zeros(L, dtype=torch.int32, device=weight.device))
        # Which adapter each slot holds, for the state dict: slot_key of its name, 0 for none (never read in
        # forward; load_state_dict puts a checkpoint's adapters in their names' slots: _slots_by_name).
        self.register_buffer("slot_keys", torch.zeros(L, dtype=torch.int64, device=weight.device))
        self._keys_from_names()
        self.slot_ranks = [0] * L       # host mirror of `rank`: read for validation, never in forward
        self._stacked = None            # (stacked weight, stacked bias or None), plain tensors: see stack_a
        self._stack_ptrs = None         # set by _stack
        self._stack_params = None       # set by _stack: the parameters made views of the stack (weight, bias, lora_a)
        self.stacked_max_tokens = 0     # set by _stack
        self._eager = eager_ops.EagerCalls()   # bound eager calls (lora_ops.eager)
        # The base's mode: a new module is in training mode, and a model from from_pretrained (eval) had its
        # wrapped layers drop adapters' dropout in while a trainer was open.
        self.train(base.training)
        if stack_a and stacked_token_limit(N, K, L * S * R, device=weight.device, dtype=weight.dtype):
            self._stack()       # (which leaves a base it cannot stack unstacked: _stackable_now)
        self.register_load_state_dict_post_hook(LoRALinear._restack_after_load)

    @torch.no_grad()
    @torch.inference_mode(False)
    def _stack(self):
        """Put the base weight over lora_a in one buffer (and the bias over zeros), the parameters becoming
        views of it; values are kept. Called at construction and after conversions (:meth:`_apply`). A layer
        that can no longer be stacked (:meth:`_stackable_now`) runs unstacked from then on."""
        if not self._stackable_now():
            self._stacked, self._stack_params, self._stack_ptrs, self.stacked_max_tokens = None, None, None, 0
            return
        base, lora_a = self.base, self.lora_a
        weight, bias = base.weight, base.bias
        N, K = weight.shape
        E = lora_a.numel() // K   # L·S·R rows
        stacked = stacked_weight(weight.detach(), lora_a.detach())
        P = stacked.shape[0] - N - E
        stacked_bias = None if bias is None else torch.cat([bias.detach(), bias.new_zeros(E + P)])
        # The same parameter objects, their data now the views: an optimizer built over them, the trainer's
        # gradient hooks and a module the weight is tied to keep them (new parameters made a model's .to()
        # detach lora_a from the optimizer, silently).
        base.weight = _holding(weight, stacked[:N])
        if bias is not None:
            base.bias = _holding(bias, stacked_bias[:N])
        self.lora_a = _holding(lora_a, stacked[N:N + E].view(lora_a.shape))
        self._stacked = (stacked, stacked_bias)
        self._stack_params = (base.weight, base.bias, self.lora_a)
        self._note_stack_ptrs()
        self.stacked_max_tokens = stacked_token_limit(N, K, E, pad_rows=P, device=weight.device, dtype=weight.dtype)

    def _stackable_now(self):
        """Whether _stack may (re)build the stack: the base's parameters plain ones of its own, lora_a not
        parametrized (one registered after apply_lora: the re-stack raised torch's "attribute 'weight' already
        exists"), and the weight not the view of another layer's stack (a weight shared by two wrapped layers,
        tied or one base layer in two models: the second stack re-pointed the shared parameter, and the first
        layer's compiled graph, which checks identity only, read its own stale copy of W)."""
        if not _stackable(self.base) or torch.nn.utils.parametrize.is_parametrized(self, "lora_a"):
            return False
        weight, owner = self.base.weight, _STACK_OWNERS.get(id(self.base.weight))
        return not (owner is not None and owner is not self and owner._stacked is not None
                    and weight.data_ptr() == owner._stacked[0].data_ptr())

    def _note_stack_ptrs(self):
        """The addresses the parameters have while they are the stack's views (_stack_intact compares them)."""
        stacked, stacked_bias = self._stacked
        N = self.base.out_features
        # (Here, not in _stack alone: torch.load and pickles bring stacks whose views are intact, never re-stacked,
        # and a second layer over the weight stacked it again.)
        _STACK_OWNERS[id(self.base.weight)] = self
        self._stack_ptrs = (stacked.data_ptr(), stacked.data_ptr() + N * stacked.stride(0) * stacked.element_size(),
                            None if stacked_bias is None else stacked_bias.data_ptr(),
                            (N, stacked.shape[1]), self.lora_a.shape, (N,))

    def _stack_intact(self, weight, bias, lora_a):
        """Whether the parameters are still the views of the stack (eager: their addresses and shapes; a
        parameter replaced by hand drops the layer back to lora_linear). Under torch.compile, whether they are
        the parameter objects the stack made: Dynamo guards on the identity, so a parameter replaced after a
        compile (load_state_dict(assign=True) is restacked: :meth:`_restack_after_load`) compiles again, to
        lora_linear; a compiled stacked layer took the old stack, silently. (Their ``.data`` replaced in
        place cannot be seen there: eager only.)"""
        if torch.compiler.is_compiling():
            params = self._stack_params
            return params is not None and weight is params[0] and bias is params[1] and lora_a is params[2]
        weight_ptr, lora_a_ptr, bias_ptr, weight_shape, lora_a_shape, bias_shape = self._stack_ptrs
        dtype = self._stacked[0].dtype
        # (Shapes too: ``weight.data = weight.data[:N - 8]`` keeps the address, and the stacked path served a
        # narrower output where the unstacked op refuses B's rows; a bias cut to one entry served the stack's.)
        if bias is None:
            bias_kept = bias_ptr is None
        else:
            bias_kept = bias.data_ptr() == bias_ptr and bias.shape == bias_shape
        return (weight.data_ptr() == weight_ptr and lora_a.data_ptr() == lora_a_ptr
                and weight.shape == weight_shape and lora_a.shape == lora_a_shape
                and weight.dtype is dtype and lora_a.dtype is dtype and bias_kept)

    @property
    def in_features(self):
        """The base layer's in_features."""
        return self.base.in_features

    @property
    def out_features(self):
        """The base layer's out_features (every slice's)."""
        return self.base.out_features

    @in_features.setter
    def in_features(self, value):
        self._refuse_resize("in_features", value)

    @out_features.setter
    def out_features(self, value):
        self._refuse_resize("out_features", value)

    def _refuse_resize(self, name, value):
        # (Hugging Face's resize_token_embeddings sets lm_head.out_features: torch's "property has no setter"
        # named nothing a user could act on)
        raise AttributeError(f"{self.context._name(self)}: {name} is the base layer's, and the adapter stacks "
                             f"are sized by it; a wrapped layer cannot be resized (to {value}): resize the model "
                             f"(resize_token_embeddings) before apply_lora")

    # The base layer's weight and bias, read-only, as PEFT's LoRA layers forward them: model code reads
    # ``proj.weight.dtype`` to cast its activations (Hugging Face's T5 before ``wo``). Code that computes with
    # the weight instead of calling the layer would skip the delta; nn.MultiheadAttention's out_proj, the
    # known case, is refused by apply_lora.
    @property
    def weight(self):
        """The base layer's weight (LoRALinear computes with it; it is not copied)."""
        return self.base.weight

    @property
    def bias(self):
        """The base layer's bias, or None."""
        return self.base.bias

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):     # (nn.Module's own error named neither the layer nor the way)
            if "base" in self._modules and value is getattr(self.base, name):
                return      # (the base's own: Hugging Face's tie_weights ties a tied lm_head again)
            raise AttributeError(f"LoRALinear.{name} is the base layer's, read-only here: set "
                                 f"layer.base.{name} instead")
        super().__setattr__(name, value)

    @property
    def max_rank(self):
        """The stack's rank capacity R."""
        return self.lora_a.shape[2]

    @property
    def slice_offsets(self):
        """Each output slice's first column, then out_features (S + 1 offsets)."""
        offsets = [0]
        for w in self.slice_widths:
            offsets.append(offsets[-1] + w)
        return offsets

    def __prepare_scriptable__(self):
        raise TypeError(_TRACERS_REFUSED.format(what="torch.jit.script"))

    def forward(self, input):     # (nn.Linear's name: callers pass it by keyword too)
        x = input
        eager = not torch.compiler.is_compiling()
        if eager and (isinstance(x, torch.fx.Proxy) or torch._C._is_tracing()):
            raise TypeError(_TRACERS_REFUSED.format(what="torch.fx.symbolic_trace" if isinstance(x, torch.fx.Proxy)
                                                    else "torch.jit.trace"))
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        context = self.context
        if eager and x.is_cuda:
            other = ops.on_other_device(x)
            if other is not None:       # (a model on another GPU than the current one, where launches go)
                with torch.cuda.device(other):
                    return self.forward(x)
        cast_to = autocast_dtype(x2d)
        if cast_to is not None and self._in_dtype(x2d, cast_to):
            cast_to = None        # autocast would cast nothing: the usual path (bound calls, the stack)
        row = None
        if eager:                 # Python-side checks and bound calls stay out of compiled graphs
            context.check_input(x2d, self, x)
            out = self._eager.replay(self, x2d) if cast_to is None else None
            if out is not None:
                return out if x2d is x else out.view(*x.shape[:-1], out.shape[-1])
        elif context._rows is not None:     # (per_row under torch.compile: the batch built in the graph)
            row = context.traced_row_batch(x, self)
        else:
            context.traced_check_input(x2d, self)
        dropout = self.training and context.dropout_p is not None
        # From the module's dicts, not nn.Module.__getattr__: a Python call per read, ~1 µs of eager host
        # time each. Through the attributes where something moved them (a parametrization).
        params, buffers = self._parameters, self._buffers
        try:
            lora_a, lora_b, scale, rank = params["lora_a"], params["lora_b"], buffers["scale"], buffers["rank"]
        except KeyError:
            lora_a, lora_b, scale, rank = self.lora_a, self.lora_b, self.scale, self.rank
        base = self._modules["base"]
        if cast_to is not None:
            # Under torch.autocast the layer computes as nn.Linear would there: its floating inputs cast to
            # autocast's dtype (differentiably: gradients reach the parameters in their own dtype). The ops
            # then run in that dtype; the stack, in the parameters' dtype, is not used.
            lora_a, lora_b = autocast_cast(lora_a, cast_to), autocast_cast(lora_b, cast_to)
        adapters = (lora_a, lora_b, scale, rank, self.slice_widths)
        if not dropout and eager_ops.plain_linear(base):
            weight, bias = base._parameters["weight"], base._parameters["bias"]
            if cast_to is not None:
                x2d, weight, bias = (autocast_cast(t, cast_to) for t in (x2d, weight, bias))
            # (requires_grad read tensor by tensor, not through ops.any_requires_grad: Dynamo traces this
            # forward and cannot trace that C call, a graph break under fullgraph=True.)
            grad = torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad or lora_a.requires_grad
                                                or lora_b.requires_grad or (bias is not None and bias.requires_grad))
            # Autograd's calls: the batch's own copy (LoRAContext); a split model's layers: their device's.
            meta = (context.batch_for(grad, x2d) if row is None else row)[0]
            if (self._stacked is not None and cast_to is None and _at_most(x2d.shape[0], self.stacked_max_tokens)
                    and not grad and forward_ad._current_level < 0 and self._stack_intact(weight, bias, lora_a)):
                # One GEMM gives the output and every slot's h; no shrink launch (stack_a).
                stacked, stacked_bias = self._stacked
                op_args = (x2d, stacked, stacked_bias, lora_b, scale, rank, self.slice_widths, *meta)
                full = ops.call("lora_linear_stacked", *op_args)
                out = full[:, :weight.shape[0]]
                if eager and ops.direct("lora_linear_stacked", op_args):
                    self._eager.bind(self, x2d, weight, bias, full, stacked=True)
                return out if x2d is x else out.view(*x.shape[:-1], out.shape[-1])
            # One op for the whole layer: the shrink can run beside the base GEMM, and in the backward
            # the base layer's dx and the delta's are summed in one GEMM epilogue (lora_ops.autograd).
            # (A bare nn.Linear keeps its weight and bias in its dict.)
            op_args = (x2d, weight, bias, *adapters, *meta)
            out = ops.call("lora_linear", *op_args)
            if eager and cast_to is None and ops.direct("lora_linear", op_args):
                self._eager.bind(self, x2d, weight, bias, out, stacked=False)
            return out if x2d is x else out.view(*x.shape[:-1], out.shape[-1])
        if row is None and context._rows is not None:
            # (per_row, eager: this input's batch, taken before the base runs: a wrapped layer the base calls on
            # an input of another shape sets the block's current batch to its own)
            row = context._row_current
        y = base(x)
        if y.dim() > 2 and not _viewable_as_rows(y):
            y = y.contiguous()      # (a base returning a transposed view: the delta goes into a row-major copy)
        y2d = y.view(-1, y.shape[-1])
        grad = torch.is_grad_enabled() and (y.requires_grad or lora_a.requires_grad or lora_b.requires_grad)
        meta, token_slots = context.batch_for(grad, x2d) if row is None else row
        args = (*adapters, *meta)
        x_lora = x2d
        if dropout:
            # PEFT's lora_dropout: only the adapters see the dropped input, each at its slot's p.
            x_lora = training.slot_dropout(x2d, context.dropout_p, token_slots)
        if cast_to is not None or y.dtype != x_lora.dtype:
            # The base layer ran under autocast, or returns another dtype than its input's (float32 logits of a
            # 16-bit model): the delta goes in its output's dtype, as PEFT adds it.
            x_lora = autocast_cast(x_lora, y.dtype)
            args = (autocast_cast(lora_a, y.dtype), autocast_cast(lora_b, y.dtype), *args[2:])
        # Where something needs gradients through this layer (x, the base or the adapters), the out-of-place
        # op, which has autograd (lora_ops.autograd); the in-place one is invisible to autograd. Under
        # torch.func.vmap too (torch's loop over a custom op's batch works on functional ops only), and under
        # forward-mode AD (add_lora has a formula: ops.FORWARD_AD).
        functional = grad or (eager and (torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0))
        name = "add_lora" if functional else "add_lora_"
        if not functional and eager_ops.output_may_be_kept(base):
            y = y.clone()
            y2d = y.view(-1, y.shape[-1])
        # (Bound deltas are add_lora_ in place, or add_lora where autograd needs it: bind_delta tells them apart
        # by whether the output is y; not the functional op taken for vmap or forward mode.)
        bindable = eager and cast_to is None and not dropout and functional == grad and x_lora is x2d
        out = self._eager.replay_delta(self, x2d, y2d, grad) if bindable else None
        if out is None:
            out = ops.call(name, y2d, x_lora, *args)
            if bindable and ops.direct(name, (y2d, x_lora, *args)):
                self._eager.bind_delta(self, x2d, y2d, y2d if out is None else out)
        if out is None or out is y2d:
            return y
        return out if y.dim() == 2 else out.view(y.shape)

    def _in_dtype(self, x, dtype):
        """Whether x and every floating parameter the layer computes with are in ``dtype`` already (False
        where one is not in the module's dicts: a parametrization moved it)."""
        params, base_params = self._parameters, self._modules["base"]._parameters
        if "bias" not in base_params:
            return False
        bias = base_params["bias"]
        return (all(t is not None and t.dtype == dtype for t in (x, params.get("lora_a"), params.get("lora_b"),
                                                                 base_params.get("weight")))
                and (bias is None or bias.dtype == dtype))

    @torch.no_grad()
    def write_slot(self, slot, slices, scale, rank):
        """Write one slot in place: ``slices[i]`` is ``(A [r_i, K], B [n_i, r_i])`` or None (slice unused).

        Rank columns past each slice's ``r_i`` are zero-filled, so nothing of a previous adapter stays.
        Callers validate first (lora_ops.adapters); this only asserts.
        """
        assert len(slices) == len(self.slice_widths) and 0 <= rank <= self.max_rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = self.slice_offsets
        for i, pair in enumerate(slices):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.lora_a[slot, i, :r].copy_(a)
            self.lora_b[slot, offsets[i]:offsets[i + 1], :r].copy_(b)
        self.scale[slot] = float(scale)
        self.rank[slot] = int(rank)
        self.slot_ranks[slot] = int(rank)

    @torch.no_grad()
    def clear_slot(self, slot):
        """Empty ``slot`` in this layer: its A and B zeroed, scale and rank 0 (its tokens get no delta here)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scale[slot] = 0.0
        self.rank[slot] = 0
        self.slot_ranks[slot] = 0
        self.slot_keys[slot] = 0

    @staticmethod
    def _restack_after_load(module, incompatible_keys):
        """load_state_dict(assign=True) replaces the parameters of a stacked layer by the state dict's tensors:
        stack them again (values kept) so the layer keeps its one GEMM (a load_state_dict post hook, which
        runs once the base's parameters are loaded too)."""
        if module._stacked is not None and not module._stack_intact(module.base.weight, module.base.bias,
                                                                     module.lora_a):
            module._stack()
        module._follow_trainer()

    def _keys_from_names(self):
        """slot_keys from the context's names (a new layer, a layer pickled before slot_keys)."""
        self.slot_keys.copy_(torch.tensor([slot_key(n) for n in self.context.slot_names], dtype=torch.int64))

    def _follow_trainer(self):
        """An open trainer's gradient hooks onto this layer's stacks where they were replaced (load_state_dict
        with assign=True, a conversion that overwrote the parameters): SlotTrainer.follow_stacks."""
        trainer = getattr(getattr(self, "context", None), "trainer", None)
        if trainer is not None and self in trainer._row_of:
            trainer.follow_stacks(self)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # load_state_dict writes the slots' stacks, scale and rank in place: the host mirror of the ranks follows
        # (a host sync, once a load). The adapters' names are the context's; the state dict's slot_keys say which
        # name each slot held, and this layer's slots are put where the context has those names (_slots_by_name).
        # Keys cast with the rest of a checkpoint ({k: v.half()}) no longer name anything: the layer keeps its own
        # and the slots stay as loaded, as for a checkpoint from before slot_keys (not a missing key either).
        incoming = state_dict.get(prefix + "slot_keys")
        keyed = isinstance(incoming, torch.Tensor) and incoming.dtype == torch.int64 and not incoming.is_meta
        context = getattr(self, "context", None)
        names = list(context.slot_names) if context is not None else [None] * self.rank.shape[0]
        wanted = [slot_key(n) for n in names]
        # (the slots as they were: a name the checkpoint does not hold keeps its adapter here, and a load that fails
        # in this layer leaves it as it was: rank and scale loaded beside stacks of another shape mismatched them)
        before = self._slot_tensors()
        kept = None if keyed else self.slot_keys.clone()
        error_msgs = args[4] if len(args) > 4 else kwargs.get("error_msgs")
        errors = len(error_msgs) if error_msgs is not None else 0
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        missing = args[2] if len(args) > 2 else kwargs.get("missing_keys")
        if incoming is None and missing is not None and prefix + "slot_keys" in missing:
            missing.remove(prefix + "slot_keys")
        if kept is not None:
            if self.slot_keys.dtype != torch.int64:     # (assign=True took the cast tensor itself)
                self.slot_keys = kept
            else:
                self.slot_keys.copy_(kept)
        # load_state_dict(assign=True) takes the state dict's tensors as they are: a checkpoint converted to
        # half precision ({k: v.half()}) gave a float16 scale, and every forward then raised. The ops take a
        # float32 scale and an int32 rank, as model.half() keeps them (_apply).
        if self.scale.dtype != torch.float32:
            self.scale = self.scale.float()
        if self.rank.dtype != torch.int32:
            self.rank = self.rank.to(torch.int32)
        if error_msgs is not None and len(error_msgs) > errors:
            with torch.no_grad():
                for t, old in zip(self._slot_views(), before):
                    if t.shape == old.shape and t.dtype == old.dtype:
                        t.copy_(old)
        elif keyed and incoming.tolist() != wanted:
            self._slots_by_name(before, names)
        self.slot_ranks = [int(r) for r in self.rank.tolist()]
        bad = [r for r in self.slot_ranks if not 0 <= r <= self.max_rank]
        if bad:
            message = (f"{prefix}rank: slot ranks {self.slot_ranks} hold {bad[0]}, outside [0, "
                       f"max_rank={self.max_rank}]")
            if error_msgs is None:
                raise ValueError(message)
            error_msgs.append(message)

    def _slot_tensors(self):
        """(lora_a, lora_b, scale, rank, slot_keys) as they are, copied."""
        return tuple(t.detach().clone() for t in self._slot_views())

    @torch.no_grad()
    def _slots_by_name(self, before, names):
        """After a load whose slot_keys differ from the context's names: each adapter the checkpoint holds under a
        name the context has goes to that name's slot; a name the checkpoint does not hold keeps its adapter
        (``before``); an adapter of a name the context does not know stays in its slot if that slot is unnamed
        here, else is not loaded (warned). Per layer, so a load of part of the model (one block, strict=False)
        puts each name's weights in one slot in every layer. Before (session 54's first form) a checkpoint of
        another slot order made each name serve another adapter's weights, silently; renaming the context instead
        broke loads of part of the model."""
        loaded = self._slot_tensors()
        keys = loaded[4].tolist()
        known = {slot_key(name): slot for slot, name in enumerate(names) if name is not None}
        source = {}         # slot here -> (tensors, slot there)
        for key, slot in known.items():
            source[slot] = (loaded, keys.index(key)) if key in keys else (before, slot)
        unplaced = []
        for there, key in enumerate(keys):
            if key == 0 or key in known:
                continue
            if names[there] is None:
                source[there] = (loaded, there)
            else:
                unplaced.append(there)
        for i, t in enumerate(self._slot_views()):
            new = torch.zeros_like(t)
            for slot, (tensors, there) in source.items():
                new[slot] = tensors[i][there]
            t.copy_(new)
        if unplaced:
            warnings.warn(f"LoRALinear: load_state_dict: the checkpoint's slot(s) {unplaced} hold adapters this "
                          f"context does not know by name, and those slots hold others here: not loaded (load "
                          f"them by name)", stacklevel=3)

    def _slot_views(self):
        """The tensors holding the slots, as the layer reads them (lora_a, lora_b, scale, rank, slot_keys)."""
        return (self.lora_a, self.lora_b, self.scale, self.rank, self.slot_keys)

    def __getstate__(self):
        # A copy (copy.deepcopy, torch.save) taken while a trainer is open has none (LoRAContext.__getstate__):
        # its stacks go back to frozen, as without a trainer, rather than taking gradients into every slot
        # with no hook to mask them.
        state = super().__getstate__()     # (nn.Module's: a copy of the dict, without an in-place compile's call)
        if getattr(getattr(self, "context", None), "trainer", None) is not None:
            state["_freeze_stacks"] = True
        return state

    def __deepcopy__(self, memo):
        """copy.deepcopy's own protocol for a module (its class's ``__new__``, then :meth:`__setstate__` with the
        copied :meth:`__getstate__`), written out: torch's parametrize gives a parametrized module's class a
        ``__deepcopy__`` that copies the dict and skips ``__setstate__`` unless the class has one, and a layer
        whose lora_a was parametrized after apply_lora then kept a copy of its stack, unused (W + A held twice)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        # (LoRALinear's, not the object's: a parametrized class's __getstate__ refuses pickling, deep copies too.
        # Not inference tensors: LoRAContext.__deepcopy__.)
        with torch.inference_mode(False):
            new.__setstate__(copy.deepcopy(LoRALinear.__getstate__(self), memo))
        return new

    def __setstate__(self, state):
        freeze = state.pop("_freeze_stacks", False)
        # A layer pickled before session 24 (torch.save of a whole model) has no bound calls yet.
        super().__setstate__(state)
        if freeze:
            training.freeze_stacks((self.lora_a, self.lora_b))
        if "_eager" not in self.__dict__:
            self._eager = eager_ops.EagerCalls()
        if "slot_keys" not in self._buffers:      # (pickled before session 54: the names its context holds)
            self.register_buffer("slot_keys", torch.zeros_like(self.rank, dtype=torch.int64))
            if "slot_names" in self.context.__dict__:
                self._keys_from_names()
            else:   # (the context is unpickled after this layer: LoRAContext.__setstate__ fills them)
                self._keys_pending = True
        if LoRALinear._restack_after_load not in self._load_state_dict_post_hooks.values():   # (pickled before)
            self.register_load_state_dict_post_hook(LoRALinear._restack_after_load)
        if getattr(self, "_stacked", None) is not None:
            if getattr(self, "_stack_params", None) is None:    # (pickled before session 36)
                self._stack_params = (self.base.weight, self.base.bias, self.lora_a)
            self._note_stack_ptrs()     # (torch.load keeps the views, at new addresses)
            if not self._stack_intact(self.base.weight, self.base.bias, self.lora_a):
                # copy.deepcopy clones each nn.Parameter on its own (Parameter.__deepcopy__): the copy's weight
                # and lora_a were no longer views of its stack, and a compiled copy, which reads the stack,
                # served the adapters as they were at the copy whatever was loaded into it after. Stack again
                # (values kept). (copy.copy shares the parameters, still views: left as they are.)
                self._stack()

    def _apply(self, fn, *args, **kwargs):
        # model.half() / .to(dtype) would cast the float32 scale buffer, and model.type(dtype) the int32 rank
        # too; the ops need them as they were.
        scale, rank, keys = self.scale, self.rank, self.slot_keys
        left_meta = rank.is_meta
        self._eager.clear()     # the bound calls hold the old tensors
        # (Never inference tensors: a conversion under torch.inference_mode made the adapter stacks ones, and
        # every later load, unload or train_slots failed on torch's "inplace update to inference tensor".)
        with torch.inference_mode(False):
            super()._apply(fn, *args, **kwargs)
            if left_meta and not self.rank.is_meta:
                # to_empty: the stacks, ranks and scales hold whatever the memory held, which set_batch served
                # as adapters (ranks of -1551737373). Every slot is emptied, and the context's names go.
                for slot in range(self.rank.shape[0]):
                    self.clear_slot(slot)
                self.context._forget_adapters("the model left the meta device (to_empty)")
        if self.scale.dtype != torch.float32:
            self.scale = scale.to(device=self.scale.device)
        if self.rank.dtype != torch.int32:
            self.rank = rank.to(device=self.rank.device)
        if self.slot_keys.dtype != torch.int64:
            self.slot_keys = keys.to(device=self.slot_keys.device)
        # A conversion that moved or cast the parameters made them separate tensors: stack again. One that
        # changed nothing leaves the views as they are, and so does one that moved the stack's storage in place
        # (share_memory_: the views follow it; restacking put them in private memory, silently unshared).
        if self._stacked is not None:
            self._note_stack_ptrs()
            if not self._stack_intact(self.base.weight, self.base.bias, self.lora_a):
                self._stack()
        self._follow_trainer()
        return self

    def extra_repr(self):
        L, S, R, K = self.lora_a.shape
        return f"in_features={K}, out_features={self.lora_b.shape[1]}, max_loras={L}, max_rank={R}, " \
               f"slice_widths={list(self.slice_widths)}"


def _viewable_as_rows(y):
    """Whether ``y`` [..., N] views as [-1, N]: its leading dimensions (those of size 1 aside) nest."""
    lead = [(n, s) for n, s in zip(y.shape[:-1], y.stride()[:-1]) if n != 1]
    return all(outer == inner * size for (_, outer), (size, inner) in zip(lead, lead[1:]))


def _at_most(num_tokens, limit):
    """``num_tokens <= limit``; False for a token count torch.compile holds unbacked (``mark_unbacked``: a guard
    on its value cannot be taken, and the branch refused to compile), whose graph then serves every count
    through lora_linear."""
    return guard_or_false(num_tokens <= limit)


# id(a stacked layer's base weight) -> the LoRALinear whose stack it views (LoRALinear._stackable_now).
_STACK_OWNERS = weakref.WeakValueDictionary()


def _holding(param, view):
    """``param`` with ``view`` as its data (the same object), or a new parameter where it is a plain tensor or an
    inference tensor (a model built under torch.inference_mode: it would stay one, which serves nowhere else)."""
    if not isinstance(param, nn.Parameter) or param.is_inference():
        return nn.Parameter(view, requires_grad=param.requires_grad)
    param.data = view
    return param


def _stackable(base):
    """Whether stack_a may replace ``base``'s weight and bias by views of a stack: plain parameters of its own.
    A parametrized weight (torch.nn.utils.parametrize: weight_norm, orthogonal) or one a forward pre-hook
    computes (the legacy weight_norm and spectral_norm) is not a parameter to replace; such a layer runs
    unstacked (apply_lora raised torch's own errors on them, or the first forward did)."""
    params = base._parameters
    return (not torch.nn.utils.parametrize.is_parametrized(base) and isinstance(params.get("weight"), nn.Parameter)
            and (base.bias is None or isinstance(params.get("bias"), nn.Parameter)))


# ---- the model-wide helper -----------------------------------------------------------------------------

# Where stack_a's one-GEMM path pays (H200, benchmarks/results/lab-h200-2026-12-03-session13.md): the GEMM
# computes every slot's h for every token, so its extra rows cost what their bytes cost at small batches
# (a stack of more than half the base weight's rows lost at one token: Llama qkv, 4 slots of rank 320) and
# MMA work at large ones. Up to STACKED_ALWAYS_TOKENS it won on every core grid row of the runs that set
# these figures. Beyond, two costs decide (session 15, paired timing, Llama-3-8B at 1024-8192 tokens):
# - the stack's extra rows: a stack of at most STACKED_FREE_ROWS rows (with padding) cost less than the
#   shrink it spares at every batch measured; a wider one serves while its extra multiply-adds stay under
#   STACKED_MAX_EXTRA_MACS (~11 µs of the H200's tensor cores; the shrink it spares costs about that much);
# - y: the expand reads y right after the GEMM wrote it, from L2 while y fits there, while lora_linear's
#   write-first path never reads it. Past STACKED_MAX_Y_BYTES of y (H200: 50 MB of L2) write-first won on
#   every row measured (gate_up r16 at 4096 tokens: 0.088 of the base layer against 0.111 stacked) and
#   the stacked path on every row below it (down r16 at 8192 tokens, 64 MiB: 0.032 against 0.067).
# Larger batches take lora_linear. A tuned table's "stack_limit" entries replace the rule up to 1024 tokens
# for the shapes they measured (session 14: at ranks 128-320 the stacked path also won at 16-256 tokens on
# stacks wider than half N, and at 1024 on several).
STACKED_MAX_ROWS_FRACTION = 0.5
STACKED_ALWAYS_TOKENS = 256
STACKED_MAX_EXTRA_MACS = 2 ** 32
STACKED_FREE_ROWS = 192
STACKED_MAX_Y_BYTES = 64 << 20


def stacked_weight(weight, lora_a):
    """[W; A; P zero rows]: the base weight [N, K] over every slot's A (lora_a [L, S, R, K] flattened), then
    the zero rows the GPU's tuned table asks for (configs.stack_pad_rows: cuBLAS runs some row counts of the
    wider GEMM faster): the buffer stack_a builds, as lora_linear_stacked reads it."""
    N, K = weight.shape
    E = lora_a.numel() // K
    P = configs.stack_pad_rows(N, K, E, weight.device, weight.dtype)
    return torch.cat([weight, lora_a.reshape(E, K), weight.new_zeros(P, K)])


def _stacked_rule(out_features, in_features, rows, esize):
    """The rule's token limit for a stack of ``rows`` extra rows (A and padding) that pays at all (see above)."""
    by_y = STACKED_MAX_Y_BYTES // (out_features * esize)
    by_rows = by_y if rows <= STACKED_FREE_ROWS else STACKED_MAX_EXTRA_MACS // (in_features * rows)
    return max(STACKED_ALWAYS_TOKENS, min(by_y, by_rows))


def stacked_token_limit(out_features, in_features, stack_rows, pad_rows=0, device=None, dtype=torch.bfloat16):
    """The most tokens at which stack_a's one-GEMM path serves a layer of this shape whose stack holds
    ``stack_rows`` = L·S·R rows of A (and ``pad_rows`` zero rows after them); 0 where stacking does not pay
    at all. On a GPU whose table measured the shape (configs.stack_limit_tokens: both layer paths timed at
    the token buckets up to 1024), the measured limit where the stacked path stopped winning within them;
    where it won up to the last bucket measured, the rule beyond it."""
    rule = 0 if stack_rows > STACKED_MAX_ROWS_FRACTION * out_features else _stacked_rule(
        out_features, in_features, stack_rows + pad_rows, dtype.itemsize)
    tuned = None if device is None else configs.stack_limit_tokens(out_features, in_features, stack_rows, device,
                                                                    dtype)
    if tuned is None:
        return rule
    limit, measured_to = tuned
    return limit if limit < measured_to else max(limit, rule)


def apply_lora(model, target_modules, *, max_loras, max_rank, max_tokens, packed_modules=None, stack_a=False):
    """Wrap the ``nn.Linear`` modules that ``target_modules`` selects in :class:`LoRALinear`, in place;
    returns their shared :class:`LoRAContext`.

    ``target_modules`` follows PEFT: a list of names, each matching a module path exactly or as its
    last dotted components (``"q_proj"`` matches ``model.layers.0.self_attn.q_proj``); a string, as a
    regex that must match the whole path; or ``"all-linear"`` (every nn.Linear but the output layer).
    A selected module that is not an nn.Linear is an error.

    ``packed_modules`` declares fused layers: ``{"qkv_proj": {"q_proj": 64, "k_proj": 32, "v_proj": 32}}``
    gives every layer named ``qkv_proj`` three output slices of those widths, and adapter weights
    trained for ``<parent>.q_proj`` etc. load into them. A fused layer is selected when its own name
    or one of its slices' names is.

    Apply after moving the model to its device and dtype (``.to()`` later works but moves the stacks).
    ``stack_a``: each layer's base weight and ``lora_a`` in one buffer (opt-in; :class:`LoRALinear`).
    """
    _check_positive_int("max_rank", max_rank)     # (before any layer is wrapped, as the context's capacities are)
    packed = _normalise_packed(packed_modules)
    selected, wrapped = _select_targets(model, target_modules, packed)
    if selected and wrapped:
        # (The new context would not serve them: set_batch on it never reached them, silently.)
        warnings.warn(f"apply_lora: target_modules also selects {len(wrapped)} layer(s) already wrapped "
                      f"({wrapped[0]!r}{' and others' if len(wrapped) > 1 else ''}): they stay with the context that "
                      f"wrapped them; this one serves only the {len(selected)} it wraps now", stacklevel=2)
    if not selected:
        already = (f" (it selects {wrapped[0]!r}{' and others' if len(wrapped) > 1 else ''}, already a LoRALinear: "
                   f"apply_lora wraps a layer once; its context serves it)") if wrapped else ""
        as_name = (isinstance(target_modules, str) and target_modules != ALL_LINEAR and not wrapped
                   and any(_matches([target_modules], path) for path, _ in model.named_modules()))
        hint = (f" (a string is a regex that must match a whole module path, as in PEFT; for the modules of that "
                f"name pass a list: [{target_modules!r}])") if as_name else ""
        raise ValueError(f"target_modules: {target_modules!r} selects no nn.Linear in {type(model).__name__}"
                         f"{already}{hint}")
    # A model split across devices (device_map): the context's batch lives on the first GPU a layer is on
    # (else the first layer's device) and is copied to the others at each fill (LoRAContext.serve_device).
    devices = [module.weight.device for _, module, _ in selected]
    device = next((d for d in devices if d.type == "cuda"), next((d for d in devices if d.type != "meta"), devices[0]))
    if device.type == "meta":
        # (Layers on meta beside real ones are a split model's, as in the tests; all of them: a model built
        # without memory, whose context would stay on meta when to_empty moves the model.)
        raise ValueError(f"apply_lora: the selected layers have their weights on the meta device ({selected[0][0]!r} "
                         f"first): the batch and the adapter stacks would stay there. Materialise the model first "
                         f"(to_empty, then load its weights), then apply_lora")
    ctx = LoRAContext(max_loras, max_tokens, device=device)
    ctx._model = weakref.ref(model)
    places = _places(model)
    names = {}      # every name of each module (a module registered twice: its adapter keys may use either)
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    for path, module, slices in selected:
        layer = LoRALinear(module, ctx, max_rank, slice_widths=[w for _, w in slices] if slices else None,
                           stack_a=stack_a)
        _replace_everywhere(places[id(module)], layer)
        _keep_parents_calling(places[id(module)])
        ctx.layers[path] = layer
        ctx.targets[path] = (layer, None)
        for alias in names.get(id(module), ()):
            ctx.targets.setdefault(alias, (layer, None))
        for i, (slice_path, _) in enumerate(slices or ()):
            ctx.targets[slice_path] = (layer, i)
    return ctx


def conv1d_to_linear(model):
    """Replace every Hugging Face ``Conv1D`` in ``model`` (GPT-2 and its kin: weight ``[in, out]``, the
    transpose of nn.Linear's) by an equal ``nn.Linear``, in place, before :func:`apply_lora`, which wraps
    nn.Linear only; returns the converted paths. Weights and biases are copied (same device, dtype and
    requires_grad); the outputs are the same. PEFT adapters trained on the Conv1D model (``fan_in_fan_out``)
    then load as they are."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is None:          # (transformers not imported: the model has no Conv1D)
        return []
    converted, places = [], _places(model)
    for path, module in list(model.named_modules()):
        if not isinstance(module, conv1d):
            continue
        in_features, out_features = module.weight.shape
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device=module.weight.device,
                           dtype=module.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(module.weight.T)
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        linear.weight.requires_grad_(module.weight.requires_grad)
        if module.bias is not None:
            linear.bias.requires_grad_(module.bias.requires_grad)
        linear.train(module.training)
        _replace_everywhere(places[id(module)], linear)
        converted.append(path)
    return converted


def _normalise_packed(packed_modules):
    """{fused name: ((slice name, width), ...)} from the user's {fused name: {slice name: width}}."""
    packed = {}
    for fused, slices in (packed_modules or {}).items():
        items = tuple((str(n), int(w)) for n, w in dict(slices).items())
        if len(items) < 2 or any(w <= 0 for _, w in items):
            raise ValueError(f"packed_modules[{fused!r}]: expected two or more slices with positive widths, "
                             f"got {dict(slices)!r}")
        packed[fused] = items
    return packed


def _select_targets(model, target_modules, packed):
    """([(path, module, slices)], wrapped): slices is ((slice path, width), ...) for a packed layer, else None;
    wrapped the paths of the LoRALinear layers the rule would select were they still nn.Linear (another
    context serves them)."""
    if isinstance(target_modules, str) and target_modules != ALL_LINEAR:
        try:
            re.compile(target_modules)
        except re.error as e:
            raise ValueError(f"target_modules: {target_modules!r} is not a valid regex ({e})") from None
    output_layer = _output_layer(model) if target_modules == ALL_LINEAR else None
    selected, taken, wrapped = [], set(), {}
    # Every name a module has (remove_duplicate=False): a module registered twice (tied, or one layer listed
    # twice in a ModuleList) is selected by any of its names, once, and replaced under all of them.
    for path, module in model.named_modules(remove_duplicate=False):
        if type(module).__module__.startswith("peft.tuners."):
            # (Its LoRA layers are Linear-like wrappers of their own: "all-linear" wrapped their factor layers,
            # and a name selected one with an error naming a "Linear" that is not nn.Linear.)
            raise TypeError(f"apply_lora: the model holds PEFT's adapter layers ({path!r} is a "
                            f"{type(module).__module__}.{type(module).__name__}: a PeftModel). lora_ops serves PEFT "
                            f"adapters itself: call apply_lora on the base model (before get_peft_model, or after "
                            f"peft_model.unload()), then ctx.load_adapter each adapter's directory")
        if isinstance(module, LoRALinear):
            if path and id(module) not in wrapped and (
                    module is not output_layer and module.base is not output_layer if target_modules == ALL_LINEAR
                    else _names_hit(target_modules, path, _slice_paths(path, packed))):
                wrapped[id(module)] = path
            continue
        if not path or _inside_lora_linear(model, path) or id(module) in taken:
            continue
        slices = _slice_paths(path, packed)
        read_directly = isinstance(module, nn.Linear) and _weight_read_by_parent(model, path)
        if target_modules == ALL_LINEAR:
            hit = isinstance(module, nn.Linear) and module is not output_layer and not read_directly
        else:
            hit = _names_hit(target_modules, path, slices)
        if not hit:
            continue
        if not isinstance(module, nn.Linear):
            hint = (": convert the model's Conv1D layers first, lora_ops.conv1d_to_linear(model)"
                    if type(module).__name__ == "Conv1D" else "")
            kind = f"{type(module).__module__}.{type(module).__qualname__}"    # (quantized layers are "Linear" too)
            raise TypeError(f"target_modules selects {path!r}, a {kind}: only nn.Linear layers are supported "
                            f"(layer type {type(module).__name__} is not){hint}")
        if isinstance(module.weight, nn.parameter.UninitializedParameter):
            raise ValueError(f"target_modules selects {path!r}, an nn.LazyLinear whose weight is not initialised: "
                             f"run one forward through the model first (its in_features come from the input)")
        if read_directly:
            raise TypeError(f"target_modules selects {path!r}, the output projection of an nn.MultiheadAttention, "
                            f"which reads its weight and bias itself and never calls it: a LoRALinear there "
                            f"would not run")
        if _offloaded(model, path):
            raise ValueError(f"apply_lora: {path!r} is offloaded by accelerate (a device_map entry 'cpu' or 'disk'): "
                             f"its weight stays on the meta device until its forward, where a LoRALinear's adapter "
                             f"stacks cannot follow it. Load the model onto devices without offloading (layers "
                             f"on the CPU are supported)")
        if module.weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"apply_lora: {path!r} has dtype {module.weight.dtype}; the LoRA ops take float16, "
                            f"bfloat16 or float32 layers")
        if slices and sum(w for _, w in slices) != module.out_features:
            raise ValueError(f"packed_modules: the slice widths of {path!r} sum to {sum(w for _, w in slices)}, "
                             f"but the layer has out_features={module.out_features}")
        selected.append((path, module, slices))
        taken.add(id(module))
    return selected, list(wrapped.values())


def _names_hit(target_modules, path, slices):
    """Whether names or a regex select the module at ``path``, by its own name or a packed slice's."""
    return any(_matches(target_modules, p) for p in [path, *(p for p, _ in slices or ())])


def _offloaded(model, path):
    """Whether accelerate offloads the module at ``path`` or a module above it (an ``_hf_hook`` with ``offload``
    set: its weights are on the meta device between forwards)."""
    parts = path.split(".")
    for i in range(len(parts) + 1):
        hook = getattr(model.get_submodule(".".join(parts[:i])), "_hf_hook", None)
        if any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,))):
            return True
    return False


def _weight_read_by_parent(model, path):
    """Whether the module at ``path`` is one its parent never calls (nn.MultiheadAttention's out_proj: the
    attention function takes its weight and bias), so wrapping it changes nothing ("all-linear" skips it)."""
    parent = path.rpartition(".")[0]
    return isinstance(model.get_submodule(parent) if parent else model, nn.MultiheadAttention)


def _matches(target_modules, path):
    """PEFT's rule: a regex string must match the whole path; a list entry the path or its dotted suffix."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path) is not None
    return any(path == t or path.endswith("." + t) for t in target_modules)


def _slice_paths(path, packed):
    parent, _, name = path.rpartition(".")
    if name not in packed:
        return None
    prefix = parent + "." if parent else ""
    return tuple((prefix + slice_name, width) for slice_name, width in packed[name])


def _output_layer(model):
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _inside_lora_linear(model, path):
    parent = path.rpartition(".")[0]
    return bool(parent) and isinstance(model.get_submodule(parent), LoRALinear)


def _places(model):
    """{id(module): [(parent, name), ...]}: every place a module of ``model`` is registered, each parent once
    (one walk: apply_lora replaces thousands of experts' layers). Not inside a LoRALinear (its own base)."""
    places = {}
    for parent in model.modules():
        if isinstance(parent, LoRALinear):
            continue
        for name, child in parent._modules.items():
            if child is not None:
                places.setdefault(id(child), []).append((parent, name))
    return places


def _replace_everywhere(places, new):
    """Put ``new`` at each of ``places`` (:func:`_places`) of a module: under each name a module shared between
    parents (or listed twice) has (it once got the delta under its first name only, silently), and inside a
    selected nn.Linear subclass that is itself wrapped (a LoRALinear's base; the inner layer was once put on
    the outer LoRALinear, where nothing called it). The parents are the model's modules before any
    replacement, which stay in the model (a wrapped one as a LoRALinear's base)."""
    for parent, name in places:
        setattr(parent, name, new)


def _keep_parents_calling(places):
    """A wrapped layer's parents that have a fused path reading its weight instead of calling it, kept off that
    path: nn.TransformerEncoderLayer's fused inference path (eval, no grad) reads linear1's and linear2's
    weights itself, and the delta was skipped there; the flag that path requires, off for that layer.
    (nn.MultiheadAttention's out_proj, never called at all, is refused: _weight_read_by_parent.)"""
    for parent, name in places:
        if isinstance(parent, nn.TransformerEncoderLayer) and name in ("linear1", "linear2"):
            parent.activation_relu_or_gelu = 0
