"""Config selection: token buckets, the heuristic, the tuned-table lookup and its fallbacks (the GPU path
of the lookup is exercised with a fake GPU name and table); the tuner's runner and the runtime autotune
run their kernels on the test device (the interpreter, or the GPU with LORA_OPS_TEST_DEVICE=cuda)."""
import itertools
import json
import math
import re
from unittest import mock

import pytest
import torch

from conftest import DEVICE
from lora_ops import configs, launch, launch_grad
from lora_ops.configs import heuristics, tuning


@pytest.mark.parametrize("m, bucket", [(0, 1), (1, 1), (2, 16), (16, 16), (17, 64), (1000, 1024), (5000, 8192),
                                       (100000, 8192)])
def test_token_bucket_edges(m, bucket):
    assert heuristics.token_bucket(m) == bucket


def test_configs_depend_on_bucket_not_raw_token_count():
    """Each count resolves afresh (configs.reset: the remembered config of its bucket would hide one resolved
    with the raw count) to its bucket's heuristic."""
    for lo, hi in [(2, 16), (17, 64), (257, 1024), (4097, 8192)]:
        for m in (lo, hi):
            configs.reset()
            assert configs.shrink_config(m, 4096, 3, 16, 4) == heuristics.shrink_config(hi, 4096, 3, 16, 4), m
            configs.reset()
            assert configs.expand_config(m, 6144, 3, 16, 4) == heuristics.expand_config(hi, 6144, 16, 4), m


@pytest.mark.parametrize("rank", [1, 16, 64, 128, 256, 320])
@pytest.mark.parametrize("bucket", heuristics.TOKEN_BUCKETS)
def test_heuristic_configs_are_valid(rank, bucket):
    s = heuristics.shrink_config(bucket, 4096, 3, rank, 4)
    e = heuristics.expand_config(bucket, 6144, rank, 4)
    for block in (s.block_m, s.block_r, s.block_k, e.block_m, e.block_n, e.block_r):
        assert block >= 16 and block & (block - 1) == 0      # tl.dot: powers of two, at least 16
    assert 1 <= s.split_k <= 32 and s.split_k <= heuristics.cdiv(4096, s.block_k)
    assert s.block_r == heuristics.rank_block(rank)
    if heuristics.expand_rank_loops(bucket, rank, 6144):  # the expand's rank loop, in steps of its own
        assert e.block_r < rank and heuristics.rank_loops(rank)
    elif not heuristics.rank_loops(rank):  # the whole rank in one block, as the shrink's
        assert e.block_r == s.block_r
    else:  # past 64 at decode sizes: one block holding the rank, its h tile within bounds
        assert bucket <= max(b for b, _, _ in heuristics.ONE_BLOCK_LIMITS)
        assert e.block_r >= rank and e.block_m * e.block_r <= heuristics.ONE_BLOCK_MAX_H_TILE
    assert launch.takes_partials(e, rank) == (not heuristics.expand_rank_loops(bucket, rank, 6144))


def test_split_k_only_at_small_token_counts():
    assert heuristics.shrink_config(1, 4096, 1, 16, 4).split_k > 1
    assert heuristics.shrink_config(8192, 4096, 3, 16, 4).split_k == 1


def test_split_k_capped_where_an_expand_adds_the_partial_sums():
    # o r16 at 256 tokens: the shrink alone would take 32 splits; every column block of the expand
    # re-reads each of them, so add_lora_'s pair takes at most MAX_EXPAND_PARTS.
    alone = heuristics.shrink_config(256, 4096, 1, 16, 4)
    paired = heuristics.shrink_config(256, 4096, 1, 16, 4, out_features=4096)
    assert alone.split_k > heuristics.MAX_EXPAND_PARTS == paired.split_k
    # The rank loop takes h summed by the shrink itself: no cap. (At 64 tokens up to rank 256 the
    # heuristic's expand holds the rank in one block and adds the partial sums: capped.)
    assert heuristics.expand_rank_loops(64, 320, 4096) and not heuristics.expand_rank_loops(64, 256, 4096)
    assert heuristics.shrink_config(64, 4096, 1, 320, 4, out_features=4096).split_k == \
        heuristics.shrink_config(64, 4096, 1, 320, 4).split_k > heuristics.MAX_EXPAND_PARTS
    assert heuristics.shrink_config(64, 4096, 1, 256, 4, out_features=4096).split_k == heuristics.MAX_EXPAND_PARTS


@pytest.mark.parametrize("bucket, in_features, slices, rank, split_k", [
    (1024, 4096, 1, 16, 2), (1024, 4096, 3, 64, 2), (1024, 14336, 1, 64, 7), (1024, 3072, 1, 16, 1),
    (4096, 14336, 1, 16, 3), (8192, 8192, 1, 16, 1)], ids=lambda v: str(v))
def test_shrink_op_splits_keep_enough_k_steps(bucket, in_features, slices, rank, split_k):
    """From 1024 tokens the shrink op alone (its splits summed by counters) gives each split at least
    SELF_SUM_MIN_K_STEPS steps of K, on 8 warps; add_lora_'s shrink (out_features) keeps the program target."""
    alone = heuristics.shrink_config(bucket, in_features, slices, rank, 4)
    assert alone.split_k == split_k and alone.num_warps == 8
    assert heuristics.cdiv(in_features, alone.block_k) >= alone.split_k * heuristics.SELF_SUM_MIN_K_STEPS or \
        alone.split_k == 1
    paired = heuristics.shrink_config(bucket, in_features, slices, rank, 4, out_features=4096)
    assert paired.split_k >= alone.split_k
    # Below 1024 tokens the program target alone decides, as before.
    assert heuristics.shrink_config(256, in_features, slices, rank, 4).split_k > 1


@pytest.mark.parametrize("tokens, in_features, n_loop", [
    (256, 14336, 1), (1024, 14336, 1), (4096, 3072, 1), (4096, 4096, 2), (4096, 14336, 4), (8192, 14336, 8)],
    ids=lambda v: str(v))
def test_grad_x_walks_column_blocks_from_1024_tokens(tokens, in_features, n_loop):
    """lora_grad_x's programs walk the widest power of two of column blocks (at most 8) that leaves
    GRAD_X_MIN_PROGRAMS programs, from 1024 tokens; float32 on a GPU keeps its own tiles, one block each."""
    cfg = launch_grad.grad_x_config(tokens, in_features, 64, 1)
    assert cfg.n_loop == n_loop
    tiles = heuristics.cdiv(heuristics.token_bucket(tokens), cfg.block_m)
    if n_loop > 1:
        assert heuristics.cdiv(heuristics.cdiv(in_features, cfg.block_n), n_loop) * tiles >= \
            launch_grad.GRAD_X_MIN_PROGRAMS
    assert launch_grad.grad_x_config(tokens, in_features, 64, 1, float32_gpu=True).n_loop == 1


@pytest.mark.parametrize("tokens, rank, slices, holds", [
    (1024, 16, 3, True), (4096, 64, 2, True), (4096, 64, 1, True), (300, 64, 1, True), (256, 16, 1, False),
    (4096, 64, 3, False), (4096, 128, 1, False), (4096, 20, 2, True), (4096, 16, 5, True), (4096, 32, 5, False)],
    ids=lambda v: str(v))
def test_grad_x_holds_dh_where_measured(tokens, rank, slices, holds):
    """lora_grad_x's ONE_RANK_BLOCK path: from the 1024-token bucket (257 tokens on), the whole rank in one
    block and the slices' blocks side by side within GRAD_X_MAX_HELD_COLUMNS (three slices at rank 64 gained
    nothing); never float32's or float16's on a GPU. The tile is the one the rank-block path would take."""
    cfg = launch_grad.grad_x_config(tokens, 4096, rank, slices)
    assert cfg.one_rank_block == holds
    assert cfg._replace(one_rank_block=False) == launch_grad.grad_x_config(tokens, 4096, rank, slices, float16_gpu=True)
    assert not launch_grad.grad_x_config(tokens, 4096, rank, slices, float32_gpu=True).one_rank_block
    with mock.patch.object(launch_grad, "GRAD_X_HOLDS_DH", False):
        assert not launch_grad.grad_x_config(tokens, 4096, rank, slices).one_rank_block


def test_segment_outer_deep_steps_only_where_measured():
    """dA / dB's 128-token steps: from the 1024-token bucket, on a small grid, never for float16 or float32 on
    a GPU (float16's would be a pipelined wgmma reading a register operand: sm90 codegen)."""
    deep = launch_grad.DEEP_STEP["block_t"]
    assert launch_grad.segment_outer_config(64, 4096, 4, num_tokens=1024).block_t == deep
    assert launch_grad.segment_outer_config(64, 4096, 4, num_tokens=256).block_t != deep
    assert launch_grad.segment_outer_config(64, 4096, 4, num_tokens=4096, float16_gpu=True).block_t != deep
    assert launch_grad.segment_outer_config(64, 4096, 4, True, num_tokens=4096).block_t != deep
    assert launch_grad.segment_outer_config(64, 28672, 4, num_tokens=4096).block_t != deep   # 896 programs


@pytest.mark.parametrize("bucket, rank, out_features, loops", [
    (1, 320, 6144, False), (1, 320, 28672, True), (16, 320, 4096, False), (16, 320, 6144, True),
    (64, 256, 28672, False), (64, 320, 4096, True), (256, 128, 6144, False), (256, 128, 28672, True),
    (256, 256, 4096, False), (256, 256, 6144, True), (1024, 128, 4096, True), (8192, 64, 28672, False)])
def test_heuristic_expand_holds_the_rank_in_one_block_where_the_table_did(bucket, rank, out_features, loops):
    """heuristics.ONE_BLOCK_LIMITS: one block at high rank for small buckets, at rank 320 and at 256 tokens
    only for narrow outputs (each column block re-reads the shrink's partial sums)."""
    assert heuristics.expand_rank_loops(bucket, rank, out_features) == loops
    e = heuristics.expand_config(bucket, out_features, rank, 4)
    assert launch.takes_partials(e, rank) == (not loops)


@pytest.mark.parametrize("m, slots, block_m, bound", [(1, 4, 16, 1), (16, 4, 16, 5), (64, 8, 16, 12),
                                                      (4096, 4, 64, 68), (3, 64, 16, 3)])
def test_token_tile_bound_adds_slots_not_multiplies(m, slots, block_m, bound):
    assert heuristics.max_token_tiles(m, slots, block_m) == bound


@pytest.fixture
def fake_gpu_table(pretend_gpu_table):
    """A tuned table for a pretend GPU, found through the normal lookup."""
    return pretend_gpu_table([
        dict(kind="shrink", features=4096, slices=3, rank=16, tokens=64,
             config=heuristics.ShrinkConfig(32, 16, 256, 4, 8, 3)._asdict()),
        dict(kind="expand", features=6144, slices=3, rank=16, tokens=64,
             config=heuristics.ExpandConfig(32, 256, 16, 8, 2)._asdict()),
        dict(kind="expand", features=14336 * 2, slices=2, rank=64, tokens=8192,
             config=heuristics.ExpandConfig(128, 64, 64, 4, 3)._asdict()),
        dict(kind="fused", features=4096, out_features=6144, slices=3, rank=16, tokens=1,
             config=heuristics.FusedConfig(16, 256, 16, 256, 8, 3)._asdict()),
        dict(kind="fused", features=4096, out_features=6144, slices=3, rank=16, tokens=64, config=None),
        dict(kind="stacked", features=4096, in_features=14336, slices=1, rank=64, tokens=64,
             config=heuristics.ExpandConfig(16, 32, 64, 4, 2)._asdict()),
        dict(kind="store", features=14336 * 2, in_features=4096, slices=2, rank=64, tokens=4096,
             config=heuristics.ExpandConfig(16, 128, 64, 4, 2, 1, 4)._asdict()),
    ])


CUDA = torch.device("cuda", 0)


def test_shipped_tables_pass_the_table_check():
    tables = sorted(configs.TUNED_DIR.glob("*.json"))
    assert tables, "no tuned table in the package"
    for path in tables:
        configs.check_table(json.loads(path.read_text()), path)


_GOOD_EXPAND = dict(kind="expand", features=6144, slices=3, rank=16, tokens=64,
                    config=heuristics.ExpandConfig(32, 256, 16, 8, 2)._asdict())


def _with(entry=_GOOD_EXPAND, config=(), **fields):
    """``entry`` with ``fields`` replaced and its config's fields updated by ``config`` (a None drops one)."""
    config = {k: v for k, v in {**entry["config"], **dict(config)}.items() if v is not None}
    return {**entry, **fields, "config": config}


BAD_ENTRIES = [
    (_with(config=dict(block_r=8)), "block_r must be a power of two >= 16"),
    (_with(config=dict(block_n=48)), "block_n must be a power of two >= 16"),
    (_with(config=dict(num_warps=3)), "num_warps must be one of"),
    (_with(config=dict(num_stages=0)), "num_stages must be >= 1"),
    (_with(config=dict(block_m=32.0)), "block_m must be an int"),
    (_with(config=dict(block_k=64)), r"unknown fields \['block_k'\]"),
    (_with(config=dict(block_n=None)), r"missing fields \['block_n'\]"),
    (_with(config=dict(planes_in_turn=1)), "planes_in_turn must be true or false"),
    (_with(dict(kind="shrink", features=4096, slices=3, rank=16, tokens=64,
                config=heuristics.ShrinkConfig(32, 16, 256, 4, 8, 3)._asdict()), config=dict(slice_group=3)),
     "slice_group must be a power of two"),
    (_with(config=dict(n_loop=0)), "n_loop must be >= 1"),
    (_with(rank=0), "rank must be an int >= 1"),
    (_with(tokens="64"), "tokens must be an int >= 1"),
    (_with(kind="expnad"), "unknown kind 'expnad'"),
    ({**_GOOD_EXPAND, "config": None}, "an entry of kind 'expand' needs a config"),
    ({**_GOOD_EXPAND, "config": [32, 256]}, "config must be an object or null"),
    (dict(kind="stack_limit", features=4096, in_features=4096, slices=1, rank=16, rows=64, tokens=1,
          buckets=[1, 16]), "max_tokens must be an int"),
    (dict(kind="stack_pad", features=4096, in_features=4096, slices=1, rank=16, rows=64, tokens=1, pad=-64),
     "pad must be an int >= 0"),
    (dict(kind="stack_pad", features=4096, in_features=4096, rows=0, pad=64), "rows must be an int >= 1"),
    (dict(kind="stack_pad", features=4096, in_features=4096, rows=64, pad=64, buckets=[1, 16], bucket_pads=[64]),
     "bucket_pads must be a list of ints in"),
    (dict(kind="stack_pad", features=4096, in_features=4096, rows=64, pad=64, buckets=[1, 16],
          bucket_pads=[0, 96]), "bucket_pads must be a list of ints in"),
]


@pytest.mark.parametrize("entry, message", BAD_ENTRIES,
                         ids=[re.sub(r"\W+", "_", m.replace("\\", "")).strip("_") for _, m in BAD_ENTRIES])
def test_table_check_names_the_file_the_entry_and_the_problem(entry, message):
    """A table entry whose config a GPU could not compile (the interpreter takes any tile), or that the
    lookup could not read, is refused when the table loads, with the file, the entry and why."""
    table = dict(entries=[_GOOD_EXPAND, entry])
    with pytest.raises(ValueError, match=f"some/table.json: entry 1 .*{message}"):
        configs.check_table(table, "some/table.json")
    configs.check_table(dict(entries=[_GOOD_EXPAND]), "some/table.json")     # the good entry passes
    with pytest.raises(ValueError, match="a list of 'entries'"):
        configs.check_table(dict(entry=[]), "some/table.json")


def test_a_bad_table_is_refused_when_it_loads(pretend_gpu_table):
    pretend_gpu_table([_with(config=dict(block_r=8))])
    with pytest.raises(ValueError, match=r"Pretend_GPU_9000.json: entry 0 \(kind expand, features 6144.*block_r"):
        configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16)


def test_table_entry_is_used_on_its_gpu(fake_gpu_table):
    cfg = configs.shrink_config(40, 4096, 3, 16, 4, CUDA, torch.bfloat16, out_features=6144)
    assert cfg == heuristics.ShrinkConfig(32, 16, 256, 4, 8, 3)
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.float16) == heuristics.ExpandConfig(32, 256, 16, 8, 2)


def test_stacked_entry_is_used_and_else_the_expand_serves(fake_gpu_table):
    """The stacked path's expand takes the table's "stacked" entry; a shape without one near takes
    add_lora_'s expand config (the table's expand entry, else the heuristic), as before stacked entries."""
    assert configs.stacked_config(40, 4096, 1, 64, 4, 14336, CUDA, torch.bfloat16) == \
        heuristics.ExpandConfig(16, 32, 64, 4, 2)
    assert configs.stacked_config(64, 6144, 3, 16, 4, 4096, CUDA, torch.bfloat16) == \
        configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == heuristics.ExpandConfig(32, 256, 16, 8, 2)
    assert configs.stacked_config(1, 4096, 1, 64, 4, 14336) == heuristics.expand_config(1, 4096, 64, 4)   # CPU


def test_store_entry_is_used_and_else_the_expand_serves(fake_gpu_table):
    """The expand's store mode (lora_linear's write-first path) takes the table's "store" entry; a shape
    without one near takes add_lora_'s expand config."""
    assert configs.store_config(4096, 2 * 14336, 2, 64, 4, 4096, CUDA, torch.bfloat16) == \
        heuristics.ExpandConfig(16, 128, 64, 4, 2, 1, 4)
    assert configs.store_config(64, 6144, 3, 16, 4, 4096, CUDA, torch.bfloat16) == \
        configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == heuristics.ExpandConfig(32, 256, 16, 8, 2)
    assert configs.store_config(4096, 2 * 14336, 2, 64, 4, 4096) == heuristics.expand_config(4096, 28672, 64, 4)
    # Only the entry's own key takes it (configs.EXACT_KINDS): not another rank, width, slice count or bucket.
    others = ((4096, 2 * 14336, 2, 32), (4096, 2 * 8192, 2, 64), (4096, 2 * 14336, 1, 64), (8192, 2 * 14336, 2, 64))
    for other in others:
        assert configs.store_config(*other, 4, 4096, CUDA, torch.bfloat16) == \
            configs.expand_config(*other, 4, CUDA, torch.bfloat16)


def test_write_first_takes_the_store_config(fake_gpu_table, monkeypatch):
    """lora_linear's write-first launches (add_lora_launches, accumulate=False) resolve the store mode's
    config; add_lora_'s the expand's."""
    asked = []
    real = configs._config
    monkeypatch.setattr(configs, "_config", lambda kind, *a: asked.append(kind) or real(kind, *a))
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], 16, 3, 9)
    args = (p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"])
    launch.add_lora_launches(*args, accumulate=False)
    assert "store" in asked and "expand" not in asked
    asked.clear()
    launch.add_lora_launches(*args)
    assert "store" not in asked and "expand" in asked


def test_nearest_entry_adapts_rank_block(fake_gpu_table):
    cfg = configs.expand_config(5000, 2 * 14336, 2, 32, 4, CUDA, torch.bfloat16)
    assert (cfg.block_m, cfg.block_n) == (128, 64)
    assert cfg.block_r == heuristics.rank_block(32)


def test_nearest_shrink_entry_adapts_rank_block_and_split_k(pretend_gpu_table):
    """A shrink entry at a neighbouring rank serves with this rank's block; one at a wider input keeps at most
    one split per K block (cdiv(features, block_k))."""
    pretend_gpu_table([dict(kind="shrink", features=4096, slices=3, rank=16, tokens=64,
                            config=heuristics.ShrinkConfig(32, 16, 256, 32, 8, 3)._asdict())])
    cfg = configs.shrink_config(64, 4096, 3, 32, 4, CUDA, torch.bfloat16, out_features=6144)
    assert (cfg.block_m, cfg.block_k) == (32, 256) and cfg.block_r == heuristics.rank_block(32) != 16
    cfg = configs.shrink_config(64, 2048, 3, 16, 4, CUDA, torch.bfloat16, out_features=6144)
    assert (cfg.block_m, cfg.block_k, cfg.split_k) == (32, 256, heuristics.cdiv(2048, 256))


def test_expand_entry_of_the_other_rank_path_is_not_used(fake_gpu_table):
    # The rank-64 entry was tuned on the one-rank-block path with 128-token tiles: rank 256 in one block
    # would hold a 128 x 256 h tile, past heuristics.ONE_BLOCK_MAX_H_TILE; the heuristic serves.
    cfg = configs.expand_config(5000, 2 * 14336, 2, 256, 4, CUDA, torch.bfloat16)
    assert cfg == heuristics.expand_config(4096, 2 * 14336, 256, 4)


@pytest.mark.parametrize("entry, rank, expected", [
    (heuristics.ExpandConfig(16, 64, 128, 8, 2), 320, heuristics.ExpandConfig(16, 64, 512, 8, 2)),
    (heuristics.ExpandConfig(16, 64, 128, 8, 2), 96, heuristics.ExpandConfig(16, 64, 128, 8, 2)),
    (heuristics.ExpandConfig(64, 64, 128, 8, 2), 320, None),              # a 64 x 512 h tile: too large
    (heuristics.ExpandConfig(64, 256, 32, 4, 3), 320, heuristics.ExpandConfig(64, 256, 32, 4, 3)),
    (heuristics.ExpandConfig(64, 256, 32, 4, 3), 32, None),               # the loop's step holds rank 32
], ids=["one_block-widens", "one_block-narrows", "one_block-too_large", "loop-keeps_step", "loop-no_loop"])
def test_expand_entry_keeps_its_code_path_at_another_rank(entry, rank, expected):
    """An expand entry tuned at rank 128 serves a neighbouring rank on the path it was tuned on (one rank
    block, or the rank loop with its step), or not at all (None: the heuristic serves)."""
    assert configs._expand_at_rank(entry, 128, rank) == expected


@pytest.mark.parametrize("order", [1, -1], ids=["table_order", "reversed"])
def test_tied_entries_go_to_the_fewer_tokens(order):
    """256 tokens sit at distance 2 from both a 64- and a 1024-token entry: the 64-token one serves,
    whichever comes first in the table."""
    entries = [dict(kind="expand", features=4096, slices=1, rank=128, tokens=tokens,
                    config=heuristics.ExpandConfig(16 if tokens == 64 else 64, 128, 32, 4, 3)._asdict())
               for tokens in (64, 1024)][::order]
    assert configs._nearest(entries, "expand", 4096, 1, 128, 256)["tokens"] == 64


def _expand_entry(**fields):
    """An expand entry at features 4096, one slice, rank 128, 256 tokens, with ``fields`` replaced."""
    return dict(dict(kind="expand", features=4096, slices=1, rank=128, tokens=256,
                     config=heuristics.ExpandConfig(16, 128, 32, 4, 3)._asdict()), **fields)


@pytest.mark.parametrize("order", [1, -1], ids=["table_order", "reversed"])
def test_tied_entries_go_to_the_nearer_token_count(order):
    """Before the fewer tokens, the nearer token count: at 256 tokens and rank 128 an entry two octaves off
    in rank (at 256 tokens) and one two octaves off in tokens (at 64) are both at distance 2; the first
    serves, whichever comes first in the table."""
    entries = [_expand_entry(rank=32), _expand_entry(tokens=64)][::order]
    assert configs._nearest(entries, "expand", 4096, 1, 128, 256)["rank"] == 32


def test_nearest_weighs_each_part_of_the_distance():
    """Each part of _nearest's distance decides between entries that differ only there (the wrong one
    first: a part left out would tie, and the table's order would pick it): the features' octaves; another
    slice count at 0.5 (nearer than one octave of features, further than 0.29); the output features of
    one-launch entries."""
    near = configs._nearest([_expand_entry(features=16384), _expand_entry(features=2048)], "expand", 4096, 1, 128,
                            256)
    assert near["features"] == 2048                                        # 1 octave, not 2
    near = configs._nearest([_expand_entry(slices=3), _expand_entry(features=5000)], "expand", 4096, 1, 128, 256)
    assert near["features"] == 5000                                        # log2(5000 / 4096) = 0.29 < 0.5
    near = configs._nearest([_expand_entry(features=8192), _expand_entry(slices=3)], "expand", 4096, 1, 128, 256)
    assert near["slices"] == 3                                             # 0.5 < 1 octave
    fused = dict(kind="fused", features=4096, slices=1, rank=16, tokens=1, config=None)
    near = configs._nearest([dict(fused, out_features=6144), dict(fused, out_features=28672)], "fused", 4096, 1,
                            16, 1, 28672)
    assert near["out_features"] == 28672


def test_shrink_op_alone_uses_the_heuristic(fake_gpu_table):
    # Shrink entries are tuned as add_lora_'s pair (the expand adds the split-K partial sums); the shrink
    # op alone (the backward's dh and h) adds its splits itself.
    assert configs.shrink_config(40, 4096, 3, 16, 4, CUDA, torch.bfloat16) == heuristics.shrink_config(
        64, 4096, 3, 16, 4)


def test_distant_entries_are_not_used(fake_gpu_table):
    # The table's only shrink entry is for 64 tokens: a prefill bucket (8192) is too far from it.
    assert configs.shrink_config(8000, 4096, 3, 16, 4, CUDA, torch.bfloat16, out_features=6144) == \
        heuristics.shrink_config(8192, 4096, 3, 16, 4, out_features=6144)
    # At the limit (configs.MAX_DISTANCE = 2): the 64-token expand entry serves 256 tokens (two octaves);
    # with another slice count (2.5) the heuristic does.
    tuned = heuristics.ExpandConfig(32, 256, 16, 8, 2)
    assert configs.expand_config(256, 6144, 3, 16, 4, CUDA, torch.bfloat16) == tuned
    assert configs.expand_config(256, 6144, 1, 16, 4, CUDA, torch.bfloat16) == \
        heuristics.expand_config(256, 6144, 16, 4) != tuned


def test_float32_and_cpu_use_the_heuristic(fake_gpu_table):
    # (float32 on a GPU in float32's tiles: test_float32_takes_its_own_tiles_on_a_gpu_only) Also add_lora_'s
    # shrink (out_features), which the table holds an entry for in 16-bit dtypes.
    for out_features in (None, 6144):
        assert configs.shrink_config(40, 4096, 3, 16, 4, CUDA, torch.float32, out_features=out_features) == \
            heuristics.float32_tiles(heuristics.shrink_config(64, 4096, 3, 16, 4, out_features=out_features))
        assert configs.shrink_config(40, 4096, 3, 16, 4, out_features=out_features) == \
            heuristics.shrink_config(64, 4096, 3, 16, 4, out_features=out_features)


_TUNED_EXPAND = heuristics.ExpandConfig(32, 256, 16, 8, 2)
_HOPPER = dict(capability=[9, 0], multiprocessors=132)


def _table_of(gpu, expand=_TUNED_EXPAND, **kind):
    return dict(gpu=gpu, **kind, entries=[dict(_GOOD_EXPAND, config=expand._asdict())])


def test_gpu_without_table_falls_back_to_heuristic(pretend_gpu_tables):
    pretend_gpu_tables({}, ("Unknown GPU", (8, 0), 108))
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA) == heuristics.expand_config(64, 6144, 16, 4)
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA) != _TUNED_EXPAND     # the test can tell them apart


@pytest.mark.parametrize("gpu, served", [
    (("Sibling GPU", (9, 0), 132), True),           # same capability and SM count: the tuned GPU's table
    (("Fewer SMs GPU", (9, 0), 114), False),        # e.g. a PCIe card of the same chip: the heuristic
    (("Older GPU", (8, 0), 132), False),
], ids=["same_kind", "fewer_sms", "other_capability"])
def test_a_gpu_without_its_own_table_takes_one_tuned_on_its_kind(pretend_gpu_tables, monkeypatch, gpu, served):
    pretend_gpu_tables({"Tuned_GPU": _table_of("Tuned GPU", **_HOPPER)}, gpu)
    want = _TUNED_EXPAND if served else heuristics.expand_config(64, 6144, 16, 4)
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert configs.table_source(CUDA) == ("Tuned GPU" if served else None)
    configs.use_tuned_tables(False)
    try:
        assert configs.table_source(CUDA) is None
    finally:
        configs.use_tuned_tables(True)


def test_its_own_table_wins_and_a_table_without_its_kind_serves_no_other_gpu(pretend_gpu_tables):
    own = heuristics.ExpandConfig(16, 128, 16, 4, 3)
    tables = {"A_GPU": _table_of("A GPU", **_HOPPER),           # first in name order
              "Sibling_GPU": _table_of("Sibling GPU", own),    # its own, with no kind recorded
              "Old_GPU": _table_of("Old GPU")}                 # before tables recorded their GPU's kind
    pretend_gpu_tables(tables, ("Sibling GPU", (9, 0), 132))
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == own
    pretend_gpu_tables(tables, ("Another GPU", (9, 0), 132))
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == _TUNED_EXPAND
    pretend_gpu_tables({"Old_GPU": _table_of("Old GPU")}, ("Another GPU", (9, 0), 132))
    assert configs.expand_config(64, 6144, 3, 16, 4, CUDA, torch.bfloat16) == heuristics.expand_config(64, 6144,
                                                                                                       16, 4)


def test_stack_entries_come_from_the_table_of_its_kind_too(pretend_gpu_tables):
    table = dict(gpu="Tuned GPU", **_HOPPER, entries=[dict(kind="stack_pad", features=8, in_features=8, rows=4,
                                                           pad=64)])
    pretend_gpu_tables({"Tuned_GPU": table}, ("Sibling GPU", (9, 0), 132))
    assert configs.stack_pad_rows(8, 8, 4, CUDA) == 64
    pretend_gpu_tables({"Tuned_GPU": table}, ("Fewer SMs GPU", (9, 0), 114))
    assert configs.stack_pad_rows(8, 8, 4, CUDA) == 0


@pytest.mark.parametrize("field, value, message", [
    ("capability", [9], r"'capability' must be \[major, minor\]"),
    ("capability", "9.0", r"'capability' must be \[major, minor\]"),
    ("multiprocessors", 0, "'multiprocessors' must be an int >= 1"),
    ("multiprocessors", 132.0, "'multiprocessors' must be an int >= 1"),
])
def test_table_check_refuses_a_gpu_kind_it_could_not_match(field, value, message):
    with pytest.raises(ValueError, match=f"some/table.json: {message}"):
        configs.check_table({"entries": [_GOOD_EXPAND], field: value}, "some/table.json")


def test_the_shipped_h200_table_records_its_gpu_kind():
    """An H100 SXM (sm_90, 132 SMs) takes it: measured there on 2026-12-05, add_lora_ at 0.84 of the
    heuristic's time (core grid), 0.86 at ranks 128-320."""
    table = json.loads(configs.table_path("NVIDIA H200").read_text())
    assert {k: table[k] for k in _HOPPER} == _HOPPER


def test_table_chooses_the_add_lora_path(fake_gpu_table):
    """A "fused" entry names the one-launch config, or null: two launches were faster there."""
    assert configs.fused_config(1, 4096, 6144, 3, 16, 4, CUDA) == heuristics.FusedConfig(16, 256, 16, 256, 8, 3)
    assert configs.fused_config(60, 4096, 6144, 3, 16, 4, CUDA) is None


def test_a_null_fused_entry_takes_two_launches_where_the_heuristic_takes_one(pretend_gpu_table):
    """The table's null "fused" entry wins over the heuristic's one-launch config (one token, rank 16)."""
    assert heuristics.fused_config(1, 4096, 16) is not None
    pretend_gpu_table([dict(kind="fused", features=4096, out_features=6144, slices=3, rank=16, tokens=1,
                            config=None)])
    assert configs.fused_config(1, 4096, 6144, 3, 16, 4, CUDA, torch.bfloat16) is None


def test_forced_path_and_tables_off(fake_gpu_table):
    try:
        configs.force_path("fused")  # the table's null entry does not stop a forced one-launch path
        assert configs.fused_config(60, 4096, 6144, 3, 16, 4, CUDA) == heuristics.fused_config(64, 4096, 16)
        configs.force_path("split")
        assert configs.fused_config(1, 4096, 6144, 3, 16, 4, CUDA) is None
        configs.force_path(None)
        configs.use_tuned_tables(False)
        assert configs.fused_config(60, 4096, 6144, 3, 16, 4, CUDA) is None  # the heuristic: two launches
        assert configs.fused_config(1, 4096, 6144, 3, 16, 4, CUDA) == heuristics.fused_config(1, 4096, 16)
        assert configs.shrink_config(40, 4096, 3, 16, 4, CUDA) == heuristics.shrink_config(64, 4096, 3, 16, 4)
    finally:
        configs.force_path(None)
        configs.use_tuned_tables(True)
    with pytest.raises(ValueError, match="path"):
        configs.force_path("both")


@pytest.mark.parametrize("bucket, rank, features, fused", [(1, 16, 4096, True), (1, 64, 4096, False),
                                                          (16, 16, 4096, False), (1, 16, 14336, False)],
                         ids=["decode-r16", "decode-r64", "M16", "decode-down"])
def test_heuristic_path_choice(bucket, rank, features, fused):
    assert (configs.fused_config(bucket, features, 4096, 1, rank, 4) is not None) == fused


def test_shipped_tables_parse_and_hold_valid_configs():
    make = {"shrink": heuristics.ShrinkConfig, "expand": heuristics.ExpandConfig, "fused": heuristics.FusedConfig,
            "stacked": heuristics.ExpandConfig, "store": heuristics.ExpandConfig}
    for path in configs.TUNED_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        assert table["entries"], path
        for e in table["entries"]:
            if e["kind"] == "stack_pad":   # no config: zero rows after stack_a's [W; A]
                assert isinstance(e["pad"], int) and e["pad"] >= 0 and e["rows"] > 0, e
            elif e["kind"] == "stack_limit":   # no config: stack_a's token limit, 0 or a bucket it measured
                assert e["max_tokens"] in [0, *e["buckets"]] and max(e["buckets"]) <= tuning.STACK_LIMIT_MAX_BUCKET
                assert tuning.best_stack_limit(e["buckets"], e["us"]) == e["max_tokens"], e
            elif e["config"] is not None or e["kind"] != "fused":
                make[e["kind"]](**e["config"])


@pytest.mark.parametrize("bucket", [1, 64, 8192])
def test_tuner_candidates_include_valid_configs(bucket):
    shr = list(tuning.shrink_candidates(bucket, 4096, 16, 3))
    exp = list(tuning.expand_candidates(bucket, 6144, 16))
    fused = list(tuning.fused_candidates(bucket, 4096, 16))
    assert shr and exp and len(set(shr)) == len(shr)
    assert bool(fused) == (bucket <= tuning.FUSED_TUNE_MAX_BUCKET) and len(set(fused)) == len(fused)
    assert all(c.split_k <= heuristics.cdiv(4096, c.block_k) for c in shr)
    # From 1024 tokens 2 and 4 splits are always tried (a token axis of ~M / block_m tiles fills SMs unevenly).
    assert ({2, 4} <= {c.split_k for c in shr}) == (bucket >= tuning.FEW_SPLITS_MIN_BUCKET)
    assert {c.block_r for c in shr} == {16}
    # From 1024 tokens (long K loops, many token tiles) the shrink also tries a 4-stage pipeline.
    assert {c.num_stages for c in shr} == ({3, 4} if bucket >= tuning.DEEP_PIPELINE_MIN_BUCKET else {3})
    # Above rank 64 the shrink also tries a 128-wide rank block (8 warps: its accumulator is large).
    wide_shr = list(tuning.shrink_candidates(bucket, 4096, 320, 3))
    assert {c.block_r for c in wide_shr} == {64, 128} and len(set(wide_shr)) == len(wide_shr)
    assert all(c.num_warps == 8 for c in wide_shr if c.block_r == 128)
    # Above rank 64 (the rank loop) the expand also tries a narrower rank block, and up to
    # ONE_BLOCK_TUNE_MAX_BUCKET tokens the whole rank in one block (small h tiles only); up to 64 the whole
    # rank is one block, and from 256 tokens a program may stream several column blocks.
    for rank, one_block in ((256, 256), (320, 512)):
        wide = list(tuning.expand_candidates(bucket, 6144, rank))
        one = bucket <= tuning.ONE_BLOCK_TUNE_MAX_BUCKET
        assert {c.block_r for c in wide} == ({32, 64, one_block} if one else {32, 64})
        assert len(set(wide)) == len(wide) and {c.n_loop for c in wide} == {1}
        assert all(c.block_m * c.block_r <= heuristics.ONE_BLOCK_MAX_H_TILE for c in wide if c.block_r >= rank)
    # The stacked path's expand: one rank block up to rank 64 (16-token tiles always among them); the
    # expand's space above.
    stk = list(tuning.stacked_candidates(bucket, 6144, 16))
    assert len(set(stk)) == len(stk) and {c.block_r for c in stk} == {16} and 16 in {c.block_m for c in stk}
    assert (4 in {c.n_loop for c in stk}) == (bucket >= heuristics.EXPAND_N_LOOP_MIN_BUCKET)
    assert list(tuning.stacked_candidates(bucket, 6144, 320)) == list(tuning.expand_candidates(bucket, 6144, 320))
    assert {c.block_r for c in exp} == {16} and len(set(exp)) == len(exp)
    assert {c.n_loop for c in exp} == ({1, 4, 8} if bucket >= heuristics.EXPAND_N_LOOP_MIN_BUCKET else {1, 2, 4})
    # From TOKEN_LOOP_MIN_BUCKET both whole-rank expands also walk several token tiles a program (m_loop),
    # always with one column block; never with the rank loop.
    walks = bucket >= tuning.TOKEN_LOOP_MIN_BUCKET
    for space in (exp, stk):
        assert ({c.m_loop for c in space} == {1, 2, 4, 8}) == walks and {c.m_loop for c in space} <= {1, 2, 4, 8}
        assert all(c.n_loop == 1 for c in space if c.m_loop > 1)
    assert {c.m_loop for c in tuning.expand_candidates(bucket, 6144, 320)} == {1}


# (max rank, shrink, expand): the expand adds the shrink's 3 split-K partial sums of K = 40 itself (one
# rank block, also past 64), or the shrink sums them for the expand's rank loop.
PAIRS = {
    "one_block": (16, heuristics.ShrinkConfig(16, 16, 16, 3, 4, 2), heuristics.ExpandConfig(16, 16, 16, 4, 2)),
    "one_block-rank_80": (80, heuristics.ShrinkConfig(16, 64, 16, 3, 4, 2), heuristics.ExpandConfig(16, 16, 128, 4, 2)),
    "rank_loop-rank_80": (80, heuristics.ShrinkConfig(16, 64, 16, 3, 4, 2), heuristics.ExpandConfig(16, 16, 32, 4, 2)),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # see test_split_k_...
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("pair", [*PAIRS, None], ids=lambda p: f"pair-{p}" if p else "shrink_alone")
def test_tuner_times_what_add_lora_runs(pair):
    """The tuner's shrink runner: with an expand config, the pair add_lora_ runs: y gets the LoRA delta;
    alone, the shrink op (h summed by the shrink)."""
    from lora_ops.reference import lora_delta_reference, shrink_reference
    R, scfg, ecfg = PAIRS[pair or "one_block"]
    with_expand = pair is not None
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], R, 3, 9)
    y0 = p["y"].clone()
    if with_expand:
        assert launch.shrink_buffer(p["x"], p["A"], scfg, ecfg).shape[0] == (3 if R <= ecfg.block_r else 1)
    tuning.shrink_runner(p, scfg, ecfg if with_expand else None)()
    slots = p["meta"][0].new_full((9,), -1)
    sorted_ids, starts, counts = (t.cpu() for t in p["meta"])
    for s in range(3):
        slots[sorted_ids[starts[s]:starts[s] + counts[s]].long()] = s
    if with_expand:
        ref = lora_delta_reference(p["x"], p["A"], p["B"], p["scale"], p["rank"], slots, p["widths"])
        torch.testing.assert_close((p["y"] - y0).cpu(), ref.float(), rtol=1e-4, atol=1e-4)
    else:
        ref = shrink_reference(p["x"], p["A"], p["scale"], p["rank"], slots)
        has = (slots >= 0).cpu()
        # Into a buffer of its own: p["h"] stays the expand's input.
        torch.testing.assert_close(p["h_shrink"].cpu()[has], ref.float()[has], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"pair-{p}")
def test_tuner_store_runner_writes_the_delta(pair, monkeypatch):
    """The tuner's store runner: the shrink add_lora_ resolves, then the expand in its store mode: y (NaN
    before) = the LoRA delta, rows without one 0."""
    from lora_ops.reference import lora_delta_reference
    R, scfg, ecfg = PAIRS[pair]
    monkeypatch.setattr(configs, "shrink_config", lambda *a, **k: scfg)
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], R, 3, 9)
    p["y"].fill_(float("nan"))
    tuning.store_runner(p, ecfg)()
    slots = p["meta"][0].new_full((9,), -1)
    sorted_ids, starts, counts = (t.cpu() for t in p["meta"])
    for s in range(3):
        slots[sorted_ids[starts[s]:starts[s] + counts[s]].long()] = s
    ref = lora_delta_reference(p["x"], p["A"], p["B"], p["scale"], p["rank"], slots, p["widths"])
    torch.testing.assert_close(p["y"].cpu(), ref.float(), rtol=1e-4, atol=1e-4)


CHECKED = {   # kind -> (max rank, config, expand config) each runner is checked with
    "expand": (80, heuristics.ExpandConfig(16, 16, 32, 4, 2), None),
    "shrink": (80, PAIRS["rank_loop-rank_80"][1], None),
    "pair": (80, *PAIRS["rank_loop-rank_80"][1:]),
    "pair_one_block": (16, *PAIRS["one_block"][1:]),
    "fused": (16, heuristics.FusedConfig(16, 16, 16, 16, 4, 2), None),
    "store": (80, heuristics.ExpandConfig(16, 16, 32, 4, 2), None),
    "stacked": (16, heuristics.ExpandConfig(16, 16, 16, 4, 2), None),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # see test_split_k_...
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CHECKED)
def test_tuner_check_passes_right_candidates_and_restores_y(case, dtype, request):
    """Every runner's output passes the tuner's check (check_candidate) for a right config, with y as first
    seen afterwards, also after timing-like runs added into y. (bf16 is judged on a GPU only: the
    interpreter's own bf16 arithmetic is wrong, so the check skips it there.)"""
    if dtype == torch.bfloat16:
        request.getfixturevalue("bf16_interpreter")
    R, cfg, ecfg = CHECKED[case]
    kind = case.split("_")[0].replace("pair", "shrink")
    p = tuning.synthetic_problem(torch.device(DEVICE), dtype, 40, [24, 8], R, 3, 9)
    y0 = p["y"].clone()
    assert tuning.time_config(kind, [p], cfg, ecfg, check=False) is not None   # timed first: y moves on
    assert tuning.check_candidate(kind, p, cfg, ecfg) is None
    assert torch.equal(p["y"], y0)   # the check ran from y as it was before the timing, and put it back


@pytest.mark.parametrize("fault,tokens", [("one_value", 9), ("one_row", 9), ("nan", 9), ("skipped", 9), ("skipped", 1)],
                         ids=["one_value", "one_row", "nan", "skipped", "skipped-one_token"])
@pytest.mark.parametrize("kind", ["expand", "store", "shrink_alone"])
def test_tuner_check_rejects_wrong_candidates(kind, fault, tokens, monkeypatch, capsys):
    """A candidate whose output is wrong (one value or one row off by the delta's size, a NaN, or no write at
    all) fails the check, and time_config drops it with a line to stderr. One token too: its problem's token
    drew "no adapter" (a zero delta), and a config that wrote nothing passed the check at the 1-token bucket."""
    R, cfg, ecfg = CHECKED["shrink" if kind == "shrink_alone" else kind]
    kind = kind.replace("_alone", "")
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], R, 3, tokens)
    real = tuning.RUNNERS[kind]

    def faulty(p, cfg, expand_cfg=None):
        run = real(p, cfg, expand_cfg)

        def go():
            out = p["h_shrink"] if kind == "shrink" else p["y"]
            before = out.clone()
            run()
            used = (p["slots"] >= 0).nonzero()[0, 0]   # a token with an adapter
            if fault == "one_value":
                out[used].view(-1)[0] += 3 * float(out[used].abs().max())
            elif fault == "one_row":
                out[used] = before[used]
            elif fault == "nan":
                out[used].view(-1)[-1] = float("nan")
            else:
                out.copy_(before)
        return go
    monkeypatch.setattr(tuning, "RUNNERS", {**tuning.RUNNERS, kind: faulty})
    assert tuning.check_candidate(kind, p, cfg, ecfg) is not None
    assert tuning.time_config(kind, [p], cfg, ecfg) is None
    assert "wrong result" in capsys.readouterr().err


def test_synthetic_problems_give_token_0_an_adapter():
    for seed in range(64):
        p = tuning.synthetic_problem(torch.device("cpu"), torch.float32, 8, [4], 4, 3, 1, seed=seed)
        assert int(p["slots"][0]) >= 0 and int(p["meta"].slot_counts[3]) == 0


@pytest.mark.parametrize("kind", ["expand", "shrink_alone", "stacked"])
def test_tuner_check_rejects_runs_that_differ(kind, monkeypatch, capsys):
    """A candidate whose runs write different bits (a race: one value a step off in the second run, within
    the value bound) fails the check as a race, whatever its values."""
    R, cfg, ecfg = CHECKED["shrink" if kind == "shrink_alone" else kind]
    kind = kind.replace("_alone", "")
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], R, 3, 9)
    real, runs = tuning.RUNNERS[kind], []

    def racing(p, cfg, expand_cfg=None):
        run = real(p, cfg, expand_cfg)

        def go():
            run()
            runs.append(1)
            if len(runs) % 2 == 0:
                out = p["h_shrink"] if kind == "shrink" else p["stacked_out"] if kind == "stacked" else p["y"]
                used = (p["slots"] >= 0).nonzero()[0, 0]
                first = out[used].view(-1)
                first[0] = torch.nextafter(first[0], torch.tensor(math.inf, device=out.device))
        return go
    monkeypatch.setattr(tuning, "RUNNERS", {**tuning.RUNNERS, kind: racing})
    assert "a race" in tuning.check_candidate(kind, p, cfg, ecfg)
    assert tuning.time_config(kind, [p], cfg, ecfg) is None
    assert "runs differ" in capsys.readouterr().err


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_tuner_pair_launches_with_pdl_where_add_lora_does(monkeypatch, pdl):
    """The pair's timing launches shrink and expand with PDL exactly where add_lora_ would (uses_pdl)."""
    seen = []
    monkeypatch.setattr(launch, "uses_pdl", lambda x: pdl)
    monkeypatch.setattr(launch, "launch_shrink", lambda *a, **kw: seen.append(("shrink", kw.get("pdl"))))
    monkeypatch.setattr(launch, "launch_expand", lambda *a, **kw: seen.append(("expand", kw.get("pdl"))))
    R, scfg, ecfg = PAIRS["one_block"]
    p = tuning.synthetic_problem(torch.device(DEVICE), torch.float32, 40, [24, 8], R, 3, 9)
    tuning.shrink_runner(p, scfg, ecfg)()
    assert seen == [("shrink", pdl), ("expand", pdl)]


def test_tuner_picks_the_fastest_pair_over_both_expand_paths(monkeypatch):
    """At ranks past 64 the expand's two paths differ in what they ask of the shrink (one rank block adds
    its partial sums; the rank loop has it sum them), so the tuner times the shrink before each path's
    fastest expand and keeps the fastest pair, not the fastest expand."""
    loop_fast, loop_slow = heuristics.ExpandConfig(16, 128, 64, 4, 3), heuristics.ExpandConfig(32, 128, 64, 4, 3)
    one_block = heuristics.ExpandConfig(16, 64, 128, 8, 2)
    shrinks = [heuristics.ShrinkConfig(16, 64, 256, 32, 4, 3), heuristics.ShrinkConfig(16, 64, 256, 1, 4, 3)]
    pair_us = {(shrinks[0], loop_fast): 20.0, (shrinks[1], loop_fast): 30.0,
               (shrinks[0], one_block): 12.0, (shrinks[1], one_block): 25.0}
    timed = []

    def fake_time(kind, problems, cfg, expand_cfg=None, check=True):
        timed.append(expand_cfg)
        return pair_us[(cfg, expand_cfg)]
    monkeypatch.setattr(tuning, "time_config", fake_time)
    monkeypatch.setattr(tuning, "passes_check", lambda *a: True)
    expand_us = {loop_fast: 3.0, loop_slow: 4.0, one_block: 5.0}     # the one-block expand alone is slower
    shrink, us, timings, expand, e_us = tuning.search_pair([], shrinks, expand_us, 128)
    assert (shrink, us, expand, e_us) == (shrinks[0], 12.0, one_block, 5.0)
    assert set(timed) == {loop_fast, one_block} and len(timings) == 2


def test_search_checks_each_new_fastest_and_drops_a_wrong_one(monkeypatch):
    """search checks a candidate only when it times faster than all before it; a wrong one is neither kept
    nor timed into the result, and the fastest right one wins."""
    cands = [heuristics.ExpandConfig(16, bn, 16, 4, 2) for bn in (16, 32, 64, 128)]
    us = dict(zip(cands, (5.0, 7.0, 3.0, 1.0)))
    checked = []
    monkeypatch.setattr(tuning, "time_config", lambda kind, problems, cfg, expand_cfg=None, check=True: us[cfg])
    monkeypatch.setattr(tuning, "passes_check",
                        lambda kind, problems, cfg, expand_cfg=None: checked.append(cfg) or cfg != cands[3])
    best, best_us, timings = tuning.search("expand", [], cands)
    assert (best, best_us) == (cands[2], 3.0) and cands[3] not in timings and len(timings) == 3
    assert checked == [cands[0], cands[2], cands[3]]


def test_tuner_pairs_each_column_block_count_with_the_shrinks(monkeypatch):
    """An expand streaming several column blocks reads its tile's partial sums once for all of them: timed
    alone (on one part) it looks slower, but after a shrink of many splits it wins the pair. Its pairs are
    timed with the full search's fastest shrink shapes only, at every split count."""
    one, four = heuristics.ExpandConfig(16, 64, 64, 4, 2, 1), heuristics.ExpandConfig(16, 64, 64, 4, 2, 4)
    one_slow = heuristics.ExpandConfig(32, 64, 64, 4, 2, 1)
    shapes = [heuristics.ShrinkConfig(16, 64, bk, 1, 4, 3) for bk in (64, 128, 256)] + \
        [heuristics.ShrinkConfig(32, 64, bk, 1, 4, 3) for bk in (64, 128, 256)]
    shrinks = [c._replace(split_k=sk) for c in shapes for sk in (4, 16)]
    pair_us = {}
    for i, c in enumerate(shrinks):   # with `one`: 4 splits best; the 32-row shapes slowest
        pair_us[(c, one)] = 10.0 + i * 0.1 + (0.0 if c.split_k == 4 else 1.0)
        pair_us[(c, four)] = 8.0 if (c.block_k, c.split_k, c.block_m) == (256, 16, 16) else 10.5
    timed = []

    def fake_time(kind, problems, cfg, expand_cfg=None, check=True):
        timed.append((cfg, expand_cfg))
        return pair_us[(cfg, expand_cfg)]
    monkeypatch.setattr(tuning, "time_config", fake_time)
    monkeypatch.setattr(tuning, "passes_check", lambda *a: True)
    shrink, us, timings, expand, e_us = tuning.search_pair([], shrinks, {one: 3.0, one_slow: 3.5, four: 4.0}, 64)
    assert (shrink, us, expand, e_us) == (shrinks[5], 8.0, four, 4.0)
    after_four = {cfg for cfg, e in timed if e == four}
    assert len(after_four) == 2 * tuning.PAIR_RETIME_SHAPES and {c.split_k for c in after_four} == {4, 16}
    assert len([e for _, e in timed if e == one]) == len(shrinks) and one_slow not in {e for _, e in timed}


def test_runtime_autotune_is_asked_once_per_key_and_never_during_capture(monkeypatch):
    """enable_autotune: each new (kernel, shapes, bucket) key on a GPU is tuned once and remembered (the
    shrink with its expand's width: the pair decides its split count); during a CUDA-graph capture the
    table or heuristic serves and nothing is remembered, so a later warm-up still tunes."""
    asked = []
    tuned = heuristics.ShrinkConfig(16, 16, 64, 3, 4, 3)

    def fake_autotune(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features=None,
                      fused_only=False):
        asked.append((kind, features, bucket, out_features))
        return tuned
    capturing = {"on": True}
    monkeypatch.setattr(tuning, "autotune", fake_autotune)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    configs.enable_autotune(True)
    try:
        cfg = configs.shrink_config(40, 4096, 3, 16, 4, CUDA, torch.bfloat16, out_features=6144)
        assert asked == [] and cfg != tuned                          # in a capture: not tuned
        capturing["on"] = False
        for m in (40, 64, 33):                                       # one bucket: asked once
            assert configs.shrink_config(m, 4096, 3, 16, 4, CUDA, torch.bfloat16, out_features=6144) == tuned
        assert asked == [("shrink", 4096, 64, 6144)]
        configs.shrink_config(40, 4096, 3, 16, 4, CUDA, torch.float32, out_features=6144)
        assert len(asked) == 1                                       # float32: the heuristic, no tuning
    finally:
        configs.enable_autotune(False)


def _timed_at(monkeypatch, us):
    """tuning.time_config runs each candidate as before and reports it at ``us[cfg]`` µs (or None where it
    failed): the fastest is known, not left to the interpreter's wall time."""
    real = tuning.time_config

    def time_config(kind, problems, cfg, expand_cfg=None, check=True):
        return None if real(kind, problems, cfg, expand_cfg, check) is None else us[cfg]
    monkeypatch.setattr(tuning, "time_config", time_config)


def test_autotune_times_the_shrink_with_its_expand(monkeypatch):
    """tuning.autotune for add_lora_'s shrink (out_features given) times each candidate followed by the
    expand, and returns the fastest that runs (on the test device: the interpreter, or the GPU; two
    candidates, one copy, the second reported fastest)."""
    timed = []
    real_runner = tuning.shrink_runner

    def recording_runner(p, cfg, expand_cfg=None):
        timed.append((cfg, expand_cfg))
        return real_runner(p, cfg, expand_cfg)
    cands = [heuristics.ShrinkConfig(16, 16, 16, 2, 4, 2), heuristics.ShrinkConfig(16, 16, 32, 1, 4, 2)]
    _timed_at(monkeypatch, {cands[0]: 5.0, cands[1]: 1.0})
    monkeypatch.setitem(tuning.RUNNERS, "shrink", recording_runner)
    monkeypatch.setattr(tuning, "passes_check", lambda *a: True)   # timing only: no check's runs recorded
    monkeypatch.setattr(tuning, "candidates_for", lambda kind, *a, **k: cands)
    monkeypatch.setattr(tuning, "MAX_COPIES", 1)
    best = tuning.autotune("shrink", torch.device(DEVICE), torch.float32, 40, 2, 16, 3, 16, out_features=32)
    assert best == cands[1]
    assert [c for c, _ in timed] == cands and all(e is not None for _, e in timed)


@pytest.mark.parametrize("pair_us, chosen", [(5.0, None), (20.0, "fused")], ids=["pair_faster", "fused_faster"])
def test_autotune_one_launch_against_the_fastest_pair(monkeypatch, pair_us, chosen):
    """tuning.autotune("fused") keeps the one-launch config only where it beats the fastest shrink + expand
    pair over both expand paths (search_pair), not a pair built on the fastest expand alone."""
    fused = heuristics.FusedConfig(16, 128, 16, 128, 4, 3)
    expand_us = {heuristics.ExpandConfig(16, 64, 64, 4, 3): 1.0}
    asked = []

    def fake_search(kind, problems, candidates, expand_cfg=None):
        return (fused, 10.0, {fused: 10.0}) if kind == "fused" else (None, 0.0, expand_us)

    def fake_pair(problems, shrink_candidates, timings, max_rank):
        asked.append((timings, max_rank))
        return None, pair_us, {}, None, 1.0
    monkeypatch.setattr(tuning, "search", fake_search)
    monkeypatch.setattr(tuning, "search_pair", fake_pair)
    monkeypatch.setattr(tuning, "MAX_COPIES", 1)
    best = tuning.autotune("fused", torch.device(DEVICE), torch.float32, 40, 2, 80, 3, 1, out_features=32)
    assert best == (fused if chosen else None) and asked == [(expand_us, 80)]


def test_autotune_times_the_stacked_layer(monkeypatch):
    """tuning.autotune("stacked") times each candidate as the stacked layer runs it (the GEMM over [W; A],
    then the expand reading h from its output) on problems of the layer's input width, and returns the
    fastest that runs (the second, reported fastest); configs.stacked_config asks it once per key, with the
    input width."""
    timed = []
    real_runner = tuning.stacked_runner

    def recording_runner(p, cfg, expand_cfg=None):
        run = real_runner(p, cfg, expand_cfg)
        timed.append((cfg, tuple(p["Wst"].shape)))
        return run
    cands = [heuristics.ExpandConfig(16, 16, 16, 4, 2), heuristics.ExpandConfig(16, 32, 16, 4, 2, 2)]
    _timed_at(monkeypatch, {cands[0]: 5.0, cands[1]: 1.0})
    monkeypatch.setitem(tuning.RUNNERS, "stacked", recording_runner)
    monkeypatch.setattr(tuning, "passes_check", lambda *a: True)   # timing only: no check's runs recorded
    monkeypatch.setattr(tuning, "candidates_for", lambda kind, *a, **k: cands)
    monkeypatch.setattr(tuning, "MAX_COPIES", 1)
    # 3 slots, 2 slices of 24 + 24 outputs, rank 16, K 40: [W; A] is [48 + 3 * 2 * 16, 40].
    best = tuning.autotune("stacked", torch.device(DEVICE), torch.float32, 48, 2, 16, 3, 16, out_features=40)
    assert best == cands[1] and timed == [(c, (48 + 96, 40)) for c in cands]

    asked = []
    monkeypatch.setattr(tuning, "autotune", lambda kind, *a, **k: asked.append((kind, a)) or cands[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    configs.enable_autotune(True)
    try:
        for m in (40, 64):
            assert configs.stacked_config(m, 6144, 3, 16, 4, 4096, CUDA, torch.bfloat16) == cands[0]
        assert asked == [("stacked", (CUDA, torch.bfloat16, 6144, 3, 16, 4, 64, 4096))]
    finally:
        configs.enable_autotune(False)


def test_autotune_times_the_store_mode(monkeypatch):
    """tuning.autotune("store") times each candidate as lora_linear's write-first delta runs (the shrink,
    then the expand in its store mode: tuning.store_runner) on problems of the layer's input width, and
    returns the fastest (the second, reported fastest)."""
    timed = []
    real_runner = tuning.store_runner

    def recording_runner(p, cfg, expand_cfg=None):
        timed.append((cfg, tuple(p["x"].shape)))
        return real_runner(p, cfg, expand_cfg)
    cands = [heuristics.ExpandConfig(16, 16, 16, 4, 2), heuristics.ExpandConfig(16, 32, 16, 4, 2, 1, 2)]
    _timed_at(monkeypatch, {cands[0]: 5.0, cands[1]: 1.0})
    monkeypatch.setitem(tuning.RUNNERS, "store", recording_runner)
    monkeypatch.setattr(tuning, "passes_check", lambda *a: True)   # timing only: no check's runs recorded
    monkeypatch.setattr(tuning, "candidates_for", lambda kind, *a, **k: cands)
    monkeypatch.setattr(tuning, "MAX_COPIES", 1)
    best = tuning.autotune("store", torch.device(DEVICE), torch.float32, 48, 2, 16, 3, 16, out_features=40)
    assert best == cands[1] and timed == [(c, (16, 40)) for c in cands]


def test_float32_takes_its_own_tiles_on_a_gpu_only():
    """On a CUDA device float32 resolves the heuristic in float32's tiles (heuristics.float32_tiles: narrower
    feature tiles, 8 warps, the expand's rank tile kept); on the CPU (the interpreter) the heuristic as is."""
    from lora_ops.configs import heuristics
    configs.reset()
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for M, R in ((1, 16), (64, 64), (4096, 64), (64, 320), (4096, 320)):
        for kind in ("shrink", "expand"):
            get = getattr(configs, f"{kind}_config")
            on_cpu, on_gpu = get(M, 512, 3, R, 4, cpu, torch.float32), get(M, 512, 3, R, 4, gpu, torch.float32)
            assert on_gpu == heuristics.float32_tiles(on_cpu), (kind, M, R)
            assert on_gpu.num_warps == heuristics.F32_WARPS and on_gpu != on_cpu, (kind, M, R)
            if kind == "expand":
                assert on_gpu.block_r == on_cpu.block_r and on_gpu.block_n <= 32, (M, R)
            else:
                assert on_gpu.block_r <= 16 and on_gpu.block_k <= 64 and on_gpu.split_k <= on_cpu.split_k, (M, R)


def test_planes_in_turn_is_a_table_field_but_no_tuner_candidate(pretend_gpu_table):
    """The rank loop's planes in turn (ExpandConfig.planes_in_turn) lost on the H200 (1.10-1.24x the table's
    time, session 26): the tuner does not try it; a table entry may still hold it, and entries written before
    the field load without it."""
    for bucket in (256, 1024, 4096):
        assert not any(c.planes_in_turn for c in tuning.expand_candidates(bucket, 6144, 320)), bucket
    old_style = {k: v for k, v in heuristics.ExpandConfig(64, 256, 32, 4, 3)._asdict().items() if k != "planes_in_turn"}
    pretend_gpu_table([
        dict(kind="expand", features=4096, slices=1, rank=320, tokens=4096, config=old_style),
        dict(kind="expand", features=4096, slices=1, rank=320, tokens=1024,
             config=heuristics.ExpandConfig(128, 256, 32, 8, 3, planes_in_turn=True)._asdict()),
    ])
    assert configs.expand_config(4096, 4096, 1, 320, 4, CUDA, torch.bfloat16) == \
        heuristics.ExpandConfig(64, 256, 32, 4, 3)
    assert configs.expand_config(1024, 4096, 1, 320, 4, CUDA, torch.bfloat16).planes_in_turn


# sm_90's shared memory a block (the opt-in maximum, H100 and H200) and the layer shapes whose configs must fit:
# (in_features, slices, out_features) of Llama-3-8B's and Phi-4-mini's layers.
SM90_SHARED = 232448
LAYER_SHAPES = [(4096, 3, 6144), (4096, 1, 4096), (4096, 2, 28672), (14336, 1, 4096), (3072, 3, 5120),
                (3072, 1, 3072), (3072, 2, 16384), (8192, 1, 3072)]


def _shrink_shared(cfg, element_size=2):
    """The shrink's shared memory: each stage holds an x tile and the slice group's A tiles."""
    return cfg.num_stages * cfg.block_k * (cfg.block_m + cfg.slice_group * cfg.block_r) * element_size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_configs_from_the_shipped_table_fit_sm90_shared_memory(pretend_gpu_tables, dtype):
    """Configs derived from the H200 table for shapes it does not hold must still compile on sm_90:
    - a shrink entry at a neighbouring rank kept its slice group with the wider rank block (rank 32 from the
      rank-16 entry: a 128-wide dot, 288 KiB; the launch fails on the GPU);
    - float16 widens the expand's B tile to float32 (one rank block of 512 and 128 columns: 292 KiB).
    The estimates match sm90_codegen's compiles of both (2026-12-06)."""
    table = json.loads((configs.TUNED_DIR / "NVIDIA_H200.json").read_text())
    pretend_gpu_tables({"NVIDIA_H200": table}, ("NVIDIA H200", (9, 0), 132))
    for (K, S, N), R, tokens in itertools.product(LAYER_SHAPES, (8, 16, 24, 32, 48, 64, 96, 128, 256, 320, 512),
                                                  (1, 16, 64, 256, 1024, 4096)):
        shrink = configs.shrink_config(tokens, K, S, R, 4, CUDA, dtype, out_features=N)
        assert _shrink_shared(shrink) <= SM90_SHARED, (K, S, N, R, tokens, shrink)
        if dtype == torch.float16:
            expand = configs.expand_config(tokens, N, S, R, 4, CUDA, dtype)
            assert expand.block_r * expand.block_n <= heuristics.FLOAT16_MAX_B_TILE, (N, S, R, tokens, expand)


def test_float16_tiles_narrow_only_a_wide_float32_b_tile():
    wide = heuristics.ExpandConfig(16, 128, 512, 8, 2)
    assert heuristics.float16_tiles(wide) == wide._replace(block_n=64)
    for cfg in (heuristics.ExpandConfig(16, 128, 256, 8, 2), heuristics.ExpandConfig(64, 256, 32, 4, 3),
                heuristics.ShrinkConfig(64, 32, 256, 1, 8, 3, 4)):
        assert heuristics.float16_tiles(cfg) is cfg


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda (the launches sm_90 refused)")
@pytest.mark.parametrize("K, widths, R, M, dtype", [
    (4096, [4096, 1024, 1024], 32, 2048, torch.bfloat16),     # qkv, rank 32 from the rank-16 shrink entry
    (4096, [4096, 1024, 1024], 24, 1100, torch.bfloat16),
    (4096, [4096, 1024, 1024], 320, 16, torch.float16),      # float16's B tile widened to float32
    (3072, [8192, 8192], 512, 64, torch.float16),
], ids=["qkv-r32-2048-bf16", "qkv-r24-1100-bf16", "qkv-r320-16-fp16", "phi-gate_up-r512-64-fp16"])
def test_configs_session_37_fixed_launch_on_the_gpu(K, widths, R, M, dtype):
    """The configs test_configs_from_the_shipped_table_fit_sm90_shared_memory bounds, launched: add_lora_ with
    the shipped table's configs at the shapes whose launches ran out of shared memory, against float64."""
    from conftest import TOLERANCE, make_case, rel_err
    case = make_case(M, K, sum(widths), 4, len(widths), R, dtype=dtype, device=DEVICE, seed=37,
                     slice_widths=widths)
    y = torch.full((M, sum(widths)), float("nan"), dtype=dtype, device=DEVICE)
    y.normal_()
    y0 = y.clone()
    launch.add_lora_(y, case.x, case.lora_a, case.lora_b, case.scale, case.rank, case.slice_widths, *case.meta)
    torch.cuda.synchronize()
    assert rel_err(y.double() - y0.double(), case.delta_reference()) <= TOLERANCE[dtype]
    assert torch.equal(y[case.untouched_rows().to(DEVICE)], y0[case.untouched_rows().to(DEVICE)])
