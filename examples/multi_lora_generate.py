"""Several LoRA adapters in one batch on a causal LM, compiled, checked against PEFT.

    python examples/multi_lora_generate.py                    # CPU: a tiny Llama built from a config
    python examples/multi_lora_generate.py --device cuda      # each decode step replays one CUDA graph
    python examples/multi_lora_generate.py --model PATH --adapter sql=PATH --adapter chat=PATH

1. A causal LM: a small LlamaConfig with random weights (nothing is downloaded), or --model PATH, a local
   Hugging Face checkpoint.
2. PEFT LoRA adapters, made on the fly with different ranks and alphas (one rsLoRA, one with a
   rank_pattern) and random non-zero B, saved as PEFT directories; or --adapter NAME=PATH.
3. lora_ops: ``apply_lora`` on a copy of the base model, then each adapter directory into a slot.
4. A mixed batch: requests cycling through the adapters and "no adapter", decoded greedily with a static
   KV cache. The decode step is compiled with ``fullgraph=True`` (one graph for every step and every
   adapter mix) and, on CUDA, captured once in a CUDA graph and replayed for each new token.
5. PEFT's own mixed-batch path (its forward with ``adapter_names=[...]``) in the same greedy loop, eager,
   on the same requests: generated tokens and prompt logits must agree for every adapter (the script
   exits 1 if they do not); tokens/s of both.
6. Hugging Face's own ``model.generate`` on our model, eager, inside ``ctx.per_row(request_adapters)`` (each
   layer takes its batch from its input's rows: nothing to set per step): the same tokens again.
"""
import argparse
import copy
import inspect
import os
import tempfile
import time
import warnings

import torch

import lora_ops

# Adapters made on the fly: (name, LoraConfig arguments). Different ranks and alphas; one uses rsLoRA,
# one a per-module rank through rank_pattern (PEFT's suffix/regex matching of module names).
ADAPTER_SPECS = [
    ("math", dict(r=8, lora_alpha=12)),
    ("code", dict(r=16, lora_alpha=10, use_rslora=True)),
    ("chat", dict(r=4, lora_alpha=6, rank_pattern={"down_proj": 2})),
]
NO_ADAPTER = None

# transformers / peft deprecation notices about their own internals are noise here.
warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (decode steps replay a CUDA graph)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="model dtype (float32 default: greedy tokens then agree with PEFT exactly)")
    ap.add_argument("--model", help="a local Hugging Face causal-LM checkpoint (default: a tiny Llama from a config)")
    ap.add_argument("--adapter", action="append", default=[], type=adapter_arg, metavar="NAME=PATH",
                    help="a PEFT adapter directory (repeatable; default: three made on the fly)")
    ap.add_argument("--requests", type=int, default=8, help="requests in the batch")
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--backend", default=None,
                    help="torch.compile backend (default: inductor on cuda; aot_eager on cpu, where inductor "
                         "needs a C++ compiler and about a minute of compiling on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def adapter_arg(text):
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


# ---- the model and the adapters ------------------------------------------------------------------------

def build_base_model(args, dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
    else:
        torch.manual_seed(args.seed)
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                             initializer_range=0.05)
        model = LlamaForCausalLM(config).to(dtype)
    return model.to(device).eval()


def make_adapters(base, out_dir, seed):
    """Create the ADAPTER_SPECS adapters with PEFT (lora_B random, so each one changes the output), save
    them as PEFT directories under out_dir; returns {name: directory}."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed + 1)
    peft_model = None
    for name, kwargs in ADAPTER_SPECS:
        config = LoraConfig(target_modules="all-linear", init_lora_weights=False, **kwargs)
        if peft_model is None:
            peft_model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    with torch.no_grad():
        for key, param in peft_model.named_parameters():
            if ".lora_B." in key:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(out_dir)
    return {name: os.path.join(out_dir, name) for name, _ in ADAPTER_SPECS}


def read_adapter_configs(paths):
    return {name: lora_ops.adapters.read_adapter_config(path) for name, path in paths.items()}


def lora_targets(configs):
    """What apply_lora must wrap: the union of the adapters' target_modules (or every linear layer)."""
    names = set()
    for config in configs.values():
        targets = config.get("target_modules")
        if not isinstance(targets, (list, tuple)):
            return "all-linear"
        names.update(targets)
    return sorted(names)


def max_rank(configs):
    return max(max([int(c["r"]), *map(int, (c.get("rank_pattern") or {}).values())]) for c in configs.values())


# ---- lora_ops: the model, the decode loop --------------------------------------------------------------

def build_lora_model(base, adapter_paths, configs, args):
    model = copy.deepcopy(base)
    ctx = lora_ops.apply_lora(model, lora_targets(configs), max_loras=len(adapter_paths), max_rank=max_rank(configs),
                              max_tokens=args.requests * args.prompt_len)
    for name, path in adapter_paths.items():
        ctx.load_adapter(name, path)
    return model, ctx


class Generator:
    """Greedy decoding of a fixed batch with a static KV cache: an eager prefill, then one compiled decode
    step ([requests, 1] tokens, the same shapes every step), replayed from a CUDA graph on CUDA."""

    def __init__(self, model, ctx, args):
        self.model, self.ctx, self.args = model, ctx, args
        self.use_graphs = next(model.parameters()).device.type == "cuda"
        self.backend = args.backend or ("inductor" if self.use_graphs else "aot_eager")
        self.compiled_step = torch.compile(self._decode_step, fullgraph=True, backend=self.backend)
        self.cache = None       # allocated once: the compiled step and the CUDA graph keep reading its tensors
        self.graph = None
        # Older transformers take the write position as `cache_position`; newer caches track it on the device.
        self.cache_arg = cache_arg(model)
        self.pass_position = "cache_position" in inspect.signature(model.forward).parameters

    def _decode_step(self, tokens, position):
        extra = {"cache_position": position} if self.pass_position else {}
        out = self.model(input_ids=tokens, use_cache=True, **{self.cache_arg: self.cache}, **extra)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.no_grad()
    def generate(self, prompts, request_adapters):
        """[requests, new_tokens] greedy tokens; ``request_adapters[i]`` is request i's adapter or None."""
        if self.use_graphs and self.graph is None:
            self._capture(prompts, request_adapters)
        tokens = [self._prefill(prompts, request_adapters)]
        for _ in range(self.args.new_tokens - 1):
            tokens.append(self._step(tokens[-1]))
        return torch.cat(tokens, dim=1)

    def _prefill(self, prompts, request_adapters):
        """Empty the cache (in place), run the prompts eagerly, and set the batch for the decode steps."""
        from transformers import StaticCache
        B, P = prompts.shape
        if self.cache is None:
            self.cache = StaticCache(config=self.model.config, max_cache_len=P + self.args.new_tokens)
            self.position = torch.zeros(1, dtype=torch.long, device=prompts.device)   # the next token's position
        self.cache.reset()
        self.position.fill_(P)
        self.ctx.set_batch([(name, P) for name in request_adapters])
        extra = {"cache_position": torch.arange(P, device=prompts.device)} if self.pass_position else {}
        logits = self.model(input_ids=prompts, use_cache=True, **{self.cache_arg: self.cache}, **extra).logits
        self.ctx.set_batch([(name, 1) for name in request_adapters])      # decode: one token per request
        return logits[:, -1].argmax(-1, keepdim=True)

    def _step(self, tokens):
        if self.use_graphs:
            self.static_tokens.copy_(tokens)
            self.graph.replay()
            next_tokens = self.static_next.clone()
        else:
            next_tokens = self.compiled_step(tokens, self.position)
        self.position.add_(1)
        return next_tokens

    def _capture(self, prompts, request_adapters):
        """On a throwaway run of the same shapes: warm up (compile, Triton JIT) on a side stream, then capture
        one decode step. The warm-up advances the cache; the next _prefill empties it in place."""
        self.static_tokens = self._prefill(prompts, request_adapters)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.compiled_step(self.static_tokens, self.position)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_next = self.compiled_step(self.static_tokens, self.position)


# ---- PEFT: the reference and the baseline --------------------------------------------------------------

def build_peft_model(base, adapter_paths):
    from peft import PeftModel
    names = list(adapter_paths)
    peft_model = PeftModel.from_pretrained(base, adapter_paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_paths[name], adapter_name=name)
    return peft_model.eval()


@torch.no_grad()
def peft_generate(peft_model, prompts, request_adapters, new_tokens):
    """The same greedy loop through PEFT's mixed-batch forward (adapter_names=...), eager, dynamic KV cache."""
    from transformers import DynamicCache
    adapter_names = [name or "__base__" for name in request_adapters]
    cache = {cache_arg(peft_model.get_base_model()): DynamicCache()}
    tokens = [prompts]
    for _ in range(new_tokens):
        logits = peft_model(input_ids=tokens[-1], use_cache=True, adapter_names=adapter_names, **cache).logits
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens[1:], dim=1)


@torch.no_grad()
def hf_generate(model, ctx, prompts, request_adapters, new_tokens):
    """Hugging Face's generate on our model, greedy, every step's batch from each layer's input rows (per_row).
    No end-of-sequence token: every request runs its new_tokens, as the loops above do. The attention mask is
    all ones: without one, generate takes every prompt token equal to pad_token_id for padding and masks it."""
    model.generation_config.eos_token_id = None     # (a None argument would mean "the model's default")
    with ctx.per_row(request_adapters):
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


def cache_arg(model):
    """The KV cache's keyword: `cache` in recent transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ---- the run -------------------------------------------------------------------------------------------

# Relative error allowed between our prompt logits and PEFT's, whole model (PEFT runs LoRA in the model's
# dtype; lora_ops keeps the rank-sized intermediate in float32).
LOGITS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def timed(fn, device):
    """(result, seconds) of the second of two runs: compile, JIT and warm-up stay out of the figure."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


@torch.no_grad()
def prompt_logits_errors(model, ctx, peft_model, prompts, request_adapters):
    """{adapter: largest relative error of a request's prompt logits, ours (eager) against PEFT's}."""
    ctx.set_batch([(name, prompts.shape[1]) for name in request_adapters])
    ours = model(input_ids=prompts).logits.double()
    theirs = peft_model(input_ids=prompts, adapter_names=[n or "__base__" for n in request_adapters]).logits.double()
    errors = {}
    for i, name in enumerate(request_adapters):
        err = ((ours[i] - theirs[i]).norm() / theirs[i].norm()).item()
        errors[name] = max(errors.get(name, 0.0), err)
    return errors


def main():
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu" and not args.model:
        torch.set_num_threads(1)        # the tiny model: more threads only add synchronisation
    started = time.perf_counter()
    base = build_base_model(args, dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_paths = dict(args.adapter) or make_adapters(base, tmp, args.seed)
        configs = read_adapter_configs(adapter_paths)
        model, ctx = build_lora_model(base, adapter_paths, configs, args)
        peft_model = build_peft_model(base, adapter_paths)      # PEFT wraps `base` itself: ours is a copy

    names = list(adapter_paths)
    request_adapters = [[*names, NO_ADAPTER][i % (len(names) + 1)] for i in range(args.requests)]
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (args.requests, args.prompt_len), generator=gen).to(device)

    generator = Generator(model, ctx, args)
    compile_start = time.perf_counter()
    generator.generate(prompts, request_adapters)               # compiles (and captures, on CUDA)
    compile_s = time.perf_counter() - compile_start
    ours, ours_s = timed(lambda: generator.generate(prompts, request_adapters), device)
    theirs, peft_s = timed(lambda: peft_generate(peft_model, prompts, request_adapters, args.new_tokens), device)
    errors = prompt_logits_errors(model, ctx, peft_model, prompts, request_adapters)
    hf_tokens = hf_generate(model, ctx, prompts, request_adapters, args.new_tokens)

    print_setup(args, names, configs, device, dtype, generator)
    print_requests(args, request_adapters, ours)
    tokens = ours.numel()
    print(f"\nthroughput, {tokens} tokens (prefill included, warm; compiling{' and capturing' * generator.use_graphs} "
          f"took {compile_s:.1f} s once):")
    print(f"  lora_ops ({describe(generator)}): {tokens / ours_s:10.1f} tokens/s")
    print(f"  PEFT mixed batch (adapter_names=..., eager): {tokens / peft_s:10.1f} tokens/s")
    if device.type == "cpu":
        print("  (on the CPU a toy model measures Python overhead; --device cuda compares the kernels)")

    print("\nagreement with PEFT, per adapter (generated tokens of its requests; prompt logits):")
    agree = True
    for name, rows in rows_by_adapter(request_adapters).items():
        same_tokens = torch.equal(ours[rows], theirs[rows])
        ok = same_tokens and errors[name] <= LOGITS_TOLERANCE[dtype]
        agree &= ok
        print(f"  {name or 'no adapter':<12} agrees with PEFT: {'yes' if ok else 'no'}   (tokens "
              f"{'identical' if same_tokens else 'differ'}; logits relative error {errors[name]:.1e})")
    same_hf = torch.equal(hf_tokens, ours)
    agree &= same_hf
    print(f"  model.generate inside ctx.per_row (eager, Hugging Face's loop): tokens "
          f"{'identical' if same_hf else 'differ'}")
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    if not agree:
        raise SystemExit("lora_ops and PEFT disagree (see above)")


def rows_by_adapter(request_adapters):
    rows = {}
    for i, name in enumerate(request_adapters):
        rows.setdefault(name, []).append(i)
    return rows


def describe(generator):
    what = f"torch.compile(fullgraph=True, backend={generator.backend!r})"
    return what + (" + CUDA graph" if generator.use_graphs else "")


def print_setup(args, names, configs, device, dtype, generator):
    print(f"model: {args.model or 'tiny Llama from a config (random weights)'}, {str(dtype)[6:]}, {device}")
    for name in names:
        c = configs[name]
        extras = " rsLoRA" if c.get("use_rslora") else ""
        extras += f" rank_pattern={c['rank_pattern']}" if c.get("rank_pattern") else ""
        print(f"adapter {name}: r={c['r']} lora_alpha={c['lora_alpha']}{extras}")


def print_requests(args, request_adapters, tokens):
    print(f"\n{len(request_adapters)} requests in one batch, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens each (greedy):")
    for i, name in enumerate(request_adapters):
        print(f"  request {i}  {name or 'no adapter':<12} {tokens[i].tolist()}")


if __name__ == "__main__":
    main()
