"""The one-launch ticketed kernel (kernels.chained) against the two launches it chains.

Same configs, same arithmetic in the same order, so the results must be bit-identical; the sync counters
must be back at zero after every launch (the next launch, or graph replay, relies on it); partial sums the
shrink leaves unwritten are NaN, so reading one shows.
"""
import math

import pytest
import torch
from conftest import DEVICE

from lora_ops import launch
from lora_ops.configs import tuning
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig

CASES = [  # (M, split_k, slot ranks): one token; many splits; more tokens than one tile per slot
    pytest.param(1, 1, [16, 5, 16], id="M1-split1"),
    pytest.param(9, 3, [16, 5, 0], id="M9-split3-rank0"),
    pytest.param(40, 2, [3, 16, 8], id="M40-split2"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("M, split_k, ranks", CASES)
def test_chained_matches_two_launches(dtype, M, split_k, ranks):
    p = tuning.synthetic_problem(DEVICE, dtype, 96, [32, 16, 16], 16, 3, M, seed=M)
    p["rank"].copy_(torch.tensor(ranks, dtype=torch.int32))
    for slot, r in enumerate(ranks):
        p["B"][slot, :, r:] = math.nan  # past the slot's rank: must not be read
    scfg = ShrinkConfig(16, 16, 32, split_k, 4, 2, 1)
    ecfg = ExpandConfig(16, 16, 16, 4, 2, 2)
    two = p["y"].clone()
    h = launch.shrink_buffer(p["x"], p["A"], scfg, ecfg)
    launch.launch_shrink_expand(two, p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"], h,
                                scfg, ecfg)
    assert not two.isnan().any()

    part = torch.full((split_k, M, 3, 16), math.nan, device=DEVICE)
    sync = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second launch reuses the counters the first left
        one = p["y"].clone()
        launch.launch_chained(one, p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"], part,
                              sync, scfg, ecfg)
        assert sync.tolist() == [0, 0, 0], "the last program must reset the counters"
        assert torch.equal(one, two), "one launch and two launches must agree bit for bit"


def test_chained_refuses_the_rank_loop():
    p = tuning.synthetic_problem(DEVICE, torch.float32, 32, [16], 80, 2, 4)
    with pytest.raises(ValueError, match="rank block"):
        launch.launch_chained(p["y"], p["x"], p["A"], p["B"], p["scale"], p["rank"], p["widths"], *p["meta"],
                              torch.empty(1, 4, 1, 80, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE),
                              ShrinkConfig(16, 64, 32, 1, 4, 2, 1), ExpandConfig(16, 16, 64, 4, 2, 1))
