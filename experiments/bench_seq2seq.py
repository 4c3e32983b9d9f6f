"""The encoder-decoder section of ``python -m experiments.bench``.

Training: our ``Transformer`` against the same model with ``torch.nn.Transformer`` in the middle
(our embeddings and output layer around it, its usual masks: causal ``tgt_mask`` plus key padding
masks for source, target and memory), batched by token budget exactly as ``classify.seq2seq``
trains. Generation: greedy ``Transformer.generate`` with and without the key/value cache.

The sequences are synthetic (random ids with sentence-like lengths): speed depends on shapes,
not on which ids fill them, and this keeps the section free of a translation corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from classify.core import Embedding
from classify.engine.device import autocast, autocast_dtype, grad_scaler, to_device
from classify.engine.optim import build_optimizer, optimizer_step
from classify.generate import generate
from classify.models import Transformer, TransformerConfig
from classify.seq2seq.data import PairCollate, pair_lengths
from classify.seq2seq.metrics import summed_loss
from classify.text.batching import BucketBatchSampler

from .benchtools import interleave, paired_ratio, summarize

PAD, BOS = 0, 2  # classify's special-token ids ([PAD] = 0, then [UNK], [CLS] used as BOS here)
NO_EOS = -1      # an id no token has: every row decodes all max_new_tokens (an untrained model stops at random)


@dataclass(frozen=True)
class Seq2SeqSizes:
    """Model sizes default to ``python -m classify.seq2seq train``'s (tied embeddings included)."""

    train_batches: int                 # token-budget batches per timed call
    generate_tokens: int               # new tokens per generate() call
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 3                # encoder blocks, and decoder blocks
    d_ff: int = 512
    dropout: float = 0.1
    vocab_size: int = 8000
    max_len: int = 128
    max_tokens: int = 2048             # classify.seq2seq's --max-tokens
    label_smoothing: float = 0.1
    pairs: int = 2000                  # synthetic sentence pairs batches are drawn from
    generate_batch: int = 16
    source_len: int = 32               # source length for generation


# --quick: the classifier's default width and depth, half the token budget, short generations.
QUICK_SEQ2SEQ = Seq2SeqSizes(train_batches=1, generate_tokens=16, d_model=128, num_heads=4, num_layers=2,
                             max_tokens=1024, generate_batch=8)
FULL_SEQ2SEQ = Seq2SeqSizes(train_batches=2, generate_tokens=64)


def transformer_config(sizes: Seq2SeqSizes) -> TransformerConfig:
    return TransformerConfig(src_vocab_size=sizes.vocab_size, tgt_vocab_size=sizes.vocab_size, d_model=sizes.d_model,
                             num_heads=sizes.num_heads, num_encoder_layers=sizes.num_layers,
                             num_decoder_layers=sizes.num_layers, d_ff=sizes.d_ff, max_len=sizes.max_len,
                             dropout=sizes.dropout, tie_embeddings=True)


class TorchSeq2Seq(nn.Module):
    """Our embeddings and output layer around ``torch.nn.Transformer``: the same function as
    ``classify.models.Transformer`` with the same config, written the way torch.nn is used."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        c = self.config = config
        embed = (c.d_model, c.max_len, c.dropout, c.positional)
        self.src_embed = Embedding(c.src_vocab_size, *embed, padding_idx=c.pad_id)
        self.tgt_embed = Embedding(c.tgt_vocab_size, *embed, padding_idx=c.pad_id)
        self.transformer = nn.Transformer(c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff,
                                          c.dropout, activation=c.activation, batch_first=True,
                                          norm_first=c.norm_first)
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)
        if c.tie_embeddings:
            self.generator.weight = self.tgt_embed.tokens.weight

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """src (B, S), tgt (B, T) -> logits (B, T, V). torch.nn's masks: True = may NOT attend."""
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=torch.bool)
        src_pad, tgt_pad = src == self.config.pad_id, tgt == self.config.pad_id
        hidden = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=causal,
                                  src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                                  memory_key_padding_mask=src_pad)
        return self.generator(hidden)


def synthetic_pairs(sizes: Seq2SeqSizes, rng: np.random.Generator) -> tuple[list[list[int]], list[list[int]]]:
    """Sentence pairs of random ids, each ending in EOS like classify.seq2seq's encode_side: source
    lengths 5..60 (skewed short, like sentences), target lengths within +-30% of the source."""
    eos, low = 3, 5  # [SEP] as EOS; real ids start after the five specials
    src, tgt = [], []
    for _ in range(sizes.pairs):
        n = int(np.clip(rng.gamma(4.0, 5.0), 4, 59))
        m = int(np.clip(round(n * rng.uniform(0.7, 1.3)), 3, 59))
        src.append(rng.integers(low, sizes.vocab_size, n).tolist() + [eos])
        tgt.append(rng.integers(low, sizes.vocab_size, m).tolist() + [eos])
    return src, tgt


class Seq2SeqTrainer:
    """Steps as classify.seq2seq takes them: token-mean label-smoothed loss, AdamW, clip 1.0."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype | None, label_smoothing: float):
        self.model = model.to(device).train()
        self.device, self.dtype, self.label_smoothing = device, dtype, label_smoothing
        self.optimizer = build_optimizer(self.model, lr=1e-3, weight_decay=0.01)
        self.scaler = grad_scaler(device, dtype)

    def steps(self, batches: Sequence[dict[str, Tensor]]) -> float:
        """Train on ``batches``; returns the real source + target tokens processed."""
        tokens = 0
        for batch in batches:
            with autocast(self.device, self.dtype):
                loss, n = summed_loss(self.model, batch, PAD, self.label_smoothing)
            optimizer_step(loss / max(n, 1), self.model, self.optimizer, self.scaler, clip=1.0)
            tokens += n + int((batch["src"] != PAD).sum())
        return float(tokens)


def seq2seq_section(sizes: Seq2SeqSizes, device: torch.device, precisions: Sequence[str], seed: int,
                    train_repeats: int, generate_repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Training tokens/s (ours vs torch.nn, each precision) and generation tokens/s (cache on/off),
    medians over the given numbers of interleaved rounds."""
    config = transformer_config(sizes)
    rng = np.random.default_rng(seed)
    src, tgt = synthetic_pairs(sizes, rng)
    sampler = BucketBatchSampler(pair_lengths(src, tgt), max_tokens=sizes.max_tokens, seed=seed)
    collate = PairCollate(src, tgt, PAD, BOS)
    batches = [to_device(collate(b), device)
               for b in sampler.batches()[: sizes.train_batches]]

    arms: dict[str, Callable[[], float]] = {}
    for p in precisions:
        dtype = autocast_dtype(device, p)
        torch.manual_seed(seed)
        for name, model in (("ours", Transformer(config)), ("torch", TorchSeq2Seq(config))):
            trainer = Seq2SeqTrainer(model, device, dtype, sizes.label_smoothing)
            arms[f"{name}_{p}"] = lambda t=trainer: t.steps(batches)
    log(f"seq2seq training: {len(batches)} batch(es) per call, arms {', '.join(arms)}")
    train_samples = interleave(arms, train_repeats, device)
    train_ratios = {f"ours/torch train {p}": paired_ratio(train_samples[f"ours_{p}"], train_samples[f"torch_{p}"])
                    for p in precisions}

    torch.manual_seed(seed)
    model = Transformer(config).to(device).eval()
    source = torch.randint(5, sizes.vocab_size, (sizes.generate_batch, sizes.source_len),
                           generator=torch.Generator().manual_seed(seed))
    source = to_device(source, device)

    def generation(use_cache: bool, dtype: torch.dtype | None) -> float:
        with autocast(device, dtype):
            out = generate(model, source, sizes.generate_tokens, bos_id=BOS, eos_id=NO_EOS, use_cache=use_cache)
        return float(out.shape[0] * (out.shape[1] - 1))

    gen_arms = {f"{'cache' if c else 'no-cache'}_{p}": (lambda c=c, d=autocast_dtype(device, p): generation(c, d))
                for p in precisions for c in (True, False)}
    log(f"seq2seq generation: {sizes.generate_batch} x {sizes.generate_tokens} tokens, arms {', '.join(gen_arms)}")
    gen_samples = interleave(gen_arms, generate_repeats, device)
    gen_ratios = {f"cache/no-cache generate {p}": paired_ratio(gen_samples[f"cache_{p}"], gen_samples[f"no-cache_{p}"])
                  for p in precisions}
    return {"config": {k: v for k, v in asdict(config).items() if k in ("d_model", "num_heads", "num_encoder_layers",
                                                                        "num_decoder_layers", "d_ff", "tgt_vocab_size",
                                                                        "dropout", "tie_embeddings")},
            "data": (f"synthetic pairs, source lengths ~5..60; {len(batches)} batch(es) of <= {sizes.max_tokens} "
                     f"padded tokens per call; tokens/s counts real source + target tokens; generation: batch "
                     f"{sizes.generate_batch}, source length {sizes.source_len}, {sizes.generate_tokens} new tokens"),
            "training": {"arms": summarize(train_samples), "ratios": train_ratios},
            "generation": {"arms": summarize(gen_samples), "ratios": gen_ratios}}
