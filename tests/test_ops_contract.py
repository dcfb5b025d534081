"""The op contract: opcheck of every forward op (the backward ops': tests/test_autograd.py), the schemas' aliasing,
the fake kernels' checks, launchers on meta tensors (grids from shapes only), and one compile of the hot path over
many batch sizes."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import lora_ops
from conftest import make_case
from csrc_meta.schemas import NOT_DIFFERENTIABLE, OPS
from lora_ops import configs, launch
from lora_ops.configs.heuristics import cdiv, max_token_tiles

# (M, K, N, L, S, R): decode-like, fused q/k/v-like with odd sizes, one slot, an empty batch.
SHAPES = [(7, 9, 11, 3, 2, 8), (33, 17, 23, 5, 3, 16), (1, 5, 3, 1, 1, 1), (0, 6, 7, 2, 2, 4)]
SHAPE_IDS = ["M7-S2", "M33-S3", "M1-L1", "M0"]


def requiring_grad(t):
    return t.detach().clone().requires_grad_(True)


def op_args(op_name, case):
    """Arguments of torch.ops.lora_ops.<op_name>; lora_linear's differentiable inputs require grad (opcheck's
    autograd check needs some); the ops without a gradient refuse such inputs (NOT_DIFFERENTIABLE), so none of
    theirs does. With one slot (L = 1) the layers have no bias (None); with more, lora_linear_stacked's stack has
    padding rows (P = 3 of schemas.py), whose columns its output holds too."""
    M, K, N, L, S, R = case.shape
    meta = tuple(case.meta)
    grad = requiring_grad if op_name not in NOT_DIFFERENTIABLE else (lambda t: t)
    x, lora_a, lora_b = grad(case.x), grad(case.lora_a), grad(case.lora_b)
    dev, dtype, with_bias = case.x.device, case.x.dtype, L > 1
    if op_name == "shrink":
        return (x, lora_a, case.scale, case.rank, *meta)
    if op_name == "expand_":
        h = torch.randn(M, S, R, generator=case.gen).to(dev)
        return (case.new_y("random"), h, lora_b, case.slice_widths, case.rank, *meta)
    if op_name == "lora_linear":
        weight = requiring_grad(torch.randn(N, K, generator=case.gen).to(dev, dtype))
        bias = requiring_grad(torch.randn(N, generator=case.gen).to(dev, dtype)) if with_bias else None
        return (x, weight, bias, lora_a, lora_b, case.scale, case.rank, case.slice_widths, *meta)
    if op_name == "lora_linear_stacked":   # inference only: no input requires grad
        pad = 3 if L > 1 else 0
        stacked = torch.cat([torch.randn(N, K, generator=case.gen).to(dev, dtype), case.lora_a.reshape(-1, K),
                             torch.zeros(pad, K, dtype=dtype, device=dev)])
        bias = torch.cat([torch.randn(N, generator=case.gen), torch.zeros(L * S * R + pad)]).to(dev, dtype)
        return (case.x, stacked, bias if with_bias else None, case.lora_b, case.scale, case.rank, case.slice_widths,
                *meta)
    return (case.new_y("random"), x, lora_a, lora_b, case.scale, case.rank, case.slice_widths, *meta)


# Every shape in float32, and one in float16: the fake kernels' output dtypes (h float32, the layers' outputs in
# x's dtype) only show where x's dtype is not float32. (Not bf16: the interpreter computes it wrongly unpatched.)
OPCHECK_CASES = ([pytest.param(shape, torch.float32, id=i) for shape, i in zip(SHAPES, SHAPE_IDS)]
                 + [pytest.param(SHAPES[0], torch.float16, id=f"{SHAPE_IDS[0]}-fp16")])


@pytest.mark.parametrize("shape, dtype", OPCHECK_CASES)
@pytest.mark.parametrize("op_name", ["shrink", "expand_", "add_lora_", "lora_linear", "lora_linear_stacked"])
def test_opcheck(backend, op_name, shape, dtype):
    case = make_case(*shape, dtype=dtype, device=backend.device, seed=11)
    op = getattr(torch.ops.lora_ops, op_name).default
    # All default test_utils: schema, autograd registration, fake tensor, aot dispatch (dynamic).
    results = torch.library.opcheck(op, op_args(op_name, case))
    assert set(results) == {"test_schema", "test_autograd_registration", "test_faketensor",
                            "test_aot_dispatch_dynamic"}
    assert all(v == "SUCCESS" for v in results.values()), results


def test_only_the_in_place_ops_write_and_only_their_y():
    """expand_ and add_lora_ write y (Tensor(a!)) and return nothing; no other argument of any op is written or
    aliased, and every other op returns a tensor of its own. opcheck finds a write the schema does not mark, not a
    mark too many (functionalization would copy such an input back, and ops.MUTATES_FIRST reads the marks)."""
    for name in OPS:
        schema = getattr(torch.ops.lora_ops, name).default._schema
        aliased = [(a.name, a.alias_info.is_write) for a in schema.arguments if a.alias_info is not None]
        in_place = name in ("expand_", "add_lora_")
        assert aliased == ([("y", True)] if in_place else []), (name, aliased)
        assert [r.alias_info for r in schema.returns] == ([] if in_place else [None]), (name, schema.returns)


def arg_names(op_name):
    """The names of torch.ops.lora_ops.<op_name>'s arguments, in its schema's order."""
    return [a.name for a in getattr(torch.ops.lora_ops, op_name).default._schema.arguments]


def args_by_name(op_name, device, **replaced):
    """Arguments of torch.ops.lora_ops.<op_name>, looked up by its schema's names in a small valid problem
    (make_case's, M=2, K=8, N=6, L=3, S=2, R=4, float32, and random signed values for the rest) on ``device``
    ("meta": the fake kernels run), with ``replaced``'s values (on ``device`` too) in place of those of their
    names."""
    M, K, N, L, S, R = 2, 8, 6, 3, 2, 4
    case = make_case(M, K, N, L, S, R, seed=17, ranks=[R, 1, 0], token_slots=[1, -1], slice_widths=[2, N - 2])
    signed = case.signed
    rows = N + L * S * R
    values = dict(x=case.x, y=case.new_y("random"), lora_a=case.lora_a, lora_b=case.lora_b, h=signed((M, S, R)),
                  dh=signed((M, S, R)), u=signed((M, R)), v=signed((M, N)), grad_out=signed((M, N)),
                  weight=signed((N, K)), bias=signed((N,)), stacked_weight=signed((rows, K)),
                  stacked_bias=signed((rows,)), scale=case.scale, rank=case.rank, slice_widths=case.slice_widths,
                  **case.meta._asdict())
    values.update(replaced)
    return [values[name].to(device) if isinstance(values[name], torch.Tensor) else values[name]
            for name in arg_names(op_name)]


@pytest.mark.parametrize("op_name", list(OPS))
def test_fake_kernels_refuse_what_the_kernels_refuse(op_name):
    """Every fake kernel runs its op's checks: traced (torch.compile, export) a bad argument is refused with the
    error an eager call gives (here rank in int64), not only once the compiled graph runs the kernel."""
    op = getattr(torch.ops.lora_ops, op_name).default
    rank = torch.tensor([4, 1, 0], dtype=torch.int64)
    with pytest.raises(TypeError, match="^rank: expected dtype torch.int32, got torch.int64") as eager:
        op(*args_by_name(op_name, "cpu", rank=rank))
    with pytest.raises(TypeError) as fake:
        op(*args_by_name(op_name, "meta", rank=rank))
    assert str(fake.value) == str(eager.value)


# ------------------------------------------------------------------------------------------------
# Launchers on meta tensors: grids are plain ints computed from shapes, bounded by the real work.
# ------------------------------------------------------------------------------------------------
class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records kernel[grid](*args, **kwargs) instead of launching,
    with the arguments bound to the real kernel's parameter names."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        self.launches = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.launches.append((grid, {**dict(zip(self.arg_names, args)), **kwargs}))
        return launch_


@pytest.fixture
def recorders(monkeypatch):
    shrink = LaunchRecorder(lora_ops.kernels.shrink.shrink_kernel)
    expand = LaunchRecorder(lora_ops.kernels.expand.expand_kernel)
    fused = LaunchRecorder(lora_ops.kernels.fused.fused_add_lora_kernel)
    for launcher, recorder in ((launch.SHRINK, shrink), (launch.EXPAND, expand), (launch.FUSED, fused)):
        monkeypatch.setattr(launcher, "kernel", recorder)
        monkeypatch.setattr(launcher, "enabled", False)   # every launch through kernel[grid], recorded
    return {"shrink": shrink, "expand": expand, "fused": fused}


def meta_problem(M, K, N, L, S, R, capacity):
    """Meta tensors of the right shapes and dtypes: reading any value raises."""
    meta = dict(device="meta")
    widths = [N // S] * (S - 1) + [N - (N // S) * (S - 1)]
    return dict(
        y=torch.empty(M, N, dtype=torch.bfloat16, **meta), x=torch.empty(M, K, dtype=torch.bfloat16, **meta),
        lora_a=torch.empty(L, S, R, K, dtype=torch.bfloat16, **meta),
        lora_b=torch.empty(L, N, R, dtype=torch.bfloat16, **meta),
        h=torch.empty(M, S, R, dtype=torch.float32, **meta),
        scale=torch.empty(L, dtype=torch.float32, **meta), rank=torch.empty(L, dtype=torch.int32, **meta),
        slice_widths=widths,
        meta=(torch.empty(capacity, dtype=torch.int32, **meta), torch.empty(L + 1, dtype=torch.int32, **meta),
              torch.empty(L + 1, dtype=torch.int32, **meta)),
    )


def call_launcher(op_name, p):
    if op_name == "shrink":
        return launch.shrink(p["x"], p["lora_a"], p["scale"], p["rank"], *p["meta"])
    if op_name == "expand_":
        return launch.expand_(p["y"], p["h"], p["lora_b"], p["slice_widths"], p["rank"], *p["meta"])
    if op_name == "lora_linear_stacked":
        L, S, R, K = p["lora_a"].shape
        stacked = torch.empty(p["y"].shape[1] + L * S * R, K, dtype=p["x"].dtype, device="meta")
        return launch.lora_linear_stacked(p["x"], stacked, None, p["lora_b"], p["scale"], p["rank"],
                                          p["slice_widths"], *p["meta"])
    configs.force_path(op_name.split(":")[1])
    try:
        return launch.add_lora_(p["y"], p["x"], p["lora_a"], p["lora_b"], p["scale"], p["rank"], p["slice_widths"],
                                *p["meta"])
    finally:
        configs.force_path(None)


# decode with many slots, odd mid sizes, prefill, one slot, and a rank loop over a B of 7 MiB a slot, whose expand
# takes its token tiles on grid axis 0 (launch.expand_tokens_first): (M, K, N, L, S, R)
TOKENS_FIRST_SHAPE = (1024, 4096, 14336, 4, 1, 256)
LAUNCH_SHAPES = [(1, 4096, 4096, 64, 1, 16), (37, 999, 1533, 8, 3, 48), (5000, 4096, 14336, 16, 2, 64),
                 (64, 64, 64, 1, 1, 8), TOKENS_FIRST_SHAPE]
LAUNCH_IDS = ["decode-L64", "odd-S3", "prefill", "L1", "tokens-first"]


@pytest.mark.parametrize("shape", LAUNCH_SHAPES, ids=LAUNCH_IDS)
@pytest.mark.parametrize("op_name", ["shrink", "expand_", "add_lora_:fused", "add_lora_:split", "lora_linear_stacked"])
def test_launch_grids_on_meta_tensors(recorders, op_name, shape):
    M, K, N, L, S, R = shape
    p = meta_problem(M, K, N, L, S, R, capacity=M + 3)
    call_launcher(op_name, p)  # meta tensors: any host read of data would raise here

    expected = {"shrink": ["shrink"], "expand_": ["expand"], "add_lora_:fused": ["fused"],
                "add_lora_:split": ["shrink", "expand"], "lora_linear_stacked": ["expand"]}[op_name]
    assert [k for k in ("shrink", "expand", "fused") if recorders[k].launches] == expected
    for kind in expected:
        (grid, args), = recorders[kind].launches  # one launch each
        assert all(type(g) is int for g in grid), f"{kind} grid {grid!r} is not plain ints"
        assert all(g >= 1 for g in grid), f"{kind} grid {grid}"
        tokens_first = args.get("TOKENS_FIRST", False)   # the expand's axes swapped: (token tiles, column chunks)
        if shape == TOKENS_FIRST_SHAPE and kind == "expand":
            assert tokens_first, f"the expand of {shape} no longer takes its token tiles first: pick another shape"
        token_tiles, block_m = grid[0 if tokens_first else 1], args["BLOCK_M"]
        assert token_tiles <= cdiv(M, block_m) + L and token_tiles <= M, \
            f"{kind}: {token_tiles} token tiles for M={M}, L={L}, BLOCK_M={block_m}"
        assert type(args["M"]) is int and args["M"] == M
        if kind == "shrink":
            slice_groups = cdiv(S, args.get("SLICE_GROUP", 1))  # slices sharing one program's dot
            assert grid[0] == slice_groups * cdiv(R, args["BLOCK_R"]), f"shrink grid {grid}"
            assert grid[2] == args["split_k"], f"shrink grid {grid} vs split_k {args['split_k']}"
        else:  # expand and the one-launch kernel: one program per column chunk (N_LOOP blocks) of each slice
            chunk = args["BLOCK_N"] * args.get("N_LOOP", 1)
            chunks = grid[1 if tokens_first else 0]
            assert chunks == sum(cdiv(n, chunk) for n in p["slice_widths"]), f"{kind} grid {grid}"
        tensors = [a for a in args.values() if isinstance(a, torch.Tensor)]
        assert len(tensors) >= 7 and all(t.device.type == "meta" for t in tensors)


def test_launch_grid_bound_covers_the_worst_case():
    """The token-tile bound must cover the tiles of any split of M tokens over L slots."""
    for M in range(1, 150):
        for L in (1, 2, 5, 16):
            for block_m in (16, 64):
                bound = max_token_tiles(M, L, block_m)
                for counts in tile_heavy_splits(M, L, block_m):
                    tiles = sum(cdiv(c, block_m) for c in counts)
                    assert tiles <= bound, f"M={M} L={L} BLOCK_M={block_m} counts={counts}: {tiles} > {bound}"


def tile_heavy_splits(M, L, block_m):
    """Splits of M tokens over L slots with many partial tiles: round robin, and full tiles plus one
    token for every other slot."""
    round_robin = [M // L + (i < M % L) for i in range(L)]
    ones = min(L - 1, M - 1)
    rest = M - ones
    return [round_robin, [rest] + [1] * ones + [0] * (L - 1 - ones)]


# ------------------------------------------------------------------------------------------------
# torch.compile: one compile for every batch size, results equal to eager
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def recompiles_raise():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def test_compiled_add_lora_compiles_once_for_all_batch_sizes(backend, recompiles_raise):
    capacity, K, N, L, S, R = 64, 17, 21, 3, 2, 8
    case = make_case(capacity, K, N, L, S, R, dtype=torch.float32, device=backend.device, seed=5)
    weight = torch.randn(N, K, generator=case.gen).to(backend.device)
    batch = lora_ops.LoRABatch(capacity, L, device=backend.device)  # fixed capacity, refilled per step

    def layer(x):
        y = x @ weight.T
        return lora_ops.add_lora(y, x, case.lora_a, case.lora_b, case.scale, case.rank, batch=batch,
                                 slice_widths=case.slice_widths)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(0)
    for M in (2, 7, 33, 64):
        x = torch.randn(M, K, generator=gen).to(backend.device)
        torch._dynamo.mark_dynamic(x, 0)
        batch.update(torch.randint(-1, L, (M,), generator=gen).to(backend.device))
        assert torch.equal(compiled(x), layer(x)), f"compiled != eager at M={M}"
    assert counter.frame_count == 1
    targets = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert any("lora_ops.add_lora_" in t for t in targets), targets


def test_compiled_functional_call_with_token_slots_has_no_graph_break(backend):
    """lora_forward / add_lora given per-token slots (not a batch) under torch.compile(fullgraph=True): the CPU
    range check of the slots read their values (a host sync), a data-dependent guard that fullgraph refused
    and that broke the graph five times without it. The check is eager-only, as the ranks' is."""
    capacity, K, N, L, S, R = 32, 17, 21, 3, 2, 8
    case = make_case(capacity, K, N, L, S, R, dtype=torch.float32, device=backend.device, seed=6)

    def layer(y, x, slots):
        return lora_ops.lora_forward(y, x, case.lora_a, case.lora_b, case.scale, case.rank, token_slots=slots,
                                     slice_widths=case.slice_widths)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(1)
    for M in (5, 9, 20):
        x, y = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
        slots = torch.randint(-1, L, (M,), generator=gen)
        x, y, slots = (t.to(backend.device) for t in (x, y, slots))
        for t in (x, y, slots):
            torch._dynamo.mark_dynamic(t, 0)
        assert torch.allclose(compiled(y, x, slots), layer(y, x, slots), rtol=1e-5, atol=1e-5), M
    assert counter.frame_count == 1


@pytest.mark.parametrize("how", ["export", "unbacked", "unbacked_unstated"])
def test_functional_call_with_token_slots_serves_any_token_count(backend, how):
    """With per-token slots the functional API sized a LoRABatch from the token count: a non-strict
    torch.export pinned the program to the example's count, and an unbacked count (mark_unbacked) did not
    compile. The metadata comes from traceable ops of the tokens' own size there now. Three unbacked counts
    whose equality the caller does not state compile too (the checks' y-rows comparison could not be guarded
    on; torch._check_with now)."""
    K, N, L, S, R = 17, 21, 3, 2, 8
    case = make_case(4, K, N, L, S, R, dtype=torch.float32, device=backend.device, seed=7)

    class Layer(torch.nn.Module):
        def forward(self, y, x, slots):
            if how == "unbacked":   # (three inputs, three unbacked counts: their equality is the caller's to state)
                torch._check(y.shape[0] == x.shape[0])
                torch._check(slots.shape[0] == x.shape[0])
            return lora_ops.lora_forward(y, x, case.lora_a, case.lora_b, case.scale, case.rank, token_slots=slots,
                                         slice_widths=case.slice_widths)

    gen = torch.Generator().manual_seed(2)

    def inputs(M):
        x, y = torch.randn(M, K, generator=gen), torch.randn(M, N, generator=gen)
        return tuple(t.to(backend.device) for t in (y, x, torch.randint(-1, L, (M,), generator=gen)))

    if how == "export":
        M = torch.export.Dim("M", min=2, max=64)
        run = torch.export.export(Layer(), inputs(9), dynamic_shapes=({0: M}, {0: M}, {0: M})).module()
    else:
        counter = CompileCounterWithBackend("aot_eager")
        run = torch.compile(Layer(), fullgraph=True, backend=counter)
    for M in (5, 30) if how == "export" else (1, 5, 30):
        args = inputs(M)
        if how != "export":
            for t in args:
                torch._dynamo.decorators.mark_unbacked(t, 0)
        torch.testing.assert_close(run(*args), Layer()(*args), rtol=1e-5, atol=1e-5)
    if how != "export":
        assert counter.frame_count == 1
    torch._dynamo.reset()
