"""Kernel configs: heuristic defaults (no files), tuned tables per GPU shipped in the package, and an
opt-in runtime autotune.

add_lora_ runs either one launch (lora_ops.kernels.fused: small batches) or two (shrink, then expand);
:func:`fused_config` decides, by the same resolution, and returns None for two launches.

Resolution order for a (kernel, shapes, token bucket) key: a config autotuned in this process, else the
nearest entry of the tuned table for this GPU (``tuned/<gpu name>.json``, written by
``python -m lora_ops.tune``; a GPU without one takes a table tuned on a GPU of the same compute capability
and multiprocessor count: :func:`load_table`), else the heuristic. Tables are tuned in 16-bit dtypes;
float32 inputs use the heuristic. Each key is resolved once per process and remembered (keyed by shapes, never by data),
so the steady-state cost is one dict lookup. Autotune runs only outside CUDA-graph capture; during a
capture the table or heuristic config is used and not remembered, so a later warm-up can still tune.
"""
import functools
import json
import math
import os
import pathlib
import re

import torch

from lora_ops.configs import heuristics
from lora_ops.configs.heuristics import ExpandConfig, FusedConfig, ShrinkConfig, token_bucket

__all__ = ["ShrinkConfig", "ExpandConfig", "FusedConfig", "shrink_config", "expand_config", "fused_config",
           "stacked_config", "store_config", "stack_pad_rows", "stack_pad_at", "stack_limit_tokens",
           "enable_autotune", "force_path", "use_tuned_tables", "table_dirs", "table_path", "table_source",
           "gpu_kind", "token_bucket", "reset", "generation"]

PATHS = ("fused", "split")

TUNED_DIR = pathlib.Path(__file__).with_name("tuned")   # the tables shipped in the package
# Folders of the user's own tables (os.pathsep-separated), looked up before the package's and written by the
# tuner: an installed package's folder may not be writable.
TUNED_DIR_ENV = "LORA_OPS_TUNED_DIR"
_resolved = {}
_autotune = {"on": False}
_forced = {"path": None}
_tables = {"on": True}
_generation = [0]


def reset():
    """Forget every resolved config and loaded table (they are resolved and read again on next use), e.g.
    after a table changed or ``$LORA_OPS_TUNED_DIR`` did. Bumps :func:`generation`, which lora_ops.plan keys
    on: plans hold configs."""
    _resolved.clear()
    load_table.cache_clear()
    _generation[0] += 1


def generation():
    """How many times the resolved configs were forgotten (:func:`reset`)."""
    return _generation[0]


def enable_autotune(on=True):
    """Opt in (or out) of runtime autotuning: the first call of each new shape bucket on a GPU times the
    candidate configs (see lora_ops.configs.tuning) and keeps the fastest. Warm up before capturing."""
    _autotune["on"] = bool(on)
    reset()


def force_path(path):
    """Make add_lora_ take one path for every shape: "fused" (one launch), "split" (shrink + expand),
    or None (the default: chosen per shape). For tests and benchmarks."""
    if path not in PATHS + (None,):
        raise ValueError(f"path: expected one of {PATHS} or None, got {path!r}")
    _forced["path"] = path
    reset()


def use_tuned_tables(on=True):
    """Look up the shipped tuned tables (default) or use the heuristic alone (benchmarks compare both)."""
    _tables["on"] = bool(on)
    reset()


def table_dirs():
    """The folders tuned tables are looked up in, in order: those in ``$LORA_OPS_TUNED_DIR``, then the
    package's. The tuner writes into the first."""
    extra = os.environ.get(TUNED_DIR_ENV, "")
    return [pathlib.Path(p) for p in extra.split(os.pathsep) if p] + [TUNED_DIR]


def table_path(gpu_name, directory=None):
    """The file of ``gpu_name``'s table in ``directory`` (default: the package's folder)."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", gpu_name).strip("_") + ".json"
    return pathlib.Path(TUNED_DIR if directory is None else directory) / name


@functools.lru_cache(maxsize=None)
def _gpu(index):
    """(name, compute capability, multiprocessor count) of CUDA device ``index``: what picks its table."""
    props = torch.cuda.get_device_properties(index)
    return props.name, (props.major, props.minor), props.multi_processor_count


def gpu_kind(index=None):
    """{"capability": [major, minor], "multiprocessors": n} of a CUDA device (default: the current one), as
    the tuner records it in the tables it writes: a GPU without a table of its own takes one tuned on a GPU
    of this kind (:func:`load_table`)."""
    _, capability, multiprocessors = _gpu(torch.cuda.current_device() if index is None else index)
    return dict(capability=list(capability), multiprocessors=multiprocessors)


def _read_table(path):
    with open(path) as f:
        table = json.load(f)
    check_table(table, path)
    return table


@functools.lru_cache(maxsize=None)
def load_table(gpu_name, capability=None, multiprocessors=None):
    """The tuned table a GPU looks its configs up in, or None (the heuristic serves): its own (the first of
    :func:`table_dirs` that holds one), else, given its compute capability and multiprocessor count, the first
    table (by folder, then file name) tuned on a GPU with both equal. Kernel configs follow the SMs (grids,
    split counts) and their shared memory (stages, tiles), both the same there. Measured: the H200's table on
    an H100 SXM (both sm_90, 132 SMs; 2026-12-05) took add_lora_ to 0.84 of the heuristic's time on the core
    grid and 0.86 at ranks 128-320; one row of 116 lost more than 5%."""
    dirs = table_dirs()
    for directory in dirs:
        path = table_path(gpu_name, directory)
        if path.exists():
            return _read_table(path)
    if capability is None:
        return None
    kind = dict(capability=list(capability), multiprocessors=multiprocessors)
    for directory in dirs:
        for other in sorted(directory.glob("*.json")):
            table = _read_table(other)
            if {k: table.get(k) for k in kind} == kind:
                return table
    return None


def _device_table(device):
    """The tuned table ``device`` (a CUDA device) looks its configs up in, or None."""
    return load_table(*_gpu(device.index if device.index is not None else torch.cuda.current_device()))


def table_source(device=None):
    """Which GPU's tuned table ``device`` (default: the current CUDA device) uses — its own name, or another
    GPU's of the same kind (:func:`load_table`) — or None where the heuristic serves (no table, tables off,
    no CUDA device). For reports: benchmarks record it beside their figures."""
    if not (_tables["on"] and torch.cuda.is_available()):
        return None
    table = _device_table(torch.device("cuda") if device is None else torch.device(device))
    return None if table is None else table.get("gpu")


# What a config's fields must be for the kernels to compile on a GPU: the tile sizes are tl.arange lengths
# (powers of two) and dimensions of tl.dot's operands, which a GPU's tl.dot takes no smaller than 16 (the
# interpreter takes any, so the CPU tests would not notice).
_TILE_FIELDS = ("block_m", "block_n", "block_r", "block_k")
_COUNT_FIELDS = ("split_k", "num_stages", "n_loop", "m_loop")
_WARPS = (1, 2, 4, 8, 16, 32)
_LOOKUP_FIELDS = ("features", "slices", "rank", "tokens")    # log2 distances are taken over them
_STACK_LOOKUP_FIELDS = ("features", "in_features", "rows")    # stack_a's entries match them exactly


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _config_problem(kind, config):
    """What is wrong with the table config ``config`` (a dict) of ``kind``, or None."""
    config_type = _CONFIG_TYPES[kind]
    fields = config_type._fields
    unknown = sorted(set(config) - set(fields))
    if unknown:
        return f"unknown fields {unknown} (a {kind} config has {list(fields)})"
    missing = [f for f in fields if f not in config and f not in config_type._field_defaults]
    if missing:
        return f"missing fields {missing}"
    for name, v in config.items():
        if name == "planes_in_turn":
            if not isinstance(v, bool):
                return f"planes_in_turn must be true or false, got {v!r}"
        elif not _is_int(v):
            return f"{name} must be an int, got {v!r}"
        elif name in _TILE_FIELDS and (v < 16 or v & (v - 1)):
            return f"{name} must be a power of two >= 16 (a tile of tl.dot on a GPU), got {v}"
        elif name == "num_warps" and v not in _WARPS:
            return f"num_warps must be one of {_WARPS}, got {v}"
        elif name == "slice_group" and (v < 1 or v & (v - 1)):
            return f"slice_group must be a power of two >= 1, got {v}"
        elif name in _COUNT_FIELDS and v < 1:
            return f"{name} must be >= 1, got {v}"
    return None


def _entry_problem(entry):
    if not isinstance(entry, dict) or "kind" not in entry:
        return "expected an object with a 'kind'"
    kind = entry["kind"]
    if kind not in _CONFIG_TYPES and kind not in STACK_KINDS:
        return f"unknown kind {kind!r} (expected one of {sorted((*_CONFIG_TYPES, *STACK_KINDS))})"
    for name in _STACK_LOOKUP_FIELDS if kind in STACK_KINDS else _LOOKUP_FIELDS:   # what lookups compare
        if not (_is_int(entry.get(name)) and entry[name] >= 1):
            return f"{name} must be an int >= 1, got {entry.get(name)!r}"
    if kind in STACK_KINDS:
        if kind == "stack_pad" and not (_is_int(entry.get("pad")) and entry["pad"] >= 0):
            return f"pad must be an int >= 0, got {entry.get('pad')!r}"
        if kind == "stack_pad" and "bucket_pads" in entry:
            pads, buckets = entry["bucket_pads"], entry.get("buckets")
            if not (isinstance(pads, list) and isinstance(buckets, list) and len(pads) == len(buckets) > 0
                    and all(_is_int(p) and 0 <= p <= entry["pad"] for p in pads)
                    and all(_is_int(b) for b in buckets) and buckets == sorted(buckets)):
                return ("bucket_pads must be a list of ints in [0, pad], one per entry of buckets (ascending ints), "
                        f"got {pads!r} for buckets {buckets!r}")
        if kind == "stack_limit" and not (_is_int(entry.get("max_tokens")) and entry.get("buckets")):
            return "max_tokens must be an int and buckets a non-empty list"
        return None
    config = entry.get("config")
    if config is None:
        return None if kind == "fused" else f"an entry of kind {kind!r} needs a config"
    if not isinstance(config, dict):
        return f"config must be an object or null, got {config!r}"
    return _config_problem(kind, config)


def check_table(table, where):
    """Raise ValueError naming ``where`` (the file) and the first bad entry of a tuned table: one whose configs
    would fail to compile on a GPU (or fail to build), or whose lookup fields are not positive ints. A
    table is written by ``python -m lora_ops.tune``, which checks it too, but it is a file a user can edit."""
    if not isinstance(table, dict) or not isinstance(table.get("entries"), list):
        raise ValueError(f"{where}: a tuned table is an object with a list of 'entries'")
    capability, multiprocessors = table.get("capability"), table.get("multiprocessors")
    if capability is not None and not (isinstance(capability, list) and len(capability) == 2
                                       and all(_is_int(v) and v >= 0 for v in capability)):
        raise ValueError(f"{where}: 'capability' must be [major, minor] (two ints), got {capability!r}")
    if multiprocessors is not None and not (_is_int(multiprocessors) and multiprocessors >= 1):
        raise ValueError(f"{where}: 'multiprocessors' must be an int >= 1, got {multiprocessors!r}")
    for i, entry in enumerate(table["entries"]):
        problem = _entry_problem(entry)
        if problem:
            what = ", ".join(f"{k} {entry[k]}" for k in ("kind", *_LOOKUP_FIELDS, "in_features", "rows")
                             if isinstance(entry, dict) and k in entry)
            raise ValueError(f"{where}: entry {i} ({what}): {problem}")


# The expand's other modes, each with table entries of its own kind: the stacked path's
# (launch.lora_linear_stacked) and the store mode of lora_linear's write-first path. Same kernel, same
# ExpandConfig; where a mode has no entry, add_lora_'s expand config serves it.
EXPAND_MODES = ("stacked", "store")
EXPAND_KINDS = ("expand", *EXPAND_MODES)
STACK_KINDS = ("stack_pad", "stack_limit")   # stack_a's entries: a pad and a token limit, no config
_CONFIG_TYPES = {"shrink": ShrinkConfig, "fused": FusedConfig, **dict.fromkeys(EXPAND_KINDS, ExpandConfig)}

# Kinds whose entries serve only their own key (layer shape, rank, token bucket): the store mode is tuned only
# where lora_linear writes first, and its entry holds a config of its own only where it beat add_lora_'s
# expand config there, so another key's entry says nothing of this one, whose own expand config (itself
# looked up) serves it instead.
EXACT_KINDS = ("store",)

# A table entry further than this (sum of |log2| ratios of features, rank and token bucket, plus 0.5 for
# another slice count) is not "near": the heuristic serves instead, so a partial table never hands a
# decode config to a prefill shape.
MAX_DISTANCE = 2.0


def _nearest(entries, kind, features, num_slices, max_rank, bucket, out_features=None):
    """The table entry nearest in log2 distance over (features, rank, tokens), if near enough; one-launch
    entries also weigh the output features."""
    def dist(e):
        d = (abs(math.log2(e["features"] / features)) + abs(math.log2(e["rank"] / max_rank))
             + abs(math.log2(e["tokens"] / bucket)) + (0.5 if e["slices"] != num_slices else 0.0))
        if out_features and e.get("out_features"):
            d += abs(math.log2(e["out_features"] / out_features))
        return d
    cands = [e for e in entries if e["kind"] == kind]
    if kind in EXACT_KINDS:
        cands = [e for e in cands
                 if (e["features"], e["slices"], e["rank"], e["tokens"]) == (features, num_slices, max_rank, bucket)]
    # Ties go to the entry nearer in token count (tiling and split-K follow the tokens), then to the fewer
    # tokens, whatever the table's order: a config tuned for fewer tokens runs more programs when given
    # more; one tuned for more leaves SMs idle when given fewer (H200, 2026-12-03: 1024-token entries at
    # 256 tokens took 1.17-1.47x the heuristic's time at four high-rank shapes).
    def rank_of(e):
        return round(dist(e), 9), abs(math.log2(e["tokens"] / bucket)), e["tokens"]
    best = min(cands, key=rank_of) if cands else None
    return best if best is not None and dist(best) <= MAX_DISTANCE else None


def _heuristic(kind, features, num_slices, max_rank, num_slots, bucket, forced, out_features):
    if kind == "shrink":
        return heuristics.shrink_config(bucket, features, num_slices, max_rank, num_slots, out_features)
    if kind in EXPAND_KINDS:
        return heuristics.expand_config(bucket, features, max_rank, num_slots)
    if forced == "fused" or heuristics.prefers_fused(bucket, features, max_rank):
        return heuristics.fused_config(bucket, features, max_rank)
    return None


def _from_table(kind, device, features, num_slices, max_rank, bucket, out_features, fallback):
    table = _device_table(device)
    entry = table and _nearest(table["entries"], kind, features, num_slices, max_rank, bucket, out_features)
    if entry is None:
        return fallback
    if entry["config"] is None:  # the tuner found two launches faster here
        return None
    cfg = _CONFIG_TYPES[kind](**entry["config"])
    if kind in EXPAND_KINDS and entry["rank"] != max_rank:
        return _expand_at_rank(cfg, entry["rank"], max_rank) or fallback
    if entry["rank"] != max_rank:  # a neighbour's rank block may not suit this rank
        block_r = heuristics.rank_block(max_rank)
        if kind == "shrink":
            # The dot no wider than the entry's (slice_group x block_r): the rank-16 entry's 4 slices a program
            # at rank 32 took a 128-wide dot and 288 KiB of shared memory, past sm_90's 227 (Llama qkv, 4096
            # tokens: a launch failure on the GPU; sm90_codegen).
            cfg = cfg._replace(slice_group=max(1, min(cfg.slice_group, cfg.slice_group * cfg.block_r // block_r)))
        cfg = cfg._replace(block_r=block_r)
    if kind == "shrink":
        cfg = cfg._replace(split_k=max(1, min(cfg.split_k, heuristics.cdiv(features, cfg.block_k))))
    return cfg


def _expand_at_rank(cfg, entry_rank, max_rank):
    """An expand entry tuned at another rank, on the code path it was tuned on (kernels.expand), or None
    where that path does not suit this rank. One rank block at the entry's rank: one block holding this
    rank, while h's tile stays within heuristics.ONE_BLOCK_MAX_H_TILE. The rank loop: the same step,
    where this rank still takes more than one."""
    if cfg.block_r >= entry_rank:
        block_r = heuristics.one_block_rank(max_rank)
        return cfg._replace(block_r=block_r) if cfg.block_m * block_r <= heuristics.ONE_BLOCK_MAX_H_TILE else None
    return cfg if max_rank > cfg.block_r else None


def _resolve(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features=None):
    """(config, whether to remember it)."""
    forced = _forced["path"] if kind == "fused" else None
    if forced == "split":
        return None, True
    fallback = _heuristic(kind, features, num_slices, max_rank, num_slots, bucket, forced, out_features)
    if device.type != "cuda":
        return fallback, True
    if dtype == torch.float32:      # the heuristic, in float32's own tiles (no table or autotune entries)
        return (None if fallback is None else heuristics.float32_tiles(fallback)), True
    cfg, keep = _resolve_half(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features,
                              forced, fallback)
    return (heuristics.float16_tiles(cfg) if dtype == torch.float16 and cfg is not None else cfg), keep


def _resolve_half(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features, forced,
                  fallback):
    """_resolve for bfloat16 and float16 on a GPU: autotune, the table or the heuristic."""
    if _autotune["on"]:
        if torch.cuda.is_current_stream_capturing():
            return fallback, False
        from lora_ops.configs import tuning
        return tuning.autotune(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket,
                               out_features, fused_only=forced == "fused"), True
    # The table's shrink entries are tuned as add_lora_'s pair (out_features: the expand adding the split-K
    # partial sums); the shrink op alone (the backward's dh and h) sums its splits itself: the heuristic.
    if not _tables["on"] or (kind == "shrink" and out_features is None):
        return fallback, True
    if kind in EXPAND_MODES:   # no entry of its own near: add_lora_'s expand config (the same kernel)
        fallback = _config("expand", device, dtype, features, num_slices, max_rank, num_slots, bucket)
    cfg = _from_table(kind, device, features, num_slices, max_rank, bucket, out_features, fallback)
    if forced == "fused" and cfg is None:
        cfg = fallback
    return cfg, True


def _config(kind, device, dtype, features, num_slices, max_rank, num_slots, num_tokens, out_features=None):
    bucket = token_bucket(num_tokens)
    key = (kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features)
    if key in _resolved:
        return _resolved[key]
    cfg, keep = _resolve(kind, device, dtype, features, num_slices, max_rank, num_slots, bucket, out_features)
    if keep:
        _resolved[key] = cfg
    return cfg


def shrink_config(num_tokens, in_features, num_slices, max_rank, num_slots, device=torch.device("cpu"),
                  dtype=torch.bfloat16, out_features=None):
    """The shrink's config. out_features: the width of the expand that adds its split-K partial sums
    (add_lora_: the split count is chosen, and tuned, for the pair); None for the shrink op alone."""
    return _config("shrink", device, dtype, in_features, num_slices, max_rank, num_slots, num_tokens,
                   out_features)


def expand_config(num_tokens, out_features, num_slices, max_rank, num_slots, device=torch.device("cpu"),
                  dtype=torch.bfloat16):
    return _config("expand", device, dtype, out_features, num_slices, max_rank, num_slots, num_tokens)


def fused_config(num_tokens, in_features, out_features, num_slices, max_rank, num_slots,
                 device=torch.device("cpu"), dtype=torch.bfloat16):
    """The one-launch kernel's config, or None where two launches (shrink, expand) serve this shape."""
    return _config("fused", device, dtype, in_features, num_slices, max_rank, num_slots, num_tokens,
                   out_features)


def stacked_config(num_tokens, out_features, num_slices, max_rank, num_slots, in_features,
                   device=torch.device("cpu"), dtype=torch.bfloat16):
    """The expand's config in the stacked path (launch.lora_linear_stacked), tuned there as the whole layer
    (the table's "stacked" entries); without one, add_lora_'s expand config. in_features: the GEMM's K
    (the runtime autotune times the layer)."""
    return _config("stacked", device, dtype, out_features, num_slices, max_rank, num_slots, num_tokens, in_features)


def store_config(num_tokens, out_features, num_slices, max_rank, num_slots, in_features,
                 device=torch.device("cpu"), dtype=torch.bfloat16):
    """The expand's config in its store mode, where lora_linear writes the delta first (launch.writes_first),
    tuned there after add_lora_'s shrink (the table's "store" entries); without one, add_lora_'s expand
    config. in_features: the shrink's K (the runtime autotune times the pair)."""
    return _config("store", device, dtype, out_features, num_slices, max_rank, num_slots, num_tokens, in_features)


def _stack_entry(kind, out_features, in_features, stack_rows, device, dtype):
    """The table's entry of ``kind`` for exactly this layer shape and L·S·R = ``stack_rows`` on this GPU,
    or None (the CPU, float32, no table, tables turned off)."""
    if device.type != "cuda" or dtype == torch.float32 or not _tables["on"]:
        return None
    table = _device_table(device)
    for e in (table or {}).get("entries", ()):
        if e["kind"] == kind and (e["features"], e["in_features"], e["rows"]) == (out_features, in_features,
                                                                                   stack_rows):
            return e
    return None


def stack_pad_rows(out_features, in_features, stack_rows, device=torch.device("cpu"), dtype=torch.bfloat16):
    """Zero rows to put after stack_a's [W; A] (lora_ops.layers; L·S·R = ``stack_rows``): the table's
    "stack_pad" entry for exactly this shape on this GPU (the most its buckets take, of those the stacked path
    serves), else 0. cuBLAS picks its kernel by shape, and some
    row counts get a slower one (H200: Llama o, 4096 + 256 rows at 64 tokens, 16.3 µs; + 384 rows, 13.0).
    Tuned by ``python -m lora_ops.tune --kinds stack_pad``."""
    e = _stack_entry("stack_pad", out_features, in_features, stack_rows, device, dtype)
    return 0 if e is None else _rows_held(e, out_features, in_features, stack_rows, device, dtype)


def _rows_held(entry, out_features, in_features, stack_rows, device, dtype):
    """The padding rows the stack holds for its "stack_pad" ``entry``: the most its buckets take, of those the
    stacked path serves. Where the "stack_limit" entry lost past a count (:func:`stack_limit_tokens`: limit
    under the buckets measured), the buckets above it need no rows; where it won to its last bucket,
    layers.stacked_token_limit's rule decides beyond, and every bucket counts."""
    limit = stack_limit_tokens(out_features, in_features, stack_rows, device, dtype)
    if not entry.get("bucket_pads") or limit is None or limit[0] >= limit[1]:
        return int(entry["pad"])
    served = token_bucket(limit[0])
    return max((p for b, p in zip(entry["buckets"], entry["bucket_pads"]) if b <= served), default=0)


def stack_pad_at(num_tokens, out_features, in_features, stack_rows, device=torch.device("cpu"),
                 dtype=torch.bfloat16):
    """The zero rows of the stack's padding that the GEMM over [W; A; pad] takes at ``num_tokens`` tokens
    (precision.stacked_gemm multiplies a prefix of the stack), or None without a table entry (the whole
    stack): the entry's pad for the timed token bucket at or below this count's (the first bucket's pad where
    none is), at most :func:`stack_pad_rows`. cuBLAS's kernel choice for a row count changes with the token
    count (DESIGN §4, "A pad per token bucket"), so the tuner keeps a pad per bucket (``bucket_pads``); an entry
    without them pads every count alike. Resolved once per (bucket, shape) and remembered."""
    key = ("stack_pad_at", token_bucket(num_tokens), out_features, in_features, stack_rows, device, dtype)
    if key not in _resolved:
        e = _stack_entry("stack_pad", out_features, in_features, stack_rows, device, dtype)
        _resolved[key] = None if e is None else min(
            _bucket_pad(e, key[1]), _rows_held(e, out_features, in_features, stack_rows, device, dtype))
    return _resolved[key]


def _bucket_pad(entry, bucket):
    """``entry``'s (a "stack_pad" entry) pad at token bucket ``bucket``: its pad for the last bucket at or below
    it, the first bucket's where none is."""
    pads = entry.get("bucket_pads")
    if not pads:
        return int(entry["pad"])
    below = [p for b, p in zip(entry["buckets"], pads) if b <= bucket]
    return int(below[-1] if below else pads[0])


def stack_limit_tokens(out_features, in_features, stack_rows, device=torch.device("cpu"), dtype=torch.bfloat16):
    """(limit, measured to): the most tokens at which stack_a's stacked path served this layer shape best
    on this GPU, and the largest token bucket measured (the table's "stack_limit" entry for exactly this
    shape: ``python -m lora_ops.tune --kinds stack_limit``); None without one. lora_ops.layers.stacked_token_limit
    combines it with its rule."""
    e = _stack_entry("stack_limit", out_features, in_features, stack_rows, device, dtype)
    return None if e is None else (int(e["max_tokens"]), max(e["buckets"]))
