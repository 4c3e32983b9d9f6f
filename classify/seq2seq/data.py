"""Parallel text for the seq2seq example: line-aligned files, token ids with BOS/EOS, batches."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..errors import ClassifyError
from ..text.batching import pad_batch
from ..text.data import normalize
from ..text.tokenize import CLS, PAD, SEP, encode

BOS, EOS = CLS, SEP


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


def encode_training_pairs(tokenizer: Tokenizer, pairs: Parallel,
                          max_len: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Token ids of both sides; pairs with a side longer than ``max_len`` are skipped, not cut
    (a cut target would teach the model to stop mid-sentence). Returns (src, tgt, skipped)."""
    src_all, tgt_all = encode_side(tokenizer, pairs.src), encode_side(tokenizer, pairs.tgt)
    kept = [i for i, (s, t) in enumerate(zip(src_all, tgt_all)) if len(s) <= max_len and len(t) <= max_len]
    if not kept:
        raise ClassifyError(f"every training pair is longer than --max-len {max_len} tokens")
    return [src_all[i] for i in kept], [tgt_all[i] for i in kept], len(pairs) - len(kept)


def pair_lengths(src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[int]:
    """The longer side of each pair: a token budget then bounds both padded tensors."""
    return [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]


class PairCollate:
    """Indices of training pairs -> a batch: ``src`` (B, S), decoder input ``tgt_in`` (B, T) = BOS y1..ym
    and labels ``tgt_out`` (B, T) = y1..ym EOS, all right-padded with ``pad_id``. (Id lists end in EOS.)"""

    def __init__(self, src_ids: list[list[int]], tgt_ids: list[list[int]], pad_id: int, bos_id: int):
        self.src_ids, self.tgt_ids, self.pad_id, self.bos_id = src_ids, tgt_ids, pad_id, bos_id

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        tgt = [self.tgt_ids[i] for i in indices]
        return {"src": pad_batch([self.src_ids[i] for i in indices], self.pad_id),
                "tgt_in": pad_batch([[self.bos_id] + t[:-1] for t in tgt], self.pad_id),
                "tgt_out": pad_batch(tgt, self.pad_id)}
