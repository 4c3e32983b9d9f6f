"""The settings of a classifier training run: config.json's "train", the flags of ``classify.train``.

Their own module, so that what reads a trained run (``classify.inference``, ``classify.evaluate``) reads its
settings through the same fields, and the same ``absent`` values for runs recorded before a setting existed,
without importing the training command.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import ClassVar

from .engine.config import ReviewRunConfig, decay, fraction, non_negative, positive, setting
from .errors import ClassifyError
from .models import ClassifierConfig
from .text.data import SPLITS_BY
from .text.edits import NEGATION_FORMS, NEVER_AFTER_COPULA, NEVER_AFTER_PRONOUN, NO_SHARE


@dataclass(kw_only=True)
class TrainConfig(ReviewRunConfig):
    """Everything that defines a classifier training run except the model (config.json's "train")."""

    data: str = ReviewRunConfig.redefault("data", MISSING, "hub id, folder of {train,test}.parquet, aclImdb folder, "
                                                           "or a CSV/JSONL/parquet file (default from "
                                                           "$CLASSIFY_DATA)")
    epochs: int = ReviewRunConfig.redefault("epochs", 3)
    limit: int | None = ReviewRunConfig.redefault("limit", None, "use only N training reviews and at most N "
                                                                 "unlabelled ones, seeded random samples (quick runs)")
    warmup: int = ReviewRunConfig.redefault("warmup", 200)
    weight_decay: float = ReviewRunConfig.redefault("weight_decay", 0.1)
    lr: float = ReviewRunConfig.redefault("lr", 1e-3, "peak learning rate (AdamW); with --init-from the default "
                                                      "is 3e-4")
    batch_size: int = setting(32, "reviews per batch on each process; one optimizer step trains on batch-size x "
                                  "processes (torchrun) x --grad-accum reviews, and the schedule counts optimizer "
                                  "steps", check=positive)
    finish_within: float | None = setting(None, "minutes for the whole command, on this machine: when the "
                                                "transformer is about to train, --time-budget becomes what is left, "
                                                "less the time the evaluations after training will take (estimated "
                                                "from a timed forward pass), so the command ends within it whatever "
                                                "the CPU. Recorded in config.json as the run's --time-budget, which "
                                                "a resumed run keeps (classify.command_budget)", check=positive)
    max_tokens: int | None = setting(None, "token budget per batch instead of a fixed batch size", check=positive)
    batching: str = setting("bucket", "bucket: length-bucketed batches padded to their longest review; fixed: "
                                      "random batches padded to --max-len (the naive pipeline, for comparisons "
                                      "only)", choices=("bucket", "fixed"))
    label_smoothing: float = setting(0.0, "label smoothing of the cross-entropy (the teacher's targets too). Not in "
                                          "the recipe: 0.1 cost the mix 2.0 points on the validation reviews' closing "
                                          "sentences and IMDB test 0.14, two seeds (experiments/RESULTS.md)",
                                     check=fraction)
    init_from: str | None = setting(None, "start from a classify.pretrain run folder: its tokenizer, model sizes "
                                          "and encoder weights (the classification head starts fresh); "
                                          "model/tokenizer flags must then be left out")
    layer_decay: float | None = setting(None, "layer-wise lr decay: block i of L gets lr * decay**(L - i), "
                                              "embeddings decay**(L + 1)", check=decay)
    split: str = setting("grouped", "grouped: reviews of one movie are never on both sides of the validation split "
                                    "(an honest estimate of test accuracy); random: the old random split, which "
                                    "shares movies with training", choices=SPLITS_BY,
                       absent="random")
    word_vectors: bool = setting(True, "start the transformer's token embedding from word vectors counted from the "
                                       "training and unlabelled reviews (positive PMI of words a few tokens "
                                       "apart, truncated SVD; 21-26 seconds on IMDB) instead of random vectors; "
                                       "words they do not hold start random (text.word_vectors). Off with "
                                       "--init-from. Paired with random vectors at a fixed 4,400 steps on two "
                                       "fresh seeds: the mix on the validation reviews' closing sentences "
                                       "+0.75 point, on the whole reviews +0.34, IMDB test +0.08; over six "
                                       "pairs the suite failed 9.0 against 10.9 percent of its sentences "
                                       "(experiments/RESULTS.md)",
                                 absent=False)
    word_polarity: bool = setting(False, "start one direction of the token embedding at each word's weight in stage "
                                         "1's first n-gram fit (its unigram's; the teacher's, or the branch's), "
                                         "so the transformer sees a word's polarity from the first step, a rare "
                                         "word's too. Needs the n-gram branch or --pseudo-labels, and two "
                                         "classes. Not in the recipe: paired at 4,400 steps on two seeds, the mix "
                                         "on the validation reviews' closing sentences -0.6 point, and the suite's "
                                         "negated negatives failed 23.6 / 12.8 percent against 10.3 / 7.7 "
                                         "(experiments/RESULTS.md)",
                                  absent=False)
    ngram_c: float = setting(1.0, "inverse L2 strength of the n-gram branch's logistic regression", check=positive)
    ngram_min_count: int = setting(5, "an n-gram slot fewer than this many training texts have gets no weight in the "
                                      "fits of the n-gram branch: an n-gram a few reviews alone have is mostly "
                                      "their fingerprint, and the branch recalls the label of a review it was "
                                      "fitted on when an edited copy of it comes back. At 5 against 2: 5-fold "
                                      "cross-validation over the training reviews -0.01 +- 0.05 points, the "
                                      "held-out counterfactual revisions +3.7 points (four runs, and the same "
                                      "transformers with either branch: +2.9; IMDB test +0.06), 3.2x fewer slots "
                                      "with a weight. At 20 IMDB test lost 0.25 (experiments/RESULTS.md)",
                                   check=positive)
    teacher_min_count: int = setting(2, "the same for the n-gram fit that labels the unlabelled reviews for "
                                        "--pseudo-labels (the teacher)", check=positive)
    ngram_self_train: bool = setting(False, "self-train the n-gram branch on the source's unlabelled reviews (its "
                                            "unsupervised split, when it has one): fit, label them with the fit, "
                                            "fit again on both. On IMDB test: +0.2 points for plain 1-3-grams, "
                                            "none with the default features; about 2.5 more minutes")
    pseudo_labels: bool = setting(True, "train the transformer on the source's unlabelled reviews too, each labelled "
                                        "by an n-gram model fitted on the labelled ones, the teacher (the branch's "
                                        "first fit when --teacher-edit-weight equals --negation-edit-weight, "
                                        "else a fit of its own; with --ngram-orders 0 the recipe's branch "
                                        "fitted as a teacher only); IMDB: 50,000 more reviews",
                                  absent=False)
    soft_labels: bool = setting(True, "the pseudo-labelled reviews' targets are the teacher's class probabilities "
                                       "(distillation) instead of its most likely class: a review the teacher is "
                                       "unsure of, where most of its mistakes are, pulls the transformer less",
                                absent=False)
    pseudo_label_weight: float = setting(1.0, "how much each text the teacher labelled (a pseudo-labelled review, a "
                                              "window cut from one) counts in the transformer's loss; a given label "
                                              "counts 1. Below 1, the labelled reviews, the pairs and the rule-made "
                                              "texts, which carry the structure the teacher cannot read, weigh "
                                              "more (needs --soft-labels, by which the teacher's texts are known). "
                                              "Not in the recipe: at 0.5 (one seed) the transformer alone lost 0.33 "
                                              "on IMDB test",
                                         check=positive, absent=1.0)
    self_label_share: float = setting(0.0, "the share of each teacher-labelled text's target that goes to the "
                                           "transformer's own most likely class for it, as it trains (hard "
                                           "bootstrapping, Reed et al. 2014): where it reads a review the n-gram "
                                           "teacher misreads, its reading keeps that share (needs --soft-labels). "
                                           "Not in the recipe: at 0.2, over three seeds, the transformer alone "
                                           "+0.41 on validation and -0.07 on IMDB test (experiments/RESULTS.md)",
                                      check=fraction, absent=0.0)
    ngram_refit: bool = setting(True, "once the pseudo-labels are given, fit the n-gram branch again on all labelled "
                                      "reviews, the validation split's too, for the model it keeps; the mix and the "
                                      "validation scores still use the first fit's logits, which have not seen "
                                      "those reviews. IMDB test: about +0.1 point (3 seeds)",
                                absent=False)
    spelling: bool = setting(True, "wherever the run is used (predict, evaluate, serve, an export; and the final "
                                   "test score), read an unknown word that is one typing slip (a letter deleted, "
                                   "inserted, replaced, or two swapped) from a word of the vocabulary as that "
                                   "word, the most frequent if several; capitalised words inside a sentence are "
                                   "taken for names. Training and validation read the reviews as written "
                                   "(text.spelling; word tokenizers only)",
                            absent=False)
    short_texts: bool = setting(True, "also train on the closing sentence of every training review, with its review's "
                                      "target, and validate on those of the validation reviews: the mix and the "
                                      "checkpoint are chosen on whole reviews and short texts alike (text.windows)",
                                absent=False)
    closing_passages: bool = setting(False, "also train the transformer on the closing passage of every training "
                                            "review (its last three sentences, at most 96 tokens: the length of a "
                                            "short real review), with its review's target; a training text only, "
                                            "not validated on (text.windows)",
                                     absent=False)
    train_max_len: int | None = setting(256, "the transformer trains on at most this many tokens of each text (cut "
                                             "as --truncation cuts: head and tail); validation, the test, the n-gram "
                                             "branch and every later use read --max-len; a value at or above it "
                                             "cuts nothing (recorded as no cut, as runs from before the flag were). "
                                             "A review cut to 256 costs 0.76 of its tokens on IMDB, so a time budget "
                                             "sees more reviews: over five seeds paired with runs without the cut "
                                             "on a CPU without bf16, the transformer alone +0.22 point on IMDB test, "
                                             "the model +0.08 (experiments/RESULTS.md, forty-sixth session)",
                                        check=positive, absent=None)
    elided_negation_repeat: int = setting(0, "times per epoch the transformer also trains on the last sentence of "
                                             "each training review that ends on a negated auxiliary with its verb "
                                             "left out (\"We hoped it would get better. It didn't.\", \"..., but "
                                             "he did not.\"; with the sentence before when short), with its "
                                             "review's target; 0: not at all (text.windows)",
                                          check=non_negative, absent=0)
    elided_negation_balance: bool = setting(False, "repeat the elided-negation sentences of the less common label "
                                                   "so that each label has as many as the more common one has "
                                                   "--elided-negation-repeat times over (IMDB's are negative seven "
                                                   "times in ten)",
                                            absent=False)
    counterfactual: str | None = setting(None, "counterfactual pairs to train on too (a folder with train.parquet, e.g. "
                                               "../shared/imdb-counterfactual: IMDB training reviews and their "
                                               "revisions edited so that the label flips); the held-out quarter and "
                                               "pairs whose original is a validation review are left out")
    counterfactual_passages: bool = setting(False, "also train both branches on each counterfactual pair's edited "
                                                   "passages: the runs of sentences the revision rewrote, each "
                                                   "beside its rewriting under the other label (text.counterfactual."
                                                   "edited_passages); the transformer sees them "
                                                   "--counterfactual-passage-repeat times an epoch, the n-gram fits "
                                                   "count each as --counterfactual-passage-weight reviews. Not in "
                                                   "the recipe: in two pairs the held-out revisions rose 5.75 points "
                                                   "but IMDB test fell 0.41 (experiments/RESULTS.md)",
                                            absent=False)
    counterfactual_passage_repeat: int = setting(4, "times each edited passage is seen per epoch by the transformer "
                                                    "(see --counterfactual-passages); 0: only the n-gram fits read "
                                                    "them", check=non_negative, absent=4)
    counterfactual_passage_weight: float = setting(1.0, "how much each edited passage counts in the n-gram fits "
                                                        "(a review counts 1; see --counterfactual-passages)",
                                                   check=positive, absent=1.0)
    teacher_passages: bool = setting(True, "the n-gram fit that labels the unlabelled reviews for --pseudo-labels (the "
                                           "teacher) reads the edited passages too (see --counterfactual-passages); "
                                           "--no-teacher-passages: only the fits of the branch the model keeps read "
                                           "them, so that with --counterfactual-passage-repeat 0 the transformer "
                                           "trains as without them. Grafted onto two runs at weight 0.3, that "
                                           "branch moved the held-out revisions +1.8 points and IMDB test +0.02 "
                                           "(experiments/RESULTS.md); not yet trained as a pair",
                                     absent=True)
    negation_edits: bool = setting(True, "also train both branches on negation edits of training sentences, each "
                                         "beside its sentence under the opposite label (\"The plot was thin.\" / "
                                         "\"The plot was not thin.\"), and validate on those of the validation "
                                         "reviews (text.edits)",
                                   absent=False)
    negators: str = setting("never", "which negations the negation edits write: not: \"not\" and \"n't\" only; "
                                   "never: also \"never\", as often as the training reviews do (after a copula "
                                   f"{NEVER_AFTER_COPULA:.0%}%, after a pronoun subject {NEVER_AFTER_PRONOUN:.0%}%); "
                                   "varied: \"no\" too (an indefinite predicate, \"is a gem\" -> \"is no gem\", "
                                   f"{NO_SHARE:.0%}%). The edits take out the forms they write (text.edits)",
                            choices=NEGATION_FORMS)
    contrast_joins: bool = setting(True, "also train the transformer on contrast joins of training sentences: a "
                                         "positive and a negative sentence joined by \", but\", both ways round, "
                                         "labelled by the second; and validate on those of the validation reviews "
                                         "(text.edits). The n-gram branch, which cannot read the order, is not "
                                         "fitted on them",
                                   absent=False)
    negation_edit_weight: float = setting(0.01, "how much each negation edit and its sentence count in the fit of the "
                                                "n-gram branch the model keeps (a review counts 1). Chosen by 5-fold "
                                                "cross-validation over the training reviews: at 0.01 the branch "
                                                "loses nothing on reviews, at 0.1 it loses 0.6 points "
                                                "(experiments/RESULTS.md)", check=positive)
    teacher_edit_weight: float = setting(0.1, "the same weight in the n-gram fit that labels the unlabelled reviews "
                                              "for --pseudo-labels (the teacher). A teacher at 0.01 left the "
                                              "transformer failing 3 points more of the behavioural suite; when "
                                              "the two weights differ, the teacher is one more fit (about a "
                                              "minute on IMDB)", check=positive)
    counterfactual_repeat: int = setting(4, "times each counterfactual text is seen per epoch by the transformer (the "
                                            "n-gram branch is fitted on them once)", check=positive)
    counterfactual_pair_weight: float = setting(0.0, "train the two texts of each counterfactual pair in the same "
                                                     "batch, and add this weight times a margin on their difference "
                                                     "to the loss: how much more the original leans to its label than "
                                                     "the revision does, which what they share cannot change "
                                                     "(train.pair_loss); 0: each text on its own. A pair counts as one "
                                                     "example of --batch-size and --max-tokens, so batches holding "
                                                     "pairs are larger. Not in the recipe: at 2 the held-out pairs "
                                                     "came out no better (experiments/RESULTS.md)",
                                                check=non_negative, absent=0.0)
    negation_edit_pair_weight: float = setting(0.0, "the same margin for the negation edits: each sentence and its "
                                                    "negation in the same batch, this weight times their margin in "
                                                    "the loss (see --counterfactual-pair-weight); 0: each on its "
                                                    "own. Not in the recipe: at 2 the suite came out worse",
                                               check=non_negative, absent=0.0)
    negation_edit_repeat: int = setting(1, "times each negation edit and its sentence are seen per epoch by the "
                                           "transformer (the n-gram fits count them once, weighted)",
                                        check=positive, absent=1)
    contrast_join_repeat: int = setting(3, "times each contrast join is seen per epoch by the transformer: with "
                                           "three blocks, seen once the transformer got 89-98%% of the validation "
                                           "joins right over three seeds, three times 96-99%% "
                                           "(experiments/RESULTS.md)",
                                        check=positive, absent=1)
    swapped_reviews: int = setting(0, "times per epoch the transformer sees a copy of each labelled review with its "
                                      "polar words exchanged for their nearest words of the other polarity, under "
                                      "the other label (text.swaps: counterfactuals made by machine; a copy the "
                                      "words' ratios do not read as the other label is left out); 0: none. Not "
                                      "in the recipe: in two pairs the held-out revisions moved -0.1 point and "
                                      "the transformer alone -0.25 (experiments/RESULTS.md)",
                                   check=non_negative, absent=0)

    IDENTITY: ClassVar[tuple[str, ...]] = (*ReviewRunConfig.IDENTITY, "batching", "init_from", "layer_decay",
                                           "word_vectors", "word_polarity", "split", "ngram_c", "ngram_min_count",
                                           "teacher_min_count", "pseudo_labels", "soft_labels", "pseudo_label_weight",
                                           "self_label_share", "ngram_refit", "short_texts", "closing_passages",
                                           "train_max_len", "elided_negation_repeat", "elided_negation_balance",
                                           "negation_edits", "negators", "negation_edit_weight", "teacher_edit_weight",
                                           "contrast_joins", "counterfactual", "counterfactual_passages",
                                           "counterfactual_passage_weight", "counterfactual_passage_repeat",
                                           "teacher_passages", "counterfactual_repeat", "counterfactual_pair_weight",
                                           "negation_edit_repeat", "negation_edit_pair_weight", "contrast_join_repeat",
                                           "swapped_reviews")

    def validate(self, model: ClassifierConfig) -> None:
        super().validate(model)
        if self.limit is not None and self.val_size is not None and self.limit <= self.val_size:
            raise ClassifyError(f"--limit {self.limit} leaves no training data after --val-size {self.val_size}")
        if (self.pseudo_label_weight != 1 or self.self_label_share) and not (self.pseudo_labels and self.soft_labels):
            raise ClassifyError("--pseudo-label-weight and --self-label-share act on the teacher's soft labels: they "
                                "need --pseudo-labels and --soft-labels")
        if self.word_polarity and not ((model.ngram_orders or self.pseudo_labels) and model.num_classes == 2):
            raise ClassifyError("--word-polarity reads each word's weight in the n-gram fit of stage 1 as one number: "
                                "it needs the n-gram branch (--ngram-orders > 0) or --pseudo-labels, and two classes")
        if self.swapped_reviews and model.num_classes != 2:
            raise ClassifyError("--swapped-reviews exchanges positive words for negative ones: it needs two classes")
        if self.finish_within is not None and self.time_budget is not None:
            raise ClassifyError("--finish-within sets the training minutes from the whole command's; --time-budget "
                                "gives them: pass one of them")
        if self.word_vectors and self.init_from:
            raise ClassifyError("--word-vectors starts the token embedding afresh; --init-from brings a trained one: "
                                "give one of them")
