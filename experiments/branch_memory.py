"""How much the n-gram branch's fit remembers of each training review, and whether a looser fit reads an edit
better: on a run's own validation texts and validation pairs (no test, no suite, no held-out quarter).

    python -m experiments.branch_memory --runs runs/imdb-v39-fusedshort-seed5 --variants 2:1 10:0.01 --threads 2

A counterfactual pair's revision shares most of its n-grams with its original. The branch the model keeps was
fitted on the original (an IMDB training review) and, with 16.8M slots, fits every training review: on the
revision it recalls the original's label. Fitted without the originals it reads the revisions far better
(``experiments/RESULTS.md``, thirty-first session). This experiment refits a trained run's branch with other
settings and asks what each costs and gains where the recipe can see it:

* ``MIN:C[:S]`` variants: slots fewer than MIN training texts have get no weight (``--ngram-min-count``), the
  logistic regression's inverse L2 strength is C (``--ngram-c``) and naive-Bayes' pseudo-count S (1 when left
  out; a larger one shrinks the scales of slots few texts have); 5:1 is the recipe's branch (2:1 before).
* ``student:MIN:C:W[:S]``: a branch that never fits a labelled review's text at full weight. The recipe's teacher,
  fitted on the same texts, labels the unlabelled reviews; the branch is fitted on those (soft: each twice, under
  either label, weighted by the teacher's probability of it; a slot's count includes both copies), the
  counterfactual texts and the edits, the labelled reviews counting W each (0: not at all).
* As ``classify.train`` does: the first fit on the run's training texts (its training reviews, the
  counterfactual pairs it trained on, the negation edits at their weight) gives the held-out logits of the run's
  validation texts, on which the mix is fitted (``Validation.scores``, whole reviews and short texts); the kept
  fit adds the validation reviews. Scored: the branch alone and the mix on each validation group, and the
  *validation pairs* (the counterfactual pairs whose original is a validation review, left out of training), with
  the kept fit, which has seen their originals and never their revisions: the situation of the held-out quarter
  and of the public contrast sets, seen from validation.

The transformer is the run's own (its best weights); only the branch and the mix change. With ``--save FOLDER``
each variant's model is also written as a run folder (``FOLDER/RUN-minMIN-cC``: the run's transformer, the
variant's kept branch and mix, its held-out validation logits; ``config.json`` says what was grafted), so the
commands that score a run (``classify.evaluate``, ``experiments.behaviour``) can compare branch fits under one
transformer, free of the run-to-run spread of training.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from classify.engine.config import runtime
from classify.engine.files import load_model_weights, model_state, save_tensors, write_json
from classify.engine.runfolder import CONFIG, TOKENIZER, WEIGHTS, RunFolder, read_model_config
from classify.evaluate import run_training_split
from classify.inference import KIND, load_run, softmax
from classify.mix import mixed_logits
from classify.models import Classifier, ClassifierConfig, ngram_branch
from classify.ngrams import NgramBag, bag_logits, feature_matrix, fit_features
from classify.text.data import unlabelled_split
from classify.text.prepare import Preprocessing
from classify.text.tokenize import token_ids
from classify.text.windows import AUXILIARIES, CONTRACTED
from classify.train import Validation
from classify.train_config import TrainConfig
from classify.training_texts import REVIEW, LabelledTexts, ngram_kinds, ngram_weights, teacher_reads

from . import add_results_args, results_folder
from .mix_forms import PAIRS, REVISIONS, validation_of
from .trainruns import experiment_meta, write_results


@dataclass(frozen=True)
class Variant:
    """One way of fitting the branch: the recipe's kind of fit (``fit``) or a ``student`` of the teacher; slots
    fewer than ``min_count`` texts have get no weight; ``c``: inverse L2 strength; ``weight``: what a labelled
    review counts in a student's fit; ``smoothing``: naive-Bayes' pseudo-count (``classify.ngrams.fit_features``)."""

    kind: str
    min_count: int
    c: float
    weight: float = 1.0
    smoothing: float = 1.0

    @property
    def name(self) -> str:
        fit = f"{self.min_count}:{self.c:g}" + (f":{self.smoothing:g}" if self.smoothing != 1 else "")
        return fit if self.kind == "fit" else f"student {fit}, reviews x{self.weight:g}"


def parse_variant(text: str) -> Variant:
    """"MIN:C[:S]" (the recipe's kind of fit, S the naive-Bayes smoothing, 1 if left out) or
    "student:MIN:C:W[:S]"."""
    parts = text.split(":")
    try:
        if parts[0] == "student" and len(parts) in (4, 5):
            return Variant("student", int(parts[1]), float(parts[2]), float(parts[3]),
                           float(parts[4]) if len(parts) == 5 else 1.0)
        if len(parts) in (2, 3):
            return Variant("fit", int(parts[0]), float(parts[1]), 1.0, float(parts[2]) if len(parts) == 3 else 1.0)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"a variant is MIN:C[:S] or student:MIN:C:W[:S], e.g. 10:0.01 or 2:1:10 "
                                     f"(got {text!r})")


@dataclass
class BranchData:
    """A run's branch training texts as ``classify.train`` builds them, as binary feature matrices."""

    train: sp.csr_matrix          # (N, buckets): LabelledTexts.ngram_parts(), in order
    labels: np.ndarray            # (N,)
    kind: np.ndarray              # (N,) each text's kind: training_texts.REVIEW, ...
    val: sp.csr_matrix            # (V, buckets) the validation reviews
    val_labels: np.ndarray        # (V,)
    unlabelled: sp.csr_matrix | None   # (U, buckets) the unlabelled reviews (students only), or None
    config: TrainConfig
    model_config: ClassifierConfig


def branch_data(path: str, students: bool, ellipsis: int | None = None,
                passage_weight: float | None = None) -> BranchData:
    """The run's branch training data (``classify.train``'s stage 1); the unlabelled reviews' too for
    ``students``. ``ellipsis``: the branch reads clauses denied by an elided negation over that many words
    (``--ngram-ellipsis``; 0 not), whatever the run's branch did. ``passage_weight``: the counterfactual pairs'
    edited passages are among the texts, each counting that much (``--counterfactual-passage-weight``; 0: none
    are), whether the run read them or not."""
    run = load_run(path, torch.device("cpu"), None)
    config = TrainConfig(**{k: v for k, v in run.config["train"].items() if k in TrainConfig.__dataclass_fields__})
    if passage_weight == 0:   # the fits without them, whatever the run did
        config = replace(config, counterfactual_passages=False)
    elif passage_weight is not None:
        config = replace(config, counterfactual_passages=True, counterfactual_passage_weight=passage_weight)
    texts = LabelledTexts.of(config, *run_training_split(run.config, None))
    model_config = run.backend.model.config
    if ellipsis is not None:   # as classify.train fills in the auxiliaries' ids
        model_config = replace(model_config, ngram_ellipsis=ellipsis, ngram_auxiliaries=token_ids(
            run.tokenizer, AUXILIARIES + CONTRACTED) if ellipsis else [])
    encode = Preprocessing(run.tokenizer, model_config.max_len, run.truncation).ids
    bag = ngram_branch(model_config)
    parts = texts.ngram_parts()   # the reviews, the counterfactual texts, their edited passages, the negation edits
    unlabelled = (feature_matrix(bag, encode(unlabelled_split(config.data, config.limit, config.seed).texts))
                  if students else None)
    return BranchData(feature_matrix(bag, encode([t for part in parts for t in part.texts])),
                      np.asarray([y for part in parts for y in part.labels]),
                      ngram_kinds([len(part.texts) for part in parts]),
                      feature_matrix(bag, encode(texts.val.texts)), np.asarray(texts.val.labels), unlabelled, config,
                      model_config)


def fitted(data: BranchData, variant: Variant, kept: bool):
    """The branch of ``variant`` fitted on the run's training texts, and with ``kept`` on the validation reviews
    too (the fit the model keeps). A student: the recipe's teacher fitted on the same texts labels the unlabelled
    reviews, and the branch is fitted on those (each twice, under either label, weighted by the teacher's
    probability of it), the counterfactual texts and the edits, the labelled reviews counting ``variant.weight``
    each."""
    config, v = data.config, variant
    features, labels, kinds = data.train, data.labels, data.kind
    if kept:   # the validation reviews count as training reviews
        features = sp.vstack([features, data.val]).tocsr()
        labels = np.concatenate([labels, data.val_labels])
        kinds = np.concatenate([kinds, np.full(len(data.val_labels), REVIEW, dtype=kinds.dtype)])
    weights = ngram_weights(kinds, config) * np.where(kinds == REVIEW, v.weight if v.kind == "student" else 1.0, 1.0)
    bag = ngram_branch(data.model_config)
    if v.kind == "fit":
        fit_features(bag, features, labels, v.c, weights, v.min_count, v.smoothing)
        return bag
    read = teacher_reads(kinds, config)                                                   # the teacher's texts
    fit_features(bag, features[read], labels[read], config.ngram_c, ngram_weights(kinds, config, teacher=True)[read],
                 config.teacher_min_count)                                                # the teacher
    probs = softmax(logits_of(bag, data.unlabelled))                                      # (U, 2)
    u = len(probs)
    bag = ngram_branch(data.model_config)
    fit_features(bag, sp.vstack([data.unlabelled, data.unlabelled, features]).tocsr(),
                 np.concatenate([np.ones(u, dtype=labels.dtype), np.zeros(u, dtype=labels.dtype), labels]), v.c,
                 np.concatenate([probs[:, 1], probs[:, 0], weights]), v.min_count, v.smoothing)
    return bag


def logits_of(bag, features) -> np.ndarray:
    """The bag's logits (N, C) for binary features (N, buckets) (its last row is the padding slot's)."""
    return features @ bag.weight.detach()[: bag.buckets].numpy() + bag.bias.detach().numpy()


UNSEEN = "pair revisions, original unseen"


def accuracies(logits: np.ndarray, labels: np.ndarray, group: np.ndarray) -> dict[str, float]:
    """Accuracy of (N, C) logits per validation group (whole reviews, short texts, the pairs' two texts)."""
    names = [g or "reviews" for g in Validation.GROUPS] + ["pair originals", "pair revisions"]
    return {name: float((logits[group == g].argmax(1) == labels[group == g]).mean())
            for g, name in enumerate(names) if (group == g).any()}


def uncompacted(path: str) -> tuple[dict, Classifier]:
    """The run's config.json and its model as trained (the branch's table as fitted and saved, not compacted)."""
    config, model_config = read_model_config(path, KIND, ClassifierConfig)
    model = Classifier(model_config)
    load_model_weights(model, Path(path) / WEIGHTS)
    return config, model


def save_graft(path: str, run: tuple[dict, Classifier], variant: Variant, kept: NgramBag, mix: np.ndarray,
               held_out: np.ndarray, folder: Path, model_config: ClassifierConfig,
               passage_weight: float | None = None) -> Path:
    """Write the run at ``path`` (``run``: its config and ``uncompacted`` model, whose branch and mix this
    replaces) with ``variant``'s kept branch and ``mix`` (2, 2), and the branch's held-out logits of the
    validation texts ``held_out`` (V, C), as ``folder/RUN-minMIN-cC`` (``-ellN`` after it where the branch's
    ``model_config`` reads denied clauses and the run's did not; ``-passagesW`` where the branch's fits read the
    edited passages at ``passage_weight`` (0: not, whatever the run's did): ``graft`` in its config.json says so,
    ``train`` stays the run's, whose teacher and transformer are the graft's)."""
    config, model = run
    grafted = "" if model_config.ngram_ellipsis == model.config.ngram_ellipsis else f"-ell{model_config.ngram_ellipsis}"
    grafted += "" if passage_weight is None else f"-passages{passage_weight:g}"
    out = folder / f"{Path(path).name}-min{variant.min_count}-c{variant.c:g}{grafted}"
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "model": model_config.to_dict(),
              "train": {**config["train"], "ngram_min_count": variant.min_count, "ngram_c": variant.c},
              "graft": {"from": str(path), "branch": variant.name + grafted, "by": "experiments.branch_memory --save",
                        **({} if passage_weight is None else {"counterfactual_passage_weight": passage_weight})}}
    write_json(out / CONFIG, config)
    shutil.copyfile(Path(path) / TOKENIZER, out / TOKENIZER)
    model.ngram.load_state_dict(kept.state_dict())
    model.mix.copy_(torch.as_tensor(mix, dtype=model.mix.dtype))
    save_tensors(out / WEIGHTS, model_state(model))
    RunFolder(out, KIND).save_branch_validation(held_out)
    return out


def study(path: str, variants: list[Variant] | None, device, dtype, save: Path | None = None,
          ellipsis: int | None = None, passage_weight: float | None = None) -> dict:
    """Each variant's branch alone, the transformer alone and the mix, per validation group, for one run (no
    ``variants``: the run's own fit); with ``save``, each variant's model written there (``save_graft``);
    ``ellipsis``, ``passage_weight``: as ``branch_data``."""
    with torch.inference_mode():
        validation, transformer, _ = validation_of(path, device, dtype, pairs=True)
    data = branch_data(path, any(v.kind == "student" for v in variants or []), ellipsis, passage_weight)
    variants = variants or [Variant("fit", data.config.ngram_min_count, data.config.ngram_c)]   # the run's own
    y, group, lengths = np.asarray(validation.labels), validation.group, validation.lengths()
    texts = group < PAIRS                              # what the mix is fitted on, as in training
    run = uncompacted(path) if save is not None else None
    out = {"transformer": accuracies(transformer, y, group), "variants": []}
    for variant in variants:
        t = time.monotonic()
        ngram = np.zeros_like(transformer)
        first = fitted(data, variant, kept=False)      # held-out logits of the validation texts
        ngram[texts] = bag_logits(first, [validation.ids[i] for i in np.flatnonzero(texts)]).numpy()
        pair_ids = [validation.ids[i] for i in np.flatnonzero(~texts)]
        unseen = ngram.copy()                          # the pairs as the first fit reads them: originals unseen
        unseen[~texts] = bag_logits(first, pair_ids).numpy()
        kept = fitted(data, variant, kept=True)        # has seen the validation pairs' originals
        ngram[~texts] = bag_logits(kept, pair_ids).numpy()
        # The mix as training fits it, on the validation texts alone (not the pairs); the checkpoint's score.
        rows = np.flatnonzero(texts)
        on_texts = Validation([validation.ids[i] for i in rows], [validation.labels[i] for i in rows], group[rows],
                              ngram[rows])
        scores, mix = on_texts.scores(transformer[rows])
        score = float(np.mean([scores[on_texts.key("mixed", g)] for g in Validation.GROUPS
                               if scores.get(on_texts.key("mixed", g)) is not None]))
        mixed = mixed_logits(mix, transformer, ngram, lengths)
        revisions = group == REVISIONS
        row = {"variant": variant.name,
               "slots": int((kept.weight != 0).any(dim=1).sum()), "mix": np.round(mix, 4).tolist(),
               "checkpoint_score": score, "ngram": accuracies(ngram, y, group), "mixed": accuracies(mixed, y, group),
               "seconds": round(time.monotonic() - t)}
        # The revisions again, their originals unseen: the first fit's logits (the validation reviews left out).
        for system, logits in (("ngram", unseen), ("mixed", mixed_logits(mix, transformer, unseen, lengths))):
            row[system][UNSEEN] = float((logits[revisions].argmax(1) == y[revisions]).mean())
        if save is not None:
            row["saved"] = str(save_graft(path, run, variant, kept, mix, ngram[texts], save, data.model_config,
                                          passage_weight))
        out["variants"].append(row)
        print(path, {k: row[k] for k in ("variant", "slots", "checkpoint_score", "seconds")}, "mixed", row["mixed"],
              "ngram", row["ngram"], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.branch_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="run folders trained with the n-gram branch and "
                                                            "--counterfactual")
    p.add_argument("--variants", nargs="+", type=parse_variant, default=None, metavar="VARIANT",
                   help="branch fits to compare: MIN:C[:S], min count, C and naive-Bayes smoothing (S 1 if left out); "
                        "student:MIN:C:W[:S], a student of the teacher on the unlabelled reviews, the labelled reviews "
                        "counting W (default: each run's own fit, its --ngram-min-count and --ngram-c)")
    p.add_argument("--save", type=Path, default=None, metavar="FOLDER",
                   help="also write each variant's model as a run folder FOLDER/RUN-minMIN-cC (the run's transformer, "
                        "the variant's kept branch and mix), for classify.evaluate and experiments.behaviour; MIN:C "
                        "variants only (classify.train has flags for those)")
    p.add_argument("--ngram-ellipsis", type=int, default=None, metavar="N",
                   help="every variant's branch reads the last N words of a clause denied by an elided negation as "
                        "negated (classify.train's --ngram-ellipsis; 0 not; default: as each run did)")
    p.add_argument("--counterfactual-passage-weight", type=float, default=None, metavar="W",
                   help="every variant's fits also read the counterfactual pairs' edited passages, each counting W "
                        "reviews (classify.train's --counterfactual-passages and --counterfactual-passage-weight), "
                        "whether the run read them or not; the teacher, and so the transformer, stay the run's, and "
                        "a student's teacher reads them too unless the run had --no-teacher-passages (the fits a run "
                        "with --counterfactual-passage-repeat 0 --no-teacher-passages keeps); 0: none of the fits "
                        "read them, whatever the run did (such a run's control; default: as each run did)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="branch_memory", help="the report's file name")
    add_results_args(p, "NAME.json and .md")
    args = p.parse_args(argv)
    if args.save is not None and any(v.kind != "fit" or v.smoothing != 1 for v in args.variants or []):
        p.error("--save writes MIN:C variants only: a run's config.json cannot describe the others")
    if args.counterfactual_passage_weight is not None and args.counterfactual_passage_weight < 0:
        p.error(f"--counterfactual-passage-weight must be >= 0, got {args.counterfactual_passage_weight:g}")
    for path in args.runs if args.ngram_ellipsis is not None else []:
        _, model = read_model_config(path, KIND, ClassifierConfig)
        if model.scope_embedding and model.ngram_ellipsis != args.ngram_ellipsis:
            p.error(f"{path}'s transformer reads its branch's negation scope (--scope-embedding): --ngram-ellipsis "
                    f"{args.ngram_ellipsis} would change what the transformer reads too")
    device, dtype = runtime(argparse.Namespace(device="cpu", precision="auto", threads=args.threads))
    results = {path: study(path, args.variants, device, dtype, args.save, args.ngram_ellipsis,
                           args.counterfactual_passage_weight) for path in args.runs}
    meta = experiment_meta("experiments.branch_memory", argv if argv is not None else sys.argv[1:])
    groups = list(next(iter(results.values()))["variants"][0]["mixed"])
    lines = [f"Command: `{meta['command']}` ({meta['date']}). Validation only. Per run and branch fit (min count, "
             f"C, naive-Bayes smoothing if not 1): slots with a weight, the checkpoint's score (the mix's mean "
             f"accuracy over the validation groups), then accuracy per group of the mix and of the branch alone; "
             f"the transformer alone for scale. Pairs: the validation pairs, scored with the kept fit (which saw "
             f"their originals); the last column, their revisions scored with the first fit (which did not).", "",
             f"| run | fit | slots | checkpoint score | system | {' | '.join(groups)} |",
             "|---|---|---|---|---|" + "---|" * len(groups)]
    for path, result in results.items():
        lines.append(f"| {path} | - | - | - | transformer | "
                     + " | ".join(f"{result['transformer'][g]:.2%}" if g in result["transformer"] else "-"
                                  for g in groups) + " |")
        for row in result["variants"]:
            for system in ("mixed", "ngram"):
                lines.append(f"| {path} | {row['variant']} | {row['slots']:,} | "
                             f"{row['checkpoint_score']:.2%} | {system} | "
                             + " | ".join(f"{row[system][g]:.2%}" for g in groups) + " |")
    write_results(results_folder(args), args.name, {"meta": meta, "runs": results}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
