"""Typing slips read as the words they were meant to be.

A word-level tokenizer turns "wondreful" into ``[UNK]``: a one-sentence review with one slip in its one
sentiment word loses everything it said. ``Speller`` reads an unknown word that is one edit away from a word of
the vocabulary (a letter deleted, inserted, replaced, or two neighbours swapped: Damerau's distance, through
``symspellpy``) as that word; among several, the most frequent. What is not a slip is left alone: a word of
English that the vocabulary lacks ("tweak" is not "weak": symspellpy's dictionary of 82,765 English words decides),
a capitalised word inside a sentence (a name: "Ahmed"), and words with no known neighbour.

    speller = Speller.for_tokenizer(tokenizer)        # None for subword tokenizers (they have no unknown words)
    ids, fixes = speller.correct(text, encoding.ids, encoding.offsets)   # fixes: [("wondreful", "wonderful")]
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from symspellpy import SymSpell, Verbosity
from tokenizers import Tokenizer

from .tokenize import UNK

MIN_LETTERS = 3      # shorter unknown words have too many neighbours one edit away to pick one
SENTENCE_ENDS = ".!?"
ENGLISH = "frequency_dictionary_en_82_765.txt"   # shipped with symspellpy: "word count" per line


@cache
def english_words() -> frozenset[str]:
    """The words of symspellpy's English frequency dictionary (lower case)."""
    lines = (files("symspellpy") / ENGLISH).read_text(encoding="utf-8").splitlines()
    return frozenset(line.split(" ", 1)[0] for line in lines)


def looks_like_a_name(text: str, start: int, end: int) -> bool:
    """Whether the word ``text[start:end]`` is capitalised (not all capitals) and does not open a sentence."""
    word = text[start:end]
    if not (word[0].isupper() and any(c.islower() for c in word[1:])):
        return False
    before = text[:start].rstrip()
    return bool(before) and before[-1] not in SENTENCE_ENDS


class Speller:
    """Corrects a word-level tokenizer's unknown words to their nearest known word (see the module's doc)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.unk_id = tokenizer.token_to_id(UNK)
        vocab = tokenizer.get_vocab()
        # The word-level trainer numbers the vocabulary by falling frequency, so a lower id is a more frequent
        # word: the count given to SymSpell, which prefers the most frequent among the nearest.
        self.symspell = SymSpell(max_dictionary_edit_distance=1)
        for word, token_id in vocab.items():
            if word.isalpha():
                self.symspell.create_dictionary_entry(word, len(vocab) - token_id)
        self.cache: dict[str, tuple[str, int] | None] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> Speller | None:
        """A speller for a word-level tokenizer with an unknown token; None for any other."""
        if type(tokenizer.model).__name__ != "WordLevel" or tokenizer.token_to_id(UNK) is None:
            return None
        return cls(tokenizer)

    def nearest(self, written: str) -> tuple[str, int] | None:
        """The known word one edit from the unknown word ``written`` (as in the text; normalised as the tokenizer
        does, once per distinct spelling: the answer is cached) and its id, or None (also for a word of English)."""
        if written not in self.cache:
            word, found = self.tokenizer.normalizer.normalize_str(written), None
            if len(word) >= MIN_LETTERS and word.isalpha() and word not in english_words():
                hits = self.symspell.lookup(word, Verbosity.TOP, max_edit_distance=1)
                if hits:
                    found = hits[0].term, self.tokenizer.token_to_id(hits[0].term)
            self.cache[written] = found
        return self.cache[written]

    def correct(self, text: str, ids: list[int], offsets: list[tuple[int, int]]
                ) -> tuple[list[int], list[tuple[str, str]]]:
        """One encoding of ``text`` (its ids and character offsets) -> the ids with each unknown word that has a
        known neighbour replaced by it, and the (word as written, word read) pairs replaced, in order; words that
        look like names are left alone."""
        if self.unk_id not in ids:
            return ids, []
        out, fixes = list(ids), []
        for position, token_id in enumerate(ids):
            if token_id != self.unk_id:
                continue
            start, end = offsets[position]
            if looks_like_a_name(text, start, end):
                continue
            written = text[start:end]
            found = self.nearest(written)
            if found is not None:
                out[position] = found[1]
                fixes.append((written, found[0]))
        return out, fixes
