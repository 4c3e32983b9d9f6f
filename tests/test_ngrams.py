"""The n-gram branch: hashing, padding, gradients, fitting, mixing, checkpoints and their compact storage."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from classify.engine import files
from classify.engine.optim import build_optimizer
from classify.engine.runfolder import LAST, RunFolder
from classify.text.batching import pad_batch
from classify.models import Classifier, ClassifierConfig
from classify.mix import fit_mix, mix_features, mixed_logits
from classify.ngrams import (Family, NgramBag, bag_logits, families, feature_matrix, fit_features, fit_ngram_bag,
                             ellipsis_scope, group_counts, naive_bayes_ratios, negation_scope, ngram_ids,
                             self_train_ngram_bag)

VOCAB, BUCKETS = 50, 1009
HEAD, TAIL = 4, 5   # the families' sizes in these tests (the default model's are 30 and 60)


def expected_slots(ids: list[int], orders: int = 3, skip_bigrams: bool = False, head: int = 0,
                   tail: int = 0) -> set[int]:
    """The slots of one unpadded review, computed one n-gram at a time (the definition)."""
    base = VOCAB + 1

    def slot(positions: list[int], family: Family) -> int:
        code = sum((ids[p] + 1) * base ** k for k, p in enumerate(positions))
        return (code % BUCKETS + family.salt(BUCKETS)) % BUCKETS

    slots = set()
    for n in range(1, orders + 1):
        for i in range(len(ids) - n + 1):
            slots.add(slot(list(range(i, i + n)), Family(tuple(range(n)))))
            if i + n <= head:                                   # wholly within the first ``head`` tokens
                slots.add(slot(list(range(i, i + n)), Family(tuple(range(n)), "head", head)))
            if i >= len(ids) - tail:                            # wholly within the last ``tail`` tokens
                slots.add(slot(list(range(i, i + n)), Family(tuple(range(n)), "tail", tail)))
    if skip_bigrams:
        slots |= {slot([i, i + 2], Family((0, 2))) for i in range(len(ids) - 2)}
    return slots


def test_plain_ngrams_hash_as_before_the_other_families():
    # Run folders fitted before the families existed must give the same slots: no salt on plain n-grams.
    assert all(f.salt(BUCKETS) == 0 for f in families(3))
    assert len({f.salt(BUCKETS) for f in families(3, True, HEAD, TAIL)}) == 1 + 1 + 3 + 3
    assert expected_slots([7], orders=1) == {8}   # one token: its id + 1


def test_every_family_sees_its_ngrams_once_and_never_padding():
    reviews = [[5, 6, 7, 5, 6, 9, 9, 2, 3], [9], [3, 3, 3, 3], list(range(1, 14))]
    kinds = families(3, skip_bigrams=True, head=HEAD, tail=TAIL)
    for length in (None, 20):   # padded to the longest review, and further
        slots = ngram_ids(pad_batch(reviews, 0, length=length), 0, VOCAB, BUCKETS, kinds)
        for row, review in zip(slots, reviews):
            present = row[row != BUCKETS].tolist()
            assert len(present) == len(set(present))
            assert set(present) == expected_slots(review, 3, True, HEAD, TAIL)


def test_slots_are_every_ngram_once_and_never_padding():
    reviews = [[5, 6, 7, 5, 6], [9], [3, 3, 3, 3]]
    slots = ngram_ids(pad_batch(reviews, 0), pad_id=0, vocab_size=VOCAB, buckets=BUCKETS, kinds=families(3))
    for row, review in zip(slots, reviews):
        present = row[row != BUCKETS].tolist()
        assert len(present) == len(set(present))            # each slot once (binary features)
        assert set(present) == expected_slots(review)       # every 1-3-gram, none with padding
    # Padding the same review further changes nothing.
    longer = ngram_ids(pad_batch(reviews, 0, length=12), 0, VOCAB, BUCKETS, families(3))
    for a, b in zip(slots, longer):
        assert set(a[a != BUCKETS].tolist()) == set(b[b != BUCKETS].tolist())


@pytest.mark.slow
def test_hashing_is_the_same_in_another_process():
    tokens = torch.randint(1, VOCAB, (4, 30), generator=torch.Generator().manual_seed(0))
    tokens[1, 20:] = 0
    here = ngram_ids(tokens, 0, VOCAB, BUCKETS, families(3, True, HEAD, TAIL)).tolist()
    code = ("import json, sys, torch; from classify.ngrams import families, ngram_ids; "
            f"t = torch.tensor({tokens.tolist()}); "
            f"print(json.dumps(ngram_ids(t, 0, {VOCAB}, {BUCKETS}, families(3, True, {HEAD}, {TAIL})).tolist()))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert here == there


def branch_model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    model = Classifier(vocab_size=VOCAB, num_classes=2, d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=64,
                       dropout=0.0, ngram_orders=3, ngram_buckets=BUCKETS, ngram_skip_bigrams=True, ngram_head=HEAD,
                       ngram_tail=TAIL).eval()
    with torch.no_grad():  # a non-trivial branch and mix, so that a wrong slot would show
        model.ngram.weight.normal_()
        model.ngram.weight[BUCKETS] = 0
        model.mix.copy_(torch.tensor([[0.7, 0.1], [1.3, -0.2]]))
    return model


def test_logits_alone_equal_logits_in_a_padded_batch_with_the_branch_on():
    model = branch_model()
    reviews = [[4, 8, 15, 16, 23, 42], [7, 7], list(range(1, 30))]
    batch = model(pad_batch(reviews, 0))
    for i, review in enumerate(reviews):
        alone = model(torch.tensor([review]))
        torch.testing.assert_close(alone[0], batch[i], atol=1e-5, rtol=1e-5)
    parts = model.branches(pad_batch(reviews, 0))
    assert parts.lengths.tolist() == [6, 2, 29]
    log_length = parts.lengths.float().log().unsqueeze(1)
    torch.testing.assert_close((0.7 + 0.1 * log_length) * parts.transformer + (1.3 - 0.2 * log_length) * parts.ngram,
                               batch)


def test_branch_output_is_the_sum_of_its_slots_and_gradients_reach_exactly_those_slots():
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
    with torch.no_grad():
        bag.weight.normal_()
    review = [3, 1, 4, 1, 5]
    out = bag(pad_batch([review, [2]], 0, length=8))
    slots = sorted(expected_slots(review))
    torch.testing.assert_close(out[0], bag.weight[slots].sum(0) + bag.bias)
    out[0, 1].backward()
    touched = bag.weight.grad[:, 1].nonzero().flatten().tolist()
    assert touched == slots and bag.weight.grad[BUCKETS].abs().sum() == 0


def test_fitted_branch_separates_the_classes_and_matches_its_feature_matrix():
    rng = np.random.default_rng(0)
    positive, negative = [10, 11, 12], [20, 21, 22]
    ids, labels = [], []
    for i in range(200):
        label = i % 2
        words = rng.integers(30, VOCAB, size=rng.integers(5, 20)).tolist()
        words.insert(int(rng.integers(0, len(words))), int(rng.choice(positive if label else negative)))
        ids.append(words)
        labels.append(label)
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
    fit_ngram_bag(bag, ids[:150], labels[:150], c=1.0)
    held_out = bag(pad_batch(ids[150:], 0)).argmax(-1).numpy()
    assert (held_out == np.asarray(labels[150:])).mean() > 0.95
    features = feature_matrix(bag, ids[:3])
    for row, review in zip(features, ids[:3]):
        assert set(row.indices.tolist()) == expected_slots(review)


def test_the_fit_reaches_the_regularised_optimum_of_its_weighted_objective():
    # The peer: liblinear's objective minimised by L-BFGS in float64: 0.5 |(w, b)|^2 + C sum_i weight_i *
    # log(1 + exp(-y_i (x_i . w + b))), x_i the naive-Bayes-scaled binary features (liblinear regularises the bias).
    rng, reviews = np.random.default_rng(1), 60
    labels = [i % 2 for i in range(reviews)]
    ids = [rng.integers(1, 8, size=rng.integers(3, 9)).tolist() + [10 if y else 20] * int(rng.random() < 0.6)
           for y in labels]
    weights = np.where(np.arange(reviews) % 5 == 0, 0.1, 1.0)
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
    features = feature_matrix(bag, ids)
    fit_features(bag, features, np.asarray(labels), c=0.5, weights=weights)
    y = torch.as_tensor(labels, dtype=torch.float64) * 2 - 1
    x = torch.as_tensor(features.toarray() * naive_bayes_ratios(features, np.asarray(labels), 1.0, weights),
                        dtype=torch.float64)                                                 # (N, buckets)
    w = torch.zeros(BUCKETS + 1, dtype=torch.float64, requires_grad=True)
    solver = torch.optim.LBFGS([w], max_iter=2000, tolerance_grad=1e-12, tolerance_change=1e-15,
                               line_search_fn="strong_wolfe")

    def objective():
        solver.zero_grad()
        margins = y * (x @ w[:-1] + w[-1])
        value = 0.5 * w.square().sum() + 0.5 * (torch.as_tensor(weights) * F.softplus(-margins)).sum()
        value.backward()
        return value

    solver.step(objective)
    logits = bag_logits(bag, ids).double()
    torch.testing.assert_close(logits[:, 1] - logits[:, 0], (x @ w[:-1] + w[-1]).detach(), atol=1e-2, rtol=0)


def test_min_count_leaves_slots_too_few_reviews_have_without_weight():
    # Each review carries a fingerprint n-gram no other review has, and one of two shared sentiment words.
    labels = [i % 2 for i in range(60)]
    # The bigram (30 + i % 20, 30 + i // 20) is review i's alone.
    ids = [[10 if y else 20, 30 + i % 20, 30 + i // 20] for i, y in enumerate(labels)]
    counts = np.bincount(feature_matrix(NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0), ids).indices, minlength=BUCKETS)
    for min_count, rare_kept in ((1, True), (2, False)):
        bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
        fit_ngram_bag(bag, ids, labels, c=1.0, min_count=min_count)
        weighted = (bag.weight[:BUCKETS] != 0).any(dim=1).numpy()
        assert weighted[counts == 1].any() == rare_kept           # the fingerprints only at min_count 1
        assert weighted[counts >= 2].sum() >= 30                   # what reviews share keeps its weights
        assert not weighted[counts == 0].any()
        assert (bag_logits(bag, [[10], [20]]).argmax(1).tolist() == [1, 0])


def test_smoothing_shrinks_the_weights_of_slots_few_reviews_have_more_than_shared_ones():
    # As above: every review has a fingerprint bigram of its own and one of two shared sentiment words.
    labels = [i % 2 for i in range(60)]
    ids = [[10 if y else 20, 30 + i % 20, 30 + i // 20] for i, y in enumerate(labels)]
    counts = np.bincount(feature_matrix(NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0), ids).indices, minlength=BUCKETS)
    (shared,) = expected_slots([10])                # the unigram "10", half the reviews have it

    def weights(smoothing: float) -> tuple[float, float]:
        bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
        fit_ngram_bag(bag, ids, labels, c=1.0, smoothing=smoothing)
        direction = (bag.weight[:BUCKETS, 1] - bag.weight[:BUCKETS, 0]).abs().detach().numpy()
        return float(direction[counts == 1].mean()), float(direction[shared])

    (rare_1, shared_1), (rare_20, shared_20) = weights(1.0), weights(20.0)
    assert rare_20 < 0.5 * rare_1                  # a fingerprint's weight shrinks a lot
    assert shared_20 > 0.5 * shared_1              # the word 30 reviews share keeps most of its weight
    assert rare_20 / shared_20 < rare_1 / shared_1


def test_a_slot_one_movie_alone_has_keeps_no_weight_with_min_groups():
    # Reviews of six movies, three each; each movie's reviews name it (a token of its own, 40 + movie) and carry
    # one of two shared sentiment words; the last two texts belong to no movie (group -1), like an edit.
    labels = [m % 2 for m in range(6) for _ in range(3)] + [1, 1]
    groups = np.asarray([m for m in range(6) for _ in range(3)] + [-1, -1])
    ids = [[10 if y else 20, 40 + m] for m, y in zip(groups[:18], labels)] + [[10, 46], [10, 46]]
    bag = NgramBag(VOCAB, 2, 1, BUCKETS, pad_id=0)
    features = feature_matrix(bag, ids)
    by_movie = group_counts(features, groups, BUCKETS)
    (good,), (bad,), (title,), (edit_only,) = (expected_slots([t], orders=1) for t in (10, 20, 41, 46))
    assert (by_movie[good], by_movie[bad], by_movie[title], by_movie[edit_only]) == (3, 3, 1, 0)
    fit_features(bag, features, np.asarray(labels), c=1.0, min_count=2, groups=groups, min_groups=2)
    weighted = set(np.flatnonzero((bag.weight[:BUCKETS] != 0).any(1).numpy()).tolist())
    assert weighted == {good, bad}                 # the titles (3 texts, one movie) and the edit-only word: none
    fit_features(bag, features, np.asarray(labels), c=1.0, min_count=2)
    assert {title, edit_only} <= set(np.flatnonzero((bag.weight[:BUCKETS] != 0).any(1).numpy()).tolist())


def test_self_training_gives_words_seen_only_in_unlabelled_reviews_the_sign_of_their_company():
    rng = np.random.default_rng(2)
    good, bad, new_good, new_bad = 10, 20, 13, 23   # new_*: never in a labelled review

    def review(words):
        filler = rng.integers(30, VOCAB, size=8).tolist()
        return filler[:4] + words + filler[4:]

    labels = [i % 2 for i in range(120)]
    ids = [review([good if y else bad]) for y in labels]
    unlabelled = [review([good, new_good]) for _ in range(40)] + [review([bad, new_bad]) for _ in range(40)]
    plain = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
    fit_ngram_bag(plain, ids, labels, c=1.0)
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0)
    probs = self_train_ngram_bag(bag, ids, labels, unlabelled, c=1.0)
    assert probs.shape == (80, 2) and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert probs.argmax(1).tolist() == [1] * 40 + [0] * 40    # labelled by the first fit
    def margins(b):   # what each new word alone adds to logit(good) - logit(bad), the bias left out
        logits = bag_logits(b, [[new_good], [new_bad]]) - b.bias
        return (logits[:, 1] - logits[:, 0]).tolist()

    (before_good, before_bad), (after_good, after_bad) = margins(plain), margins(bag)
    assert abs(before_good) < 0.01 and abs(before_bad) < 0.01   # unseen by the plain fit (up to hash collisions)
    assert after_good > 0.1 and after_bad < -0.1
    assert self_train_ngram_bag(bag, ids, labels, [], c=1.0).shape == (0, 2)


def test_fit_mix_finds_the_length_dependent_weights_that_generated_the_labels():
    rng = np.random.default_rng(1)
    n = 8000
    parts = rng.normal(size=(2, n, 2)).astype(np.float32)
    lengths = rng.integers(3, 500, size=n)
    true = np.array([[2.0, -0.2], [0.1, 0.3]])   # the n-gram branch counts for more on longer texts
    mixed = mixed_logits(true, parts[0], parts[1], lengths)
    p1 = 1 / (1 + np.exp(-(mixed[:, 1] - mixed[:, 0])))
    labels = (rng.random(n) < p1).astype(int).tolist()
    mix = fit_mix(parts[0], parts[1], lengths, labels, l2=0.0)
    assert np.abs(mix - true).max() < 0.2, mix
    # The fitted weights give the n-gram branch more of the vote on a 300-token review than on a sentence.
    w = mix_features(torch.tensor([8, 300])).double().numpy() @ mix.T
    assert w[1, 1] / w[1, 0] > 2 * w[0, 1] / w[0, 0]


def test_fit_mix_weights_texts_as_told():
    rng = np.random.default_rng(4)
    n = 600
    parts = rng.normal(size=(2, n, 2))
    lengths, labels = rng.integers(3, 400, size=n), rng.integers(0, 2, size=n)
    first = np.arange(n) < 400
    np.testing.assert_allclose(fit_mix(parts[0], parts[1], lengths, labels, weights=first.astype(float)),
                               fit_mix(parts[0][first], parts[1][first], lengths[first], labels[first]), atol=1e-6)
    assert not np.allclose(fit_mix(parts[0], parts[1], lengths, labels, weights=first + 0.5),
                           fit_mix(parts[0], parts[1], lengths, labels), atol=1e-3)


def test_fit_mix_takes_another_basis_of_length_features():
    """Two lines in log-length, one for texts up to 64 tokens and one past them: the weights are found again."""
    def split(lengths):
        base = mix_features(lengths)
        return torch.cat([base, base * (lengths > 64).to(base.dtype)[:, None]], dim=-1)

    rng = np.random.default_rng(2)
    n = 8000
    parts = rng.normal(size=(2, n, 2)).astype(np.float32)
    lengths = np.exp(rng.uniform(np.log(3), np.log(500), size=n)).astype(int)   # as many short texts as long
    true = np.array([[1.5, -0.1, -1.0, 0.1], [0.2, 0.1, 0.5, 0.0]])
    mixed = mixed_logits(true, parts[0], parts[1], lengths, split)
    labels = (rng.random(n) < 1 / (1 + np.exp(-(mixed[:, 1] - mixed[:, 0])))).astype(int).tolist()
    mix = fit_mix(parts[0], parts[1], lengths, labels, l2=0.0, features_of=split)
    at = split(torch.tensor([8, 30, 100, 300])).double().numpy()
    assert mix.shape == (2, 4) and np.abs(at @ mix.T - at @ true.T).max() < 0.25, (at @ mix.T, at @ true.T)


def test_a_mix_saved_before_it_depended_on_length_loads_as_constant_weights(tmp_path):
    model = branch_model()
    state = files.model_state(model)
    state["mix"] = torch.tensor([0.7, 1.3])   # the (2,) layout of older run folders
    files.save_tensors(tmp_path / "old.safetensors", state)
    files.load_model_weights(model, tmp_path / "old.safetensors")
    assert torch.equal(model.mix, torch.tensor([[0.7, 0.0], [1.3, 0.0]]))
    tokens = pad_batch([[1, 2, 3, 4], [5, 6]], 0)
    parts = model.branches(tokens)
    torch.testing.assert_close(model(tokens), 0.7 * parts.transformer + 1.3 * parts.ngram)


def test_branch_weights_round_trip_and_older_configs_load_without_a_branch(tmp_path):
    model = branch_model()
    files.save_tensors(tmp_path / "w.safetensors", files.model_state(model))
    again = Classifier(ClassifierConfig.from_dict(model.config.to_dict())).eval()
    files.load_model_weights(again, tmp_path / "w.safetensors")
    tokens = pad_batch([[1, 2, 3, 4], [5, 6]], 0)
    torch.testing.assert_close(again(tokens), model(tokens))
    # A config.json written before the branch existed has no ngram fields: a pure transformer.
    old = {k: v for k, v in model.config.to_dict().items() if not k.startswith("ngram")}
    plain = Classifier(ClassifierConfig.from_dict(old))
    assert plain.ngram is None and "mix" not in plain.state_dict()
    # One written before the other families existed has a branch of plain 1..N-grams.
    before = {k: v for k, v in model.config.to_dict().items() if k not in ("ngram_skip_bigrams", "ngram_head",
                                                                          "ngram_tail")}
    assert Classifier(ClassifierConfig.from_dict(before)).ngram.kinds == families(3)


@pytest.mark.parametrize("extra", [{}, {"skip_bigrams": True, "head": HEAD, "tail": TAIL}])
def test_token_contributions_add_up_to_the_branch_logit_difference(extra):
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0, **extra)
    with torch.no_grad():
        bag.weight.normal_()
    review = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]         # repeated n-grams count once
    direction = torch.tensor([-1.0, 1.0])
    shares = bag.token_contributions(review, direction)
    assert shares.shape == (len(review),)
    expected = float((bag(torch.tensor([review]))[0] - bag.bias).detach() @ direction)
    assert abs(shares.sum() - expected) < 1e-4


NOT, NO, STOP, BUT = 40, 41, 42, 43   # token ids standing for "not", "no", "." and "but" in these tests


def test_negation_scope_covers_the_next_words_up_to_a_clause_break():
    tokens = torch.tensor([[5, NOT, 6, 7, 8, 9, 10, 11],      # scope of 4: words 2..5
                           [NOT, 6, STOP, 7, NO, 8, BUT, 9],   # broken by "." and by "but"
                           [NOT, NOT, 6, 0, 0, 0, 0, 0]])      # a negator in scope is in scope (padding too: n-grams skip it)
    scope = negation_scope(tokens, torch.tensor([NOT, NO]), torch.tensor([STOP, BUT]), within=4)
    assert scope.int().tolist() == [[0, 0, 1, 1, 1, 1, 0, 0],
                                    [0, 1, 0, 0, 0, 1, 0, 0],
                                    [0, 1, 1, 1, 1, 1, 0, 0]]


AUX, WASN, APOS, T, COMMA = 44, 45, 46, 47, 48   # "was", "wasn", "'", "t", ","


def denied(tokens: list[list[int]], within: int = 4) -> list[list[int]]:
    return ellipsis_scope(torch.tensor(tokens), torch.tensor([AUX, WASN]), torch.tensor([NOT, T]),
                          torch.tensor([STOP, BUT, COMMA]), pad_id=0, within=within).int().tolist()


def test_an_elided_negation_denies_the_last_words_of_the_clause_before_it():
    # "5 6 7 8. 9 was not." and "5 6, but 9 wasn't.": the clause's last words, back to a break or `within`.
    assert denied([[5, 6, 7, 8, STOP, 9, AUX, NOT, STOP]]) == [[1, 1, 1, 1, 0, 0, 0, 0, 0]]
    assert denied([[5, 6, 7, 8, STOP, 9, AUX, NOT, STOP]], within=2) == [[0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert denied([[5, 6, COMMA, BUT, 9, WASN, APOS, T, STOP]]) == [[1, 1, 0, 0, 0, 0, 0, 0, 0]]
    # A subject of two words; the text's end (padding, or none) closes the denial as a break does.
    assert denied([[5, 6, STOP, 9, 10, AUX, NOT, 0]]) == [[1, 1, 0, 0, 0, 0, 0, 0]]
    assert denied([[5, 6, STOP, 9, AUX, NOT]]) == [[1, 1, 0, 0, 0, 0]]
    # A break inside the clause ends the scope there.
    assert denied([[5, COMMA, 6, 7, STOP, 9, AUX, NOT, STOP]]) == [[0, 0, 1, 1, 0, 0, 0, 0, 0]]


def test_a_negation_with_its_verb_or_a_longer_subject_denies_nothing_before_it():
    assert not any(map(any, denied([[5, 6, STOP, 9, AUX, NOT, 7, STOP, 0],        # "9 was not 7.": verb kept
                                    [5, 6, STOP, 9, 10, 11, AUX, NOT, STOP],      # a subject of three words
                                    [5, 6, 9, AUX, NOT, STOP, 0, 0, 0],           # no break before the subject
                                    [9, AUX, NOT, STOP, 0, 0, 0, 0, 0]])))        # nothing before it
    assert denied([[AUX]]) == [[0]] and denied([[STOP, AUX, NOT]]) == [[0, 0, 0]]  # shorter than the pattern


def test_the_bag_reads_a_denied_clause_as_negated_words():
    kw = dict(negators=(NOT, T), breaks=(STOP, BUT, COMMA), auxiliaries=(AUX, WASN))
    bag = NgramBag(VOCAB + 10, 2, 1, BUCKETS, pad_id=0, ellipsis=2, **kw)
    negating = NgramBag(VOCAB + 10, 2, 1, BUCKETS, pad_id=0, negation=2, **kw)

    def slots(b, review):
        row = b.slots(torch.tensor([review]))[0]
        return set(row[row != BUCKETS].tolist())

    # "7, but 9 wasn't." reads 7 as "not 7" does: NOT_7.
    assert slots(negating, [NOT, 7]) - slots(negating, [NOT]) <= slots(bag, [7, COMMA, BUT, 9, WASN, APOS, T, STOP])
    assert not slots(bag, [7]) & slots(bag, [7, COMMA, BUT, 9, WASN, APOS, T, STOP])


def test_a_negated_word_is_another_word_in_every_family():
    kw = dict(negation=3, negators=(NOT,), breaks=(STOP,))
    bag = NgramBag(VOCAB + 10, 2, 2, BUCKETS, pad_id=0, skip_bigrams=True, tail=5, **kw)
    plain = NgramBag(VOCAB + 10, 2, 2, BUCKETS, pad_id=0, skip_bigrams=True, tail=5)

    def slots(b, review):
        row = b.slots(torch.tensor([review]))[0]
        return set(row[row != BUCKETS].tolist())

    # Without a negator the marking changes no feature's meaning: as many features, unigrams in the same slots.
    assert len(slots(bag, [6, 7, 8])) == len(slots(plain, [6, 7, 8])) and slots(bag, [7]) == slots(plain, [7])
    # "6 not 7": every feature that would read 7 reads NOT_7 instead: the unigram and its tail copy, and the
    # skip-bigram "6 * 7" (which would skip the negator) are absent; as many features as without marking.
    negated = slots(bag, [6, NOT, 7])
    skip = slots(bag, [6, 5, 7]) - slots(bag, [6, 5]) - slots(bag, [5, 7])   # the one slot of "6 * 7"
    assert len(skip) == 1 and not (slots(bag, [7]) | skip) & negated
    assert len(negated) == len(slots(plain, [6, NOT, 7]))
    assert slots(bag, [NOT, STOP, 7]) >= slots(bag, [7])                  # a break ends the scope
    # Fitted, a word that is positive alone and negative when negated gets both signs.
    rng = np.random.default_rng(0)
    ids, labels = [], []
    for i in range(300):
        label = i % 2
        filler = rng.integers(30, VOCAB, size=6).tolist()
        ids.append(filler[:3] + ([7] if label else [NOT, 7]) + filler[3:])
        labels.append(label)
    fit_ngram_bag(bag, ids, labels, c=1.0)

    def margin(review: list[int]) -> float:
        logits = bag(torch.tensor([review])).detach()
        return float(logits[0, 1] - logits[0, 0])

    assert margin([7]) > 0 > margin([NOT, 7])


def test_negation_shares_of_a_review_still_add_up_to_the_branch_logit():
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0, skip_bigrams=True, negation=4, negators=(3, 4), breaks=(9,))
    with torch.no_grad():
        bag.weight.normal_()
    review = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]
    direction = torch.tensor([-1.0, 1.0])
    expected = float((bag(torch.tensor([review]))[0] - bag.bias).detach() @ direction)
    assert abs(bag.token_contributions(review, direction).sum() - expected) < 1e-4


def test_negation_scope_on_texts_shorter_than_it_and_without_negators_or_breaks():
    """The shapes an exported graph meets: any length (one token included), and a vocabulary without them."""
    short = torch.tensor([[NOT, 6], [6, 0]])
    assert negation_scope(short, torch.tensor([NOT]), torch.tensor([STOP]), within=4).int().tolist() == [[0, 1], [0, 0]]
    one = torch.tensor([[NOT]])
    assert negation_scope(one, torch.tensor([NOT]), torch.tensor([STOP]), within=4).tolist() == [[False]]
    none = torch.zeros(0, dtype=torch.long)
    tokens = torch.tensor([[NOT, 6, STOP, 7]])
    assert not negation_scope(tokens, none, torch.tensor([STOP]), within=4).any()
    assert negation_scope(tokens, torch.tensor([NOT]), none, within=4).int().tolist() == [[0, 1, 1, 1]]


def test_the_bag_sums_what_embedding_bag_sums():
    """The gathered sum (exportable as Gather + ReduceSum) is F.embedding_bag's within float rounding."""
    bag = NgramBag(VOCAB, 2, 3, BUCKETS, pad_id=0, skip_bigrams=True, head=HEAD, tail=TAIL)
    with torch.no_grad():
        bag.weight[:BUCKETS].normal_()
    tokens = torch.randint(1, VOCAB, (5, 40), generator=torch.Generator().manual_seed(1))
    tokens[1, 3:], tokens[2, 1:] = 0, 0
    slots = bag.slots(tokens)
    reference = torch.nn.functional.embedding_bag(slots, bag.weight, mode="sum", padding_idx=BUCKETS) + bag.bias
    torch.testing.assert_close(bag(tokens), reference, atol=1e-5, rtol=1e-6)


def toy_reviews(count: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Reviews of filler words with one class word each: class 1 says 10, 11 or 12; class 0 says 20, 21 or 22."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for i in range(count):
        label = i % 2
        words = rng.integers(30, VOCAB, size=rng.integers(5, 20)).tolist()
        words.insert(int(rng.integers(0, len(words))), int(rng.choice([10, 11, 12] if label else [20, 21, 22])))
        ids.append(words)
        labels.append(label)
    return ids, labels


def fitted_model(buckets: int = 20_011) -> Classifier:
    """A tiny classifier whose branch is fitted on toy reviews: most of its slots stay empty, as in a real run."""
    model = Classifier(vocab_size=VOCAB, num_classes=2, d_model=16, num_heads=2, num_layers=1, d_ff=32, max_len=64,
                       dropout=0.0, ngram_orders=3, ngram_buckets=buckets, ngram_skip_bigrams=True, ngram_head=HEAD,
                       ngram_tail=TAIL).eval()
    fit_ngram_bag(model.ngram, *toy_reviews(150), c=1.0)
    with torch.no_grad():
        model.mix.copy_(torch.tensor([[0.7, 0.1], [1.3, -0.2]]))
    return model


def test_a_fitted_branch_is_stored_as_its_live_rows_and_loads_back_bit_for_bit(tmp_path):
    model = fitted_model()
    weight = model.ngram.weight
    live = int((weight != 0).any(dim=1).sum())
    assert 0 < live < len(weight) // 4 and torch.equal(weight[:, 0], -weight[:, 1])
    files.save_tensors(tmp_path / "w.safetensors", files.model_state(model))
    raw = load_file(str(tmp_path / "w.safetensors"))
    # One bit per slot and one float16 per live slot (two classes: one column, the other is its negative; the fit
    # rounds the branch to float16 precision).
    assert "ngram.weight" not in raw and raw["ngram.weight.values"].shape == (live,)
    assert raw["ngram.weight.values"].dtype == torch.float16
    assert raw["ngram.weight.rows"].shape == ((len(weight) + 7) // 8,)
    again = Classifier(ClassifierConfig.from_dict(model.config.to_dict())).eval()
    files.load_model_weights(again, tmp_path / "w.safetensors")
    assert torch.equal(again.ngram.weight, weight)
    reviews, _ = toy_reviews(40, seed=1)
    tokens = pad_batch(reviews, 0)
    assert all(torch.equal(a, b) for a, b in zip(again.branches(tokens), model.branches(tokens)))
    assert torch.equal(again(tokens), model(tokens))


@pytest.mark.parametrize("classes", [2, 3])
def test_packed_rows_round_trip_any_number_of_classes_and_keep_dense_matrices_dense(classes, tmp_path):
    generator = torch.Generator().manual_seed(classes)
    sparse = torch.zeros(1000, classes)
    sparse[::7] = torch.randn(len(sparse[::7]), classes, generator=generator)
    if classes == 2:  # nearly antisymmetric: one row breaks it, so both columns must be stored
        sparse[::7, 0] = -sparse[::7, 1]
        sparse[14, 0] += 1.0
    dense = torch.randn(50, 8, generator=generator)
    files.save_tensors(tmp_path / "t.safetensors", {"sparse": sparse, "dense": dense, "bias": torch.zeros(classes)})
    raw = load_file(str(tmp_path / "t.safetensors"))
    assert raw["sparse.values"].shape == (143, classes) and torch.equal(raw["dense"], dense)
    assert raw["sparse.values"].dtype == torch.float32   # random values are not float16 numbers: kept as they are
    back = files.load_tensors(tmp_path / "t.safetensors")
    assert back.keys() == {"sparse", "dense", "bias"}
    assert all(torch.equal(back[k], v) for k, v in [("sparse", sparse), ("dense", dense), ("bias", torch.zeros(classes))])


def test_a_weights_file_with_the_scale_kept_apart_still_loads(tmp_path):
    # The layout written before the scale was folded in: a dense (buckets + 1, C) weight and a (buckets + 1,) scale.
    model = branch_model()
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(BUCKETS + 1, 2, generator=generator)
    weight[BUCKETS] = 0
    scale = torch.rand(BUCKETS + 1, generator=generator) + 0.5
    state = files.model_state(model)
    state["ngram.weight"], state["ngram.scale"] = weight, scale
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "old.safetensors"))
    files.load_model_weights(model, tmp_path / "old.safetensors")
    reviews = [[4, 8, 15, 16, 23, 42], [7, 7], list(range(1, 30))]
    tokens = pad_batch(reviews, 0)
    slots = model.ngram.slots(tokens)   # what the branch computed then: each slot's weight times its scale
    before = F.embedding_bag(slots, weight, mode="sum", per_sample_weights=scale[slots], padding_idx=BUCKETS)
    torch.testing.assert_close(model.branches(tokens).ngram, before + model.ngram.bias, atol=1e-5, rtol=1e-6)


def test_resume_state_holds_the_frozen_branch_compactly_and_no_optimizer_state_for_it(tmp_path):
    model = fitted_model().train()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(pad_batch(toy_reviews(8)[0], 0)).sum().backward()
    optimizer.step()
    with RunFolder(tmp_path / "run", "classifier") as run:
        run.save_last(model, optimizer, {"step": 1})
    last = tmp_path / "run" / LAST
    moments = files.load_tensors(last / "optimizer-000000001.safetensors")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(t.numel() for k, t in moments.items() if k.endswith(".exp_avg")) == trained
    weights = last / "model-000000001.safetensors"
    assert weights.stat().st_size < model.ngram.weight.nbytes / 4   # the branch's live rows, not its table
    restored = fitted_model(buckets=20_011)
    with torch.no_grad():
        restored.ngram.weight.zero_()
    files.load_model_weights(restored, weights)
    assert torch.equal(restored.ngram.weight, model.ngram.weight)


def test_a_compact_bag_gives_the_bags_logits_and_explanations_and_compacts_only_where_it_can():
    """``NgramBag.compact``: the table as one float16 column, what inference and the export hold."""
    import copy

    bag = NgramBag(50, 2, 3, 1009, pad_id=0, skip_bigrams=True, tail=5)
    d = torch.randn(1010).half().float()
    d[-1] = 0
    with torch.no_grad():
        bag.weight.copy_(torch.stack([-d, d], dim=1) / 2)   # as the fits store a two-class branch
        bag.bias.copy_(torch.tensor([0.3, -0.3]))
    # Short texts, and a long one whose sum the two layouts may add in another order (an ulp apart).
    tokens = pad_batch([[5, 6, 7, 8, 9, 10], [11], [3, 4, 5], [3 + i % 47 for i in range(400)]], 0)
    direction = torch.tensor([-1.0, 1.0])

    def compacted(dtype: torch.dtype) -> NgramBag:
        compact = copy.deepcopy(bag)
        assert compact.compact() and compact.column.dtype == dtype and not hasattr(compact, "weight")
        ours, theirs = compact(tokens), bag(tokens)
        assert torch.equal(ours[:3], theirs[:3]) and torch.allclose(ours, theirs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(compact.token_contributions([5, 6, 7, 8], direction),
                                   bag.token_contributions([5, 6, 7, 8], direction), rtol=1e-6)
        return compact

    assert not compacted(torch.float16).compact()              # once is enough
    with torch.no_grad():
        bag.weight[3] += torch.tensor([-1e-4, 1e-4])   # not float16 any more: a float32 column, still exact
    compacted(torch.float32)
    with torch.no_grad():
        bag.weight[3, 0] += 1.0    # rows no longer (-d, d): the table stays as it is
    assert not bag.compact() and bag.column is None and bag.weight.shape == (1010, 2)
