"""The offline tuner's command line (``python -m lora_ops.tune``) with --dry-run: the CPU and the Triton
interpreter on tiny shapes, so it checks the code path and the table it writes, not speed."""
import json
import math

import pytest

from conftest import INTERPRETED
from lora_ops import tune
from lora_ops.configs import heuristics

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--dry-run runs the kernels on the interpreter")

DRY = ["--dry-run", "--model", "tiny", "--layers", "down", "--ranks", "8", "--max-candidates", "2"]
MAKE = {"shrink": heuristics.ShrinkConfig, "expand": heuristics.ExpandConfig, "fused": heuristics.FusedConfig}


def shapes(table):
    return sorted((e["kind"], e["layer"], e["rank"], e["tokens"]) for e in table["entries"])


def test_dry_run_table_merge_and_skip_tuned(tmp_path):
    out = str(tmp_path / "table.json")
    first = tune.main(DRY + ["--tokens", "1", "--out", out])
    assert shapes(first) == [(kind, "down", 8, 1) for kind in ("expand", "fused", "shrink")]
    for e in first["entries"]:
        assert e["config"] is None and e["kind"] == "fused" or MAKE[e["kind"]](**e["config"])
        if e["kind"] == "shrink":
            # The shrink's share is the pair's time less the expand's, two timings: a difference that wall
            # clocks on a busy CPU can make negative (CI, 2026-12-03: the heuristic's, -10 ms), so only the
            # pair's own time must be positive.
            assert e["pair_us"] > 0 and math.isfinite(e["us"]) and math.isfinite(e["heuristic_us"])
        else:
            assert e["us"] > 0 and e["heuristic_us"] > 0
    assert json.load(open(out))["entries"] == first["entries"]

    # --skip-tuned with --merge: the one-token shape stays as it was, only the 16-token one is tuned.
    second = tune.main(DRY + ["--tokens", "1", "16", "--merge", "--skip-tuned", "--out", out])
    assert shapes(second) == sorted(shapes(first) + [(kind, "down", 8, 16) for kind in ("expand", "fused", "shrink")])
    assert [e for e in second["entries"] if e["tokens"] == 1] == first["entries"]
    with pytest.raises(SystemExit, match="needs --merge"):
        tune.main(DRY + ["--skip-tuned", "--out", out])
