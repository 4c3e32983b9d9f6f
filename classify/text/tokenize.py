"""Training, saving and loading the tokenizer (Hugging Face ``tokenizers``).

torchtext used to do this job (``get_tokenizer`` + ``build_vocab_from_iterator``); it is
no longer maintained and does not import with current PyTorch, so ``tokenizers`` (Rust,
fast batch encoding, one JSON file) replaces it.

Kinds: ``word`` (a word-level vocabulary like Bloem's: one token per word, shortest
sequences), ``bpe`` and ``wordpiece`` (subwords: no unknown words). Text is lower-cased
(unless ``lowercase=False``) and NFKC-normalised; words and punctuation are split apart.

``reversible=True`` (for models that write text, e.g. translation) marks word starts with
``▁`` as SentencePiece does, so ``tokenizer.decode`` restores the spacing; the default
pre-tokenizer drops the spaces and its decoder glues every token together.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..errors import ClassifyError

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = [PAD, UNK, CLS, SEP, MASK]  # ids 0..4, in this order
KINDS = ("word", "bpe", "wordpiece")
# Words that open a negation scope and tokens that close one (the n-gram branch's negation marking). The
# pre-tokenizer splits "didn't" into "didn", "'", "t", so "t" stands for "n't" and the apostrophe is no break.
NEGATORS = ("not", "no", "never", "t", "nothing", "nobody", "none", "nor", "neither", "without", "cannot",
            "hardly", "barely")
CLAUSE_BREAKS = (".", ",", "!", "?", ";", ":", "(", ")", "-", "but", "however", "although", "though")
TRUNCATIONS = ("head", "tail", "head+tail")


def train_tokenizer(texts: Iterable[str], vocab_size: int, kind: str = "word", min_frequency: int = 2,
                    lowercase: bool = True, reversible: bool = False) -> Tokenizer:
    """Learn a vocabulary of at most ``vocab_size`` entries (specials included) from ``texts``.

    ``reversible``: keep word boundaries in the tokens so ``decode`` gives back readable text
    (kinds ``word`` and ``bpe``).
    """
    if kind not in KINDS:
        raise ClassifyError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if reversible and kind == "wordpiece":
        raise ClassifyError("a reversible tokenizer must be of kind 'word' or 'bpe', not 'wordpiece'")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ClassifyError(f"vocabulary size {vocab_size} is too small")
    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token=UNK))
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=SPECIAL_TOKENS)
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.decoder = decoders.BPEDecoder()
    else:
        tok = Tokenizer(models.WordPiece(unk_token=UNK))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=SPECIAL_TOKENS, show_progress=False)
        tok.decoder = decoders.WordPiece()
    steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
    tok.normalizer = normalizers.Sequence(steps)
    if reversible:
        # Spaces become "▁" at the start of the next token instead of vanishing.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
        tok.decoder = decoders.Metaspace()
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_ids(tokenizer: Tokenizer, words: Iterable[str]) -> list[int]:
    """The ids of those ``words`` that are whole tokens of ``tokenizer`` (others are left out), sorted."""
    ids = (tokenizer.token_to_id(w) for w in words)
    return sorted({i for i in ids if i is not None})


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.exists():
        raise ClassifyError(f"tokenizer not found: {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise ClassifyError(f"tokenizer file is corrupt ({path}): {err}") from None
    if tok.token_to_id(PAD) != 0:
        raise ClassifyError(f"tokenizer {path} does not have {PAD} at id 0")
    return tok


def truncate(ids: list[int] | np.ndarray, max_len: int, strategy: str = "head+tail") -> list[int] | np.ndarray:
    """Cut ``ids`` (a list or an array (T,)) to ``max_len``: keep the start, the end, or both (a quarter head, the
    rest tail: reviews often state the verdict at the end; Sun et al. 2019 found head+tail best)."""
    if len(ids) <= max_len:
        return ids
    if strategy == "head":
        return ids[:max_len]
    if strategy == "tail":
        return ids[-max_len:]
    if strategy != "head+tail":
        raise ClassifyError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {strategy!r}")
    head = max_len // 4
    kept = ids[:head], ids[len(ids) - (max_len - head):]
    return np.concatenate(kept) if isinstance(ids, np.ndarray) else kept[0] + kept[1]


# Texts per ``encode_batch`` call: enough to keep Rust's threads busy. All 50,000 unlabelled IMDB reviews in one
# call held every one's Encoding (tokens, offsets, masks) at once: 1.9 GB more peak memory than these chunks.
ENCODE_CHUNK = 1024


def encode(tokenizer: Tokenizer, texts: list[str], max_len: int, truncation: str = "head+tail") -> list[list[int]]:
    """Normalised texts -> token id lists of at most ``max_len`` (batch-encoded in Rust, in parallel, a chunk of
    texts at a time)."""
    return [truncate(e.ids, max_len, truncation) for start in range(0, len(texts), ENCODE_CHUNK)
            for e in tokenizer.encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)]
