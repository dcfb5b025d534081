"""The benchmark's shapes, as data: layers, adapter ranks, token counts and the grids that combine them.

Every number the benchmark sweeps lives here and nowhere else.
"""
from typing import NamedTuple

NUM_SLOTS = 4                 # adapters resident in the slot stack (every one used once M >= 4)
NO_ADAPTER_FRACTION = 0.1     # share of tokens with slot -1 (base model only)
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
TINY_TOKENS = (1, 16, 64, 256)
TINY_FEATURE_DIVISOR = 64     # --tiny: features / 64 (Llama qkv 4096 -> 64), ranks / 8
TINY_RANK_DIVISOR = 8


class Layer(NamedTuple):
    model: str
    name: str
    in_features: int
    slices: tuple             # output slice widths, stacked along N (q/k/v, gate/up, or one slice)

    @property
    def out_features(self):
        return sum(self.slices)


class RankSpec(NamedTuple):
    label: str                # the table's "rank" column
    slot_ranks: tuple         # rank of each of the NUM_SLOTS adapters
    capacity: int             # R of the slot stack A [L, S, R, K]

    @property
    def uniform(self):
        return len(set(self.slot_ranks)) == 1 and self.slot_ranks[0] == self.capacity


class Case(NamedTuple):
    layer: Layer
    ranks: RankSpec
    M: int

    @property
    def label(self):
        return f"{self.layer.model}/{self.layer.name} r{self.ranks.label} M={self.M}"


def _layers(model, k, qkv, o, gate_up, down_in):
    return (Layer(model, "qkv", k, qkv), Layer(model, "o", k, (o,)),
            Layer(model, "gate_up", k, gate_up), Layer(model, "down", down_in, (k,)))


LLAMA3_8B = _layers("llama3-8b", 4096, (4096, 1024, 1024), 4096, (14336, 14336), 14336)
PHI4_MINI = _layers("phi4-mini", 3072, (3072, 1024, 1024), 3072, (8192, 8192), 8192)


def uniform(rank):
    return RankSpec(str(rank), (rank,) * NUM_SLOTS, rank)


# A capacity-128 stack holding adapters of four ranks: each should cost its own rank, not 128.
MIXED = RankSpec("mix", (8, 16, 64, 128), 128)


def rank_spec(text):
    """A RankSpec from the command line: "64" (every slot at 64), "mix" (:data:`MIXED`), or one rank per slot
    as "100/128/320/320" (the stack's capacity: the largest)."""
    if text == MIXED.label:
        return MIXED
    ranks = tuple(int(r) for r in text.split("/"))
    return uniform(ranks[0]) if len(ranks) == 1 else RankSpec(text, ranks, max(ranks))


GRIDS = {
    "core": ((LLAMA3_8B, (uniform(16), uniform(64))),),
    "highrank": ((LLAMA3_8B, (uniform(128), uniform(256), uniform(320))),
                 (PHI4_MINI, (uniform(256), uniform(320)))),
    "mixed": ((LLAMA3_8B, (MIXED,)),),
}

# --subset: a fast smoke run (2 layers x 2 token counts, first rank of each model).
SUBSET_LAYERS = ("qkv", "down")
SUBSET_TOKENS = (16, 4096)
TINY_SUBSET_TOKENS = (16, 256)


def tiny_layer(layer):
    d = TINY_FEATURE_DIVISOR
    return layer._replace(in_features=layer.in_features // d, slices=tuple(n // d for n in layer.slices))


def tiny_ranks(spec):
    def scale(r):
        return max(1, r // TINY_RANK_DIVISOR)
    return RankSpec(spec.label, tuple(scale(r) for r in spec.slot_ranks), scale(spec.capacity))


def cases(grid, tiny=False, subset=False, models=None, layers=None, ranks=None, tokens=None):
    """The grid's rows in table order (model, layer, rank, M), after the optional filters.

    models / layers: names to keep; ranks: rank labels to keep (as strings); tokens: M values to use.
    """
    if grid not in GRIDS:
        raise ValueError(f"grid: expected one of {sorted(GRIDS)}, got {grid!r}")
    if tokens is None:
        tokens = (TINY_SUBSET_TOKENS if tiny else SUBSET_TOKENS) if subset else (TINY_TOKENS if tiny else TOKENS)
    if layers is None and subset:
        layers = SUBSET_LAYERS
    out = []
    for model_layers, specs in GRIDS[grid]:
        if models is not None and model_layers[0].model not in models:
            continue
        if subset and ranks is None:
            specs = specs[:1]
        for layer in model_layers:
            if layers is not None and layer.name not in layers:
                continue
            for spec in specs:
                if ranks is not None and spec.label not in ranks:
                    continue
                for M in tokens:
                    out.append(Case(tiny_layer(layer) if tiny else layer, tiny_ranks(spec) if tiny else spec, M))
    return out
