"""The classifier's n-gram branch: a bag of hashed word n-grams read from the same token ids.

Why it exists: on IMDB a linear model over naive-Bayes-weighted uni-, bi- and trigrams (NBSVM,
Wang & Manning 2012) beats a small transformer trained from scratch. The branch gives the
classifier that evidence explicitly, as part of the model (weights in ``model.safetensors``, sizes
in ``config.json``), so predict, evaluate, explain and the server use it without knowing it is there.

How it works:

* ``ngram_ids``: every n-gram of orders 1..``orders`` of a right-padded id tensor is hashed to one
  of ``buckets`` slots by exact integer arithmetic (the n-gram's ids as digits in base vocab+1, modulo
  a bucket count), the same on every process, platform and device. N-grams never span padding.
  Each row keeps a slot once (binary features: NBSVM's best variant), padding slots point at an
  extra all-zero row. Optional ``families`` add features of their own (salted slots): pairs of tokens
  one apart, and the n-grams of a review's first and last tokens, where the verdict tends to be.
* Negation marking (Das & Chen 2001, Pang et al. 2002: "was not good" -> "was not NOT_good"): a word
  within ``negation`` tokens after a negator ("not", "no", "never", the "t" of "n't", ...), with no
  clause break (punctuation, "but") between, is another word, NOT_word, in every family: its digit
  is shifted by vocab + 1 (the base doubles). So "not boring" no longer carries the weight of
  "boring", the most negative word of the corpus, and neither does the skip-bigram "was * boring" nor
  "boring" among the last tokens of a review. With ``ellipsis`` the marking also reaches back: a negated
  auxiliary whose verb is left out denies the clause before it ("I thought it would be good, but it
  wasn't."), whose last words become NOT_word too (``ellipsis_scope``).
* ``NgramBag``: logits (B, C) = sum over a review's slots of ``weight[slot]`` + bias: an embedding bag
  in sum mode. ``weight`` holds the coefficients of a logistic regression fitted on naive-Bayes-scaled
  features, times those scales (the naive-Bayes log-count ratios), folded into one table. Most slots of
  a large table stay zero; weights files keep only the others (``classify.engine.files.pack_rows``).
* ``fit_ngram_bag``: that fit, by scikit-learn's liblinear solver (an exact L2-regularised solution;
  Adam on the same features stays three points short of it), run once at training time; only its
  coefficients are kept.
* ``self_train_ngram_bag``: the same fit, then unlabelled reviews labelled by it, then the fit again
  on both (self-training): n-grams that occur only beside known evidence in the unlabelled text get
  weights of their own. On IMDB's 50,000 unlabelled reviews: +0.2 points on test for plain
  1-3-grams alone, nothing with the other families (``classify.train`` leaves it off by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from .engine.files import exact_half, signed_column
from .text.batching import pad_batch
from .text.prepare import TokenIds

# The n-gram's ids are digits in base (vocab_size + 1); three of them must fit an int64.
MAX_VOCAB = 2_097_150
# Hash slots of a branch built without a size (a prime: spreads the n-gram codes evenly). Enough for plain
# 1-3-grams; classify.train's recipe, with more families, asks for 16.8M (models.RECIPE).
DEFAULT_BUCKETS = 4_194_301


@dataclass(frozen=True)
class Family:
    """One kind of n-gram the branch reads: token ``offsets`` from its start ((0, 1) a bigram, (0, 2) a bigram
    that skips a token) and where in the review it must lie (``head``: within the first ``within`` tokens,
    ``tail``: within the last ``within``, ``all``: anywhere)."""

    offsets: tuple[int, ...]
    where: str = "all"        # "all" | "head" | "tail"
    within: int = 0

    def salt(self, buckets: int) -> int:
        """Added to every slot of a family that is not a plain n-gram: "good" at the end of a review and
        "good" anywhere are different features."""
        if self.where == "all" and self.offsets == tuple(range(len(self.offsets))):
            return 0  # plain n-grams hash as they did before the other families existed
        key = (len(self.offsets), self.offsets[-1], ("all", "head", "tail").index(self.where), self.within)
        return sum(k * 0x9E3779B1 ** (i + 1) for i, k in enumerate(key)) % buckets


def families(orders: int, skip_bigrams: bool = False, head: int = 0, tail: int = 0) -> list[Family]:
    """The n-gram families of a branch: orders 1..``orders`` anywhere; with ``skip_bigrams``, the pairs of
    tokens one apart ("not * good"); with ``head``/``tail`` > 0, orders 1..``orders`` again, as separate
    features, for the n-grams within a review's first ``head`` and last ``tail`` tokens (where reviews tend
    to state their verdict)."""
    plain = [tuple(range(n)) for n in range(1, orders + 1)]
    out = [Family(o) for o in plain]
    if skip_bigrams:
        out.append(Family((0, 2)))
    out += [Family(o, "head", head) for o in plain if head] + [Family(o, "tail", tail) for o in plain if tail]
    return out


def describe(kinds: list[Family], negation: int = 0, ellipsis: int = 0) -> str:
    """What a branch reads, in words: "1-3-grams, skip-bigrams, 1-3-grams of the first 30 / last 60 tokens,
    negation marked over 4 tokens, clauses denied by an elided negation over 4 words"."""
    def orders(fs: list[Family]) -> str:
        return f"1-{max(len(f.offsets) for f in fs)}-grams"

    parts = [orders([f for f in kinds if f.where == "all" and f.offsets[-1] + 1 == len(f.offsets)])]
    parts += ["skip-bigrams"] * any(f.offsets == (0, 2) for f in kinds)
    ends = [f"{where} {fs[0].within}" for where, fs in
            (("first", [f for f in kinds if f.where == "head"]), ("last", [f for f in kinds if f.where == "tail"])) if fs]
    if ends:
        parts.append(f"{orders([f for f in kinds if f.where in ('head', 'tail')])} of the {' / '.join(ends)} tokens")
    parts += [f"negation marked over {negation} tokens"] * bool(negation)
    parts += [f"clauses denied by an elided negation over {ellipsis} words"] * bool(ellipsis)
    return ", ".join(parts)


def _shift(x: Tensor, d: int, fill: bool) -> Tensor:
    """x (B, T) bool -> (B, T): ``x`` moved ``d`` positions to the right, ``fill`` coming in from the left. Valid
    for any T, also T <= d, with no branch on T (an exported graph has one for every T)."""
    return torch.cat([torch.full_like(x[:, :1], fill).expand(-1, d), x], dim=1)[:, : x.shape[1]]


def _member(tokens: Tensor, ids: Tensor) -> Tensor:
    """tokens (B, T) -> (B, T) bool: the token is one of ``ids`` (K,). A count, not ``any``: ONNX Runtime's
    reduction behind an exported ``any`` comes out True over K = 0 ids (a vocabulary without the negators)."""
    return (tokens.unsqueeze(-1) == ids).sum(-1) > 0


def _ahead(x: Tensor, d: int, fill: bool) -> Tensor:
    """x (B, T) bool -> (B, T): position i reads ``x`` at i + ``d``, ``fill`` past the end. Valid for any T, as
    ``_shift``."""
    return torch.cat([x, torch.full_like(x[:, :1], fill).expand(-1, d)], dim=1)[:, d:]


def ellipsis_scope(tokens: Tensor, auxiliaries: Tensor, negators: Tensor, breaks: Tensor, pad_id: int,
                   within: int) -> Tensor:
    """tokens (B, T) -> (B, T) bool: the token is one of the last ``within`` words, with no clause break among
    them, of a clause that a negated auxiliary with its verb left out denies: "I thought it would be good, but it
    wasn't." and "Everyone said the acting was good. It was not." read "good" as NOT_good. The denial is one or two
    breaks (",", ", but", "."), a subject of one or two words, an auxiliary, then a negator right after it ("was
    not") or one token later ("wasn ' t"), then a break or the text's end. ``auxiliaries``, ``negators``,
    ``breaks``: token ids (K,). Comparisons and shifts only, as ``negation_scope``."""
    brk, aux, neg = (_member(tokens, ids) for ids in (breaks, auxiliaries, negators))      # (B, T) each
    end = brk | (tokens == pad_id)                                                        # (B, T)
    # Each shift once: the 8 forms below read the same few offsets. ``clear``: a token that is no break (none
    # past the end).
    brk_at = [_ahead(brk, d, False) for d in range(7)]
    clear_at = [_ahead(~brk, d, False) for d in range(7)]
    last = torch.zeros_like(brk)       # last[:, i]: the denied clause's last word is token i
    for b in (1, 2):                   # breaks after the clause
        for s in (1, 2):               # words of the subject
            for n in (1, 2):           # the negator's distance from the auxiliary
                at = b + s + 1         # the auxiliary's distance from the clause's last word
                found = clear_at[0] & _ahead(aux, at, False) & _ahead(neg, at + n, False) & _ahead(end, at + n + 1,
                                                                                                   True)
                for d in range(1, at + n):   # the breaks, then the subject and what lies between aux and negator
                    found = found & (brk_at[d] if d <= b else clear_at[d])
                last = last | found
    scope = torch.zeros_like(last)
    run = torch.ones_like(last)        # run[:, i]: no break in positions i .. i+d
    for d in range(within):
        run = run & ~_ahead(brk, d, False)
        scope = scope | (_ahead(last, d, False) & run)
    return scope


def negation_scope(tokens: Tensor, negators: Tensor, breaks: Tensor, within: int) -> Tensor:
    """tokens (B, T) -> (B, T) bool: the token follows a negator by 1..``within`` positions with no clause
    break among the tokens after the negator up to and including itself. ``negators``, ``breaks``: token ids
    (K,). Comparisons and shifts only (no cumulative ops), so it exports to ONNX as it is."""
    negator = _member(tokens, negators)                           # (B, T)
    clear = ~_member(tokens, breaks)                              # (B, T): not a break
    scope = torch.zeros_like(negator)
    run = torch.ones_like(negator)   # run[:, i]: no break in positions i-d+1 .. i
    for d in range(1, within + 1):
        run = run & _shift(clear, d - 1, True)
        scope = scope | (_shift(negator, d, False) & run)
    return scope


def family_slots(tokens: Tensor, pad_id: int, vocab_size: int, buckets: int, kinds: list[Family],
                 scope: Tensor | None = None) -> list[Tensor]:
    """tokens (B, T), right-padded -> per family, the slot of its n-gram starting at each position, (B, T);
    ``buckets`` (the padding slot) where there is none: the n-gram would include padding or run past the end,
    or lies outside the family's part of the review. ``scope`` (B, T) bool (``negation_scope``): the words read
    as NOT_word (their digit shifted by ``vocab_size + 1``, the base doubled); None: no marking, and plain
    n-grams hash as they always have."""
    t = tokens.shape[1]
    # Padded by the longest span, every family has an n-gram (maybe of padding) at each of the T positions: no
    # branch on T, so one exported graph serves every length, a one-token text included.
    longest = max(f.offsets[-1] for f in kinds)
    tokens = torch.cat([tokens, torch.full_like(tokens[:, :1], pad_id).expand(-1, longest)], dim=1)
    digits = tokens.long() + 1                            # 0 stays free for "no token"
    base = vocab_size + 1
    if scope is not None:                                 # NOT_word: a word of its own
        scope = torch.cat([scope, torch.zeros_like(scope[:, :1]).expand(-1, longest)], dim=1)
        digits, base = digits + scope.long() * base, 2 * base
    real = tokens != pad_id
    lengths = real.sum(dim=1, keepdim=True)               # right-padded: real tokens are 0 .. length-1
    start = torch.arange(t, device=tokens.device)
    out = []
    for family in kinds:
        span = family.offsets[-1] + 1
        # code[:, i] = the n-gram starting at i: digits[i + o0] + base * digits[i + o1] + base**2 * digits[i + o2] ...
        code = sum(base ** k * digits[:, o : o + t] for k, o in enumerate(family.offsets))
        ok = torch.stack([real[:, o : o + t] for o in family.offsets]).all(dim=0)
        if family.where == "head":
            ok = ok & (start + span <= family.within)
        elif family.where == "tail":
            ok = ok & (start >= lengths - family.within)
        out.append(torch.where(ok, (code % buckets + family.salt(buckets)) % buckets, buckets))
    return out


def ngram_ids(tokens: Tensor, pad_id: int, vocab_size: int, buckets: int, kinds: list[Family],
              scope: Tensor | None = None) -> Tensor:
    """tokens (B, T) -> hashed n-gram slots (B, L), L = the positions of all ``kinds`` (see ``families``;
    ``scope`` as in ``family_slots``).

    Each row holds every distinct slot once, sorted; the rest of the row is ``buckets`` (the
    padding slot). Padding tokens never enter an n-gram.
    """
    slots = torch.cat(family_slots(tokens, pad_id, vocab_size, buckets, kinds, scope), dim=1).sort(dim=1).values
    repeated = torch.zeros_like(slots, dtype=torch.bool)
    repeated[:, 1:] = slots[:, 1:] == slots[:, :-1]
    return slots.masked_fill(repeated, buckets)


class NgramBag(nn.Module):
    """Hashed n-gram bag: tokens (B, T) -> logits (B, num_classes)."""

    def __init__(self, vocab_size: int, num_classes: int, orders: int, buckets: int, pad_id: int,
                 skip_bigrams: bool = False, head: int = 0, tail: int = 0, negation: int = 0,
                 negators: tuple[int, ...] = (), breaks: tuple[int, ...] = (), ellipsis: int = 0,
                 auxiliaries: tuple[int, ...] = ()):
        super().__init__()
        marked = bool(negation or ellipsis)
        limit = MAX_VOCAB // 2 if marked else MAX_VOCAB   # negation marking doubles the base of the digits
        if not 0 < vocab_size <= limit:
            raise ValueError(f"the n-gram branch{' with negation marking' if marked else ''} supports vocabularies "
                             f"up to {limit}, got {vocab_size}")
        self.vocab_size, self.buckets, self.pad_id = vocab_size, buckets, pad_id
        self.kinds = families(orders, skip_bigrams, head, tail)
        self.negation, self.ellipsis = negation, ellipsis
        # Token ids, not weights: buffers outside the state dict (the config holds them).
        for name, ids in (("negators", negators), ("breaks", breaks), ("auxiliaries", auxiliaries)):
            self.register_buffer(name, torch.tensor(sorted(ids), dtype=torch.long), persistent=False)
        # Row ``buckets``: padding, stays 0. The naive-Bayes scale of each slot is folded in (see the module).
        self.weight = nn.Parameter(torch.zeros(buckets + 1, num_classes))
        self.bias = nn.Parameter(torch.zeros(num_classes))
        self.register_buffer("column", None)   # the table in one column (buckets + 1,), once ``compact``

    @property
    def device(self) -> torch.device:
        return self.bias.device

    @torch.no_grad()
    def compact(self) -> bool:
        """Hold the table as one column (buckets + 1,), float16 where that is exact, instead of (buckets + 1, C)
        float32: what inference and the ONNX export need, in a quarter of the memory (34 MB for the recipe's
        16.8M slots, not 134). A two-class branch's rows are (-d/2, d/2) (``fit_features``), so column 1 carries
        them all, and the fits round the weights to float16, which holds them exactly, as the run folder stores
        them (``engine.files.pack_rows``). The logits stay the bag's own up to the order of a float32 sum (an ulp:
        at most 1.2e-7 on IMDB reviews). False, and nothing changed, for any other table. A compact bag is for
        inference: it has no ``weight`` to fit or save."""
        column = signed_column(self.weight) if self.column is None else None
        if column is None:
            return False
        del self.weight
        self.register_buffer("column", exact_half(column))
        return True

    def slot_values(self, direction: Tensor) -> Tensor:
        """Each slot's weights dotted with ``direction`` (C,) -> (buckets + 1,) float32."""
        direction = direction.float().to(self.device)
        if self.column is not None:
            return self.column.float() * (direction[1] - direction[0])
        return self.weight.float() @ direction

    @torch.no_grad()
    def word_values(self, direction: Tensor) -> Tensor:
        """Each token id's unigram slot dotted with ``direction`` (C,) -> (vocab_size,) float32: the weight the
        branch gives a word as a plain 1-gram, outside any negation scope (its NOT_word and its n-grams of the
        review's ends are features of their own). The padding id gets 0."""
        words = torch.arange(self.vocab_size, device=self.device)[:, None]                  # (V, 1)
        slots = family_slots(words, self.pad_id, self.vocab_size, self.buckets, [Family((0,))])[0][:, 0]
        return self.slot_values(direction)[slots]

    def scope(self, tokens: Tensor) -> Tensor | None:
        """tokens (B, T) -> (B, T) bool, the words read as NOT_word (``negation_scope``, ``ellipsis_scope``); None
        without marking."""
        scope = negation_scope(tokens, self.negators, self.breaks, self.negation) if self.negation else None
        if self.ellipsis:
            denied = ellipsis_scope(tokens, self.auxiliaries, self.negators, self.breaks, self.pad_id, self.ellipsis)
            scope = denied if scope is None else scope | denied
        return scope

    def slots(self, tokens: Tensor, scope: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> each text's distinct slots (B, L), the padding slot ``buckets`` after them; ``scope``:
        ``self.scope(tokens)`` when the caller has it already (None reads it here)."""
        return ngram_ids(tokens, self.pad_id, self.vocab_size, self.buckets, self.kinds,
                         self.scope(tokens) if scope is None else scope)

    def upgrade_state(self, tensors: dict[str, Tensor], prefix: str) -> None:
        """Weights written before the scale was folded in hold ``weight`` (buckets + 1, C) and ``scale``
        (buckets + 1,) apart: fold them (the very products the branch used to compute, so the logits stay)."""
        weight, scale = tensors.get(prefix + "weight"), tensors.get(prefix + "scale")
        if weight is not None and scale is not None and scale.shape == weight.shape[:1]:
            tensors[prefix + "weight"] = weight * scale[:, None].to(weight.dtype)
            del tensors[prefix + "scale"]

    @torch.no_grad()
    def token_contributions(self, ids: list[int], direction: Tensor) -> np.ndarray:
        """Each token's share of ``direction . (logits - bias)`` for one review (ids, unpadded) -> (T,).

        The branch is a sum over distinct slots, so this is exact: a slot's value is split equally
        over the tokens of all its occurrences (an n-gram seen twice counts once, as in ``forward``).
        """
        tokens = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)[None]   # (1, T)
        per_family = family_slots(tokens, self.pad_id, self.vocab_size, self.buckets, self.kinds, self.scope(tokens))
        value = self.slot_values(direction)                                              # (buckets + 1,)
        occurrences: dict[int, list[list[int]]] = {}   # slot -> the token positions of each occurrence
        for family, slots in zip(self.kinds, per_family):
            for start, slot in enumerate(slots[0].tolist()):
                if slot != self.buckets:
                    occurrences.setdefault(slot, []).append([start + o for o in family.offsets])
        shares = np.zeros(len(ids))
        for slot, where in occurrences.items():
            for positions in where:
                shares[positions] += float(value[slot]) / (len(where) * len(positions))
        return shares

    def forward(self, tokens: Tensor, scope: Tensor | None = None) -> Tensor:
        """tokens (B, T) -> logits (B, C); ``scope`` as in ``slots``."""
        slots = self.slots(tokens, scope)                                               # (B, L)
        if self.column is None:
            return slot_sum(self.weight, slots, self.buckets) + self.bias
        half = slot_sum(self.column, slots, self.buckets)                              # (B,)
        return torch.stack([-half, half], dim=1) + self.bias


def slot_sum(table: Tensor, slots: Tensor, padding: int) -> Tensor:
    """Each row's sum of ``table``'s entries at its slots, the ``padding`` slot left out: table (S,) or (S, C),
    slots (B, L) -> (B,) or (B, C), in the table's dtype or float32, whichever is wider (a float16 table is summed
    in float32).

    The entries gathered and summed: F.embedding_bag's sum within float rounding, as fast here, and ONNX exports
    it as Gather + ReduceSum, where embedding_bag becomes a loop over the bags that made the whole exported model
    4.5x slower than PyTorch."""
    dtype = torch.promote_types(table.dtype, torch.float32)
    entries = table[slots].to(dtype)                                         # (B, L) or (B, L, C)
    real = (slots != padding).to(dtype)                                      # (B, L); padding slots 0
    return (entries * real.reshape(real.shape + (1,) * (entries.dim() - 2))).sum(dim=1)


def feature_matrix(bag: NgramBag, ids: list[TokenIds], batch_size: int = 256):
    """Binary n-gram features of pre-tokenized reviews: a SciPy CSR matrix (N, buckets) of float32 ones over
    int32 slots, sorted in each row, built by the same ``ngram_ids`` the model runs, a batch at a time, on the
    bag's device."""
    import scipy.sparse as sp

    slots, counts = [np.zeros(0, dtype=np.int32)], [np.zeros(1, dtype=np.int64)]   # counts[0]: indptr's leading 0
    for start in range(0, len(ids), batch_size):
        batch = bag.slots(pad_batch(ids[start : start + batch_size], bag.pad_id).to(bag.device)).cpu()   # (B, L)
        present = batch != bag.buckets
        slots.append(batch[present].to(torch.int32).numpy())                         # row by row, in order
        counts.append(present.sum(dim=1).numpy())
    indices, indptr = np.concatenate(slots), np.cumsum(np.concatenate(counts))
    return sp.csr_matrix((np.ones(len(indices), dtype=np.float32), indices, indptr), shape=(len(ids), bag.buckets))


def naive_bayes_ratios(features, labels: np.ndarray, smoothing: float = 1.0,
                       weights: np.ndarray | None = None) -> np.ndarray:
    """log(p / q) per feature, p and q the feature counts of class 1 and class 0 plus ``smoothing`` each,
    normalised (each review counted ``weights[i]`` times when given)."""
    w = np.ones(len(labels)) if weights is None else np.asarray(weights, dtype=np.float64)
    p = smoothing + features.T @ (w * (labels == 1))
    q = smoothing + features.T @ (w * (labels == 0))
    return np.log((p / p.sum()) / (q / q.sum()))


@torch.no_grad()
def fit_ngram_bag(bag: NgramBag, ids: list[TokenIds], labels: list[int], c: float,
                  weights: np.ndarray | None = None, min_count: int = 1, smoothing: float = 1.0) -> None:
    """Fit the bag on pre-tokenized training reviews: naive-Bayes scales (two classes; 1 otherwise) and
    an L2-regularised logistic regression with inverse strength ``c`` on the scaled binary features; ``weights``
    (N,): how much each review counts (1 by default); a slot fewer than ``min_count`` texts have keeps no weight;
    ``smoothing``: the count added to each slot's two class counts in the naive-Bayes scales."""
    fit_features(bag, feature_matrix(bag, ids), np.asarray(labels), c, weights, min_count, smoothing)


def group_counts(features, groups: np.ndarray, buckets: int) -> np.ndarray:
    """How many distinct groups have each slot: binary features (N, buckets), groups (N,) int, a text of group -1
    counted in none -> (buckets,) int64. With IMDB's movies as groups (``classify.text.review_groups``), a slot one
    movie's reviews alone have (a title, a character, an actor) counts 1, however many reviews have it."""
    import scipy.sparse as sp

    groups = np.asarray(groups)
    rows = np.flatnonzero(groups >= 0)
    _, group = np.unique(groups[rows], return_inverse=True)
    membership = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (group, rows)),
                               shape=(int(group.max(initial=-1)) + 1, features.shape[0]))
    per_group = (membership @ features).tocsr()                                   # (G, buckets), > 0 where present
    return np.bincount(per_group.indices, minlength=buckets)


@torch.no_grad()
def fit_features(bag: NgramBag, features, y: np.ndarray, c: float, weights: np.ndarray | None = None,
                 min_count: int = 1, smoothing: float = 1.0, groups: np.ndarray | None = None,
                 min_groups: int = 1) -> None:
    """``fit_ngram_bag`` on the reviews' binary feature matrix (N, buckets), labels (N,) and weights (N,) or None;
    with ``groups`` (N,) int (-1: in none), a slot fewer than ``min_groups`` groups have keeps no weight either
    (``group_counts``).

    The solver sees only the K columns at least ``min_count`` reviews have (of IMDB's 16.8M slots, 6.3M at 1 and
    2.1M at 2): liblinear copies the matrix and keeps several vectors as long as its columns, and a column no
    review has gets no weight anyway (its gradient is zero). The scaled values go to it as float64 over int32
    indices, which scikit-learn passes on without a copy of its own.

    Why ``min_count``: an n-gram only one review has is mostly that review's fingerprint (a name, a phrase), and
    its weight can only learn that review's label. Leaving them out costs no accuracy on held-out reviews
    (``classify.train --ngram-min-count``) and leaves most slots without weight, which the weights file skips.

    Why ``smoothing`` (naive-Bayes' pseudo-count, 1 in NBSVM): a slot's scale is its log-count ratio, so a slot a
    few reviews of one class have is scaled as much as a common word, and the L2 penalty, paid on the coefficient,
    holds it back no more. A larger pseudo-count shrinks the rare slots' scales (a slot 3 reviews have: log 4 at 1,
    log 1.3 at 10) and hardly moves a common one's, a softer ``min_count``.
    """
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression

    binary = bag.weight.shape[1] == 2
    kept = np.bincount(features.indices, minlength=bag.buckets) >= max(1, min_count)    # (buckets,) slots fitted
    by_group = groups is not None and min_groups > 1
    if by_group:
        kept &= group_counts(features, groups, bag.buckets) >= min_groups
    if min_count > 1 or by_group:
        features = _only_columns(features, kept)
    seen, columns = _columns_in_use(features.indices, kept)                            # (K,), (nnz,)
    # Ratios over all slots (their smoothing counts every slot), then those in use; binary features: each value
    # of the scaled matrix is its column's ratio.
    scale = naive_bayes_ratios(features, y, smoothing, weights)[seen] if binary else np.ones(len(seen))  # (K,)
    solver = LogisticRegression(C=c, solver="liblinear" if binary else "lbfgs", max_iter=1000)
    solver.fit(sp.csr_matrix((scale[columns], columns, features.indptr), shape=(features.shape[0], len(seen))), y,
               sample_weight=weights)
    coef = torch.as_tensor(solver.coef_, dtype=torch.float32)            # (1, K) or (C, K)
    bias = torch.as_tensor(solver.intercept_, dtype=torch.float32)
    if binary:  # one logit difference -> two logits, symmetric around zero (same softmax)
        coef, bias = torch.cat([-coef, coef]) / 2, torch.cat([-bias, bias]) / 2
    bag.weight.zero_()
    # The scales folded in, then rounded to float16 precision, which weights files store in half the bytes
    # (classify.engine.files.pack_rows). On IMDB test this moves the branch's logits by at most 0.03 and changes
    # none of the 25,000 predictions (experiments/RESULTS.md).
    folded = coef.T * torch.as_tensor(scale, dtype=torch.float32)[:, None]
    bag.weight[torch.as_tensor(seen, device=bag.device)] = folded.to(torch.float16).float().to(bag.device)
    bag.bias.copy_(bias)


def _only_columns(features, kept: np.ndarray):
    """The binary matrix (N, buckets) with only the entries of the ``kept`` (buckets,) columns."""
    import scipy.sparse as sp

    keep = kept[features.indices]                                                               # (nnz,)
    rows = np.repeat(np.arange(features.shape[0]), np.diff(features.indptr))[keep]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=features.shape[0]))])
    return sp.csr_matrix((features.data[keep], features.indices[keep], indptr), shape=features.shape)


def _columns_in_use(indices: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column indices (nnz,), all of ``kept`` (buckets,) columns -> (the kept columns, sorted (K,), each index's
    position among them (nnz,) int32)."""
    seen = np.flatnonzero(kept)
    position = np.zeros(len(kept), dtype=np.int32)
    position[seen] = np.arange(len(seen), dtype=np.int32)
    return seen, position[indices]


@torch.no_grad()
def bag_logits(bag: NgramBag, ids: list[TokenIds], batch_size: int = 512) -> Tensor:
    """Logits (N, C) of the bag alone for pre-tokenized reviews, computed on the bag's device, returned on the CPU."""
    return torch.cat([bag(pad_batch(ids[s : s + batch_size], bag.pad_id).to(bag.device)).cpu()
                      for s in range(0, len(ids), batch_size)])


def self_train_ngram_bag(bag: NgramBag, ids: list[TokenIds], labels: list[int], unlabelled: list[TokenIds],
                         c: float, refit: bool = True, weights: np.ndarray | None = None,
                         min_count: int = 1, smoothing: float = 1.0) -> np.ndarray:
    """Fit the bag on labelled reviews (each counting ``weights[i]``, (N,), when given; slots fewer than
    ``min_count`` of the texts fitted on have get no weight; ``smoothing``: naive-Bayes' pseudo-count), label
    ``unlabelled`` with that fit (its most likely class), and, with ``refit``, fit again on all of them
    (self-training; an unlabelled review counts 1). Naive-Bayes scales are recomputed from both.

    Returns the first fit's class probabilities for the unlabelled reviews, (N, C) float32."""
    import scipy.sparse as sp

    features, y = feature_matrix(bag, ids), np.asarray(labels)
    fit_features(bag, features, y, c, weights, min_count, smoothing)
    if not unlabelled:
        return np.zeros((0, bag.weight.shape[1]), dtype=np.float32)
    probs = torch.softmax(bag_logits(bag, unlabelled).double(), dim=1).float().numpy()
    if refit:
        # The labelled reviews' features are built once and reused for the second fit.
        fit_features(bag, sp.vstack([features, feature_matrix(bag, unlabelled)]).tocsr(),
                      np.concatenate([y, probs.argmax(1).astype(y.dtype)]), c,
                      None if weights is None else np.concatenate([weights, np.ones(len(unlabelled))]), min_count,
                      smoothing)
    return probs
