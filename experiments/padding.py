"""How far training batches are padded, and what it costs: the recipe's transformer trained on its own batches.

The README command's training texts (the labelled, counterfactual and unlabelled reviews cut to --train-max-len,
their closing sentences, the negation edits and contrast joins: ``classify.train``'s own functions build them,
with its default flags), tokenized by a run's tokenizer and batched as one epoch of training batches them (length
buckets of --batch-size, the seed's shuffle). For each multiple that a batch's length is rounded up to
(``classify.text.batching.pad_batch``): the share of the epoch's positions that are padding; and real tokens per
second of training steps (forward, backward, clipping, AdamW, fp32) of the recipe's transformer (no n-gram branch)
on a sample of the epoch's batches. The ids are random ones of the batches' lengths (the speed does not depend on
which ids), the multiples timed in turn, in ABBA order over the rounds (``benchtools.interleave``); the ratio
against 32 is the median of the rounds' ratios.

    python -m experiments.padding --tokenizer-from runs/imdb-v65-trainlen256-avx2-seed7 --threads 2 --record
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from classify.engine.optim import build_optimizer, optimizer_step
from classify.engine.runfolder import TOKENIZER
from classify.text.batching import BucketBatchSampler, pad_batch, padded_length
from classify.text.data import training_split, unlabelled_split
from classify.text.prepare import Preprocessing
from classify.text.tokenize import load_tokenizer, token_ids
from classify.text.windows import SENTENCE_ENDS, Elision
from classify.train import build_parser, configs_from_args
from classify.training_texts import LabelledTexts, TransformerExamples, training_parts

from . import add_results_args
from .attention_precision import models_to_time, timing_record, write_table_report
from .benchtools import interleave, paired_ratio, summarize


def training_lengths(data: str, counterfactual: str, seed: int, tokenizer: Path) -> tuple[np.ndarray, list, int]:
    """The token counts of the texts the README command's transformer trains on (``classify.train``'s defaults,
    ``tokenizer``'s tokens), one epoch's batches of them (index lists), and the model's max_len."""
    args = build_parser().parse_args(["--data", data, "--output", "unused", "--counterfactual", counterfactual,
                                      "--seed", str(seed)])
    model_config, config = configs_from_args(args)
    texts = LabelledTexts.of(config, *training_split(config.data, config.val_size, config.seed, config.limit,
                                                     config.split))
    vocabulary = load_tokenizer(tokenizer)
    encode = Preprocessing(vocabulary, model_config.max_len, config.truncation).ids
    parts = training_parts(config, *((encode(e.texts), e.labels) for e in texts.parts()))
    unlabelled = encode(unlabelled_split(config.data, config.limit, config.seed).texts)
    given = np.full((len(unlabelled), model_config.num_classes), 1 / model_config.num_classes)  # targets: unused
    examples = TransformerExamples.build(parts, unlabelled, given, config, set(token_ids(vocabulary, SENTENCE_ENDS)),
                                         Elision.of(vocabulary))
    lengths = np.array([len(x) for x in examples.ids])
    sampler = BucketBatchSampler(lengths, batch_size=config.batch_size, seed=config.seed)
    return lengths, sampler.batches(), model_config.max_len


def padded_share(lengths: np.ndarray, batches: list, max_len: int, multiple: int) -> float:
    """The share of the batches' positions that padding fills when each is rounded up to ``multiple``."""
    padded = sum(len(b) * padded_length(int(lengths[b].max()), max_len, multiple) for b in batches)
    return 1 - lengths.sum() / padded


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.padding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="../shared/imdb")
    parser.add_argument("--counterfactual", default="../shared/imdb-counterfactual")
    parser.add_argument("--tokenizer-from", type=Path, required=True, metavar="RUN",
                        help="a classifier run folder whose tokenizer encodes the texts")
    parser.add_argument("--seed", type=int, default=7, help="the epoch's shuffle, as classify.train --seed")
    parser.add_argument("--multiples", type=int, nargs="+", default=[32, 16, 8, 1])
    parser.add_argument("--batches", type=int, default=80, help="the epoch's batches timed, drawn at random")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per multiple (ABBA order)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="padding", help="the report's file name")
    add_results_args(parser, "NAME.json and .md")
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)  # as every command of the project does, before the thread pool starts
    torch.set_num_threads(args.threads)
    lengths, batches, max_len = training_lengths(args.data, args.counterfactual, args.seed,
                                                 args.tokenizer_from / TOKENIZER)
    rng = np.random.default_rng(0)
    timed = [batches[i] for i in sorted(rng.choice(len(batches), min(args.batches, len(batches)), replace=False))]
    generator = torch.Generator().manual_seed(1)
    texts = [[torch.randint(1, 30_000, (int(lengths[i]),), generator=generator).tolist() for i in b] for b in timed]
    model = models_to_time(None)["initial weights"].train()
    optimizer = build_optimizer(model, 1e-6, 0.01)   # a tiny rate: the weights stay what they were
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def steps(multiple: int) -> float:
        for batch in texts:
            tokens = pad_batch(batch, max_len=max_len, multiple=multiple)
            loss = F.cross_entropy(model(tokens, ngram=False), torch.zeros(len(batch), dtype=torch.long))
            optimizer_step(loss, model, optimizer, scaler, 1.0)
        return float(sum(len(x) for batch in texts for x in batch))   # real tokens

    samples = interleave({m: (lambda m=m: steps(m)) for m in args.multiples}, args.repeats, torch.device("cpu"))
    times = summarize(samples)
    rows = [{"multiple": m, "padding": padded_share(lengths, batches, max_len, m),
             "tokens_per_s": times[m]["rate_median"], "against_32": paired_ratio(samples[m], samples[32])
             if 32 in samples else None} for m in args.multiples]
    record = timing_record("experiments.padding", argv, args.threads, rows, texts=len(lengths),
                           batches=len(batches), timed_batches=len(timed), repeats=args.repeats)
    write_table_report(
        args, record, "Training batches padded to a multiple: padding and speed",
        f"fp32, torch {record['torch']}. One epoch of the README command's training texts ({len(lengths)} texts, "
        f"{len(batches)} batches); {len(timed)} of its batches timed per round, training steps of the recipe's "
        f"transformer; medians of {args.repeats} interleaved rounds.",
        ["multiple", "padding (share of positions)", "real tokens/s", "against 32 (paired)"],
        [[r["multiple"], f"{r['padding']:.3f}", f"{r['tokens_per_s']:.0f}",
          "" if r["against_32"] is None else f"{r['against_32']:.3f}x"] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
