"""Masked-language-model pretraining pieces: BERT-style masking and the MLM model.

``MaskedLM`` owns the *same* ``embed`` and ``encoder`` modules a ``Classifier`` has (built by
constructing a Classifier and keeping those two), so its state dict names them exactly as the
classifier does (``embed.tokens.weight``, ``encoder.layers.0...``) and they load 1:1 for
fine-tuning. Only ``mlm_head.*`` is pretraining-specific.

Shapes: B batch, T time, D model width, V vocabulary, N number of prediction targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor, nn

from .core import padding_mask
from .models import Classifier, ClassifierConfig
from .text.tokenize import MASK, SPECIAL_TOKENS

IGNORE = -100  # target value of positions that are not predicted (F.cross_entropy's ignore_index)


class Masker:
    """Dynamic BERT masking (Devlin et al. 2019): each call draws fresh positions.

    Each non-special token becomes a prediction target with probability ``mask_prob``; a
    target's input is replaced by ``[MASK]`` 80% of the time, by a random non-special token
    10%, and left unchanged 10% (so the model cannot assume that unmasked inputs are
    correct). Special tokens ([PAD], [UNK], [CLS], [SEP], [MASK]) are never targets: padding
    carries nothing, and predicting [UNK] would teach nothing about words.
    """

    def __init__(self, tokenizer: Tokenizer, mask_prob: float = 0.15, mask_ratio: float = 0.8,
                 random_ratio: float = 0.1):
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask probability must be in (0, 1), got {mask_prob}")
        if mask_ratio < 0 or random_ratio < 0 or mask_ratio + random_ratio > 1.0:
            raise ValueError("mask_ratio + random_ratio must lie in [0, 1]")
        vocab_size = tokenizer.get_vocab_size()
        special = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        self.mask_id = tokenizer.token_to_id(MASK)
        if self.mask_id is None:
            raise ValueError(f"the tokenizer has no {MASK} token")
        self.special = torch.zeros(vocab_size, dtype=torch.bool)  # lookup table: id -> is special
        self.special[[i for i in special if i is not None]] = True
        self.ordinary = (~self.special).nonzero().squeeze(1)  # ids a random replacement may take
        if len(self.ordinary) == 0:
            raise ValueError("the tokenizer has no ordinary tokens to predict")
        self.mask_prob, self.mask_ratio, self.random_ratio = mask_prob, mask_ratio, random_ratio

    def __call__(self, tokens: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """tokens (B, T) on the CPU -> (inputs (B, T), targets (B, T)).

        ``targets`` holds the original id at prediction positions and ``IGNORE`` elsewhere.
        ``generator``: a private RNG (fixed masks for validation); None draws from torch's global RNG.
        """
        eligible = ~self.special[tokens]
        targeted = (torch.rand(tokens.shape, generator=generator) < self.mask_prob) & eligible
        action = torch.rand(tokens.shape, generator=generator)  # one draw decides mask / random / keep
        to_mask = targeted & (action < self.mask_ratio)
        to_random = targeted & (action >= self.mask_ratio) & (action < self.mask_ratio + self.random_ratio)
        inputs = tokens.masked_fill(to_mask, self.mask_id)
        picks = torch.randint(len(self.ordinary), (int(to_random.sum()),), generator=generator)
        inputs[to_random] = self.ordinary[picks]
        targets = tokens.masked_fill(~targeted, IGNORE)
        return inputs, targets


class MLMHead(nn.Module):
    """BERT's prediction head: dense -> GELU -> LayerNorm -> tied decoder + per-token bias.

    The decoder matrix is the token embedding itself (passed in at call time), so the head
    adds only D*D + 3D + V parameters and input and output vocabularies share one space.
    """

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        nn.init.xavier_uniform_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, hidden: Tensor, embedding: Tensor) -> Tensor:
        """hidden (N, D), embedding (V, D) -> logits (N, V)"""
        return F.linear(self.norm(F.gelu(self.dense(hidden))), embedding, self.bias)


class MaskedLM(nn.Module):
    """A Classifier's embedding + encoder with an MLM head on top.

    ``MaskedLM(config)`` takes a ``ClassifierConfig`` (``num_classes`` and ``pooling`` are unused
    here; fine-tuning picks its own head).
    """

    def __init__(self, config: ClassifierConfig):
        super().__init__()
        backbone = Classifier(config)  # same construction and initialisation as the fine-tuned model
        self.config = config
        self.embed = backbone.embed
        self.encoder = backbone.encoder
        self.mlm_head = MLMHead(config.d_model, config.vocab_size)

    def encode(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> contextual token vectors (B, T, D); exactly ``Classifier.encode``."""
        mask = padding_mask(tokens, self.config.pad_id) if self.config.mask_padding else None
        return self.encoder(self.embed(tokens), mask)

    def forward(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """inputs (B, T), targets (B, T) with IGNORE -> (logits (N, V), labels (N,)) at the N targets.

        The V-wide output projection runs only at the ~15% target positions: with a 30k
        vocabulary it would otherwise cost more than the whole encoder.
        """
        hidden = self.encode(inputs)
        where = targets != IGNORE
        return self.mlm_head(hidden[where], self.embed.tokens.weight), targets[where]


def mlm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the targets (zero, not NaN, when a batch happens to have none)."""
    return F.cross_entropy(logits.float(), labels, reduction="sum") / max(len(labels), 1)
