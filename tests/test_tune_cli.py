"""The offline tuner's command line (``python -m lora_ops.tune``) with --dry-run: the CPU and the Triton
interpreter on tiny shapes, so it checks the code path and the table it writes, not speed."""
import json
import math
import re
import os

import pytest
import torch

from conftest import INTERPRETED
from lora_ops import configs, tune
from lora_ops.configs import heuristics, tuning

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--dry-run runs the kernels on the interpreter")

DRY = ["--dry-run", "--model", "tiny", "--layers", "down", "--ranks", "8", "--max-candidates", "2"]
MAKE = {"shrink": heuristics.ShrinkConfig, "expand": heuristics.ExpandConfig, "fused": heuristics.FusedConfig,
        "stacked": heuristics.ExpandConfig, "store": heuristics.ExpandConfig}
KINDS = ("expand", "fused", "shrink", "stacked")


def shapes(table):
    return sorted((e["kind"], e["layer"], e["rank"], e["tokens"]) for e in table["entries"])


def test_dry_run_table_merge_and_skip_tuned(tmp_path):
    out = str(tmp_path / "table.json")
    first = tune.main(DRY + ["--tokens", "1", "--out", out])
    assert shapes(first) == sorted([(kind, "down", 8, 1) for kind in KINDS + ("stack_pad", "stack_limit")])
    for e in first["entries"]:
        if e["kind"] == "stack_pad":   # the wider GEMM's padding: one entry per layer and rank
            assert e["rows"] == 4 * 1 * 8 and e["pad"] in tuning.STACK_PAD_ROWS and e["buckets"] == [1]
            assert len(e["bucket_pads"]) == len(e["buckets"]) and e["pad"] == max(e["bucket_pads"])
            assert set(e["us"]) == {str(p) for p in tuning.STACK_PAD_ROWS}
            continue
        if e["kind"] == "stack_limit":   # both layer paths at every bucket; the limit one of them or 0
            assert e["rows"] == 4 * 1 * 8 and e["buckets"] == [1] and e["max_tokens"] in (0, 1)
            assert {path: len(ts) for path, ts in e["us"].items()} == {"stacked": 1, "linear": 1}
            assert all(t > 0 for ts in e["us"].values() for t in ts)
            continue
        assert e["config"] is None and e["kind"] == "fused" or MAKE[e["kind"]](**e["config"])
        if e["kind"] == "shrink":
            # The shrink's share is the pair's time less the expand's, two timings: a difference that wall
            # clocks on a busy CPU can make negative (CI, 2026-12-03: the heuristic's, -10 ms), so only the
            # pair's own time must be positive.
            assert e["pair_us"] > 0 and 0 <= e["us"] < math.inf and 0 <= e["heuristic_us"] < math.inf
        else:
            assert e["us"] > 0 and e["heuristic_us"] > 0
        if e["kind"] == "stacked":   # the layer timed with the config it replaces beside it
            assert e["in_features"] == 80 and e["expand_entry_us"] > 0
    assert json.load(open(out))["entries"] == first["entries"]

    # --skip-tuned with --merge: the one-token shape stays as it was, only the 16-token one is tuned (the
    # layer's padding was tuned at its first bucket already).
    second = tune.main(DRY + ["--tokens", "1", "16", "--merge", "--skip-tuned", "--out", out])
    assert shapes(second) == sorted(shapes(first) + [(kind, "down", 8, 16) for kind in KINDS])
    assert [e for e in second["entries"] if e["tokens"] == 1] == first["entries"]
    with pytest.raises(SystemExit, match="needs --merge"):
        tune.main(DRY + ["--skip-tuned", "--out", out])


CUDA = torch.device("cuda", 0)   # (lookups on a pretend GPU: configs._gpu answers; nothing runs there)


def test_the_written_table_is_the_one_lookups_serve(tmp_path, monkeypatch, capsys, pretend_gpu_tables):
    """Every entry the tuner writes is found by the library's own lookups for the shape it tuned: the file is
    named for the GPU as configs.load_table looks it up, and each entry's key fields (kind, features,
    out_features, in_features, slices, rank, tokens, rows) are the ones configs' lookups match. A table that
    loads (``load_table(...) == table``) can still serve nothing: a shrink entry with features and out_features
    swapped, or an expand entry keyed by the input width, is too far from every shape (MAX_DISTANCE) and the
    heuristic serves instead, silently; a field off by less is still the nearest of this one layer's entries,
    so the key fields are checked as well. Each config is first replaced by a marker (num_stages 7 + its index, a
    one-launch entry's null too) so that a lookup that fell back to the heuristic cannot pass by equalling it,
    and the 1- and 16-token entries are told apart. The "stack_limit" kind is timed inside the table this run
    writes (its pair and stack_pad entries), as stack_a will run with it."""
    from lora_ops import launch
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 16)   # a "store" entry at 16 tokens
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    pretend_gpu_tables({}, ("dry-run", (9, 0), 132))     # a dry run's GPU name, as the lookups see this process's
    monkeypatch.setenv(configs.TUNED_DIR_ENV, str(configs.TUNED_DIR))   # the tuner's default --out goes there
    seen = []
    real_times = tuning.layer_path_times

    def layer_path_times(*args):
        seen.append(configs.load_table("dry-run"))
        return real_times(*args)
    monkeypatch.setattr(tuning, "layer_path_times", layer_path_times)
    table = tune.main(DRY + ["--tokens", "1", "16"])
    written = re.search(r"wrote \d+ entries to (\S+?)(;|$)", capsys.readouterr().out, re.M).group(1)
    assert written == str(configs.table_path("dry-run", configs.TUNED_DIR))
    assert sorted({e["kind"] for e in table["entries"]}) == sorted(KINDS + ("stack_pad", "stack_limit", "store"))
    assert [[(e["kind"], e["tokens"]) for e in t["entries"]] for t in seen] == \
        [[(e["kind"], e["tokens"]) for e in table["entries"] if e["kind"] != "stack_limit"]]
    for i, e in enumerate(table["entries"]):
        if e["kind"] in MAKE:
            e["config"] = dict(e["config"] or heuristics.FusedConfig(16, 32, 16, 16, 4, 1)._asdict(), num_stages=7 + i)
    with open(written, "w") as f:
        json.dump(table, f)
    configs.reset()
    K, N, S, r, L = 80, 32, 1, 8, 4     # tiny's down layer, at DRY's rank and the default 4 slots
    lookups = {
        "shrink": lambda m: configs.shrink_config(m, K, S, r, L, CUDA, torch.bfloat16, out_features=N),
        "expand": lambda m: configs.expand_config(m, N, S, r, L, CUDA, torch.bfloat16),
        "fused": lambda m: configs.fused_config(m, K, N, S, r, L, CUDA, torch.bfloat16),
        "stacked": lambda m: configs.stacked_config(m, N, S, r, L, K, CUDA, torch.bfloat16),
        "store": lambda m: configs.store_config(m, N, S, r, L, K, CUDA, torch.bfloat16),
    }
    # The key fields themselves: a lookup takes the nearest entry, and of one layer's entries an expand keyed by
    # its input width (80 for 32) is still the nearest, though another layer's would win in a model's table.
    stack_key = dict(features=N, in_features=K, rows=L * S * r)
    keys = {"shrink": dict(features=K, out_features=N), "expand": dict(features=N),
            "fused": dict(features=K, out_features=N), "stacked": dict(features=N, in_features=K),
            "store": dict(features=N, in_features=K), "stack_pad": stack_key, "stack_limit": stack_key}
    for e in table["entries"]:
        what = (e["kind"], e["tokens"])
        want = dict(keys[e["kind"]], slices=S, rank=r)
        assert {k: e.get(k) for k in want} == want, what
        if e["kind"] == "stack_limit":
            assert configs.stack_limit_tokens(N, K, L * S * r, CUDA, torch.bfloat16) == \
                (e["max_tokens"], max(e["buckets"])), what
        elif e["kind"] == "stack_pad":
            assert configs.stack_pad_at(e["tokens"], N, K, L * S * r, CUDA, torch.bfloat16) is not None, what
        else:
            assert lookups[e["kind"]](e["tokens"]) == MAKE[e["kind"]](**e["config"]), what


def test_dry_run_merge_retunes_entries_in_place(tmp_path):
    """--merge without --skip-tuned: a retuned shape's entries take their old places (the table's diff is
    what changed, not a reshuffle), and a shape new to the table follows them."""
    out = str(tmp_path / "table.json")
    first = tune.main(DRY + ["--tokens", "16", "--kinds", "pair", "--out", out])
    second = tune.main(DRY + ["--tokens", "1", "16", "--kinds", "pair", "--merge", "--out", out])
    order = [(e["kind"], e["tokens"]) for e in second["entries"]]
    assert order[:len(first["entries"])] == [(e["kind"], e["tokens"]) for e in first["entries"]]
    assert {t for _, t in order[len(first["entries"]):]} == {1}, order
    assert all(t == 16 for _, t in order[:len(first["entries"])])
    # Each merge records the table it merged into, oldest first: the first run's time is not lost.
    third = tune.main(DRY + ["--tokens", "1", "--kinds", "pair", "--merge", "--out", out])
    assert [m["seconds"] for m in third["merged_from"]] == [first["seconds"], second["seconds"]]
    assert "merged_from" not in first and len(second["merged_from"]) == 1 and len(third["merged_from"]) == 2


def test_dry_run_stacked_kind_alone_fills_a_pair_table(tmp_path):
    """--kinds stacked --merge --skip-tuned on a table of pair entries: only the stacked entries are added."""
    out = str(tmp_path / "table.json")
    first = tune.main(DRY + ["--tokens", "1", "--kinds", "pair", "--out", out])
    assert {e["kind"] for e in first["entries"]} == {"expand", "fused", "shrink"}
    second = tune.main(DRY + ["--tokens", "1", "--kinds", "stacked", "--merge", "--skip-tuned", "--out", out])
    assert shapes(second) == [(kind, "down", 8, 1) for kind in KINDS]
    assert [e for e in second["entries"] if e["kind"] != "stacked"] == first["entries"]


def test_dry_run_store_kind_only_where_lora_linear_writes_first(tmp_path, monkeypatch):
    """--kinds store writes a "store" entry (the expand's store-mode config) at the buckets where lora_linear
    writes the delta first (launch.writes_first_at), and none at the others."""
    from lora_ops import launch
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_TOKENS", 16)
    monkeypatch.setattr(launch, "WRITE_FIRST_MIN_Y_BYTES", 0)
    table = tune.main(DRY + ["--tokens", "1", "16", "--kinds", "store", "--out", str(tmp_path / "t.json")])
    assert shapes(table) == [("store", "down", 8, 16)]
    (e,) = table["entries"]
    assert MAKE["store"](**e["config"]) and e["us"] > 0 and e["expand_entry_us"] > 0 and e["in_features"] == 80


def test_compile_work_holds_only_what_each_shape_tunes():
    """The parallel compiles cover the kinds each shape is tuned for, no more (a store kind where lora_linear
    does not write first, or a kind --skip-tuned leaves out, compiles nothing)."""
    args = tune.parse_args(DRY + ["--kinds", "pair", "store"])
    jobs = tune._shape_jobs(args, [1, 16])
    work = tune.compile_work(jobs, args, {"pair": {jobs[0]}, "store": {jobs[1]}})
    assert {kind for kind, _ in work[jobs[0]]} == {"shrink", "expand", "fused"}
    assert {kind for kind, _ in work[jobs[1]]} == {"store"}
    assert tune.compile_work(jobs, args, {"pair": set(), "store": set()}) == {}


@pytest.mark.parametrize("table_us, new_us, kept", [(10.0, 9.7, "new"), (10.0, 9.9, "table"), (10.0, 11.0, "table")],
                         ids=["wins-3pct", "wins-1pct", "loses"])
def test_dry_run_min_gain_keeps_the_table_unless_the_new_path_wins(tmp_path, monkeypatch, capsys, table_us, new_us,
                                                                   kept):
    """--min-gain 0.02 times each retuned shape's path against the one the table gives it, in turn, and writes
    the search's entries where the new path takes at most 0.98 of its time, else entries holding the
    configs the library resolved (on the CPU: the heuristic's), so the shape keeps what was measured; the
    other shapes' entries are untouched."""
    out = str(tmp_path / "table.json")
    first = tune.main(DRY + ["--tokens", "1", "16", "--kinds", "pair", "stacked", "--out", out])
    compared = []

    def times_us(fn_lists, device):
        compared.append(sorted(fn_lists))
        assert all(len(fns) == len(fn_lists["table"]) > 0 for fns in fn_lists.values())
        for fns in fn_lists.values():   # both paths run on the problems
            fns[0]()
        return {"table": table_us, "new": new_us}
    monkeypatch.setattr(tuning, "times_us", times_us)
    # Candidates other than the first tuning's, so "new" differs from the table's wherever it is kept.
    capsys.readouterr()
    second = tune.main(DRY[:-2] + ["--max-candidates", "3", "--tokens", "16", "--kinds", "pair", "stacked",
                                   "--merge", "--min-gain", "0.02", "--out", out])
    printed = capsys.readouterr().out
    assert f"configs kept at {2 if kept == 'new' else 0} of 2 shapes" in printed
    # The speed-up summaries are the search's, over the entries that hold its configs only.
    assert ("stacked layer, tuned vs" in printed) == (kept == "new")
    assert compared == [["new", "table"]] * 2   # one shape, two kinds
    assert shapes(second) == shapes(first)
    assert [e for e in second["entries"] if e["tokens"] == 1] == [e for e in first["entries"] if e["tokens"] == 1]
    retuned = [e for e in second["entries"] if e["tokens"] == 16 and e["kind"] in KINDS]
    assert len(retuned) == 4
    job, args = ("tiny", "down", 80, (32,), 8, 16), tune.parse_args(DRY)
    resolved = {k: v for kind in ("pair", "stacked")
                for k, v in tune._library_configs(kind, job, args, torch.device("cpu"), torch.bfloat16).items()}
    for e in retuned:
        assert (e["kept"], e["table_us"], e["retimed_us"]) == (kept, table_us, new_us)
        if kept == "table":
            assert e["config"] == resolved[e["kind"]]
    with pytest.raises(SystemExit, match="needs --merge"):
        tune.main(DRY + ["--min-gain", "0.02", "--out", out])


@pytest.mark.parametrize("new_us, kept", [(9.0, "new"), (11.0, "table")])
def test_min_gain_compares_with_the_configs_the_table_gives(monkeypatch, new_us, kept):
    """against_table times the new entries against the configs the library resolves from the table at --out
    (tune._lookups_from: read as this GPU's), and where they lose keeps those: the table's own entries here,
    which the heuristic does not equal; where they win, the search's configs (the test above checks only their
    "kept" label where they win: entries labelled "new" that held the table's configs passed it). The dry runs
    above cannot tell: on the CPU every lookup is the heuristic's, so a comparison with the heuristic instead of
    the table passed them. A pretend GPU here
    (configs._gpu, sm_90 with 132 SMs, so that without the table the shipped H200 table would serve)."""
    job, args = ("tiny", "down", 80, (32,), 8, 16), tune.parse_args(DRY + ["--merge", "--min-gain", "0.02"])
    key = dict(model="tiny", layer="down", slices=1, rank=8, tokens=16)
    theirs = {"shrink": heuristics.ShrinkConfig(16, 16, 16, 1, 2, 5),
              "expand": heuristics.ExpandConfig(16, 32, 16, 2, 5),
              "fused": heuristics.FusedConfig(16, 32, 16, 16, 2, 5)}
    table = dict(gpu="Pretend GPU", entries=[
        dict(kind="shrink", features=80, out_features=32, **key, config=theirs["shrink"]._asdict()),
        dict(kind="expand", features=32, **key, config=theirs["expand"]._asdict()),
        dict(kind="fused", features=80, out_features=32, **key, config=theirs["fused"]._asdict())])
    ours = [dict(e, config=None if e["kind"] == "fused" else dict(e["config"], num_stages=6))
            for e in table["entries"]]
    monkeypatch.setattr(configs, "_gpu", lambda index: ("Pretend GPU", (9, 0), 132))
    monkeypatch.setattr(tuning, "times_us", lambda fn_lists, device: {"table": 10.0, "new": new_us})
    problems = tuning.problem_copies(torch.device("cpu"), torch.bfloat16, 80, [32], 8, args.slots, 16)
    try:
        got = tune.against_table("pair", job, ours, problems, table, "Pretend GPU", args, CUDA, torch.bfloat16)
    finally:
        configs.reset()
    assert [e["kept"] for e in got] == [kept] * 3
    want = {e["kind"]: e["config"] for e in (ours if kept == "new" else table["entries"])}
    assert {e["kind"]: e["config"] for e in got} == want


def test_dry_run_time_budget_stops_between_shapes_smallest_bucket_first(tmp_path, monkeypatch, capsys):
    """--time-budget: checked before each shape, the shapes in order of token bucket (decode first, where
    configs matter most), whatever order --tokens gives; the table is written with the shapes tuned so far.
    A clock that moves 100 s each time a shape's problems are made, against a budget of 50 s: one shape."""
    clock = [0.0]
    real_copies = tuning.problem_copies

    def problem_copies(*a, **k):
        clock[0] += 100.0
        return real_copies(*a, **k)
    monkeypatch.setattr(tuning, "problem_copies", problem_copies)
    monkeypatch.setattr(tune, "time", type("Clock", (), {"time": staticmethod(lambda: clock[0])}))
    table = tune.main(DRY + ["--tokens", "16", "1", "--kinds", "pair", "--time-budget", "50",
                             "--out", str(tmp_path / "t.json")])
    assert "time budget reached after 1 of 2 shapes" in capsys.readouterr().err
    assert shapes(table) == [(kind, "down", 8, 1) for kind in ("expand", "fused", "shrink")]
    assert json.load(open(tmp_path / "t.json"))["entries"] == table["entries"]


@pytest.mark.parametrize("times, pads", [
    ({0: [10.0, 20.0], 64: [9.9, 19.9], 384: [8.0, 16.0]}, [384, 384]),     # a clear win at both
    ({0: [10.0, 20.0], 64: [9.9, 19.9], 384: [9.8, 19.8]}, [0, 0]),         # under STACK_PAD_MIN_GAIN: none
    ({0: [10.0, 20.0], 128: [8.0, 16.0], 384: [8.0, 16.0]}, [128, 128]),    # ties go to the fewer rows
    ({0: [10.0, 20.0], 64: [8.0, 21.0], 384: [11.0, 15.0]}, [64, 384]),     # each bucket its own
], ids=["wins", "noise", "tie", "per_bucket"])
def test_best_stack_pads(times, pads):
    assert tuning.best_stack_pads(times) == pads


@pytest.mark.parametrize("stacked, linear, limit", [
    ([5.0, 6.0, 9.0, 30.0], [6.0, 8.0, 10.0, 25.0], 256),    # stacked wins to 256, loses at 1024
    ([7.0, 6.0, 6.0, 30.0], [6.0, 9.0, 10.0, 29.0], 256),    # loses at 1 token, wins more at 16-256
    ([7.0, 9.0, 9.0, 30.0], [6.0, 8.0, 8.0, 25.0], 0),       # never wins: not stacked
    ([5.0, 5.0, 5.0, 20.0], [5.0, 5.0, 5.0, 20.0], 0),       # ties: the smaller limit
], ids=["wins_then_loses", "loses_at_one", "never", "ties"])
def test_best_stack_limit(stacked, linear, limit):
    assert tuning.best_stack_limit([1, 16, 256, 1024], dict(stacked=stacked, linear=linear)) == limit


def test_dry_run_stack_limit_times_buckets_up_to_its_maximum(tmp_path):
    out = str(tmp_path / "table.json")
    table = tune.main(DRY + ["--tokens", "1", "1024", "4096", "--kinds", "stack_limit", "--out", out])
    assert [e["buckets"] for e in table["entries"]] == [[1, 1024]] and tuning.STACK_LIMIT_MAX_BUCKET == 1024


def test_dry_run_stack_pad_is_one_entry_per_layer_and_rank(tmp_path):
    """A later --merge run that starts at another bucket retunes the layer's padding in place (one entry);
    with --skip-tuned it leaves it alone."""
    out = str(tmp_path / "table.json")
    tune.main(DRY + ["--tokens", "1", "--kinds", "stack_pad", "--out", out])
    second = tune.main(DRY + ["--tokens", "16", "--kinds", "stack_pad", "--merge", "--out", out])
    assert shapes(second) == [("stack_pad", "down", 8, 16)] and second["entries"][0]["buckets"] == [16]
    third = tune.main(DRY + ["--tokens", "1", "--kinds", "stack_pad", "--merge", "--skip-tuned", "--out", out])
    assert third["entries"] == second["entries"]


def test_dry_run_stack_pad_times_the_buckets_the_layer_stacks(tmp_path, monkeypatch):
    """The padding is timed at every bucket the stacked path serves (layers.stacked_token_limit), not past
    it: here a budget of extra multiply-adds that ends between 16 and 64 tokens. (Tiny down: K 80, N 32;
    rank 4 at 4 slots, 16 rows of A; rank 8's 32 rows are over half of N, so that layer never stacks and
    its one timed bucket is the smallest.)"""
    from lora_ops import layers
    monkeypatch.setattr(layers, "STACKED_ALWAYS_TOKENS", 1)
    monkeypatch.setattr(layers, "STACKED_MAX_EXTRA_MACS", 32 * 80 * 16)
    monkeypatch.setattr(layers, "STACKED_FREE_ROWS", 0)   # the budget decides, however narrow the stack
    out = str(tmp_path / "table.json")
    tokens = ["--tokens", "1", "16", "64", "--kinds", "stack_pad", "--out", out]
    assert [e["buckets"] for e in tune.main(DRY + tokens + ["--ranks", "4"])["entries"]] == [[1, 16]]
    assert [e["buckets"] for e in tune.main(DRY + tokens)["entries"]] == [[1]]


def test_stack_limit_times_with_the_table_being_written(tmp_path, monkeypatch):
    """tune._lookups_from: inside, the library looks configs up in the run's table (for its GPU name), not in
    a table of the user's folder for the same GPU; after, in the usual folders again, with nothing resolved
    from the run's table left behind."""
    from lora_ops import configs
    name = "Pretend GPU 9001"
    table = dict(gpu=name, entries=[dict(kind="stack_pad", features=8, in_features=8, rows=4, pad=64)])
    users = dict(gpu=name, entries=[dict(kind="stack_pad", features=8, in_features=8, rows=4, pad=128)])
    monkeypatch.setenv(configs.TUNED_DIR_ENV, str(tmp_path))
    configs.table_path(name, tmp_path).write_text(json.dumps(users))
    configs.reset()
    try:
        with tune._lookups_from(table, name):
            assert configs.load_table(name) == table
        assert configs.load_table(name) == users and configs.table_dirs() == [tmp_path, configs.TUNED_DIR]
    finally:
        monkeypatch.delenv(configs.TUNED_DIR_ENV)
        configs.reset()
    assert configs.load_table(name) is None


def test_the_user_folder_comes_first_and_takes_the_tuners_table(tmp_path, monkeypatch):
    """$LORA_OPS_TUNED_DIR: its tables are looked up before the package's (an installed package's folder may
    not be writable), and the tuner writes there by default."""
    from lora_ops import configs
    monkeypatch.setenv(configs.TUNED_DIR_ENV, str(tmp_path / "mine") + os.pathsep + str(tmp_path / "team"))
    assert configs.table_dirs() == [tmp_path / "mine", tmp_path / "team", configs.TUNED_DIR]
    assert tune._default_out("NVIDIA H200") == tmp_path / "mine" / "NVIDIA_H200.json"
    written = tune.main(DRY + ["--tokens", "1", "--kinds", "pair"])      # (a dry run's GPU is "dry-run")
    assert json.loads((tmp_path / "mine" / "dry_run.json").read_text()) == written
    (tmp_path / "team").mkdir()
    theirs = json.loads(configs.table_path("NVIDIA H200").read_text())
    ours = dict(theirs, entries=theirs["entries"][:1])
    configs.table_path("NVIDIA H200", tmp_path / "team").write_text(json.dumps(ours))
    configs.reset()
    try:
        assert configs.load_table("NVIDIA H200") == ours
        monkeypatch.delenv(configs.TUNED_DIR_ENV)
        configs.reset()
        assert configs.load_table("NVIDIA H200") == theirs
    finally:
        configs.reset()


def test_the_tuner_refuses_to_write_a_table_the_library_would_refuse(tmp_path):
    """tune._table checks what it is about to write (configs.check_table), as the library checks it on load."""
    import argparse
    args = argparse.Namespace(dtype="bf16", slots=4, merge=False, dry_run=True)
    bad = dict(kind="expand", features=6144, slices=3, rank=16, tokens=64,
               config=heuristics.ExpandConfig(32, 256, 8, 8, 2)._asdict())
    with pytest.raises(ValueError, match=r"out.json: entry 0 .*block_r must be a power of two >= 16 .*got 8"):
        tune._table(args, str(tmp_path / "out.json"), "Pretend GPU", [bad], 0, 0)
    good = dict(bad, config=heuristics.ExpandConfig(32, 256, 16, 8, 2)._asdict())
    assert tune._table(args, str(tmp_path / "out.json"), "Pretend GPU", [good], 0, 0)["entries"] == [good]


def test_a_table_tuned_on_a_gpu_records_its_kind(tmp_path, monkeypatch):
    """What configs.load_table matches a GPU without a table of its own against; a dry run (no GPU) records
    none, so its table serves no other GPU."""
    import argparse
    from lora_ops import configs
    monkeypatch.setattr(configs, "gpu_kind", lambda index=None: dict(capability=[9, 0], multiprocessors=132))
    entry = dict(kind="expand", features=6144, slices=3, rank=16, tokens=64,
                 config=heuristics.ExpandConfig(32, 256, 16, 8, 2)._asdict())
    for dry_run, kind in ((False, {"capability": [9, 0], "multiprocessors": 132}), (True, {})):
        args = argparse.Namespace(dtype="bf16", slots=4, merge=False, dry_run=dry_run)
        table = tune._table(args, str(tmp_path / "out.json"), "Pretend GPU", [entry], 0, 0)
        assert {k: table[k] for k in ("capability", "multiprocessors") if k in table} == kind


def test_merge_into_a_gpus_own_path_starts_from_the_table_of_its_kind(tmp_path, monkeypatch, pretend_gpu_tables):
    """--merge where this GPU has no table of its own (the default --out): the run's entries go over the table it
    took from its kind, so tuning a few shapes keeps that table's entries for the rest. Elsewhere, or without
    --merge, the run's entries alone."""
    import argparse
    from lora_ops import configs
    monkeypatch.setattr(configs, "gpu_kind", lambda index=None: dict(capability=[9, 0], multiprocessors=132))

    def entry(rank):
        return dict(kind="expand", features=6144, model="llama3-8b", layer="qkv", slices=3, rank=rank, tokens=64,
                    config=heuristics.ExpandConfig(32, 256, 16, 8, 2)._asdict())
    sibling = dict(gpu="Tuned GPU", capability=[9, 0], multiprocessors=132, date="2026-12-04", entries=[entry(16)])
    pretend_gpu_tables({"Tuned_GPU": sibling}, ("Pretend GPU", (9, 0), 132))
    own = str(configs.table_path("Pretend GPU"))
    merged = tune._table(argparse.Namespace(dtype="bf16", slots=4, merge=True, dry_run=False), own,
                         "Pretend GPU", [entry(32)], 0, 0)
    assert merged["entries"] == [entry(16), entry(32)] and merged["gpu"] == "Pretend GPU"
    assert merged["merged_from"] == [dict(gpu="Tuned GPU", date="2026-12-04", torch=None, triton=None,
                                          seconds=None)]
    elsewhere = tune._table(argparse.Namespace(dtype="bf16", slots=4, merge=True, dry_run=False),
                            str(tmp_path / "other.json"), "Pretend GPU", [entry(32)], 0, 0)
    fresh = tune._table(argparse.Namespace(dtype="bf16", slots=4, merge=False, dry_run=False), own,
                        "Pretend GPU", [entry(32)], 0, 0)
    assert elsewhere["entries"] == fresh["entries"] == [entry(32)]


def test_dry_run_from_a_shell_without_the_interpreter_set(tmp_path):
    """``python -m lora_ops.tune --dry-run`` from a plain shell: the tuner sets TRITON_INTERPRET itself before
    the kernels are imported (every candidate once raised on the CPU tensors, then a traceback)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "table.json"
    run = subprocess.run([sys.executable, "-m", "lora_ops.tune", *DRY, "--tokens", "1", "--kinds", "pair",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert {e["kind"] for e in json.load(open(out))["entries"]} == {"shrink", "expand", "fused"}


def test_a_shape_where_no_candidate_runs_is_skipped_with_a_line(tmp_path, monkeypatch, capsys):
    """Every candidate raising or failing its check: the shape is skipped and named, not a traceback."""
    monkeypatch.setattr(tuning, "time_config", lambda *a, **k: None)
    table = tune.main(DRY + ["--tokens", "1", "--kinds", "pair", "--out", str(tmp_path / "t.json")])
    assert table["entries"] == []
    assert "no shrink + expand pair ran for" in capsys.readouterr().err


def test_dry_run_defaults_to_the_tiny_model():
    """--dry-run kept llama3-8b's shapes by default: minutes a shape on the interpreter."""
    assert tune.parse_args(["--dry-run"]).model == ["tiny"]
    assert tune.parse_args([]).model == ["llama3-8b"]
    assert tune.parse_args(["--dry-run", "--model", "phi4-mini"]).model == ["phi4-mini"]


def test_dry_run_without_out_leaves_the_package_tables_alone(monkeypatch, capsys):
    """A dry run's table (interpreter timings) went into the package's tuned folder, beside the tables the
    library looks up; without --out or $LORA_OPS_TUNED_DIR it goes to a new temporary folder now."""
    monkeypatch.delenv("LORA_OPS_TUNED_DIR", raising=False)
    before = sorted(p.name for p in configs.TUNED_DIR.iterdir())
    table = tune.main(DRY + ["--tokens", "1", "--kinds", "stacked"])
    assert table["entries"] and sorted(p.name for p in configs.TUNED_DIR.iterdir()) == before
    written = re.search(r"wrote \d+ entries to (\S+)$", capsys.readouterr().out, re.M).group(1)
    assert "lora_ops_dry_run_" in written and json.load(open(written))["entries"] == table["entries"]


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "argument --ranks: expected an integer >= 1, got 0"),
    (["--tokens", "0"], "argument --tokens: expected an integer >= 1, got 0"),
    (["--slots", "0"], "argument --slots: expected an integer >= 1, got 0"),
    (["--max-candidates", "-1"], "argument --max-candidates: expected an integer >= 1, got -1"),
    (["--layers", "gateup"], r"--layers: \['gateup'\] not among tiny's layers \(down, qkv\)"),
], ids=["ranks", "tokens", "slots", "max_candidates", "layers"])
def test_bad_arguments_are_refused_naming_them(argv, message, capsys):
    """(0 divided by zero deep in a run, -1 cut the candidate lists silently, a layer name that selects nothing
    wrote an empty table over the GPU's own.)"""
    with pytest.raises(SystemExit):
        tune.parse_args(["--dry-run", *argv])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("where", ["under_a_file", "a_folder"])
def test_an_out_path_that_cannot_be_written_is_refused_before_tuning(tmp_path, monkeypatch, where):
    """An --out the table cannot be written to was found after every shape was tuned (os.makedirs' traceback,
    the run's results lost): refused first, naming --out."""
    (tmp_path / "afile").write_text("")
    out = str(tmp_path / "afile" / "t.json") if where == "under_a_file" else str(tmp_path)
    monkeypatch.setattr(tune, "_shape_jobs", lambda *a: pytest.fail("tuned before --out was checked"))
    with pytest.raises(SystemExit, match=f"^lora_ops.tune: --out {re.escape(repr(out))}: cannot write the table"):
        tune.main(DRY + ["--tokens", "1", "--out", out])


def test_dry_run_after_triton_was_imported_without_the_interpreter_exits_naming_it():
    """Triton imported before the tuner could set TRITON_INTERPRET (by the caller, or torch.compile's imports): its
    helpers are built for the GPU compiler, every candidate's check failed and the table left the kernels out,
    silently. An exit naming the flag instead."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import triton\nfrom lora_ops import tune\ntune.main({DRY + ['--tokens', '1', '--kinds', 'pair']!r})\n"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Triton or lora_ops' kernels were imported without Triton's interpreter; set TRITON_INTERPRET=1" in (
        run.stderr)
