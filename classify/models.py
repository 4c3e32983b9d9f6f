"""The two models built on ``classify.core``.

``Classifier``  tokens (B, T) -> Embedding -> Encoder -> masked pooling -> Linear -> logits (B, C)
                [+ a hashed n-gram bag over the same tokens, mixed in with weights fitted on validation that
                depend on the text's length; with ``scope_embedding`` the embedding also marks the words the bag
                reads as negated]
``Transformer`` src (B, S), tgt (B, T) -> Encoder(src) = memory -> Decoder(tgt, memory) -> logits (B, T, V)

Both are constructible from keyword arguments or from a config dataclass that
round-trips through JSON (``to_dict`` / ``from_dict``); checkpoints store the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .core import (POSITIONAL, Decoder, Embedding, Encoder, KVCache, MultiHeadAttention, causal_mask,
                   combine_masks, padding_mask, rotary_positions)
from .mix import mix_features
from .ngrams import DEFAULT_BUCKETS, NgramBag

__all__ = ["ClassifierConfig", "Classifier", "BranchLogits", "RECIPE", "TransformerConfig", "Transformer"]


# How the classifier turns its token vectors into one: their mean, their maximum, the first one, or a weighted mean
# whose weights a learned query gives (``Classifier.pool``).
POOLINGS = ("mean", "max", "first", "attention")

# Fields of either config that count something and must be positive.
_SIZES = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "num_classes", "d_model", "num_heads", "num_layers",
          "num_encoder_layers", "num_decoder_layers", "d_ff", "max_len")


class _Config:
    """JSON round-trip for the config dataclasses; unknown keys are an error, not silently dropped."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def given(cls, config: "_Config | None", kwargs: dict[str, Any]):
        """The config a model was built with: ``config`` itself, or one made from keyword
        arguments (not both), validated."""
        if config is None:
            config = cls(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either a {cls.__name__} or keyword arguments, not both")
        config.validate()
        return config

    def validate(self) -> None:
        for name in _SIZES:
            value = getattr(self, name, 1)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        d, h = self.d_model, self.num_heads  # type: ignore[attr-defined]
        if d % h:
            raise ValueError(f"d_model ({d}) must be a multiple of num_heads ({h})")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        positional = self.positional  # type: ignore[attr-defined]
        if positional not in POSITIONAL:
            raise ValueError(f"positional must be one of {tuple(POSITIONAL)}, got {positional!r}")


def _init_weights(module: nn.Module) -> None:
    """Xavier-uniform matrices (as the Annotated Transformer and nn.Transformer do), zero biases."""
    for name, p in module.named_parameters():
        if p.dim() > 1 and "positions" not in name:
            nn.init.xavier_uniform_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


# ---------------------------------------------------------------------- classifier
@dataclass
class ClassifierConfig(_Config):
    vocab_size: int
    num_classes: int = 2
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 512
    max_len: int = 512
    dropout: float = 0.1
    pad_id: int = 0
    pooling: str = "mean"          # "mean" | "max" | "first" | "attention" (over real tokens only)
    positional: str = "learned"    # Bloem's; "sinusoidal" (Vaswani), "rotary" (Su et al.), ...: core.POSITIONAL
    activation: str = "gelu"
    norm_first: bool = True        # pre-LN; False = post-LN as in Bloem / nn.Transformer default
    mask_padding: bool = True      # False reproduces Bloem: attention and pooling see padding too
    attention_dropout: float | None = None  # on the attention weights; None = dropout
    ngram_orders: int = 0          # n-gram branch over orders 1..N (classify.ngrams); 0 = no branch
    ngram_buckets: int = DEFAULT_BUCKETS  # hash slots of the branch
    ngram_skip_bigrams: bool = False  # the branch also reads pairs of tokens one apart
    ngram_head: int = 0            # ... and, as features of their own, the n-grams of the first N tokens
    ngram_tail: int = 0            # ... and of the last N tokens
    ngram_negation: int = 0        # ... reading words up to N tokens after a negator as NOT_word (0 = off)
    ngram_negators: list[int] = field(default_factory=list)  # token ids that open a negation scope
    ngram_breaks: list[int] = field(default_factory=list)    # token ids that close one (punctuation, "but")
    ngram_ellipsis: int = 0        # ... and the last N words of a clause denied by "..., but it wasn't." (0 = off)
    ngram_auxiliaries: list[int] = field(default_factory=list)  # token ids of the auxiliaries that deny one
    scope_embedding: bool = False  # the transformer also reads the branch's negation scope (``Classifier.encode``)
    scope_dropout: float = 0.0     # ... in training, each text without the mark at this probability

    @property
    def marks_negation(self) -> bool:
        """Whether the n-gram branch reads some words as NOT_word: the scope ``scope_embedding`` hands on."""
        return bool(self.ngram_orders and (self.ngram_negation or self.ngram_ellipsis))

    def validate(self) -> None:
        super().validate()
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}, got {self.pooling!r}")
        counts = (self.ngram_orders, self.ngram_head, self.ngram_tail, self.ngram_negation, self.ngram_ellipsis)
        if min(counts) < 0 or self.ngram_buckets < 1:
            raise ValueError(f"ngram_orders, ngram_head, ngram_tail, ngram_negation and ngram_ellipsis must be "
                             f">= 0 and ngram_buckets >= 1, got {', '.join(map(str, counts))} and {self.ngram_buckets}")
        if self.scope_embedding and not self.marks_negation:
            raise ValueError("scope_embedding marks the words the n-gram branch reads as NOT_word: it needs the "
                             "branch (ngram_orders) with ngram_negation or ngram_ellipsis")
        if not 0 <= self.scope_dropout < 1 or (self.scope_dropout and not self.scope_embedding):
            raise ValueError(f"scope_dropout leaves the scope_embedding's mark off a share of training texts: it "
                             f"needs scope_embedding and 0 <= scope_dropout < 1, got {self.scope_dropout}")


# The model `python -m classify.train` builds (its flags default to these fields; ``ClassifierConfig``'s own
# defaults are Bloem's pure transformer, the smallest model, which the tests build). The n-gram families beyond
# plain 1-3-grams each add 0.1-0.3 points on IMDB test and need 16.8M slots to keep collisions rare; no dropout on
# attention weights lets SDPA's fused CPU kernel apply (1.9-2.7x faster training); the negation scope of 4 words
# is the classic marking of sentiment analysis; a third encoder block reads a verdict negated at the end of a
# sentence (the transformer alone fails 0-3.5% of such cases, with two blocks 13.5-45%; three seeds each) for the
# same IMDB accuracy, with ``classify.train``'s contrast joins seen three times (experiments/RESULTS.md, thirteenth
# session); positions as rotations plus a vector per distance from the text's end ("end+rotary") lift the
# transformer alone by 0.5 points over learned ones for the same IMDB accuracy (three seeds; sixteenth session);
# the branch reads a clause denied by an elided negation ("..., but it wasn't.") as negated: with the same two
# transformers, a verdict negated at the end fails 8 points less often for the model, 73.5 less for the branch
# alone, IMDB +0.03 (fifty-second session); the transformer reads that marking as well, one learned vector on each
# word the branch reads as NOT_word, left off a quarter of the training texts so it also reads negation from the
# words: over four pairs a verdict negated at the end fails 16.5 points less often (2.6%), the suite 8.05 -> 5.2%,
# the transformer alone +0.19, IMDB -0.01 (fifty-third to fifty-sixth sessions; always marked cost IMDB 0.09, half
# the texts unmarked made the negated verdict a lottery again).
# The negators, breaks and auxiliaries are token ids: ``classify.train`` looks them up in the tokenizer it builds
# (``text.tokenize.NEGATORS`` / ``CLAUSE_BREAKS``, ``text.windows.AUXILIARIES`` + ``CONTRACTED``).
RECIPE: dict[str, Any] = {"num_layers": 3, "positional": "end+rotary", "attention_dropout": 0.0,
                          "ngram_orders": 3, "ngram_buckets": 16_777_259, "ngram_skip_bigrams": True,
                          "ngram_head": 30, "ngram_tail": 60, "ngram_negation": 4, "ngram_ellipsis": 4,
                          "scope_embedding": True, "scope_dropout": 0.25}


def ngram_branch(c: ClassifierConfig, orders: int | None = None) -> NgramBag:
    """The n-gram branch ``c`` describes, unfitted; ``orders`` instead of ``c.ngram_orders`` builds it for a
    model without one (``classify.train``'s teacher for a pure transformer)."""
    return NgramBag(c.vocab_size, c.num_classes, orders or c.ngram_orders, c.ngram_buckets, c.pad_id,
                    c.ngram_skip_bigrams, c.ngram_head, c.ngram_tail, c.ngram_negation,
                    tuple(c.ngram_negators), tuple(c.ngram_breaks), c.ngram_ellipsis, tuple(c.ngram_auxiliaries))


class BranchLogits(NamedTuple):
    """The classifier's logits before the mix: the transformer's (B, C), the n-gram branch's (B, C) or None
    without a branch, and each text's length in real tokens (B,), which the mix reads."""

    transformer: Tensor
    ngram: Tensor | None
    lengths: Tensor


class Classifier(nn.Module):
    """Encoder-only sequence classifier (Bloem, "Transformers from scratch").

    ``Classifier(vocab_size=..., num_classes=2, d_model=..., num_heads=..., num_layers=...,
    d_ff=..., max_len=..., dropout=..., pad_id=0)`` or ``Classifier(config)``.

    With ``ngram_orders > 0`` the logits are ``w_t * transformer + w_n * ngram``, the two weights linear in
    ``mix_features`` of the text's length (``mix``, (2 branches, 2 features)). ``mix`` starts at
    ((1, 0), (0, 0)), so training sees the transformer alone, and ``classify.ngrams`` /
    ``classify.train`` fit the branch and the mix (``ngrams.fit_mix``).
    """

    def __init__(self, config: ClassifierConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = c = ClassifierConfig.given(config, kwargs)
        self.embed = Embedding(c.vocab_size, c.d_model, c.max_len, c.dropout, c.positional, padding_idx=c.pad_id)
        self.encoder = Encoder(c.num_layers, c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation, c.norm_first,
                               c.attention_dropout, rotary_positions(c.positional, c.d_model // c.num_heads, c.max_len))
        # Attention pooling: one learned query attends over the token vectors with the encoder's own attention, so
        # a verdict can outweigh the rest of a text (mean pooling gives every token the same say).
        self.pool_attention = (MultiHeadAttention(c.d_model, c.num_heads, c.dropout if c.attention_dropout is None
                                                  else c.attention_dropout)
                               if c.pooling == "attention" else None)
        self.head = nn.Linear(c.d_model, c.num_classes)
        _init_weights(self)
        # A zero query weighs every real token alike: attention pooling starts as mean pooling (of the values).
        self.pool_query = nn.Parameter(torch.zeros(1, 1, c.d_model)) if c.pooling == "attention" else None
        # After the Xavier initialisation: the bag starts at zero and is fitted, not trained.
        self.ngram = ngram_branch(c) if c.ngram_orders else None
        if self.ngram is not None:
            self.ngram.requires_grad_(False)
        # Zero at the start, so training starts from the same model as without it.
        self.scope_vector = nn.Parameter(torch.zeros(c.d_model)) if c.scope_embedding else None
        self.register_buffer("mix", torch.tensor([[1.0, 0.0], [0.0, 0.0]]) if self.ngram is not None else None)

    def forward(self, tokens: Tensor, ngram: bool = True) -> Tensor:
        """tokens (B, T) LongTensor, right-padded with ``pad_id`` -> logits (B, num_classes): what ships.
        ``ngram=False``: the transformer branch's alone, as ``classify.train`` trains it (the branch is frozen and
        weighted 0 until the mix is chosen, so computing it would be work for nothing)."""
        if not ngram:
            return self.transformer(tokens)
        return self.mixed(self.branches(tokens))

    def transformer(self, tokens: Tensor, scope: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> the transformer branch's logits (B, C): encoder, pooling over real tokens, head.
        ``scope``: as in ``encode``."""
        return self.head(self.pool(self.encode(tokens, scope), tokens))

    def branches(self, tokens: Tensor) -> BranchLogits:
        """tokens (B, T) -> each branch's logits before the mix (see ``BranchLogits``)."""
        # The negation scope is read once, by the branch and (with ``scope_embedding``) by the transformer.
        scope = self.ngram.scope(tokens) if self.ngram is not None else None                  # (B, T) bool
        logits = self.transformer(tokens, scope)
        ngram = self.ngram(tokens, scope).to(logits.dtype) if self.ngram is not None else None
        return BranchLogits(logits, ngram, (tokens != self.config.pad_id).sum(dim=1))

    def mix_weights(self, lengths: Tensor) -> Tensor:
        """lengths (B,) -> the weights of the transformer and of the n-gram branch for texts that long, (B, 2)."""
        return mix_features(lengths.to(self.mix.device)) @ self.mix.T

    def mixed(self, parts: BranchLogits) -> Tensor:
        """The branches' logits -> the model's, (B, C)."""
        if parts.ngram is None:
            return parts.transformer
        w = self.mix_weights(parts.lengths).to(parts.transformer.dtype)   # (B, 2)
        return w[:, :1] * parts.transformer + w[:, 1:] * parts.ngram

    def upgrade_state(self, tensors: dict[str, Tensor], prefix: str) -> None:
        """Weights saved before the mix depended on length hold two constant weights (2,): they are the
        length-dependent mix with zero slopes (``tensors`` is changed in place; ``load_model_weights`` calls it)."""
        mix = tensors.get(prefix + "mix")
        if mix is not None and mix.dim() == 1:
            tensors[prefix + "mix"] = torch.stack([mix, torch.zeros_like(mix)], dim=1)

    def encode(self, tokens: Tensor, scope: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> contextual token vectors (B, T, D). With ``scope_embedding``, each word the n-gram
        branch reads as NOT_word (``NgramBag.scope``: after a negator, or in a clause an elided negation denies)
        gets one learned vector added to its embedding: the branch's rule reaches the transformer as an input
        feature, so a denial with no negator beside the word ("..., but it wasn't.") is marked as "not good" is.
        In training, ``scope_dropout`` leaves the mark off whole texts at random, so the transformer also keeps
        reading negation from the words themselves (a reader less like the branch, and one that still reads a
        negation the rule does not reach). ``scope``: the branch's ``NgramBag.scope(tokens)`` when the caller has
        it already; None reads it here."""
        mask = padding_mask(tokens, self.config.pad_id) if self.config.mask_padding else None
        x = self.embed(tokens)                                                         # (B, T, D)
        if self.scope_vector is not None:
            marked = self.ngram.scope(tokens) if scope is None else scope              # (B, T) bool
            if self.training and self.config.scope_dropout:
                kept = torch.rand(len(tokens), 1, device=tokens.device) >= self.config.scope_dropout  # (B, 1)
                marked = marked & kept
            x = x + marked.unsqueeze(-1).to(x.dtype) * self.scope_vector.to(x.dtype)
        return self.encoder(x, mask)

    def pool(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """hidden (B, T, D) -> (B, D), pooling over real tokens only (unless ``mask_padding`` is off)."""
        if self.config.pooling == "first":
            return hidden[:, 0]
        if self.config.pooling == "attention":
            mask = padding_mask(tokens, self.config.pad_id) if self.config.mask_padding else None   # (B, 1, 1, T)
            query = self.pool_query.expand(len(hidden), -1, -1).to(hidden.dtype)                   # (B, 1, D)
            return self.pool_attention(query, hidden, hidden, mask)[0][:, 0]
        if self.config.mask_padding:
            real = (tokens != self.config.pad_id).unsqueeze(-1)  # (B, T, 1)
        else:
            real = torch.ones_like(tokens, dtype=torch.bool).unsqueeze(-1)
        if self.config.pooling == "max":
            return hidden.masked_fill(~real, float("-inf")).amax(dim=1).nan_to_num(neginf=0.0)
        count = real.sum(dim=1).clamp(min=1).to(hidden.dtype)  # (B, 1); an all-pad row pools to zeros
        return (hidden * real).sum(dim=1) / count


# ------------------------------------------------------------------ encoder-decoder
@dataclass
class TransformerConfig(_Config):
    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    max_len: int = 256
    dropout: float = 0.1
    pad_id: int = 0
    positional: str = "sinusoidal"
    activation: str = "relu"
    norm_first: bool = True
    tie_embeddings: bool = False   # share the target embedding with the output projection
    attention_dropout: float | None = None  # on the attention weights; None = dropout

    def validate(self) -> None:
        super().validate()
        if POSITIONAL[self.positional].added == "end":
            raise ValueError(f"positional={self.positional!r} counts from a text's end, which a decoder generating "
                             f"token by token does not know yet; use it for a classifier")


class Transformer(nn.Module):
    """Encoder-decoder transformer (Vaswani et al. 2017), pre-LN by default.

    ``forward(src (B, S), tgt (B, T)) -> logits (B, T, tgt_vocab_size)``; ``tgt`` is the
    decoder input (the target shifted right, starting with BOS). Greedy and beam decoding:
    ``classify.generate``.
    """

    def __init__(self, config: TransformerConfig | None = None, **kwargs: Any):
        super().__init__()
        self.config = c = TransformerConfig.given(config, kwargs)
        self.src_embed = Embedding(c.src_vocab_size, c.d_model, c.max_len, c.dropout, c.positional, padding_idx=c.pad_id)
        self.tgt_embed = Embedding(c.tgt_vocab_size, c.d_model, c.max_len, c.dropout, c.positional, padding_idx=c.pad_id)
        layer_args = (c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation, c.norm_first, c.attention_dropout,
                      rotary_positions(c.positional, c.d_model // c.num_heads, c.max_len))
        self.encoder = Encoder(c.num_encoder_layers, *layer_args)
        self.decoder = Decoder(c.num_decoder_layers, *layer_args)
        self.generator = nn.Linear(c.d_model, c.tgt_vocab_size)
        _init_weights(self)
        if c.tie_embeddings:
            self.generator.weight = self.tgt_embed.tokens.weight

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) -> (memory (B, S, D), source padding mask (B, 1, 1, S))."""
        src_mask = padding_mask(src, self.config.pad_id)
        return self.encoder(self.src_embed(src), src_mask), src_mask

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor,
               caches: list[tuple[KVCache, KVCache]] | None = None) -> Tensor:
        """tgt (B, T), memory (B, S, D) -> logits (B, T, V).

        With ``caches`` (from ``self.decoder.new_caches()``) ``tgt`` holds only the new
        positions; earlier positions' keys/values come from the caches.
        """
        offset = 0 if caches is None else caches[0][0].length
        t = tgt.shape[1]
        self_mask = causal_mask(t, tgt.device, offset)  # (1, 1, T, offset + T)
        if caches is None:
            # Padding is only ever at the end, so the causal mask already hides it from real
            # queries; adding the key padding mask keeps pad queries from attending to pad.
            self_mask = combine_masks(self_mask, padding_mask(tgt, self.config.pad_id))
        x = self.decoder(self.tgt_embed(tgt, offset), memory, self_mask, src_mask, caches)
        return self.generator(x)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        memory, src_mask = self.encode(src)
        return self.decode(tgt, memory, src_mask)
