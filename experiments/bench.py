"""python -m experiments.bench: how fast classify trains and predicts, next to torch.nn on the same work.

    python -m experiments.bench --quick     # every ratio, few repeats: under two minutes on 2 CPU cores
    python -m experiments.bench             # the full run (bigger samples, a bigger model, more repeats)

Sections, all measured in one process with the same data, sizes and precision on both sides:

* ``peak_matmul``  this machine's best square-matmul FLOP/s (fp32, bf16), at the start and the end
                   of the run (always measured): the MFU denominator.
* ``training``     real tokens/s of forward + backward + AdamW of our ``Classifier`` against the same
                   classifier whose encoder is ``torch.nn.TransformerEncoder``, fp32 and bf16 autocast,
                   on bucketed batches of real IMDB reviews; bf16/fp32 ratios; MFU; the cost of
                   attention dropout (which keeps SDPA off its fused CPU kernel).
* ``epoch``        one epoch of our pipeline (bucketing, bf16) against the naive Bloem-style one (every
                   review padded to 512, fp32, random batches), extrapolated from sampled steps.
* ``inference``    reviews/s from raw text to labels: our predict path against nn.TransformerEncoder's
                   inference fast path and against padding every review to 512 with no bucketing.
* ``latency``      run-folder load time; single-review predict latency p50/p95.
* ``scaling``      training step time and peak memory against sequence length and batch size.
* ``seq2seq``      our encoder-decoder against torch.nn.Transformer; generation with/without KV cache.

Results: ``bench.{json,md}`` (``bench_quick.*`` with ``--quick``) in ``experiments/runs/results/``
(untracked), or with ``--record`` in ``experiments/results/``, which RESULTS_bench.md cites.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from classify.core import Dropout, Encoder, MultiHeadAttention
from classify.engine.device import autocast, autocast_dtype, bf16_supported, grad_scaler, resolve_device, to_device
from classify.engine.files import model_state, save_tensors, write_json, write_text
from classify.engine.optim import build_optimizer, optimizer_step
from classify.engine.runfolder import CONFIG, FORMAT_VERSION, TOKENIZER, WEIGHTS
from classify.backends import TorchBackend
from classify.inference import KIND, LoadedRun, classify_texts, load_run
from classify.models import Classifier, ClassifierConfig
from classify.text.batching import BucketBatchSampler, pad_batch
from classify.text.data import LABEL_NAMES, load_split, normalize
from classify.text.tokenize import encode, train_tokenizer, truncate

from . import add_results_args, results_folder
from .bench_seq2seq import FULL_SEQ2SEQ, QUICK_SEQ2SEQ, Seq2SeqSizes, seq2seq_section
from .benchtools import (ROOT, PeakMemory, interleave, load_average, machine_info, matmul_probe, paired_ratio,
                         peak_matmul_flops, percentile, summarize, time_call)

# The transformer timed against torch.nn: classify.train's width (--d-model 128 --num-heads 4 --d-ff 512 --dropout
# 0.1, batch 32, vocab 30000) with two blocks and dropout on the attention weights, as every recorded bench ran;
# classify.train's own model has three blocks and --attention-dropout 0 (attn_dropout_lengths times ours without it).
DEFAULT_MODEL = {"d_model": 128, "num_heads": 4, "num_layers": 2, "d_ff": 512, "dropout": 0.1}
BIG_MODEL = {"d_model": 256, "num_heads": 4, "num_layers": 6, "d_ff": 1024, "dropout": 0.1}
EPOCH_REVIEWS = 22_500  # IMDB's 25,000 training reviews minus classify.train's 2,500 validation reviews
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    """Everything --quick changes: sample sizes, repeats, which extra arms run."""

    train_sample: int                   # training reviews tokenized; training batches are drawn from them
    test_sample: int                    # test reviews pushed through each inference pipeline per call
    repeats: int                        # timed rounds per comparison (medians are over these)
    train_batches: int                  # training batches per timed call
    big_lengths: tuple[int, ...]        # max lengths for BIG_MODEL (empty: skip it); one batch per call
    big_repeats: int                    # timed rounds for BIG_MODEL (a step costs ~10x the default's)
    attn_dropout_lengths: tuple[int, ...]  # max lengths that also time ours without attention dropout
    epoch_steps: int                    # sampled steps per pipeline for the epoch estimate
    epoch_fp32_bucketed: bool           # also time bucketing without bf16 (splits the two gains)
    infer_precisions: tuple[str, ...]
    infer_repeats: int                  # timed rounds of the inference pipelines
    latency_reviews: int
    load_repeats: int
    scaling_lengths: tuple[int, ...]    # at batch size scaling_batch
    scaling_batches: tuple[int, ...]    # at length scaling_length
    scaling_repeats: int                # timed steps per point (after one untimed step that measures memory)
    seq2seq: Seq2SeqSizes
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))
    lengths: tuple[int, ...] = (128, 256, 512)
    batch_size: int = 32
    infer_batch_size: int = 64          # classify_texts' default
    vocab_size: int = 30_000
    matmul_size: int = 2048
    scaling_batch: int = 16
    scaling_length: int = 256


QUICK = Sizes(train_sample=2000, test_sample=96, repeats=3, train_batches=1, big_lengths=(), big_repeats=0,
              attn_dropout_lengths=(512,), epoch_steps=2, epoch_fp32_bucketed=False, infer_precisions=("bf16",),
              infer_repeats=3,
              latency_reviews=20, load_repeats=3, scaling_lengths=(128, 512), scaling_batches=(8, 32),
              scaling_repeats=1, seq2seq=QUICK_SEQ2SEQ)
FULL = Sizes(train_sample=5000, test_sample=192, repeats=5, train_batches=2, big_lengths=(256,), big_repeats=3,
             attn_dropout_lengths=(256, 512), epoch_steps=8, epoch_fp32_bucketed=True,
             infer_precisions=("fp32", "bf16"), infer_repeats=3, latency_reviews=100, load_repeats=5,
             scaling_lengths=(64, 128, 256, 512, 1024), scaling_batches=(8, 16, 32, 64, 128), scaling_repeats=2,
             seq2seq=FULL_SEQ2SEQ)


# ----------------------------------------------------------------------------- data
@dataclass
class Data:
    """A seeded sample of real reviews, tokenized once (tokenizing inference input is timed, not done here)."""

    tokenizer: Tokenizer
    train_ids: list[list[int]]    # untruncated word ids of the training sample
    train_labels: list[int]
    test_texts: list[str]         # raw test reviews, HTML and all: inference starts from these

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def prepare_data(source: str, sizes: Sizes, seed: int) -> Data:
    """Load both splits, sample them, train a throwaway word tokenizer (weights and vocabulary quality
    do not matter for speed; the review lengths, which do, are the real ones)."""
    train, test = load_split(source, "train"), load_split(source, "test")
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(train), min(sizes.train_sample, len(train)), replace=False)
    texts = [normalize(train.texts[i]) for i in pick]
    # min_frequency=1 so that a few thousand reviews give a vocabulary near the training default.
    tokenizer = train_tokenizer(texts, sizes.vocab_size, "word", min_frequency=1)
    test_pick = rng.choice(len(test), min(sizes.test_sample, len(test)), replace=False)
    return Data(tokenizer, encode(tokenizer, texts, max_len=10**9), [train.labels[i] for i in pick],
                [test.texts[i] for i in test_pick])


@dataclass
class Batch:
    """A padded training batch already on the device."""

    tokens: Tensor   # (B, T)
    labels: Tensor   # (B,)
    lengths: list[int]

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)


def make_batch(ids: Sequence[list[int]], labels: Sequence[int], device: torch.device, pad_id: int = 0,
               pad_to: int | None = None) -> Batch:
    """Right-pad like training does; ``pad_to`` pads further to a fixed width (the naive pipeline)."""
    tokens = pad_batch(ids, pad_id)
    if pad_to is not None:
        tokens = F.pad(tokens, (0, pad_to - tokens.shape[1]), value=pad_id)
    return Batch(to_device(tokens, device), to_device(torch.tensor(list(labels)), device), [len(x) for x in ids])


def bucketed_batches(data: Data, max_len: int, batch_size: int, seed: int, device: torch.device) -> list[Batch]:
    """Every batch of an epoch over the sample, cut exactly as classify.train cuts them."""
    ids = [truncate(x, max_len) for x in data.train_ids]
    sampler = BucketBatchSampler([len(x) for x in ids], batch_size=batch_size, seed=seed)
    return [make_batch([ids[i] for i in b], [data.train_labels[i] for i in b], device) for b in sampler.batches()]


# --------------------------------------------------------------------------- models
class TorchEncoder(nn.Module):
    """``torch.nn.TransformerEncoder`` behind classify's ``Encoder`` interface, so a ``Classifier`` with
    this encoder shares our embedding, masked pooling and head and differs only in the blocks."""

    def __init__(self, config: ClassifierConfig):
        super().__init__()
        layer = nn.TransformerEncoderLayer(config.d_model, config.num_heads, config.d_ff, config.dropout,
                                           activation=config.activation, batch_first=True,
                                           norm_first=config.norm_first)
        final_norm = nn.LayerNorm(config.d_model) if config.norm_first else None
        # torch only builds nested tensors for post-LN layers (and warns if asked to for pre-LN ones).
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, norm=final_norm,
                                             enable_nested_tensor=not config.norm_first)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, T, D), mask (B, 1, 1, T) True = real token -> (B, T, D)."""
        out = self.encoder(x, src_key_padding_mask=None if mask is None else ~mask[:, 0, 0, :])
        if out.is_nested:  # the inference fast path dropped the padding; pooling wants (B, T, D) back
            out = out.to_padded_tensor(0.0, x.shape)
        return out


def torch_classifier(config: ClassifierConfig) -> Classifier:
    """Our Classifier with its encoder swapped for torch.nn's (same sizes, activation, pre/post-LN)."""
    model = Classifier(config)
    model.encoder = TorchEncoder(config)
    return model


def copy_encoder_weights(ours: Encoder, theirs: TorchEncoder) -> None:
    """Copy our encoder's weights into the torch.nn one (same layout: packed in_proj, out_proj)."""
    state = {}
    for name, value in ours.state_dict().items():
        name = (name.replace("self_attn.in_proj.weight", "self_attn.in_proj_weight")
                .replace("self_attn.in_proj.bias", "self_attn.in_proj_bias")
                .replace("feed_forward.", "").replace("attn_residual.norm", "norm1")
                .replace("ff_residual.norm", "norm2"))
        state[name] = value
    theirs.encoder.load_state_dict(state)


def without_attention_dropout(model: nn.Module) -> nn.Module:
    """Turn off dropout on the attention weights only (residual/FFN/embedding dropout stay): with it on,
    F.scaled_dot_product_attention cannot use its fused CPU kernel and materialises the T x T weights."""
    for module in model.modules():
        if isinstance(module, (MultiHeadAttention, nn.MultiheadAttention)):
            module.dropout = 0.0
    return model


def with_torch_dropout(model: nn.Module) -> nn.Module:
    """Our model with PyTorch's dropout kernel (``nn.Dropout``: a double drawn per element on a CPU) in place of
    ``classify.core.Dropout`` (16 random bits per element): what the core's own dropout saves."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Dropout):
                setattr(module, name, nn.Dropout(child.p))
    return model


def classifier_config(sizes: Sizes, vocab_size: int, model: dict[str, Any] | None = None,
                      **overrides: Any) -> ClassifierConfig:
    """The benchmark's classifier: ``model`` sizes (default: classify.train's), positions for the longest length."""
    return ClassifierConfig(**{"vocab_size": vocab_size, "max_len": max(sizes.lengths), **(model or sizes.model),
                               **overrides})


def non_embedding_params(model: nn.Module) -> int:
    """Parameters that do a multiply-add per token (everything but the token and position tables)."""
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))


def training_flops(config: ClassifierConfig, n_params: int, shapes: Sequence[tuple[int, int]]) -> float:
    """FLOPs of forward + backward over batches of shape (B, T), padding included:
    6 * N * B*T for the weight matmuls (2 forward, 4 backward per parameter and token) plus
    12 * L * T * d per token for attention (QK^T and AV: 4*T*d forward per layer, x3 with backward)."""
    layers, d = config.num_layers, config.d_model
    return sum(6.0 * n_params * b * t + 12.0 * layers * d * b * t * t for b, t in shapes)


class Trainer:
    """Optimizer steps on one model exactly as classify.train takes them (autocast, fp32 loss, AdamW
    with its default decay groups, gradient clipping at 1.0)."""

    def __init__(self, model: Classifier, device: torch.device, dtype: torch.dtype | None):
        self.model = model.to(device).train()
        self.device, self.dtype = device, dtype
        self.optimizer = build_optimizer(self.model, lr=1e-3, weight_decay=0.1)
        self.scaler = grad_scaler(device, dtype)

    def step(self, batch: Batch) -> int:
        """One training step; returns the real (non-pad) tokens it trained on."""
        with autocast(self.device, self.dtype):
            loss = F.cross_entropy(self.model(batch.tokens).float(), batch.labels)
        optimizer_step(loss, self.model, self.optimizer, self.scaler, clip=1.0)
        return batch.real_tokens

    def steps(self, batches: Sequence[Batch]) -> float:
        return float(sum(self.step(b) for b in batches))


# ------------------------------------------------------------------------- sections
@dataclass
class Context:
    """What every section gets: where to run, how much, on which data."""

    device: torch.device
    sizes: Sizes
    data: Data
    seed: int
    precisions: tuple[str, ...]  # of fp32/bf16, those this device runs
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True)

    def dtype(self, precision: str) -> torch.dtype | None:
        return autocast_dtype(self.device, precision)


def peak_matmul(ctx: Context) -> dict[str, dict[str, float]]:
    return {p: peak_matmul_flops(ctx.device, DTYPES[p], ctx.sizes.matmul_size) for p in ctx.precisions}


def stratified(batches: Sequence[Batch], n: int) -> list[Batch]:
    """``n`` batches at evenly spaced quantiles of padded size (the median one for ``n`` = 1): their
    mean step time estimates the epoch's far better than ``n`` random batches when widths range
    from 10 to 512 tokens."""
    ordered = sorted(batches, key=lambda b: b.tokens.numel())
    picked = [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / n))] for i in range(n)]
    return [picked[i] for i in np.random.default_rng(0).permutation(n)]


def training_section(ctx: Context) -> list[dict[str, Any]]:
    """Ours vs torch.nn, both precisions, one interleaved group per (model size, max length)."""
    sizes, entries = ctx.sizes, []
    plans = [("default", sizes.model, sizes.lengths, sizes.train_batches, sizes.repeats)]
    if sizes.big_lengths:
        plans.append(("big", BIG_MODEL, sizes.big_lengths, 1, sizes.big_repeats))
    for label, spec, lengths, per_call, repeats in plans:
        config = classifier_config(sizes, ctx.data.vocab_size, spec)
        trainers: dict[str, Trainer] = {}
        for precision in ctx.precisions:
            torch.manual_seed(ctx.seed)
            trainers[f"ours_{precision}"] = Trainer(Classifier(config), ctx.device, ctx.dtype(precision))
            trainers[f"torch_{precision}"] = Trainer(torch_classifier(config), ctx.device, ctx.dtype(precision))
            if label == "default":
                torch.manual_seed(ctx.seed)
                trainers[f"ours-torch-dropout_{precision}"] = Trainer(with_torch_dropout(Classifier(config)),
                                                                      ctx.device, ctx.dtype(precision))
            if label == "default" and any(n in sizes.attn_dropout_lengths for n in lengths):
                model = without_attention_dropout(Classifier(config))
                trainers[f"ours-no-attn-dropout_{precision}"] = Trainer(model, ctx.device, ctx.dtype(precision))
        n_params = non_embedding_params(next(iter(trainers.values())).model)
        # A square matmul per precision runs in every round too: MFU compares each round's training
        # FLOP/s with the matmul FLOP/s of the same round, so load on the shared machine cancels.
        probes = {p: matmul_probe(ctx.device, DTYPES[p], sizes.matmul_size) for p in ctx.precisions}
        warmed: set[str] = set()
        for max_len in lengths:
            # Batches at spread-out quantiles of size, not the first few: those could all be long ones.
            batches = stratified(bucketed_batches(ctx.data, max_len, sizes.batch_size, ctx.seed, ctx.device), per_call)
            names = [n for n in trainers if "no-attn" not in n or max_len in sizes.attn_dropout_lengths]
            ctx.log(f"training: {label} model, max_len {max_len}, arms {', '.join(names)}")
            arms = {n: (lambda t=trainers[n]: t.steps(batches)) for n in names}
            arms.update({f"matmul_{p}": probe for p, probe in probes.items()})
            # Each arm warms up once, in its first group (allocations, AdamW state, library init); later
            # groups' first rounds pay at most for new shapes, which the median over rounds absorbs.
            for name in set(names) - warmed:
                arms[name]()
            warmed.update(names)
            samples = interleave(arms, repeats, ctx.device, warmup=0)
            all_stats = summarize(samples)
            stats_by_arm = {n: all_stats[n] for n in names}
            flops = training_flops(config, n_params, [tuple(b.tokens.shape) for b in batches])
            useful = training_flops(config, n_params, [(1, n) for b in batches for n in b.lengths])
            for name, stats in stats_by_arm.items():
                peak = samples[f"matmul_{name.rsplit('_', 1)[1]}"]
                stats["flops_per_s"] = flops / stats["seconds_median"]
                stats["mfu"] = statistics.median(flops / s.seconds / m.rate for s, m in zip(samples[name], peak))
                stats["useful_mfu"] = statistics.median(useful / s.seconds / m.rate
                                                        for s, m in zip(samples[name], peak))
            ratios = {}
            for p in ctx.precisions:
                ratios[f"ours/torch {p}"] = paired_ratio(samples[f"ours_{p}"], samples[f"torch_{p}"])
                if f"ours-torch-dropout_{p}" in samples:
                    ratios[f"our dropout/F.dropout {p}"] = paired_ratio(samples[f"ours_{p}"],
                                                                        samples[f"ours-torch-dropout_{p}"])
                if f"ours-no-attn-dropout_{p}" in samples:
                    ratios[f"no-attn-dropout/ours {p}"] = paired_ratio(samples[f"ours-no-attn-dropout_{p}"],
                                                                       samples[f"ours_{p}"])
            if {"fp32", "bf16"} <= set(ctx.precisions):
                for side in ("ours", "torch"):
                    ratios[f"bf16/fp32 {side}"] = paired_ratio(samples[f"{side}_bf16"], samples[f"{side}_fp32"])
            entries.append({"model": label, "config": {**spec, "vocab_size": config.vocab_size},
                            "non_embedding_params": n_params, "max_len": max_len,
                            "batches": [list(b.tokens.shape) for b in batches],
                            "padding_fraction": 1 - sum(b.real_tokens for b in batches)
                            / sum(b.tokens.numel() for b in batches),
                            "arms": stats_by_arm, "ratios": ratios,
                            "matmul_flops_per_s": {p: all_stats[f"matmul_{p}"]["rate_median"] for p in ctx.precisions},
                            "loadavg": load_average()})
    return entries


def epoch_section(ctx: Context) -> dict[str, Any]:
    """Our pipeline (bucketing + bf16) against the naive one (pad to 512, fp32, random batches),
    same model and optimizer, extrapolated to one epoch from sampled steps."""
    sizes, max_len = ctx.sizes, max(ctx.sizes.lengths)
    config = classifier_config(ctx.sizes, ctx.data.vocab_size)
    bucketed = stratified(bucketed_batches(ctx.data, max_len, sizes.batch_size, ctx.seed, ctx.device),
                          sizes.epoch_steps)
    rng = np.random.default_rng(ctx.seed)
    ids = [truncate(x, max_len) for x in ctx.data.train_ids]
    naive = []
    for _ in range(sizes.epoch_steps):
        rows = rng.choice(len(ids), sizes.batch_size, replace=False)
        naive.append(make_batch([ids[i] for i in rows], [ctx.data.train_labels[i] for i in rows], ctx.device,
                                pad_to=max_len))
    fast = "bf16" if "bf16" in ctx.precisions else "fp32"
    pipelines = {f"bucketed_{fast}": (bucketed, fast), "padded512_fp32": (naive, "fp32")}
    if sizes.epoch_fp32_bucketed and fast != "fp32":
        pipelines["bucketed_fp32"] = (bucketed, "fp32")
    arms = {}
    for name, (batches, precision) in pipelines.items():
        torch.manual_seed(ctx.seed)
        trainer, cycle = Trainer(Classifier(config), ctx.device, ctx.dtype(precision)), itertools.cycle(batches)
        arms[name] = lambda t=trainer, c=cycle: float(t.step(next(c)))
    ctx.log(f"epoch: {sizes.epoch_steps} sampled steps each of {', '.join(arms)}")
    # A GPU pays once for each new batch shape (choosing and loading kernels), which a real epoch's thousands of
    # steps amortise and two sampled steps would not: there every sampled batch is run once untimed first.
    warmup = sizes.epoch_steps if ctx.device.type == "cuda" else 1   # the CPU: warmup + n steps cover each batch once
    samples = interleave(arms, sizes.epoch_steps, ctx.device, warmup)
    steps_per_epoch = len(BucketBatchSampler([1] * EPOCH_REVIEWS, batch_size=sizes.batch_size))
    result: dict[str, Any] = {"steps_measured": sizes.epoch_steps, "steps_per_epoch": steps_per_epoch,
                              "epoch_reviews": EPOCH_REVIEWS, "pipelines": {}}
    for name, runs in samples.items():
        mean_step = float(np.mean([s.seconds for s in runs]))
        result["pipelines"][name] = {"mean_step_s": mean_step, "epoch_minutes": mean_step * steps_per_epoch / 60,
                                     "tokens_per_step": float(np.mean([b.tokens.numel() for b in pipelines[name][0]]))}
    minutes = {n: p["epoch_minutes"] for n, p in result["pipelines"].items()}
    result["speedup"] = {n: minutes[n] / minutes[f"bucketed_{fast}"] for n in minutes if n != f"bucketed_{fast}"}
    result["loadavg"] = load_average()
    return result


def write_throwaway_run(folder: Path, config: ClassifierConfig, tokenizer: Tokenizer) -> Path:
    """A run folder as classify.train writes it, holding an untrained model (speed does not depend on weights)."""
    tokenizer.save(str(folder / TOKENIZER))
    write_json(folder / CONFIG, {"format_version": FORMAT_VERSION, "kind": KIND, "model": config.to_dict(),
                                 "train": {"truncation": "head+tail"}, "labels": list(LABEL_NAMES)})
    save_tensors(folder / WEIGHTS, model_state(Classifier(config)))
    return folder


@torch.inference_mode()
def classify_batches(model: Classifier, ids: list[list[int]], batches: Sequence[Sequence[int]], device: torch.device,
                     dtype: torch.dtype | None, pad_to: int | None = None) -> np.ndarray:
    """Labels for ``ids`` in input order, running the given batches (index lists); ``pad_to`` pads each batch
    to a fixed width. Mirrors classify.backends.batched_logits for the pipelines that are not ours."""
    labels = np.zeros(len(ids), dtype=np.int64)
    for indices in batches:
        tokens = pad_batch([ids[i] for i in indices], model.config.pad_id)
        if pad_to is not None:
            tokens = F.pad(tokens, (0, pad_to - tokens.shape[1]), value=model.config.pad_id)
        with autocast(device, dtype):
            logits = model(to_device(tokens, device))
        labels[list(indices)] = logits.float().argmax(dim=-1).cpu().numpy()
    return labels


def on_dtype(run: LoadedRun, device: torch.device, dtype: torch.dtype | None) -> LoadedRun:
    """``run`` with its PyTorch model under autocast to ``dtype`` (None: fp32)."""
    return dataclasses.replace(run, backend=TorchBackend(run.model, device, dtype))


def fast_path_ops(model: nn.Module, tokens: Tensor) -> dict[str, bool]:
    """Which torch.nn inference fast paths one forward actually took (from the profiler's op names)."""
    with torch.inference_mode(), torch.profiler.profile() as prof:
        model(tokens)
    names = {event.name for event in prof.events()}
    return {"fused_encoder_layer": "aten::_transformer_encoder_layer_fwd" in names,
            "nested_tensor": "aten::_nested_tensor_from_mask" in names}


def inference_section(ctx: Context) -> dict[str, Any]:
    """Raw test reviews -> labels (normalise, tokenize, batch, forward), four pipelines interleaved:

    * ``ours``: classify.inference.classify_texts (length-bucketed batches of 64, autocast);
    * ``torch-fastpath``: the same encoding and batches through nn.TransformerEncoder in inference mode;
      pre-LN layers take the fused-layer fast path but not nested tensors (torch disables those for
      norm_first), so
    * ``torch-nested``: its post-LN twin on padded-to-512, unbucketed batches, where nested tensors
      drop the padding: what the fast path recovers of the naive pipeline;
    * ``naive``: our model, every review padded to 512, random order, no bucketing.

    autocast turns torch.nn's fast path off, so at bf16 its models run cast to bf16 instead.
    """
    sizes, device, texts = ctx.sizes, ctx.device, ctx.data.test_texts
    max_len = max(sizes.lengths)
    config = classifier_config(sizes, ctx.data.vocab_size)
    precisions = [p for p in sizes.infer_precisions if p in ctx.precisions]
    skipped = [p for p in sizes.infer_precisions if p not in precisions]
    if not precisions:  # e.g. --quick asks for bf16 alone on a CPU without it: measure fp32 rather than nothing
        precisions = ["fp32"]
    with tempfile.TemporaryDirectory(prefix="bench-run-") as folder:
        run = load_run(write_throwaway_run(Path(folder), config, ctx.data.tokenizer), device)
    order = np.random.default_rng(ctx.seed).permutation(len(texts))
    naive_batches = [order[i : i + sizes.infer_batch_size] for i in range(0, len(texts), sizes.infer_batch_size)]
    post_ln = dataclasses.replace(config, norm_first=False)

    def ours(dtype: torch.dtype | None) -> float:
        return float(len(classify_texts(on_dtype(run, device, dtype), texts, sizes.infer_batch_size)))

    def theirs(model: Classifier, naive: bool, dtype: torch.dtype | None) -> float:
        ids = run.preprocessing.ids(texts)
        if naive:
            batches, pad_to = naive_batches, max_len
        else:  # exactly classify_texts' batches
            batches, pad_to = BucketBatchSampler([len(x) for x in ids], sizes.infer_batch_size, shuffle=False), None
        return float(len(classify_batches(model, ids, batches, device, dtype, pad_to)))

    arms: dict[str, Callable[[], float]] = {}
    fast_paths = {}
    for p in precisions:
        dtype = ctx.dtype(p)
        # torch.nn's fast path refuses autocast: at bf16 its models get bf16 weights instead.
        weights = dtype or torch.float32
        pre = torch_classifier(config).to(device, weights).eval()
        post = torch_classifier(post_ln).to(device, weights).eval()
        probe = make_batch([[5] * 40, [5] * 20], [0, 0], device, pad_to=max_len).tokens
        fast_paths[p] = {"torch-fastpath": fast_path_ops(pre, probe), "torch-nested": fast_path_ops(post, probe)}
        arms[f"ours_{p}"] = lambda d=dtype: ours(d)
        arms[f"torch-fastpath_{p}"] = lambda m=pre: theirs(m, False, None)
        arms[f"torch-nested_{p}"] = lambda m=post: theirs(m, True, None)
        arms[f"naive_{p}"] = lambda d=dtype: theirs(run.model, True, d)
    ctx.log(f"inference: {len(texts)} test reviews per call, arms {', '.join(arms)}")
    samples = interleave(arms, sizes.infer_repeats, device)
    ratios = {}
    for p in precisions:
        for other in ("torch-fastpath", "torch-nested", "naive"):
            ratios[f"ours/{other} {p}"] = paired_ratio(samples[f"ours_{p}"], samples[f"{other}_{p}"])
    if {"fp32", "bf16"} <= set(precisions):
        ratios["bf16/fp32 ours"] = paired_ratio(samples["ours_bf16"], samples["ours_fp32"])
    return {"reviews_per_call": len(texts), "batch_size": sizes.infer_batch_size, "precisions": precisions,
            "skipped_precisions": skipped, "arms": summarize(samples), "ratios": ratios,
            "fast_paths_taken": fast_paths, "loadavg": load_average()}


def latency_section(ctx: Context) -> dict[str, Any]:
    """Run-folder load time (load_run: config, tokenizer, safetensors weights) and one-review predict
    latency after load, at the precision ``auto`` picks here (what classify.predict uses by default)."""
    sizes, device = ctx.sizes, ctx.device
    config = classifier_config(sizes, ctx.data.vocab_size)
    dtype = autocast_dtype(device, "auto")
    with tempfile.TemporaryDirectory(prefix="bench-run-") as folder:
        write_throwaway_run(Path(folder), config, ctx.data.tokenizer)
        loads = []
        for _ in range(sizes.load_repeats):
            start = time.perf_counter()
            run = load_run(folder, device, dtype)
            loads.append(time.perf_counter() - start)
        texts = ctx.data.test_texts[: sizes.latency_reviews]
        for text in texts[:3]:  # warmup: first calls pay for kernel selection
            classify_texts(run, [text])
        latencies = []
        for text in texts:
            start = time.perf_counter()
            classify_texts(run, [text])
            latencies.append(time.perf_counter() - start)
    return {"precision": str(dtype) if dtype else "fp32", "load_s_first": loads[0],
            "load_s_median": float(np.median(loads)), "predict_reviews": len(latencies),
            "predict_ms_p50": 1e3 * percentile(latencies, 50), "predict_ms_p95": 1e3 * percentile(latencies, 95),
            "predict_ms_mean": 1e3 * float(np.mean(latencies))}


def scaling_section(ctx: Context) -> dict[str, Any]:
    """Training step time and peak memory of our model on full-length random tokens (no review is
    1024 words long, and padding would blur the shape), against length and against batch size."""
    sizes, device = ctx.sizes, ctx.device
    precision = "bf16" if "bf16" in ctx.precisions else "fp32"
    max_len = max(sizes.scaling_lengths + (sizes.scaling_length,))
    config = classifier_config(sizes, ctx.data.vocab_size, max_len=max_len)
    torch.manual_seed(ctx.seed)
    trainer = Trainer(Classifier(config), device, ctx.dtype(precision))
    generator = torch.Generator().manual_seed(ctx.seed)

    def batch(b: int, t: int) -> Batch:
        ids = torch.randint(5, config.vocab_size, (b, t), generator=generator).tolist()
        return make_batch(ids, [i % 2 for i in range(b)], device)

    trainer.step(batch(2, 8))  # allocates AdamW's state, which no point below should be charged for
    points = [(sizes.scaling_batch, t, True) for t in sizes.scaling_lengths]
    points += [(b, sizes.scaling_length, True) for b in sizes.scaling_batches
               if (b, sizes.scaling_length, True) not in points]
    # The longest sequences once more without attention dropout: the fused kernel's time and memory.
    points.append((sizes.scaling_batch, max(sizes.scaling_lengths), False))
    rows = []
    for b, t, attention_dropout in points:
        if not attention_dropout:
            without_attention_dropout(trainer.model)
        data = batch(b, t)
        with PeakMemory(device) as memory:  # also the warmup step for this shape
            trainer.step(data)
        step_s = float(np.median([time_call(lambda: trainer.step(data), device).seconds
                                  for _ in range(sizes.scaling_repeats)]))
        rows.append({"batch": b, "length": t, "attention_dropout": attention_dropout, "step_s": step_s,
                     "tokens_per_s": b * t / step_s,
                     "peak_mib": None if memory.bytes is None else memory.bytes / 2**20})
        ctx.log(f"scaling: batch {b} x length {t}: {rows[-1]['step_s']:.3f} s/step")
    return {"precision": precision, "memory_method": PeakMemory.method(device), "points": rows,
            "loadavg": load_average()}


def equivalence_check(ctx: Context) -> dict[str, Any]:
    """Our classifier and the torch.nn one give the same logits once weights are copied (eval, fp32):
    the throughput comparison is between two implementations of the same function."""
    config = classifier_config(ctx.sizes, ctx.data.vocab_size, dropout=0.0)
    torch.manual_seed(ctx.seed)
    ours, theirs = Classifier(config).eval(), torch_classifier(config).eval()
    theirs.embed.load_state_dict(ours.embed.state_dict())
    theirs.head.load_state_dict(ours.head.state_dict())
    copy_encoder_weights(ours.encoder, theirs.encoder)
    ids = [truncate(x, config.max_len) for x in ctx.data.train_ids[:4]]
    tokens = make_batch(ids, [0] * len(ids), torch.device("cpu")).tokens
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens)).abs().max().item()
    return {"max_abs_logit_diff_fp32": diff}


SECTIONS: dict[str, Callable[[Context], Any]] = {
    "equivalence": equivalence_check,
    "training": training_section,
    "epoch": epoch_section,
    "inference": inference_section,
    "latency": latency_section,
    "scaling": scaling_section,
    "seq2seq": lambda ctx: seq2seq_section(ctx.sizes.seq2seq, ctx.device, ctx.precisions, ctx.seed,
                                           ctx.sizes.repeats, ctx.sizes.infer_repeats, ctx.log),
}


def run(source: str, sizes: Sizes, device: torch.device, seed: int = 0,
        sections: Sequence[str] = tuple(SECTIONS), log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Prepare the data and run the chosen sections; returns everything as one JSON-able dict."""
    start = time.perf_counter()
    info = machine_info(device)
    data = prepare_data(source, sizes, seed)
    precisions = tuple(p for p in ("fp32", "bf16") if p == "fp32" or bf16_supported(device))
    ctx = Context(device, sizes, data, seed, precisions, **({"log": log} if log else {}))
    results: dict[str, Any] = {"machine": info, "sizes": dataclasses.asdict(sizes), "seed": seed, "source": source,
                               "vocab_size": data.vocab_size, "setup_s": time.perf_counter() - start}
    first = peak_matmul(ctx)
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            results[name] = SECTIONS[name](ctx)
            results.setdefault("section_s", {})[name] = time.perf_counter() - t0
    # Measured again at the end and the best kept: on a shared machine one moment may be a busy one.
    last = peak_matmul(ctx)
    results["peak_matmul"] = {p: {"size": first[p]["size"],
                                  "peak_flops": max(first[p]["peak_flops"], last[p]["peak_flops"]),
                                  "median_flops_start": first[p]["median_flops"],
                                  "median_flops_end": last[p]["median_flops"]} for p in first}
    results["machine"]["loadavg_at_end"] = load_average()
    results["total_s"] = time.perf_counter() - start
    return results


# --------------------------------------------------------------------------- report
def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def to_markdown(results: dict[str, Any], command: str) -> str:
    """The human-readable report: command, machine, then one table per section."""
    m, sizes = results["machine"], results["sizes"]
    rounds = f"{sizes['repeats']} per comparison, {sizes['infer_repeats']} for inference and generation"
    if sizes["big_lengths"]:
        rounds += f", {sizes['big_repeats']} for the big model"
    lines = [f"# classify speed benchmark{' (quick)' if 'quick' in command else ''}", "",
             f"Command: `{command}`  ", f"Date (UTC): {m['date_utc']}  ", f"Commit: {m['git_commit']}  ",
             f"Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs ({', '.join(m['cpu_flags'])}); "
             f"device {m['device']}  ",
             f"torch {m['torch']}, {m['torch_threads']} intra-op thread(s), "
             f"tokenizer threads {m['tokenizer_threads']}, "
             f"bf16 {'supported' if m['bf16_supported'] else 'not supported'}  ",
             f"Load average (1/5/15 min): {m['loadavg_at_start']} at start, {m['loadavg_at_end']} at end  ",
             f"Wall time: {results['total_s'] / 60:.1f} min; vocabulary {results['vocab_size']} (word-level, "
             f"trained on the training sample); seed {results['seed']}", "",
             "Method: contenders run interleaved (ABBA order) on identical inputs, each warmed up once "
             f"untimed; rates are medians over timed rounds ({rounds}); ratios are medians of per-round "
             "ratios (> 1: the first-named is faster).", ""]
    lines += ["## Peak matmul", "", "Square matmuls at the start and at the end of the run (the load on the "
              "shared machine changes: MFU below uses a matmul timed in the same rounds instead).", "",
              "| precision | size | best GFLOP/s | median at start | median at end |", "|---|---|---|---|---|"]
    lines += [f"| {p} | {r['size']} | {r['peak_flops'] / 1e9:,.1f} | {r['median_flops_start'] / 1e9:,.1f} | "
              f"{r['median_flops_end'] / 1e9:,.1f} |" for p, r in results["peak_matmul"].items()]
    lines.append("")
    if "equivalence" in results:
        lines += [f"Equivalence: with copied weights our classifier and the torch.nn one differ by at most "
                  f"{results['equivalence']['max_abs_logit_diff_fp32']:.1e} in fp32 logits.", ""]
    if "training" in results:
        lines += ["## Training throughput (forward + backward + AdamW)", "",
                  f"Real (non-pad) tokens/s on bucketed batches of real reviews (batch {sizes['batch_size']}, "
                  "cut as classify.train cuts them; those at evenly spaced quantiles of width). MFU = model "
                  "FLOPs (6·N·B·T + 12·L·d·B·T², N = non-embedding parameters, padding included) / time / "
                  f"FLOP/s of a {results['peak_matmul']['fp32']['size']}² matmul of that precision timed in the same "
                  "rounds (median over rounds); useful MFU counts each review at its own length.", ""]
        models = {e["model"]: (e["config"], e["non_embedding_params"]) for e in results["training"]}
        lines += [f"* {name}: `{json.dumps(config)}`, N = {n:,}" for name, (config, n) in models.items()]
        lines += ["",
                  "| model | max_len | batches (B×T) | padding | arm | tokens/s | MFU | useful MFU |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in results["training"]:
            shapes = ", ".join(f"{b}×{t}" for b, t in e["batches"])
            for name, a in e["arms"].items():
                lines.append(f"| {e['model']} | {e['max_len']} | {shapes} | {e['padding_fraction']:.0%} | {name} | "
                             f"{a['rate_median']:,.0f} | {_pct(a['mfu'])} | {_pct(a['useful_mfu'])} |")
        lines += ["", "| model | max_len | ratio | value |", "|---|---|---|---|"]
        for e in results["training"]:
            lines += [f"| {e['model']} | {e['max_len']} | {k} | {v:.2f} |" for k, v in e["ratios"].items()]
            lines += [f"| {e['model']} | {e['max_len']} | matmul GFLOP/s {p} (same rounds) | {v / 1e9:.1f} |"
                      for p, v in e["matmul_flops_per_s"].items()]
        lines.append("")
    if "epoch" in results:
        ep = results["epoch"]
        lines += ["## Epoch time", "",
                  f"Extrapolated: mean of {ep['steps_measured']} sampled steps x {ep['steps_per_epoch']} steps "
                  f"({ep['epoch_reviews']:,} reviews, batch {sizes['batch_size']}). Bucketed steps are "
                  "picked at evenly spaced quantiles of batch size; naive batches are random reviews padded to "
                  f"{max(sizes['lengths'])}.", "", "| pipeline | tokens/step (padded) | s/step | epoch (min) |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {p['tokens_per_step']:,.0f} | {p['mean_step_s']:.3f} | {p['epoch_minutes']:.1f} |"
                  for n, p in ep["pipelines"].items()]
        lines += [""] + [f"Our pipeline is {v:.2f}x faster per epoch than {n}.  " for n, v in ep["speedup"].items()]
        lines.append("")
    if "inference" in results:
        inf = results["inference"]
        lines += ["## Inference throughput (raw text -> labels)", "",
                  f"{inf['reviews_per_call']} real test reviews per call, batch {inf['batch_size']}, "
                  f"precision {', '.join(inf['precisions'])}"
                  + (f" ({', '.join(inf['skipped_precisions'])} not supported here)." if inf["skipped_precisions"]
                     else "."), "",
                  "| arm | reviews/s |", "|---|---|"]
        lines += [f"| {n} | {a['rate_median']:,.1f} |" for n, a in inf["arms"].items()]
        lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in inf["ratios"].items()]
        lines += ["", f"torch.nn fast paths taken: `{json.dumps(inf['fast_paths_taken'])}`", ""]
    if "latency" in results:
        lat = results["latency"]
        lines += ["## Load and single-review latency", "",
                  f"load_run: {lat['load_s_first'] * 1e3:.0f} ms first, {lat['load_s_median'] * 1e3:.0f} ms median. "
                  f"One review ({lat['precision']}), {lat['predict_reviews']} reviews: "
                  f"p50 {lat['predict_ms_p50']:.1f} ms, "
                  f"p95 {lat['predict_ms_p95']:.1f} ms, mean {lat['predict_ms_mean']:.1f} ms.", ""]
    if "scaling" in results:
        sc = results["scaling"]
        lines += ["## Scaling (ours, training step)", "",
                  f"Precision {sc['precision']}; random full-length tokens; memory: {sc['memory_method']}.", "",
                  "| batch | length | attention dropout | s/step | tokens/s | peak MiB |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['batch']} | {p['length']} | {'on' if p['attention_dropout'] else 'off'} | {p['step_s']:.3f} | "
                  f"{p['tokens_per_s']:,.0f} | {_fmt(p['peak_mib'], 0)} |" for p in sc["points"]]
        lines.append("")
    if "seq2seq" in results:
        s2s = results["seq2seq"]
        lines += ["## Encoder-decoder", "", f"Model: `{json.dumps(s2s['config'])}`; {s2s['data']}", "",
                  "| arm | tokens/s |", "|---|---|"]
        lines += [f"| train {n} | {a['rate_median']:,.0f} |" for n, a in s2s["training"]["arms"].items()]
        lines += [f"| generate {n} | {a['rate_median']:,.1f} |" for n, a in s2s["generation"]["arms"].items()]
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in {**s2s["training"]["ratios"], **s2s["generation"]["ratios"]}.items()]
        lines.append("")
    return "\n".join(lines)


def headline(results: dict[str, Any]) -> list[str]:
    """The ratios worth printing at the end of a run."""
    out = []
    for e in results.get("training", []):
        out.append(f"training {e['model']} max_len {e['max_len']}: " +
                   ", ".join(f"{k} {v:.2f}" for k, v in e["ratios"].items()))
    if "epoch" in results:
        out.append("epoch: " + ", ".join(f"ours is {v:.2f}x faster than {k}"
                                         for k, v in results["epoch"]["speedup"].items()))
    if "inference" in results:
        out.append("inference: " + ", ".join(f"{k} {v:.2f}" for k, v in results["inference"]["ratios"].items()))
    if "seq2seq" in results:
        s2s = results["seq2seq"]
        out.append("seq2seq: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                          {**s2s["training"]["ratios"], **s2s["generation"]["ratios"]}.items()))
    return out


# ------------------------------------------------------------------------------ CLI
def default_data() -> str:
    """$CLASSIFY_DATA, else the shared IMDB parquet folder beside the checkout."""
    return os.environ.get("CLASSIFY_DATA") or str(ROOT.parent / "shared" / "imdb")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small samples and few repeats (under two minutes)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (and tokenizer threads); 1 keeps a shared machine's other "
                        "jobs from distorting the result")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto")
    p.add_argument("--data", default=default_data(), help="IMDB source, as classify.train's --data")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="what to run")
    add_results_args(p, "bench.json and .md (bench_quick.* with --quick)")
    p.add_argument("--seed", type=int, default=0, help="sampling and initialisation seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        raise SystemExit("--threads must be at least 1")
    # torch.nn's construction-time and nested-tensor notices: known, and noise in a report.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    # Before the tokenizer's first parallel call: its Rust thread pool reads this once.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    command = "python -m experiments.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = run(args.data, QUICK if args.quick else FULL, resolve_device(args.device), args.seed, args.sections)
    results["command"] = command.strip()
    stem = results_folder(args) / ("bench_quick" if args.quick else "bench")
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_json(stem.with_suffix(".json"), results)
    report = to_markdown(results, results["command"])
    write_text(stem.with_suffix(".md"), report + "\n")
    print(report)
    print("\n".join(["", "Headline ratios (> 1: ours faster):", *headline(results),
                     f"total {results['total_s']:.0f} s; wrote {stem.with_suffix('.json')} and .md"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
