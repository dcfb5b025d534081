"""Property tests of add_lora_ (fused), shrink and expand_ on both CPU backends against the float64 reference.

Hypothesis draws the problem: M 0..70 tokens, odd K and N, max rank 1..64 with per-slot ranks at or
below it (0 included), 1..3 output slices of unequal widths, 1..8 slots, unsorted slots with -1,
strided x / y / h / weight stacks, metadata capacity above M with stale ids past M. The Triton interpreter gets the
smaller shapes (it runs every program in Python) and checks bf16 values only through the test patch
of its bf16 arithmetic (tests/interp_bf16.py; DESIGN.md §6).
"""
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import interp_bf16
import lora_ops
from conftest import (DTYPES, FLOAT32_ROUNDOFF, H_TOLERANCE, INTERPRETED, LAYOUTS, TOLERANCE, WEIGHT_LAYOUTS,
                      add_lora_paths, dtype_id, expand_reference, force_add_lora_path, h_roundoff, make_case, rel_err,
                      ulp)
from lora_ops import configs, launch
from lora_ops.configs import heuristics
from lora_ops.configs.heuristics import ExpandConfig
from lora_ops.reference import lora_delta_reference, lora_forward_reference, shrink_reference

FP16_FP32 = [torch.float16, torch.float32]


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    max_k: int
    max_n: int
    max_rank: int = 64
    max_slots: int = 8


TORCH_LIMITS = Limits(max_tokens=70, max_k=301, max_n=201)
INTERP_LIMITS = Limits(max_tokens=70, max_k=49, max_n=49)
# The isolation test runs every problem twice: smaller still on the interpreter.
INTERP_ISOLATION_LIMITS = Limits(max_tokens=16, max_k=33, max_n=33, max_rank=32, max_slots=4)


def limits_for(backend, isolation=False):
    if not backend.interpreted:
        return TORCH_LIMITS
    return INTERP_ISOLATION_LIMITS if isolation else INTERP_LIMITS


def odd(max_value, min_value=1):
    return st.integers(min_value // 2, (max_value - 1) // 2).map(lambda i: 2 * i + 1)


@st.composite
def problems(draw, limits, min_tokens=0):
    """make_case keyword arguments (all but dtype and device)."""
    M = draw(st.integers(min_tokens, limits.max_tokens))
    S = draw(st.integers(1, 3))
    K = draw(odd(limits.max_k))
    N = draw(odd(limits.max_n, min_value=3))
    R = draw(st.integers(1, limits.max_rank))
    L = draw(st.integers(1, limits.max_slots))
    cuts = sorted(draw(st.lists(st.integers(1, N - 1), min_size=S - 1, max_size=S - 1, unique=True)))
    return dict(
        M=M, K=K, N=N, num_slots=L, num_slices=S, max_rank=R,
        ranks=draw(st.lists(st.integers(0, R), min_size=L, max_size=L)),
        token_slots=draw(st.lists(st.integers(-1, L - 1), min_size=M, max_size=M)),
        slice_widths=[b - a for a, b in zip([0] + cuts, cuts + [N])],
        x_layout=draw(st.sampled_from(LAYOUTS)), y_layout=draw(st.sampled_from(LAYOUTS)),
        weight_layout=draw(st.sampled_from(WEIGHT_LAYOUTS)),
        capacity=max(M + draw(st.integers(0, 4)), 1),
        seed=draw(st.integers(0, 2 ** 32 - 1)),
    )


def draw_case(data, backend, dtype, isolation=False, min_tokens=0):
    spec = data.draw(problems(limits_for(backend, isolation), min_tokens), label="problem")
    return make_case(**spec, dtype=dtype, device=backend.device)


@pytest.fixture(params=["fused", "split"], ids=["one_launch", "two_launches"])
def add_lora_path(request):
    """add_lora_'s Triton path: one launch (kernels.fused) or shrink + expand; the torch CPU kernel has one
    path and runs under both ids."""
    configs.force_path(request.param)
    yield request.param
    configs.force_path(None)


def add_lora(case, y):
    return lora_ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                             slice_widths=case.slice_widths)


def shrink_then_expand(case, y):
    h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)
    return lora_ops.expand(y, h, case.lora_b, case.rank, batch=case.meta, slice_widths=case.slice_widths)


# ------------------------------------------------------------------------------------------------
# Assertions
# ------------------------------------------------------------------------------------------------
def assert_delta_close(y_out, y_in, ref, dtype):
    """y_out - y_in against the reference delta, within the dtype's relative tolerance. From a non-zero y
    the sum's own rounding (half a step of each output that got a delta) is allowed on top: with y a few
    times the delta it alone can pass the tolerance (fp16, 3 outputs: 2.1e-3 against 2e-3)."""
    y_out, y_in = y_out.double().cpu(), y_in.double().cpu()
    delta = y_out - y_in
    rounding = (0.5 * ulp(y_out, dtype) * ((ref != 0) & (y_in != 0))).norm().item()
    err = rel_err(delta, ref)
    norm = ref.norm().item()
    allowed = TOLERANCE[dtype] + (rounding / norm if norm else 0.0)
    assert err <= allowed, f"relative error of the delta {err:.3g} > {allowed:.3g} ({dtype}; tolerance {TOLERANCE[dtype]:.0e})"


def bits(t):
    int_dtype = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.cpu().contiguous().view(int_dtype)


def assert_rows_bit_identical(y_out, y_in, rows, what):
    """y_out's and y_in's ``rows`` (a boolean mask) hold the same bits; either tensor on any device."""
    assert torch.equal(bits(y_out)[rows.cpu()], bits(y_in)[rows.cpu()]), f"{what} rows changed"


def assert_rows_equal(y_out, y_in, rows, what):
    rows = rows.to(y_out.device)
    assert torch.equal(y_out[rows].cpu(), y_in[rows].cpu()), f"{what} rows changed"


def assert_one_rounding_step(y_out, y_in, delta, abs_bound, terms, dtype, backend, where=None):
    """|y_out - round(y_in + delta)| <= one output step + the intermediates' worst-case error, at the
    entries ``where`` (default: all). That error is at most (``terms`` float32 roundings + one rounding
    of h to the expand's precision) times ``abs_bound``, the delta with every term made positive.
    A plain cast of h to 16 bits would fail this. ``backend`` None: ``delta`` is computed from h as the kernel
    loads it (the stacked path's 16-bit h), so h adds no rounding of its own."""
    exact = y_in.double().cpu() + delta
    rounded = exact.to(dtype).double()
    h_unit = FLOAT32_ROUNDOFF if backend is None else h_roundoff(dtype, backend)
    slack = ulp(rounded, dtype) + (terms * FLOAT32_ROUNDOFF + h_unit) * abs_bound
    off = (y_out.double().cpu() - rounded).abs()
    if where is not None:
        off, slack = off[where], slack[where]
    assert not torch.isnan(off).any(), "NaN in y"
    worst = (off / slack).max().item() if off.numel() else 0.0
    assert worst <= 1.0, (f"y is {worst:.3g} x (one rounding step + the intermediates' error) away from the "
                          "rounded exact result")


# ------------------------------------------------------------------------------------------------
# Values against the reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@given(data=st.data())
def test_add_lora_matches_reference(backend, checked_dtype, add_lora_path, data):
    dtype = checked_dtype
    case = draw_case(data, backend, dtype)
    M, K, N, L, S, R = case.shape
    ref = case.delta_reference()

    # From y = 0: the delta itself, within the dtype's tolerance; untouched rows stay exactly zero.
    y = case.new_y("zero")
    y_zero = y.clone()
    add_lora(case, y)
    assert_delta_close(y, y_zero, ref, dtype)
    assert_rows_equal(y, y_zero, case.untouched_rows(), "slot -1 / rank-0")

    # From a random y (sentinels in slot -1 rows): the same delta, rounded once onto y.
    y = case.new_y("random")
    y_in = y.clone()
    add_lora(case, y)
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")
    assert_one_rounding_step(y, y_in, ref, case.delta_abs_bound(), K + R + 4, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@given(data=st.data())
def test_shrink_matches_reference(backend, checked_dtype, data):
    case = draw_case(data, backend, checked_dtype)
    M, K, N, L, S, R = case.shape
    h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)

    assert (h.shape, h.dtype, h.device.type) == ((M, S, R), torch.float32, torch.device(backend.device).type)
    ref = shrink_reference(case.x, case.lora_a, case.scale, case.rank, case.token_slots)
    err = rel_err(h, ref)
    assert err <= H_TOLERANCE, f"relative error of h {err:.3g} > {H_TOLERANCE:.0e}"
    # h is a fresh tensor, so poison cannot show a missed write; the rows of slot -1 and the columns
    # at or past each token's rank must be exactly zero instead.
    h = h.cpu()
    assert torch.equal(h[case.no_adapter_rows()], torch.zeros_like(h[case.no_adapter_rows()])), "slot -1 rows of h"
    token_rank = case.rank.cpu().long()[case.token_slots.cpu().clamp(min=0)]
    past_rank = torch.arange(R)[None, None, :] >= token_rank[:, None, None]
    assert torch.equal(h[past_rank.expand_as(h)], torch.zeros(int(past_rank.expand_as(h).sum()))), \
        "h past the slot's rank"


def poisoned_h(case, layout):
    """Random float32 h [M, S, R] in ``layout``, NaN where expand must not read: slot -1 rows and past
    each token's rank."""
    M, _, _, _, S, R = case.shape
    h = torch.randn(M, S, R, generator=case.gen)
    token_rank = case.rank.cpu().long()[case.token_slots.cpu().clamp(min=0)]
    unread = (torch.arange(R)[None, :] >= token_rank[:, None]) | case.no_adapter_rows()[:, None]
    h.masked_fill_(unread[:, None, :], math.nan)
    device = case.x.device
    if layout == "rank_slice":
        out = torch.empty(M, S, R + 3, device=device)[:, :, :R]
    elif layout == "permuted":
        out = torch.empty(S, R, M, device=device).permute(2, 0, 1)
    else:
        out = torch.empty(M, S, R, device=device)
    return out.copy_(h)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@given(data=st.data())
def test_expand_matches_reference(backend, checked_dtype, data):
    dtype = checked_dtype
    case = draw_case(data, backend, dtype)
    M, K, N, L, S, R = case.shape
    h = poisoned_h(case, data.draw(st.sampled_from(["contiguous", "rank_slice", "permuted"]), label="h layout"))
    ref = expand_reference(h, case.lora_b, case.rank, case.token_slots, case.slice_widths)

    y = case.new_y("random")
    y_in = y.clone()
    lora_ops.expand(y, h, case.lora_b, case.rank, batch=case.meta, slice_widths=case.slice_widths)
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")
    abs_bound = expand_reference(h.abs(), case.lora_b.abs(), case.rank, case.token_slots, case.slice_widths)
    assert_one_rounding_step(y, y_in, ref, abs_bound, R + 4, dtype, backend)


# The expand kernel's two code paths (kernels.expand): the whole rank in one block (h split once, N_LOOP
# column blocks streamed with y prefetched; h as split-K partial sums, read launch.part_chunk at a time:
# counts below, at and past a chunk) and the rank loop (h summed); each with one and several column blocks
# per program. Entries: (config, max rank, partial sums).
EXPAND_PATH_CONFIGS = {
    "one_block-1_col_block-2_parts": (ExpandConfig(16, 16, 16, 4, 2, 1), 16, 2),
    "one_block-3_col_blocks-11_parts": (ExpandConfig(16, 16, 32, 4, 2, 3), 24, 11),
    "one_block-chunks_of_2-5_parts": (ExpandConfig(64, 16, 64, 4, 2, 2), 40, 5),
    "one_block-chunks_of_2-1_part": (ExpandConfig(64, 16, 64, 4, 2, 1), 40, 1),
    "one_block-rank_80_in_128-4_parts": (ExpandConfig(16, 16, 128, 4, 2, 1), 80, 4),
    "rank_loop-1_col_block": (ExpandConfig(32, 32, 16, 4, 3, 1), 40, 1),
    "rank_loop-2_col_blocks": (ExpandConfig(16, 16, 16, 4, 2, 2), 40, 1),
    # A program walking several token tiles with its block of B held (m_loop).
    "one_block-2_token_tiles-3_parts": (ExpandConfig(16, 32, 16, 4, 2, 1, 2), 16, 3),
    "one_block-3_token_tiles-1_part": (ExpandConfig(16, 16, 64, 4, 2, 1, 3), 40, 1),
}
TOKEN_LOOP_PATHS = [path for path, (cfg, _, _) in EXPAND_PATH_CONFIGS.items() if cfg.m_loop > 1]


def test_expand_path_configs_cover_part_chunks():
    chunks = {launch.part_chunk(cfg) for cfg, _, _ in EXPAND_PATH_CONFIGS.values()}
    assert {2, 8} <= chunks
    # One rank block past the heuristic's 64 (tuned tables, decode sizes at high rank) takes partial sums.
    assert any(R > 64 and parts > 1 for _, R, parts in EXPAND_PATH_CONFIGS.values())


def token_tile_slots(M, seed):
    """Shuffled slots of M tokens over expand_path_problem's 4 slots (ranks R, R // 2 + 1, 0, 3), most in the
    adapted ones: ~55% slot 0, ~25% slot 1, ~10% slot 3, ~5% slot 2 (rank 0), the rest -1. Uniform slots
    leave every adapted slot of 70 tokens within one 16-token tile, so a program's later tiles hold no rows."""
    sizes = [int(M * f) for f in (0.55, 0.25, 0.05, 0.10)]
    slots = torch.cat([torch.full((n,), s) for s, n in enumerate(sizes)] + [torch.full((M - sum(sizes),), -1)])
    return slots[torch.randperm(M, generator=torch.Generator().manual_seed(seed))].tolist()


def adapted_tokens_per_slot(case):
    """Tokens of each slot that get a delta (slot -1 and rank-0 slots count none), on the CPU."""
    slots = case.token_slots.cpu()
    counts = torch.bincount(slots[slots >= 0], minlength=case.rank.shape[0])
    return counts * (case.rank.cpu() > 0)


def expand_path_problem(path, dtype, device, seed, M=37, token_slots=None):
    """EXPAND_PATH_CONFIGS[path] on a fixed problem: M tokens over 4 slots (ranks R, R // 2 + 1, 0, 3),
    3 slices of unequal widths, h as the config's partial sums; B's rows past each slot's rank hold NaN
    (they must not be read). Returns (config, R, parts, case, y before the expand (random; made first: it
    takes its scale from the reference delta, which the poison would turn NaN), h's parts, the float64
    delta, the delta with every term made positive)."""
    cfg, R, num_parts = EXPAND_PATH_CONFIGS[path]
    assert num_parts == 1 or launch.takes_partials(cfg, R)
    K, N, L, S = 9, 75, 4, 3
    case = make_case(M, K, N, L, S, R, dtype=dtype, device=device, seed=seed, ranks=[R, R // 2 + 1, 0, 3],
                     slice_widths=[41, 29, 5], capacity=M + 5, token_slots=token_slots)
    y_in = case.new_y("random")
    parts = torch.stack([poisoned_h(case, "contiguous") for _ in range(num_parts)])
    past_rank = torch.arange(R, device=case.lora_b.device) >= case.rank[:, None, None].to(case.lora_b.device)
    case.lora_b.masked_fill_(past_rank, math.nan)  # must not be read
    ref = expand_reference(parts.double().sum(0), case.lora_b, case.rank, case.token_slots, case.slice_widths)
    abs_bound = expand_reference(parts.double().abs().sum(0), case.lora_b.abs(), case.rank, case.token_slots,
                                 case.slice_widths)
    return cfg, R, num_parts, case, y_in, parts, ref, abs_bound


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", EXPAND_PATH_CONFIGS, ids=str)
def test_expand_kernel_paths(triton_backend, checked_dtype, path):
    dtype = checked_dtype
    m_loop = EXPAND_PATH_CONFIGS[path][0].m_loop
    M = 70 if m_loop > 1 else 37
    cfg, R, num_parts, case, y_in, parts, ref, abs_bound = expand_path_problem(
        path, dtype, triton_backend.device, seed=3, M=M, token_slots=token_tile_slots(M, 3) if m_loop > 1 else None)
    assert int(adapted_tokens_per_slot(case).max()) > cfg.block_m * (cfg.m_loop - 1)   # the last tile holds rows
    y = y_in.clone()
    launch.launch_expand(y, parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg)
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")
    # The precision h meets B at (bf16: hi + lo terms; a plain cast to bf16 fails this).
    assert_one_rounding_step(y, y_in, ref, abs_bound, R + 4 + num_parts, dtype, triton_backend)


@pytest.mark.parametrize("M", [70, 150])
@pytest.mark.parametrize("path", TOKEN_LOOP_PATHS, ids=str)
def test_expand_token_loop_covers_every_tile(triton_backend, M, path):
    """Adapted slots of 7-82 tokens: a program's later token tiles hold rows (full, partial and past the slot's
    end); every adapted row gets its delta, no other row changes."""
    dtype = torch.float32
    cfg, R, num_parts, case, y_in, parts, ref, abs_bound = expand_path_problem(
        path, dtype, triton_backend.device, seed=M, M=M, token_slots=token_tile_slots(M, M))
    assert int(adapted_tokens_per_slot(case).max()) > cfg.block_m * (cfg.m_loop - 1)   # the last tile holds rows
    y = y_in.clone()
    launch.launch_expand(y, parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg)
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_rows_equal(y, y_in, case.untouched_rows(), "rank-0")


@pytest.mark.parametrize("path", TOKEN_LOOP_PATHS, ids=str)
def test_expand_token_loop_store_mode_writes_every_tile(triton_backend, path):
    """The store mode (y = the delta, y never read: launch.lora_linear's write-first path) over a program's token
    tiles: every row the metadata names is written (y NaN before), zeros where a token has no delta. Half of slot
    0's tokens moved to -1, so the tokens without a delta also fill a program's later tiles (token_tile_slots'
    few leave them within its first, where a zero fill of the first tile alone passed)."""
    dtype, M = torch.float32, 150
    slots = token_tile_slots(M, M)
    for i in [i for i, s in enumerate(slots) if s == 0][::2]:
        slots[i] = -1
    cfg, R, num_parts, case, y_in, parts, ref, _ = expand_path_problem(path, dtype, triton_backend.device, seed=M,
                                                                       M=M, token_slots=slots)
    tiles_before_last = cfg.block_m * (cfg.m_loop - 1)
    assert int(adapted_tokens_per_slot(case).max()) > tiles_before_last
    assert int(case.no_adapter_rows().sum()) > tiles_before_last
    y = torch.full_like(y_in, math.nan)
    launch.launch_expand(y, parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg, accumulate=False)
    assert not torch.isnan(y).any(), "rows the store mode left unwritten"
    assert_rows_equal(y, torch.zeros_like(y), case.untouched_rows(), "slot -1 / rank-0")
    assert_delta_close(y, torch.zeros_like(y), ref, dtype)


RANK_LOOP_PATHS = [path for path, (cfg, R, _) in EXPAND_PATH_CONFIGS.items() if not launch.takes_partials(cfg, R)]


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "store"])
@pytest.mark.parametrize("path", RANK_LOOP_PATHS, ids=str)
def test_expand_tokens_first_grid_matches_columns_first(triton_backend, monkeypatch, path, accumulate):
    """The rank loop's grid with its token tiles first (launch.expand_tokens_first: where one slot's B is
    large) computes every tile as the columns-first grid does: the same bits in every row, the store mode
    writing every row (y starts as NaN there)."""
    dtype = torch.float32
    # 150 tokens: more token tiles than column chunks, so a grid read the wrong way round misses tiles.
    cfg, R, _, case, y_in, parts, ref, _ = expand_path_problem(path, dtype, triton_backend.device, seed=7, M=150)
    out = {}
    for first in (False, True):
        monkeypatch.setattr(launch, "TOKENS_FIRST_MIN_B_BYTES", 0 if first else 1 << 62)
        y = y_in.clone() if accumulate else torch.full_like(y_in, math.nan)
        lc = launch.launch_expand(y, parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg,
                                  accumulate=accumulate, run=False)
        assert lc.constexprs.get("TOKENS_FIRST", False) is first
        columns = launch.slice_layout(case.slice_widths, cfg.block_n * cfg.n_loop)[1][-1]
        assert lc.grid[1 if first else 0] == columns, (lc.grid, columns)
        lc()
        out[first] = y
    assert torch.equal(bits(out[True]), bits(out[False]))
    if accumulate:
        assert_delta_close(out[True], y_in, ref, dtype)
        assert_rows_bit_identical(out[True], y_in, case.no_adapter_rows(), "slot -1")
    else:
        assert not torch.isnan(out[True]).any()
        assert_delta_close(out[True], torch.zeros_like(y_in), ref, dtype)


def test_expand_tokens_first_rule():
    """Token tiles first only for the rank loop, where one slot's B [N, R] holds the threshold or more, and
    where the column chunks fit CUDA's grid axis 1."""
    big = launch.TOKENS_FIRST_MIN_B_BYTES
    assert launch.expand_tokens_first(False, 28672, 320, 2, 112)            # Llama gate_up r320, bf16
    assert not launch.expand_tokens_first(True, 28672, 320, 2, 112)         # one rank block
    assert not launch.expand_tokens_first(False, 6144, 320, 2, 24)          # Llama qkv r320: 3.75 MiB
    assert launch.expand_tokens_first(False, big // 2, 1, 2, 65535)
    assert not launch.expand_tokens_first(False, big // 2, 1, 2, 65536)     # grid axis 1's limit
    assert not launch.expand_tokens_first(False, big // 2 - 1, 1, 2, 10)


@pytest.mark.parametrize("cfg,R", [(ExpandConfig(16, 16, 16, 4, 2, 2, 2), 16),
                                   (ExpandConfig(16, 16, 16, 4, 2, 1, 2), 40)], ids=["with_column_blocks", "rank_loop"])
def test_expand_token_loop_needs_one_column_block_and_rank_block(triton_backend, cfg, R):
    case = make_case(8, 9, 32, 2, 1, R, device=triton_backend.device, seed=1)
    h = torch.zeros(1, 8, 1, R, device=triton_backend.device)
    with pytest.raises(ValueError, match="m_loop > 1 needs n_loop 1"):
        launch.launch_expand(case.new_y("zero"), h, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg)


@pytest.mark.parametrize("path", ["one_block-3_col_blocks-11_parts", "rank_loop-2_col_blocks"])
def test_fast_bf16_rounds_h_to_one_term(triton_backend, bf16_interpreter, path):
    """launch.set_fast_bf16: h meets B as one bf16 term. Within one rounding of h to 8 bits (plus one
    output step) of the exact result, and measurably off the two-term result, so the switch is live."""
    dtype = torch.bfloat16
    cfg, R, num_parts, case, y_in, parts, ref, abs_bound = expand_path_problem(path, dtype, triton_backend.device,
                                                                               seed=5)
    outs = {}
    for fast in (False, True):
        launch.set_fast_bf16(fast)
        try:
            outs[fast] = y_in.clone()
            launch.launch_expand(outs[fast], parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg)
            assert_one_rounding_step(outs[fast], y_in, ref, abs_bound, R + 4 + num_parts, dtype, triton_backend)
        finally:
            launch.set_fast_bf16(False)
    assert_rows_bit_identical(outs[True], y_in, case.no_adapter_rows(), "slot -1")
    assert_delta_close(outs[True], y_in, ref, dtype)
    assert not torch.equal(outs[True], outs[False])
    assert rel_err(outs[True] - y_in.double(), ref) > rel_err(outs[False] - y_in.double(), ref)


# add_lora_'s pair above rank 64 in bf16: the shrink stores h as bf16 planes (hi, lo), which the rank loop
# multiplies as loaded (launch.h_planes); fp16 and float32 keep float32 h.
PLANES_PAIRS = {   # split count: 1 (the shrink stores h) or 3 (the last split adds the others, then stores)
    "one_split": heuristics.ShrinkConfig(16, 64, 16, 1, 4, 2),
    "three_splits": heuristics.ShrinkConfig(16, 64, 16, 3, 4, 2),
}


@pytest.mark.parametrize("fast", [False, True], ids=["bf16x2", "fast_bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("split", PLANES_PAIRS)
def test_rank_loop_takes_h_as_bf16_planes(triton_backend, checked_dtype, split, fast):
    dtype = checked_dtype
    R, ecfg = 80, ExpandConfig(16, 16, 32, 4, 2)   # the rank loop: two full rank blocks and a partial one
    case = make_case(37, 48, 40, 3, 2, R, dtype=dtype, device=triton_backend.device, seed=11)
    launch.set_fast_bf16(fast)
    try:
        planes = {torch.bfloat16: 1 if fast else 2}.get(dtype, 0)
        assert launch.h_planes(ecfg, R, dtype) == planes
        h = launch.shrink_buffer(case.x, case.lora_a, PLANES_PAIRS[split], ecfg)
        assert h.dtype == (dtype if planes else torch.float32) and h.shape[0] == max(planes, 1), h.shape
        h.fill_(math.nan)   # entries past a slot's rank (rounded up) and rows of slot -1 are never read
        y_in = case.new_y("random")
        y = y_in.clone()
        launch.launch_shrink_expand(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths,
                                    *case.meta, h, PLANES_PAIRS[split], ecfg)
    finally:
        launch.set_fast_bf16(False)
    ref = case.delta_reference()
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")
    assert_delta_close(y, y_in, ref, dtype)
    if planes == 2:   # hi + lo hold h to ~16 bits: as the float32 h split in registers
        # The same terms split in registers (float32 h = hi + lo: the transposed rank loop) give the same
        # products: within one step of y, so the lo plane counts.
        y32 = y_in.clone()
        h32 = torch.where(torch.isnan(h[0]), 0.0, h[0].float() + h[1].float()).unsqueeze(0)
        launch.launch_expand(y32, h32, case.lora_b, case.slice_widths, case.rank, *case.meta, ecfg)
        assert ((y.double() - y32.double()).abs() <= ulp(y32, dtype)).all()
        h_ref = shrink_reference(case.x, case.lora_a, case.scale, case.rank, case.token_slots).float().cpu()
        have = (case.token_slots >= 0).cpu()
        summed = (h[0].float() + h[1].float()).cpu()
        for s, r in enumerate(case.rank.tolist()):
            rows = have & (case.token_slots.cpu() == s)
            torch.testing.assert_close(summed[rows][..., :r], h_ref[rows][..., :r], rtol=2 ** -14, atol=1e-5)


@pytest.mark.parametrize("where", ["one_rank_block", "float32_h"])
def test_planes_in_turn_changes_nothing_without_two_planes(triton_backend, where):
    """The flag is for the rank loop over two bf16 planes; elsewhere the launch is the one without it (the
    same constexprs: no compile of its own)."""
    one_block = where == "one_rank_block"
    R, ecfg = (16, ExpandConfig(16, 16, 16, 4, 2)) if one_block else (80, ExpandConfig(16, 16, 32, 4, 2))
    case = make_case(9, 48, 40, 2, 2, R, dtype=torch.float16, device=triton_backend.device, seed=13)
    h = launch.shrink_buffer(case.x, case.lora_a, PLANES_PAIRS["one_split"], ecfg)
    launches = [launch.launch_expand(case.new_y("random"), h, case.lora_b, case.slice_widths, case.rank, *case.meta,
                                     ecfg._replace(planes_in_turn=flag), run=False) for flag in (False, True)]
    assert launches[0].constexprs == launches[1].constexprs and "PLANES_IN_TURN" not in launches[1].constexprs


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "store"])
def test_planes_in_turn_match_the_planes_loop_bit_for_bit(triton_backend, bf16_interpreter, accumulate):
    """The rank loop's variant with the planes taking turns (ExpandConfig.planes_in_turn: kernels.expand's
    PLANES_IN_TURN, one dot a step) multiplies the same terms in the same order as the shipped loop, so y is
    the same to the bit (a missing or wrong term shows; an order of the same terms would mostly hide in bf16's
    rounding of y). Every row the metadata names is written (y poisoned with NaN in the store mode)."""
    R, ecfg = 80, ExpandConfig(16, 16, 32, 4, 2)   # two full rank blocks and a partial one
    case = make_case(37, 48, 40, 3, 2, R, dtype=torch.bfloat16, device=triton_backend.device, seed=12)
    h = launch.shrink_buffer(case.x, case.lora_a, PLANES_PAIRS["one_split"], ecfg)
    assert h.shape[0] == 2, h.shape
    launch.launch_shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta, h, PLANES_PAIRS["one_split"])
    y_in = case.new_y("random") if accumulate else torch.full_like(case.new_y("random"), math.nan)
    outs = {}
    for in_turn in (False, True):
        y = y_in.clone()
        lc = launch.launch_expand(y, h, case.lora_b, case.slice_widths, case.rank, *case.meta,
                                  ecfg._replace(planes_in_turn=in_turn), accumulate=accumulate)
        assert lc.constexprs["H_PLANES"] == 2 and not lc.constexprs["ONE_RANK_BLOCK"]
        assert lc.constexprs.get("PLANES_IN_TURN", False) == in_turn
        outs[in_turn] = y
    assert not outs[True].isnan().any()
    assert torch.equal(outs[True], outs[False])
    ref = case.delta_reference()
    assert_delta_close(outs[True], y_in if accumulate else torch.zeros_like(y_in), ref, torch.bfloat16)


def test_float32_inputs_multiply_in_ieee_float32(triton_backend, monkeypatch):
    """float32 inputs: every product on every add_lora_ path in IEEE float32, never tf32 (the x.A dot's
    DOT_PRECISION, the h.B dot's H_PRECISION; kernels.work.split_f32). The interpreter multiplies a tf32 dot in
    float32, so no value here would show one: the launches' constexprs are the check (a GPU run's values too)."""
    case = make_case(9, 12, 10, num_slots=3, num_slices=2, max_rank=32, seed=18, device=triton_backend.device)
    seen = set()
    for name, path in add_lora_paths(32).items():
        force_add_lora_path(monkeypatch, path)
        launches, _, _ = launch.add_lora_launches(case.new_y("zero"), case.x, case.lora_a, case.lora_b, case.scale,
                                                  case.rank, case.slice_widths, *case.meta)
        for lc in launches:
            for key in ("DOT_PRECISION", "H_PRECISION"):
                if key in lc.constexprs:
                    seen.add((lc.launcher.kernel.__name__, key))
                    assert lc.constexprs[key] == "ieee", (name, lc.launcher.kernel.__name__, key, lc.constexprs[key])
    assert {("shrink_kernel", "DOT_PRECISION"), ("expand_kernel", "H_PRECISION"),
            ("fused_add_lora_kernel", "DOT_PRECISION"), ("fused_add_lora_kernel", "H_PRECISION")} <= seen


# ------------------------------------------------------------------------------------------------
# Isolation: a NaN in one slot's weights (or one token's x) reaches exactly the outputs it should
# ------------------------------------------------------------------------------------------------
def plant_nan(case, data):
    """Put one NaN into A, B or x; return the [M, N] bool mask of outputs it must turn into NaN."""
    M, K, N, L, S, R = case.shape
    slots = case.token_slots.cpu()
    ranks = case.rank.cpu().tolist()
    expected = torch.zeros(M, N, dtype=torch.bool)
    cols = torch.tensor(case.slice_widths).cumsum(0).tolist()
    target = data.draw(st.sampled_from(["lora_a", "lora_b", "x"]), label="NaN in")
    if target == "x":
        t = data.draw(st.integers(0, M - 1), label="token")
        case.x[t, data.draw(st.integers(0, K - 1), label="k")] = math.nan
        s = int(slots[t])
        expected[t] = s >= 0 and ranks[s] > 0
        return expected
    s = data.draw(st.integers(0, L - 1), label="slot")
    r = data.draw(st.integers(0, R - 1), label="r (past the rank: must not be read)")
    if target == "lora_a":
        i = data.draw(st.integers(0, S - 1), label="slice")
        case.lora_a[s, i, r, data.draw(st.integers(0, K - 1), label="k")] = math.nan
        hit_cols = torch.zeros(N, dtype=torch.bool)
        hit_cols[([0] + cols)[i]:cols[i]] = True
    else:
        n = data.draw(st.integers(0, N - 1), label="n")
        case.lora_b[s, n, r] = math.nan
        hit_cols = torch.arange(N) == n
    if r < ranks[s]:
        expected |= (slots == s)[:, None] & hit_cols[None, :]
    return expected


@pytest.mark.parametrize("path", [add_lora, shrink_then_expand], ids=["add_lora", "shrink+expand"])
@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
@given(data=st.data())
def test_nan_stays_in_its_slot(backend, dtype, path, add_lora_path, data):
    case = draw_case(data, backend, dtype, isolation=True, min_tokens=1)
    y_start = case.new_y("random")
    clean = path(case, y_start.clone())
    delta, abs_bound = case.delta_reference(), case.delta_abs_bound()
    expected = plant_nan(case, data)
    dirty = path(case, y_start.clone())

    assert torch.equal(torch.isnan(dirty).cpu(), expected), "NaN reached other outputs (or missed its own)"
    assert_rows_bit_identical(dirty, y_start, case.no_adapter_rows(), "slot -1")
    if backend.device == "cpu":  # deterministic: everything away from the NaN is exactly as before
        assert torch.equal(bits(dirty)[~expected], bits(clean)[~expected]), "outputs away from the NaN changed"
    else:  # split-K atomics may reorder float32 sums between runs: hold them to the rounding bound
        assert_one_rounding_step(dirty, y_start, delta, abs_bound, case.shape[1] + case.shape[5] + 4, dtype,
                                 backend, where=~expected)


def test_the_reference_never_reads_what_the_ops_skip():
    """The reference masked by multiplying: a NaN in a factor past a slot's rank or an inf in the input row of a
    token with no adapter (values the ops never read) made it NaN, where the ops are finite (session 54). It
    selects them away now: with them planted, it equals the reference of the clean problem."""
    gen = torch.Generator().manual_seed(0)
    M, K, N, L, R = 6, 7, 9, 3, 4
    x, a, b = (torch.randn(*shape, generator=gen) for shape in ((M, K), (L, 1, R, K), (L, N, R)))
    scale, rank = torch.tensor([0.5, -2.0, 1.0]), torch.tensor([2, 4, 0], dtype=torch.int32)
    slots = torch.tensor([-1, 0, 1, -1, 1, 2], dtype=torch.int32)
    a[2], b[2] = 0, 0       # (an empty slot of rank 0)
    clean = (lora_delta_reference(x, a, b, scale, rank, slots), shrink_reference(x, a, scale, rank, slots))
    x[0, 3], a[0, 0, 3, 1], b[0, 2, 2] = math.inf, math.nan, math.nan    # slot -1's row; slot 0 past rank 2
    x[5, 1] = math.inf                                                   # a row of the rank-0 slot
    planted = (lora_delta_reference(x, a, b, scale, rank, slots), shrink_reference(x, a, scale, rank, slots))
    for got, want in zip(planted, clean):
        assert not got.isnan().any() and torch.equal(got, want)


# ------------------------------------------------------------------------------------------------
# Edges
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("M", [9, 300], ids=["decode-expand_one_block", "prefill-expand_rank_loop"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rank_above_one_rank_block(backend, checked_dtype, add_lora_path, M):
    """Ranks past the kernels' 64-wide rank block: the rank loops take several blocks and stop at each
    slot's own rank (rank rows past it hold NaN, so reading them shows). The heuristic's expand holds the
    rank in one block at decode sizes (heuristics.ONE_BLOCK_LIMITS), and loops over it at 300 tokens."""
    dtype = checked_dtype
    K, N, L, S, R = 37, 29, 3, 2, 80
    if backend.interpreted:  # on CUDA a tuned table may choose otherwise
        assert heuristics.expand_rank_loops(heuristics.token_bucket(M), R, N) == (M == 300)
    case = make_case(M, K, N, L, S, R, dtype=dtype, device=backend.device, seed=11,
                     ranks=[80, 65, 3], token_slots=([0, 1, 2, -1, 0, 1, 2, 0, 1] * 34)[:M])
    ref = case.delta_reference()  # before the poison: the reference masks rank by multiplying
    y = case.new_y("random")
    y_in = y.clone()
    for s, r in enumerate([80, 65, 3]):
        case.lora_a[s, :, r:] = math.nan
        case.lora_b[s, :, r:] = math.nan
    add_lora(case, y)
    assert_delta_close(y, y_in, ref, dtype)
    assert_rows_bit_identical(y, y_in, case.no_adapter_rows(), "slot -1")


@pytest.mark.parametrize("M", [1, 9])
def test_y_that_is_x_takes_the_delta_of_x_before_the_write(backend, add_lora_path, M):
    """add_lora(x, x, ...): x += delta(x) on a square layer. The one-launch kernel's column blocks each read
    the x rows that earlier blocks had written (columns past the first block wrong; a race on a GPU): the
    launcher now copies x where its memory meets y's. Every path gives x + delta(x before)."""
    case = make_case(M, 70, 70, num_slots=3, num_slices=2, max_rank=8, seed=5, ranks=[8, 5, 3],
                     token_slots=([0, 1, -1, 2, 0, 2, 1, -1, 0])[:M], device=backend.device)
    expected = case.x.double().cpu() + case.delta_reference()
    xy = case.x
    assert add_lora(case, xy) is xy
    assert_rows_bit_identical(xy, expected.to(xy.dtype), case.no_adapter_rows(), "slot -1")
    assert rel_err(xy, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("shift", [4, 70 * 3 + 5], ids=["half_a_row", "rows_and_a_bit"])
def test_x_overlapping_y_takes_the_delta_of_x_before_the_write(backend, shift):
    """x and y views of one buffer, shifted (not the same view): the torch CPU kernels wrote one slot's rows of y
    before they read the next slot's x (off by 24 in a probe's case); every backend reads x as it was."""
    M, K = 9, 70
    case = make_case(M, K, K, num_slots=3, num_slices=2, max_rank=8, seed=8, ranks=[8, 5, 3],
                     token_slots=[0, 1, -1, 2, 0, 2, 1, -1, 0], device=backend.device)
    buffer = torch.randn(M * K + shift, generator=torch.Generator().manual_seed(9)).to(backend.device)
    y, x = buffer[:M * K].view(M, K), buffer[shift:shift + M * K].view(M, K)
    x.copy_(case.x)
    delta = lora_delta_reference(x, case.lora_a, case.lora_b, case.scale, case.rank, case.token_slots,
                                 case.slice_widths)
    expected = y.double().cpu() + delta
    lora_ops.add_lora(y, x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                      slice_widths=case.slice_widths)
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


def test_expand_into_memory_shifted_from_its_h(backend):
    """h a view of y's buffer a row and a half on: expand reads h as it was (the torch CPU kernels read later
    slots' h rows after earlier slots had written y over them)."""
    M, R, N = 9, 8, 12
    case = make_case(M, 20, N, num_slots=2, num_slices=1, max_rank=R, seed=10, ranks=[R, 5],
                     token_slots=[0, 1, -1, 1, 0, 0, 1, -1, 1], device=backend.device)
    buffer = torch.randn(M * N + 18, generator=torch.Generator().manual_seed(11)).to(backend.device)
    y, h = buffer[:M * N].view(M, N), buffer[18:18 + M * R].view(M, 1, R)
    h.copy_(lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta))
    expected = y.double().cpu() + expand_reference(h, case.lora_b, case.rank, case.token_slots, [N])
    lora_ops.expand(y, h, case.lora_b, case.rank, batch=case.meta, slice_widths=[N])
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


def test_expand_into_the_memory_of_its_h(triton_backend, monkeypatch):
    """expand(y, h, ...) with y over h's memory: the expand's column blocks each read h rows that others had
    written (two 16-wide blocks here). The launcher copies h first where they meet. (The torch CPU kernel reads a
    slot's h rows whole before it writes them, so y exactly over h is no hazard there; the shifted layout above
    is its test.)"""
    monkeypatch.setattr(configs, "expand_config", lambda *a, **k: ExpandConfig(16, 16, 32, 4, 1))
    M, R = 9, 32
    case = make_case(M, 20, R, num_slots=2, num_slices=1, max_rank=R, seed=6, ranks=[R, 7],
                     token_slots=[0, 1, -1, 1, 0, 0, 1, -1, 1], device=triton_backend.device)
    h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)   # [M, 1, R] float32
    y = h.view(M, R)
    expected = h.double().cpu().view(M, R) + expand_reference(h, case.lora_b, case.rank, case.token_slots, [R])
    lora_ops.expand(y, h, case.lora_b, case.rank, batch=case.meta, slice_widths=[R])
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


def _laid_over_y(y_rows, y_cols, t, seed, where="middle"):
    """(y [y_rows, y_cols], a copy of ``t``'s values in y's memory): laid from the middle of y on ("middle"), or
    ending in y's first rows ("end_under_head": the last slot's entries under the rows the first tokens write,
    so a backend that runs slots in order writes them before it reads them)."""
    n, size = t.numel(), y_rows * y_cols
    at, y_at = (size // 2, 0) if where == "middle" else (0, max(0, n - size // 2))
    buffer = torch.randn(max(y_at + size, at + n), generator=torch.Generator().manual_seed(seed)).to(t.device)
    alias = buffer[at:at + n].view(t.shape)
    alias.copy_(t)
    return buffer[y_at:y_at + size].view(y_rows, y_cols), alias


@pytest.mark.parametrize("where", ["middle", "end_under_head"])
@pytest.mark.parametrize("stack", ["lora_a", "lora_b", "scale"])
def test_a_weight_stack_viewing_y_is_read_as_it_was(backend, add_lora_path, stack, where):
    """lora_a, lora_b or scale a view of y's buffer (session 45's input audit: only x and h were copied where
    they met y, and the delta came out up to ~2 off on both backends): every floating input of the in-place ops
    is read as it was before the call. On the CPU a backend runs slots in order, so only a layout whose later
    slots' entries sit under rows earlier slots write shows a missing copy ("end_under_head"; the middle one
    alone passed on both backends without lora_a's copy, session 48's test audit)."""
    M, K, N = 9, 20, 12
    case = make_case(M, K, N, num_slots=2, num_slices=2, max_rank=4, seed=12, ranks=[4, 3],
                     token_slots=[0, 1, -1, 1, 0, 0, 1, -1, 1], device=backend.device)
    y, alias = _laid_over_y(M, N, getattr(case, stack), seed=13, where=where)
    stacks = {"lora_a": case.lora_a, "lora_b": case.lora_b, "scale": case.scale, stack: alias}
    expected = y.double().cpu() + case.delta_reference()
    lora_ops.add_lora(y, case.x, stacks["lora_a"], stacks["lora_b"], stacks["scale"], case.rank, batch=case.meta,
                      slice_widths=case.slice_widths)
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("where", ["middle", "end_under_head"])
def test_expand_reads_a_lora_b_viewing_y_as_it_was(backend, where):
    M, N, R = 9, 12, 4
    case = make_case(M, 20, N, num_slots=2, num_slices=1, max_rank=R, seed=14, ranks=[R, 3],
                     token_slots=[0, 1, -1, 1, 0, 0, 1, -1, 1], device=backend.device)
    h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)
    y, lora_b = _laid_over_y(M, N, case.lora_b, seed=15, where=where)
    expected = y.double().cpu() + expand_reference(h, case.lora_b, case.rank, case.token_slots, [N])
    lora_ops.expand(y, h, lora_b, case.rank, batch=case.meta, slice_widths=[N])
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


def test_x_sharing_y_memory_through_another_storage_is_read_as_it_was(backend):
    """x and y over one numpy array's memory through two storages (torch.from_numpy of overlapping slices): the
    overlap test compared the storages' identity, so nothing was copied and the torch CPU kernels (which write
    one slot's rows of y before they read the next slot's x) gave a delta ~3.9 off (session 45's audit)."""
    if torch.device(backend.device).type != "cpu":
        pytest.skip("numpy memory is the CPU's")
    M, N = 6, 6
    buffer = np.random.default_rng(0).standard_normal((M + 1) * N).astype(np.float32)
    y, x = torch.from_numpy(buffer[:M * N]).view(M, N), torch.from_numpy(buffer[N:]).view(M, N)   # x[i]: y[i + 1]
    case = make_case(M, N, N, num_slots=2, num_slices=1, max_rank=3, seed=16, ranks=[3, 3],
                     token_slots=[0, 1, 0, 1, 0, 1])
    delta = lora_delta_reference(x.clone(), case.lora_a, case.lora_b, case.scale, case.rank, case.token_slots,
                                 case.slice_widths)
    expected = y.double() + delta
    lora_ops.add_lora(y, x, case.lora_a, case.lora_b, case.scale, case.rank, batch=case.meta,
                      slice_widths=case.slice_widths)
    assert rel_err(y, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", FP16_FP32, ids=dtype_id)
def test_empty_batch_is_a_no_op(backend, dtype):
    case = make_case(0, 9, 11, num_slots=3, num_slices=2, max_rank=8, dtype=dtype, device=backend.device,
                     capacity=16)  # stale metadata from a batch of 16 first
    y = case.new_y("zero")
    assert add_lora(case, y) is y and y.shape == (0, 11)
    h = lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, batch=case.meta)
    assert (h.shape, h.dtype) == ((0, 2, 8), torch.float32)
    lora_ops.expand(y, h, case.lora_b, case.rank, batch=case.meta, slice_widths=case.slice_widths)
    assert y.shape == (0, 11)


# The rank loop computes rows of a tile's invalid tokens from token 0's h (unwritten memory here) and never
# stores them; the interpreter (numpy) warns when such a row holds inf/NaN garbage.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("R", [16, 80, 264], ids=["expand_adds_splits", "one_block_past_64", "shrink_adds_splits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_split_k_matches_reference(backend, checked_dtype, R):
    """K large enough that the Triton shrink splits K. Ranks 16 and 80: the expand adds the partial sums
    (the whole rank is one block; past 64 only at small token counts); rank 264 at 17 tokens: the expand's
    rank loop takes h summed, so the shrink adds them."""
    dtype = checked_dtype
    M, K, N, L, S = 17, 517, 33, 3, 2
    if backend.interpreted:  # on CUDA a tuned table may choose otherwise
        cfg = configs.shrink_config(M, K, S, R, L, torch.device("cpu"), dtype)
        assert cfg.split_k > 1, "this shape no longer exercises split-K"
        ecfg = configs.expand_config(M, N, S, R, L, torch.device("cpu"), dtype)
        assert launch.takes_partials(ecfg, R) == (R != 264)
    case = make_case(M, K, N, L, S, R, dtype=dtype, device=backend.device, seed=7,
                     ranks=[R, 5, 0], token_slots=([2, 0, -1, 1, 0] * 4)[:M])
    y = case.new_y("zero")
    add_lora(case, y)
    assert_delta_close(y, torch.zeros_like(y), case.delta_reference(), dtype)


def test_a_negative_slot_start_is_clamped_by_every_backend(backend):
    """Hand-built metadata with slot 0's start at -3: the kernels clamp it to 0 (kernels.work.find_slot_tile);
    the torch CPU kernels took it as a Python slice start from the end, and gave slot 0's delta to the tokens
    of the no-adapter group instead."""
    M = 8
    case = make_case(M, 12, 10, num_slots=3, num_slices=1, max_rank=4, seed=12, ranks=[4, 3, 2],
                     token_slots=[0, 0, 1, 1, 2, 2, -1, -1], device=backend.device)
    meta = lora_ops.BatchMeta(*(torch.tensor(v, dtype=torch.int32, device=backend.device) for v in
                                (list(range(M)), [-3, 2, 4, 6], [2, 2, 2, 2])))
    y = case.new_y("zero")
    lora_ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, batch=meta,
                      slice_widths=case.slice_widths)
    assert rel_err(y, case.delta_reference()) < TOLERANCE[torch.float32]
    # The gradients read the metadata alike: the backward ops, and the graph the double backward differentiates
    # (autograd._token_slots).
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.lora_a, case.lora_b)]
    refs = [t.detach().double().cpu().requires_grad_() for t in leaves]
    out = lora_ops.lora_forward(torch.zeros_like(y), *leaves, case.scale, case.rank, batch=meta,
                                slice_widths=case.slice_widths)
    ref = lora_forward_reference(torch.zeros(y.shape, dtype=torch.float64), *refs, case.scale.cpu(), case.rank.cpu(),
                                 case.token_slots.cpu(), case.slice_widths)
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out), create_graph=True)
    ref_grads = torch.autograd.grad(ref, refs, grad_out, create_graph=True)
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOLERANCE[torch.float32]
    second = torch.autograd.grad(grads[0].square().sum(), leaves[1])[0]
    assert rel_err(second, torch.autograd.grad(ref_grads[0].square().sum(), refs[1])[0]) < TOLERANCE[torch.float32]


# Hand-built metadata that no LoRABatch makes (sorted_token_ids has capacity 10, M = 8 tokens):
# (sorted_token_ids, slot_starts, slot_counts), slot 3 the no-adapter group.
CORRUPT_METAS = {
    "ids_outside_the_tokens": ([0, -1, 1, 8, 2, 3, 99, 4, 5, -7], [0, 2, 4, 8], [2, 2, 4, 2]),
    "count_past_the_buffer": ([0, 1, 2, 3, 4, 5, 6, 7, -1, -1], [0, 2, 4, 10], [2, 2, 1000, 0]),
    # Slot 0's count, unclamped, would give it more token tiles than the grid has, and slots 1 and 2 none.
    "count_past_the_buffer_first": ([0, 1, 2, 3, 4, 5, 6, 7, -1, -1], [6, 0, 2, 4], [1000, 2, 2, 2]),
    "start_past_the_buffer": ([0, 1, 2, 3, 4, 5, 6, 7, -1, -1], [0, 2, 50, 6], [2, 2, 2, 2]),
    "counts_negative": ([0, 1, 2, 3, 4, 5, 6, 7, -1, -1], [0, 2, 4, 6], [2, -5, 2, 2]),
    "runs_overlapping": ([0, 1, 2, 3, 4, 5, 6, 7, -1, -1], [0, 1, 1, 6], [3, 3, 8, 2]),
}


def delta_of_runs(case, ids, starts, counts):
    """float64 [M, N]: each slot's delta added to every token of its run as the kernels read it (the start
    clamped into the buffer, the run cut at its end, ids outside [0, M) skipped)."""
    M = case.x.shape[0]
    out = torch.zeros(M, case.lora_b.shape[1], dtype=torch.float64)
    for slot in range(case.lora_a.shape[0]):
        start = min(max(starts[slot], 0), len(ids))
        for token in ids[start:start + max(counts[slot], 0)]:
            if 0 <= token < M:
                as_slot = torch.full((M,), -1, dtype=torch.int64)
                as_slot[token] = slot
                out += lora_delta_reference(case.x, case.lora_a, case.lora_b, case.scale, case.rank, as_slot,
                                            case.slice_widths)
    return out


@pytest.mark.parametrize("corrupt", list(CORRUPT_METAS))
def test_corrupt_metadata_stays_in_bounds_on_every_backend(backend, corrupt):
    """No input makes a kernel read or write out of bounds: token ids outside [0, M), a run that starts or ends
    past sorted_token_ids, a negative count, runs that overlap. y (random at first) changes only within its
    rows (a sentinel row on either side stays), and while each token sits in one run at most, by exactly what
    the metadata says as far as the buffer and the tokens reach (delta_of_runs). Runs that overlap have no
    meaning (a path that maps each token to one slot gives it one of its runs): finite values, nothing outside.
    The shrink op over the same metadata runs too (a read past the buffer crashes the interpreter)."""
    M = 8
    case = make_case(M, 12, 10, num_slots=3, num_slices=2, max_rank=4, seed=14, ranks=[4, 3, 2],
                     token_slots=[0, 0, 1, 1, 2, 2, -1, -1], device=backend.device)
    ids, starts, counts = CORRUPT_METAS[corrupt]
    meta = lora_ops.BatchMeta(*(torch.tensor(v, dtype=torch.int32, device=backend.device)
                                for v in (ids, starts, counts)))
    guarded = torch.randn(M + 2, 10, generator=torch.Generator().manual_seed(15)).to(backend.device)
    before = guarded.clone()
    y = guarded[1:M + 1]                            # a row of sentinels before and after y
    lora_ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, batch=meta,
                      slice_widths=case.slice_widths)
    assert torch.equal(guarded[0], before[0]) and torch.equal(guarded[M + 1], before[M + 1])
    assert y.isfinite().all()
    if corrupt != "runs_overlapping":
        want = delta_of_runs(case, ids, starts, counts)
        assert want.abs().sum() > 0
        assert rel_err(y.double().cpu() - before[1:M + 1].double().cpu(), want) < TOLERANCE[torch.float32]
    h = torch.ops.lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, *meta)
    assert h.shape == (M, 2, 4)


@pytest.mark.parametrize("path", list(add_lora_paths(32)) + ["shrink_op"])
def test_ranks_outside_the_stack_are_clamped_by_the_kernels(triton_backend, monkeypatch, path):
    """A rank above the stack's R, or below 0, which the ops refuse on CPU tensors but nothing checks on a GPU
    (a device sync): every kernel clamps it into [0, R] (kernels.work.find_slot_tile). The stacks are views of
    wider ones with NaN past R, so a kernel reading past a slot's R rank entries (the one-launch kernel's second
    rank block; the rank loop's partial block) shows. The launches are the ops' own, run without the ops' checks."""
    R = 32
    case = make_case(9, 12, 10, num_slots=3, num_slices=2, max_rank=R, seed=17, ranks=[R, 3, 7],
                     token_slots=[0, 1, 2, -1, 0, 2, 1, 0, 2], weight_layout="padded", device=triton_backend.device)
    corrupt = torch.tensor([R + 5, -4, 7], dtype=torch.int32, device=triton_backend.device)
    clamped = torch.tensor([R, 0, 7], dtype=torch.int32)
    if path == "shrink_op":
        (lc,), _, (h, *_) = launch.shrink_launches(case.x, case.lora_a, case.scale, corrupt, *case.meta)
        lc()
        ref = shrink_reference(case.x, case.lora_a, case.scale, clamped, case.token_slots)
        assert not torch.isnan(h).any() and rel_err(h, ref) < H_TOLERANCE
        return
    force_add_lora_path(monkeypatch, add_lora_paths(R)[path])
    y_in = case.new_y("random")
    y = y_in.clone()
    launches, _, _ = launch.add_lora_launches(y, case.x, case.lora_a, case.lora_b, case.scale, corrupt,
                                              case.slice_widths, *case.meta)
    for lc in launches:
        lc()
    ref = lora_delta_reference(case.x, case.lora_a, case.lora_b, case.scale, clamped, case.token_slots,
                               case.slice_widths)
    assert_delta_close(y, y_in, ref, torch.float32)
    assert_rows_bit_identical(y, y_in, (case.token_slots < 0) | (case.token_slots == 1), "slot -1 / rank below 0")


@pytest.mark.parametrize("bad_slot", [-2, 3], ids=["below_-1", "equal_to_L"])
@pytest.mark.parametrize("op", ["add_lora", "shrink", "expand"])
def test_cpu_slot_out_of_range_raises(backend, op, bad_slot):
    if backend.device != "cpu":
        pytest.skip("the slot range is checked on CPU only (no device sync)")
    case = make_case(4, 9, 11, num_slots=3, num_slices=1, max_rank=4, device=backend.device)
    slots = torch.tensor([0, bad_slot, -1, 2], device=backend.device)
    y = case.new_y("zero")
    calls = {
        "add_lora": lambda: lora_ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                                              token_slots=slots),
        "shrink": lambda: lora_ops.shrink(case.x, case.lora_a, case.scale, case.rank, token_slots=slots),
        "expand": lambda: lora_ops.expand(y, torch.zeros(4, 1, 4, device=backend.device), case.lora_b, case.rank,
                                          token_slots=slots),
    }
    with pytest.raises(ValueError, match=rf"token_slots: slot {bad_slot} at token 1 is outside \[-1, max_loras=3\)"):
        calls[op]()


# ------------------------------------------------------------------------------------------------
# The bf16 interpreter patch itself (tests/interp_bf16.py)
# ------------------------------------------------------------------------------------------------
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="only the Triton interpreter has the bf16 problem")


def integer_bf16_tiles(seed=0):
    """Two 16 x 16 bf16 tiles of small integers: their float32 dot is exact, so the bf16 result has a
    single right answer (round to nearest even; sums past 256 need rounding, ties included)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, (16, 16), generator=gen).to(torch.bfloat16) for _ in range(2)]


def cast_probe_values():
    """float32 values whose bf16 rounding differs from truncation, ties both ways, specials."""
    return torch.tensor([1 + 2 ** -8 + 2 ** -10, -(3 + 3 * 2 ** -8), 1 + 2 ** -8, 1 + 3 * 2 ** -8, 259.0, 3.4e38,
                         -1e-40, math.inf, -0.0, 0.1, -2.5e-3, 65504.0, 1.0, 7.0, 2 ** -130, math.nan],
                        dtype=torch.float32)


@needs_interpreter
def test_unpatched_interpreter_gets_bf16_wrong():
    """Why the bf16_interpreter fixture exists: without it, bf16 dot, add and cast are all wrong."""
    a, b = integer_bf16_tiles()
    dot, add = interp_bf16.run_probe(a, b)
    want = (a.double() @ b.double()).to(torch.bfloat16)
    assert rel_err(dot, want) > 1e3, "the interpreter's bf16 dot is right now: is the patch still needed?"
    assert not torch.equal(add, a + b), "the interpreter's bf16 add is right now: is the patch still needed?"
    values = cast_probe_values().nan_to_num(nan=0.5)  # the stock cast's NaN is not the question here
    assert not torch.equal(interp_bf16.run_cast_probe(values), values.to(torch.bfloat16)), \
        "the interpreter's fp32 -> bf16 cast rounds to nearest even now: is the patch still needed?"


@needs_interpreter
def test_bf16_patch_matches_torch(bf16_interpreter):
    a, b = integer_bf16_tiles()
    dot, add = interp_bf16.run_probe(a, b)
    assert torch.equal(dot, (a.double() @ b.double()).to(torch.bfloat16))
    assert torch.equal(add, a + b)
    values = cast_probe_values()
    cast, want = interp_bf16.run_cast_probe(values), values.to(torch.bfloat16)
    nan = torch.isnan(values)
    assert torch.equal(torch.isnan(cast), nan)  # NaN stays NaN (payloads differ between libraries)
    assert torch.equal(bits(cast[~nan]), bits(want[~nan]))


@needs_interpreter
def test_bf16_patch_is_scoped():
    """The patch is undone when the block exits, even on error (other tests see the stock interpreter)."""
    from triton.runtime.interpreter import InterpreterBuilder
    before = {name: InterpreterBuilder.__dict__[name] for name in ("binary_op", "create_dot", "cast_impl")}
    with pytest.raises(RuntimeError, match="boom"):
        with interp_bf16.patched():
            assert InterpreterBuilder.__dict__["create_dot"] is not before["create_dot"]
            raise RuntimeError("boom")
    assert {name: InterpreterBuilder.__dict__[name] for name in before} == before


def test_rank_loop_refuses_partial_sums(triton_backend):
    cfg, R, _ = EXPAND_PATH_CONFIGS["rank_loop-1_col_block"]
    case = make_case(4, 9, 11, 2, 1, R, device=triton_backend.device)
    parts = torch.zeros(2, 4, 1, R, device=triton_backend.device)
    with pytest.raises(ValueError, match="h: the expand's rank loop"):
        launch.launch_expand(case.new_y("zero"), parts, case.lora_b, case.slice_widths, case.rank, *case.meta, cfg)
