"""Where one training step's time goes: a layer's forward + backward as ``lora_ops::lora_linear`` (what
LoRALinear runs) with 4 adapters in one batch, host time per step against wall time per step, then a
torch.profiler table of the kernels (sorted by device time). Same data as grad_check.py's timing rows.

    python benchmarks/train_profile.py [--layers qkv,gate_up] [--tokens 4096] [--out DIR]
"""
import argparse
import os
import time

from repo_path import HERE  # noqa: F401  (first: this checkout's lora_ops)

import torch  # noqa: E402

import grad_check  # noqa: E402
from shapes import LLAMA3_8B  # noqa: E402


def step_fn(layer):
    _, x, a, b = layer.leaves()

    def step():
        for t in (x, a, b):
            t.grad = None
        grad_check.ours_layer_op(layer, x, a, b).backward(layer.grad)
    return step


def profile_layer(spec, tokens, device, steps=20):
    layer = grad_check.Layer(spec, list(grad_check.SLOT_RANKS), tokens, torch.bfloat16, device, seed=0)
    step = step_fn(layer)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - t0) / steps * 1e3   # the host's issue time, GPU still running
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=50)
    return (f"== {spec.name} M={tokens}, slot ranks {grad_check.SLOT_RANKS}: host {host_ms:.3f} ms/step, "
            f"wall {wall_ms:.3f} ms/step (5 steps profiled below)\n{table}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="qkv,gate_up")
    p.add_argument("--tokens", type=int, default=grad_check.TIME_TOKENS)
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_profile.py: needs a CUDA GPU")
    names = args.layers.split(",")
    text = "\n".join(profile_layer(spec, args.tokens, "cuda") for spec in LLAMA3_8B if spec.name in names)
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {__import__('triton').__version__}"
    path = os.path.join(args.out, "train_profile.txt")
    with open(path, "w") as f:
        f.write(f"# {env}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n{text}")
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
