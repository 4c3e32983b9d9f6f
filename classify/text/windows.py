"""Short texts cut from whole reviews: each review's closing sentence or closing passage, as token ids.

People type a sentence or two; IMDB's reviews are ~230 words. A review's last sentence is where its verdict tends
to be ("Avoid it.", "I loved every minute."), so it keeps the review's label more often than a sentence from the
middle does. ``classify.train`` uses the closing sentences twice: as short training texts with their review's
target, and as a short-text validation set cut from the validation reviews (reported beside whole-review
validation, and part of what chooses the mix and the checkpoint). The closing passage (the last three sentences,
at most 96 tokens: the length of a short real review) is a training text only. Cut from the training data alone:
no test text, no template.
"""

from __future__ import annotations

from .prepare import TokenIds

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
