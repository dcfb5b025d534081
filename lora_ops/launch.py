"""Plain launchers of the Triton kernels: validate, pick a config, compute the grid from shapes, launch.

Grids depend on shapes and capacities only (token count M, slot capacity L, max rank R, slice widths),
never on tensor data, so they are CUDA-graph safe; the programs find their work on the device
(lora_ops.kernels.work). Nothing here reads tensor data on the host.
"""
import functools
import os
from typing import NamedTuple

import torch

from csrc_meta import checks
from lora_ops import configs, plan
from lora_ops.precision import base_addmm_, base_linear, stacked_gemm
from lora_ops.configs.heuristics import cdiv, max_token_tiles, next_power_of_2, rank_align
from lora_ops.kernels import expand as expand_kernels
from lora_ops.kernels import fused as fused_kernels
from lora_ops.kernels import shrink as shrink_kernels
from lora_ops.kernels.work import gdc_wait
from lora_ops import triton_launch
from lora_ops.triton_launch import FastLauncher

SHRINK = FastLauncher(shrink_kernels.shrink_kernel)
EXPAND = FastLauncher(expand_kernels.expand_kernel)
FUSED = FastLauncher(fused_kernels.fused_add_lora_kernel)

_DOT_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}
# How an fp32 operand (h, dh) meets a weight-dtype operand on the tensor cores (kernels.work.split_f32);
# one choice for the forward and the backward kernels (f32_operand_precision).
F32_OPERAND_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "bf16x2"}
_fast_bf16 = {"on": os.environ.get("LORA_OPS_FAST_BF16", "0") == "1"}


def set_fast_bf16(on):
    """bf16 weights: let the fp32 h (and the backward's dh) meet them on the tensor cores as one bf16 term
    instead of two (default off; ``LORA_OPS_FAST_BF16=1`` turns it on). One MMA instead of two per
    product: h is rounded to 8 significant bits before the expand, as vLLM and PEFT's bf16 path do (two
    terms keep ~16). H200, 2026-12-03 (highrank grid): 0.87-0.94 of the time at 1024-8192 tokens, error
    3.2e-3 against 2.8e-3 where the delta is as large as y. CUDA graphs captured before the switch keep
    their kernels."""
    _fast_bf16["on"] = bool(on)
    plan.clear()      # plans hold the launch constexprs


def f32_operand_precision(dtype):
    """The kernels' H_PRECISION / PRECISION for weights of ``dtype`` (kernels.work.split_f32)."""
    if dtype == torch.bfloat16 and _fast_bf16["on"]:
        return "bf16"
    return F32_OPERAND_PRECISION[dtype]


def slice_layout(slice_widths, block_n):
    """(column offsets, column-block offsets) of the output slices, S + 1 entries each."""
    return _slice_layout(tuple(slice_widths), block_n)


@functools.lru_cache(maxsize=1024)
def _slice_layout(slice_widths, block_n):
    # Remembered: a model has a few layer layouts, and this ran on every launch (~5 µs of host time).
    cols, blocks = [0], [0]
    for n in slice_widths:
        cols.append(cols[-1] + n)
        blocks.append(blocks[-1] + cdiv(n, block_n))
    return tuple(cols), tuple(blocks)


MAX_GRID_YZ = 65535    # CUDA's limit on a grid's second and third axes


class Launch(NamedTuple):
    """One kernel launch, everything bound: ``launch()`` runs it. The launchers below build these, so a
    plan (lora_ops.plan) can keep what a call derives from shapes and replay it with other tensors."""
    launcher: FastLauncher
    grid: tuple
    tensors: tuple
    ints: tuple
    constexprs: dict

    def __call__(self):
        self.launcher(self.grid, self.tensors, self.ints, **self.constexprs)

    def run_if(self, run, too_large="x: too many tokens for one call", axes="axis 1 counts the token tiles",
               remedy="split the batch"):
        """Run it if ``run``; return it either way (what the launchers below end with). A grid past CUDA's
        limits (65535 programs on axes 1 and 2) is a clear error here, not a failed launch: ``too_large``
        names the argument and what is too large, ``axes`` what the grid's axes count (by default the
        token tiles on axis 1, as in every kernel but the tokens-first expand and segment_outer)."""
        too_many = [n for n in self.grid[1:] if n > MAX_GRID_YZ]
        if too_many:
            raise ValueError(f"{too_large}: {self.launcher.kernel.__name__}'s grid {self.grid} has {too_many[0]} "
                             f"programs on an axis that holds at most {MAX_GRID_YZ} ({axes}); {remedy}")
        if run:
            self()
        return self


class Scratch(NamedTuple):
    """A buffer a launch needs (or an op returns) for one call; ``zero``: it must start zeroed."""
    shape: tuple
    dtype: torch.dtype
    zero: bool = False

    def alloc(self, device):
        return (torch.zeros if self.zero else torch.empty)(self.shape, dtype=self.dtype, device=device)


def shrink_sum_scratch(M, S, R, grid, cfg):
    """The buffers a split-K shrink that sums its own splits needs: per-split partial sums, and one zeroed
    arrival counter per (column block, token tile). Empty when the shrink needs none."""
    if cfg.split_k == 1:
        return ()
    return Scratch((cfg.split_k, M, S, R), torch.float32), Scratch((grid[0] * grid[1],), torch.int32, zero=True)


def shrink_grid(M, S, R, L, cfg):
    """(Its token axis also covers group L's tiles, the tokens without an adapter, where the kernel writes all of
    h: heuristics.max_token_tiles.)"""
    return (cdiv(S, cfg.slice_group) * cdiv(R, cfg.block_r), max_token_tiles(M, L, cfg.block_m), cfg.split_k)


def launch_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, h, cfg, partials_out=False,
                  sum_scratch=None, run=True, pdl=False, slice_k=None, write_all=False):
    """h [M, S, R] float32 gets scale * x A^T at valid entries (deterministically, also with split-K).
    h may be [1, M, S, R] (add_lora_'s buffer, :func:`shrink_buffer`), or [planes, M, S, R] in x's 16-bit
    dtype: h as bf16 terms (:func:`h_planes`: hi, then lo = h - hi), for the expand's rank loop.

    With ``partials_out`` (and split-K), h is [split_k, M, S, R] and gets each split's partial sums, for
    a consumer that adds them in order (launch_expand): no counters, no zero-fill, one round trip less.
    Otherwise a split-K shrink sums its splits in ``sum_scratch`` (the buffers :func:`shrink_sum_scratch`
    names; allocated here when not given). Returns the :class:`Launch`, run unless ``run`` is False.

    ``slice_k`` (with cfg.slice_group 1): S + 1 feature offsets, slice i reading x's and A's features
    [slice_k[i], slice_k[i + 1]) only (kernels.shrink's SLICE_K: the backward's dh, launch_grad.lora_grad_h).

    ``write_all`` (float32 h, not ``partials_out``): every entry of h a token the metadata names has is written,
    zeros where it has no delta, so h need not start zeroed (kernels.shrink's WRITE_ALL)."""
    M, K = x.shape
    L, S, R, _ = lora_a.shape
    assert slice_k is None or cfg.slice_group == 1, "slice_k: each program reads one slice's features"
    x, lora_a = addressable(x), addressable(lora_a)
    partials_out = partials_out and cfg.split_k > 1
    planes = planes_in(h)
    assert not write_all or not (partials_out or planes), "write_all: h itself, float32"
    grid = shrink_grid(M, S, R, L, cfg)
    # No views of h: a plan finds every tensor of a launch among the call's tensors and its scratch.
    h_strides = (*h.stride()[-3:], h.stride(0) if planes else 0)
    if partials_out:
        part, arrivals, part_strides = h, sorted_token_ids, h.stride()
    elif cfg.split_k > 1:
        if sum_scratch is None:
            sum_scratch = [s.alloc(x.device) for s in shrink_sum_scratch(M, S, R, grid, cfg)]
        part, arrivals = sum_scratch
        part_strides = part.stride()
        assert arrivals.numel() >= grid[0] * grid[1], "sum_scratch: an arrival counter per (column block, tile)"
    else:  # one split: its partial sums are h itself (the part stride is never used)
        part, arrivals, part_strides = h, sorted_token_ids, (h_strides[0] * M, *h_strides[:3])
    return Launch(
        SHRINK, grid, (x, lora_a, h, part, arrivals, scale, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, K, S, L, R, sorted_token_ids.shape[0], cfg.split_k,
         *x.stride(), *lora_a.stride(), *h_strides, *part_strides,
         *plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts)),
        dict(BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, SLICE_GROUP=cfg.slice_group, BLOCK_K=cfg.block_k,
             SPLIT_K=cfg.split_k > 1, PARTIALS_OUT=partials_out, SLOTS_POW2=next_power_of_2(L),
             DOT_PRECISION=_DOT_PRECISION[x.dtype], H_PLANES=planes, RANK_ALIGN=rank_align(R), SLICE_K=slice_k,
             WRITE_ALL=write_all, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl)),
    ).run_if(run)


def launch_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts, cfg, run=True,
                  pdl=False, accumulate=True):
    """y[:, slices] += h @ B^T per slice; h [M, S, R] float32, or [P, M, S, R] partial sums added in order,
    or [planes, M, S, R] bf16 terms as :func:`launch_shrink` stores them (zeros between each slot's rank and
    the rank rounded up to ``heuristics.rank_align(R)``, which the rank loop reads).
    Returns the :class:`Launch`, run unless ``run`` is False. ``pdl``: only right after a ``pdl`` shrink
    (see :func:`pdl_options`). ``accumulate=False``: y = the delta instead, y never read, rows of tokens
    without a delta zeroed (every row the metadata names is written; kernels.expand, ACCUMULATE)."""
    M = y.shape[0]
    R = lora_b.shape[2]
    h = addressable(h)
    planes = planes_in(h)
    num_parts = h.shape[0] if h.dim() == 4 and not planes else 1
    part_strides = h.stride() if h.dim() == 4 else (h.stride(0) * M, *h.stride())   # no view of h (see above)
    if num_parts > 1 and not takes_partials(cfg, R):
        raise ValueError(f"h: the expand's rank loop (rank {R} > block_r {cfg.block_r}) takes one part, got "
                         f"{num_parts} partial sums")
    if planes and takes_partials(cfg, R):
        raise ValueError(f"h: {h.dtype} planes are for the expand's rank loop (rank {R} > block_r {cfg.block_r})")
    hp, hm, hs, hr = part_strides
    extra = dict(H_PLANES=planes, **pdl_options(pdl))
    if not accumulate:
        extra["ACCUMULATE"] = False
    return _expand_launch(y, h, (0, hp, hm, 0, hs, hr), num_parts, rank, lora_b, slice_widths, rank,
                          sorted_token_ids, slot_starts, slot_counts, cfg, f32_operand_precision(y.dtype),
                          extra, run)


def launch_expand_stacked(y_ext, out_features, lora_b, slice_widths, rank, scale, sorted_token_ids, slot_starts,
                          slot_counts, cfg, run=True, pdl=False):
    """The stacked path's expand (kernels.expand, SCALE_BY_SLOT): y_ext [M, N + L·S·R (+ padding)] is
    F.linear(x, [W; A]) with A [L, S, R, K] stacked under the base weight W [N, K]: columns [0, N) y,
    columns N + (l·S + i)·R + r slot l's unscaled h for slice i (padding columns are not read). Adds
    scale[s_t] · h[t, s_t, i] @ B^T into the y columns of each adapted token. Returns the :class:`Launch`,
    run unless ``run`` is False. ``pdl``: launched with programmatic dependent launch right behind the GEMM
    (the kernel waits before reading y)."""
    L, _, R = lora_b.shape
    S = len(slice_widths)
    row, col = y_ext.stride()
    # Layout of h inside y_ext: offset N columns, then [slot, slice, rank] blocks of the row.
    h_layout = (out_features * col, 0, row, S * R * col, R * col, col)
    precision = "bf16" if y_ext.dtype == torch.bfloat16 else F32_OPERAND_PRECISION[y_ext.dtype]   # h: exact
    return _expand_launch(y_ext, y_ext, h_layout, 1, scale, lora_b, slice_widths, rank, sorted_token_ids,
                          slot_starts, slot_counts, cfg, precision, dict(SCALE_BY_SLOT=True, **pdl_options(pdl)), run)


def _expand_launch(y, h, h_layout, num_parts, scale, lora_b, slice_widths, rank, sorted_token_ids, slot_starts,
                   slot_counts, cfg, h_precision, extra, run):
    """The expand kernel's launch: h_layout = (offset, part, token, slot, slice, rank strides) of h in
    elements; ``scale`` is read only with SCALE_BY_SLOT (in ``extra``)."""
    M = y.shape[0]
    L, _, R = lora_b.shape
    lora_b = addressable(lora_b)
    h_offset, *h_strides = h_layout
    cols, chunks = slice_layout(slice_widths, cfg.block_n * cfg.n_loop)
    one_block = takes_partials(cfg, R)
    if cfg.m_loop > 1 and (cfg.n_loop > 1 or not one_block):
        raise ValueError(f"expand config {cfg}: m_loop > 1 needs n_loop 1 and the rank ({R}) within block_r")
    if cfg.planes_in_turn and extra.get("H_PLANES") == 2 and not one_block:
        extra = dict(extra, PLANES_IN_TURN=True)   # (elsewhere the flag changes nothing: no compile of its own)
    grid = (chunks[-1], max_token_tiles(M, L, cfg.block_m * cfg.m_loop))
    if expand_tokens_first(one_block, sum(slice_widths), R, lora_b.element_size(), grid[0]):
        grid = grid[::-1]
        extra = dict(extra, TOKENS_FIRST=True)
    return Launch(
        EXPAND, grid, (h, lora_b, y, rank, sorted_token_ids, slot_starts, slot_counts, scale),
        (M, L, R, sorted_token_ids.shape[0], num_parts, h_offset, *h_strides, *lora_b.stride(), *y.stride(),
         *plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts)),
        dict(SLICE_COLS=cols, SLICE_CHUNKS=chunks,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, N_LOOP=cfg.n_loop,
             ONE_RANK_BLOCK=one_block, PART_CHUNK=part_chunk(cfg), SLOTS_POW2=next_power_of_2(L),
             RANK_ALIGN=rank_align(R), H_PRECISION=h_precision, M_LOOP=cfg.m_loop,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra),
    ).run_if(run)


# ---- programmatic dependent launch (sm_90+) ----------------------------------------------------------

_pdl = {"on": os.environ.get("LORA_OPS_PDL", "1") != "0"}


def set_pdl(on):
    """Launch add_lora_'s shrink and expand with programmatic dependent launch where the GPU and Triton
    allow it (default on; ``LORA_OPS_PDL=0`` turns it off); benchmarks compare."""
    _pdl["on"] = bool(on)
    plan.clear()      # plans hold the launch options


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index):
    return gdc_wait is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(x):
    """Whether add_lora_ on ``x``'s device launches its pair with PDL: a CUDA device of sm_90 or later,
    a Triton with grid dependency control (kernels.work), and not turned off."""
    return _pdl["on"] and x.is_cuda and _pdl_capable(x.device.index)


def pdl_options(pdl):
    """The kernel arguments of a launch with (or without) programmatic dependent launch. With it, the
    kernel may start before the previous one in the stream ends (kernels.shrink / kernels.expand say what
    each does before waiting for it); without, the PDL constexpr compiles the waits out."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


# Registers per thread a chunk of partial sums may hold in flight (kernels.expand, PART_CHUNK): eight
# 64 x 16 fp32 tiles at 4 warps; two 64 x 64 ones.
PART_CHUNK_VALUES_PER_THREAD = 64
MAX_PART_CHUNK = 8


def part_chunk(expand_cfg):
    """How many split-K partial sums the expand loads at once (a power of two, 1..MAX_PART_CHUNK)."""
    per_part = max(1, expand_cfg.block_m * expand_cfg.block_r // (32 * expand_cfg.num_warps))
    fits = max(1, PART_CHUNK_VALUES_PER_THREAD // per_part)
    return min(MAX_PART_CHUNK, 1 << (fits.bit_length() - 1))  # the largest power of two that fits


# The rank-loop expand's grid takes its token tiles first where one slot's B is at least this large
# (kernels.expand, TOKENS_FIRST). H200, session 22 (ab_trees at 1024 / 4096 tokens, tokens first for every
# rank loop): gate_up at ranks 256-320 (Llama's B 14-18 MiB a slot, Phi-4-mini's 8-10) took 0.95-0.99 of the
# time (Llama r320 at 4096 tokens 403 -> 389 us), Llama gate_up r128 (7 MiB) 0.99-1.00; the other layers
# (B 4 MiB or less) moved within +-1.5%, the worst +3.6% (Phi-4-mini qkv r320 at 1024): there the column
# blocks stay first.
TOKENS_FIRST_MIN_B_BYTES = 6 << 20


def expand_tokens_first(one_block, out_features, max_rank, element_size, chunks):
    """Whether the expand's grid is (token tiles, column chunks) rather than (column chunks, token tiles):
    for the rank loop where one slot's B [N, R] holds TOKENS_FIRST_MIN_B_BYTES or more, so the programs
    running together share its column blocks instead of each wave streaming all of it for one or two
    token tiles. The chunks then go on grid axis 1, which CUDA caps at 65535."""
    return (not one_block and chunks <= MAX_GRID_YZ
            and out_features * max_rank * element_size >= TOKENS_FIRST_MIN_B_BYTES)


def takes_partials(expand_cfg, max_rank):
    """Whether the expand can add the shrink's split-K partial sums itself: only where the whole rank is
    one block (kernels.expand); the rank loop wants h summed."""
    return max_rank <= expand_cfg.block_r


def addressable(t):
    """``t``, or its row-major copy where an offset along a dimension after the first passes 2^31 elements
    ((size - 1) * stride: a transposed x of 4 GiB or more, a view whose ranks or features lie far apart). The
    kernels compute some of those offsets (rank and feature columns) in 32 bits, the first dimension's (token
    rows, slots) in 64: such a view made them read gigabytes before the tensor (session 54, the interpreter).
    The copy also keeps such a call out of the plans (a plan takes only the call's own tensors)."""
    for size, stride in zip(t.shape[1:], t.stride()[1:]):
        if size > 1 and (size - 1) * stride >= 2 ** 31:
            return t.contiguous()
    return t


def launch_fused(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                 cfg, run=True):
    """y[:, slices] += scale * (x A^T) B^T in one launch (small batches; see kernels.fused). Returns the
    :class:`Launch`, run unless ``run`` is False."""
    M, K = x.shape
    L, _, R, _ = lora_a.shape
    x, lora_a, lora_b = addressable(x), addressable(lora_a), addressable(lora_b)
    cols, blocks = slice_layout(slice_widths, cfg.block_n)
    grid = (blocks[-1], max_token_tiles(M, L, cfg.block_m))
    return Launch(
        FUSED, grid, (x, lora_a, lora_b, y, scale, rank, sorted_token_ids, slot_starts, slot_counts),
        (M, K, L, R, sorted_token_ids.shape[0], *x.stride(), *lora_a.stride(), *lora_b.stride(), *y.stride(),
         *plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts)),
        dict(SLICE_COLS=cols, SLICE_BLOCKS=blocks,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k,
             SLOTS_POW2=next_power_of_2(L), RANK_ALIGN=rank_align(R), DOT_PRECISION=_DOT_PRECISION[x.dtype],
             H_PRECISION=f32_operand_precision(y.dtype),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    ).run_if(run)


# The h the shrink op and lora_grad_h return: every entry written by the kernel, zeros where a token has no delta
# (launch_shrink's write_all), not zero-filled first (a launch of its own, ~2.4 µs on the H100 beside the split
# counters' fill; DESIGN §4). False: as before (benchmarks/lab_train_ops.py AB_SHRINK_FILL=1 times both).
SHRINK_WRITES_ALL = True


def shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, checked=True):
    if checked:    # (False: ops.call_trusted, the backward formula's call)
        checks.check_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts)
    M, K = x.shape
    L, S, R, _ = lora_a.shape
    if M == 0:
        return x.new_zeros((M, S, R), dtype=torch.float32)
    return plan.run(plan.op_key("shrink", (x, lora_a), sorted_token_ids.shape[0],
                                plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts)),
                    (x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts),
                    lambda: shrink_launches(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts))[0]


def shrink_launches(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
    """The shrink op's launch, not run, and its scratch (specs, buffers): first the h it returns
    (:func:`returned_h_spec`), then the buffers a split-K shrink sums its splits in."""
    M, K = x.shape
    L, S, R, _ = lora_a.shape
    cfg = configs.shrink_config(M, K, S, R, L, x.device, x.dtype)
    launch, scratch, buffers = shrink_with_scratch(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts,
                                                   returned_h_spec(M, S, R), cfg, write_all=SHRINK_WRITES_ALL)
    return [launch], scratch, buffers


def expand_(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.check_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts)
    M, N = y.shape
    if M == 0:
        return
    h, lora_b = checks.apart_from(y, h, lora_b)

    def build():
        cfg = configs.expand_config(M, N, len(slice_widths), lora_b.shape[2], lora_b.shape[0], y.device, y.dtype)
        return [launch_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts, cfg,
                              run=False)], (), ()
    plan.run(plan.op_key("expand_", (y, h, lora_b), tuple(slice_widths), sorted_token_ids.shape[0],
                         plan.strides_1d(rank, sorted_token_ids, slot_starts, slot_counts)),
             (y, h, lora_b, rank, sorted_token_ids, slot_starts, slot_counts), build)


def add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    checks.check_add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                           slot_counts)
    x, lora_a, lora_b, scale = checks.apart_from(y, x, lora_a, lora_b, scale)
    _add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)


def _add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """add_lora_ after its checks, through the plan of its shape key (lora_ops.plan)."""
    if x.shape[0] == 0:
        return
    plan.run(plan.key(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts),
             (y, x, lora_a, lora_b, scale, rank, sorted_token_ids, slot_starts, slot_counts),
             lambda: add_lora_launches(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                                       slot_starts, slot_counts), scratch_out=False)


def _write_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """y = the LoRA delta (every row the metadata names written, zeros where a token has none): the shrink,
    then the expand in its store mode, through a plan of their own (lora_linear's write-first path)."""
    plan.run(write_plan_key(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                            slot_counts),
             (y, x, lora_a, lora_b, scale, rank, sorted_token_ids, slot_starts, slot_counts),
             lambda: add_lora_launches(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                                       slot_starts, slot_counts, accumulate=False), scratch_out=False)


def write_plan_key(*args):
    """The plan key of _write_lora on add_lora_'s arguments ``args`` (lora_ops.eager looks it up)."""
    return ("write", *plan.key(*args))


def add_lora_launches(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                      accumulate=True):
    """add_lora_'s launches for these arguments, not run: one (the fused kernel, small batches) or two
    (shrink, expand); with the scratch they use, as specs (:class:`Scratch`) and as the buffers allocated
    from them. ``accumulate=False`` (two launches only): the expand writes y = the delta (launch_expand)."""
    M, K = x.shape
    L, S, R, _ = lora_a.shape
    N = y.shape[1]
    fcfg = configs.fused_config(M, K, N, S, R, L, x.device, x.dtype) if accumulate else None
    if fcfg is not None:
        return [launch_fused(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                             slot_counts, fcfg, run=False)], (), ()
    scfg = configs.shrink_config(M, K, S, R, L, x.device, x.dtype, out_features=N)
    ecfg = (configs.expand_config(M, N, S, R, L, y.device, y.dtype) if accumulate
            else configs.store_config(M, N, S, R, L, K, y.device, y.dtype))
    h_spec = shrink_buffer_spec(M, S, R, scfg, ecfg, x.dtype)
    pdl = uses_pdl(x)
    shrink_launch, scratch, buffers = shrink_with_scratch(x, lora_a, scale, rank, sorted_token_ids, slot_starts,
                                                          slot_counts, h_spec, scfg, holds_partials(h_spec), pdl)
    expand_launch = launch_expand(y, buffers[0], lora_b, slice_widths, rank, sorted_token_ids, slot_starts,
                                  slot_counts, ecfg, run=False, pdl=pdl, accumulate=accumulate)
    return [shrink_launch, expand_launch], scratch, buffers


def shrink_with_scratch(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, h_spec, cfg,
                        partials_out=False, pdl=False, slice_k=None, write_all=False):
    """The shrink's launch (not run) into an h allocated from ``h_spec``, with the scratch it takes as specs
    and as buffers: h first, then what a split-K shrink that sums its own splits needs (``slice_k``,
    ``write_all``: as :func:`launch_shrink` takes them)."""
    M = x.shape[0]
    L, S, R, _ = lora_a.shape
    partials_out = partials_out and cfg.split_k > 1
    sums = () if partials_out else shrink_sum_scratch(M, S, R, shrink_grid(M, S, R, L, cfg), cfg)
    scratch = (h_spec, *sums)
    buffers = tuple(spec.alloc(x.device) for spec in scratch)
    launch = launch_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, buffers[0], cfg,
                           partials_out=partials_out, sum_scratch=buffers[1:] or None, run=False, pdl=pdl,
                           slice_k=slice_k, write_all=write_all)
    return launch, scratch, buffers


def returned_h_spec(M, S, R):
    """The h [M, S, R] float32 the shrink op and lora_grad_h return: unzeroed where the kernel writes every entry
    (:data:`SHRINK_WRITES_ALL`), else zeroed first (entries of tokens without a delta, and of ranks past a slot's,
    are 0: the ops' contract)."""
    return Scratch((M, S, R), torch.float32, zero=not SHRINK_WRITES_ALL)


def launch_shrink_expand(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts,
                         h, scfg, ecfg, pdl=False, accumulate=True):
    """add_lora_'s two launches: the shrink into ``h`` (from :func:`shrink_buffer`: split-K partial sums
    where it has several parts), then the expand reading it; ``pdl`` as add_lora_ takes it
    (:func:`uses_pdl`); ``accumulate=False``: the expand's store mode (y = the delta). The tuner times this
    (add_lora_ and lora_linear's write-first path run the same launches through :func:`add_lora_launches`)."""
    launch_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, h, scfg,
                  partials_out=holds_partials(h), pdl=pdl)
    launch_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts, ecfg, pdl=pdl,
                  accumulate=accumulate)


def h_planes(ecfg, max_rank, dtype):
    """How many 16-bit planes add_lora_'s h is stored in for the expand's rank loop (0: float32 h).

    The rank loop multiplies bf16 terms of h (hi, and lo = h - hi: kernels.work.split_f32). Split in its
    registers every rank step, they have to be the MMA's right operand on Hopper (kernels.work.dot_t),
    which costs the loop its asynchronous MMAs; stored as planes by the shrink, which has h's full sum in
    its epilogue, they load like B and multiply as loaded. bf16 weights only: 2 planes, or 1 with
    set_fast_bf16 (fp16 keeps float32 h, which the rank loop multiplies in tf32)."""
    if takes_partials(ecfg, max_rank):
        return 0
    return {"bf16x2": 2, "bf16": 1}.get(f32_operand_precision(dtype), 0)


def shrink_buffer_spec(M, S, R, scfg, ecfg, dtype=torch.float32):
    """h for the shrink to fill and the expand to read: every entry the expand reads (valid tokens,
    r < rank) gets written; [split_k, M, S, R] partial sums where the expand adds them, [planes, M, S, R]
    bf16 terms where the rank loop multiplies them (:func:`h_planes`, ``dtype``: the weights'), else
    [1, M, S, R] float32."""
    planes = h_planes(ecfg, R, dtype)
    if planes:
        return Scratch((planes, M, S, R), dtype)
    parts = scfg.split_k if takes_partials(ecfg, R) else 1
    return Scratch((parts, M, S, R), torch.float32)


def planes_in(h):
    """How many 16-bit planes of h's terms ``h`` holds (:func:`h_planes`; a tensor, or its
    :func:`shrink_buffer_spec`): 0 for float32 h."""
    return h.shape[0] if h.dtype != torch.float32 else 0


def holds_partials(h):
    """Whether add_lora_'s h (a tensor, or its :func:`shrink_buffer_spec`) takes the shrink's split-K
    partial sums."""
    return not planes_in(h) and h.shape[0] > 1


def shrink_buffer(x, lora_a, scfg, ecfg):
    """:func:`shrink_buffer_spec`'s h for these arguments, allocated."""
    _, S, R, _ = lora_a.shape
    return shrink_buffer_spec(x.shape[0], S, R, scfg, ecfg, x.dtype).alloc(x.device)


# ---- lora_linear: the base GEMM and the LoRA delta, the shrink beside the GEMM ---------------------------

# From this many tokens and this size of y, lora_linear (no bias) writes the delta first and lets cuBLAS add
# the base product onto it (y.addmm_, beta = 1): the delta's y traffic is one write instead of a read and a
# write after the GEMM, and the GEMM's epilogue read of y costs ~1% of it. H200, paired timing (DESIGN §4,
# sessions 15-16): 0.90 of the accumulating layer's delta where y is 48 MiB or more (Llama qkv from 4096
# tokens, gate_up from 1024); where y fits in L2 the accumulating expand reads it from there right after the
# GEMM, and write-first lost (o and down at 4096 tokens, 32 MiB: up to 1.31x at rank 64) or tied (8-12 MiB).
WRITE_FIRST_MIN_TOKENS = 1024
WRITE_FIRST_MIN_Y_BYTES = 40 << 20


def writes_first_at(num_tokens, out_features, element_size):
    """Whether an output of this size is large enough for lora_linear to write the delta first."""
    return (num_tokens >= WRITE_FIRST_MIN_TOKENS
            and num_tokens * out_features * element_size >= WRITE_FIRST_MIN_Y_BYTES)


def writes_first(x, out_features, bias):
    """Whether lora_linear on ``x`` writes the delta first (the store-mode expand, then y.addmm_)."""
    return writes_first_at(x.shape[0], out_features, x.element_size()) and bias is None and not _overlaps(x)

OVERLAP_MODES = ("never", "auto", "always")
# Off by default: on the H200 (bench_lora --variants overlap,in_order, 2026-12-02) cuBLAS's GEMM leaves no
# room for the shrink's programs at decode sizes, so the side stream saved nothing there (qkv r16 M=64:
# 11.9 µs beside vs 12.0 µs in order) and cost a few µs at some mid sizes; see DESIGN §4.
_overlap = {"mode": "never"}
_side_streams = {}    # device index -> the stream the shrink runs on beside the base GEMM


def set_overlap(mode):
    """When lora_linear runs the shrink on a side stream beside the base GEMM: "never" (default),
    "auto" (while a CUDA graph is being captured, where fork and join cost nothing at replay), or
    "always"."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"mode: expected one of {OVERLAP_MODES}, got {mode!r}")
    _overlap["mode"] = mode


def _overlaps(x):
    """Streams are CUDA's: CPU tensors (the interpreter) run the two launches in order."""
    mode = _overlap["mode"]
    return x.is_cuda and (mode == "always" or (mode == "auto" and triton_launch.capturing()))


def _side_stream(device):
    stream = _side_streams.get(device.index)
    if stream is None:
        # High priority: the shrink's few programs start as soon as the GEMM leaves room for them.
        stream = _side_streams[device.index] = torch.cuda.Stream(device, priority=-1)
    return stream


# The stacked path's expand launches with PDL right behind the GEMM up to this many tokens (H200, cuBLAS of
# CUDA 13). Session 13 (timed in sequence): 1-64 tokens 0.177 -> 0.156 and 0.245 -> 0.229 of the base layer,
# up to 2x slower from 1024 tokens. Session 16 (paired with the base layer, Llama r16/r64): the expand's delta
# 0.92 / 0.98 / 1.00 of the time without PDL at 256 / 1024 / 4096 tokens, no row above 1.02.
STACKED_PDL_MAX_TOKENS = 1024


def stacked_uses_pdl(x):
    """Whether lora_linear_stacked on ``x`` launches its expand with PDL (the tuner times it alike)."""
    return uses_pdl(x) and x.shape[0] <= STACKED_PDL_MAX_TOKENS


def lora_linear_stacked(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                        slot_starts, slot_counts):
    """F.linear(x, [W; A; pad], [bias; 0]) gives the layer's output and every slot's h in one cuBLAS launch
    (schemas.py; precision.stacked_gemm, over the prefix of the padding this token count takes); the expand
    then adds each token's slot's scaled h @ B^T into the output's first N columns. Returns
    [M, N + L·S·R + P]; the layer's output is its first N columns."""
    checks.check_lora_linear_stacked(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths,
                                     sorted_token_ids, slot_starts, slot_counts)
    L, N, R = lora_b.shape
    out = stacked_gemm(x, stacked_weight, stacked_bias, N, L * len(slice_widths) * R)
    M = x.shape[0]
    if M == 0:
        return out

    def build():
        cfg = configs.stacked_config(M, N, len(slice_widths), R, L, x.shape[1], x.device, x.dtype)
        return [launch_expand_stacked(out, N, lora_b, slice_widths, rank, scale, sorted_token_ids, slot_starts,
                                      slot_counts, cfg, run=False, pdl=stacked_uses_pdl(x))], (), ()
    plan.run(stacked_plan_key(out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts),
             (out, lora_b, rank, scale, sorted_token_ids, slot_starts, slot_counts), build)
    return out


def stacked_plan_key(out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    """The plan key of lora_linear_stacked's expand on its output ``out`` (lora_ops.eager looks it up)."""
    return plan.op_key("lora_linear_stacked", (out, lora_b), tuple(slice_widths), sorted_token_ids.shape[0],
                       plan.strides_1d(scale, rank, sorted_token_ids, slot_starts, slot_counts))


def lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                slot_counts):
    """F.linear(x, weight, bias) + the LoRA delta. For large outputs (writes_first: no bias, no overlap) the
    delta is written first and the GEMM accumulates onto it. The shrink only needs x, so (see
    set_overlap) it can run on a side stream while the GEMM runs: the delta then costs the expand alone on
    the critical path."""
    checks.check_lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                             slot_starts, slot_counts)
    M, K = x.shape
    L, S, R, _ = lora_a.shape
    N = weight.shape[0]
    if writes_first(x, N, bias):
        y = x.new_empty(M, N)
        _write_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
        return base_addmm_(y, x, weight)
    # The cheap test first: by default (no overlap) _add_lora resolves the path itself, once.
    if not _overlaps(x) or M == 0 or configs.fused_config(M, K, N, S, R, L, x.device, x.dtype) is not None:
        y = base_linear(x, weight, bias)
        _add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
        return y
    scfg = configs.shrink_config(M, K, S, R, L, x.device, x.dtype, out_features=N)
    ecfg = configs.expand_config(M, N, S, R, L, x.device, weight.dtype)
    h = shrink_buffer(x, lora_a, scfg, ecfg)
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    # h is allocated on the main stream, which reads it; the side stream joins back before anything reads
    # h or frees x. (The shrink's own split-K scratch, when it sums the splits, lives and dies on the side.)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        launch_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts, h, scfg,
                      partials_out=holds_partials(h))
    y = base_linear(x, weight, bias)
    main.wait_stream(side)
    launch_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts, ecfg)
    return y
