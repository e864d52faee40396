"""keyfold as transformers' attn_implementation="keyfold": logits, generations, gradients and
caches against eager attention, on tiny random models (no downloads) with padded batches."""

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra: pip install 'keyfold[hf]'")

import torch  # noqa: E402

import keyfold as kf  # noqa: E402
from keyfold.integrations import transformers as kft  # noqa: E402

VOCAB = 101
kft.register()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices


def _decoder(name):
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common))
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**common))
    if name == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**common, sliding_window=5))
    if name == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**common, head_dim=8, sliding_window=5, attn_logit_softcapping=0.3,
                                                  final_logit_softcapping=None, query_pre_attn_scalar=5))
    if name == "gpt2":  # asks the mask for .ndim (a static cache's generate crashed there, 2026-12-06)
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2))
    raise ValueError(name)


def _encoder(name):
    t = transformers
    if name == "bert":
        return t.BertModel(t.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64), add_pooling_layer=False)
    if name == "modernbert":
        return t.ModernBertModel(t.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    raise ValueError(name)


DECODERS = ["llama", "mistral", "gemma2", "qwen2", "gpt2"]
ENCODERS = ["bert", "modernbert"]


def build(name):
    torch.manual_seed(0)
    model = (_decoder if name in DECODERS else _encoder)(name)
    return model.float().eval()


def batch(left: bool, B=3, N=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, N), generator=g)
    am = torch.ones(B, N, dtype=torch.long)
    for b, pad in enumerate((0, 4, 9)[:B]):
        if left:
            am[b, :pad], ids[b, :pad] = 0, 0
        else:
            am[b, N - pad:], ids[b, N - pad:] = 0, 0
    return ids, am


def run(model, impl, **kw):
    model.set_attn_implementation(impl)
    out = model(**kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", DECODERS + ENCODERS)
def test_logits_and_grads_match_eager_on_a_padded_batch(name):
    model = build(name)
    ids, am = batch(left=name in DECODERS)
    want = run(model, "eager", input_ids=ids, attention_mask=am)
    got = run(model, "keyfold", input_ids=ids, attention_mask=am)
    real = am.bool()
    assert (got - want)[real].abs().max() <= 1e-4
    # gradients of a loss over real tokens, every parameter
    grads = {}
    for impl in ("eager", "keyfold"):
        model.zero_grad()
        out = run(model, impl, input_ids=ids, attention_mask=am)
        (out[real].square().mean()).backward()
        grads[impl] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(grads["eager"]) == len(grads["keyfold"]) > 0
    for a, b in zip(grads["eager"], grads["keyfold"]):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, float(a.abs().max()))


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_is_identical(name, cache):
    model = build(name)
    ids, am = batch(left=True)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    if cache == "static":
        kw["cache_implementation"] = "static"
    model.set_attn_implementation("eager")
    want = model.generate(**kw)
    model.set_attn_implementation("keyfold")
    got = model.generate(**kw)
    assert got.shape == want.shape == (3, 12 + 32)
    assert torch.equal(got, want)


def test_padding_reaches_keyfold():
    """Regression: with only the attention function registered, a model builds no mask and the
    left padding is silently attended (logits off by ~7 in the trial that found it). keyfold gets
    padding(keys=...) from its mask builder, and a padded row equals the same row unpadded."""
    model = build("llama")
    ids, am = batch(left=True)
    got = run(model, "keyfold", input_ids=ids, attention_mask=am)
    alone = run(model, "keyfold", input_ids=ids[2:, 9:], attention_mask=am[2:, 9:])
    assert (got[2, 9:] - alone[0]).abs().max() <= 1e-5
    unmasked = run(model, "keyfold", input_ids=ids, attention_mask=torch.ones_like(am))
    assert (unmasked[2, 9:] - alone[0]).abs().max() > 1e-2  # the padding matters in this test
    built = kft.mask_interface(3, 12, 12, attention_mask=am.bool())
    assert isinstance(built, kft.KeyfoldMask) and "padding" in repr(built.mask)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_prepared_4d_mask_is_read_as_eager_reads_it(kind):
    """transformers passes a 4-D attention_mask through untouched (packed documents, tree attention):
    eager and sdpa read it, keyfold raised TypeError (a review, 2026-12-07). Two documents packed per
    row, causal within each, as a bool (True attends) or additive (0 / finfo.min) mask; logits and
    gradients match sdpa's (eager adds a bool mask as 0 / 1: it takes additive masks only), and the
    mask matters (plain causal differs)."""
    model = build("llama")
    ids, _ = batch(left=True)
    doc = torch.tensor([0] * 5 + [1] * 7)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    allowed = allowed.expand(3, 1, 12, 12)
    mask = allowed if kind == "bool" else torch.zeros(3, 1, 12, 12).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = run(model, "sdpa", input_ids=ids, attention_mask=mask)
    got = run(model, "keyfold", input_ids=ids, attention_mask=mask)
    assert (got - want).abs().max() <= 1e-4
    if kind == "additive":
        assert (run(model, "eager", input_ids=ids, attention_mask=mask) - want).abs().max() <= 1e-4
    assert (run(model, "keyfold", input_ids=ids) - want).abs().max() > 1e-2   # the documents matter
    grads = {}
    for impl in ("sdpa", "keyfold"):
        model.zero_grad()
        run(model, impl, input_ids=ids, attention_mask=mask).square().mean().backward()
        grads[impl] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(grads["sdpa"]) == len(grads["keyfold"]) > 0
    for a, b in zip(grads["sdpa"], grads["keyfold"]):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, float(a.abs().max()))


def test_attention_alone_without_mask_builder_raises():
    from transformers import AttentionInterface
    model = build("llama")
    AttentionInterface.register("keyfold_attention_only", kft.attention_forward)
    ids, am = batch(left=True)
    model.set_attn_implementation("keyfold_attention_only")
    with pytest.raises(RuntimeError, match="mask builder"):
        model(input_ids=ids, attention_mask=am)


def test_mask_functions_become_keyfold_masks():
    mu = transformers.masking_utils
    pm = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).bool()
    cases = {
        "causal": mu.causal_mask_function,
        "window": mu.sliding_window_causal_mask_function(3),
        "bidirectional window": mu.sliding_window_bidirectional_mask_function(1),
        "padding": mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(pm)),
        "chunked (kept as a callable)": mu.chunked_causal_mask_function(2, torch.tensor([0, 1])),
    }
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(1).view(1, 1, 1, 1)
    qp, kp = torch.arange(4).view(1, 1, 4, 1), torch.arange(4).view(1, 1, 1, 4)
    for what, fn in cases.items():
        m = kft.to_keyfold_mask(fn)
        want = torch.broadcast_to(fn(b, h, qp, kp), (2, 1, 4, 4))
        got = torch.broadcast_to(m.evaluate(b, h, qp, kp), (2, 1, 4, 4))
        assert torch.equal(got, want), what
    assert kft.to_keyfold_mask(mu.causal_mask_function) == kf.causal()
    assert kft.to_keyfold_mask(mu.sliding_window_causal_mask_function(3)) == kf.window(2, None) & kf.causal()
    chunked = kft.to_keyfold_mask(cases["chunked (kept as a callable)"])  # the unknown piece only
    assert isinstance(chunked.a, kft._HFMaskFn) and chunked.b == kf.causal()


def test_packed_sequences_from_position_ids():
    """position_ids restarting at 0 mark packed sequences: each attends only to itself."""
    model = build("llama")
    ids = torch.randint(3, VOCAB, (1, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    got = run(model, "keyfold", input_ids=ids, position_ids=pos, use_cache=False)  # (transformers
    want = run(model, "eager", input_ids=ids, position_ids=pos, use_cache=False)   # packs without a cache)
    assert (got - want).abs().max() <= 1e-4
    alone = run(model, "keyfold", input_ids=ids[:, 4:7])
    assert (got[0, 4:7] - alone[0]).abs().max() <= 1e-5
    mu = transformers.masking_utils
    psm = mu.find_packed_sequence_indices(pos)
    fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
                      mu.packed_sequence_mask_function(psm))
    assert kft.to_keyfold_mask(fn) == kf.causal() & kf.documents(psm)  # closed form, not a callable


def test_dropout_in_training_is_explicit():
    model = build("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    ids, am = batch(left=True)
    model.set_attn_implementation("keyfold")
    if kft._supports_dropout():
        model(input_ids=ids, attention_mask=am)
    else:
        with pytest.raises(NotImplementedError, match="dropout"):
            model(input_ids=ids, attention_mask=am)


def test_import_keyfold_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, keyfold, keyfold.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["llama", pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("gemma2", marks=pytest.mark.slow)])
def test_compiles_whole_with_padding(name):
    """torch.compile(fullgraph=True) of a padded forward: 0 graph breaks, eager's logits. Mistral's
    and Gemma 2's sliding-window mask functions are closures made while dynamo traces (it cannot
    read their ``__closure__``): the mask builder calls them on symbolic positions instead (5 graph
    breaks before it did)."""
    model = build(name)
    model.set_attn_implementation("keyfold")
    ids, am = batch(left=True)

    def forward(ids, am):
        return model(input_ids=ids, attention_mask=am, use_cache=False).logits

    ex = torch._dynamo.explain(forward)(ids, am)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    got, want = compiled(ids, am), forward(ids, am)
    real = am.bool()
    assert (got - want)[real].abs().max() <= 1e-5
    model.set_attn_implementation("eager")
    assert (got - forward(ids, am))[real].abs().max() <= 1e-4
    model.set_attn_implementation("keyfold")
    am2 = am.flip(0)  # other padding, same shapes: the same graph, the new padding honoured
    assert (compiled(ids.flip(0), am2) - forward(ids.flip(0), am2))[am2.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_compiled_static_cache_generate_is_identical(name):
    """generate(cache_implementation="static") with transformers compiling the decoding steps
    (fullgraph=True): eager's greedy tokens, and (Llama) one graph for every step, since the
    cache position reaches keyfold as a tensor rather than an int guarded at each step."""
    from torch._dynamo.utils import counters
    model = build(name)
    ids, am = batch(left=True)
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              cache_implementation="static")
    model.set_attn_implementation("eager")
    want = model.generate(**kw)
    model.set_attn_implementation("keyfold")
    cc = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    cc._compile_all_devices = True  # transformers compiles generate's decoding only on accelerators unless told
    torch._dynamo.reset()
    counters.clear()
    got = model.generate(**kw, compile_config=cc)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] >= 1  # the decoding steps did run compiled
    if name == "llama":  # (a sliding-window cache layer guards on its own int length: one recompile)
        assert counters["stats"]["unique_graphs"] == 1


def test_static_cache_offset_is_copied_before_the_cache_advances():
    """A StaticCache layer's length is a tensor it advances in place inside the forward, after the
    mask is built: the mask keeps its own copy (a shared one would move every query by Nq)."""
    pos = torch.tensor(7)
    built = kft.mask_interface(1, 1, 16, q_offset=pos, attention_mask=torch.ones(1, 8, dtype=torch.bool))
    pos.add_(1)
    assert int(built.q_offset) == 7


def test_symbolic_probe_reads_transformers_mask_functions():
    """What the mask builder uses while compiling: the same keyfold masks as the closure reader."""
    mu = transformers.masking_utils
    for fn in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(3),
               mu.sliding_window_bidirectional_mask_function(2),
               mu.or_masks(mu.causal_mask_function, mu.sliding_window_bidirectional_overlay(1))):
        got, want = kft.traced_mask(fn), kft.to_keyfold_mask(fn)
        assert torch.equal(got.to_dense(9, 9), want.to_dense(9, 9)), fn
    assert kft.traced_mask(mu.bidirectional_mask_function) is None
    chunked = mu.chunked_causal_mask_function(2, torch.tensor([0, 1]))  # indexes a tensor
    with pytest.raises(kft._NotClosedForm):
        kft.traced_mask(chunked)


def _packed_functions(mu):
    """transformers' packed-sequence mask functions (as create_causal_mask composes them), and one
    whose sequence ids do not come from its positions (the remapping must then stay exact)."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    psm = mu.find_packed_sequence_indices(pos)

    def packed(fn, ids=psm):
        return mu.and_masks(mu.remap_positions_for_packed_sequence(fn, pos), mu.packed_sequence_mask_function(ids))

    return {"causal": packed(mu.causal_mask_function),
            "sliding window": packed(mu.sliding_window_causal_mask_function(3)),
            "ids not from the positions": packed(mu.causal_mask_function, torch.zeros_like(psm))}, psm


def test_packed_mask_functions_read_exactly_traced_and_eager():
    """The symbolic probe (what the mask builder runs while compiling) reads the packed functions
    too: ``position_ids[b, q_idx]`` is a remapped position, ``psm[b, q] == psm[b, kv]`` documents.
    Both readers give the function's own answer on every pair; where the ids do come from the
    positions, ``&`` turns the remapped mask into the plain closed form."""
    mu = transformers.masking_utils
    cases, psm = _packed_functions(mu)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(1).view(1, 1, 1, 1)
    qp, kp = torch.arange(10).view(1, 1, 10, 1), torch.arange(10).view(1, 1, 1, 10)
    for what, fn in cases.items():
        want = torch.broadcast_to(fn(b, h, qp, kp), (2, 1, 10, 10))
        for reader in (kft.traced_mask, kft.to_keyfold_mask):
            m = reader(fn)
            assert not isinstance(m, kft._HFMaskFn) and "fn" not in repr(m), (what, m)
            assert torch.equal(torch.broadcast_to(m.evaluate(b, h, qp, kp), (2, 1, 10, 10)), want), (what, reader)
    assert kft.traced_mask(cases["causal"]) == kf.causal() & kf.documents(psm)
    assert kft.traced_mask(cases["sliding window"]) == kf.window(2, None) & kf.causal() & kf.documents(psm)
    assert "remapped" in repr(kft.traced_mask(cases["ids not from the positions"]))


def test_packed_masks_reach_the_op_as_data_and_plan_in_closed_form():
    """Traced, the positions are unknown and the mask stays remapped; the op rebuilds it with the
    data and ``&`` drops the remapping (no per-pair evaluation in the plan)."""
    from keyfold.ops import flatten, unflatten
    mu = transformers.masking_utils
    cases, psm = _packed_functions(mu)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    traced = kf.masks._And(kf.masks._Remapped(kf.causal(), pos), kf.documents(psm))  # as the trace builds it
    spec, tensors = flatten(traced, None, kf.Backend.AUTO, None)
    assert '"remap"' in spec
    mask = unflatten(spec, tensors)[0]
    assert mask == kf.causal() & kf.documents(psm, psm)


def test_packed_position_ids_compile_whole():
    """Packed sequences from position_ids (transformers packs when there is no attention_mask and
    no cache; under compile it always does): 0 graph breaks with fullgraph (3 before: the probe
    indexed position_ids with Python objects), eager's logits, and a new packing of the same
    shape runs in the same graph with its own answer."""
    model = build("llama")
    model.set_attn_implementation("keyfold")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 10), generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])

    def forward(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    ex = torch._dynamo.explain(forward)(ids, pos)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    got, want = compiled(ids, pos), forward(ids, pos)
    assert (got - want).abs().max() <= 1e-5
    params = [p for p in model.parameters() if p.requires_grad]  # packing is for training: eager's gradients
    for a, b in zip(torch.autograd.grad(got.square().mean(), params), torch.autograd.grad(want.square().mean(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    got = got.detach()
    model.set_attn_implementation("eager")
    assert (got - forward(ids, pos)).abs().max() <= 1e-4
    other = torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5, 0, 1]])
    want = forward(ids, other)
    model.set_attn_implementation("keyfold")
    with torch.compiler.set_stance("fail_on_recompile"):
        assert (compiled(ids, other) - want).abs().max() <= 1e-4


def test_unreadable_mask_function_compiles_as_a_dense_mask():
    """A mask function the probe cannot read (chunked attention indexes left_padding by the batch
    index) is evaluated densely by transformers' sdpa_mask while compiling, and reaches the op as
    data: 0 breaks, the eager answer, and new padding in the same graph (it raised inside dynamo)."""
    mu = transformers.masking_utils
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))

    def chunked(q, k, v, left, am):
        fn = mu.and_masks(mu.causal_mask_function, mu.chunked_causal_mask_function(3, left))
        return kft.attention_forward(None, q, k, v, kft.mask_interface(2, 9, 9, mask_function=fn, attention_mask=am))[0]

    am = torch.ones(2, 9, dtype=torch.bool)
    am[1, :2] = False
    left = torch.tensor([0, 2])
    ex = torch._dynamo.explain(chunked)(q, k, v, left, am)
    assert ex.graph_break_count == 0, ex.break_reasons
    compiled = torch.compile(chunked, fullgraph=True, backend="aot_eager")
    assert (compiled(q, k, v, left, am) - chunked(q, k, v, left, am)).abs().max() <= 1e-6
    with torch.compiler.set_stance("fail_on_recompile"):
        left2, am2 = torch.tensor([1, 0]), am.flip(0)
        assert (compiled(q, k, v, left2, am2) - chunked(q, k, v, left2, am2)).abs().max() <= 1e-6


@pytest.mark.parametrize("fn", ["bidirectional_mask_function", "causal_mask_function"])
def test_a_static_caches_empty_slots_are_hidden_from_masks_that_are_not_causal(fn):
    """A StaticCache's slots past the 2-D attention_mask hold no key yet. The padding was only
    built when the mask had a padded entry, so with an all-real mask a bidirectional mask function
    saw the empty slots and averaged them in (a Gemma 3 with use_bidirectional_attention: logits
    off by 1.7, a helper's fuzz); transformers pads them False."""
    mu = transformers.masking_utils
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (1, 4, 4))
    k[:, :, 1:] = 0  # the cache's empty slots
    v[:, :, 1:] = 0
    m = kft.mask_interface(1, 1, 4, q_offset=0, kv_offset=0, mask_function=getattr(mu, fn),
                           attention_mask=torch.ones(1, 1, dtype=torch.bool))
    out = kft.attention_forward(None, q, k, v, m)[0]
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    assert str(m) == repr(m)  # (BlockMask's __str__ raised AttributeError)


def _gemma4_kv_shared():
    t = transformers
    torch.manual_seed(0)
    cfg = t.Gemma4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                             num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.Gemma4ForCausalLM(cfg).float().eval()


def _qwen2_moe_default():
    t = transformers
    torch.manual_seed(0)
    cfg = t.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return t.Qwen2MoeForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("make", [_gemma4_kv_shared, _qwen2_moe_default])
def test_models_that_slice_the_mask_or_build_an_empty_window_match_eager(make):
    """Gemma 4's KV-shared layers slice the mask by query on every forward (BlockMask's indexing raised
    AttributeError 'dq_kv_order'); Qwen2-MoE's default config builds a window-0 mask no layer uses
    (window(-1) raised). Both now run: logits on a left-padded batch, logits_to_keep and greedy
    generation equal eager's (reviews, 2026-12-08)."""
    model = make()
    ids, am = batch(left=True)
    real = am.bool()
    want = run(model, "eager", input_ids=ids, attention_mask=am)
    got = run(model, "keyfold", input_ids=ids, attention_mask=am)
    assert (got - want)[real].abs().max() <= 1e-4
    for keep in (1, 3):
        want = run(model, "eager", input_ids=ids, attention_mask=am, logits_to_keep=keep)
        got = run(model, "keyfold", input_ids=ids, attention_mask=am, logits_to_keep=keep)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-4
    gens = {}
    for impl in ("eager", "keyfold"):
        model.set_attn_implementation(impl)
        gens[impl] = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False)
    assert torch.equal(gens["eager"], gens["keyfold"])


def test_a_sliced_mask_moves_its_query_offset_and_other_indexing_raises():
    mask = kft.KeyfoldMask(kf.causal(), 0, 0, (2, 1, 10, 10))
    rows = mask[:, :, -3:]
    assert (rows.q_offset, rows.shape) == (7, (2, 1, 3, 10))
    rows = mask[..., 2:5, :]
    assert (rows.q_offset, rows.shape) == (2, (2, 1, 3, 10))
    q = torch.randn(2, 4, 10, 8)
    k = v = torch.randn(2, 2, 10, 8)
    whole, _ = kft.attention_forward(torch.nn.Module(), q, k, v, mask)
    part, _ = kft.attention_forward(torch.nn.Module(), q[:, :, 7:], k, v, mask[:, :, -3:])
    torch.testing.assert_close(part, whole[:, 7:])
    with pytest.raises(NotImplementedError, match="only its query rows"):
        mask[:, 0]
    with pytest.raises(TypeError, match="not a tensor"):
        torch.zeros(2, 1, 10, 10) + mask


@pytest.mark.parametrize("name", ["block_indices", "indices"])
def test_a_models_key_selection_is_refused_not_dropped(name):
    """MiniMax-M3 hands its sparse key-block selection to any attention but eager and sdpa as
    block_indices= (the DeepSeek-V3.2 family: indices=); keyfold dropped it and attended densely,
    4.1 off (a review, 2026-12-08)."""
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=name):
        kft.attention_forward(torch.nn.Module(), q, k, v, None, **{name: torch.zeros(1, 2, 4, 1, dtype=torch.long)})


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_learned_sinks_are_refused_as_sinks(name):
    """Learned attention sinks come as s_aux= (gpt-oss) or sinks= (Inkling 2): refused, and said to be sinks
    (sinks= was called "a selection of keys"; a review, 2026-12-08)."""
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=rf"learned attention sinks \({name}=\)"):
        kft.attention_forward(torch.nn.Module(), q, k, v, None, **{name: torch.zeros(2)})


def test_doge_is_refused():
    """Doge folds its causal and padding mask into its own bias only when the mask is not a BlockMask,
    which keyfold's mask is: its tokens saw the future, 3.2 off (a review, 2026-12-08)."""
    t = transformers
    torch.manual_seed(0)
    model = t.DogeForCausalLM(t.DogeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)).float().eval()
    ids, am = batch(left=True)
    with pytest.raises(NotImplementedError, match="DogeAttention"):
        run(model, "keyfold", input_ids=ids, attention_mask=am)


def test_more_keys_than_the_mask_describes_raise():
    """transformers' sliding-window DynamicCache with sliding_window=1 keeps every key while its mask
    describes one: keyfold read key j at position kv_offset + j, 0.15-0.35 off eager from the second
    generated token, silently (a review, 2026-12-08). Such a call now raises."""
    t = transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = t.MistralForCausalLM(t.MistralConfig(**common, sliding_window=1)).float().eval()
    model.set_attn_implementation("keyfold")
    with pytest.raises(RuntimeError, match="keys but its mask describes"):
        model.generate(input_ids=torch.randint(3, VOCAB, (1, 4)), max_new_tokens=3, do_sample=False)
    q = torch.randn(1, 4, 1, 8)
    k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="5 keys"):
        kft.attention_forward(torch.nn.Module(), q, k, v, kft.KeyfoldMask(kf.causal(), 4, 4, (1, 1, 1, 1)))
