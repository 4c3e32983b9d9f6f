"""Classifier and Transformer: parity with nn.Transformer, mask properties, decoding, learning."""

import json

import pytest
import torch
from test_core import TOL, copy_decoder_layer, copy_encoder_layer, lengths_to_tokens
from torch import nn

from classify.engine.files import load_model_weights, model_state, save_tensors
from classify.generate import generate
from classify.models import Classifier, ClassifierConfig, Transformer, TransformerConfig


def tiny_transformer(**overrides) -> Transformer:
    cfg = dict(src_vocab_size=20, tgt_vocab_size=20, d_model=32, num_heads=4, num_encoder_layers=2,
               num_decoder_layers=2, d_ff=64, max_len=32, dropout=0.0)
    cfg.update(overrides)
    return Transformer(**cfg)


def test_transformer_matches_torch_transformer_float64():
    torch.manual_seed(0)
    ours = tiny_transformer().double()
    theirs = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True, norm_first=True).double()
    for a, b in zip(ours.encoder.layers, theirs.encoder.layers):
        copy_encoder_layer(a, b)
    for a, b in zip(ours.decoder.layers, theirs.decoder.layers):
        copy_decoder_layer(a, b)
    ours.encoder.norm.load_state_dict(theirs.encoder.norm.state_dict())
    ours.decoder.norm.load_state_dict(theirs.decoder.norm.state_dict())

    src, tgt = lengths_to_tokens([6, 3], pad_id=0) % 20, lengths_to_tokens([5, 5]) % 20
    src[src == 0] = 0
    logits = ours(src, tgt)
    x_src, x_tgt = ours.src_embed(src), ours.tgt_embed(tgt)
    hidden = theirs(x_src, x_tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.bool),
                    src_key_padding_mask=src == 0, memory_key_padding_mask=src == 0)
    ref = ours.generator(hidden)
    torch.testing.assert_close(logits, ref, **TOL)
    assert logits.shape == (2, 5, 20)


def test_config_round_trips_through_json():
    cfg = ClassifierConfig(vocab_size=100, d_model=32, num_heads=4)
    again = ClassifierConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    model = Classifier(again)
    assert model.config.d_model == 32
    tcfg = TransformerConfig(src_vocab_size=10, tgt_vocab_size=12, d_model=16, num_heads=2)
    assert TransformerConfig.from_dict(tcfg.to_dict()) == tcfg
    with pytest.raises(ValueError, match="unknown"):
        ClassifierConfig.from_dict({"vocab_size": 3, "bogus": 1})


def test_an_encoder_decoder_refuses_positions_counted_from_the_end():
    with pytest.raises(ValueError, match="decoder"):
        Transformer(src_vocab_size=10, tgt_vocab_size=12, d_model=16, num_heads=2, positional="end+rotary")


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError, match="multiple"):
        Classifier(vocab_size=10, d_model=30, num_heads=4)


# ------------------------------------------------------------------------- classifier
@pytest.mark.parametrize("pooling, positional", [("mean", "learned"), ("max", "learned"), ("first", "learned"),
                                                 ("attention", "learned"), ("mean", "rotary"),
                                                 ("mean", "learned+rotary"), ("mean", "end+rotary")])
def test_padding_does_not_change_classifier_logits(pooling, positional):
    torch.manual_seed(0)
    model = Classifier(vocab_size=50, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=40,
                       pooling=pooling, positional=positional).eval()
    if pooling == "attention":   # a query that prefers some tokens (zero weighs them all alike)
        nn.init.normal_(model.pool_query, std=1.0)
    tokens = torch.randint(1, 50, (1, 7))
    alone = model(tokens)
    padded = torch.cat([tokens, torch.zeros(1, 9, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded), alone, rtol=1e-5, atol=1e-6)
    other = torch.randint(1, 50, (1, 16))
    batch = torch.cat([padded, other])
    torch.testing.assert_close(model(batch)[:1], alone, rtol=1e-5, atol=1e-6)


def test_attention_pooling_starts_as_the_mean_and_its_query_weighs_the_tokens():
    torch.manual_seed(0)
    model = Classifier(vocab_size=50, d_model=32, num_heads=4, num_layers=1, d_ff=64, pooling="attention").eval()
    tokens = torch.tensor([[5, 6, 7, 8, 0, 0]])
    hidden = model.encode(tokens)[:, :4]                        # the real tokens' vectors (1, 4, D)
    attention = model.pool_attention
    d = model.config.d_model
    values = hidden @ attention.in_proj.weight[2 * d:].T + attention.in_proj.bias[2 * d:]
    # A zero query (as initialised) gives every real token the same weight: the mean of their values.
    torch.testing.assert_close(model.pool(model.encode(tokens), tokens), attention.out_proj(values.mean(1)))
    # A learned query does not: the pooled vector is then a weighted mean, which the attention weights give.
    nn.init.normal_(model.pool_query, std=1.0)
    query = model.pool_query
    _, weights = attention(query, hidden, hidden, need_weights=True)    # (1, H, 1, 4)
    assert not torch.allclose(weights, torch.full_like(weights, 0.25))
    torch.testing.assert_close(model.pool(model.encode(tokens), tokens), attention(query, hidden, hidden)[0][:, 0])
    with pytest.raises(ValueError, match="pooling must be one of"):
        Classifier(vocab_size=50, pooling="median")


def test_without_padding_mask_padding_changes_logits():
    """The Bloem ablation switch really does let padding leak in (so the test above can fail)."""
    torch.manual_seed(0)
    model = Classifier(vocab_size=50, d_model=32, num_heads=4, num_layers=1, d_ff=64, mask_padding=False).eval()
    tokens = torch.randint(1, 50, (1, 7))
    padded = torch.cat([tokens, torch.zeros(1, 9, dtype=torch.long)], dim=1)
    assert not torch.allclose(model(padded), model(tokens), atol=1e-4)


def test_the_scope_embedding_marks_for_the_transformer_the_words_the_branch_reads_as_negated(monkeypatch):
    torch.manual_seed(0)
    NOT, BREAK = 5, 6   # the negator and a clause break of this toy vocabulary
    model = Classifier(vocab_size=50, d_model=32, num_heads=4, num_layers=1, d_ff=64, ngram_orders=1,
                       ngram_buckets=101, ngram_negation=2, ngram_negators=[NOT], ngram_breaks=[BREAK],
                       scope_embedding=True).eval()
    plain = Classifier(model.config.__class__(**{**model.config.to_dict(), "scope_embedding": False})).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "scope_vector"})
    negated, kept = torch.tensor([[9, NOT, 10, 11, 12, 0]]), torch.tensor([[9, 13, 10, 11, 12, 0]])
    assert model.ngram.scope(negated).tolist() == [[False, False, True, True, False, False]]
    # It starts at zero: the transformer is the one without it until training moves the vector.
    for tokens in (negated, kept):
        torch.testing.assert_close(model.transformer(tokens), plain.transformer(tokens))
    nn.init.normal_(model.scope_vector, std=1.0)
    assert not torch.allclose(model.transformer(negated), plain.transformer(negated), atol=1e-4)
    torch.testing.assert_close(model.transformer(kept), plain.transformer(kept))   # no scope: nothing added
    # Padding still changes no real token's output, the scope of a padded text being its own.
    padded = torch.cat([negated, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model.transformer(padded), model.transformer(negated), rtol=1e-5, atol=1e-6)
    # The model reads the scope once for both branches and gets what each branch gets reading it on its own.
    calls, read = [], model.ngram.scope
    monkeypatch.setattr(model.ngram, "scope", lambda tokens: calls.append(tokens) or read(tokens))
    parts = model.branches(negated)
    assert len(calls) == 1
    torch.testing.assert_close(parts.transformer, model.transformer(negated))
    torch.testing.assert_close(parts.ngram, model.ngram(negated))
    with pytest.raises(ValueError, match="scope_embedding marks the words"):
        Classifier(vocab_size=50, ngram_orders=1, scope_embedding=True)


def test_scope_dropout_leaves_the_mark_off_whole_texts_in_training_only():
    torch.manual_seed(0)
    NOT, BREAK = 5, 6
    model = Classifier(vocab_size=50, d_model=32, num_heads=4, num_layers=1, d_ff=64, dropout=0.0, ngram_orders=1,
                       ngram_buckets=101, ngram_negation=2, ngram_negators=[NOT], ngram_breaks=[BREAK],
                       scope_embedding=True, scope_dropout=0.5)
    nn.init.normal_(model.scope_vector, std=1.0)
    negated = torch.tensor([[9, NOT, 10, 11, 12, 0]]).expand(64, -1)
    model.eval()
    marked = model.transformer(negated)[0]
    with torch.no_grad():
        saved = model.scope_vector.clone()
        model.scope_vector.zero_()
        unmarked = model.transformer(negated[:1])[0]
        model.scope_vector.copy_(saved)
    model.train()   # no other dropout: the only randomness is the mark's
    logits = model.transformer(negated)
    is_marked = torch.isclose(logits, marked, atol=1e-5).all(dim=1)
    is_unmarked = torch.isclose(logits, unmarked, atol=1e-5).all(dim=1)
    assert (is_marked ^ is_unmarked).all()                 # each text all marked or not at all
    assert 16 <= int(is_unmarked.sum()) <= 48              # about half of 64 at p = 0.5
    model.eval()
    torch.testing.assert_close(model.transformer(negated), marked.expand(64, -1))   # never at inference
    for bad in ({"scope_dropout": 1.0}, {"scope_dropout": 0.5, "scope_embedding": False}):
        with pytest.raises(ValueError, match="scope_dropout leaves"):
            Classifier(model.config.__class__(**{**model.config.to_dict(), **bad}))


def test_all_padding_row_is_finite():
    model = Classifier(vocab_size=20, d_model=16, num_heads=2, num_layers=1, d_ff=32).eval()
    assert torch.isfinite(model(torch.zeros(2, 4, dtype=torch.long))).all()


@pytest.mark.slow
def test_classifier_learns_separable_toy_task():
    torch.manual_seed(0)
    # class 1 sequences contain token 3; class 0 contain token 4; the rest is noise 5..19
    n, t = 256, 12
    tokens = torch.randint(5, 20, (n, t))
    labels = torch.randint(0, 2, (n,))
    pos = torch.randint(0, t, (n,))
    tokens[torch.arange(n), pos] = torch.where(labels == 1, 3, 4)
    model = Classifier(vocab_size=20, d_model=32, num_heads=4, num_layers=1, d_ff=64, max_len=t, dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = nn.functional.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = (model(tokens).argmax(-1) == labels).float().mean()
    assert acc > 0.97


# ---------------------------------------------------------------------- transformer
def test_future_target_tokens_do_not_change_earlier_outputs():
    torch.manual_seed(0)
    model = tiny_transformer().eval()
    src = torch.randint(1, 20, (2, 6))
    tgt = torch.randint(1, 20, (2, 5))
    changed = tgt.clone()
    changed[:, 3:] = torch.randint(1, 20, (2, 2))
    torch.testing.assert_close(model(src, tgt)[:, :3], model(src, changed)[:, :3])


def test_source_padding_does_not_change_decoder_outputs():
    torch.manual_seed(0)
    model = tiny_transformer().eval()
    src = torch.randint(1, 20, (1, 6))
    tgt = torch.randint(1, 20, (1, 4))
    padded = torch.cat([src, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded, tgt), model(src, tgt), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_cached_greedy_equals_full_rerun_and_beam_one(positional):
    torch.manual_seed(0)
    model = tiny_transformer(positional=positional)
    with torch.no_grad():   # a trained model never emits padding; the rerun would mask it, the cache would not
        model.generator.bias[model.config.pad_id] = -1e4
    src = torch.randint(3, 20, (4, 7))
    cached = generate(model, src, max_new_tokens=10, bos_id=1, eos_id=2)
    rerun = generate(model, src, max_new_tokens=10, bos_id=1, eos_id=2, use_cache=False)
    beam1 = generate(model, src, max_new_tokens=10, bos_id=1, eos_id=2, beam_size=1)
    assert torch.equal(cached, rerun)
    assert torch.equal(cached, beam1)
    assert cached[:, 0].eq(1).all()


def test_beam_search_cache_matches_rerun_and_scores_at_least_greedy():
    torch.manual_seed(0)
    model = tiny_transformer()
    src = torch.randint(3, 20, (3, 6))
    a = generate(model, src, max_new_tokens=8, bos_id=1, eos_id=2, beam_size=4)
    b = generate(model, src, max_new_tokens=8, bos_id=1, eos_id=2, beam_size=4, use_cache=False)
    assert torch.equal(a, b)


def _copy_task_batch(n: int, length: int, vocab: int):
    body = torch.randint(3, vocab, (n, length))
    src = body
    tgt = torch.cat([torch.full((n, 1), 1), body, torch.full((n, 1), 2)], dim=1)  # BOS body EOS
    return src, tgt


@pytest.mark.slow
def test_transformer_learns_copy_task():
    torch.manual_seed(0)
    vocab = 12
    model = tiny_transformer(src_vocab_size=vocab, tgt_vocab_size=vocab, num_encoder_layers=1,
                             num_decoder_layers=1, d_model=64, d_ff=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        src, tgt = _copy_task_batch(64, 6, vocab)
        logits = model(src, tgt[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    src, tgt = _copy_task_batch(100, 6, vocab)
    out = generate(model, src, max_new_tokens=7, bos_id=1, eos_id=2)
    seq_acc = (out[:, : tgt.shape[1]] == tgt).all(dim=1).float().mean()
    assert seq_acc > 0.95, seq_acc
    beam = generate(model, src, max_new_tokens=7, bos_id=1, eos_id=2, beam_size=3)
    assert (beam[:, : tgt.shape[1]] == tgt).all(dim=1).float().mean() > 0.95


def test_tied_embeddings_share_storage():
    model = tiny_transformer(tie_embeddings=True)
    assert model.generator.weight.data_ptr() == model.tgt_embed.tokens.weight.data_ptr()


def test_tied_embeddings_are_saved_once_and_stay_tied_after_loading(tmp_path):
    model = tiny_transformer(tie_embeddings=True)
    state = model_state(model)
    assert "tgt_embed.tokens.weight" in state and "generator.weight" not in state
    save_tensors(tmp_path / "w.safetensors", state)
    loaded = tiny_transformer(tie_embeddings=True)
    load_model_weights(loaded, tmp_path / "w.safetensors")
    assert loaded.generator.weight.data_ptr() == loaded.tgt_embed.tokens.weight.data_ptr()
    assert torch.equal(loaded.generator.weight, model.generator.weight)
    assert set(model_state(tiny_transformer())) == set(state) | {"generator.weight"}  # untied: both


def test_attention_dropout_is_separate_from_dropout():
    model = Classifier(vocab_size=20, d_model=16, num_heads=2, num_layers=1, d_ff=32, dropout=0.1,
                       attention_dropout=0.0)
    block = model.encoder.layers[0]
    assert block.self_attn.dropout == 0.0 and block.feed_forward.dropout.p == 0.1
    assert Classifier(vocab_size=20, d_model=16, num_heads=2, num_layers=1, d_ff=32,
                      dropout=0.2).encoder.layers[0].self_attn.dropout == 0.2
    seq = tiny_transformer(dropout=0.1, attention_dropout=0.05)
    assert seq.decoder.layers[0].cross_attn.dropout == 0.05
