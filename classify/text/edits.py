"""Rule-made training texts from real review sentences: negation edits and contrast joins.

IMDB's reviews rarely hold a sentence beside its negation under opposite labels, so a model trained on them learns
"not" as a word of negative reviews, not as an operator: "It was not boring at all." comes out negative. Nor do
they teach that after "but" the second clause has the say. The counterfactual pairs (``text.counterfactual``) are
the human-made cure, but there are only ~1,100 of them. This module makes many more, mechanically, from the
training reviews' own sentences, each beside a text of the same words under the other label:

- ``negate(sentence, verbs)`` toggles the negation of a sentence's first verb phrase: "not" goes in after the
  first copula or modal ("The plot was thin." -> "The plot was not thin."), or "do"-support is added to a lexical
  verb after a pronoun ("I enjoyed it." -> "I did not enjoy it."), and a negated one loses its negation
  ("I couldn't stop laughing." -> "I could stop laughing."). Asked to, it also writes "never" and "no" as often as
  the training reviews do ("I enjoyed it." -> "I never enjoyed it."; "It is a gem." -> "It is no gem.").
- ``negation_pairs`` keeps the sentences whose label is known with some confidence: the review's label for an
  un-negated sentence whose words a bag-of-words lexicon (``Lexicon``, log-count ratios fitted on the training
  reviews) also reads that way, and the opposite label for its edit. For a negated sentence the lexicon reads the
  edit, which has lost the negation, and the review's label goes to the sentence itself.
- ``contrast_joins`` joins a positive and a negative sentence from two reviews with ", but", both ways round:
  "The cast is superb, but the script is a mess." is negative and "The script is a mess, but the cast is superb."
  positive (the rule of Hu et al. 2016, "Harnessing Deep Neural Networks with Logic Rules": in "A but B", B
  decides). Same words, opposite labels: only reading the order tells them apart.

The rules are linguistic ones, applied to the training data only: no sentence, word list or template of the
behavioural suite (``classify.behaviour``) or of any test set goes in.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Copulas and modals take "not" after them ("was not", "will not"); "do"-forms are left out, since "did" is as
# often a main verb ("did a fine job") as an auxiliary.
TAKES_NOT = frozenset("is was are were am will would can could should must might may".split())
# Pronouns whose "'s" is "is" ("it's great" -> "it's not great"), not a possessive.
IS_CONTRACTED = frozenset("it that this there he she what here".split())
# Negated forms and what they become without the negation.
UNNEGATED = {"isn't": "is", "wasn't": "was", "aren't": "are", "weren't": "were", "won't": "will",
             "wouldn't": "would", "can't": "can", "cannot": "can", "couldn't": "could", "shouldn't": "should",
             "mustn't": "must", "didn't": "did", "doesn't": "does", "don't": "do", "hasn't": "has", "haven't": "have",
             "hadn't": "had"}
# ... and the other way: the contracted negation of a copula or modal.
CONTRACTED = {plain: negated for negated, plain in UNNEGATED.items() if plain in TAKES_NOT and negated != "cannot"}
NEGATION_WORDS = frozenset({"not", "no", "never", "nothing", "nobody", "none", "nor", "neither", "without", "hardly",
                            "barely", *UNNEGATED})
# A lexical verb takes "do"-support to be negated ("I enjoyed it." -> "I did not enjoy it."). The rule reads it only
# after a pronoun subject, where the next word is a verb if it is any verb's form; which words are verbs it learns
# from the training reviews (``Lexicon.verbs``: the words that follow "didn't", "don't", ...). The subject decides
# the present tense's form of "do"; irregular past forms are not guessable from their spelling.
DO_BY_SUBJECT = {"i": "do", "we": "do", "you": "do", "they": "do", "he": "does", "she": "does", "it": "does"}
# "have" is left out: as often an auxiliary ("I have seen") as a main verb.
IRREGULAR = {"thought": "think", "found": "find", "felt": "feel", "saw": "see", "knew": "know", "got": "get",
             "kept": "keep", "made": "make", "took": "take", "gave": "give", "understood": "understand",
             "bought": "buy", "left": "leave", "fell": "fall", "meant": "mean"}
# Adverbs that sit between the subject and its verb and stay before it ("I really liked" -> "I did not really
# like"); other adverbs ending in -ly do the same.
ADVERBS = frozenset("just even also still always really actually truly honestly simply quite".split())

# How often people negate with "no" and "never" instead of "not" / "n't", counted on IMDB's 25,000 training reviews
# (experiments/RESULTS.md, twenty-fourth session): a copula's or modal's indefinite predicate ("was a ...") takes "no"
# in 59% of its negations, any other predicate "never" in 6%, and a lexical verb after a pronoun "never" in 12%. That
# first count took "no longer" / "no one" for "no" and pronouns anywhere; `experiments.negation_forms`, which leaves
# them out and reads the pronoun that opens a sentence, gives 55%, 6.2% and 11.2%. The runs were made with these.
NO_SHARE, NEVER_AFTER_COPULA, NEVER_AFTER_PRONOUN = 0.59, 0.06, 0.12
# What --negators chooses between: "not" and "n't" alone; "never" too; "never" and "no" too.
NEGATION_FORMS = ("not", "never", "varied")
ARTICLES = frozenset({"a", "an"})
# "no" that is no article's negation: "was no longer", "is no better than", "was no one".
NO_PHRASES = frozenset("longer more less one doubt matter better worse other sooner".split())

_SENTENCE = re.compile(r"[^.!?]+[.!?]+")
_AFTER_DO = re.compile(r"\b(?:didn't|don't|doesn't|did not|do not|does not) ([a-z]+)\b")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
MIN_WORDS, MAX_WORDS = 4, 20


def sentences(text: str) -> list[str]:
    """The sentences of a normalised review (``text.data.normalize``) that end with a mark, stripped."""
    return [s.strip() for s in _SENTENCE.findall(text)]


# A sentence that opens with a conjunction leans on the one before; one that ends with a title was cut at its dot.
_OPENS_MID_THOUGHT = frozenset("but and or so because yet however although though while which".split())
_TITLE_AT_END = re.compile(r"\b(?:mr|mrs|ms|dr|st|vs|jr|sr|no|vol|ch)\.$", re.IGNORECASE)


def whole(sentence: str) -> bool:
    """Whether a sentence stands on its own: it opens with a capital letter and not with a conjunction, and was
    not cut at a title's dot ("Mr.")."""
    first = words(sentence[:40])
    return (sentence[:1].isupper() and bool(first) and first[0] not in _OPENS_MID_THOUGHT
            and not _TITLE_AT_END.search(sentence))


def words(sentence: str) -> list[str]:
    """Lower-cased words, contractions kept whole ("didn't")."""
    return _WORD.findall(sentence.lower().replace("\u2019", "'"))


def _bare(token: str) -> str:
    return token.lower().strip("\"'()[],;:.!?").replace("\u2019", "'")


CLAUSE_WORDS = frozenset("but however although though while whereas yet".split())


@dataclass
class Edit:
    """A sentence with its negation toggled: ``text``; ``plain`` is whichever of the two has no negation, and
    ``scope`` the words the negation covers (from the verb to the clause's end), as they read in ``plain``."""

    text: str
    plain: str
    scope: list[str]


def _scope(tokens: list[str], start: int) -> list[str]:
    """Bare words from ``tokens[start]`` to the end of its clause: a mark that ends a clause, or a contrasting
    word."""
    out = []
    for token in tokens[start:]:
        word = _bare(token)
        if word in CLAUSE_WORDS:
            break
        if word:
            out.append(word)
        if token[-1] in ",;:.!?)":
            break
    return out


def _adverb(word: str) -> bool:
    return word in ADVERBS or (word.endswith("ly") and len(word) > 4)


def _do_support(tokens: list[str], i: int, verbs: frozenset[str], contract: bool, never: bool) -> Edit | None:
    """``tokens[i]`` is a pronoun, the sentence's subject: the sentence with "do"-support negating the lexical verb
    after it (up to two adverbs may come between: "I really truly loved"), or with ``never`` "never" after the
    subject and the verb as it was ("I never really loved"); None when the next words are no verb form ``verbs``
    knows."""
    j = i + 1
    while j < len(tokens) and j <= i + 2 and _adverb(_bare(tokens[j])):
        j += 1
    if j >= len(tokens) or not tokens[j].isalpha():
        return None  # "I, ..." or a verb with a mark after it: nothing the rule reads with confidence
    subject, form = _bare(tokens[i]), tokens[j].lower()
    if form in IRREGULAR:
        do, base = "did", IRREGULAR[form]
    elif form.endswith("ed"):  # "enjoyed" -> enjoy, "loved" -> love, "stopped" -> stop, "tried" -> try
        do, base = "did", next((b for b in (form[:-2], form[:-1], form[:-3], form[:-3] + "y") if b in verbs), None)
    elif DO_BY_SUBJECT[subject] == "does":  # "deserves" -> deserve, "watches" -> watch, "tries" -> try
        do, base = "does", next((b for b in (form[:-1], form[:-2], form[:-3] + "y") if form.endswith("s")
                                 and b in verbs), None)
    else:
        do, base = "do", form if form in verbs else None
    if not base:
        return None
    if never:
        return Edit(" ".join([*tokens[: i + 1], "never", *tokens[i + 1:]]), " ".join(tokens), _scope(tokens, i + 1))
    negation = [do + "n't"] if contract else [do, "not"]
    edited = [*tokens[: i + 1], *negation, *tokens[i + 1: j], base, *tokens[j + 1:]]
    return Edit(" ".join(edited), " ".join(tokens), _scope(tokens, i + 1))


def _reword(token: str, word: str) -> str:
    """``token`` with its word replaced by ``word``, keeping a capital first letter and the marks around it."""
    core = re.search(r"[A-Za-z]+['\u2019]?[A-Za-z]*", token)
    word = word.capitalize() if core.group()[0].isupper() else word
    return token[:core.start()] + word + token[core.end():]


def _unnegated(edited: list[str], start: int) -> Edit:
    """The edit that took a negation out: ``edited`` (tokens) is both the text and its plain side, the scope read
    from ``edited[start]``."""
    text = " ".join(edited)
    return Edit(text, text, _scope(edited, start))


def negate(sentence: str, verbs: frozenset[str] = frozenset(), contract: bool = False, negators: str = "not",
           draw: float = 1.0) -> Edit | None:
    """The sentence with the negation of its first negated or negatable verb toggled, or None when it has neither.
    ``verbs``: the base forms of lexical verbs (``Lexicon.verbs``); with none, only copulas and modals are negated.
    ``contract``: a negation put in is contracted where English contracts it ("wasn't", "didn't").
    ``negators`` (``NEGATION_FORMS``): "not" reads and writes "not" and "n't" alone; "never" also takes "never" out
    ("I never liked it." -> "I liked it.") and puts it in where ``draw``, a number in [0, 1), falls under its share
    (``NEVER_AFTER_COPULA``, ``NEVER_AFTER_PRONOUN``); "varied" does the same with "no" too ("It was no gem." ->
    "It was a gem.", and in for an indefinite predicate under ``NO_SHARE``).

    "The film is a mess." -> "The film is not a mess."; "It's fun." -> "It's not fun."; "It wasn't funny." ->
    "It was funny."; "It was not funny." -> "It was funny."; "It was never dull." -> "It was dull."; "I loved it."
    -> "I did not love it."; "I never laughed." (a negation with no verb to undo) -> None.
    """
    never, no = negators in ("never", "varied"), negators == "varied"
    tokens = sentence.split(" ")
    for i, token in enumerate(tokens):
        word = _bare(token)
        if verbs and i == 0 and word in DO_BY_SUBJECT and token.isalpha():  # the main clause's subject
            if never and len(tokens) > 2 and tokens[1] == "never":  # "I never liked it." -> "I liked it."
                return _unnegated([tokens[0], *tokens[2:]], 1)
            edit = _do_support(tokens, i, verbs, contract, never=never and draw < NEVER_AFTER_PRONOUN)
            if edit is not None:
                return edit
        if word in UNNEGATED:  # "wasn't" -> "was", keeping the case and the punctuation around it
            return _unnegated([*tokens[:i], _reword(token, UNNEGATED[word]), *tokens[i + 1:]], i + 1)
        following = _bare(tokens[i + 1]) if i + 1 < len(tokens) else ""
        if word in TAKES_NOT or (word.endswith("'s") and word[:-2] in IS_CONTRACTED):
            if following in ("not", "never"):  # "was not" -> "was"
                return _unnegated([*tokens[: i + 1], *tokens[i + 2:]], i + 1)
            after = _bare(tokens[i + 2]) if i + 2 < len(tokens) else ""
            if no and following == "no" and after.isalpha() and after not in NO_PHRASES:
                return _unnegated([*tokens[: i + 1], "an" if after[0] in "aeiou" else "a", *tokens[i + 2:]],
                                  i + 1)   # "was no gem" -> "was a gem"
            if following in NEGATION_WORDS or not following.isalpha() or token[-1] in ",;:.!?":
                return None  # "was no ...", "is, " : nothing the rule can toggle
            if no and following in ARTICLES and draw < NO_SHARE:   # "is a gem" -> "is no gem": the article goes
                return Edit(" ".join([*tokens[: i + 1], _reword(tokens[i + 1], "no"), *tokens[i + 2:]]), sentence,
                            _scope(tokens, i + 1))
            if never and following not in ARTICLES and draw < NEVER_AFTER_COPULA:
                negation = [token, "never"]
            else:
                negation = ([_reword(token, CONTRACTED[word])] if contract and word in CONTRACTED
                            else [token, "not"])  # "was" -> "wasn't" or "was not"
            return Edit(" ".join([*tokens[:i], *negation, *tokens[i + 1:]]), sentence, _scope(tokens, i + 1))
        if word in NEGATION_WORDS:  # "never", "no one": a negation the rule cannot undo
            return None
    return None


def negated(sentence: str) -> bool:
    """Whether the sentence holds a negation word."""
    return any(w in NEGATION_WORDS for w in words(sentence))


def _conjugated(word: str, seen: set[str]) -> bool:
    """Whether a word that followed "didn't" is a lexical verb's base form: its past and -ing forms are among the
    ``seen`` words, or it is an irregular verb's ("the" and "really" follow "didn't" too, but no "theed" is
    written). The auxiliaries are left to the other rules."""
    if word in ("be", "have", "do") or _adverb(word) or len(word) < 2:
        return False
    if word in IRREGULAR.values():
        return True
    past = {word + "ed", word + "d", word + word[-1] + "ed", word[:-1] + "ied"}
    present_participle = {word + "ing", word[:-1] + "ing", word + word[-1] + "ing", word[:-2] + "ying"}
    return bool(past & seen) and bool(present_participle & seen)


def nbsvm_ratios(holding: np.ndarray, documents: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """Wang and Manning's NBSVM ratios. ``holding`` (2, V): how many documents of each class hold each word;
    ``documents`` (2,): each class's documents -> (V,): log of the share of the second class's documents holding the
    word over the share of the first's, add-``alpha`` smoothed (> 0 leans to the second class)."""
    return (np.log((holding[1] + alpha) / (documents[1] + alpha))
            - np.log((holding[0] + alpha) / (documents[0] + alpha)))


@dataclass
class Lexicon:
    """Per-word log-count ratios of a two-class corpus (``nbsvm_ratios`` of the words of normalised text)."""

    ratio: dict[str, float]
    # Base forms of lexical verbs, for "do"-support (``negate``): the words seen after "didn't", "do not", ...
    verbs: frozenset[str] = frozenset()

    @classmethod
    def fit(cls, texts: Iterable[str], labels: Iterable[int], alpha: float = 1.0, min_count: int = 5) -> "Lexicon":
        counts = (Counter(), Counter())
        after_do: Counter = Counter()
        docs = [0, 0]
        for text, label in zip(texts, labels):
            counts[label].update(set(words(text)))
            after_do.update(_AFTER_DO.findall(text.lower()))
            docs[label] += 1
        vocab = [w for w in counts[0].keys() | counts[1].keys() if counts[0][w] + counts[1][w] >= min_count]
        seen = set(vocab)
        verbs = frozenset(w for w, n in after_do.items() if n >= min_count and _conjugated(w, seen))
        holding = np.array([[c[w] for w in vocab] for c in counts], dtype=np.float64).reshape(2, len(vocab))
        return cls(dict(zip(vocab, nbsvm_ratios(holding, np.asarray(docs), alpha).tolist())), verbs)

    def score(self, sentence: str) -> float:
        """Summed ratios of the sentence's distinct words, negation words left out: > 0 reads as the second
        class."""
        return sum(self.ratio.get(w, 0.0) for w in set(words(sentence)) if w not in NEGATION_WORDS)


def polar_sentences(text: str, label: int, lexicon: Lexicon, margin: float) -> list[str]:
    """The sentences of a review (normalised text, label 0/1) that say its label plainly: no question and no
    negation, MIN_WORDS to MAX_WORDS words, read by the lexicon as the label by at least ``margin``."""
    sign = 2 * label - 1
    return [s for s in sentences(text) if not s.endswith("?") and MIN_WORDS <= len(words(s)) <= MAX_WORDS
            and whole(s) and not negated(s) and sign * lexicon.score(s) >= margin]


def contrast_joins(texts: Sequence[str], labels: Sequence[int], lexicon: Lexicon, margin: float = 2.0,
                   seed: int = 0) -> tuple[list[str], list[int]]:
    """"A, but b." texts pairing a positive sentence with a negative one from another review (``polar_sentences``,
    one drawn from each review), each pair both ways round and labelled by the sentence after "but". Returns the
    texts (a-but-b, b-but-a, ...) and their labels."""
    rng = np.random.default_rng(seed)
    drawn: tuple[list[str], list[str]] = ([], [])
    for text, label in zip(texts, labels):
        found = polar_sentences(text, label, lexicon, margin)
        if found:
            drawn[label].append(found[rng.integers(len(found))])
    negative, positive = (list(rng.permutation(d)) for d in drawn)

    def join(first: str, second: str) -> str:
        return f"{first.rstrip('.!? ')}, but {second[0].lower()}{second[1:]}"

    out_texts: list[str] = []
    out_labels: list[int] = []
    for neg, pos in zip(negative, positive):
        out_texts += [join(pos, neg), join(neg, pos)]
        out_labels += [0, 1]
    return out_texts, out_labels


def negation_pairs(texts: Sequence[str], labels: Sequence[int], lexicon: Lexicon, margin: float = 1.0,
                   per_review: int = 1, seed: int = 0, negators: str = "not") -> tuple[list[str], list[int]]:
    """Up to ``per_review`` (sentence, edit) pairs from each two-class review (normalised text, label 0/1), in
    review order. A sentence qualifies when it is no question, has MIN_WORDS to MAX_WORDS words and no contrasting word
    ("but", "although", ...: the clause after it would have a say in the edit's label), ``negate`` can edit it, and the
    lexicon reads the words in the negation's scope, un-negated, as the label the un-negated side gets, by at least
    ``margin``, while the words outside the scope lean that way or not at all (so the edit flips what carries the
    sentence). ``negators``: which negations the edits put in and take out (``negate``). Returns the texts
    (sentence, edit, sentence, edit, ...) and their labels."""
    rng = np.random.default_rng(seed)
    out_texts: list[str] = []
    out_labels: list[int] = []
    for text, label in zip(texts, labels):
        found = []
        for sentence in sentences(text):
            if sentence.endswith("?") or not MIN_WORDS <= len(words(sentence)) <= MAX_WORDS or not whole(sentence):
                continue  # a question's label is not its statement's
            # "not" draws nothing more, so its edits stay those made before --negators existed.
            edit = negate(sentence, lexicon.verbs, contract=bool(rng.integers(2)), negators=negators,
                          draw=float(rng.random()) if negators != "not" else 1.0)
            if edit is None or negated(edit.plain) or CLAUSE_WORDS & set(words(sentence)):
                continue  # a second negation, or a contrast ("..., but ..."), would make the edit's label a guess
            sign = 2 * (label if edit.plain == sentence else 1 - label) - 1
            in_scope = sign * sum(lexicon.ratio.get(w, 0.0) for w in set(edit.scope))
            rest = sign * lexicon.score(" ".join(w for w in words(edit.plain) if w not in edit.scope))
            if in_scope >= margin and rest > -margin / 2:
                found.append((sentence, edit.text))
        for k in rng.permutation(len(found))[:per_review]:
            sentence, edit = found[k]
            out_texts += [sentence, edit]
            out_labels += [label, 1 - label]
    return out_texts, out_labels
