"""Batch metadata: LoRABatch, build_batch_meta and fill_batch_meta against plain Python counting."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import DEVICE, fill_setting
from lora_ops.batch import LoRABatch, batch_meta_of, build_batch_meta, fill_batch_meta

SLOT_DTYPES = [torch.int32, torch.int64]
SLOT_DTYPE_IDS = ["int32", "int64"]


def python_grouping(slots, num_slots):
    """What the metadata must say, by plain counting: tokens of slot 0 in order, ..., then 'no adapter'
    (-1 and, where unchecked, any slot outside [0, L)) in order; counts and starts with L + 1 entries."""
    bucket = [s if 0 <= s < num_slots else num_slots for s in slots]
    order = [t for b in range(num_slots + 1) for t in range(len(slots)) if bucket[t] == b]
    counts = [bucket.count(b) for b in range(num_slots + 1)]
    starts = [sum(counts[:b]) for b in range(num_slots + 1)]
    return order, counts, starts


def assert_meta_matches(meta, slots, num_slots):
    order, counts, starts = python_grouping(slots, num_slots)
    M = len(slots)
    for name, t in zip(meta._fields, meta):
        assert t.dtype == torch.int32, f"{name} is {t.dtype}"
    assert meta.sorted_token_ids[:M].tolist() == order
    assert meta.slot_counts.tolist() == counts
    assert meta.slot_starts.tolist() == starts


@st.composite
def slot_lists(draw, max_tokens=80):
    num_slots = draw(st.integers(1, 9))
    slots = draw(st.lists(st.integers(-1, num_slots - 1), max_size=max_tokens))
    return num_slots, slots


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=SLOT_DTYPE_IDS)
@given(problem=slot_lists())
def test_build_batch_meta_groups_stably_and_completely(slot_dtype, problem):
    num_slots, slots = problem
    meta = build_batch_meta(torch.tensor(slots, dtype=slot_dtype), num_slots)
    assert_meta_matches(meta, slots, num_slots)
    # Complete: a permutation of the tokens (also implied by the equality above; said plainly here).
    assert sorted(meta.sorted_token_ids[:len(slots)].tolist()) == list(range(len(slots)))


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=SLOT_DTYPE_IDS)
@given(problem=slot_lists())
def test_batch_meta_of_gives_the_fills_metadata(slot_dtype, problem):
    """batch_meta_of (per_row's batch under torch.compile, out of place) gives what the fill writes."""
    num_slots, slots = problem
    meta = batch_meta_of(torch.tensor(slots, dtype=slot_dtype), num_slots)
    assert meta.sorted_token_ids.dtype == torch.int32 and meta.sorted_token_ids.shape == (len(slots),)
    assert_meta_matches(meta, slots, num_slots)


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=SLOT_DTYPE_IDS)
def test_lora_batch_refills_the_same_buffers(slot_dtype):
    """Grow, fill to capacity exactly, empty, shrink: every count and start rewritten (a slot, -1's group
    included, that the new batch lacks counts 0), the first M token ids written and the ids past M left as
    they were, as the one-launch fill leaves them (the two paths' buffers the same bit for bit)."""
    batch = LoRABatch(max_tokens=64, max_loras=5)
    meta = batch.meta
    pointers = [t.data_ptr() for t in meta]
    gen = torch.Generator().manual_seed(3)
    for M in (5, 64, 0, 17, 1):  # grow, shrink, empty: stale ids past M must not matter
        slots = torch.randint(-1, 5, (M,), generator=gen, dtype=slot_dtype)
        tail = meta.sorted_token_ids[M:].clone()
        returned = batch.update(slots)
        assert all(a is b for a, b in zip(returned, meta)), "update returned new tensors"
        assert [t.data_ptr() for t in batch.meta] == pointers, "a buffer moved"
        assert batch.num_tokens == M
        assert_meta_matches(batch.meta, slots.tolist(), 5)
        assert torch.equal(meta.sorted_token_ids[M:], tail), f"ids past M={M} written"


def test_more_tokens_than_capacity_raises():
    batch = LoRABatch(max_tokens=8, max_loras=2)
    with pytest.raises(ValueError, match=r"token_slots: 9 tokens exceed the batch capacity max_tokens=8"):
        batch.update(torch.zeros(9, dtype=torch.int32))


@pytest.mark.parametrize("max_tokens,max_loras", [(0, 4), (4, 0)], ids=["no_tokens", "no_slots"])
def test_lora_batch_needs_positive_capacity(max_tokens, max_loras):
    with pytest.raises(ValueError, match=r"LoRABatch: expected max_tokens >= 1 and max_loras >= 1"):
        LoRABatch(max_tokens, max_loras)


@pytest.mark.parametrize("bad_slot,token", [(-2, 2), (4, 0), (1000, 3), (2 ** 32 + 1, 1), (-2 ** 32 - 1, 2)],
                         ids=["below_-1", "equal_to_L", "far_above", "past_int32", "below_int32"])
@pytest.mark.parametrize("builder", ["build_batch_meta", "LoRABatch.update"])
def test_cpu_slot_out_of_range_raises_naming_token_slots(builder, bad_slot, token):
    slots = [1, 0, -1, 3]
    slots[token] = bad_slot
    slots = torch.tensor(slots)
    build = {"build_batch_meta": lambda: build_batch_meta(slots, 4),
             "LoRABatch.update": lambda: LoRABatch(16, 4).update(slots)}[builder]
    with pytest.raises(ValueError, match=rf"token_slots: slot {bad_slot} at token {token} is outside "
                                         rf"\[-1, max_loras=4\)"):
        build()


@pytest.mark.parametrize("bad,error,message", [
    (torch.zeros(2, 3, dtype=torch.int32), ValueError, r"token_slots: expected a 1-D tensor \[M\], got shape \(2, 3\)"),
    (torch.zeros(3, dtype=torch.float32), TypeError, r"token_slots: expected dtype int32 or int64, got torch.float32"),
    (torch.zeros(3, dtype=torch.int16), TypeError, r"token_slots: expected dtype int32 or int64, got torch.int16"),
    ([0, 1, -1], TypeError, r"token_slots: expected a torch.Tensor of per-token slots, got list"),
], ids=["2-D", "float32", "int16", "list"])
@pytest.mark.parametrize("builder", ["build_batch_meta", "LoRABatch.update"])
def test_bad_token_slots_raise(builder, bad, error, message):
    build = {"build_batch_meta": lambda: build_batch_meta(bad, 4),
             "LoRABatch.update": lambda: LoRABatch(16, 4).update(bad)}[builder]
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=SLOT_DTYPE_IDS)
def test_unchecked_device_path_sends_out_of_range_slots_to_no_adapter(slot_dtype):
    """On a GPU the range is not checked (that would sync): fill_batch_meta, which LoRABatch.update calls
    after the checks, must turn any slot outside [0, L) into 'no adapter' rather than index with it."""
    slots = [2, 7, -1, 0, -9, 2, 3, 1000, 0]
    batch = LoRABatch(max_tokens=12, max_loras=4)
    fill_batch_meta(torch.tensor(slots, dtype=slot_dtype), 4, *batch.meta, batch._ones)
    assert_meta_matches(batch.meta, slots, 4)
    assert batch.meta.slot_counts[4] == 4  # -1, 7, -9 and 1000


# Slots no copy into int32 may see first: each wraps into one in range ([1, 0, 3, -1] for 4 slots).
PAST_INT32 = [2 ** 32 + 1, 2 ** 32, 2 ** 33 + 3, -(2 ** 32) - 1]


def served_slots(slots, num_slots):
    """Each token's slot as the per-token buffer holds it: -1 for any outside [0, L)."""
    return [s if 0 <= s < num_slots else -1 for s in slots]


@pytest.mark.parametrize("one_launch", [False, True], ids=["torch_path", "one_launch"])
def test_the_fill_writes_the_served_slots_without_wrapping_int64(triton_kernels, one_launch):
    """slots_out (a LoRAContext's int32 per-token buffer) gets each slot, -1 outside [0, L); an int64 slot past
    int32's range is no adapter there and in the metadata, not the slot it would wrap to. Every entry written,
    the rest left alone; slots_out may be the slots themselves."""
    slots = [2, 7, -1, 0, -9, 3, *PAST_INT32, 1]
    device = triton_kernels.device
    batch = _poisoned_batch(len(slots) + 2, 4, device)
    out = torch.full((len(slots) + 2,), -77, dtype=torch.int32, device=device)
    with fill_setting(one_launch):
        batch._refill(torch.tensor(slots, dtype=torch.int64, device=device), slots_out=out)
    assert_meta_matches(type(batch.meta)(*[t.cpu() for t in batch.meta]), slots, 4)
    assert out.tolist() == served_slots(slots, 4) + [-77, -77]
    in_place = torch.tensor([3, 9, -1, 0, -5, 1], dtype=torch.int32, device=device)
    with fill_setting(one_launch):
        batch._refill(in_place, slots_out=in_place)
    assert in_place.tolist() == [3, -1, -1, 0, -1, 1]
    assert_meta_matches(type(batch.meta)(*[t.cpu() for t in batch.meta]), [3, 9, -1, 0, -5, 1], 4)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda")
@pytest.mark.parametrize("one_launch", [False, True], ids=["torch_path", "one_launch"])
def test_a_context_serves_cuda_int64_slots_past_int32_no_adapter(one_launch):
    """A LoRAContext does not check CUDA slots (that would sync): any outside [0, L), an int64 one past int32's
    range too, is served no adapter, and its per-token buffer says -1."""
    import lora_ops
    ctx = lora_ops.LoRAContext(4, 16, device="cuda")
    slots = [1, *PAST_INT32, 3]
    with fill_setting(one_launch):
        ctx.set_token_slots(torch.tensor(slots, dtype=torch.int64, device="cuda"))
    assert ctx.token_slots[:len(slots)].tolist() == served_slots(slots, 4)
    assert ctx.meta.slot_counts.tolist() == [0, 1, 0, 1, len(PAST_INT32)]


@pytest.mark.skipif(DEVICE != "cuda", reason="needs LORA_OPS_TEST_DEVICE=cuda")
def test_cuda_batch_from_cuda_or_cpu_slots():
    slots = [2, 7, -1, 0, -9, 2, 3, 1000, 0]
    batch = LoRABatch(max_tokens=12, max_loras=4, device="cuda")
    batch.update(torch.tensor(slots, device="cuda"))  # unchecked on the device: no sync, no raise
    assert_meta_matches(type(batch.meta)(*[t.cpu() for t in batch.meta]), slots, 4)
    with pytest.raises(ValueError, match="token_slots: slot 7 at token 1"):  # CPU slots are checked
        batch.update(torch.tensor(slots))


# -- the one-launch fill (lora_ops.kernels.batch; on GPUs by default: batch.set_one_launch_fill) -----------

@pytest.fixture
def one_launch_fill(triton_kernels):
    """The one-launch fill switched on, CPU tensors too (through the Triton side: the interpreter)."""
    with fill_setting(True):
        yield triton_kernels


def _poisoned_batch(max_tokens, max_loras, device):
    batch = LoRABatch(max_tokens, max_loras, device=device)
    for t in batch.meta:
        t.fill_(-77)      # every entry the fill must write shows if it is not written
    return batch


@pytest.mark.parametrize("slot_dtype", SLOT_DTYPES, ids=SLOT_DTYPE_IDS)
@given(problem=slot_lists(), out_of_range=st.lists(st.integers(-1000, 1000), max_size=6))
def test_one_launch_fill_groups_stably_and_completely(one_launch_fill, slot_dtype, problem, out_of_range):
    """The kernel's metadata is the plain count's, out-of-range slots in 'no adapter' (unchecked on the
    device), every entry of counts and starts and the first M token ids written, the rest left alone; the
    per-token slots written alike where asked (an int64 slot past int32's range too)."""
    from lora_ops import launch_batch
    num_slots, slots = problem
    slots = slots + out_of_range + (PAST_INT32 if slot_dtype == torch.int64 else [])
    batch = _poisoned_batch(len(slots) + 3, num_slots, one_launch_fill.device)
    out = torch.full((len(slots) + 3,), -77, dtype=torch.int32, device=one_launch_fill.device)
    launch_batch.fill_batch_meta(torch.tensor(slots, dtype=slot_dtype, device=one_launch_fill.device), num_slots,
                                 *batch.meta, slots_out=out)
    meta = type(batch.meta)(*[t.cpu() for t in batch.meta])
    assert_meta_matches(meta, slots, num_slots)
    assert (meta.sorted_token_ids[len(slots):] == -77).all()
    assert out.tolist() == served_slots(slots, num_slots) + [-77] * 3


@pytest.mark.parametrize("num_tokens, num_slots", [(1500, 4), (1000, 64), (300, 300), (0, 5), (1, 1)],
                         ids=["several_steps", "64_slots", "300_slots", "no_tokens", "one_token"])
def test_one_launch_fill_at_larger_shapes(one_launch_fill, num_tokens, num_slots):
    """Several steps of the two passes (1500 tokens, 4 slots: 2 steps of 1024), many slots (narrow steps),
    and the edges; strided token slots (every other element of a longer tensor)."""
    from lora_ops import launch_batch
    assert launch_batch.fits(num_tokens, num_slots)
    gen = torch.Generator().manual_seed(num_tokens + num_slots)
    strided = torch.randint(-3, num_slots + 3, (2 * num_tokens,), generator=gen, dtype=torch.int64)
    slots = strided.to(one_launch_fill.device)[::2]
    batch = _poisoned_batch(max(num_tokens, 1), num_slots, one_launch_fill.device)
    launch_batch.fill_batch_meta(slots, num_slots, *batch.meta)
    assert_meta_matches(type(batch.meta)(*[t.cpu() for t in batch.meta]), slots.tolist(), num_slots)


def test_one_launch_fill_serves_what_fits_and_the_torch_path_the_rest(one_launch_fill, monkeypatch):
    """LoRABatch.update and a LoRAContext take the kernel where launch_batch.fits (shapes only), the torch
    ops elsewhere and when switched off; the metadata is the same either way."""
    from lora_ops import launch_batch
    assert launch_batch.fits(64, 4) and launch_batch.fits(32768, 4) and not launch_batch.fits(32769, 4)
    assert launch_batch.fits(2048, 64) and not launch_batch.fits(2049, 64) and not launch_batch.fits(1, 1000)
    launches = []
    real = launch_batch.fill_batch_meta
    monkeypatch.setattr(launch_batch, "fill_batch_meta", lambda *a: launches.append(a[0].shape[0]) or real(*a))
    slots = torch.tensor([2, -1, 0, 3, 3, 1, -1, 0], device=one_launch_fill.device)
    small = LoRABatch(16, 4, device=one_launch_fill.device)
    small.update(slots)
    assert launches == [8]
    assert_meta_matches(type(small.meta)(*[t.cpu() for t in small.meta]), slots.tolist(), 4)
    wide = LoRABatch(16, 1000, device=one_launch_fill.device)      # 1024 keys: past the kernel's one-hot
    wide.update(slots)
    assert launches == [8]
    assert_meta_matches(type(wide.meta)(*[t.cpu() for t in wide.meta]), slots.tolist(), 1000)
    with fill_setting(False):
        small.update(slots.flip(0))
    assert launches == [8]
    assert_meta_matches(type(small.meta)(*[t.cpu() for t in small.meta]), slots.flip(0).tolist(), 4)
    with fill_setting(None):     # the default: GPUs only
        small.update(slots)
    assert launches == ([8, 8] if small.meta.slot_counts.is_cuda else [8])


@pytest.mark.parametrize("setting, served", [
    (None, {(64, 4): True, (16384, 4): True, (16385, 4): False, (1024, 64): True, (1025, 64): False}),
    (True, {(16385, 4): True, (32768, 4): True, (32769, 4): False, (2048, 64): True, (2049, 64): False}),
    (False, {(64, 4): False}),
], ids=["default", "on", "off"])
def test_which_gpu_batches_the_one_launch_fill_serves(setting, served):
    """By default up to 16 steps of the kernel a pass (launch_batch.DEFAULT_MAX_STEPS, timed), switched on
    wherever it fits (MAX_STEPS), off never; shapes only, so no GPU is needed to ask."""
    from lora_ops import batch
    with fill_setting(setting):
        got = {shape: batch._launch_batch(torch.device("cuda", 0), *shape) is not None for shape in served}
    assert got == served


def test_one_launch_fill_is_not_traced_by_torch_compile(one_launch_fill, monkeypatch):
    """Metadata filled inside torch.compile'd code takes the torch path (it traces, fullgraph); eagerly, the
    kernel. The metadata is the same."""
    from lora_ops import launch_batch
    launches = []
    real = launch_batch.fill_batch_meta
    monkeypatch.setattr(launch_batch, "fill_batch_meta", lambda *a: launches.append(a[0].shape[0]) or real(*a))
    batch = LoRABatch(16, 4, device=one_launch_fill.device)
    slots = torch.tensor([3, -1, 0, 2, 0, 1], device=one_launch_fill.device)

    def refill(slots):     # (LoRABatch.update checks CPU slots' range: a sync that does not trace)
        fill_batch_meta(slots, 4, *batch.meta, batch._ones)
        return [t.clone() for t in batch.meta]
    torch._dynamo.reset()
    traced = torch.compile(refill, backend="aot_eager", fullgraph=True)(slots)
    torch._dynamo.reset()
    assert launches == []
    eager = refill(slots)
    assert launches == [6]
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert_meta_matches(type(batch.meta)(*[t.cpu() for t in eager]), slots.tolist(), 4)


def test_set_one_launch_fill_takes_none_true_or_false():
    from lora_ops import batch
    with pytest.raises(ValueError, match="set_one_launch_fill: expected None, True or False, got 'yes'"):
        batch.set_one_launch_fill("yes")


@pytest.mark.parametrize("one_launch", [False, True], ids=["torch_path", "one_launch"])
def test_a_refill_bumps_every_buffers_version(triton_kernels, one_launch):
    """Autograd refuses a backward whose saved metadata was refilled since its forward (lora_ops.autograd):
    both paths must bump the buffers' version counters (a kernel's writes do not by themselves)."""
    batch = LoRABatch(16, 4, device=triton_kernels.device)
    slots_out = torch.full((16,), -7, dtype=torch.int32, device=triton_kernels.device)   # (a context's token_slots)
    with fill_setting(one_launch):
        before = [t._version for t in batch.meta]
        batch.update(torch.tensor([1, 0, -1, 3], device=triton_kernels.device))
        assert all(t._version > v for t, v in zip(batch.meta, before)), [t._version for t in batch.meta]
        before = [t._version for t in (*batch.meta, slots_out)]
        batch._refill(torch.tensor([1, 0, -1, 3], device=triton_kernels.device), slots_out=slots_out)
        after = [t._version for t in (*batch.meta, slots_out)]
        assert all(a > b for a, b in zip(after, before)), after
