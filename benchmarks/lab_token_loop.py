"""Lab (session 16): the expand walking several token tiles with its block of B held (kernels.expand M_LOOP).

ncu on the H200 (2026-12-03, `lab-h200-2026-12-03-session16.md`): at 1024 tokens, Llama qkv rank 64, the
stacked path's expand (tuned: 16 x 128 tiles, one tile a program) was bound by L1 / shared memory (74% of
L1's throughput, DRAM 19%): each 16-token tile re-reads its 64 x 128 block of B, more bytes than the tile's
y, and B goes through shared memory on its way to the dot. With m_loop > 1 a program loads its block of B
once for m_loop tiles of its slot. Variants per Llama-3-8B layer, rank and token count:

    base                         F.linear(x, W)
    stacked                      lora_linear_stacked as shipped (the table's stacked config)
    stacked <bm>x<bn>/m<k>       F.linear(x, [W; A]) then the stacked expand with that config (PDL as shipped)
    expand                       add_lora_'s expand alone as shipped (after its shrink, on its h)
    expand <bm>x<bn>/m<k>        the same expand with that config

Layers are timed paired with the base layer (their deltas: medians of per-round differences); the expands
alone by their medians. Every variant's output is checked against the shipped one.

    python benchmarks/lab_token_loop.py out.json              # H200 (BUDGET s, default 150; MS, RANKS)
    DEV=cpu TRITON_INTERPRET=1 python benchmarks/lab_token_loop.py /tmp/x.json    # logic check, tiny
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

import repo_path  # noqa: F401,E402
from lora_ops import configs, launch  # noqa: E402
from lora_ops.configs.heuristics import ExpandConfig  # noqa: E402
from lora_ops.layers import stacked_weight  # noqa: E402
from lab_env import DEV, DTYPE, TINY, ints, lab_rows, problem, run_env  # noqa: E402
from timing import Timer, paired_delta  # noqa: E402

BUDGET = float(os.environ.get("BUDGET", "150"))
TOKENS = ints("MS", "1024,256" if not TINY else "64")
RANKS = ints("RANKS", "64,16")
# (block_m, block_n, m_loop); block_r is the shipped config's, 4 warps, 2 stages, one column block.
CANDIDATES = [(16, 128, 4), (16, 64, 4), (32, 128, 2), (32, 64, 4), (16, 128, 8)] if not TINY else [(16, 16, 2)]


def variant_config(shipped, bm, bn, m_loop):
    return ExpandConfig(bm, bn, shipped.block_r, 4, 2, 1, m_loop)


class Row:
    def __init__(self, layer, rank, M):
        self.p = p = problem(layer, rank, M)
        self.stacked_cfg = configs.stacked_config(M, p.N, p.S, p.R, p.L, p.K, torch.device(DEV), DTYPE)
        self.expand_cfg = configs.expand_config(M, p.N, p.S, p.R, p.L, torch.device(DEV), DTYPE)
        self.sets = {}

    def inputs(self, k):
        if k not in self.sets:
            i = self.p.inputs(k)
            w = self.p.base_inputs(k)[1]
            launches, _, buffers = launch.add_lora_launches(i.y, i.x, i.lora_a, i.lora_b, self.p.scale, self.p.rank,
                                                            self.p.widths, *self.p.meta)
            self.sets[k] = dict(i=i, w=w, ws=stacked_weight(w, i.lora_a), launches=launches, buffers=buffers)
        return self.sets[k]

    def call(self, kind, spec, k):
        """Variant (kind, spec) on input set k: kind "base", "stacked" or "expand"; spec () for the shipped
        config, else (block_m, block_n, m_loop). None where add_lora_ takes its one-launch path."""
        s, p = self.inputs(k), self.p
        i = s["i"]
        if kind == "base":
            return lambda: F.linear(i.x, s["w"])
        if kind == "stacked" and not spec:
            op = torch.ops.lora_ops.lora_linear_stacked
            args = (i.x, s["ws"], None, i.lora_b, p.scale, p.rank, p.widths, *p.meta)
            return lambda: op(*args)
        if kind == "stacked":
            cfg = variant_config(self.stacked_cfg, *spec)

            def run():
                out = F.linear(i.x, s["ws"])
                launch.launch_expand_stacked(out, p.N, i.lora_b, p.widths, p.rank, p.scale, *p.meta, cfg,
                                             pdl=launch.stacked_uses_pdl(i.x))
                return out
            return run
        if len(s["launches"]) != 2:
            return None
        shrink, expand = s["launches"]
        shrink()   # h for the expand-alone timings
        if not spec:
            return lambda: (expand(), s["buffers"])
        cfg = variant_config(self.expand_cfg, *spec)
        h = s["buffers"][0]
        return lambda: (launch.launch_expand(i.y, h, i.lora_b, p.widths, p.rank, *p.meta, cfg), s["buffers"])

    def variants(self):
        """{label: (kind, spec)}; add_lora_'s expands only where it runs two launches."""
        specs = [c for c in CANDIDATES if c[1] <= max(self.p.widths)]
        kinds = ["stacked"] + (["expand"] if self.call("expand", (), 0) is not None else [])
        out = {"base": ("base", ())}
        for kind in kinds:
            out[kind] = (kind, ())
            out.update({f"{kind} {bm}x{bn}/m{m}": (kind, (bm, bn, m)) for bm, bn, m in specs})
        return out

    def errors(self, variants):
        """Each variant's delta against the shipped one's (max abs difference over the largest delta)."""
        N, y = self.p.N, self.inputs(0)["i"].y
        base = self.call("base", (), 0)().double()
        want = {"stacked": self.call("stacked", (), 0)()[:, :N].double() - base}
        y0 = y.clone()
        if "expand" in variants:
            self.call("expand", (), 0)()
            want["expand"] = y.double() - y0.double()
        errs = {}
        for name, (kind, spec) in variants.items():
            if not spec:
                continue
            y.copy_(y0)
            out = self.call(kind, spec, 0)()
            got = (out[:, :N].double() - base) if kind == "stacked" else (y.double() - y0.double())
            errs[name] = float((got - want[kind]).abs().max() / want[kind].abs().max().clamp(min=1e-30))
        y.copy_(y0)
        return errs


def main(out_path):
    timer = Timer(DEV)
    rows = []
    for layer, rank, M in lab_rows(TOKENS, RANKS, BUDGET):
        row = Row(layer, rank, M)
        variants = row.variants()
        errs = row.errors(variants)
        makers = {name: (lambda k, v=v, row=row: row.call(*v, k)) for name, v in variants.items()}
        med, times = timer.measure_paired(makers, {n: row.p.set_bytes() + row.p.base_set_bytes() for n in makers})
        delta = {n: paired_delta(times, n, "base") for n in makers if n.startswith("stacked")}
        rows.append(dict(layer=layer.name, rank=rank, M=M, stacked_cfg=row.stacked_cfg._asdict(),
                         expand_cfg=row.expand_cfg._asdict(), err=errs, median_us=med, delta_us=delta))
        best_s = min((n for n in delta if n != "stacked"), key=delta.get)
        line = (f"{layer.name:8s} r{rank:<3d} M={M:<5d} base {med['base']:7.1f} | stacked {delta['stacked']:6.2f}, "
                f"best {best_s} {delta[best_s]:6.2f}")
        if "expand" in variants:
            best_e = min((n for n in med if n.startswith("expand ")), key=med.get)
            line += f" | expand {med['expand']:6.2f}, best {best_e} {med[best_e]:6.2f}"
        print(line + f" | max err {max(errs.values()):.1e}", flush=True)
        del row
    env = run_env()
    with open(out_path, "w") as f:
        json.dump(dict(env=env, candidates=CANDIDATES, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lab_token_loop.json")
