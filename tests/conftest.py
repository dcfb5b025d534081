"""Shared test setup: where the Triton kernels run, tolerances, random problems, the backend fixture.

By default the suite runs on this machine's CPU: the vectorised torch CPU kernels, and the real Triton
kernels through Triton's interpreter (``TRITON_INTERPRET=1``, which must be set before anything imports
triton, hence first thing here). ``LORA_OPS_TEST_DEVICE=cuda`` runs the Triton side on CUDA tensors
with the real compiler instead (one command on the GPU machine:
``LORA_OPS_TEST_DEVICE=cuda python -m pytest tests``).
"""
import contextlib
import os

DEVICE = os.environ.get("LORA_OPS_TEST_DEVICE", "cpu")
if DEVICE != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import interp_bf16  # noqa: E402
from lora_ops import ops  # noqa: E402
from lora_ops.batch import LoRABatch  # noqa: E402
from lora_ops.reference import lora_delta_reference  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    from lora_ops.triton_launch import interpreter_problem  # noqa: E402
    if interpreter_problem():
        pytest.exit(f"{interpreter_problem()}; or on a GPU: LORA_OPS_TEST_DEVICE=cuda python -m pytest", returncode=4)

# Hypothesis: no deadline (the interpreter's first call of a kernel is slow) and modest example
# counts so the suite stays well under 15 minutes on 2 cores; HYPOTHESIS_PROFILE=dev digs deeper.
# Our function-scoped fixtures (backend, bf16 patch) set state once per test that every example may
# share, so hypothesis' warning about them does not apply.
settings.register_profile(
    "ci", deadline=None, max_examples=12, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", parent=settings.get_profile("ci"), max_examples=200)
# On a GPU each example of new shapes compiles kernels: at 12 examples a property test takes 10-25 s on a
# cold machine (H200, 2026-12-03), too long for a device call. The CPU suite covers the property space;
# a GPU run checks the compiled kernels on a few examples each (benchmarks/gpu_session.sh uses this).
settings.register_profile("gpu", parent=settings.get_profile("ci"), max_examples=4)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# ---------------------------------------------------------------------------------------------
# Tolerances: the ONE place. Relative Frobenius error of the LoRA delta against the float64
# reference (computed from the same rounded inputs), y starting at zero. The shrink output h is
# float32 whatever the input dtype, so it is held to the float32 tolerance.
# ---------------------------------------------------------------------------------------------
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
H_TOLERANCE = TOLERANCE[torch.float32]

# The one-rounding-step check (y from a non-zero start) allows, on top of one output step, the
# worst-case error of the float32 intermediates plus one rounding of h to the expand's precision.
FLOAT32_ROUNDOFF = 2.0 ** -24  # the kernels accumulate in float32


def h_roundoff(dtype, backend):
    """Unit roundoff of h (float32) as the expand's dot sees it on ``backend`` (lora_ops.launch's
    f32_operand_precision): float32, except in the Triton kernel for bf16 (h as two bf16 terms, about 16
    significant bits; one term, 8 bits, under launch.set_fast_bf16) and for fp16 on a GPU (tf32, whose
    operand conversion truncates: 2**-10; the interpreter ignores tf32 and stays in float32).
    """
    if backend.name == "triton" and dtype == torch.bfloat16:
        from lora_ops import launch   # imports Triton: only where the Triton kernels run
        return 2.0 ** -8 if launch.f32_operand_precision(dtype) == "bf16" else 2.0 ** -16
    if backend.name == "triton" and dtype == torch.float16 and not backend.interpreted:
        return 2.0 ** -10  # tf32 on the tensor cores truncates the fp32 operand to 10 mantissa bits
    return FLOAT32_ROUNDOFF


DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_id(dtype):
    return DTYPE_IDS[dtype]


def rel_err(out, ref):
    """||out - ref||_F / ||ref||_F in float64; inf if out has a NaN; exact match needed if ref is 0."""
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    if torch.isnan(out).any():
        return math.inf
    diff = (out - ref).norm().item()
    norm = ref.norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def ulp(values, dtype):
    """Spacing of ``dtype`` numbers at each of ``values`` (float64): one output rounding step."""
    info = torch.finfo(dtype)
    mag = values.abs()
    _, exponent = torch.frexp(mag)
    binade = torch.where(mag < info.smallest_normal, torch.full_like(mag, info.smallest_normal),
                         torch.ldexp(torch.ones_like(mag), exponent - 1))
    return binade * info.eps


# ---------------------------------------------------------------------------------------------
# Backends: the torch CPU kernels, and the Triton kernels (interpreter on CPU, or CUDA).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    name: str     # "torch" or "triton": lora_ops.ops.set_cpu_backend's choice
    device: str   # where this backend's tensors live

    @property
    def interpreted(self):
        return self.name == "triton" and self.device == "cpu"

    @property
    def id(self):
        return f"{self.name}-{'interp' if self.interpreted else self.device}"


BACKENDS = [Backend("torch", "cpu"), Backend("triton", DEVICE)]


def _refuse_cpu_tensors():
    raise RuntimeError("a test on the Triton CUDA backend gave lora_ops CPU tensors, which would test the interpreter, "
                       "not the compiled kernels: build its case on the backend's device "
                       "(make_case(..., device=backend.device))")


def refuse_cpu_tensors_on_gpu_runs(monkeypatch, backend):
    """Where ``backend`` is the Triton backend on CUDA: CPU tensors reaching the Triton kernels raise. Such a test
    built its case on the CPU and ran the interpreter where the run meant the GPU (session 48 found two; only
    Triton 3.6's interpreter refusing numpy 2 showed it, and a Triton without that refusal would have passed)."""
    if backend.name == "triton" and backend.device != "cpu":
        monkeypatch.setattr(ops, "_check_interpreter", _refuse_cpu_tensors)


@pytest.fixture(params=BACKENDS, ids=lambda b: b.id)
def backend(request, monkeypatch):
    """Routes CPU tensors to this backend for the test, then restores the previous choice."""
    previous = ops.get_cpu_backend()
    ops.set_cpu_backend(request.param.name)
    refuse_cpu_tensors_on_gpu_runs(monkeypatch, request.param)
    yield request.param
    ops.set_cpu_backend(previous)


@contextlib.contextmanager
def fill_setting(on):
    """lora_ops.batch.set_one_launch_fill(on) within the block, the setting before it restored after."""
    from lora_ops import batch
    before = batch._one_launch[0]
    batch.set_one_launch_fill(on)
    try:
        yield
    finally:
        batch.set_one_launch_fill(before)


@pytest.fixture
def pretend_gpu_tables(tmp_path, monkeypatch):
    """``install(tables, gpu)``: only these tuned tables ({file stem: table}) in the tuned folder (none of the
    user's: $LORA_OPS_TUNED_DIR unset), and this process's GPU pretending to be ``gpu`` (name, compute
    capability, multiprocessor count), found through the normal lookup from then on; resolved configs and read
    tables are dropped on both sides."""
    import json
    from lora_ops import configs
    folder = tmp_path / "tuned"
    folder.mkdir()

    def install(tables, gpu):
        monkeypatch.setattr(configs, "TUNED_DIR", folder)
        monkeypatch.delenv(configs.TUNED_DIR_ENV, raising=False)
        for path in folder.glob("*.json"):
            path.unlink()
        for stem, table in tables.items():
            (folder / f"{stem}.json").write_text(json.dumps(table))
        monkeypatch.setattr(configs, "_gpu", lambda index: gpu)
        configs.reset()
    yield install
    configs.reset()


@pytest.fixture
def pretend_gpu_table(pretend_gpu_tables):
    """``install(entries)``: a tuned table of these entries for a pretend GPU (sm_90, 132 SMs), found through the
    normal lookup from then on (returns the GPU's name)."""
    from lora_ops import configs
    name = "Pretend GPU 9000"

    def install(entries):
        pretend_gpu_tables({configs.table_path(name).stem: dict(gpu=name, entries=entries)}, (name, (9, 0), 132))
        return name
    return install


@pytest.fixture
def triton_backend(backend):
    """``backend``, for tests of the Triton kernels themselves (their configs, launchers and precision):
    skipped on the torch CPU kernels."""
    if backend.name != "triton":
        pytest.skip("tests the Triton kernels themselves (configs, launchers, precision)")
    return backend


@pytest.fixture
def triton_kernels(monkeypatch):
    """The Triton side only, for the test: CPU tensors to the Triton kernels (the interpreter; CUDA tensors
    go there anyway), and no launch plans kept before or after. Yields the Triton backend."""
    from lora_ops import plan
    previous = ops.get_cpu_backend()
    ops.set_cpu_backend("triton")
    plan.clear()
    triton = next(b for b in BACKENDS if b.name == "triton")
    refuse_cpu_tensors_on_gpu_runs(monkeypatch, triton)
    yield triton
    plan.clear()
    ops.set_cpu_backend(previous)


def add_lora_paths(rank):
    """add_lora_'s paths at max rank ``rank`` (even), as forced configs: name -> (fused config or None, shrink
    config, expand config). One launch; two; two with split-K partial sums; two where the shrink sums its
    own splits (the expand's rank loop, block_r below the rank, takes h summed)."""
    from lora_ops.configs.heuristics import ExpandConfig, FusedConfig, ShrinkConfig
    # A GPU's tl.dot takes K >= 16 (the interpreter takes any): split_k_summed's rank block is rank // 2.
    assert rank >= 32 and rank % 2 == 0, f"add_lora_paths needs an even rank >= 32, got {rank}"
    return {
        "fused": (FusedConfig(16, 32, rank, 32, 4, 1), None, None),
        "split": (None, ShrinkConfig(16, rank, 32, 1, 4, 1), ExpandConfig(16, 32, rank, 4, 1)),
        "split_k_partials": (None, ShrinkConfig(16, rank, 16, 2, 4, 1), ExpandConfig(16, 32, rank, 4, 1)),
        "split_k_summed": (None, ShrinkConfig(16, rank // 2, 16, 3, 4, 1), ExpandConfig(16, 32, rank // 2, 4, 1)),
    }


def force_add_lora_path(monkeypatch, path):
    """Make add_lora_ take ``path`` (an entry of :func:`add_lora_paths`) for the test."""
    from lora_ops import configs
    fcfg, scfg, ecfg = path
    monkeypatch.setattr(configs, "fused_config", lambda *a, **k: fcfg)
    monkeypatch.setattr(configs, "shrink_config", lambda *a, **k: scfg)
    monkeypatch.setattr(configs, "expand_config", lambda *a, **k: ecfg)


@pytest.fixture
def write_first_from(monkeypatch):
    """``write_first_from(m)``: lora_linear takes the write-first path from ``m`` tokens in this test, at any
    output size."""
    from lora_ops import launch

    def set_threshold(m):
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", m)
        monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    return set_threshold


@pytest.fixture
def write_calls(monkeypatch):
    """The list of launch._write_lora calls in this test (the calls still run): proof the path was taken. Each
    call's y (torch.empty in lora_linear) is filled with NaN first: a row the store mode leaves unwritten then
    fails the layer's comparison, where fresh memory holding zeros would pass it for a token without a delta."""
    from lora_ops import launch
    calls, real = [], launch._write_lora

    def poisoned(y, *rest):
        calls.append((y, *rest))
        return real(y.fill_(float("nan")), *rest)
    monkeypatch.setattr(launch, "_write_lora", poisoned)
    return calls


@pytest.fixture
def bf16_interpreter():
    """Redo the Triton interpreter's bf16 arithmetic in float32 (tests/interp_bf16.py) for this test.

    A no-op off the interpreter (the real compiler is right); skips if this Triton cannot be patched.
    """
    if not INTERPRETED:
        yield
        return
    if interp_bf16.UNPATCHABLE_REASON:
        pytest.skip(interp_bf16.UNPATCHABLE_REASON)
    with interp_bf16.patched():
        yield


@pytest.fixture
def checked_dtype(backend, dtype, request):
    """The parametrized ``dtype``; bf16 values on the interpreter are only right with the bf16 patch."""
    if backend.interpreted and dtype == torch.bfloat16:
        request.getfixturevalue("bf16_interpreter")
    return dtype


# ---------------------------------------------------------------------------------------------
# Random problems.
# ---------------------------------------------------------------------------------------------
LAYOUTS = ("contiguous", "column_slice", "transposed")


def laid_out(t, layout, gen):
    """A copy of the 2-D ``t`` stored as ``layout``: contiguous, a column slice of a wider tensor
    (garbage around it), or transposed storage (column-major)."""
    rows, cols = t.shape
    if layout == "contiguous":
        return t.clone()
    if layout == "column_slice":
        wide = torch.randn(rows, cols + 5, generator=gen).to(dtype=t.dtype, device=t.device)
        view = wide[:, 3:3 + cols]
    elif layout == "transposed":
        view = torch.empty(cols, rows, dtype=t.dtype, device=t.device).t()
    else:
        raise ValueError(f"layout: unknown {layout!r}")
    view.copy_(t)
    return view


# How make_case stores the weight stacks (their values unchanged): contiguous; views of stacks allocated larger
# ("padded": one slice or output row more a slot, rank R + 3, NaN in the padding, so a read there shows); or
# feature-major ("feature_major": A stored [L, S, K, R] and B [L, R, N], transposed views). The kernels take every
# stride of A and B; launchers that passed A's and B's contiguous strides instead passed every property test while
# all the stacks were contiguous (a mutation audit, session 51).
WEIGHT_LAYOUTS = ("contiguous", "padded", "feature_major")


def stacks_laid_out(lora_a, lora_b, layout):
    """(lora_a [L, S, R, K], lora_b [L, N, R]) copied into ``layout`` (:data:`WEIGHT_LAYOUTS`)."""
    if layout == "contiguous":
        return lora_a, lora_b
    (L, S, R, K), N = lora_a.shape, lora_b.shape[1]
    kw = dict(dtype=lora_a.dtype, device=lora_a.device)
    if layout == "padded":
        a = torch.full((L, S + 1, R + 3, K), math.nan, **kw)[:, :S, :R]
        b = torch.full((L, N + 1, R + 3), math.nan, **kw)[:, :N, :R]
    elif layout == "feature_major":
        a = torch.empty(L, S, K, R, **kw).transpose(2, 3)
        b = torch.empty(L, R, N, **kw).transpose(1, 2)
    else:
        raise ValueError(f"layout: unknown {layout!r}")
    return a.copy_(lora_a), b.copy_(lora_b)


def unequal_widths(n, num_slices, gen):
    """``num_slices`` positive widths summing to ``n``, not all equal where n allows."""
    widths = [n]
    for _ in range(20):
        cuts = sorted(torch.randperm(n - 1, generator=gen)[:num_slices - 1].add(1).tolist())
        widths = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        if num_slices == 1 or len(set(widths)) > 1:
            break
    return widths


def random_slots(num_tokens, num_slots, gen):
    """Per-token slots in [-1, L), unsorted, with at least one -1 when there are two tokens or more."""
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    if num_tokens >= 2:
        slots[torch.randint(0, num_tokens, (1,), generator=gen)] = -1
    return slots.tolist()


def random_ranks(num_slots, max_rank, gen):
    """Per-slot ranks in [0, max_rank], with one slot at max_rank and, when L > 1, one at 0."""
    ranks = torch.randint(0, max_rank + 1, (num_slots,), generator=gen)
    order = torch.randperm(num_slots, generator=gen)
    ranks[order[0]] = max_rank
    if num_slots > 1:
        ranks[order[1]] = 0
    return ranks.tolist()


@dataclass
class Case:
    """One random problem; tensors on ``device``, values already rounded to ``dtype``."""
    x: torch.Tensor             # [M, K], possibly strided
    lora_a: torch.Tensor        # [L, S, R, K]
    lora_b: torch.Tensor        # [L, N, R]
    scale: torch.Tensor         # [L] float32, signed
    rank: torch.Tensor          # [L] int32
    token_slots: torch.Tensor   # [M] int64 in [-1, L), unsorted
    slice_widths: list
    batch: LoRABatch            # capacity >= M, refilled from token_slots (stale entries past M)
    y_layout: str
    gen: torch.Generator

    @property
    def meta(self):
        return self.batch.meta

    @property
    def shape(self):
        """(M, K, N, L, S, R)."""
        L, S, R, K = self.lora_a.shape
        return self.x.shape[0], K, self.lora_b.shape[1], L, S, R

    def delta_reference(self):
        """The float64 delta [M, N] on CPU."""
        return lora_delta_reference(self.x, self.lora_a, self.lora_b, self.scale, self.rank, self.token_slots,
                                    self.slice_widths)

    def delta_abs_bound(self):
        """sum |scale x A B| term by term: what the float32 rounding errors of the delta scale with."""
        return lora_delta_reference(self.x.abs(), self.lora_a.abs(), self.lora_b.abs(), self.scale.abs(),
                                    self.rank, self.token_slots, self.slice_widths)

    def untouched_rows(self):
        """Tokens whose delta is zero by definition: slot -1, or a slot of rank 0 (CPU bool mask)."""
        slots = self.token_slots.cpu()
        ranks = self.rank.cpu().long()
        return (slots < 0) | (ranks[slots.clamp(min=0)] == 0)

    def no_adapter_rows(self):
        return self.token_slots.cpu() < 0

    def signed(self, shape, dtype=None):
        """Fresh random signed values of ``shape`` from the case's generator, in the case's dtype (or ``dtype``)
        on its device: y, grad_out, h, a base weight, ... beside the case's own tensors."""
        return torch.randn(*shape, generator=self.gen).to(dtype=dtype or self.x.dtype, device=self.x.device)

    def new_y(self, fill):
        """y [M, N] in the case's layout: 'zero', or 'random' (signed values at the delta's scale for
        tokens with an adapter; NaN-free sentinels such as -0.0, +-max and subnormals for slot -1)."""
        M, _, N, *_ = self.shape
        dtype, device = self.x.dtype, self.x.device
        if fill == "zero":
            values = torch.zeros(M, N, dtype=torch.float64)
        elif fill == "random":
            values = sentinel_rows(M, N, dtype, self.gen)
            rms = self.delta_reference().pow(2).mean().sqrt().item() if M * N else 1.0
            adapted = ~self.no_adapter_rows()
            values[adapted] = torch.randn(int(adapted.sum()), N, generator=self.gen, dtype=torch.float64) * (
                rms or 1.0)
        else:
            raise ValueError(f"fill: unknown {fill!r}")
        return laid_out(values.to(dtype=dtype, device=device), self.y_layout, self.gen)


def sentinel_rows(rows, cols, dtype, gen):
    """[rows, cols] float64 of values that any arithmetic would disturb: -0.0, +-max, subnormals, ..."""
    info = torch.finfo(dtype)
    sentinels = torch.tensor([-0.0, info.max, -info.max, info.smallest_normal, -info.smallest_normal * info.eps,
                              12345.0, -1.0 / 3.0], dtype=torch.float64)
    pick = torch.randint(0, len(sentinels), (rows, cols), generator=gen)
    return sentinels[pick].to(dtype).double()


def make_case(M, K, N, num_slots, num_slices, max_rank, *, dtype=torch.float32, device="cpu", seed=0,
              ranks=None, token_slots=None, slice_widths=None, x_layout="contiguous", y_layout="contiguous",
              weight_layout="contiguous", capacity=None):
    """A random problem: signed data scaled so the delta is O(1); anything not given is drawn from
    ``seed``: ranks (<= max_rank, some 0), unsorted slots with -1, unequal slice widths. x, y and the weight
    stacks stored as their layouts say (:data:`LAYOUTS`, :data:`WEIGHT_LAYOUTS`)."""
    gen = torch.Generator().manual_seed(seed)
    L, S, R = num_slots, num_slices, max_rank
    ranks = random_ranks(L, R, gen) if ranks is None else list(ranks)
    if token_slots is None:
        token_slots = random_slots(M, L, gen)
    slice_widths = unequal_widths(N, S, gen) if slice_widths is None else list(slice_widths)
    slots = torch.as_tensor(token_slots, dtype=torch.int64).clone().reshape(M)   # a list or a tensor

    def rand(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=device)

    x = laid_out(rand(M, K, std=1.0), x_layout, gen)
    lora_a = rand(L, S, R, K, std=K ** -0.5)
    lora_b = rand(L, N, R, std=R ** -0.5)
    lora_a, lora_b = stacks_laid_out(lora_a, lora_b, weight_layout)
    sign = torch.randint(0, 2, (L,), generator=gen) * 2 - 1
    scale = (sign * (0.25 + 1.75 * torch.rand(L, generator=gen))).to(device)
    rank = torch.tensor(ranks, dtype=torch.int32, device=device)
    batch = LoRABatch(capacity or max(M, 1), L, device=device)
    if batch.max_tokens > M:  # leave stale token ids past M, as a serving loop does
        batch.update(torch.randint(-1, L, (batch.max_tokens,), generator=gen))
    batch.update(slots.to(device))
    return Case(x, lora_a, lora_b, scale, rank, slots.to(device), slice_widths, batch, y_layout, gen)


def expand_reference(h, lora_b, rank, token_slots, slice_widths):
    """float64 [M, N]: h[t, i, :rank] @ B[s_t, slice i, :rank]^T; zero for slot -1. Reads nothing of h
    past each token's rank, nor the rows of slot -1 (so those may hold NaN)."""
    slots = token_slots.long().cpu()
    M = slots.shape[0]
    N = lora_b.shape[1]
    h64, b64 = h.detach().double().cpu(), lora_b.detach().double().cpu()
    ranks = rank.cpu().tolist()
    out = torch.zeros(M, N, dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        r, col = ranks[s], 0
        for i, n in enumerate(slice_widths):
            out[t, col:col + n] = b64[s, col:col + n, :r] @ h64[t, i, :r]
            col += n
    return out

