"""Tables, geometric-mean summaries and files (JSON, markdown, PNG) from the benchmark's row records.

A row record is a plain dict (see bench_lora.new_record); times are in µs, None when not measured.
"""
import json
import math
import os
import re
import subprocess

IMPLS = ("ours", "vllm", "sglang")
PEERS = ("vllm", "sglang")
# Our op with one config choice changed (bench_lora.VARIANTS); columns and summaries appear when timed.
VARIANTS = ("heuristic", "autotune", "two_launch", "one_launch", "overlap", "in_order", "fast_bf16", "stacked")
# Derived from the timed columns (bench_lora): stack_a, what LoRALinear(stack_a=True) runs at the row.
DERIVED = ("stack_a",)

# Token-count bins of the summaries: (label, predicate on M).
BASE_BINS = (("M<=64", lambda M: M <= 64), ("M 256-1024", lambda M: 256 <= M <= 1024),
             ("M>=4096", lambda M: M >= 4096))
FLOOR_BIN = ("M>=1024", lambda M: M >= 1024)


def ratio(a, b):
    return a / b if a is not None and b is not None and b > 0 else None


def git_revision(repo):
    """The checkout's short commit, "+dirty" where tracked files changed; None without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) if rev else None
    except Exception:
        return None


def geomean(values):
    """The geometric mean of the positive values (None where there are none); see left_out."""
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


LEFT_OUT = " left out"   # a bin's key + this: how many of its rows a mean left out (non-positive ratios)


def left_out(values):
    """How many of ``values`` geomean leaves out for being zero or negative (a paired delta within the noise,
    where a variant's time less the base layer's is a difference of two timings)."""
    return sum(1 for v in values if v is not None and v <= 0)


def bound_us(row):
    """The larger of the bytes floor and the MMA floor: no kernel of the delta runs faster."""
    floors = [row.get(k) for k in ("floor_us", "mma_floor_us") if row.get(k) is not None]
    return max(floors) if floors else None


def best_peer_us(row):
    times = [row.get(f"{p}_us") for p in PEERS if row.get(f"{p}_us") is not None]
    return min(times) if times else None


def layer_label(row, several_models):
    return f"{row['model']}:{row['layer']}" if several_models else row["layer"]


def _several_models(rows):
    return len({r["model"] for r in rows}) > 1


def _fmt(v, digits=1):
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:.{digits}f}"


def _peer_time(row, name):
    t = row.get(f"{name}_us")
    if t is None:
        return ""
    return _fmt(t) + ("" if row.get(f"{name}_ok", True) else "!")


def _err(row, name):
    e = row.get(f"{name}_err")
    return "" if e is None else f"{e:.1e}"


def ok_label(row):
    if row.get("status") in ("skipped", "error"):
        return row["status"]
    return "ok" if row.get("ok") else "FAIL"


# --- the tables


def _columns(rows, wide):
    """(header, cell function) pairs; columns no row fills are dropped."""
    several = _several_models(rows)
    cols = [
        ("layer", lambda r: layer_label(r, several)),
        ("rank", lambda r: r["rank"]),
        ("M", lambda r: str(r["M"])),
        ("base", lambda r: _fmt(r.get("base_us"))),
        ("floor", lambda r: _fmt(r.get("floor_us"))),
        ("mma floor", lambda r: _fmt(r.get("mma_floor_us"))),
        ("ours", lambda r: _fmt(r.get("ours_us"))),
        ("ours/base", lambda r: _fmt(ratio(r.get("ours_us"), r.get("base_us")), 2)),
        ("ours/floor", lambda r: _fmt(ratio(r.get("ours_us"), r.get("floor_us")), 2)),
        ("alone-sum", lambda r: _fmt(r.get("alone_us"))),
        ("ours/alone", lambda r: _fmt(ratio(r.get("ours_us"), r.get("alone_us")), 2)),
        *[(v, lambda r, v=v: _peer_time(r, v)) for v in VARIANTS + DERIVED],
        ("vllm", lambda r: _peer_time(r, "vllm")),
        ("sglang", lambda r: _peer_time(r, "sglang")),
    ]
    if wide:
        cols += [("vllm/base", lambda r: _fmt(ratio(r.get("vllm_us"), r.get("base_us")), 2)),
                 ("sglang/base", lambda r: _fmt(ratio(r.get("sglang_us"), r.get("base_us")), 2))]
    cols.append(("ours eager", lambda r: _fmt(r.get("ours_eager_us"), 0)))
    if wide:
        cols += [("vllm eager", lambda r: _fmt(r.get("vllm_eager_us"), 0)),
                 ("sglang eager", lambda r: _fmt(r.get("sglang_eager_us"), 0))]
    cols.append(("err", lambda r: _err(r, "ours")))
    if wide:
        cols += [("vllm err", lambda r: _err(r, "vllm")), ("sglang err", lambda r: _err(r, "sglang")),
                 ("rounding", lambda r: "" if r.get("round_err") is None else f"{r['round_err']:.1e}")]
    cols.append(("ok", ok_label))
    always = {"layer", "rank", "M", "ok"}
    return [(h, f) for h, f in cols if h in always or any(f(r) for r in rows)]


def text_table(rows):
    cols = _columns(rows, wide=False)
    cells = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows):
    cols = _columns(rows, wide=True)
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


# --- the summaries


def _groups(rows):
    """'all' and, when the rows hold several, each (model, rank) group."""
    keys = []
    for r in rows:
        k = (r["model"], r["rank"])
        if k not in keys:
            keys.append(k)
    groups = [("all", rows)]
    if len(keys) > 1:
        several = _several_models(rows)
        for model, rank in keys:
            name = f"{model} r{rank}" if several else f"r{rank}"
            groups.append((name, [r for r in rows if (r["model"], r["rank"]) == (model, rank)]))
    return groups


def _bin_means(rows, numerator, denominator):
    means = {}
    for label, keep in BASE_BINS:
        ratios = [ratio(numerator(r), denominator(r)) for r in rows if keep(r["M"])]
        means[label] = geomean(ratios)
        dropped = left_out(ratios)
        if dropped:
            means[label + LEFT_OUT] = dropped
    return means


def summarise(rows):
    """Geometric means per group: X/base per token bin, X/floor at M >= 1024, ours/alone-sum per bin
    (mixed grid), the bound (the larger of the bytes and MMA floors: what no kernel beats) over base, and
    how many rows ours is slower than a peer."""
    timed = [r for r in rows if r.get("ours_us") is not None]
    out = {}
    for name, group in _groups(timed):
        g = {}
        for impl in IMPLS + VARIANTS + DERIVED + ("best_peer", "bound"):
            t = {"best_peer": best_peer_us, "bound": bound_us}.get(impl, lambda r, i=impl: r.get(f"{i}_us"))
            per_bin = _bin_means(group, t, lambda r: r.get("base_us"))
            per_bin[f"floor {FLOOR_BIN[0]}"] = geomean(ratio(t(r), r.get("floor_us"))
                                                       for r in group if FLOOR_BIN[1](r["M"]))
            if any(v is not None for k, v in per_bin.items() if not k.endswith(LEFT_OUT)):
                g[f"{impl}/base"] = per_bin
        alone = _bin_means(group, lambda r: r.get("ours_us"), lambda r: r.get("alone_us"))
        if any(v is not None for k, v in alone.items() if not k.endswith(LEFT_OUT)):
            alone["all M"] = geomean(ratio(r.get("ours_us"), r.get("alone_us")) for r in group)
            g["ours/alone-sum"] = alone
        compared = [r for r in group if best_peer_us(r) is not None]
        slower = {"rows": sum(1 for r in compared if r["ours_us"] > best_peer_us(r)), "of": len(compared)}
        for p in PEERS:
            if any(r.get(f"{p}_us") for r in compared):
                slower[f"than {p}"] = sum(1 for r in compared if r.get(f"{p}_us") and r["ours_us"] > r[f"{p}_us"])
        g["ours slower than a peer"] = slower
        layered = [r for r in compared if r.get("stack_a_us") is not None]
        if layered:   # the path LoRALinear(stack_a=True) takes (bench_lora's stacked variant)
            g["stack_a slower than a peer"] = {"rows": sum(1 for r in layered if r["stack_a_us"] > best_peer_us(r)),
                                               "of": len(layered)}
        out[name] = g
    return out


def summary_text(summary):
    """The summary as aligned text; empty when no row was timed."""
    if not any(len(g) > 1 or g["ours slower than a peer"]["of"] for g in summary.values()):
        return ""
    head = [label for label, _ in BASE_BINS] + [f"floor {FLOOR_BIN[0]}"]
    lines = ["geometric means (time ratios; 'X/base' bins: X/base, last column: X/floor)",
             f"{'':<28}" + "".join(f"{h:>14}" for h in head)]
    starred = False
    for group, g in summary.items():
        for key, vals in g.items():
            if key.endswith("slower than a peer"):
                continue
            if key == "ours/alone-sum":
                cells = [vals.get(h) for h in head[:-1]] + [vals.get("all M")]
                tail = "   (last column: all M)"
            else:
                cells, tail = [vals.get(h) for h in head], ""
            marks = ["*" if vals.get(h + LEFT_OUT) else "" for h in head[:len(cells)]]
            starred = starred or any(marks)
            lines.append(f"{group + ' ' + key:<28}" + "".join(f"{_fmt(v, 2) + m:>14}" for v, m in zip(cells, marks))
                         + tail)
        slow = g["ours slower than a peer"]
        if slow["of"]:
            per_peer = ", ".join(f"{k} {v}" for k, v in slow.items() if k.startswith("than "))
            lines.append(f"{group + ' ours slower than a peer':<28}{slow['rows']:>14} of {slow['of']} rows "
                         f"({per_peer})")
        if "stack_a slower than a peer" in g:
            slow = g["stack_a slower than a peer"]
            lines.append(f"{group + ' stack_a slower than a peer':<28}{slow['rows']:>14} of {slow['of']} rows")
    if starred:
        lines.append("*: rows whose ratio was zero or negative (a paired delta within the noise) left out of that "
                     "mean (the JSON's summary counts them under '<bin>" + LEFT_OUT + "')")
    return "\n".join(lines)


def notes_text(rows):
    lines = []
    for r in rows:
        if r.get("status") == "skipped":  # counted once in the run's notes
            continue
        for n in r.get("notes", []):
            lines.append(f"- {r['model']} {r['layer']} rank {r['rank']} M={r['M']}: {n}")
    return "\n".join(lines)


# --- files


def gpu_tag(name):
    """The short GPU name used in file names: 'h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100 80GB HBM3',
    'a100' for 'NVIDIA A100-SXM4-80GB' (the first word with a digit, up to a dash), else 'gpu'."""
    words = [w.split("-")[0] for w in name.split() if re.search(r"\d", w)]
    return re.sub(r"[^a-z0-9]+", "", words[0].lower()) if words else "gpu"


def write_run_files(out_dir, kind, result, text):
    """``{kind}-{gpu tag}-{date}.json`` (``result``) and ``.md`` (``text``) in ``out_dir``; returns the stem.
    ``result`` holds "gpu" (a name, or "cpu") and "date" ("YYYY-MM-DD ...")."""
    os.makedirs(out_dir, exist_ok=True)
    tag = "cpu" if result["gpu"] == "cpu" else gpu_tag(result["gpu"])
    stem = os.path.join(out_dir, f"{kind}-{tag}-{result['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    return stem


def write_json(path, env, rows, summary):
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows, "summary": summary}, f, indent=1, default=str)


def write_markdown(path, env, rows, summary, title):
    lines = [f"# {title}", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if k in ENV_HEADLINE), "",
             f"Timing: {env.get('timing', '')}.", "",
             "Columns in µs; `!` after a peer's time: its own correctness check failed on that row.", "",
             markdown_table(rows)]
    text = summary_text(summary)
    if text:
        lines += ["", "```", text, "```"]
    notes = notes_text(rows)
    if notes:
        lines += ["", "## Notes", "", notes]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


ENV_HEADLINE = ("date", "gpu", "torch", "triton", "cuda", "dtype", "copy_GBps", "matmul_TFLOPs", "tuned_table", "git")

# (row field, legend, line style, colour): fixed colours, so a series looks the same in every panel.
PLOT_SERIES = (("ours_us", "ours", "-o", "tab:blue"), ("vllm_us", "vllm", "-s", "tab:orange"),
               ("sglang_us", "sglang", "-^", "tab:green"), ("alone_us", "alone-sum", "-x", "tab:purple"),
               ("base_us", "base layer", "--", "black"), ("floor_us", "floor", ":", "tab:red"))


def write_plot(path, rows, title):
    """Time vs M, log-log, one panel per (model, layer, rank)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for r in rows:
        key = (r["model"], r["layer"], r["rank"])
        if key not in panels:
            panels.append(key)
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        mine = sorted((r for r in rows if (r["model"], r["layer"], r["rank"]) == key), key=lambda r: r["M"])
        for field, label, style, colour in PLOT_SERIES:
            pts = [(r["M"], r[field]) for r in mine if r.get(field)]
            if pts:
                ax.plot(*zip(*pts), style, color=colour, label=label, markersize=4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]}, rank {key[2]}", fontsize=9)
        ax.set_xlabel("M tokens", fontsize=8)
        ax.set_ylabel("µs", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out_dir, stem, env, rows, summary, title, plot=True):
    """JSON and markdown always; the PNG when asked (fails soft: returns a note)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, stem + ext) for ext in (".json", ".md")]
    write_json(paths[0], env, rows, summary)
    write_markdown(paths[1], env, rows, summary, title)
    notes = []
    timed = [r for r in rows if r.get("ours_us") is not None]
    if plot and timed:
        png = os.path.join(out_dir, stem + ".png")
        try:
            write_plot(png, timed, title)
            paths.append(png)
        except Exception as e:
            notes.append(f"plot not written: {type(e).__name__}: {e}")
    return paths, notes
