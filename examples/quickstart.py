"""The functional API in thirty lines: one packed q/k/v layer, four adapters of different ranks, a mixed
batch (tokens in any order, some with no adapter), checked against the float64 reference.

    python examples/quickstart.py              # CPU (the vectorised torch kernels)
    python examples/quickstart.py --device cuda
"""
import argparse

import torch

import lora_ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = ap.parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)

    K, widths, max_rank, slots = 256, [256, 64, 64], 32, 4          # a q/k/v layer packed into one Linear
    base = torch.nn.Linear(K, sum(widths), bias=False, device=dev, dtype=dtype)
    lora_a = torch.randn(slots, len(widths), max_rank, K, device=dev, dtype=dtype) / K ** 0.5
    lora_b = torch.randn(slots, sum(widths), max_rank, device=dev, dtype=dtype) / max_rank ** 0.5
    rank = torch.tensor([8, 16, 32, 4], dtype=torch.int32, device=dev)   # each slot at its own rank
    scale = (16.0 / rank).float()                                         # lora_alpha / r

    x = torch.randn(48, K, device=dev, dtype=dtype)
    token_slots = torch.randint(-1, slots, (48,), device=dev)             # -1: no adapter, any order
    y = base(x)
    lora_ops.add_lora(y, x, lora_a, lora_b, scale, rank, token_slots=token_slots, slice_widths=widths)

    ref = x.double() @ base.weight.double().T + lora_ops.lora_delta_reference(
        x, lora_a, lora_b, scale, rank, token_slots, widths).to(dev)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    print(f"{len(x)} tokens, slots {token_slots.tolist()[:12]}...; relative error vs float64: {err:.2e}")
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    if not err <= tol:
        raise SystemExit(f"error {err:.2e} above tolerance {tol:.0e}")


if __name__ == "__main__":
    main()
