"""lora_linear's own GEMM with the expand in its epilogue (kernels.linear): after the shrink, one launch
writes y = x W^T + bias + the delta. lora_linear takes it at decode sizes (configs.linear_config).

Checked against float64: the base product and the delta, with y and h poisoned with NaN first (every
output written; h past a slot's rank, which the shrink leaves unwritten, never read into a product),
strided x / W / y, K and N tails, several token tiles, split-K partials added in order (bit-identical
between runs), and the shrink's partial sums read by the epilogue.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from conftest import (DEVICE, FLOAT32_ROUNDOFF, INTERPRETED, LAYOUTS, TOLERANCE, dtype_id, laid_out, make_case,
                      ulp)
from lora_ops import configs, launch, ops
from lora_ops.configs.heuristics import LinearConfig, ShrinkConfig


@pytest.fixture
def triton_backend():
    """CPU tensors through the Triton kernels (the interpreter); CUDA tensors take them anyway."""
    previous = ops.get_cpu_backend()
    ops.set_cpu_backend("triton")
    yield
    ops.set_cpu_backend(previous)


@pytest.fixture
def linear_forced():
    yield configs.force_linear
    configs.force_linear(None)


@pytest.fixture(params=[torch.float16, torch.bfloat16, torch.float32], ids=dtype_id)
def dtype(request):
    if INTERPRETED and request.param == torch.bfloat16:
        request.getfixturevalue("bf16_interpreter")
    return request.param


def weights(N, K, dtype, seed, w_layout="contiguous", bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = laid_out(torch.randn(N, K, generator=gen, dtype=torch.float64) * K ** -0.5, w_layout, gen)
    b = torch.randn(N, generator=gen) if bias else None
    to = dict(dtype=dtype, device=DEVICE)
    return w.to(**to), None if b is None else b.to(**to)


def assert_linear_close(y, x, w, b, delta, dtype):
    """y against x W^T + b + delta in float64. Per output, the GEMM's own error is allowed (half an output
    step, and K + 1 float32 roundings of sum |x W| + |b|); what exceeds it is the delta's error, held to the
    dtype's relative tolerance (zero where the delta is zero)."""
    x64, w64 = x.double().cpu(), w.double().cpu()
    b64 = torch.zeros(w64.shape[0], dtype=torch.float64) if b is None else b.double().cpu()
    ref = F.linear(x64, w64, b64) + delta
    gemm_bound = (x64.shape[1] + 1) * FLOAT32_ROUNDOFF * (F.linear(x64.abs(), w64.abs()) + b64.abs())
    excess = ((y.double().cpu() - ref).abs() - 0.5 * ulp(ref, dtype) - gemm_bound).clamp(min=0)
    assert not torch.isnan(y).any(), "NaN in y"
    allowed = TOLERANCE[dtype] * delta.norm().item()
    assert excess.norm().item() <= allowed, f"error past the GEMM's {excess.norm().item():.3g} > {allowed:.3g} ({dtype})"


CONFIGS = {
    "one_tile": LinearConfig(16, 32, 32, 1, 4, 2),
    "split_k3_k_tail": LinearConfig(16, 16, 32, 3, 4, 2),
    "token_tiles_split_k2": LinearConfig(16, 64, 64, 2, 4, 2),
    "block_m64": LinearConfig(64, 32, 16, 1, 4, 2),
}


@pytest.mark.parametrize("parts", [1, 3], ids=["h", "h_3_partials"])
@pytest.mark.parametrize("w_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_kernel_matches_float64(dtype, cfg, w_layout, parts):
    """y (a column slice of a wider tensor) poisoned with NaN, h poisoned with NaN before the shrink."""
    M, K, widths, R = 37, 75, [40, 9, 24], 24
    N = sum(widths)
    case = make_case(M, K, N, num_slots=5, num_slices=3, max_rank=R, dtype=dtype, device=DEVICE, seed=parts,
                     ranks=[24, 0, 7, 16, 1], slice_widths=widths, x_layout="column_slice")
    w, b = weights(N, K, dtype, seed=3, w_layout=w_layout, bias=parts == 1)
    h = torch.full((parts, M, 3, R), float("nan"), device=DEVICE)
    launch.launch_shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta, h,
                         ShrinkConfig(16, 32, 32, parts, 4, 2), partials_out=parts > 1)
    wide = torch.full((M, N + 5), float("nan"), dtype=dtype, device=DEVICE)
    y = wide[:, 2:2 + N]
    launch.launch_linear_lora(y, case.x, w, b, h, case.lora_b, widths, case.rank, *case.meta, cfg)
    assert not torch.isnan(y).any(), "outputs left unwritten"
    assert torch.isnan(wide[:, :2]).all() and torch.isnan(wide[:, 2 + N:]).all(), "wrote outside y"
    assert_linear_close(y, case.x, w, b, case.delta_reference(), dtype)
    again = torch.full_like(y, float("nan"))
    launch.launch_linear_lora(again, case.x, w, b, h, case.lora_b, widths, case.rank, *case.meta, cfg)
    assert torch.equal(again, y), "split-K partials are added in a fixed order: runs agree bit for bit"


@st.composite
def problems(draw):
    """make_case keywords: small shapes (the interpreter runs every program in Python)."""
    M = draw(st.integers(1, 40 if INTERPRETED else 200))
    S = draw(st.integers(1, 3))
    K = draw(st.integers(1, 49 if INTERPRETED else 600))
    N = draw(st.integers(S, 49 if INTERPRETED else 600))
    R = draw(st.integers(1, 64))
    L = draw(st.integers(1, 6))
    cuts = sorted(draw(st.lists(st.integers(1, N - 1), min_size=S - 1, max_size=S - 1, unique=True))) if S > 1 else []
    return dict(M=M, K=K, N=N, num_slots=L, num_slices=S, max_rank=R,
                ranks=draw(st.lists(st.integers(0, R), min_size=L, max_size=L)),
                token_slots=draw(st.lists(st.integers(-1, L - 1), min_size=M, max_size=M)),
                slice_widths=[b - a for a, b in zip([0] + cuts, cuts + [N])],
                x_layout=draw(st.sampled_from(LAYOUTS)), capacity=M + draw(st.integers(0, 4)),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


@given(data=st.data())
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=dtype_id)
def test_op_on_the_linear_path_matches_float64(triton_backend, linear_forced, dtype, data):
    """The lora_linear op with the path forced on, whatever the batch size."""
    spec = data.draw(problems(), label="problem")
    bias = data.draw(st.booleans(), label="bias")
    linear_forced(True)
    case = make_case(**spec, dtype=dtype, device=DEVICE)
    w, b = weights(spec["N"], spec["K"], dtype, seed=spec["seed"] % 1000, bias=bias)
    y = ops.call("lora_linear", case.x, w, b, case.lora_a, case.lora_b, case.scale, case.rank,
                 list(case.slice_widths), *case.meta)
    assert_linear_close(y, case.x, w, b, case.delta_reference(), dtype)


def test_no_adapter_tokens_get_the_base_layer_alone(triton_backend, linear_forced):
    """Slots -1 and rank 0 only: y is the GEMM and bias, within their own rounding (the delta is zero)."""
    linear_forced(True)
    case = make_case(20, 64, 48, num_slots=2, num_slices=2, max_rank=16, device=DEVICE, seed=5, ranks=[0, 16],
                     token_slots=[-1] * 10 + [0] * 10)
    w, b = weights(48, 64, torch.float32, seed=6)
    y = ops.call("lora_linear", case.x, w, b, case.lora_a, case.lora_b, case.scale, case.rank,
                 list(case.slice_widths), *case.meta)
    assert_linear_close(y, case.x, w, b, case.delta_reference(), torch.float32)


def test_path_choice():
    """Decode sizes and ranks up to 64 take the linear path; larger batches or ranks take cuBLAS + add_lora_;
    force_linear overrides either way."""
    def cfg(M, R):
        return configs.linear_config(M, 4096, 6144, 3, R, 4, torch.device("cpu"), torch.bfloat16)
    try:
        assert cfg(1, 16) is not None and cfg(64, 64) is not None
        assert cfg(65, 16) is None and cfg(64, 65) is None
        configs.force_linear(False)
        assert cfg(1, 16) is None
        configs.force_linear(True)
        assert cfg(4096, 128) is not None
        with pytest.raises(ValueError, match="on"):
            configs.force_linear("yes")
    finally:
        configs.force_linear(None)


@pytest.mark.parametrize("M, path", [(8, "linear"), (300, "add_lora")])
def test_lora_linear_takes_the_path_the_config_names(triton_backend, monkeypatch, M, path):
    taken = []
    real_linear, real_add = launch.launch_linear_lora, launch._add_lora
    monkeypatch.setattr(launch, "launch_linear_lora", lambda *a: taken.append("linear") or real_linear(*a))
    monkeypatch.setattr(launch, "_add_lora", lambda *a: taken.append("add_lora") or real_add(*a))
    case = make_case(M, 32, 24, num_slots=2, num_slices=1, max_rank=8, device=DEVICE, seed=M)
    w, b = weights(24, 32, torch.float32, seed=1)
    ops.call("lora_linear", case.x, w, b, case.lora_a, case.lora_b, case.scale, case.rank,
             list(case.slice_widths), *case.meta)
    assert taken == [path]
