"""Train three LoRA adapters at once, in one mixed batch, then hand them to PEFT.

    python examples/train_multi_lora.py                   # CPU, a tiny Llama with random weights
    python examples/train_multi_lora.py --device cuda     # the Triton kernels
    python examples/train_multi_lora.py --compile         # forward + loss compiled (fullgraph)
    python examples/train_multi_lora.py --micro-batches 2 --checkpoint   # per step: both micro-batches'
                                                          # forwards, then their backwards, each layer
                                                          # recomputed in the backward (activation
                                                          # checkpointing on the batch its forward read)

1. A tiny causal LM from a LlamaConfig (random weights, nothing downloaded) and ``apply_lora`` on it.
2. Three fresh adapters with PEFT's initialisation (B = 0), different ranks, alphas and dropouts, one
   rsLoRA. Three synthetic tasks, one per adapter: at every position, predict a fixed function of the
   current token (a shift by one, a shift by seven, a reversal of the vocabulary).
3. Each step is ONE batch holding rows of all three tasks plus rows with no adapter, one forward, one
   backward, one AdamW step; ``ctx.train_slots`` keeps the base and the other slots untouched.
4. Each adapter's loss at the start and at the end (the script exits 1 unless every one fell).
5. The adapters saved as PEFT directories; PEFT loads them onto the untouched base model and, on a
   mixed batch, must reproduce our logits for every adapter (exit 1 if not).
"""
import argparse
import copy
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import lora_ops
from lora_ops import training

# name: (adapter arguments, the token function its task learns)
TASKS = {
    "shift1": (dict(r=8, lora_alpha=16, lora_dropout=0.0), lambda t, v: (t + 1) % v),
    "shift7": (dict(r=4, lora_alpha=8, lora_dropout=0.05), lambda t, v: (t + 7) % v),
    "reverse": (dict(r=8, lora_alpha=8, use_rslora=True, lora_dropout=0.1), lambda t, v: v - 1 - t),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS_PER_TASK, PLAIN_ROWS, SEQ = 4, 2, 16
PARITY_TOLERANCE = 1e-4        # relative Frobenius error, fp32

warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--compile", action="store_true", help="compile forward + loss with fullgraph=True")
    parser.add_argument("--out", default=None, help="where to save the adapters (default: a temporary folder)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="batches per optimizer step, their forwards first, then their backwards")
    parser.add_argument("--checkpoint", action="store_true",
                        help="activation checkpointing (Hugging Face's, with context_fn=ctx.checkpoint_context)")
    args = parser.parse_args()
    if args.checkpoint and args.compile:    # (transformers 5.25: a logging call in its checkpointing path)
        parser.error("--checkpoint with --compile: Hugging Face's checkpointing does not compile with fullgraph=True")
    return args


def enable_checkpointing(model, ctx):
    """The model's own activation checkpointing, its recompute reading the batch its forward read."""
    kwargs = {"use_reentrant": False, "context_fn": ctx.checkpoint_context}
    if hasattr(model, "activation_checkpointing_enable"):      # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def tiny_llama(device):
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device).eval()


def mixed_batch(vocab, gen, device):
    """(requests for ctx.set_batch, input_ids [rows, SEQ], labels [rows, SEQ], {task: row indices})."""
    names = [name for name in TASKS for _ in range(ROWS_PER_TASK)] + [None] * PLAIN_ROWS
    order = torch.randperm(len(names), generator=gen).tolist()      # interleave the tasks in the batch
    names = [names[i] for i in order]
    input_ids = torch.randint(0, vocab, (len(names), SEQ), generator=gen)
    labels = input_ids.clone()
    rows = {name: [i for i, n in enumerate(names) if n == name] for name in TASKS}
    for name, idx in rows.items():
        labels[idx] = TASKS[name][1](input_ids[idx], vocab)
    requests = [(name, SEQ) for name in names]
    return requests, input_ids.to(device), labels.to(device), rows


def task_losses(logits, labels, rows):
    """{task: mean cross-entropy over its rows}; rows without an adapter carry no loss."""
    return {name: F.cross_entropy(logits[idx].flatten(0, 1), labels[idx].flatten()) for name, idx in rows.items()}


JUDGED_FROM = 20      # steps: fewer (a smoke run) print the losses without judging them


def train(model, ctx, args, vocab):
    trainer = ctx.train_slots(list(TASKS))
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.01)
    forward = model
    if args.compile:
        backend = "inductor" if torch.device(args.device).type == "cuda" else "aot_eager"
        forward = torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    first = last = None
    model.train()
    start = time.perf_counter()
    if args.checkpoint:
        enable_checkpointing(model, ctx)
    for step in range(args.steps):
        # Each micro-batch's forward, then the backwards: each backward runs on its own forward's batch
        # (LoRAContext keeps a copy of each batch for autograd).
        totals = []
        for micro in range(args.micro_batches):
            requests, input_ids, labels, rows = mixed_batch(vocab, gen, args.device)
            ctx.set_batch(requests)
            batch_losses = task_losses(forward(input_ids=input_ids).logits, labels, rows)
            if micro == 0:
                losses = batch_losses       # (the first micro-batch's, printed)
            totals.append(sum(batch_losses.values()) / args.micro_batches)
        for total in totals:
            total.backward()
        trainer.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        values = {name: loss.item() for name, loss in losses.items()}
        first = first or values
        last = values
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  " + "  ".join(f"{n} {v:.3f}" for n, v in values.items()))
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s")
    trainer.close()
    model.eval()
    return first, last


def check_with_peft(base, model, ctx, directories, vocab, device):
    """PEFT, loading our saved directories, on a mixed batch: per-adapter relative error of the logits."""
    import peft
    names = list(directories)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), directories[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(directories[name], adapter_name=name)
    peft_model.eval()
    rows = names + [None] + names
    input_ids = torch.randint(0, vocab, (len(rows), SEQ), generator=torch.Generator().manual_seed(2)).to(device)
    ctx.set_batch([(name, SEQ) for name in rows])
    with torch.no_grad():
        ours = model(input_ids=input_ids).logits.double()
        theirs = peft_model(input_ids=input_ids, adapter_names=[n or "__base__" for n in rows]).logits.double()
        plain = base(input_ids=input_ids).logits.double()
    errors = {}
    for name in names + [None]:
        idx = [i for i, n in enumerate(rows) if n == name]
        errors[name] = ((ours[idx] - theirs[idx]).norm() / theirs[idx].norm()).item()
        if name is not None and (theirs[idx] - plain[idx]).norm() <= 1e-3 * plain[idx].norm():
            errors[name] = float("inf")      # PEFT did not pick the adapter up at all
    return errors


def main():
    args = parse_args()
    base = tiny_llama(args.device)
    vocab = base.config.vocab_size
    model = copy.deepcopy(base)
    ctx = lora_ops.apply_lora(model, TARGETS, max_loras=len(TASKS), max_rank=8,
                              max_tokens=(len(TASKS) * ROWS_PER_TASK + PLAIN_ROWS) * SEQ)
    gen = torch.Generator().manual_seed(0)
    for name, (spec, _) in TASKS.items():
        training.add_trainable_adapter(ctx, name, generator=gen, **spec)

    first, last = train(model, ctx, args, vocab)
    ok = True
    print("\nadapter   loss at start  loss at end")
    judged = args.steps >= JUDGED_FROM     # (a short smoke run's losses need not fall 10% yet)
    for name in TASKS:
        fell = last[name] < 0.9 * first[name]
        ok &= fell or not judged
        verdict = ("fell" if fell else "DID NOT FALL") if judged else f"not judged (--steps < {JUDGED_FROM})"
        print(f"{name:8s}  {first[name]:13.3f}  {last[name]:11.3f}  {verdict}")

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        directories = {name: ctx.save_adapter(name, os.path.join(out, name)) for name in TASKS}
        print(f"\nsaved as PEFT adapters in {out}" if args.out else
              "\nsaved as PEFT adapters in a temporary folder (--out DIR keeps them)")
        errors = check_with_peft(base, model, ctx, directories, vocab, args.device)
    for name, err in errors.items():
        good = err <= PARITY_TOLERANCE
        ok &= good
        print(f"PEFT vs lora_ops, {name or 'no adapter':10s}: relative error {err:.1e}  "
              f"{'reproduced' if good else 'MISMATCH'}")
    if not ok:
        print("FAILED")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
