"""Schemas of the lora_ops operators.

Shapes (L slots, S packed output slices, R max rank, K input features, N output features, M tokens,
T >= M metadata capacity):
    x [M, K]            lora_a [L, S, R, K]      lora_b [L, N, R]     y [M, N]
    scale [L] float32   rank [L] int32           slice_widths: S ints summing to N
    sorted_token_ids [T] int32, slot_starts [L+1] int32, slot_counts [L+1] int32
                        (lora_ops.batch builds these; entry L counts the tokens with no adapter)
    The metadata partitions the M tokens: sorted_token_ids names each of 0..M-1 once, in the run of its
    slot (or in run L). lora_linear's write-first path, lora_grad_x, shrink and lora_grad_h write the rows it
    names into a fresh output (zeros where a token has no delta); a row it does not name would be left unwritten.

shrink     h[t, i, r] = scale[s_t] * x[t] . lora_a[s_t, i, r]      (r < rank[s_t]; else 0; 0 for s_t = -1)
expand_    y[t, slice i] += h[t, i, :rank] @ lora_b[s_t, slice i, :rank]^T             (in place)
add_lora_  y[t, slice i] += scale[s_t] (x[t] lora_a[s_t, i, :rank]^T) lora_b[s_t, slice i, :rank]^T
                                                            (in place; the hot path: one call a layer)
Rows whose slot is -1 are left untouched.
lora_linear  out = x weight^T + bias + the add_lora_ delta         (a whole LoRALinear layer in one op: the
                    base GEMM and the LoRA kernels; differentiable in x, weight, bias, lora_a, lora_b)
lora_linear_stacked  out = x stacked_weight^T + stacked_bias, then out[t, slice i of :N] +=
                    scale[s_t] h[t, s_t, i, :rank] @ lora_b[s_t, slice i, :rank]^T, h = out[:, N:N+L*S*R]
                    as [M, L, S, R]. stacked_weight [N + L*S*R + P, K] holds the base weight [N, K] over
                    lora_a [L, S, R, K] (flattened), then P >= 0 padding rows (a row count cuBLAS handles
                    well; the GEMM may take only some of them at a token count, as the GPU's table says);
                    stacked_bias [N + L*S*R + P] (zeros past N) or None; out [M, N + L*S*R + P]: the layer's
                    output in columns :N, every slot's unscaled h (in x's dtype) in N:N+L*S*R, and in the
                    padding's columns unspecified values (never read). One GEMM computes y and h (no shrink launch);
                    inference only (no autograd).

Autograd (lora_ops.autograd registers the kernels and the backward formula):
add_lora       out = y + the add_lora_ delta, out of place; differentiable in y, x, lora_a, lora_b
lora_grad_x    dx[t] = sum_i dh[t, i, :rank] @ lora_a[s_t, i, :rank]      dh [M, S, R] float32; 0 for s_t = -1
segment_outer  out[l, :rank[l]] = sum over slot l's tokens t of u[t, :rank[l]]^T v[t]
                    u [M, P] float32, v [M, Q], out [L, P, Q] in v's dtype; rows >= rank[l] are 0
The backward of the delta uses these (every slice in one launch; grad_out [M, N] = the output's gradient):
lora_grad_h    dh[t, i, r] = scale[s_t] * grad_out[t, slice i] . lora_b[s_t, slice i, r]
                    dh [M, S, R] float32 (r < rank[s_t]; else 0; 0 for s_t = -1)
lora_grad_a    dA[l, i, :rank[l]] = sum over slot l's tokens t of dh[t, i, :rank[l]]^T x[t]
                    dh [M, S, R] float32, x [M, K], dA [L, S, R, K] in x's dtype; rows >= rank[l] are 0
lora_grad_b    dB[l, slice i, :rank[l]] = sum over slot l's tokens t of grad_out[t, slice i]^T h[t, i, :rank[l]]
                    h [M, S, R] float32, dB [L, N, R] in grad_out's dtype; columns >= rank[l] are 0
"""
import torch

LIB = torch.library.Library("lora_ops", "DEF")

_META = "Tensor sorted_token_ids, Tensor slot_starts, Tensor slot_counts"

OPS = {
    "shrink": f"shrink(Tensor x, Tensor lora_a, Tensor scale, Tensor rank, {_META}) -> Tensor",
    "expand_": f"expand_(Tensor(a!) y, Tensor h, Tensor lora_b, int[] slice_widths, Tensor rank, {_META}) -> ()",
    "add_lora_": ("add_lora_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scale, Tensor rank, "
                  f"int[] slice_widths, {_META}) -> ()"),
    "lora_linear": ("lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, Tensor scale, "
                    f"Tensor rank, int[] slice_widths, {_META}) -> Tensor"),
    "lora_linear_stacked": ("lora_linear_stacked(Tensor x, Tensor stacked_weight, Tensor? stacked_bias, "
                            f"Tensor lora_b, Tensor scale, Tensor rank, int[] slice_widths, {_META}) -> Tensor"),
    "add_lora": ("add_lora(Tensor y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scale, Tensor rank, "
                 f"int[] slice_widths, {_META}) -> Tensor"),
    "lora_grad_x": f"lora_grad_x(Tensor dh, Tensor lora_a, Tensor rank, {_META}) -> Tensor",
    "segment_outer": f"segment_outer(Tensor u, Tensor v, Tensor rank, {_META}) -> Tensor",
    "lora_grad_h": ("lora_grad_h(Tensor grad_out, Tensor lora_b, Tensor scale, Tensor rank, int[] slice_widths, "
                    f"{_META}) -> Tensor"),
    "lora_grad_a": f"lora_grad_a(Tensor dh, Tensor x, Tensor rank, {_META}) -> Tensor",
    "lora_grad_b": f"lora_grad_b(Tensor grad_out, Tensor h, Tensor rank, int[] slice_widths, {_META}) -> Tensor",
}

for _schema in OPS.values():
    LIB.define(_schema)

# Ops with no backward formula, and what to call instead. Called with an input that requires grad while grad
# mode is on, torch's fallback let them through: an in-place op's delta went unseen by autograd,
# lora_linear_stacked's output carried its GEMM's graph alone, and the gradients came back partial with no
# error. Their checks (csrc_meta.checks.check_no_gradient, in the kernels and the fake kernels) refuse instead.
NOT_DIFFERENTIABLE = {
    "shrink": "lora_ops.lora_forward (differentiable) or torch.no_grad()",
    "expand_": "lora_ops.lora_forward (differentiable) or torch.no_grad()",
    "add_lora_": "lora_ops.add_lora or lora_ops.lora_forward (differentiable) or torch.no_grad()",
    "lora_linear_stacked": "lora_linear (differentiable) or torch.no_grad(); stack_a is inference only",
}
