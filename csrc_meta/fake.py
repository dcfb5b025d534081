"""Fake (meta) kernels: output sizes from input sizes only, plus the shared argument checks."""
import torch

from csrc_meta import checks


@torch.library.register_fake("lora_ops::shrink")
def shrink_fake(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_shrink(x, lora_a, scale, rank, sorted_token_ids, slot_starts, slot_counts)
    _, S, R, _ = lora_a.shape
    return x.new_empty((x.shape[0], S, R), dtype=torch.float32)


@torch.library.register_fake("lora_ops::expand_")
def expand_fake(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_expand(y, h, lora_b, slice_widths, rank, sorted_token_ids, slot_starts, slot_counts)


@torch.library.register_fake("lora_ops::add_lora_")
def add_lora_fake(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_add_lora_(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                           slot_counts)


@torch.library.register_fake("lora_ops::lora_linear")
def lora_linear_fake(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                     slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_lora_linear(x, weight, bias, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids,
                             slot_starts, slot_counts)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("lora_ops::lora_linear_stacked")
def lora_linear_stacked_fake(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths, sorted_token_ids,
                             slot_starts, slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_lora_linear_stacked(x, stacked_weight, stacked_bias, lora_b, scale, rank, slice_widths,
                                     sorted_token_ids, slot_starts, slot_counts)
    return x.new_empty((x.shape[0], stacked_weight.shape[0]))


@torch.library.register_fake("lora_ops::add_lora")
def add_lora_functional_fake(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                             slot_counts):
    checks.refuse_frozen_fakes()
    checks.check_add_lora(y, x, lora_a, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                          slot_counts)
    return y.new_empty(y.shape)


@torch.library.register_fake("lora_ops::lora_grad_x")
def lora_grad_x_fake(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.check_lora_grad_x(dh, lora_a, rank, sorted_token_ids, slot_starts, slot_counts)
    return lora_a.new_empty((dh.shape[0], lora_a.shape[3]))


@torch.library.register_fake("lora_ops::segment_outer")
def segment_outer_fake(u, v, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.check_segment_outer(u, v, rank, sorted_token_ids, slot_starts, slot_counts)
    return v.new_empty((rank.shape[0], u.shape[1], v.shape[1]))


@torch.library.register_fake("lora_ops::lora_grad_h")
def lora_grad_h_fake(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    checks.check_lora_grad_h(grad_out, lora_b, scale, rank, slice_widths, sorted_token_ids, slot_starts,
                             slot_counts)
    return grad_out.new_empty((grad_out.shape[0], len(slice_widths), lora_b.shape[2]), dtype=torch.float32)


@torch.library.register_fake("lora_ops::lora_grad_a")
def lora_grad_a_fake(dh, x, rank, sorted_token_ids, slot_starts, slot_counts):
    checks.check_lora_grad_a(dh, x, rank, sorted_token_ids, slot_starts, slot_counts)
    return x.new_empty((rank.shape[0], dh.shape[1], dh.shape[2], x.shape[1]))


@torch.library.register_fake("lora_ops::lora_grad_b")
def lora_grad_b_fake(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts):
    checks.check_lora_grad_b(grad_out, h, rank, slice_widths, sorted_token_ids, slot_starts, slot_counts)
    return grad_out.new_empty((rank.shape[0], grad_out.shape[1], h.shape[2]))
