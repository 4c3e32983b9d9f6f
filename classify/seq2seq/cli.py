"""python -m classify.seq2seq: train, run and score the German -> English translator.

    python -m classify.seq2seq train --data ../shared/multi30k --output runs/multi30k --time-budget 60
    python -m classify.seq2seq translate --model runs/multi30k "Ein Hund läuft über die Wiese."
    python -m classify.seq2seq evaluate --model runs/multi30k --data ../shared/multi30k --split test

``train`` runs under torchrun too (``torchrun --nproc_per_node=N -m classify.seq2seq train ...``).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from ..engine.config import HelpFormatter, RuntimeConfig, add_flags, add_run_folder_args, from_args, runtime
from ..engine import distributed
from ..engine.files import load_model_weights, write_json, write_text
from ..engine.loop import fit, run_trainer
from ..engine.runfolder import WEIGHTS, RunFolder
from ..errors import ClassifyError
from ..models import Transformer, TransformerConfig
from ..text.data import normalize
from ..text.tokenize import train_tokenizer
from .data import encode_side, encode_training_pairs, load_parallel, read_lines
from .metrics import evaluate_split
from .task import Seq2SeqTrainConfig, TranslationTask
from .translate import KIND, load_translator, translate_texts


# ---------------------------------------------------------------------------- train
MODEL_FLAGS = ("d_model", "num_heads", "num_encoder_layers", "num_decoder_layers", "d_ff", "dropout", "positional",
               "norm_first", "tie_embeddings")
# The example's model: smaller than TransformerConfig's base-model defaults, with tied embeddings.
MODEL_DEFAULTS = {"d_model": 256, "num_heads": 8, "num_encoder_layers": 3, "num_decoder_layers": 3, "d_ff": 512,
                  "max_len": 128, "tie_embeddings": True}


class _BothLayers(argparse.Action):
    """--layers N (the old spelling): N encoder and N decoder blocks."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.num_encoder_layers = namespace.num_decoder_layers = values


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a translation model",
                       formatter_class=HelpFormatter,
                       description="Train the encoder-decoder transformer on a folder of line-aligned "
                                   "{train,val}.{SRC,TGT} files. Re-running into the same --output resumes. Each "
                                   "flag is a setting that config.json stores under the flag's name.")
    g = p.add_argument_group("data")
    add_flags(g, Seq2SeqTrainConfig, ["data", "src_lang", "tgt_lang", "vocab_size"])
    add_flags(g, TransformerConfig, ["max_len"], defaults=MODEL_DEFAULTS)
    g = p.add_argument_group("model")
    add_flags(g, TransformerConfig, MODEL_FLAGS, defaults=MODEL_DEFAULTS)
    g.add_argument("--layers", type=int, action=_BothLayers, default=argparse.SUPPRESS,
                   help="old spelling, kept for one release: sets --num-encoder-layers and --num-decoder-layers")
    add_flags(p.add_argument_group("optimisation"), Seq2SeqTrainConfig,
              ["epochs", "max_steps", "time_budget", "lr", "warmup", "schedule", "weight_decay", "clip", "average_from",
               "max_tokens", "grad_accum", "label_smoothing", "eval_every", "patience"])
    g = p.add_argument_group("run")
    add_flags(g, Seq2SeqTrainConfig, ["seed", "device", "precision", "threads", "best_by", "save_every", "num_workers"])
    add_run_folder_args(g)


def configs_from_args(args: argparse.Namespace) -> tuple[TransformerConfig, Seq2SeqTrainConfig]:
    """The model's config and the run's, from the flags; checked. The vocabulary sizes are the
    tokenizer's, set once it exists."""
    config = from_args(Seq2SeqTrainConfig, args, data=str(Path(args.data).expanduser().resolve()))
    model = from_args(TransformerConfig, args, src_vocab_size=config.vocab_size, tgt_vocab_size=config.vocab_size)
    config.validate(model)
    return model, config


def train(args: argparse.Namespace) -> int:
    model_config, config = configs_from_args(args)
    return run_trainer(KIND, config, args, partial(train_run, args, model_config, config))


def train_run(args: argparse.Namespace, model_config: TransformerConfig, config: Seq2SeqTrainConfig, run: RunFolder,
              device: torch.device, dtype: torch.dtype | None, console: Console) -> int:
    """The training run of ``train``; under torchrun every rank runs it. Returns the exit code."""
    resuming = run.open(config, model_config, args.overwrite, args.resume,
                        sized_by_tokenizer=("src_vocab_size", "tgt_vocab_size"))

    # ---- data: load, (train the tokenizer,) tokenize once
    t0 = time.monotonic()
    train_pairs = load_parallel(config.data, "train", config.src_lang, config.tgt_lang)
    val_pairs = load_parallel(config.data, "val", config.src_lang, config.tgt_lang)
    tokenizer = run.tokenizer(resuming, lambda: train_tokenizer(
        [normalize(t) for t in train_pairs.src + train_pairs.tgt], config.vocab_size, kind="bpe", lowercase=False,
        reversible=True))
    model_config.src_vocab_size = model_config.tgt_vocab_size = tokenizer.get_vocab_size()
    max_len = model_config.max_len
    src_ids, tgt_ids, skipped = encode_training_pairs(tokenizer, train_pairs, max_len)
    val_src, val_tgt = encode_side(tokenizer, val_pairs.src, max_len), encode_side(tokenizer, val_pairs.tgt, max_len)
    console.log(f"data: {len(src_ids)} train pairs ({skipped} longer than {max_len} tokens skipped) / "
                f"{len(val_pairs)} validation pairs from {config.data}, joint vocabulary "
                f"{tokenizer.get_vocab_size()}, {time.monotonic() - t0:.1f}s")
    run.record(resuming, tokenizer, config, model_config)

    model = Transformer(model_config).to(device)
    task = TranslationTask(model, tokenizer, src_ids, tgt_ids, val_src, val_tgt, val_pairs.tgt, config, device, dtype)
    result = fit(task, config, run, device, dtype, resuming=resuming, quiet=args.quiet)
    if result.interrupted:
        return 130
    if distributed.is_main():
        test_metrics = evaluate_test(run, config, model, tokenizer, device, dtype, console)
        best, rows = result.state["best"], []
        if best is not None:
            rows.append(("best validation", f"BLEU {best:.2f}" if config.best_by == "bleu" else f"loss {-best:.4f}"))
        if test_metrics:
            rows += [("test BLEU (greedy)", f"{test_metrics['bleu']:.2f}  (lower-cased "
                                            f"{test_metrics['bleu_lowercase']:.2f}, chrF {test_metrics['chrf']:.2f})"),
                     ("test loss / perplexity", f"{test_metrics['loss']:.4f} / {test_metrics['perplexity']:.2f}")]
        result.print_summary(console, "classify.seq2seq train", run, rows)
    return 0


def evaluate_test(run: RunFolder, config: Seq2SeqTrainConfig, model: Transformer, tokenizer: Tokenizer,
                  device: torch.device, dtype: torch.dtype | None, console: Console) -> dict | None:
    """One greedy evaluation of the best weights on the test split (when there is one)."""
    if not (run.path / WEIGHTS).exists():
        return None
    try:
        test = load_parallel(config.data, "test", config.src_lang, config.tgt_lang)
    except ClassifyError as err:
        console.log(f"no test evaluation: {err}")
        return None
    load_model_weights(model, run.path / WEIGHTS)
    metrics, _ = evaluate_split(model, tokenizer, test, device, dtype, beam_size=1, length_penalty=1.0,
                                batch_size=64, max_tokens=config.max_tokens)
    metrics["split"] = "test"
    run.write_test_metrics(metrics)
    return metrics


# ------------------------------------------------------------------------ translate
def add_translate_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate sentences with a trained run",
                       formatter_class=HelpFormatter,
                       description="Translate sentences given as arguments, one per line from --file, "
                                   "or from stdin ('-'). Prints one translation per line.")
    p.add_argument("--model", required=True, help="run folder written by 'train'")
    p.add_argument("texts", nargs="*", help="sentences to translate; '-' reads stdin")
    p.add_argument("--file", help="a file with one sentence per line ('-' = stdin)")
    p.add_argument("--beam-size", type=int, default=4, help="beam width (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam hypotheses are ranked by log-prob / length**PENALTY (0 favours short output)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together")
    add_flags(p, RuntimeConfig)


def read_inputs(texts: list[str], file: str | None) -> list[str]:
    """Sentences from the arguments, a file or stdin (``-``), in that order."""
    sentences: list[str] = []
    for text in texts:
        sentences.extend(sys.stdin.read().splitlines() if text == "-" else [text])
    if file == "-":
        sentences.extend(sys.stdin.read().splitlines())
    elif file is not None:
        sentences.extend(read_lines(Path(file)))
    if not sentences:
        raise ClassifyError("nothing to translate: give sentences, --file PATH, or '-' for stdin")
    return sentences


def check_decoding_args(args: argparse.Namespace) -> None:
    if args.beam_size < 1:
        raise ClassifyError(f"--beam-size must be at least 1, got {args.beam_size}")
    if args.batch_size < 1:
        raise ClassifyError(f"--batch-size must be at least 1, got {args.batch_size}")


def translate(args: argparse.Namespace) -> int:
    check_decoding_args(args)
    sentences = read_inputs(args.texts, args.file)
    device, dtype = runtime(args)
    run = load_translator(args.model, device)
    for line in translate_texts(run.model, run.tokenizer, sentences, device, dtype, args.beam_size,
                                args.length_penalty, args.batch_size):
        print(line)
    return 0


# ------------------------------------------------------------------------- evaluate
def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="BLEU, chrF and perplexity of a trained run on a split",
                       formatter_class=HelpFormatter,
                       description="Translate a split, score it with sacreBLEU (cased, detokenized, and "
                                   "lower-cased), chrF and teacher-forced loss/perplexity; print samples and "
                                   "write a JSON report.")
    p.add_argument("--model", required=True, help="run folder written by 'train'")
    p.add_argument("--data", required=True, help="folder with {split}.{src}/{split}.{tgt} files")
    p.add_argument("--split", default="test", help="file prefix of the split to score")
    p.add_argument("--src-lang", help="source file suffix (default: the run's)")
    p.add_argument("--tgt-lang", help="target file suffix (default: the run's)")
    p.add_argument("--beam-size", type=int, default=4, help="beam width (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam ranking: log-prob / length**PENALTY")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget of the loss batches")
    p.add_argument("--samples", type=int, default=5, help="sample translations to print and store")
    p.add_argument("--report", help="JSON report path (default: RUN/eval-SPLIT-beamK.json)")
    p.add_argument("--translations", help="also write every translation to this file, one per line")
    add_flags(p, RuntimeConfig)


def evaluate(args: argparse.Namespace) -> int:
    check_decoding_args(args)
    device, dtype = runtime(args)
    run = load_translator(args.model, device)
    train_config = run.config.get("train", {})
    src_lang = args.src_lang or train_config.get("src_lang", "de")
    tgt_lang = args.tgt_lang or train_config.get("tgt_lang", "en")
    pairs = load_parallel(args.data, args.split, src_lang, tgt_lang)
    metrics, hypotheses = evaluate_split(run.model, run.tokenizer, pairs, device, dtype, args.beam_size,
                                         args.length_penalty, args.batch_size, args.max_tokens)
    samples = [{"source": pairs.src[i], "reference": pairs.tgt[i], "translation": hypotheses[i]}
               for i in range(min(args.samples, len(pairs)))]
    report = {"run": str(run.path), "data": str(Path(args.data).expanduser().resolve()), "split": args.split,
              **metrics, "device": str(device), "precision": str(dtype) if dtype else "fp32",
              "threads": torch.get_num_threads(), "samples": samples}
    report_path = Path(args.report) if args.report else run.path / f"eval-{args.split}-beam{args.beam_size}.json"
    write_json(report_path, report)
    if args.translations:
        write_text(args.translations, "".join(h + "\n" for h in hypotheses))
    print_evaluation(report, report_path)
    return 0


def print_evaluation(report: dict[str, Any], path: Path) -> None:
    console = Console()
    table = Table(title=f"{report['split']}: {report['sentences']} sentences, beam {report['beam_size']}",
                  show_header=False)
    table.add_row("BLEU (sacreBLEU, cased, detokenized)", f"{report['bleu']:.2f}")
    table.add_row("BLEU (lower-cased, 13a-tokenized)", f"{report['bleu_lowercase']:.2f}")
    table.add_row("chrF", f"{report['chrf']:.2f}")
    table.add_row("loss / perplexity (per BPE token)", f"{report['loss']:.4f} / {report['perplexity']:.2f}")
    table.add_row("perplexity per word", f"{report['word_perplexity']:.2f}")
    table.add_row("decoding time", f"{report['decode_seconds']:.1f} s")
    console.print(table)
    for sample in report["samples"]:
        console.print(f"[dim]src[/] {sample['source']}\n[dim]ref[/] {sample['reference']}\n"
                      f"[dim]out[/] {sample['translation']}\n", highlight=False, markup=True)
    console.print(f"report: {path}")


# ------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m classify.seq2seq",
                                description="The seq2seq example: train, run and score a German->English "
                                            "transformer translator (Multi30k by default).")
    sub = p.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_translate_parser(sub)
    add_evaluate_parser(sub)
    return p


COMMANDS = {"train": train, "translate": translate, "evaluate": evaluate}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)

