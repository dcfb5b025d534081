"""Every bad input raises ValueError or TypeError with a message that names the argument, through the
public API and through torch.ops directly, on both CPU backends."""
import os
import re
from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies
import torch

import lora_ops
from conftest import make_case
from test_ops_contract import arg_names
from lora_ops.batch import BatchMeta

M, K, N, L, S, R = 4, 6, 10, 3, 2, 4
WIDTHS = [4, 6]
OPS = ("add_lora_", "shrink", "expand_")


def valid_args(device):
    case = make_case(M, K, N, L, S, R, device=device, seed=2, slice_widths=WIDTHS, token_slots=[2, -1, 0, 1])
    return dict(y=case.new_y("random"), x=case.x, lora_a=case.lora_a, lora_b=case.lora_b, scale=case.scale,
                rank=case.rank, slice_widths=list(WIDTHS), h=torch.randn(M, S, R, device=device),
                **case.meta._asdict())


def call_public(op, a):
    batch = BatchMeta(a["sorted_token_ids"], a["slot_starts"], a["slot_counts"])
    if op == "add_lora_":
        return lora_ops.add_lora(a["y"], a["x"], a["lora_a"], a["lora_b"], a["scale"], a["rank"], batch=batch,
                                 slice_widths=a["slice_widths"])
    if op == "shrink":
        return lora_ops.shrink(a["x"], a["lora_a"], a["scale"], a["rank"], batch=batch)
    return lora_ops.expand(a["y"], a["h"], a["lora_b"], a["rank"], batch=batch, slice_widths=a["slice_widths"])


def call_torch_ops(op, a):
    return getattr(torch.ops.lora_ops, op)(*[a[name] for name in arg_names(op)])


ENTRY_POINTS = {"api": call_public, "torch.ops": call_torch_ops}


@dataclass(frozen=True)
class Bad:
    """One bad argument: ``change`` maps (args, device) to the replacement value of ``arg``; ``message``
    is the start of the expected error, by op where the ops word it differently ({dev}: the device)."""
    name: str
    arg: str
    change: Callable
    error: type
    message: object  # str, or {op: str}; ops not listed do not take the argument

    def message_for(self, op):
        return self.message[op] if isinstance(self.message, dict) else self.message

    def ops(self):
        if isinstance(self.message, dict):
            return list(self.message)
        return [op for op in OPS if self.arg in USES[op]]


USES = {op: set(arg_names(op)) for op in OPS}
FLOATS = "expected dtype float16, bfloat16 or float32"
META = "(slots + 1 for 'no adapter')"


BAD = [
    # dtypes
    Bad("x_int", "x", lambda a, d: a["x"].to(torch.int32), TypeError, f"x: {FLOATS}, got torch.int32"),
    Bad("x_float64", "x", lambda a, d: a["x"].double(), TypeError, f"x: {FLOATS}, got torch.float64"),
    Bad("lora_a_dtype_not_x", "lora_a", lambda a, d: a["lora_a"].half(), TypeError,
        "lora_a: expected dtype torch.float32 (the dtype of x), got torch.float16"),
    Bad("y_dtype_not_x", "y", lambda a, d: a["y"].half(), TypeError,
        {"add_lora_": "y: expected dtype torch.float32 (the dtype of x), got torch.float16",
         "expand_": "lora_b: expected dtype torch.float16 (the dtype of y), got torch.float32"}),
    Bad("lora_b_dtype_not_y", "lora_b", lambda a, d: a["lora_b"].half(), TypeError,
        "lora_b: expected dtype torch.float32 (the dtype of y), got torch.float16"),
    Bad("h_not_fp32", "h", lambda a, d: a["h"].half(), TypeError,
        "h: expected a 3-D float32 tensor [M, S, R] (the shrink output), got torch.float16 (4, 2, 4)"),
    Bad("scale_not_fp32", "scale", lambda a, d: a["scale"].half(), TypeError,
        "scale: expected a 1-D float32 tensor of per-slot scales, got torch.float16 (3,)"),
    Bad("rank_int64", "rank", lambda a, d: a["rank"].long(), TypeError,
        "rank: expected dtype torch.int32, got torch.int64"),
    Bad("sorted_token_ids_int64", "sorted_token_ids", lambda a, d: a["sorted_token_ids"].long(), TypeError,
        "sorted_token_ids: expected dtype torch.int32, got torch.int64"),
    Bad("slot_starts_int64", "slot_starts", lambda a, d: a["slot_starts"].long(), TypeError,
        "slot_starts: expected dtype torch.int32, got torch.int64"),
    Bad("slot_counts_float", "slot_counts", lambda a, d: a["slot_counts"].float(), TypeError,
        "slot_counts: expected dtype torch.int32, got torch.float32"),
    # devices (meta stands in for a second device)
    Bad("lora_a_on_meta", "lora_a", lambda a, d: a["lora_a"].to("meta"), ValueError,
        "lora_a: expected a tensor on {dev} (the device of x), got meta"),
    Bad("lora_b_on_meta", "lora_b", lambda a, d: a["lora_b"].to("meta"), ValueError,
        {"add_lora_": "lora_b: expected a tensor on {dev} (the device of x), got meta",
         "expand_": "lora_b: expected a tensor on {dev} (the device of y), got meta"}),
    Bad("y_on_meta", "y", lambda a, d: a["y"].to("meta"), ValueError,
        {"add_lora_": "y: expected a tensor on {dev} (the device of x), got meta",
         "expand_": "h: expected a tensor on meta (the device of y), got {dev}"}),
    Bad("h_on_meta", "h", lambda a, d: a["h"].to("meta"), ValueError,
        "h: expected a tensor on {dev} (the device of y), got meta"),
    Bad("scale_on_meta", "scale", lambda a, d: a["scale"].to("meta"), ValueError,
        "scale: expected a tensor on {dev} (the device of x), got meta"),
    Bad("rank_on_meta", "rank", lambda a, d: a["rank"].to("meta"), ValueError,
        {"add_lora_": "rank: expected a tensor on {dev} (the device of x), got meta",
         "shrink": "rank: expected a tensor on {dev} (the device of x), got meta",
         "expand_": "rank: expected a tensor on {dev} (the device of y), got meta"}),
    *(Bad(f"{meta}_on_meta", meta, lambda a, d, meta=meta: a[meta].to("meta"), ValueError,
          {op: f"{meta}: expected a tensor on {{dev}} (the device of {of}), got meta"
           for op, of in (("add_lora_", "x"), ("shrink", "x"), ("expand_", "y"))})
      for meta in ("sorted_token_ids", "slot_starts", "slot_counts")),
    # shapes
    Bad("x_3d", "x", lambda a, d: a["x"][None], ValueError, "x: expected a 2-D tensor, got shape (1, 4, 6)"),
    Bad("lora_a_3d", "lora_a", lambda a, d: a["lora_a"][0], ValueError,
        "lora_a: expected a 4-D tensor, got shape (2, 4, 6)"),
    Bad("lora_a_no_slices", "lora_a", lambda a, d: torch.zeros(L, 0, R, K, device=d), ValueError,
        {op: "lora_a: expected shape [L, S, R, K] with L, S, R >= 1, got (3, 0, 4, 6)" for op in ("add_lora_",
                                                                                                  "shrink")}),
    Bad("lora_a_k_not_x", "lora_a", lambda a, d: torch.zeros(L, S, R, K + 1, device=d), ValueError,
        "lora_a: expected shape [L, S, R, K] with K = 6 (x's features), got (3, 2, 4, 7)"),
    Bad("lora_b_rank_not_a", "lora_b", lambda a, d: torch.zeros(L, N, R + 1, device=d), ValueError,
        "lora_b: expected shape [L, N, R] = [3, 10, 4], got (3, 10, 5)"),
    Bad("lora_b_n_not_y", "lora_b", lambda a, d: torch.zeros(L, N - 1, R, device=d), ValueError,
        "lora_b: expected shape [L, N, R] = [3, 10, 4], got (3, 9, 4)"),
    Bad("lora_b_slots_not_a", "lora_b", lambda a, d: torch.zeros(L + 1, N, R, device=d), ValueError,
        {"add_lora_": "lora_b: expected shape [L, N, R] = [3, 10, 4], got (4, 10, 4)",
         "expand_": "rank: expected 4 entries (one per slot of lora_b), got 3"}),
    Bad("y_rows_not_x", "y", lambda a, d: torch.zeros(M + 1, N, device=d), ValueError,
        {"add_lora_": "y: expected 4 rows (x's tokens), got shape (5, 10)",
         "expand_": "h: expected 5 rows (y's tokens), got shape (4, 2, 4)"}),
    Bad("y_1d", "y", lambda a, d: torch.zeros(N, device=d), ValueError, "y: expected a 2-D tensor, got shape (10,)"),
    # y written in place: no two elements in one memory location (torch's own in-place ops refuse them too)
    Bad("y_expanded_row", "y", lambda a, d: torch.zeros(N, device=d).expand(M, N), ValueError,
        "y: written in place, but more than one of its elements refers to one memory location (shape (4, 10), "
        "strides (0, 1)"),
    Bad("y_overlapping_rows", "y", lambda a, d: torch.zeros(M * N, device=d).as_strided((M, N), (2, 1)),
        ValueError, "y: written in place, but more than one of its elements refers to one memory location "
                    "(shape (4, 10), strides (2, 1)"),
    Bad("h_rows_not_y", "h", lambda a, d: torch.zeros(M - 1, S, R, device=d), ValueError,
        "h: expected 4 rows (y's tokens), got shape (3, 2, 4)"),
    Bad("h_2d", "h", lambda a, d: torch.zeros(M, S * R, device=d), TypeError,
        "h: expected a 3-D float32 tensor [M, S, R] (the shrink output), got torch.float32 (4, 8)"),
    Bad("slice_widths_count", "slice_widths", lambda a, d: [N], ValueError,
        {"add_lora_": "slice_widths: expected 2 widths (one per slice of lora_a), got [10]",
         "expand_": "slice_widths: expected 2 widths (one per slice of h), got [10]"}),
    Bad("slice_widths_sum", "slice_widths", lambda a, d: [4, 5], ValueError,
        "slice_widths: expected positive widths summing to N = 10 (y's columns), got [4, 5]"),
    Bad("slice_widths_zero", "slice_widths", lambda a, d: [10, 0], ValueError,
        "slice_widths: expected positive widths summing to N = 10 (y's columns), got [10, 0]"),
    Bad("slice_widths_negative", "slice_widths", lambda a, d: [12, -2], ValueError,
        "slice_widths: expected positive widths summing to N = 10 (y's columns), got [12, -2]"),
    Bad("scale_length", "scale", lambda a, d: torch.ones(L + 1, device=d), ValueError,
        "scale: expected 3 entries (one per slot of lora_a), got 4"),
    Bad("scale_2d", "scale", lambda a, d: torch.ones(L, 1, device=d), TypeError,
        "scale: expected a 1-D float32 tensor of per-slot scales, got torch.float32 (3, 1)"),
    Bad("rank_length", "rank", lambda a, d: torch.ones(L - 1, dtype=torch.int32, device=d), ValueError,
        {"add_lora_": "rank: expected 3 entries (one per slot of lora_a), got 2",
         "shrink": "rank: expected 3 entries (one per slot of lora_a), got 2",
         "expand_": "rank: expected 3 entries (one per slot of lora_b), got 2"}),
    Bad("slot_starts_length", "slot_starts", lambda a, d: a["slot_starts"][:L], ValueError,
        f"slot_starts: expected 4 entries {META}, got 3"),
    Bad("slot_counts_length", "slot_counts", lambda a, d: torch.zeros(L + 2, dtype=torch.int32, device=d),
        ValueError, f"slot_counts: expected 4 entries {META}, got 5"),
    Bad("sorted_token_ids_shorter_than_M", "sorted_token_ids", lambda a, d: a["sorted_token_ids"][:M - 1],
        ValueError, {op: f"sorted_token_ids: holds 3 entries, fewer than the 4 tokens of {rows}; build the batch "
                         f"metadata with max_tokens >= 4" for op, rows in (("add_lora_", "x"), ("shrink", "x"),
                                                                            ("expand_", "y"))}),
    Bad("sorted_token_ids_2d", "sorted_token_ids", lambda a, d: a["sorted_token_ids"][None], ValueError,
        "sorted_token_ids: expected a 1-D tensor, got shape (1, 4)"),
]

CASES = [pytest.param(bad, op, id=f"{op}-{bad.name}") for bad in BAD for op in bad.ops()]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=list(ENTRY_POINTS))
@pytest.mark.parametrize("bad,op", CASES)
def test_bad_argument_raises_naming_it(backend, bad, op, entry):
    args = valid_args(backend.device)
    args[bad.arg] = bad.change(args, backend.device)
    message = bad.message_for(op).format(dev=args["x"].device)   # "cpu", "cuda:0"
    with pytest.raises(bad.error, match="^" + re.escape(message)):
        ENTRY_POINTS[entry](op, args)


@pytest.mark.parametrize("op", OPS)
def test_valid_arguments_pass(backend, op):
    """The starting point of every bad case is fine, through every entry point."""
    args = valid_args(backend.device)
    for call in ENTRY_POINTS.values():
        call(op, dict(args))
    call_with_slots(op, args, token_slots=slots([2, -1, 0, 1], backend.device))


def test_quick_checks_accept_the_valid_case(backend):
    """Each check's quick test of the valid case must pass it (else every call pays the detailed checks):
    K != N here, so a quick test that mixes up the output's and the weight's dimensions fails."""
    from csrc_meta import checks
    a = valid_args(backend.device)
    meta = (a["sorted_token_ids"], a["slot_starts"], a["slot_counts"])
    weight, bias = torch.randn(N, K, device=backend.device), torch.randn(N, device=backend.device)
    assert K != N
    assert checks._add_lora_ok(a["y"], a["x"], a["lora_a"], a["lora_b"], a["scale"], a["rank"], a["slice_widths"],
                               *meta)
    assert checks._shrink_ok(a["x"], a["lora_a"], a["scale"], a["rank"], *meta)
    assert checks._lora_linear_ok(a["x"], weight, bias, a["lora_a"], a["lora_b"], a["scale"], a["rank"],
                                  a["slice_widths"], *meta)
    assert checks._lora_linear_ok(a["x"], weight, None, a["lora_a"], a["lora_b"], a["scale"], a["rank"],
                                  a["slice_widths"], *meta)
    stacked = torch.cat([weight, a["lora_a"].reshape(-1, K)])
    padded = torch.cat([stacked, stacked.new_zeros(3, K)])   # zero rows a tuned layout puts after A
    for st in (stacked, padded):
        for stacked_bias in (torch.cat([bias, bias.new_zeros(st.shape[0] - N)]), None):
            assert checks._lora_linear_stacked_ok(a["x"], st, stacked_bias, a["lora_b"], a["scale"], a["rank"],
                                                  a["slice_widths"], *meta)
    dh = torch.randn(M, S, R, device=backend.device)
    assert checks._lora_grad_x_ok(dh, a["lora_a"], a["rank"], *meta)
    assert checks._segment_outer_ok(dh[:, 0], a["x"], a["rank"], *meta)
    grad_out = torch.randn(M, N, device=backend.device)
    assert checks._lora_grad_h_ok(grad_out, a["lora_b"], a["scale"], a["rank"], a["slice_widths"], *meta)
    assert checks._lora_grad_a_ok(dh, a["x"], a["rank"], *meta)
    assert checks._lora_grad_b_ok(grad_out, dh, a["rank"], a["slice_widths"], *meta)


def test_every_op_has_bad_cases():
    for op in OPS:
        assert sum(op in bad.ops() for bad in BAD) >= 15, op


# ------------------------------------------------------------------------------------------------
# token_slots / batch in the public API
# ------------------------------------------------------------------------------------------------
def call_with_slots(op, a, **slots_or_batch):
    if op == "add_lora_":
        return lora_ops.add_lora(a["y"], a["x"], a["lora_a"], a["lora_b"], a["scale"], a["rank"],
                                 slice_widths=a["slice_widths"], **slots_or_batch)
    if op == "shrink":
        return lora_ops.shrink(a["x"], a["lora_a"], a["scale"], a["rank"], **slots_or_batch)
    return lora_ops.expand(a["y"], a["h"], a["lora_b"], a["rank"], slice_widths=a["slice_widths"], **slots_or_batch)


def slots(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


EXACTLY_ONE = "token_slots / batch: pass exactly one of them"
BAD_SLOTS = [
    ("both", lambda a, d: dict(token_slots=slots([0, 1, 2, -1], d), batch=BatchMeta(
        a["sorted_token_ids"], a["slot_starts"], a["slot_counts"])), ValueError, EXACTLY_ONE),
    ("neither", lambda a, d: dict(), ValueError, EXACTLY_ONE),
    ("batch_is_a_tuple", lambda a, d: dict(batch=(a["sorted_token_ids"], a["slot_starts"], a["slot_counts"])),
     TypeError, "batch: expected a LoRABatch or BatchMeta, got tuple"),
    ("slot_equal_to_L", lambda a, d: dict(token_slots=slots([0, 3, 2, -1], d)), ValueError,
     "token_slots: slot 3 at token 1 is outside [-1, max_loras=3)"),
    ("slot_below_-1", lambda a, d: dict(token_slots=slots([0, 1, -2, -1], d, torch.int32)), ValueError,
     "token_slots: slot -2 at token 2 is outside [-1, max_loras=3)"),
    ("slots_float", lambda a, d: dict(token_slots=slots([0, 1, 2, -1], d, torch.float32)), TypeError,
     "token_slots: expected dtype int32 or int64, got torch.float32"),
    ("slots_2d", lambda a, d: dict(token_slots=slots([[0, 1], [2, -1]], d)), ValueError,
     "token_slots: expected a 1-D tensor [M], got shape (2, 2)"),
    ("slots_list", lambda a, d: dict(token_slots=[0, 1, 2, -1]), TypeError,
     "token_slots: expected a torch.Tensor of per-token slots, got list"),
    ("slots_too_few", lambda a, d: dict(token_slots=slots([0, 1, 2], d)), ValueError,
     "token_slots: expected 4 entries (one per token), got 3"),
    ("slots_too_many", lambda a, d: dict(token_slots=slots([0, 1, 2, -1, 0], d)), ValueError,
     "token_slots: expected 4 entries (one per token), got 5"),
    # (a tensor neither on x's device nor the CPU: torch's "Cannot copy out of meta tensor" came first)
    ("slots_on_meta", lambda a, d: dict(token_slots=torch.zeros(4, dtype=torch.int64, device="meta")), ValueError,
     "token_slots: expected a tensor on {where}, got one on meta"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("make_kwargs,error,message", [pytest.param(*c[1:], id=c[0]) for c in BAD_SLOTS])
def test_bad_token_slots_or_batch_raise(backend, op, make_kwargs, error, message):
    if backend.device != "cpu" and "outside" in message:
        pytest.skip("the slot range is checked on CPU only (no device sync)")
    args = valid_args(backend.device)
    where = "the CPU" if backend.device == "cpu" else f"{args['x'].device} or the CPU"
    with pytest.raises(error, match="^" + re.escape(message.format(where=where))):
        call_with_slots(op, args, **make_kwargs(args, backend.device))


# Arguments the functional API checks itself, before the op's checks: the tokens' tensor's dimensions (its
# first dimension was taken for the tokens: "token_slots: expected 1 entries"), a Python number for a tensor.
FUNCTIONAL_BAD = [
    ("tokens_3d", lambda a: {**a, "x": a["x"][None], "h": a["h"][None]}, {"expand_": TypeError, "": ValueError},
     {"add_lora_": "x: expected a 2-D tensor, got shape (1, 4, 6) (x [M, K]: its tokens flattened",
      "shrink": "x: expected a 2-D tensor, got shape (1, 4, 6) (x [M, K]: its tokens flattened",
      "expand_": "h: expected a 3-D float32 tensor [M, S, R] (the shrink output), got torch.float32 (1, 4, 2, 4)"}),
    ("tokens_1d", lambda a: {**a, "x": a["x"][0]}, ValueError,
     {"add_lora_": "x: expected a 2-D tensor [M, K], got shape (6,)",
      "shrink": "x: expected a 2-D tensor [M, K], got shape (6,)", "expand_": None}),
    ("scale_a_float", lambda a: {**a, "scale": 0.5}, TypeError, "scale: expected a tensor, got float 0.5"),
    ("no_columns", lambda a: {**a, "y": a["y"][:, :0], "lora_b": a["lora_b"][:, :0], "slice_widths": None},
     ValueError, {"add_lora_": "y: expected N >= 1 columns, got shape (4, 0)",
                  "expand_": "y: expected N >= 1 columns, got shape (4, 0)", "shrink": None}),
    # (int() truncated a float width: [3.9, 2.2] ran as [3, 2])
    ("slice_widths_float", lambda a: {**a, "slice_widths": [5.5, 4.5]}, TypeError,
     {"add_lora_": "slice_widths: expected integers, got 5.5", "expand_": "slice_widths: expected integers, got 5.5",
      "shrink": None}),
    # (LoRABatch's "max_loras >= 1" came first)
    ("no_slots", lambda a: {**a, "lora_a": a["lora_a"][:0], "lora_b": a["lora_b"][:0], "scale": a["scale"][:0],
                            "rank": a["rank"][:0]}, ValueError,
     {"add_lora_": "lora_a: expected at least one slot, got shape (0, 2, 4, 6)",
      "shrink": "lora_a: expected at least one slot, got shape (0, 2, 4, 6)",
      "expand_": "lora_b: expected at least one slot, got shape (0, 10, 4)"}),
    # (an IndexError from y.shape[1], an AttributeError from None.shape, "'int' object is not iterable")
    ("y_1d", lambda a: {**a, "y": a["y"][0], "slice_widths": None}, ValueError,
     {"add_lora_": "y: expected a 2-D tensor, got shape (10,)", "expand_": "y: expected a 2-D tensor, got shape "
      "(10,)", "shrink": None}),
    ("y_none", lambda a: {**a, "y": None}, TypeError,
     {"add_lora_": "y: expected a torch.Tensor, got NoneType", "expand_": "y: expected a torch.Tensor, got NoneType",
      "shrink": None}),
    ("x_none", lambda a: {**a, "x": None}, TypeError,
     {"add_lora_": "x: expected a torch.Tensor, got NoneType", "shrink": "x: expected a torch.Tensor, got NoneType",
      "expand_": None}),
    ("stacks_none", lambda a: {**a, "lora_a": None, "lora_b": None}, TypeError,
     {"add_lora_": "lora_a: expected a torch.Tensor, got NoneType",
      "shrink": "lora_a: expected a torch.Tensor, got NoneType",
      "expand_": "lora_b: expected a torch.Tensor, got NoneType"}),
    ("lora_b_none", lambda a: {**a, "lora_b": None}, TypeError,
     {"add_lora_": "lora_b: expected a torch.Tensor, got NoneType", "shrink": None,
      "expand_": "lora_b: expected a torch.Tensor, got NoneType"}),
    ("slice_widths_an_int", lambda a: {**a, "slice_widths": 10}, TypeError,
     {"add_lora_": "slice_widths: expected a sequence of integers, got 10",
      "expand_": "slice_widths: expected a sequence of integers, got 10", "shrink": None}),
    # (h's rows were counted as the tokens: the error blamed token_slots)
    ("h_rows", lambda a: {**a, "h": a["h"][:3]}, ValueError,
     {"expand_": "h: expected 4 rows (y's tokens), got shape (3, 2, 4)", "add_lora_": None,
      "shrink": None}),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["token_slots", "batch"])
@pytest.mark.parametrize("edit,error,message", [pytest.param(*c[1:], id=c[0]) for c in FUNCTIONAL_BAD])
def test_functional_api_names_its_bad_arguments(backend, op, kind, edit, error, message):
    if op == "expand_" and "scale" in str(message):
        pytest.skip("expand takes no scale")
    if isinstance(message, dict) and message.get(op, "") is None:
        pytest.skip(f"not an argument of {op}")
    args = valid_args(backend.device)
    given = dict(token_slots=slots([0, 1, 2, -1], backend.device)) if kind == "token_slots" else dict(
        batch=BatchMeta(args["sorted_token_ids"], args["slot_starts"], args["slot_counts"]))
    message = message[op] if isinstance(message, dict) else message
    error = error.get(op, error.get("")) if isinstance(error, dict) else error
    with pytest.raises(error, match="^" + re.escape(message)):
        call_with_slots(op, edit(args), **given)


@pytest.mark.parametrize("needs_grad", [False, True], ids=["no_grad", "autograd"])
def test_add_lora_refuses_a_y_with_overlapping_rows_with_autograd_too(backend, needs_grad):
    """functional.add_lora's autograd branch (an input requiring grad) writes y with copy_, which refuses a
    stride 0 but wrote rows that overlap, one token's delta over another's, silently."""
    args = valid_args(backend.device)
    y = torch.zeros(M * N, device=backend.device).as_strided((M, N), (2, 1))
    lora_a = args["lora_a"].clone().requires_grad_(needs_grad)
    with pytest.raises(ValueError, match=re.escape("y: written in place, but more than one of its elements refers "
                                                   "to one memory location (shape (4, 10), strides (2, 1)")):
        lora_ops.add_lora(y, args["x"], lora_a, args["lora_b"], args["scale"], args["rank"],
                          token_slots=slots([0, 1, 2, -1], backend.device), slice_widths=args["slice_widths"])
    # (the memory check after the op's own: a y of 3 dimensions is named as the op names it)
    with pytest.raises(ValueError, match=re.escape("y: expected a 2-D tensor, got shape (4, 10, 1)")):
        lora_ops.add_lora(torch.zeros(M, N, 1, device=backend.device), args["x"], lora_a, args["lora_b"],
                          args["scale"], args["rank"], token_slots=slots([0, 1, 2, -1], backend.device),
                          slice_widths=args["slice_widths"])


def test_lora_linear_stacked_names_the_stack_not_its_views(backend):
    """lora_linear_stacked's checks ran lora_linear's on the stack's views and named "weight" and "bias"."""
    args = valid_args(backend.device)
    x, lora_a, lora_b = args["x"], args["lora_a"], args["lora_b"]
    stack = torch.cat([torch.randn(N, K, device=x.device), lora_a.reshape(-1, K)])
    meta = (args["sorted_token_ids"], args["slot_starts"], args["slot_counts"])
    rest = (lora_b, args["scale"], args["rank"], args["slice_widths"], *meta)
    op = torch.ops.lora_ops.lora_linear_stacked
    with pytest.raises(ValueError, match=r"^stacked_weight \(its first N rows: the base weight\): expected shape "
                                         r"\[N, K\] with K = 5"):
        op(x[:, :-1], stack, None, *rest)
    with pytest.raises(TypeError, match=r"^stacked_bias \(its first N entries: the base bias\): expected dtype"):
        op(x, stack, torch.zeros(stack.shape[0], device=x.device, dtype=torch.float16), *rest)


def test_functional_api_moves_host_token_slots_to_the_tensors_device(backend):
    """Slots made on the host for tensors on another device: the metadata was built on the host, and the error
    named sorted_token_ids, which the caller never passed. They are checked there and moved (meta stands in for
    a GPU on this machine: the call then runs on meta)."""
    args = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in valid_args("cpu").items()}
    out = lora_ops.add_lora(args["y"], args["x"], args["lora_a"], args["lora_b"], args["scale"], args["rank"],
                            token_slots=slots([0, 1, 2, -1], "cpu"), slice_widths=args["slice_widths"])
    assert out.device.type == "meta"
    with pytest.raises(ValueError, match=r"token_slots: slot 7 at token 1 is outside \[-1, max_loras=3\)"):
        lora_ops.add_lora(args["y"], args["x"], args["lora_a"], args["lora_b"], args["scale"], args["rank"],
                          token_slots=slots([0, 7, 2, -1], "cpu"), slice_widths=args["slice_widths"])


# (lora_linear has no y: its messages name the output it returns, not "y's columns")
LINEAR_BAD = [
    ("weight_wrong_features", dict(weight=lambda a: torch.randn(N, K + 1, device=a["x"].device)), ValueError,
     "weight: expected shape [N, K] with K = 6 (x's features), got (10, 7)"),
    ("weight_dtype", dict(weight=lambda a: torch.randn(N, K, device=a["x"].device, dtype=torch.float16)),
     TypeError, "weight: expected dtype torch.float32 (the dtype of x), got torch.float16"),
    ("weight_1d", dict(weight=lambda a: torch.randn(N, device=a["x"].device)), ValueError,
     "weight: expected a 2-D tensor, got shape (10,)"),
    ("bias_wrong_length", dict(bias=lambda a: torch.randn(N + 1, device=a["x"].device)), ValueError,
     "bias: expected 10 entries (weight's rows), got 11"),
    ("bias_on_meta", dict(bias=lambda a: torch.randn(N, device="meta")), ValueError,
     "bias: expected a tensor on {dev} (the device of x), got meta"),
    ("lora_b_wrong_rank", dict(lora_b=lambda a: torch.randn(L, N, R + 1, device=a["x"].device)), ValueError,
     "lora_b: expected shape [L, N, R] = [3, 10, 4], got (3, 10, 5)"),
    ("lora_b_dtype", dict(lora_b=lambda a: torch.randn(L, N, R, device=a["x"].device, dtype=torch.float16)),
     TypeError, "lora_b: expected dtype torch.float32 (the dtype of x), got torch.float16"),
    ("widths_not_summing_to_N", dict(slice_widths=lambda a: [4, 5]), ValueError,
     "slice_widths: expected positive widths summing to N = 10 (the output's columns), got [4, 5]"),
]


@pytest.mark.parametrize("change,error,message", [pytest.param(*c[1:], id=c[0]) for c in LINEAR_BAD])
def test_lora_linear_bad_argument_raises_naming_it(backend, change, error, message):
    args = valid_args(backend.device)
    args["weight"] = torch.randn(N, K, device=backend.device)
    args["bias"] = torch.randn(N, device=backend.device)
    for name, make in change.items():
        args[name] = make(args)
    meta = (args["sorted_token_ids"], args["slot_starts"], args["slot_counts"])
    with pytest.raises(error, match="^" + re.escape(message.format(dev=args["x"].device)) + "$"):
        torch.ops.lora_ops.lora_linear(args["x"], args["weight"], args["bias"], args["lora_a"], args["lora_b"],
                                       args["scale"], args["rank"], args["slice_widths"], *meta)


# The backward's slice ops (lora_ops.autograd calls them): (op, changes, error, message). Valid arguments:
# grad_out [M, N], lora_b [L, N, R], dh / h [M, S, R] float32, x [M, K].
GRAD_OPS = {
    "lora_grad_h": lambda a, meta: torch.ops.lora_ops.lora_grad_h(a["grad_out"], a["lora_b"], a["scale"], a["rank"],
                                                                  a["slice_widths"], *meta),
    "lora_grad_a": lambda a, meta: torch.ops.lora_ops.lora_grad_a(a["h"], a["x"], a["rank"], *meta),
    "lora_grad_b": lambda a, meta: torch.ops.lora_ops.lora_grad_b(a["grad_out"], a["h"], a["rank"], a["slice_widths"],
                                                                  *meta),
    "lora_grad_x": lambda a, meta: torch.ops.lora_ops.lora_grad_x(a["h"], a["lora_a"], a["rank"], *meta),
    "segment_outer": lambda a, meta: torch.ops.lora_ops.segment_outer(a["h"][:, 0], a["x"], a["rank"], *meta),
}
GRAD_BAD = [
    ("h_grad_out_int", "lora_grad_h", dict(grad_out=lambda a: a["grad_out"].to(torch.int32)), TypeError,
     f"grad_out: {FLOATS}, got torch.int32"),
    ("h_grad_out_3d", "lora_grad_h", dict(grad_out=lambda a: a["grad_out"][None]), ValueError,
     "grad_out: expected a 2-D tensor, got shape (1, 4, 10)"),
    ("h_lora_b_dtype", "lora_grad_h", dict(lora_b=lambda a: a["lora_b"].half()), TypeError,
     "lora_b: expected dtype torch.float32 (the dtype of grad_out), got torch.float16"),
    ("h_lora_b_columns", "lora_grad_h", dict(lora_b=lambda a: a["lora_b"][:, :9]), ValueError,
     "lora_b: expected shape [L, N, R] = [3, 10, 4], got (3, 9, 4)"),
    ("h_lora_b_on_meta", "lora_grad_h", dict(lora_b=lambda a: a["lora_b"].to("meta")), ValueError,
     "lora_b: expected a tensor on {dev} (the device of grad_out), got meta"),
    ("h_widths_not_summing", "lora_grad_h", dict(slice_widths=lambda a: [4, 5]), ValueError,
     "slice_widths: expected positive widths summing to N = 10 (grad_out's columns), got [4, 5]"),
    ("h_scale_length", "lora_grad_h", dict(scale=lambda a: a["scale"][:2]), ValueError,
     "scale: expected 3 entries (one per slot of lora_b), got 2"),
    ("h_rank_length", "lora_grad_h", dict(rank=lambda a: a["rank"][:2]), ValueError,
     "rank: expected 3 entries (one per slot of lora_b), got 2"),
    ("h_ids_too_few", "lora_grad_h", dict(sorted_token_ids=lambda a: a["sorted_token_ids"][:3]), ValueError,
     "sorted_token_ids: holds 3 entries, fewer than the 4 tokens of grad_out"),
    ("a_ids_too_few", "lora_grad_a", dict(sorted_token_ids=lambda a: a["sorted_token_ids"][:3]), ValueError,
     "sorted_token_ids: holds 3 entries, fewer than the 4 tokens of dh"),
    ("b_ids_too_few", "lora_grad_b", dict(sorted_token_ids=lambda a: a["sorted_token_ids"][:3]), ValueError,
     "sorted_token_ids: holds 3 entries, fewer than the 4 tokens of h"),
    ("a_dh_half", "lora_grad_a", dict(h=lambda a: a["h"].half()), TypeError,
     "dh: expected a 3-D float32 tensor [M, S, R] (the gradient of the shrink output), got torch.float16"),
    ("a_x_rows", "lora_grad_a", dict(x=lambda a: a["x"][:3]), ValueError,
     "x: expected 4 rows (dh's tokens), got shape (3, 6)"),
    ("a_x_int", "lora_grad_a", dict(x=lambda a: a["x"].to(torch.int32)), TypeError,
     f"x: {FLOATS}, got torch.int32"),
    ("a_x_on_meta", "lora_grad_a", dict(x=lambda a: a["x"].to("meta")), ValueError,
     "x: expected a tensor on {dev} (the device of dh), got meta"),
    ("a_rank_int64", "lora_grad_a", dict(rank=lambda a: a["rank"].long()), TypeError,
     "rank: expected dtype torch.int32, got torch.int64"),
    ("a_starts_length", "lora_grad_a", dict(slot_starts=lambda a: a["slot_starts"][:3]), ValueError,
     f"slot_starts: expected 4 entries {META}, got 3"),
    ("b_h_half", "lora_grad_b", dict(h=lambda a: a["h"].half()), TypeError,
     "h: expected a 3-D float32 tensor [M, S, R] (the shrink output), got torch.float16"),
    ("b_h_rows", "lora_grad_b", dict(h=lambda a: a["h"][:3]), ValueError,
     "h: expected 4 rows (grad_out's tokens), got shape (3, 2, 4)"),
    ("b_widths_count", "lora_grad_b", dict(slice_widths=lambda a: [10]), ValueError,
     "slice_widths: expected 2 widths (one per slice of h), got [10]"),
    ("b_grad_out_float64", "lora_grad_b", dict(grad_out=lambda a: a["grad_out"].double()), TypeError,
     f"grad_out: {FLOATS}, got torch.float64"),
    ("b_rank_on_meta", "lora_grad_b", dict(rank=lambda a: a["rank"].to("meta")), ValueError,
     "rank: expected a tensor on {dev} (the device of grad_out), got meta"),
    ("b_counts_int64", "lora_grad_b", dict(slot_counts=lambda a: a["slot_counts"].long()), TypeError,
     "slot_counts: expected dtype torch.int32, got torch.int64"),
    ("h_scale_on_meta", "lora_grad_h", dict(scale=lambda a: a["scale"].to("meta")), ValueError,
     "scale: expected a tensor on {dev} (the device of grad_out), got meta"),
    ("h_ids_on_meta", "lora_grad_h", dict(sorted_token_ids=lambda a: a["sorted_token_ids"].to("meta")), ValueError,
     "sorted_token_ids: expected a tensor on {dev} (the device of grad_out), got meta"),
    ("a_dh_no_slices", "lora_grad_a", dict(h=lambda a: torch.zeros(M, 0, R, device=a["x"].device)), ValueError,
     "dh: expected shape [M, S, R] with S, R >= 1, got (4, 0, 4)"),
    ("b_h_rank_0", "lora_grad_b", dict(h=lambda a: torch.zeros(M, S, 0, device=a["x"].device)), ValueError,
     "h: expected shape [M, S, R] with R >= 1, got (4, 2, 0)"),
    ("x_dh_rank", "lora_grad_x", dict(h=lambda a: torch.randn(M, S, R + 1, device=a["x"].device)), ValueError,
     "dh: expected shape [M, S, R] with S, R = (2, 4) (lora_a's slices and rank), got (4, 2, 5)"),
    ("x_dh_half", "lora_grad_x", dict(h=lambda a: a["h"].half()), TypeError,
     "dh: expected a 3-D float32 tensor [M, S, R] (the gradient of the shrink output), got torch.float16 (4, 2, 4)"),
    ("x_lora_a_on_meta", "lora_grad_x", dict(lora_a=lambda a: a["lora_a"].to("meta")), ValueError,
     "lora_a: expected a tensor on {dev} (the device of dh), got meta"),
    ("x_rank_length", "lora_grad_x", dict(rank=lambda a: a["rank"][:2]), ValueError,
     "rank: expected 3 entries (one per slot of lora_a), got 2"),
    ("outer_v_rows", "segment_outer", dict(x=lambda a: a["x"][:3]), ValueError,
     "v: expected 4 rows (u's tokens), got shape (3, 6)"),
    ("outer_u_half", "segment_outer", dict(h=lambda a: a["h"].half()), TypeError,
     "u: expected a 2-D float32 tensor [M, P] (the rank-side factor), got torch.float16 (4, 4)"),
    ("outer_rank_int64", "segment_outer", dict(rank=lambda a: a["rank"].long()), TypeError,
     "rank: expected dtype torch.int32, got torch.int64"),
]


@pytest.mark.parametrize("op,change,error,message", [pytest.param(*c[1:], id=c[0]) for c in GRAD_BAD])
def test_backward_slice_op_bad_argument_raises_naming_it(backend, op, change, error, message):
    args = valid_args(backend.device)
    args["grad_out"] = torch.randn(M, N, device=backend.device)
    for name, make in change.items():
        args[name] = make(args)
    meta = (args["sorted_token_ids"], args["slot_starts"], args["slot_counts"])
    dev = args["grad_out"].device          # "cpu", "cuda:0": the message names the tensor's device
    with pytest.raises(error, match="^" + re.escape(message.format(dev=dev))):
        GRAD_OPS[op](args, meta)


@pytest.mark.parametrize("op", list(GRAD_OPS))
def test_backward_slice_op_valid_arguments_pass(backend, op):
    args = valid_args(backend.device)
    args["grad_out"] = torch.randn(M, N, device=backend.device)
    GRAD_OPS[op](args, (args["sorted_token_ids"], args["slot_starts"], args["slot_counts"]))


def test_interpreter_too_old_for_numpy_names_the_fix(monkeypatch):
    """Triton < 3.7's interpreter cannot take numpy 2 (triton_launch.interpreter_problem): CPU tensors sent
    to the Triton kernels raise saying what to install, instead of failing deep inside the interpreter."""
    import numpy

    from lora_ops import ops, triton_launch
    monkeypatch.setattr(triton_launch, "_triton_version", lambda: (3, 6))
    monkeypatch.setattr(numpy, "__version__", "2.1.0")
    assert "numpy<2" in triton_launch.interpreter_problem()
    monkeypatch.setattr(ops, "_interpreter_checked", [])
    monkeypatch.setattr(ops, "_cpu_backend", "triton")
    case = make_case(3, 8, 8, 2, 1, 4, dtype=torch.float32, device="cpu", seed=1)
    with pytest.raises(RuntimeError, match="Triton >= 3.7"):
        lora_ops.add_lora(case.new_y("zero"), case.x, case.lora_a, case.lora_b, case.scale, case.rank,
                          batch=case.meta, slice_widths=case.slice_widths)
    monkeypatch.setattr(numpy, "__version__", "1.26.4")
    assert "numpy" not in (triton_launch.interpreter_problem() or "")    # (a GPU run's: the interpreter is off)


@pytest.mark.parametrize("when", ["never", "after_triton"])
def test_triton_backend_without_the_interpreter_names_it(when):
    """set_cpu_backend('triton') where Triton's interpreter is off (never set, or set after Triton was imported:
    its kernels and helpers were defined for the GPU compiler): the first call names TRITON_INTERPRET, where it
    had raised torch's missing _cuda_getDevice or "Cannot call @triton.jit'd outside of the scope of a
    kernel"."""
    import subprocess
    import sys

    import numpy

    from lora_ops import triton_launch
    if triton_launch._triton_version() < (3, 7) and int(numpy.__version__.split(".")[0]) >= 2:
        pytest.skip("this Triton's interpreter cannot take numpy 2, which it names first "
                    "(test_interpreter_too_old_for_numpy_names_the_fix)")
    code = ("import os, torch, triton\n" + ("os.environ['TRITON_INTERPRET'] = '1'\n" if when == "after_triton" else "")
            + "import lora_ops\nlora_ops.ops.set_cpu_backend('triton')\n"
            "a, b = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 4)\n"
            "lora_ops.add_lora(torch.zeros(3, 6), torch.randn(3, 8), a, b, torch.ones(2), "
            "torch.tensor([4, 4], dtype=torch.int32), token_slots=torch.tensor([0, 1, -1]))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1 and "RuntimeError: set_cpu_backend('triton'): Triton's interpreter is off" in (
        done.stderr), done.stderr[-2000:]
    assert "set TRITON_INTERPRET=1 in the environment before anything imports Triton" in done.stderr


def test_too_many_token_tiles_raise_before_any_launch(monkeypatch):
    """CUDA holds at most 65535 programs on a grid's second and third axes, and the token tiles sit on the
    second (several million tokens in one call): a clear error when the launch is built, before anything
    runs. The expand's rank loop with its token tiles first (large B) puts them on the first axis instead."""
    from lora_ops import launch
    from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig
    case = make_case(40, 8, 12, 2, 1, 8, dtype=torch.float32, device="cpu", seed=3)
    h = torch.zeros(1, 40, 1, 8)
    expand_cfg = ExpandConfig(16, 16, 4, 4, 2)     # rank 8 past block_r 4: the rank loop
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)  # 40 tokens in tiles of 16 make 3 + 2 slots' tiles
    with pytest.raises(ValueError, match="^x: too many tokens for one call: shrink_kernel's grid"):
        launch.launch_shrink(case.x, case.lora_a, case.scale, case.rank, *case.meta, h, ShrinkConfig(16, 8, 8, 1, 4, 2),
                             run=False)
    monkeypatch.setattr(launch, "TOKENS_FIRST_MIN_B_BYTES", 1 << 62)
    with pytest.raises(ValueError, match="^x: too many tokens for one call: expand_kernel's grid"):
        launch.launch_expand(case.new_y("zero"), h, case.lora_b, case.slice_widths, case.rank, *case.meta,
                             expand_cfg, run=False)
    monkeypatch.setattr(launch, "TOKENS_FIRST_MIN_B_BYTES", 0)
    lc = launch.launch_expand(case.new_y("zero"), h, case.lora_b, case.slice_widths, case.rank, *case.meta,
                              expand_cfg, run=False)
    assert lc.constexprs["TOKENS_FIRST"] and lc.grid[0] > 2 >= lc.grid[1], lc.grid


def test_segment_outer_grid_limit_names_the_slots(monkeypatch):
    """The backward's segment_outer puts u's rank blocks on grid axis 1 and the slots on axis 2, not the
    token tiles (its tokens are a loop): past CUDA's limit its error names the slots, not "too many tokens"."""
    from lora_ops import launch, launch_grad
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)
    M, P, Q, L = 20, 8, 16, 3
    case = make_case(M, 8, 12, L, 1, P, dtype=torch.float32, device="cpu", seed=4)
    cfg = launch_grad.segment_outer_config(P, Q, L)
    u, v = torch.randn(M, P), torch.randn(M, Q)
    with pytest.raises(ValueError, match="^rank: too many slots for one launch: segment_outer_kernel's grid "
                                         r"\(\d+, 1, 3\) .*axis 1 counts u's rank blocks, axis 2 the slots"):
        launch_grad.launch_segment_outer(torch.empty(L, P, Q), u, v, case.rank, *case.meta, cfg, run=False)
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 3)
    launch_grad.launch_segment_outer(torch.empty(L, P, Q), u, v, case.rank, *case.meta, cfg, run=False)


@settings(max_examples=300, deadline=None)
@given(shape=strategies.tuples(strategies.integers(0, 6), strategies.integers(0, 6)),
       strides=strategies.tuples(strategies.integers(0, 9), strategies.integers(0, 9)))
def test_written_in_place_check_is_exact_for_two_dimensions(shape, strides):
    """check_written_in_place refuses an output exactly when two of its elements share an offset (brute force
    over every pair): legal odd layouts (transposed, a column block of a wider tensor, strides (3, 2) over two
    columns) pass, expanded and overlapping ones do not."""
    from csrc_meta.checks import check_written_in_place
    t = torch.empty(6 * 9 * 2).as_strided(shape, strides)   # (the largest offset: 5 * 9 * 2)
    offsets = [i * strides[0] + j * strides[1] for i in range(shape[0]) for j in range(shape[1])]
    overlaps = len(set(offsets)) != len(offsets)
    if overlaps:
        with pytest.raises(ValueError, match="more than one of its elements refers to one memory location"):
            check_written_in_place("y", t)
    else:
        check_written_in_place("y", t)


@pytest.mark.parametrize("value", [R + 1, -1], ids=["above_capacity", "negative"])
@pytest.mark.parametrize("op", [*OPS, "lora_forward"])
def test_rank_outside_the_stack_raises_through_the_api_on_cpu_tensors(value, op):
    """A CPU rank tensor's values are checked as token_slots' are (no device sync): the kernels would clamp a
    rank above the stack's capacity R, or below 0, and compute something nobody asked for."""
    a = valid_args("cpu")
    a["rank"] = a["rank"].clone()
    a["rank"][1] = value
    with pytest.raises(ValueError, match=rf"rank: slot 1 has rank {value}, outside \[0, R={R}\]"):
        if op == "lora_forward":
            lora_ops.lora_forward(a["y"], a["x"], a["lora_a"], a["lora_b"], a["scale"], a["rank"],
                                  batch=BatchMeta(a["sorted_token_ids"], a["slot_starts"], a["slot_counts"]),
                                  slice_widths=a["slice_widths"])
        else:
            call_public(op, a)


def test_lora_batch_filled_for_another_token_count_raises(backend):
    """A LoRABatch passed as ``batch`` carries its last update's token count: one for more or fewer tokens than
    the input served the extra rows no adapter (or ignored some) without a word."""
    a = valid_args(backend.device)
    for filled in ([0, 1, 2], [0, 1, 2, -1, 0]):
        batch = lora_ops.LoRABatch(8, L, device=backend.device)
        batch.update(slots(filled, backend.device))
        for op in OPS:
            with pytest.raises(ValueError, match=rf"^batch: filled for {len(filled)} tokens .* the input has {M}"):
                call_with_slots(op, a, batch=batch)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=list(ENTRY_POINTS))
@pytest.mark.parametrize("op,wants", [("add_lora_", "x"), ("add_lora_", "lora_b"), ("add_lora_", "scale"),
                                      ("shrink", "lora_a"), ("shrink", "scale"), ("expand_", "h")])
def test_ops_without_a_gradient_refuse_inputs_that_require_one(backend, op, wants, entry):
    """The in-place ops and shrink have no backward formula: torch's fallback ran them under grad mode and the
    gradients came back without the LoRA term (A and B's None, x's the base layer's alone), no error. They
    refuse now; lora_ops.add_lora, the public in-place call, computes a differentiable result instead. A scale
    that requires grad too (session 54: shrink's h came back requiring grad and scale's gradient None, silently;
    the differentiable ops document that the scale takes none)."""
    a = valid_args(backend.device)
    a[wants] = a[wants].clone().requires_grad_()
    y0 = a["y"].clone()
    if op == "add_lora_" and entry == "api":
        want = lora_ops.lora_forward(y0, a["x"], a["lora_a"], a["lora_b"], a["scale"], a["rank"],
                                     batch=BatchMeta(a["sorted_token_ids"], a["slot_starts"], a["slot_counts"]),
                                     slice_widths=a["slice_widths"])
        out = call_public(op, a)
        assert out is a["y"] and torch.equal(out, want)
        if wants == "scale":    # (no gradient for the scale: README)
            return
        assert out.requires_grad
        grad_out = torch.randn_like(out)
        got, = torch.autograd.grad(out, a[wants], grad_out)
        expected, = torch.autograd.grad(want, a[wants], grad_out)
        assert torch.equal(got, expected)
        return
    note = r".*; the scale gets a gradient from no lora_ops op: pass scale.detach\(\)$" if wants == "scale" else ""
    with pytest.raises(RuntimeError, match=rf"lora_ops::{op} has no gradient, but {wants} requires grad: use {note}"):
        ENTRY_POINTS[entry](op, a)
    assert torch.equal(a["y"], y0)
    with torch.no_grad():
        ENTRY_POINTS[entry](op, a)


def test_stacked_layer_op_refuses_inputs_that_require_grad(backend):
    """lora_linear_stacked (stack_a, inference only) under grad mode returned its GEMM's graph alone: x's
    gradient without the delta's term."""
    from lora_ops.layers import stacked_weight
    a = valid_args(backend.device)
    weight = torch.randn(N, K, device=backend.device)
    stacked = stacked_weight(weight, a["lora_a"])
    meta = (a["sorted_token_ids"], a["slot_starts"], a["slot_counts"])
    for wants in ("x", "scale"):
        x, scale = a["x"].clone(), a["scale"].clone()
        (x if wants == "x" else scale).requires_grad_()
        args = (x, stacked, None, a["lora_b"], scale, a["rank"], a["slice_widths"], *meta)
        for run in (lambda: lora_ops.ops.call("lora_linear_stacked", *args),
                    lambda: torch.ops.lora_ops.lora_linear_stacked(*args)):
            with pytest.raises(RuntimeError, match=rf"lora_ops::lora_linear_stacked has no gradient, but {wants} "
                                                   rf"requires grad: .*stack_a is inference only"):
                run()
            with torch.no_grad():
                assert run().shape[0] == M


@pytest.mark.parametrize("op", ["add_lora_", "expand_"])
def test_inference_tensor_written_outside_inference_mode_raises(backend, op):
    """y made under torch.inference_mode, written in place outside it: torch's own in-place ops (the torch CPU
    path) refuse; the Triton kernels wrote it. Both refuse now, naming y; inside inference mode it is fine."""
    a = valid_args(backend.device)
    with torch.inference_mode():
        a["y"] = a["y"].clone()
    for entry in ENTRY_POINTS.values():
        with pytest.raises(RuntimeError, match=r"^y: written in place, but it is an inference tensor"):
            entry(op, a)
    with torch.inference_mode():
        call_public(op, a)
