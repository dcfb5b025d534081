"""Parity with PEFT: the same adapters, the same mixed batch, the same logits.

A tiny Llama built from a config (random weights, nothing downloaded) gets three PEFT LoRA adapters with
non-zero B, different ranks and alphas, one rsLoRA with a rank_pattern (its scale alpha / sqrt(the module's
own rank), not of r) and one with rank_pattern / alpha_pattern whose keys PEFT resolves its own way (the
first matching key wins; a key matches whole dotted components of the path, not any suffix); they are
saved as PEFT directories and loaded here. A mixed batch (rows of every adapter and rows with none,
interleaved) must match PEFT's own ``model(input_ids, adapter_names=[...])`` row by row, eagerly and
under torch.compile. Two more models: a fused q/k/v + gate/up model holding per-projection adapters in
packed slices against the unfused PEFT model, and GPT-2 (Conv1D, ``fan_in_fan_out=True``) adapters on the
same model with its Conv1D layers as nn.Linear.

On the CPU our side runs the torch kernels (and, in the eager tests, the Triton kernels through the
interpreter); ``LORA_OPS_TEST_DEVICE=cuda`` runs the Triton kernels on CUDA.
"""
import copy
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import DEVICE, TOLERANCE, rel_err
from layer_helpers import PACKED, PROJECTIONS, fused_copy, toy_lm
from lora_ops.layers import apply_lora, conv1d_to_linear

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# transformers / peft deprecation notices about their own internals.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOL = TOLERANCE[torch.float32]
# name: LoraConfig arguments. Non-zero B comes from init_lora_weights=False (random A and B).
# beta: rsLoRA with a rank_pattern, so a scale of sqrt(r) where the module's rank belongs shows.
# gamma's alpha_pattern: layer 0's o_proj matches two keys and takes the first's 7, the other o_proj the
# second's -5 (the last key winning shows); "[qp]_proj" matches q_proj, and ends "up_proj" but not at a dot,
# so PEFT gives up_proj the default alpha (a suffix match without the dotted boundary shows). (The keys are
# in sorted order: PEFT's save_pretrained sorts them, so the file's first key is the live model's.)
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8),
    "beta": dict(r=8, lora_alpha=4, use_rslora=True, rank_pattern={"k_proj": 3}),
    "gamma": dict(r=6, lora_alpha=12, rank_pattern={"v_proj": 2, r"layers\.1\.mlp\.down_proj": 3},
                  alpha_pattern={"[qp]_proj": 3, r"layers\.0\.self_attn\.o_proj": 7, "o_proj": -5}),
}
# Per row of the batch: interleaved adapters and rows with none ("__base__" for PEFT).
ROWS = ["alpha", None, "beta", "gamma", None, "alpha", "gamma", "beta"]
SEQ = 5


def peft_names(rows):
    return [name or "__base__" for name in rows]


def make_peft_adapters(base, targets, tmp_path, adapters=ADAPTERS, **common):
    """A PeftModel over a copy of ``base`` holding ``adapters`` (random non-zero A and B), each saved
    as a PEFT directory; returns (peft_model, {name: directory})."""
    torch.manual_seed(123)
    peft_model = None
    for name, kwargs in adapters.items():
        config = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **kwargs, **common)
        if peft_model is None:
            peft_model = peft.get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    peft_model.save_pretrained(tmp_path)
    return peft_model.eval(), {name: str(tmp_path / name) for name in adapters}


def load_ours(model, targets, paths, max_rank=8, max_tokens=64, **kw):
    ctx = apply_lora(model, targets, max_loras=len(paths) + 1, max_rank=max_rank, max_tokens=max_tokens, **kw)
    for name, path in paths.items():
        ctx.load_adapter(name, path)
    return ctx


def assert_rows_match(ours, theirs, rows):
    for i, name in enumerate(rows):
        err = rel_err(ours[i], theirs[i])
        assert err <= TOL, f"row {i} ({name or 'no adapter'}): relative error {err:.2e} > {TOL:.0e}"


def assert_adapters_matter(theirs, base_logits, rows):
    """Guard against a vacuous pass: every adapter changes its rows' logits materially."""
    for i, name in enumerate(rows):
        diff = rel_err(theirs[i], base_logits[i])
        if name is None:
            assert diff == 0.0
        else:
            assert diff > 1e-2, f"adapter {name} barely changes the output ({diff:.1e})"


def mixed_batch_matches_peft(base, peft_model, ours, ctx, rows, seed, output, seq=6, vocab=128):
    """One sequence of ``seq`` tokens per row of ``rows`` (an adapter name or None): our model's ``output``
    matches PEFT's mixed batch row by row, and every adapter matters."""
    input_ids = torch.randint(0, vocab, (len(rows), seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    ctx.set_batch([(name, seq) for name in rows])
    with torch.no_grad():
        theirs = output(peft_model(input_ids=input_ids, adapter_names=peft_names(rows)))
        assert_adapters_matter(theirs, output(base(input_ids=input_ids)), rows)
        assert_rows_match(output(ours(input_ids=input_ids)), theirs, rows)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(base model, PEFT model with the three adapters, their directories, input_ids), on DEVICE."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    peft_model, paths = make_peft_adapters(base, PROJECTIONS, tmp_path_factory.mktemp("llama_adapters"))
    input_ids = torch.randint(0, config.vocab_size, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(1))
    return base, peft_model, paths, input_ids.to(DEVICE)


@pytest.fixture(scope="module")
def llama_reference(llama):
    base, peft_model, _, input_ids = llama
    with torch.no_grad():
        theirs = peft_model(input_ids=input_ids, adapter_names=peft_names(ROWS)).logits
        base_logits = base(input_ids=input_ids).logits
    assert_adapters_matter(theirs, base_logits, ROWS)
    return theirs


def our_llama(llama):
    base, _, paths, _ = llama
    model = copy.deepcopy(base)
    ctx = load_ours(model, PROJECTIONS, paths)
    ctx.set_batch([(name, SEQ) for name in ROWS])
    return model, ctx


@pytest.fixture
def kernels(backend):
    """Our side's kernels: on the CPU both the torch kernels and the Triton ones (interpreter); on CUDA the
    Triton kernels (the model lives on DEVICE, so the CPU-only torch backend has nothing to run there)."""
    if backend.device != DEVICE:
        pytest.skip(f"the model is on {DEVICE}")
    return backend


def test_llama_mixed_batch_matches_peft(llama, llama_reference, kernels):
    model, _ = our_llama(llama)
    with torch.no_grad():
        ours = model(input_ids=llama[3]).logits
    assert_rows_match(ours, llama_reference, ROWS)


def test_llama_mixed_batch_matches_peft_compiled(llama, llama_reference):
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()       # earlier compiles of the same forward code must not count as recompiles
    model, ctx = our_llama(llama)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    input_ids = llama[3]
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        assert_rows_match(compiled(input_ids=input_ids).logits, llama_reference, ROWS)
        # Another mix of the same adapters: same graph, PEFT's answer for the new mix.
        rows = list(reversed(ROWS))
        ctx.set_batch([(name, SEQ) for name in rows])
        ours = compiled(input_ids=input_ids).logits
    with torch.no_grad():
        theirs = llama[1](input_ids=input_ids, adapter_names=peft_names(rows)).logits
    assert_rows_match(ours, theirs, rows)
    assert counter.frame_count == 1


def test_packed_slices_match_unfused_peft(tmp_path, kernels):
    """A fused model (qkv_proj, gate_up_proj) holding per-projection adapters with per-slice ranks and
    alphas (so slices get zero-padded and their scales folded) matches PEFT on the unfused model; "q" is
    rsLoRA with per-slice ranks, its slices' scales alpha / sqrt(each slice's own rank). Both CPU kernels: the
    Triton expand maps its column chunks to slices its own way, which only the torch kernels ran here before."""
    unfused = toy_lm(seed=3).to(DEVICE)
    adapters = {
        "p": dict(r=4, lora_alpha=8, rank_pattern={"k_proj": 2, "up_proj": 6}, alpha_pattern={"v_proj": -3}),
        "q": dict(r=3, lora_alpha=5, use_rslora=True, rank_pattern={"v_proj": 5, "gate_proj": 2}),
    }
    peft_model, paths = make_peft_adapters(unfused, PROJECTIONS, tmp_path, adapters=adapters)
    fused = fused_copy(unfused)
    ctx = load_ours(fused, PROJECTIONS, paths, packed_modules=PACKED)
    rows = ["p", None, "q", "p", "q", None]
    input_ids = torch.randint(0, 64, (len(rows), 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ctx.set_batch([(name, 7) for name in rows])
    with torch.no_grad():
        theirs = peft_model(input_ids, adapter_names=peft_names(rows))
        assert_adapters_matter(theirs, unfused(input_ids), rows)
        assert_rows_match(fused(input_ids), theirs, rows)
        compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
        assert_rows_match(compiled(input_ids), theirs, rows)


def test_gpt2_fan_in_fan_out_adapters(tmp_path, kernels):
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).to(DEVICE).eval()
    targets = ["c_attn", "c_proj", "c_fc"]
    adapters = {"g1": dict(r=4, lora_alpha=8), "g2": dict(r=8, lora_alpha=4, use_rslora=True)}
    peft_model, paths = make_peft_adapters(base, targets, tmp_path, adapters=adapters, fan_in_fan_out=True)
    ours = copy.deepcopy(base)
    with pytest.raises(TypeError, match=r"a [\w.]*Conv1D: .*convert the model's Conv1D layers first, "
                                        r"lora_ops.conv1d_to_linear\(model\)"):
        apply_lora(ours, targets, max_loras=2, max_rank=8, max_tokens=64)
    converted = conv1d_to_linear(ours)
    assert len(converted) == 4 * config.n_layer and all(type(ours.get_submodule(p)) is torch.nn.Linear
                                                        for p in converted)
    with torch.no_grad():
        ids = torch.randint(0, 128, (2, 9), device=DEVICE)
        assert torch.allclose(ours(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    ctx = load_ours(ours, targets, paths)
    mixed_batch_matches_peft(base, peft_model, ours, ctx, ["g1", None, "g2", "g2", "g1"], seed=3,
                             output=lambda out: out.logits)


# A tiny T5's sizes, its projections, and two adapters, for the T5 and BART tests.
T5_SIZES = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
T5_TARGETS = ["q", "k", "v", "o", "wi", "wo"]
TWO_ADAPTERS = {"t1": dict(r=4, lora_alpha=8), "t2": dict(r=8, lora_alpha=4)}


def bert_all_linear(model_class, tmp_path, wrapped, **sizes):
    """A tiny BERT of ``model_class`` with TWO_ADAPTERS under "all-linear": (base, PEFT model, our copy, context);
    ``wrapped``: a layer path suffix "all-linear" must have selected."""
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    base = model_class(config).to(DEVICE).eval()
    peft_model, paths = make_peft_adapters(base, "all-linear", tmp_path, adapters=TWO_ADAPTERS)
    model = copy.deepcopy(base)
    ctx = load_ours(model, "all-linear", paths)
    assert any(path.endswith(wrapped) for path in ctx.layers)
    return base, peft_model, model, ctx


def compiled_rows_match_peft(model, ctx, peft_model, input_ids, rows_list, output):
    """The model compiled (fullgraph=True) inside per_row: each rows' output equals PEFT's, one graph for all."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for i, rows in enumerate(rows_list):
            with ctx.per_row(rows), torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = output(compiled(input_ids))
            assert_rows_match(got, output(peft_model(input_ids=input_ids, adapter_names=peft_names(rows))), rows)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_bert_all_linear_pooler_inside_per_row_matches_peft(tmp_path, kernels):
    """PEFT's "all-linear" adapts BERT's pooler, which sees one token a row ([rows, hidden]: each row's first):
    inside per_row it takes its row's adapter (it was refused, and the adapter could be served no other way:
    leaving the pooler unwrapped made the load refuse it). Eager, and compiled (fullgraph=True) with other
    adapters in the rows compiling nothing new."""
    base, peft_model, model, ctx = bert_all_linear(transformers.BertModel, tmp_path, "pooler.dense",
                                                   num_hidden_layers=2)
    input_ids = torch.randint(3, 100, (4, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows_list = (["t1", None, "t2", "t1"], ["t2", "t1", None, None])
    for rows in rows_list:
        with torch.no_grad():
            theirs = peft_model(input_ids=input_ids, adapter_names=peft_names(rows))
            with ctx.per_row(rows):
                ours = model(input_ids)
        assert_rows_match(ours.pooler_output, theirs.pooler_output, rows)
        assert_rows_match(ours.last_hidden_state, theirs.last_hidden_state, rows)
    assert rel_err(theirs.pooler_output, base(input_ids).pooler_output) > 1e-2      # (the adapters matter)
    if compile_runs_here(kernels):
        compiled_rows_match_peft(model, ctx, peft_model, input_ids, rows_list, lambda out: out.pooler_output)


def test_bert_classifier_over_the_pooled_token_inside_per_row_matches_peft(tmp_path, kernels):
    """BertForSequenceClassification with "all-linear": PEFT adapts the pooler and the classifier, whose input
    (dropout(tanh(pooler(...)))) is a tensor of its own with one token a row. Inside per_row it takes its row's
    adapter (it was refused, and set_batch cannot describe it), eagerly and compiled."""
    base, peft_model, model, ctx = bert_all_linear(transformers.BertForSequenceClassification, tmp_path,
                                                   "classifier", num_hidden_layers=1, num_labels=3)
    input_ids = torch.randint(3, 100, (4, 7), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rows_list = (["t1", None, "t2", "t1"], ["t2", "t2", None, "t1"])
    with torch.no_grad():
        for rows in rows_list:
            theirs = peft_model(input_ids=input_ids, adapter_names=peft_names(rows)).logits
            with ctx.per_row(rows):
                assert_rows_match(model(input_ids).logits, theirs, rows)
        assert rel_err(theirs, base(input_ids).logits) > 1e-2      # (the adapters matter)
    if compile_runs_here(kernels):
        compiled_rows_match_peft(model, ctx, peft_model, input_ids, rows_list, lambda out: out.logits)


def test_t5_encoder_reading_a_wrapped_layers_weight(tmp_path, kernels):
    """T5 casts its hidden states to ``wo.weight.dtype`` before ``wo``: model code that reads a wrapped layer's
    weight (LoRALinear forwards ``weight`` and ``bias`` from its base, as PEFT's layers do; it had raised
    AttributeError). A mixed batch against PEFT's, row by row."""
    torch.manual_seed(0)
    base = transformers.T5EncoderModel(transformers.T5Config(**T5_SIZES)).to(DEVICE).eval()
    peft_model, paths = make_peft_adapters(base, T5_TARGETS, tmp_path, adapters=TWO_ADAPTERS)
    ours = copy.deepcopy(base)
    ctx = load_ours(ours, T5_TARGETS, paths)
    mixed_batch_matches_peft(base, peft_model, ours, ctx, ["t2", None, "t1", "t2"], seed=4,
                             output=lambda out: out.last_hidden_state)


@pytest.mark.parametrize("search", ["greedy", "two_beams"])
def test_generate_inside_per_row_matches_peft(llama, kernels, search):
    """Hugging Face ``generate`` steps the model itself (a prefill, then one token a row with the KV cache), so
    nothing sets each step's batch; inside ``ctx.per_row(rows)`` each layer takes it from its input's rows.
    Greedy: the tokens are PEFT's own ``generate(adapter_names=...)``'s, and each step's logits match PEFT's
    forward over the finished sequences (teacher forcing). Two beams: generate repeats each row twice in place
    (each adapter then covers two rows); the returned beams match PEFT's."""
    base, peft_model, paths, input_ids = llama
    model = copy.deepcopy(base)
    ctx = load_ours(model, PROJECTIONS, paths, max_tokens=2 * len(ROWS) * SEQ)   # (two beams: rows twice)
    new = 4
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, num_beams=2 if search == "two_beams" else 1)
    with torch.no_grad():
        with ctx.per_row(ROWS):
            ours = model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **kwargs)
        theirs = peft_model.generate(input_ids=input_ids, adapter_names=peft_names(ROWS), **kwargs)
        assert torch.equal(ours.sequences, theirs)
        assert not torch.equal(theirs, base.generate(input_ids, **kwargs))     # (the adapters chose other tokens)
        if search == "greedy":
            forced = peft_model(input_ids=ours.sequences, adapter_names=peft_names(ROWS)).logits
            prompt = input_ids.shape[1]
            assert_rows_match(torch.stack(ours.logits, 1), forced[:, prompt - 1:prompt - 1 + new], ROWS)


def compile_runs_here(kernels):
    """Whether a compiled generate runs on this backend: under Triton's CPU interpreter it takes ~30-60 s
    a test for what the torch CPU kernels' run already shows (the graph is the same, only the kernels the
    ops dispatch to differ; the GPU suite runs it on the compiled kernels), so CI runs it with
    LORA_OPS_SLOW_TESTS=1 only."""
    return not kernels.interpreted or os.environ.get("LORA_OPS_SLOW_TESTS") == "1"


def compiled_generate_gives(model, ctx, input_ids, kwargs, rows_twice, want):
    """With the model's forward compiled (fullgraph=True, dynamic), generate inside per_row of each of
    ``rows_twice`` gives the tokens in ``want``; the second rows' adapters compile nothing new."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model.forward = torch.compile(model.forward, backend=counter, fullgraph=True, dynamic=True)
    with ctx.per_row(rows_twice[0]):
        assert torch.equal(model.generate(input_ids, **kwargs), want[0])
    frames = counter.frame_count
    with ctx.per_row(rows_twice[1]), torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(input_ids, **kwargs), want[1])
    assert counter.frame_count == frames
    torch._dynamo.reset()


def test_generate_inside_per_row_under_torch_compile(llama, kernels):
    """The model's forward compiled with fullgraph=True (no graph breaks): inside per_row its layers build their
    batches in the graph, and generate gives the eager model's tokens (PEFT's, test above). Other adapters in
    the rows compile nothing new."""
    if not compile_runs_here(kernels):
        pytest.skip("a compiled generate on the CPU interpreter: LORA_OPS_SLOW_TESTS=1 runs it")
    base, _, paths, input_ids = llama
    model = copy.deepcopy(base)
    ctx = load_ours(model, PROJECTIONS, paths)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    other = [ROWS[-1], *ROWS[:-1]]
    with torch.no_grad():
        want = []
        for rows in (ROWS, other):
            with ctx.per_row(rows):
                want.append(model.generate(input_ids, **kwargs))
        compiled_generate_gives(model, ctx, input_ids, kwargs, (ROWS, other), want)
    assert not torch.equal(want[0], want[1])


def tiny_seq2seq(kind):
    """(model, target modules): a tiny T5 or BART built from a config, random weights, on DEVICE."""
    torch.manual_seed(0)
    if kind == "t5":
        config = transformers.T5Config(**T5_SIZES, decoder_start_token_id=0, pad_token_id=0)
        return transformers.T5ForConditionalGeneration(config).to(DEVICE).eval(), T5_TARGETS
    config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    return transformers.BartForConditionalGeneration(config).to(DEVICE).eval(), targets


@pytest.mark.parametrize("search", ["greedy", "two_beams"])
@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate_inside_per_row_matches_peft(tmp_path, kernels, kind, search):
    """An encoder-decoder's generate: the encoder once over the source rows, then the decoder a token a row, its
    cross-attention projections over the source's tokens: inside per_row each layer takes the batch of its own
    input's shape, so one context serves both stacks. Tokens equal PEFT's generate(adapter_names=...)."""
    base, targets = tiny_seq2seq(kind)
    peft_model, paths = make_peft_adapters(base, targets, tmp_path, adapters=TWO_ADAPTERS)
    ours = copy.deepcopy(base)
    ctx = load_ours(ours, targets, paths, max_tokens=64)
    rows = ["t2", None, "t1", "t2"]
    input_ids = torch.randint(3, 128, (len(rows), 7), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=2 if search == "two_beams" else 1, min_length=0)
    with torch.no_grad():
        with ctx.per_row(rows):
            got = ours.generate(input_ids, **kwargs)
        want = peft_model.generate(input_ids=input_ids, adapter_names=peft_names(rows), **kwargs)
        assert torch.equal(got, want)
        assert not torch.equal(want, base.generate(input_ids, **kwargs))     # (the adapters chose other tokens)


def tiny_qwen2_moe():
    """A tiny Qwen2-MoE from a config, random weights, on DEVICE. Its MoE block flattens the tokens [B·T, K]
    before the shared expert (`hidden_states.view(-1, hidden_dim)`), whose projections LoRA adapts; the routed
    experts are one fused 3-D parameter in transformers 5 (no nn.Linear to adapt)."""
    config = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=128,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(config).to(DEVICE).eval()


MOE_TARGETS = ["q_proj", "v_proj", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]


def one_peft_model_per_adapter(base, targets, tmp_path, adapters):
    """({name: a PeftModel over its own copy of ``base`` holding that adapter alone}, {name: its saved PEFT
    directory}). Not one PeftModel with every adapter (make_peft_adapters): PEFT 0.22 rewrites the config of an
    adapter added to a Qwen2-MoE PeftModel (its transformers-v5 MoE conversion takes the wrapped shared expert's
    projections for fused expert parameters, target_parameters) and saves none of their tensors."""
    torch.manual_seed(123)
    models, paths = {}, {}
    for name, kwargs in adapters.items():
        config = peft.LoraConfig(target_modules=targets, init_lora_weights=False, **kwargs)
        models[name] = peft.get_peft_model(copy.deepcopy(base), config, adapter_name=name).eval()
        models[name].save_pretrained(tmp_path)
        paths[name] = str(tmp_path / name)
    return models, paths


def peft_one_adapter_a_row(peft_models, rows, run):
    """``run(model)`` with each adapter of ``rows`` (its model of ``peft_models``; none: adapters disabled), each
    row's output taken from the run of its adapter: PEFT's answer where its mixed batches do not reach (Qwen2-MoE's
    shared expert sees the tokens flattened, and adapter_names needs a row per input)."""
    outs = {}
    for name in set(rows):
        if name is None:
            model = next(iter(peft_models.values()))
            with model.disable_adapter():
                outs[name] = run(model)
        else:
            outs[name] = run(peft_models[name])
    return torch.stack([outs[name][i] for i, name in enumerate(rows)])


def test_moe_generate_inside_per_row_eager_and_compiled(tmp_path, kernels):
    """Qwen2-MoE's shared expert sees its block's tokens flattened: inside per_row it takes the rows of the
    block's input before it. Eager logits and generate's tokens equal PEFT's with each row's adapter active;
    with the forward compiled (fullgraph=True, the flattened layers' batches built in the graph) generate gives
    the eager tokens, other adapters compiling nothing new."""
    base = tiny_qwen2_moe()
    peft_models, paths = one_peft_model_per_adapter(base, MOE_TARGETS, tmp_path, TWO_ADAPTERS)
    model = copy.deepcopy(base)
    ctx = load_ours(model, MOE_TARGETS, paths)
    assert any("shared_expert" in path for path in ctx.layers)
    rows, other = ["t2", None, "t1", "t2"], ["t1", "t2", None, "t1"]
    input_ids = torch.randint(3, 128, (len(rows), 6), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with ctx.per_row(rows):
            logits = model(input_ids).logits
        assert_rows_match(logits, peft_one_adapter_a_row(peft_models, rows, lambda m: m(input_ids=input_ids).logits),
                          rows)
        want = []
        for r in (rows, other):
            with ctx.per_row(r):
                want.append(model.generate(input_ids, **kwargs))
            assert torch.equal(want[-1], peft_one_adapter_a_row(peft_models, r, lambda m: m.generate(
                input_ids=input_ids, **kwargs)))
        assert not torch.equal(want[0], base.generate(input_ids, **kwargs))     # (the adapters chose other tokens)
        if compile_runs_here(kernels):
            compiled_generate_gives(model, ctx, input_ids, kwargs, (rows, other), want)
