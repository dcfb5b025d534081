"""One benchmark row's problem: random data, the float64 reference, the correctness check, and the
calls under test (ours, the base layer, the peers) built from the same weights.
"""
import importlib.util
import os
import zlib
from typing import NamedTuple

import torch
import torch.nn.functional as F

import lora_ops
from shapes import NO_ADAPTER_FRACTION, NUM_SLOTS

# Relative Frobenius error allowed on the delta, per dtype of x / y / weights.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# One scale for every slot: the peers take a single float.
SCALE = 0.75
PEER_NAMES = ("vllm", "sglang")


def token_slots(M, num_slots, seed):
    """[M] int32 on the CPU: round(10% of M) tokens with -1, the rest dealt round-robin over the slots
    (every slot used once M >= num_slots + its -1 share), in a shuffled order."""
    n_none = int(round(NO_ADAPTER_FRACTION * M))
    slots = torch.cat([torch.arange(M - n_none, dtype=torch.int32) % num_slots,
                       torch.full((n_none,), -1, dtype=torch.int32)])
    return slots[torch.randperm(M, generator=torch.Generator().manual_seed(seed))]


class Inputs(NamedTuple):
    x: torch.Tensor        # [M, K]
    y: torch.Tensor        # [M, N], accumulated in place
    lora_a: torch.Tensor   # [L, S, R, K]
    lora_b: torch.Tensor   # [L, N, R]


class Problem:
    """A layer, a slot stack (ranks and capacity), and the tokens' slots; makes input sets on demand."""

    def __init__(self, layer, slot_ranks, capacity, slots_cpu, dtype, device, seed):
        self.layer, self.dtype, self.device, self.seed = layer, dtype, torch.device(device), seed
        self.K, self.widths = layer.in_features, list(layer.slices)
        self.N, self.S = sum(self.widths), len(self.widths)
        self.slot_ranks, self.R, self.L = tuple(slot_ranks), capacity, len(slot_ranks)
        self.slots_cpu = slots_cpu
        self.slots = slots_cpu.to(self.device)
        self.M = slots_cpu.numel()
        self.scale = torch.full((self.L,), SCALE, dtype=torch.float32, device=self.device)
        self.rank = torch.tensor(self.slot_ranks, dtype=torch.int32, device=self.device)
        self.batch = lora_ops.LoRABatch(max(self.M, 1), self.L, device=self.device)
        self.meta = self.batch.update(self.slots)

    @classmethod
    def for_case(cls, case, dtype, device, seed=0):
        row_seed = zlib.crc32(case.label.encode()) ^ seed
        slots = token_slots(case.M, NUM_SLOTS, row_seed)
        return cls(case.layer, case.ranks.slot_ranks, case.ranks.capacity, slots, dtype, device, row_seed)

    @property
    def esize(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def used_slots(self):
        return sorted(s for s in set(self.slots_cpu.tolist()) if s >= 0)

    def tokens_of(self, slot):
        return int((self.slots_cpu == slot).sum())

    def alone(self, slot):
        """Slot ``slot``'s tokens as a problem of their own: one adapter in a stack of exactly its rank."""
        r = self.slot_ranks[slot]
        slots = torch.zeros(self.tokens_of(slot), dtype=torch.int32)
        return Problem(self.layer, (r,), r, slots, self.dtype, self.device, self.seed + 1 + slot)

    # --- data

    def _gen(self, k):
        return torch.Generator(device=self.device).manual_seed((self.seed * 1009 + k) % (1 << 62))

    def _randn(self, gen, shape, std=1.0):
        return torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype).mul_(std)

    def inputs(self, k):
        """Input set k: signed random data, scaled so h and the delta are O(1) like y.

        Rank rows past a slot's rank hold random values too: a kernel that reads them fails the check.
        """
        g = self._gen(k)
        x = self._randn(g, (self.M, self.K))
        y = self._randn(g, (self.M, self.N))
        a = self._randn(g, (self.L, self.S, self.R, self.K), self.K ** -0.5)
        b = self._randn(g, (self.L, self.N, self.R))
        b.mul_(torch.tensor([r ** -0.5 for r in self.slot_ranks], dtype=self.dtype, device=self.device)[:, None, None])
        return Inputs(x, y, a, b)

    def set_bytes(self):
        return (self.M * self.K + self.M * self.N + self.L * self.R * (self.S * self.K + self.N)) * self.esize

    def base_inputs(self, k):
        g = self._gen(10_000 + k)
        return self._randn(g, (self.M, self.K)), self._randn(g, (self.N, self.K), self.K ** -0.5)

    def base_set_bytes(self):
        return (self.M * self.K + self.N * self.K + self.M * self.N) * self.esize

    def floor_bytes(self):
        """x read once, each used adapter's A and B at its rank read once, y read and written once."""
        adapters = sum(self.slot_ranks[s] * (self.S * self.K + self.N) for s in self.used_slots())
        return (self.M * self.K + adapters + 2 * self.M * self.N) * self.esize

    def floor_flops(self):
        """Tensor-core FLOPs of the delta at its own precision, counted at the dtype's matmul rate: each
        adapted token's shrink (S slices of its slot's rank over K) and expand (N columns over the rank).
        The expand's fp32 h meets B as two bf16 terms (bf16) or as TF32 at half the fp16 rate (fp16):
        twice a 16-bit product either way. None for float32 (no 16-bit tensor-core path)."""
        if self.dtype == torch.float32:
            return None
        per_rank = 2 * (self.S * self.K + 2 * self.N)
        return sum(self.tokens_of(s) * self.slot_ranks[s] * per_rank for s in self.used_slots())


# --- the float64 reference and the check


def reference_delta(problem, inp):
    """The delta [M, N] in float64 on the problem's device: per used slot, float64 products over that
    slot's tokens at its own rank (a grouped form of lora_ops.reference, light enough for M = 8192)."""
    out = torch.zeros(problem.M, problem.N, dtype=torch.float64, device=problem.device)
    S, K = problem.S, problem.K
    for slot in problem.used_slots():
        r = problem.slot_ranks[slot]
        ids = (problem.slots == slot).nonzero()[:, 0]
        a = inp.lora_a[slot, :, :r].double().reshape(S * r, K)
        h = (inp.x[ids].double() @ a.T).view(-1, S, r) * float(problem.scale[slot])
        cols, parts = 0, []
        for i, n in enumerate(problem.widths):
            parts.append(h[:, i] @ inp.lora_b[slot, cols:cols + n, :r].double().T)
            cols += n
        out[ids] = torch.cat(parts, dim=1)
    return out


def values_off(y_after, y_before, ref):
    """How many values of y_after are off y_before + ref (float64) by more than the tuner's check allows
    (configs.tuning.off_mask), in row chunks (float64 temporaries stay small at M = 8192)."""
    from lora_ops.configs.tuning import off_mask
    rms = ref.pow(2).mean().sqrt()
    eps = torch.finfo(y_after.dtype).eps
    off = 0
    for i in range(0, ref.shape[0], 1024):
        off += int(off_mask(y_after[i:i + 1024], y_before[i:i + 1024].double() + ref[i:i + 1024], rms, eps).sum())
    return off


class Check(NamedTuple):
    ok: bool
    err: float        # relative Frobenius error of the delta
    round_err: float  # the same for an exact delta added into y and rounded to y's dtype
    note: str


def check_delta(problem, inp, run, ref, tol):
    """Run ``run`` once (it adds the delta into inp.y) and compare y_after - y_before with ``ref``.

    Passes when the relative Frobenius error is <= tol + round_err, no value is off by more than the
    tuner's check allows (:func:`values_off`: a few hundred wrong values among millions pass the Frobenius
    bound, session 20), rows with slot -1 are bit-identical and y holds no NaN or inf. round_err is what
    even an exact kernel shows here, because y_after is rounded to y's dtype (~2e-3 in bf16 when the delta
    and y are of one size; it grows when the delta is small against y, e.g. one token at rank 1). inp.y is
    restored afterwards.
    """
    y_before = inp.y.clone()
    run()
    finite = bool(torch.isfinite(inp.y).all())
    none_rows = problem.slots < 0
    untouched = bool(torch.equal(inp.y[none_rows], y_before[none_rows]))
    delta = inp.y.double() - y_before.double()
    off = values_off(inp.y, y_before, ref)
    inp.y.copy_(y_before)
    ref_norm = max(float(torch.linalg.vector_norm(ref)), 1e-30)
    err = float(torch.linalg.vector_norm(delta.sub_(ref))) / ref_norm
    exact = y_before.double().add_(ref)
    rounded_delta = exact.to(y_before.dtype).double().sub_(y_before.double())
    del exact
    round_err = float(torch.linalg.vector_norm(rounded_delta.sub_(ref))) / ref_norm
    del delta, rounded_delta
    notes = []
    if not finite:
        notes.append("non-finite values in y")
    if not untouched:
        notes.append("rows with slot -1 changed")
    if not err <= tol + round_err:  # NaN fails here too
        notes.append(f"rel. error {err:.2e} > {tol:.0e} + rounding {round_err:.1e}")
    if off:
        notes.append(f"{off} values off by more than the tuner's check allows")
    return Check(not notes, err, round_err, "; ".join(notes))


# --- the calls under test


def ours(problem, inp):
    """One call of our op, metadata prepared once per batch (the per-layer hot path)."""
    op = torch.ops.lora_ops.add_lora_
    args = (inp.y, inp.x, inp.lora_a, inp.lora_b, problem.scale, problem.rank, problem.widths, *problem.meta)
    return lambda: op(*args)


def layer(problem, inp, w):
    """One call of lora_linear: the base layer F.linear(x, W) and the delta in one op (a new output)."""
    op = torch.ops.lora_ops.lora_linear
    args = (inp.x, w, None, inp.lora_a, inp.lora_b, problem.scale, problem.rank, problem.widths, *problem.meta)
    return lambda: op(*args)


def base(x, w):
    """The layer's own product F.linear(x, W), W [N, K]."""
    return lambda: F.linear(x, w)


def peer_weights(problem, inp):
    """Our stack in the peers' layout, the same weights: per slice A_s [L, R, K] and B_s [L, n_s, R].

    The peers run every slot at one rank (R); rank rows past a slot's own rank are zeroed, so with
    mixed ranks they compute the same delta at the padded rank, as they would in their engines.
    """
    keep = (torch.arange(problem.R, device=problem.device) < problem.rank[:, None]).to(problem.dtype)  # [L, R]
    A = [(inp.lora_a[:, s] * keep[:, :, None]).contiguous() for s in range(problem.S)]
    B, cols = [], 0
    for n in problem.widths:
        B.append((inp.lora_b[:, cols:cols + n] * keep[:, None, :]).contiguous())
        cols += n
    return A, B


def peer(module, problem, inp):
    """The peer's per-layer call on this batch (its per-batch host preparation done here, untimed)."""
    A, B = peer_weights(problem, inp)
    return module.setup(inp.x, A, B, problem.slots, inp.y, SCALE, problem.L)


def load_peers(names, adapters_dir, peers_dir, device_type):
    """{name: adapter module} for the peers whose adapter and build import; a note for each that does not."""
    os.environ.setdefault("LORA_PEERS", str(peers_dir))
    if device_type == "cpu":
        os.environ.setdefault("STUB_DISPATCH_KEY", "CPU")  # vLLM's stubs register its ops for this key
    modules, notes = {}, []
    for name in names:
        path = os.path.join(adapters_dir, f"{name}_adapter.py")
        try:
            spec = importlib.util.spec_from_file_location(f"peer_{name}_adapter", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            modules[name] = module
        except Exception as e:  # a missing build or a broken import: run without this peer
            notes.append(f"peer {name} unavailable ({path}): {type(e).__name__}: {e}")
    return modules, notes
