"""python -m classify.seq2seq: the seq2seq example, German -> English translation on Multi30k.

    python -m classify.seq2seq train --data ../shared/multi30k --output runs/multi30k --time-budget 60
    python -m classify.seq2seq translate --model runs/multi30k "Ein Hund läuft über die Wiese."
    python -m classify.seq2seq evaluate --model runs/multi30k --data ../shared/multi30k --split test

Data: a folder of line-aligned plain-text files ``{train,val,test}.{de,en}`` (one sentence
per line, raw cased text). The model is ``classify.models.Transformer``; everything around
it (run folders, schedules, mixed precision, Ctrl-C, time budgets, bucketed batches) is
the same machinery the classifier trainer uses.

Tokenization: ONE byte-pair vocabulary learned on German and English training text
together (Vaswani et al. 2017 did the same for en-de). The two languages share an
alphabet, names and numbers, so copies ("Frisbee", "3") get the same ids on both sides,
one ``tokenizer.json`` serves both, and the decoder's input embedding can be tied to its
output projection. It is cased and reversible (``▁`` marks word starts) so translations
decode back to normally spaced, cased text that is scored against the raw references.

Sequences: the source is ``x1 .. xn EOS``; the decoder reads ``BOS y1 .. ym`` and is
trained to predict ``y1 .. ym EOS``. BOS and EOS are the tokenizer's ``[CLS]`` and
``[SEP]`` specials (ids 2 and 3); padding is ``[PAD]`` (id 0) and never enters the loss.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from . import checkpoint
from .batching import BucketBatchSampler, pad_batch
from .cli import (HelpFormatter, RunConfig, add_model_args, add_optimisation_args, add_runtime_args,
                  check_run_args, runtime)
from .data import normalize
from .device import autocast, grad_scaler, to_device
from .errors import ClassifyError, run_cli
from .models import Transformer, TransformerConfig
from .tokenize import CLS, PAD, SEP, encode, load_tokenizer, save_tokenizer, train_tokenizer
from .training import (Deadline, StopSignal, TrainingProgress, budgeted_lr_multiplier, build_optimizer,
                       optimizer_step, record_evaluation, set_lr, set_seed)

KIND = "seq2seq"
BOS, EOS = CLS, SEP
BEST_BY = ("bleu", "loss")


# ------------------------------------------------------------------------------ data
@dataclass
class Parallel:
    """Aligned sentence pairs: ``src[i]`` translates to ``tgt[i]`` (raw text)."""

    src: list[str]
    tgt: list[str]

    def __len__(self) -> int:
        return len(self.src)


def read_lines(path: Path) -> list[str]:
    """One sentence per line (``\\n`` or ``\\r\\n``); a final newline does not make an extra line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClassifyError(f"data file not found: {path}") from None
    except UnicodeDecodeError as err:
        raise ClassifyError(f"{path} is not UTF-8 text: {err}") from None
    if not text.strip():
        raise ClassifyError(f"{path} is empty")
    # Not str.splitlines(): it also splits on form feeds and U+2028, which would break the alignment.
    return [line.rstrip("\r") for line in text.removesuffix("\n").split("\n")]


def load_parallel(data: str | Path, split: str, src_lang: str, tgt_lang: str) -> Parallel:
    """``DATA/{split}.{src_lang}`` and ``DATA/{split}.{tgt_lang}``, checked to have equal line counts."""
    folder = Path(data).expanduser()
    if not folder.is_dir():
        raise ClassifyError(f"data folder not found: {folder}")
    src_path, tgt_path = folder / f"{split}.{src_lang}", folder / f"{split}.{tgt_lang}"
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ClassifyError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                            f"the files are not line-aligned")
    return Parallel(src, tgt)


# ---------------------------------------------------------------------- token ids
def special_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    """(pad, bos, eos) ids, or a ClassifyError if the tokenizer lacks them."""
    ids = [tokenizer.token_to_id(t) for t in (PAD, BOS, EOS)]
    if None in ids:
        raise ClassifyError(f"the tokenizer has no {PAD}/{BOS}/{EOS} tokens: it was not made by classify")
    return ids[0], ids[1], ids[2]


def encode_side(tokenizer: Tokenizer, texts: list[str], max_len: int | None = None) -> list[list[int]]:
    """Normalised texts -> id lists ending in EOS, cut to ``max_len`` ids (None: no cut)."""
    eos = special_ids(tokenizer)[2]
    limit = sys.maxsize if max_len is None else max_len - 1
    return [ids + [eos] for ids in encode(tokenizer, [normalize(t) for t in texts], limit, "head")]


def decode_ids(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Generated ids (BOS first, maybe EOS and padding after) -> detokenized text."""
    _, bos, eos = special_ids(tokenizer)
    ids = ids[1:] if ids and ids[0] == bos else ids
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def make_batch(src_ids: list[list[int]], tgt_ids: list[list[int]], pad_id: int, bos_id: int) -> dict[str, torch.Tensor]:
    """Id lists (each ending in EOS) -> ``src`` (B, S), decoder input ``tgt_in`` (B, T) = BOS y1..ym
    and labels ``tgt_out`` (B, T) = y1..ym EOS, all right-padded with ``pad_id``."""
    return {"src": pad_batch(src_ids, pad_id),
            "tgt_in": pad_batch([[bos_id] + t[:-1] for t in tgt_ids], pad_id),
            "tgt_out": pad_batch(tgt_ids, pad_id)}


def pair_lengths(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[int]:
    """The longer side of each pair: a token budget then bounds both padded tensors."""
    return [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]


# ------------------------------------------------------------------- loss and decoding
def summed_loss(model: Transformer, batch: dict[str, torch.Tensor],
                label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the real target tokens of a batch, and their number.

    logits (B, T, V) are scored in fp32 against ``tgt_out`` (B, T); padding is ignored.
    """
    logits = model(batch["src"], batch["tgt_in"])
    labels = batch["tgt_out"]
    pad = model.config.pad_id
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=pad,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss, int((labels != pad).sum())


@torch.inference_mode()
def corpus_loss(model: Transformer, src_ids: list[list[int]], tgt_ids: list[list[int]], bos_id: int,
                device: torch.device, dtype: torch.dtype | None, max_tokens: int) -> dict[str, float]:
    """Teacher-forced negative log-likelihood per target token (nats, no label smoothing)."""
    model.eval()
    pad_id = model.config.pad_id
    sampler = BucketBatchSampler(pair_lengths(src_ids, tgt_ids), max_tokens=max_tokens, shuffle=False)
    total, tokens = 0.0, 0
    for indices in sampler:
        batch = to_device(make_batch([src_ids[i] for i in indices], [tgt_ids[i] for i in indices], pad_id, bos_id),
                          device)
        with autocast(device, dtype):
            loss, n = summed_loss(model, batch)
        total, tokens = total + float(loss), tokens + n
    return {"nll": total, "tokens": tokens, "loss": total / max(tokens, 1),
            "perplexity": math.exp(min(total / max(tokens, 1), 50.0))}


@torch.inference_mode()
def translate_ids(model: Transformer, src_ids: list[list[int]], bos_id: int, eos_id: int, device: torch.device,
                  dtype: torch.dtype | None, beam_size: int = 1, length_penalty: float = 1.0,
                  batch_size: int = 64) -> list[list[int]]:
    """Source id lists (ending in EOS) -> generated id lists (BOS first), in input order.

    Sentences are batched by length; each batch may generate up to 1.5x its longest source
    plus 10 tokens (English is rarely longer than that in German BPE tokens), within max_len.
    """
    model.eval()
    pad_id = model.config.pad_id
    out: list[list[int]] = [[] for _ in src_ids]
    sampler = BucketBatchSampler([len(s) for s in src_ids], batch_size=batch_size, shuffle=False)
    for indices in sampler:
        src = to_device(pad_batch([src_ids[i] for i in indices], pad_id), device)  # (B, S)
        max_new = min(model.config.max_len, int(1.5 * src.shape[1]) + 10)
        with autocast(device, dtype):
            tokens = model.generate(src, max_new, bos_id, eos_id, beam_size, length_penalty)
        for row, i in zip(tokens.tolist(), indices):
            out[i] = row
    return out


def translate_texts(model: Transformer, tokenizer: Tokenizer, texts: list[str], device: torch.device,
                    dtype: torch.dtype | None, beam_size: int = 1, length_penalty: float = 1.0,
                    batch_size: int = 64) -> list[str]:
    """Raw source sentences -> detokenized translations."""
    _, bos_id, eos_id = special_ids(tokenizer)
    src_ids = encode_side(tokenizer, texts, model.config.max_len)
    generated = translate_ids(model, src_ids, bos_id, eos_id, device, dtype, beam_size, length_penalty, batch_size)
    return [decode_ids(tokenizer, ids) for ids in generated]


def bleu_scores(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus scores of detokenized hypotheses against raw references (one reference each).

    ``bleu``: sacreBLEU's standard score (its own 13a tokenization, cased), comparable across
    papers. ``bleu_lowercase``: the same with both sides lower-cased: close to the "tokenized,
    lower-cased BLEU" of older tutorials (which tokenized with spaCy/Moses and lower-cased
    before building the vocabulary). ``chrf``: character n-gram F-score (chrF2).
    """
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ImportError:
        raise ClassifyError("BLEU needs sacrebleu: pip install 'classify[seq2seq]'") from None
    if len(hypotheses) != len(references):
        raise ClassifyError(f"{len(hypotheses)} translations for {len(references)} references")
    metrics = {"bleu": BLEU(), "bleu_lowercase": BLEU(lowercase=True), "chrf": CHRF()}
    scores = {name: metric.corpus_score(hypotheses, [references]) for name, metric in metrics.items()}
    result: dict[str, Any] = {name: round(score.score, 2) for name, score in scores.items()}
    result["signatures"] = {name: str(metric.get_signature()) for name, metric in metrics.items()}
    return result


# ----------------------------------------------------------------------- run folders
@dataclass
class Translator:
    """A trained translation run ready for inference."""

    path: Path
    model: Transformer
    tokenizer: Tokenizer
    config: dict          # the whole config.json


def load_translator(path: str | Path, device: torch.device) -> Translator:
    """Load ``config.json``, ``tokenizer.json`` and ``model.safetensors`` of a seq2seq run folder;
    every way these can be missing, corrupt or inconsistent is a one-line ClassifyError."""
    path = Path(path)
    config, model_config = checkpoint.read_model_config(path, KIND, TransformerConfig)
    tokenizer = load_tokenizer(path / checkpoint.TOKENIZER)
    vocab = tokenizer.get_vocab_size()
    if vocab != model_config.src_vocab_size or vocab != model_config.tgt_vocab_size:
        raise ClassifyError(f"tokenizer.json has {vocab} tokens but the model's vocabularies have "
                            f"{model_config.src_vocab_size}/{model_config.tgt_vocab_size}: "
                            f"the run folder mixes files from different runs")
    special_ids(tokenizer)  # fail now, not mid-translation, if BOS/EOS are missing
    model = Transformer(model_config)
    checkpoint.load_model_weights(model, path / checkpoint.WEIGHTS)
    model.to(device).eval()
    return Translator(path, model, tokenizer, config)


# ----------------------------------------------------------------------- evaluation
def evaluate_split(model: Transformer, tokenizer: Tokenizer, pairs: Parallel, device: torch.device,
                   dtype: torch.dtype | None, beam_size: int, length_penalty: float, batch_size: int,
                   max_tokens: int) -> tuple[dict[str, Any], list[str]]:
    """Loss, perplexities and BLEU/chrF of ``model`` on ``pairs``. Returns (metrics, translations).

    ``perplexity`` is per BPE token (EOS included) and depends on the vocabulary;
    ``word_perplexity`` spreads the same total log-likelihood over the reference's words
    (sacreBLEU 13a tokens) plus one EOS, which is closer to the per-word perplexities of
    word-level tutorials.
    """
    _, bos_id, eos_id = special_ids(tokenizer)
    max_len = model.config.max_len
    src_ids, tgt_ids = encode_side(tokenizer, pairs.src, max_len), encode_side(tokenizer, pairs.tgt, max_len)
    loss = corpus_loss(model, src_ids, tgt_ids, bos_id, device, dtype, max_tokens)
    t0 = time.monotonic()
    generated = translate_ids(model, src_ids, bos_id, eos_id, device, dtype, beam_size, length_penalty, batch_size)
    hypotheses = [decode_ids(tokenizer, ids) for ids in generated]
    seconds = time.monotonic() - t0
    metrics = bleu_scores(hypotheses, pairs.tgt)
    words = sum(len(ref_words) + 1 for ref_words in _words(pairs.tgt))
    metrics.update({"loss": round(loss["loss"], 4), "perplexity": round(loss["perplexity"], 3),
                    "word_perplexity": round(math.exp(min(loss["nll"] / words, 50.0)), 3),
                    "target_tokens": loss["tokens"], "target_words": words, "sentences": len(pairs),
                    "beam_size": beam_size, "length_penalty": length_penalty, "decode_seconds": round(seconds, 1)})
    return metrics, hypotheses


def _words(texts: list[str]) -> list[list[str]]:
    """sacreBLEU's 13a tokenization of each text."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    return [tokenize(t).split() for t in texts]


# ------------------------------------------------------------------------- training
@dataclass(kw_only=True)
class Seq2SeqTrainConfig(RunConfig):
    """Everything that defines a translation training run except the model sizes (stored in config.json)."""

    src_lang: str = "de"
    tgt_lang: str = "en"
    epochs: int = 10
    warmup: int = 400
    weight_decay: float = 0.01
    max_tokens: int = 2048
    label_smoothing: float = 0.1
    vocab_size: int = 8000
    best_by: str = "bleu"
    patience: int | None = None

    IDENTITY: ClassVar[tuple[str, ...]] = (*RunConfig.IDENTITY, "src_lang", "tgt_lang", "vocab_size")


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a translation model",
                       formatter_class=HelpFormatter,
                       description="Train the encoder-decoder transformer on a folder of line-aligned "
                                   "{train,val}.{SRC,TGT} files. Re-running into the same --output resumes.")
    default = Seq2SeqTrainConfig.default
    g = p.add_argument_group("data")
    g.add_argument("--data", required=True, help="folder with train.de/train.en, val.de/val.en (and test.*)")
    g.add_argument("--output", required=True, help="run folder to write (re-running into it resumes)")
    g.add_argument("--src-lang", default=default("src_lang"), help="source file suffix")
    g.add_argument("--tgt-lang", default=default("tgt_lang"), help="target file suffix")
    g.add_argument("--vocab-size", type=int, default=default("vocab_size"),
                   help="joint source+target BPE vocabulary size")
    g.add_argument("--max-len", type=int, default=128,
                   help="longest sequence in tokens; longer training pairs are skipped")
    g = p.add_argument_group("model")
    add_model_args(g, d_model=256, layers=3, heads=8, d_ff=512, positional="sinusoidal",
                   layers_help="encoder blocks, and decoder blocks")
    g.add_argument("--no-tie-embeddings", action="store_true",
                   help="separate decoder input embedding and output projection")
    g = p.add_argument_group("optimisation")
    add_optimisation_args(
        g, Seq2SeqTrainConfig,
        time_budget="minutes of training (validation included); then stop cleanly. The learning-rate decay follows "
                    "steps or time, whichever is further along, so a budgeted run ends decayed",
        schedule="decay after warmup: cosine/linear reach zero at the end of --epochs (or --max-steps); "
                 "inverse_sqrt (Noam) needs no end, for open-ended runs")
    g.add_argument("--max-tokens", type=int, default=default("max_tokens"),
                   help="token budget per batch (padded length of the longer side x sentences)")
    g.add_argument("--label-smoothing", type=float, default=default("label_smoothing"),
                   help="label smoothing of the cross-entropy")
    g.add_argument("--patience", type=int, help="stop after N validations without improvement")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=default("seed"), help="random seed")
    add_runtime_args(g)
    g.add_argument("--best-by", choices=BEST_BY, default=default("best_by"),
                   help="which validation score picks model.safetensors (bleu: greedy decoding of val each epoch)")
    g.add_argument("--save-every", type=int, default=default("save_every"),
                   help="write last/ (resume state) every N steps")
    g.add_argument("--resume", action="store_true", help="continue the run in --output (also automatic)")
    g.add_argument("--overwrite", action="store_true", help="replace a different run found in --output")
    g.add_argument("--quiet", action="store_true", help="no progress display")


def check_train_args(args: argparse.Namespace) -> None:
    check_run_args(args, {"--max-tokens": args.max_tokens})
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ClassifyError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.max_tokens < args.max_len:
        raise ClassifyError(f"--max-tokens {args.max_tokens} cannot hold one sequence of --max-len {args.max_len}")


def configs_from_args(args: argparse.Namespace, vocab_size: int) -> tuple[TransformerConfig, Seq2SeqTrainConfig]:
    train = Seq2SeqTrainConfig.from_args(args)
    train.data = str(Path(args.data).expanduser().resolve())
    model = TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=args.d_model, num_heads=args.heads,
        num_encoder_layers=args.layers, num_decoder_layers=args.layers, d_ff=args.d_ff, max_len=args.max_len,
        dropout=args.dropout, positional=args.positional, norm_first=not args.post_ln,
        tie_embeddings=not args.no_tie_embeddings)
    return model, train


def prepare_output(out: Path, train: Seq2SeqTrainConfig, model: TransformerConfig, overwrite: bool) -> bool:
    """Decide between a fresh run and a resume. Returns True when resuming."""
    return checkpoint.prepare_run_folder(out, KIND, asdict(train), Seq2SeqTrainConfig.IDENTITY, model.to_dict(),
                                         overwrite, sized_by_tokenizer=("src_vocab_size", "tgt_vocab_size"))


def encode_training_pairs(tokenizer: Tokenizer, pairs: Parallel,
                          max_len: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Token ids of both sides; pairs with a side longer than ``max_len`` are skipped, not cut
    (a cut target would teach the model to stop mid-sentence). Returns (src, tgt, skipped)."""
    src_all, tgt_all = encode_side(tokenizer, pairs.src), encode_side(tokenizer, pairs.tgt)
    kept = [i for i, (s, t) in enumerate(zip(src_all, tgt_all)) if len(s) <= max_len and len(t) <= max_len]
    if not kept:
        raise ClassifyError(f"every training pair is longer than --max-len {max_len} tokens")
    return [src_all[i] for i in kept], [tgt_all[i] for i in kept], len(pairs) - len(kept)


def epoch_sizes(sampler: BucketBatchSampler, epochs: int) -> list[int]:
    """Batches in each epoch. Under a token budget the count shifts a little with each epoch's
    shuffle, so an epoch ends when its own batch list does, and the run lasts their sum."""
    sizes = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        sizes.append(len(sampler.batches()))
    return sizes


def train(args: argparse.Namespace) -> int:
    check_train_args(args)
    out = Path(args.output)
    console = Console(stderr=True, quiet=args.quiet)
    set_seed(args.seed)
    device, dtype = runtime(args)
    model_config, train_config = configs_from_args(args, args.vocab_size)
    resuming = prepare_output(out, train_config, model_config, args.overwrite)

    # ---- data: load, (train the tokenizer,) tokenize once
    t0 = time.monotonic()
    train_pairs = load_parallel(args.data, "train", args.src_lang, args.tgt_lang)
    val_pairs = load_parallel(args.data, "val", args.src_lang, args.tgt_lang)
    if resuming:
        tokenizer = load_tokenizer(out / checkpoint.TOKENIZER)
    else:
        texts = [normalize(t) for t in train_pairs.src + train_pairs.tgt]
        tokenizer = train_tokenizer(texts, args.vocab_size, kind="bpe", lowercase=False, reversible=True)
    pad_id, bos_id, eos_id = special_ids(tokenizer)
    model_config.src_vocab_size = model_config.tgt_vocab_size = tokenizer.get_vocab_size()
    src_ids, tgt_ids, skipped = encode_training_pairs(tokenizer, train_pairs, args.max_len)
    val_src = encode_side(tokenizer, val_pairs.src, args.max_len)
    val_tgt = encode_side(tokenizer, val_pairs.tgt, args.max_len)
    console.log(f"data: {len(src_ids)} train pairs ({skipped} longer than {args.max_len} tokens skipped) / "
                f"{len(val_pairs)} validation pairs from {args.data}, joint vocabulary "
                f"{tokenizer.get_vocab_size()}, {time.monotonic() - t0:.1f}s")

    if not resuming:
        out.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, out / checkpoint.TOKENIZER)
        checkpoint.write_config(out, KIND, model_config.to_dict(), train=asdict(train_config))
    else:  # flags that may change on resume (budget, epochs, ...) are recorded as the latest
        old = checkpoint.read_config(out, KIND)
        checkpoint.write_config(out, KIND, old["model"], train=asdict(train_config))

    # ---- model and optimisation
    model = Transformer(model_config).to(device)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    scaler = grad_scaler(device, dtype)
    sampler = BucketBatchSampler(pair_lengths(src_ids, tgt_ids), max_tokens=args.max_tokens, seed=args.seed)
    sizes = epoch_sizes(sampler, args.epochs)
    total_steps = sum(sizes)
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best": None, "evals_since_best": 0,
                             "train_seconds": 0.0, "tokens": 0}
    if resuming:
        restored = checkpoint.load_last(out, model, optimizer)
        if restored is not None:
            state.update({k: restored[k] for k in state if k in restored})
            console.log(f"resumed from {out / checkpoint.LAST} at step {state['step']} (epoch {state['epoch']})")
    n_params = sum(p.numel() for p in model.parameters())
    console.log(f"model: {n_params / 1e6:.2f}M parameters, device {device}, threads {torch.get_num_threads()}, "
                f"autocast {dtype if dtype else 'off (fp32)'}, {sizes[0]} steps/epoch, {total_steps} steps")

    deadline = Deadline(args.time_budget, already_used_s=state["train_seconds"])
    run_loss, run_tokens = 0.0, 0
    tokens_since, clock = 0, time.monotonic()
    stop_reason = "finished"

    def save_last() -> None:
        state["train_seconds"] = deadline.elapsed
        checkpoint.save_last(out, model, optimizer, state)

    def validate() -> bool:
        """Validation loss (and greedy BLEU), log, keep the best weights. True when patience ran out."""
        nonlocal run_loss, run_tokens, tokens_since, clock
        now = time.monotonic()
        tokens_per_s = tokens_since / max(now - clock, 1e-9)
        loss = corpus_loss(model, val_src, val_tgt, bos_id, device, dtype, args.max_tokens)
        epoch = state["epoch"] + state["batch_in_epoch"] / sizes[state["epoch"]]
        record = {"step": state["step"], "epoch": round(epoch, 3),
                  "train_loss": run_loss / max(run_tokens, 1), "val_loss": loss["loss"],
                  "val_perplexity": loss["perplexity"]}
        if args.best_by == "bleu":
            generated = translate_ids(model, val_src, bos_id, eos_id, device, dtype)
            hyps = [decode_ids(tokenizer, ids) for ids in generated]
            record["val_bleu"] = bleu_scores(hyps, val_pairs.tgt)["bleu"]
        record.update({"lr": optimizer.param_groups[0]["lr"], "elapsed_s": round(deadline.elapsed, 1),
                       "tokens_per_s": round(tokens_per_s, 1), "validation_s": round(time.monotonic() - now, 1)})
        checkpoint.append_jsonl(out / checkpoint.METRICS, record)
        bleu_text = f"  val BLEU {record['val_bleu']:.2f}" if "val_bleu" in record else ""
        progress.log(f"step {record['step']}: train loss {record['train_loss']:.3f}  val loss {loss['loss']:.3f}  "
                     f"val ppl {loss['perplexity']:.2f}{bleu_text}  {tokens_per_s:.0f} tok/s")
        run_loss, run_tokens, tokens_since = 0.0, 0, 0
        score = record["val_bleu"] if args.best_by == "bleu" else -loss["loss"]
        improved, exhausted = record_evaluation(state, "best", score, args.patience)
        if improved:
            checkpoint.save_tensors(out / checkpoint.WEIGHTS, checkpoint.model_state(model))
        model.train()
        clock = time.monotonic()
        return exhausted

    model.train()
    with StopSignal() as stop, TrainingProgress(total_steps, enabled=not args.quiet) as progress:
        progress.update(state["step"], state["epoch"], {})
        while state["step"] < total_steps and state["epoch"] < args.epochs and stop_reason == "finished":
            sampler.set_epoch(state["epoch"])
            batches = sampler.batches()
            # Resuming mid-epoch: the sampler replays this epoch's order; skip what was done.
            for i in range(state["batch_in_epoch"], len(batches)):
                if stop.requested:
                    stop_reason = "interrupted"
                elif deadline.expired:
                    stop_reason = "time budget"
                if stop_reason != "finished":
                    break
                indices = batches[i]
                batch = to_device(make_batch([src_ids[j] for j in indices], [tgt_ids[j] for j in indices],
                                             pad_id, bos_id), device)
                factor = budgeted_lr_multiplier(state["step"], args.warmup, total_steps, args.schedule, deadline)
                set_lr(optimizer, args.lr * factor)
                with autocast(device, dtype):
                    loss_sum, n_tokens = summed_loss(model, batch, args.label_smoothing)
                optimizer_step(loss_sum / n_tokens, model, optimizer, scaler, args.clip)
                run_loss += float(loss_sum.detach())
                run_tokens += n_tokens
                real = n_tokens + int((batch["src"] != pad_id).sum())
                tokens_since += real
                state["tokens"] += real
                state["step"] += 1
                state["batch_in_epoch"] = i + 1
                progress.update(state["step"], state["epoch"] + 1, {
                    "loss": run_loss / run_tokens, "lr": optimizer.param_groups[0]["lr"],
                    "tok/s": tokens_since / max(time.monotonic() - clock, 1e-9)})
                if state["batch_in_epoch"] == len(batches) or state["step"] == total_steps:
                    if validate():
                        stop_reason = "early stopping"
                if state["step"] % args.save_every == 0 or stop_reason != "finished":
                    save_last()
                if state["step"] >= total_steps or stop_reason != "finished":
                    break
            if state["batch_in_epoch"] >= len(batches):
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
        if stop_reason in ("time budget", "finished") and run_tokens:
            validate()  # the final partial epoch counts too
        save_last()

    if stop_reason == "interrupted":
        console.print(f"[yellow]interrupted at step {state['step']}; state saved in {out / checkpoint.LAST}. "
                      f"Re-run the same command to resume.[/]")
        return 130
    test_metrics = evaluate_test(out, args, model, tokenizer, device, dtype, console)
    print_summary(console, out, state, stop_reason, test_metrics, deadline.elapsed, args.best_by)
    return 0


def evaluate_test(out: Path, args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer,
                  device: torch.device, dtype: torch.dtype | None, console: Console) -> dict | None:
    """One greedy evaluation of the best weights on the test split (when there is one)."""
    if not (out / checkpoint.WEIGHTS).exists():
        return None
    try:
        test = load_parallel(args.data, "test", args.src_lang, args.tgt_lang)
    except ClassifyError as err:
        console.log(f"no test evaluation: {err}")
        return None
    checkpoint.load_model_weights(model, out / checkpoint.WEIGHTS)
    metrics, _ = evaluate_split(model, tokenizer, test, device, dtype, beam_size=1, length_penalty=1.0,
                                batch_size=64, max_tokens=args.max_tokens)
    metrics["split"] = "test"
    checkpoint.write_json(out / checkpoint.TEST_METRICS, metrics)
    return metrics


def print_summary(console: Console, out: Path, state: dict, reason: str, test: dict | None, seconds: float,
                  best_by: str) -> None:
    table = Table(title=f"classify.seq2seq train: {out}", show_header=False)
    table.add_row("stopped", reason)
    table.add_row("steps / epochs", f"{state['step']} / {state['epoch']}")
    table.add_row("training time", f"{seconds / 60:.1f} min")
    if state["best"] is not None:
        best = f"BLEU {state['best']:.2f}" if best_by == "bleu" else f"loss {-state['best']:.4f}"
        table.add_row("best validation", best)
    if test:
        table.add_row("test BLEU (greedy)", f"{test['bleu']:.2f}  (lower-cased {test['bleu_lowercase']:.2f}, "
                                           f"chrF {test['chrf']:.2f})")
        table.add_row("test loss / perplexity", f"{test['loss']:.4f} / {test['perplexity']:.2f}")
    table.add_row("run folder", str(out))
    console.print(table)


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
    add_runtime_args(p)


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
    add_runtime_args(p)


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
    checkpoint.write_json(report_path, report)
    if args.translations:
        checkpoint.write_text(args.translations, "".join(h + "\n" for h in hypotheses))
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


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="classify.seq2seq"))
