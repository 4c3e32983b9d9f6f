"""Short texts cut from whole reviews: each review's closing sentence or closing passage, as token ids.

People type a sentence or two; IMDB's reviews are ~230 words. A review's last sentence is where its verdict tends
to be ("Avoid it.", "I loved every minute."), so it keeps the review's label more often than a sentence from the
middle does. ``classify.train`` uses the closing sentences twice: as short training texts with their review's
target, and as a short-text validation set cut from the validation reviews (reported beside whole-review
validation, and part of what chooses the mix and the checkpoint). The closing passage (the last three sentences,
at most 96 tokens: the length of a short real review) is a training text only. So is a sentence that ends on a
negated auxiliary whose verb is left out ("We hoped it would get better. It didn't.", "..., but he did not."):
the verdict is the negation of what came before, which a bag of words cannot read and which IMDB's reviews write
rarely (about one review in 70). Cut from the training data alone: no test text, no template.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from .prepare import TokenIds
from .tokenize import token_ids

SENTENCE_ENDS = (".", "!", "?")
MIN_TOKENS = 4      # a closing "Enjoy!" says little: sentences shorter than this take the one before too
MAX_TOKENS = 48     # a run-on last sentence keeps its last tokens
PASSAGE_SENTENCES, PASSAGE_TOKENS = 3, 96   # a closing passage: the length of a short real review


def closing_sentence(ids: TokenIds, ends: set[int], min_tokens: int = MIN_TOKENS,
                     max_tokens: int = MAX_TOKENS, sentences: int = 1) -> TokenIds:
    """The review's last ``sentences`` sentences (with their end marks), extended backwards by whole sentences to
    at least ``min_tokens`` words, then cut to their last ``max_tokens`` tokens; a review without sentence ends is
    its own last sentence."""
    stop = len(ids)
    while stop and ids[stop - 1] in ends:   # trailing marks ("!!!") belong to the last sentence
        stop -= 1
    start, taken = stop, 0
    while start > 0:
        start -= 1
        while start > 0 and ids[start - 1] not in ends:
            start -= 1
        taken += 1
        if taken >= sentences and sum(1 for t in ids[start:stop] if t not in ends) >= min_tokens:
            break
    return ids[max(start, len(ids) - max_tokens):]


def closing_sentences(reviews: list[TokenIds], ends: set[int]) -> list[TokenIds]:
    """``closing_sentence`` of each review (token id lists), in order."""
    return [closing_sentence(ids, ends) for ids in reviews]


def closing_passage(ids: TokenIds, ends: set[int]) -> TokenIds | None:
    """The review's last ``PASSAGE_SENTENCES`` sentences cut to ``PASSAGE_TOKENS`` tokens; None where that is the
    whole review or no longer than its closing sentence (a second copy of a text, not a new one)."""
    passage = closing_sentence(ids, ends, max_tokens=PASSAGE_TOKENS, sentences=PASSAGE_SENTENCES)
    return None if len(passage) in (len(ids), len(closing_sentence(ids, ends))) else passage


# Auxiliaries as the word tokenizers split them: "wasn't" -> wasn ' t; "was not" -> was not; "can't" -> can ' t.
CONTRACTED = ("wasn", "isn", "weren", "aren", "didn", "doesn", "don", "couldn", "wouldn", "won", "can", "hasn", "haven",
              "hadn", "shouldn", "ain")
AUXILIARIES = ("was", "is", "were", "are", "did", "does", "do", "could", "would", "will", "can", "has", "have", "had",
               "should")
ELIDED_MIN_TOKENS = 8   # "It didn't." says nothing without the sentence before it


@dataclass(frozen=True)
class Elision:
    """The token ids that mark a negated auxiliary at a sentence's end, for one tokenizer."""

    contracted: frozenset[int]     # wasn, didn, can, ... before ' t
    auxiliaries: frozenset[int]    # was, did, can, ... before not
    apostrophe: int | None
    t: int | None
    negator: int | None            # not
    full_stops: frozenset[int]     # . and ! (a question is not a verdict)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "Elision":
        def one(word: str) -> int | None:
            found = token_ids(tokenizer, (word,))
            return found[0] if found else None

        return cls(frozenset(token_ids(tokenizer, CONTRACTED)), frozenset(token_ids(tokenizer, AUXILIARIES)),
                   one("'"), one("t"), one("not"), frozenset(token_ids(tokenizer, (".", "!"))))

    def ends_elided(self, sentence: TokenIds) -> bool:
        """Whether the sentence (its end marks stripped) ends on "AUX n't" or "AUX not", after at least one word."""
        tail = list(sentence[-4:])
        contracted = (len(tail) >= 4 and tail[-3] in self.contracted and tail[-2] == self.apostrophe
                      and tail[-1] == self.t)
        spelled = len(tail) >= 3 and tail[-2] in self.auxiliaries and tail[-1] == self.negator
        return contracted or spelled


def elided_negation(ids: TokenIds, ends: set[int], elision: Elision) -> TokenIds | None:
    """The review's last sentence that ends on a negated auxiliary with its verb left out (``Elision``), with the
    sentences before it up to ``ELIDED_MIN_TOKENS`` words, cut to its last ``MAX_TOKENS`` tokens; None if none."""
    stop = len(ids)
    while stop > 0:
        end = stop
        while end > 0 and ids[end - 1] in ends:         # this sentence's end marks
            end -= 1
        start = end
        while start > 0 and ids[start - 1] not in ends:
            start -= 1
        marks = ids[end:stop]
        if start < end and len(marks) and marks[0] in elision.full_stops and elision.ends_elided(ids[start:end]):
            return closing_sentence(ids[:stop], ends, ELIDED_MIN_TOKENS, MAX_TOKENS)
        stop = start
    return None
