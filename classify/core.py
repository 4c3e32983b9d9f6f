"""The transformer core: masks, attention, blocks, embeddings.

Everything in ``classify`` that attends to anything goes through this module; the
classifier and the encoder-decoder in ``classify.models`` are thin assemblies of it.

Mask convention (the one place it is defined)
---------------------------------------------
Masks are boolean tensors where **True means "may attend"**. They broadcast to
``(batch, heads, q_len, k_len)``:

* :func:`padding_mask` gives ``(B, 1, 1, T)``: every query may look at the real keys.
* :func:`causal_mask` gives ``(1, 1, T, T)``: query ``i`` may look at keys ``<= i``.
* :func:`combine_masks` ANDs any number of them (``None`` means "no restriction").

A query row whose keys are *all* masked (e.g. an all-padding sequence) has no
distribution to attend with; instead of the NaN a softmax over nothing would give,
its attention output (and its attention weights) are **exactly zero**.

Shapes in comments: B batch, H heads, T/S time (target/source), D model width,
Dh = D / H head width, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "padding_mask",
    "causal_mask",
    "combine_masks",
    "KVCache",
    "MultiHeadAttention",
    "dropout",
    "Dropout",
    "FeedForward",
    "EncoderBlock",
    "DecoderBlock",
    "Encoder",
    "Decoder",
    "Embedding",
    "sinusoidal_positions",
    "RotaryEmbedding",
    "rotary_positions",
    "POSITIONAL",
    "Positions",
]


# --------------------------------------------------------------------------- masks
def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """Keys that are real tokens. ``tokens`` (B, T) -> bool (B, 1, 1, T), True = attend."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | str | None = None, offset: int = 0) -> Tensor:
    """Queries may attend to themselves and the past only. -> bool (1, 1, length, offset + length).

    ``offset`` is the number of keys already seen (a key/value cache): query ``i``
    sits at absolute position ``offset + i`` and may attend keys ``<= offset + i``.
    """
    q = torch.arange(length, device=device)[:, None] + offset
    k = torch.arange(offset + length, device=device)[None, :]
    return (k <= q)[None, None]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND of the given boolean masks (broadcast); ``None`` entries mean "no restriction"."""
    result: Tensor | None = None
    for mask in masks:
        if mask is not None:
            result = mask if result is None else result & mask
    return result


# ----------------------------------------------------------------------- attention
@dataclass
class KVCache:
    """Projected keys and values kept between decoding steps.

    Self-attention appends each step's key/value (``static=False``); cross-attention
    projects the encoder memory once and reuses it (``static=True``).
    ``key``/``value``: (B, H, T_cached, Dh).
    """

    static: bool = False
    key: Tensor | None = None
    value: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search keeps the surviving hypotheses). ``index``: (B',)."""
        if self.key is not None:
            self.key = self.key.index_select(0, index)
            self.value = self.value.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017, section 3.2).

    Parameters are laid out like ``torch.nn.MultiheadAttention`` (one packed
    ``in_proj`` for query/key/value and an ``out_proj``) so weights copy across 1:1.

    The hot path is ``F.scaled_dot_product_attention`` (flash / memory-efficient
    kernels where the device has them). ``need_weights=True`` takes the explicit
    softmax(QK^T/sqrt(Dh))V path instead and returns the per-head weights.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 rotary: RotaryEmbedding | None = None):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.dropout = dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)  # rows: [W_q; W_k; W_v]
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        # Self-attention only: queries and keys rotated by their positions (``RotaryEmbedding``).
        self.rotary = rotary

    def _split_heads(self, x: Tensor, offset: int | None = None) -> Tensor:
        """(B, T, n * Dh) -> (B, n, T, Dh) (n: H, or 2H for queries and keys side by side); rotated by positions
        ``offset``, ``offset + 1``, ... when an offset is given and this attention has a rotary table."""
        b, t, _ = x.shape
        x = x.view(b, t, -1, self.head_dim)
        if offset is not None and self.rotary is not None:
            x = self.rotary(x, offset)
        return x.transpose(1, 2)

    def _project(self, query: Tensor, key: Tensor, value: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections -> q, k, v, each (B, H, T, Dh), using/updating ``cache``."""
        w, b = self.in_proj.weight, self.in_proj.bias
        d = self.d_model
        if query is key and key is value and cache is None:
            # Self-attention: one fused matmul for all three projections; queries and keys are rotated in one
            # pass, as 2H heads (on a CPU each elementwise pass over small tensors costs more than its arithmetic).
            qk, v = self.in_proj(query).split([2 * d, d], dim=-1)                                # (B, T, 2D), (B, T, D)
            q, k = self._split_heads(qk, 0).split(self.num_heads, dim=1)
            return q, k, self._split_heads(v)
        bq, bk, bv = (None, None, None) if b is None else b.split(d)
        # Incremental decoding: the new positions follow the cached ones, whose keys were rotated when cached.
        offset = cache.length if cache is not None and not cache.static else 0
        q = self._split_heads(F.linear(query, w[:d], bq), offset)
        if cache is not None and cache.static and cache.key is not None:
            return q, cache.key, cache.value  # cross-attention memory already projected
        wk, wv = w[d : 2 * d], w[2 * d :]
        if key is value:
            k, v = F.linear(key, torch.cat([wk, wv]), None if b is None else torch.cat([bk, bv])).split(d, dim=-1)
        else:
            k, v = F.linear(key, wk, bk), F.linear(value, wv, bv)
        k, v = self._split_heads(k, offset), self._split_heads(v)
        if cache is not None:
            if not cache.static and cache.key is not None:
                k = torch.cat([cache.key, k], dim=2)
                v = torch.cat([cache.value, v], dim=2)
            cache.key, cache.value = k, v
        return q, k, v

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` (B, Tq, D) to ``key``/``value`` (B, Tk, D).

        ``mask``: bool, True = may attend, broadcastable to (B, H, Tq, Tk) where Tk
        counts cached keys too. Returns ``(output (B, Tq, D), weights)`` where weights
        are (B, H, Tq, Tk) if ``need_weights`` else ``None``. Query rows with no
        attendable key get zero output and zero weights.
        """
        q, k, v = self._project(query, key, value, cache)
        dropout_p = self.dropout if self.training else 0.0

        empty_rows: Tensor | None = None
        if mask is not None:
            has_key = mask.any(dim=-1, keepdim=True)  # (B|1, H|1, Tq|1, 1)
            # Asking whether any row is empty costs a host sync on a GPU (a stall per attention call), so
            # there the fix-up below always runs (a no-op without empty rows); on the CPU the check is cheap. A
            # graph being captured (torch.compile, the ONNX export) cannot branch on data: it keeps the fix-up.
            if q.device.type != "cpu" or _capturing() or not bool(has_key.all()):
                # Let empty rows attend everywhere (finite result), then zero them below.
                empty_rows = ~has_key
                mask = mask | empty_rows

        if need_weights:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, Tq, Tk)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            if empty_rows is not None:
                weights = weights.masked_fill(empty_rows, 0.0)
            out = dropout(weights, dropout_p) @ v
        else:
            weights = None
            if mask is not None and _capturing():
                # ONNX's Attention operator (opset 23, what the exporter makes of this call) wants the mask's
                # query dimension spelled out; ONNX Runtime does not broadcast it. A view, no copy.
                mask = mask.expand(*mask.shape[:-2], q.shape[-2], mask.shape[-1])
            out = _sdpa(q, k, v, mask, dropout_p)  # (B, H, Tq, Dh)
            if empty_rows is not None:
                out = out.masked_fill(empty_rows, 0.0)

        b, _, tq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, tq, self.d_model)  # (B, Tq, D)
        return self.out_proj(out), weights


def _capturing() -> bool:
    """Whether this call is being captured into a graph (torch.compile, torch.export, the ONNX exporters)
    rather than run eagerly."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


# Up to this many keys, attention that autograd records on a CPU runs in fp32 even under bf16 autocast.
FP32_TRAINING_KEYS = 128


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    """``F.scaled_dot_product_attention`` of (B, H, Tq, Dh) queries and (B, H, Tk, Dh) keys and values.

    On a CPU the backward of PyTorch's bf16 kernel is slow for short texts: one call, forward and backward, batch
    32 of 4 heads of 32, took 4.9 ms at 16 keys and 22 ms at 128 in bf16, 0.5 and 5.8 ms in fp32 (torch 2.13,
    2 threads; its forward is fast either way). Closing sentences, negation edits and contrast joins are most of
    the recipe's batches, so where autograd takes the backward and there are at most ``FP32_TRAINING_KEYS`` keys,
    bf16 attention is computed in fp32 and its output rounded back. Longer texts keep the bf16 kernel, which is
    within 10% of fp32 there (experiments/RESULTS.md, twenty-eighth and twenty-ninth sessions), and inference keeps
    it everywhere. fp32 is only that fast with denormal numbers flushed (``engine.config.runtime`` flushes them).
    """
    if (q.dtype == torch.bfloat16 and q.device.type == "cpu" and k.shape[-2] <= FP32_TRAINING_KEYS
            and q.requires_grad and torch.is_grad_enabled() and not _capturing()):
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


# ------------------------------------------------------------------------- dropout
DROPOUT_LEVELS = 1 << 16  # on a CPU, the drop probability is rounded to a multiple of 1 / DROPOUT_LEVELS


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout: each element of ``x`` (any shape) is zeroed with probability ``p``, the others are scaled
    by 1 / (1 - p); the identity unless ``training``.

    On a CPU, ``F.dropout`` draws a double from the generator for every element (``bernoulli_``); with this one
    the classifier's training budget trains a fifth more tokens (experiments/RESULTS.md). Here every element gets 16
    random bits, four from each 64-bit draw: ``p`` is rounded to a multiple of 1/65536 (0.1 -> 0.100006) and the
    kept elements are scaled by exactly 1 / (1 - the rounded p), so the expected output is still ``x``. Other
    devices, and a graph being captured, keep PyTorch's own kernel.
    """
    _check_probability(p)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    if x.device.type != "cpu" or _capturing():
        return F.dropout(x, p, training=True)
    n = x.numel()
    # random_ with these bounds fills all 64 bits (without them the top bit is always 0).
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None).view(torch.int16)[:n]
    cut = round(p * DROPOUT_LEVELS)                                 # drop where the 16 bits, unsigned, are < cut
    keep = bits.view(x.shape) >= cut - DROPOUT_LEVELS // 2         # as int16: unsigned u is u - 32768
    # A mask in x's dtype, scaled: one multiplication forward and one backward (autograd keeps the mask).
    return x * keep.to(x.dtype).mul_(DROPOUT_LEVELS / (DROPOUT_LEVELS - cut))


def _check_probability(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be between 0 and 1, got {p}")


class Dropout(nn.Module):
    """``dropout`` as a module, with ``nn.Dropout``'s interface: ``p``, and on in training mode only."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        _check_probability(p)
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


# -------------------------------------------------------------------------- blocks
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """Position-wise Linear -> activation -> dropout -> Linear. (B, T, D) -> (B, T, D)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class _Residual(nn.Module):
    """One sublayer with its LayerNorm and residual, pre-LN or post-LN.

    pre-LN  (default, stable without warmup tricks): x + dropout(f(norm(x)))
    post-LN (Vaswani's and Bloem's original):        norm(x + dropout(f(x)))
    """

    def __init__(self, d_model: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderBlock(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual. (B, T, D) -> (B, T, D)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = True,
                 attention_dropout: float | None = None, rotary: RotaryEmbedding | None = None):
        super().__init__()
        # Dropout on the attention weights; None = ``dropout`` (as nn.Transformer). On CPU, SDPA with
        # dropout leaves its fused kernel: 0 trains 1.4-1.75x faster (experiments/results/bench.md).
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.self_attn = MultiHeadAttention(d_model, num_heads, attention_dropout, rotary=rotary)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.attn_residual = _Residual(d_model, dropout, norm_first)
        self.ff_residual = _Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.attn_residual(x, lambda h: self.self_attn(h, h, h, mask)[0])
        return self.ff_residual(x, self.feed_forward)


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder memory, feed-forward.

    x (B, T, D), memory (B, S, D) -> (B, T, D). ``caches`` (self, cross) enable
    incremental decoding: feed one new position at a time.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = True,
                 attention_dropout: float | None = None, rotary: RotaryEmbedding | None = None):
        super().__init__()
        attention_dropout = dropout if attention_dropout is None else attention_dropout  # see EncoderBlock
        self.self_attn = MultiHeadAttention(d_model, num_heads, attention_dropout, rotary=rotary)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, attention_dropout)
        self.feed_forward = FeedForward(d_model, d_ff, dropout, activation)
        self.self_residual = _Residual(d_model, dropout, norm_first)
        self.cross_residual = _Residual(d_model, dropout, norm_first)
        self.ff_residual = _Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None,
                caches: tuple[KVCache, KVCache] | None = None) -> Tensor:
        self_cache, cross_cache = caches if caches is not None else (None, None)
        x = self.self_residual(x, lambda h: self.self_attn(h, h, h, self_mask, cache=self_cache)[0])
        x = self.cross_residual(x, lambda h: self.cross_attn(h, memory, memory, memory_mask, cache=cross_cache)[0])
        return self.ff_residual(x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of encoder blocks; with pre-LN, a final LayerNorm (the last residual is un-normalised).
    ``rotary``: positions as rotations of every block's queries and keys (one table, shared)."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = True,
                 attention_dropout: float | None = None, rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderBlock(d_model, num_heads, d_ff, dropout, activation, norm_first, attention_dropout, rotary)
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, T, D), mask broadcastable to (B, H, T, T) -> (B, T, D)"""
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Decoder(nn.Module):
    """A stack of decoder blocks; with pre-LN, a final LayerNorm. ``rotary``: as ``Encoder``'s (self-attention)."""

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = True,
                 attention_dropout: float | None = None, rotary: RotaryEmbedding | None = None):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderBlock(d_model, num_heads, d_ff, dropout, activation, norm_first, attention_dropout, rotary)
            for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()

    def new_caches(self) -> list[tuple[KVCache, KVCache]]:
        """Empty (self-attention, cross-attention) caches, one pair per layer."""
        return [(KVCache(static=False), KVCache(static=True)) for _ in self.layers]

    def forward(self, x: Tensor, memory: Tensor, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None,
                caches: list[tuple[KVCache, KVCache]] | None = None) -> Tensor:
        """x (B, T, D), memory (B, S, D) -> (B, T, D)"""
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, self_mask, memory_mask, None if caches is None else caches[i])
        return self.norm(x)


# ---------------------------------------------------------------------- embeddings
def sinusoidal_positions(max_len: int, d_model: int) -> Tensor:
    """Vaswani et al.'s fixed encodings: PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(...). -> (max_len, D)"""
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    pe[:, 0::2] = torch.sin(position * div)
    pe[:, 1::2] = torch.cos(position * div)[:, : d_model // 2]
    return pe


class RotaryEmbedding(nn.Module):
    """Rotary positions (Su et al. 2021, "RoFormer"): the features of a query or key, in pairs (i, i + Dh/2), are
    rotated by the angle ``position * base^(-2i/Dh)``. A rotation preserves lengths and q . k then depends on the
    two positions only through their difference: attention sees how far apart two words are, not where they sit,
    so "not" beside "boring" looks the same at word 5 as at word 400. Nothing is added to the token vectors.

    x (B, T, n, Dh), n heads, at positions ``offset``, ..., ``offset + T - 1`` -> the same shape, rotated."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head size, got {head_dim}")
        frequencies = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)    # (Dh/2,)
        angles = torch.arange(max_len, dtype=torch.float64)[:, None] * frequencies               # (max_len, Dh/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        t = x.shape[1]
        cos, sin = (table[offset : offset + t, None].to(x.dtype) for table in (self.cos, self.sin))   # (T, 1, Dh/2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Positions(NamedTuple):
    """What a ``positional`` name does: the vectors ``Embedding`` adds to the tokens ("start": a learned one per
    position; "sinusoidal": Vaswani's fixed ones; "end": a learned one per distance from the last real token,
    which needs the whole text; None: nothing) and whether every self-attention rotates its queries and keys."""

    added: str | None
    rotary: bool


# "learned+rotary": where a word sits and how far apart two words are. "end+rotary": how far apart, and how far
# from the end, since relative distances alone tell no word that it closes the text (a verdict, a late "not").
POSITIONAL = {"learned": Positions("start", False), "sinusoidal": Positions("sinusoidal", False),
              "rotary": Positions(None, True), "learned+rotary": Positions("start", True),
              "end+rotary": Positions("end", True)}


def rotary_positions(positional: str, head_dim: int, max_len: int) -> RotaryEmbedding | None:
    """The rotation table that a model with ``positional`` positions shares among its self-attentions; None where
    ``POSITIONAL`` says it does not rotate."""
    return RotaryEmbedding(head_dim, max_len) if POSITIONAL[positional].rotary else None


class Embedding(nn.Module):
    """Token embedding plus position encoding, then dropout. tokens (B, T) -> (B, T, D).

    ``positional="learned"`` is Bloem's (a trained vector per position);
    ``"sinusoidal"`` is Vaswani's (fixed). Vaswani multiply token embeddings by
    sqrt(D) so they are not drowned by the unit-scale sinusoids; ``scale=None``
    picks that for sinusoidal and 1 for learned positions. ``"rotary"`` adds nothing here: the attention
    rotates its queries and keys instead (``RotaryEmbedding``, which the model gives its encoder);
    ``"learned+rotary"`` adds the learned vectors and the attention rotates too; ``"end+rotary"`` adds a learned
    vector per distance from the last real (non-``padding_idx``) token, so the texts must be right-padded.
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout: float = 0.1,
                 positional: str = "learned", padding_idx: int | None = None, scale: float | None = None):
        super().__init__()
        if positional not in POSITIONAL:
            raise ValueError(f"positional must be one of {tuple(POSITIONAL)}, got {positional!r}")
        added = POSITIONAL[positional].added
        if added == "end" and padding_idx is None:
            raise ValueError(f"positional={positional!r} counts from the last real token: it needs a padding_idx")
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        self.max_len = max_len
        self.from_end = added == "end"
        if added in ("start", "end"):
            self.positions = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        elif added == "sinusoidal":
            self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        else:
            self.positions = None
        self.scale = scale if scale is not None else (math.sqrt(d_model) if added == "sinusoidal" else 1.0)
        self.dropout = Dropout(dropout)

    def forward(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """``offset``: absolute position of ``tokens[:, 0]`` (incremental decoding)."""
        t = tokens.shape[1]
        if offset + t > self.max_len:
            raise ValueError(f"sequence of length {offset + t} exceeds max_len {self.max_len}")
        x = self.tokens(tokens) * self.scale
        if self.from_end:
            if offset:
                raise ValueError("positions counted from the end need the whole text, not an offset")
            last = (tokens != self.tokens.padding_idx).sum(dim=1, keepdim=True) - 1                  # (B, 1)
            distance = (last - torch.arange(t, device=tokens.device)).clamp(min=0)                  # (B, T); pads: 0
            x = x + self.positions[distance]
        elif self.positions is not None:
            x = x + self.positions[offset : offset + t]
        return self.dropout(x)
