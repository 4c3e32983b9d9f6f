"""Which words pushed a prediction: integrated gradients on the token embeddings, summed per word.

For a review with token embeddings ``x``, the attribution of token ``t`` to class ``c`` is

    x_t . mean_k grad_{x_t} f_c(alpha_k * x)

where ``f_c`` is the log-odds of class ``c`` (its logit minus the log-sum-exp of the others).
``steps=1`` (alpha = 1) is plain gradient x input; more steps give integrated gradients
(Sundararajan et al. 2017) against an all-zero token embedding (positions kept), with the
midpoint rule alpha_k = (k - 1/2) / steps: its attributions add up to ``f_c(x) - f_c(0)``
within a few percent at 32 steps, where the right-endpoint rule is still ~40% off. All steps
run as one batch, in fp32.

With the n-gram branch (``classify.ngrams``), each token also gets its exact share of the branch's
logits: every n-gram's weight split evenly over its words.

Tokens are summed into whitespace-separated words of the normalised review (what the
tokenizer saw). Long reviews are explained only where the model read them: with head+tail
truncation the middle is shown as a gap.
"""

from __future__ import annotations

import bisect
import html
import re
from dataclasses import dataclass

import numpy as np
import torch
from rich.text import Text

from .inference import LoadedRun
from .text.data import normalize
from .text.tokenize import truncate

_WORD = re.compile(r"\S+")


@dataclass
class Explanation:
    """Word attributions over the normalised text of one review."""

    text: str                              # the normalised review
    target: int                            # the class explained (``explained_class``)
    words: list[tuple[int, int, float]]    # (start, end, score) of each word the model read, in order
    segments: list[tuple[int, int]]        # character ranges the model read (two when the middle was cut)

    def word_scores(self) -> list[tuple[str, float]]:
        return [(self.text[start:end], score) for start, end, score in self.words]


def explained_class(probabilities: np.ndarray) -> int:
    """The class a review's words are explained towards: with two classes always the second (positive), so
    green means "pushed towards positive" on every answer, a wrong one included (a word's colour then shows what it
    did, not whether it agreed with the answer); with more classes the predicted one."""
    return 1 if len(probabilities) == 2 else int(np.argmax(probabilities))


def token_attributions(run: LoadedRun, ids: list[int], target: int, steps: int, device: torch.device) -> np.ndarray:
    """Attribution of each token in ``ids`` (one review) to the log-odds of class ``target``."""
    model = run.model
    alphas = (torch.arange(steps, device=device, dtype=torch.float32) + 0.5) / steps if steps > 1 \
        else torch.ones(1, device=device)
    alphas = alphas.view(-1, 1, 1)
    captured: dict[str, torch.Tensor] = {}

    def scale_embeddings(module, inputs, output):
        # Replace the token embeddings by alpha-scaled copies we can differentiate against.
        captured["x"] = output.detach()[:1]
        captured["scaled"] = (output.detach() * alphas).requires_grad_()
        return captured["scaled"]

    hook = model.embed.tokens.register_forward_hook(scale_embeddings)
    try:
        with torch.enable_grad():
            tokens = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)[None].expand(steps, -1)
            logits = model(tokens).float()
            others = torch.cat([logits[:, :target], logits[:, target + 1:]], dim=1)
            log_odds = logits[:, target] - torch.logsumexp(others, dim=1)
            (grads,) = torch.autograd.grad(log_odds.sum(), captured["scaled"])
    finally:
        hook.remove()
    scores = (captured["x"][0] * grads.mean(dim=0)).sum(dim=-1).cpu().numpy()
    if model.ngram is not None:
        # The n-gram branch does not read the embeddings: add its exact per-token shares, weighted by the
        # log-odds' slope in each logit at the review (e_target - softmax(others); exact for two classes).
        with torch.no_grad():
            full = model(tokens[:1]).float()[0]
            slope = -torch.cat([full[:target], full[target + 1:]]).softmax(dim=0)
            direction = torch.cat([slope[:target], torch.ones(1, device=slope.device), slope[target:]])
        weight = float(model.mix_weights(torch.tensor([len(ids)]))[0, 1])   # the branch's weight at this length
        scores = scores + weight * model.ngram.token_contributions(ids, direction)
    return scores


def explain(run: LoadedRun, text: str, target: int, steps: int, device: torch.device) -> Explanation:
    """Explain the model's score for class ``target`` on raw review ``text``.

    The tokens are those of the run's ``Preprocessing`` (same normalisation, tokenizer, typing-slip
    correction and truncation); the tokenizer's offsets map them back to words.
    """
    normalized = normalize(text)
    [(ids, offsets, _)] = run.preprocessing.tokens([normalized])
    kept = truncate(list(range(len(ids))), run.max_len, run.truncation)
    if not kept:
        return Explanation(normalized, target, [], [])
    scores = token_attributions(run, [ids[i] for i in kept], target, steps, device)

    spans = [m.span() for m in _WORD.finditer(normalized)]
    starts = [start for start, _ in spans]
    word_score: dict[int, float] = {}
    for position, score in zip(kept, scores):
        word = bisect.bisect_right(starts, offsets[position][0]) - 1
        word_score[word] = word_score.get(word, 0.0) + float(score)
    words = [(*spans[w], s) for w, s in sorted(word_score.items())]

    # Contiguous runs of kept words are the parts of the text the model read.
    segments: list[tuple[int, int]] = []
    previous = None
    for w in sorted(word_score):
        if previous is not None and w == previous + 1:
            segments[-1] = (segments[-1][0], spans[w][1])
        else:
            segments.append(spans[w])
        previous = w
    return Explanation(normalized, target, words, segments)


# ------------------------------------------------------------------------ rendering
def pieces(explanation: Explanation):
    """The text the model read as (text, score, weight) pieces, weight = score / largest |score| (drawn by
    ``to_rich``, ``to_html`` and the web page of ``classify.serve``).
    Text between words has score None; a piece ("", None, None) marks the truncated middle."""
    scale = max((abs(s) for _, _, s in explanation.words), default=0.0) or 1.0
    words = iter(explanation.words)
    word = next(words, None)
    for n, (start, end) in enumerate(explanation.segments):
        if n:
            yield "", None, None
        position = start
        while word is not None and word[1] <= end:
            w_start, w_end, score = word
            if w_start > position:
                yield explanation.text[position:w_start], None, None
            yield explanation.text[w_start:w_end], score, score / scale
            position = w_end
            word = next(words, None)


def legend(labels: list[str], target: int) -> tuple[str, str]:
    """What green and red mean for an explanation towards class ``target``: ("towards pos", "towards neg") with
    two classes, else ("towards X", "against X")."""
    towards = f"towards {labels[target]}"
    return towards, (f"towards {labels[1 - target]}" if len(labels) == 2 else f"against {labels[target]}")


def _rgb(weight: float) -> tuple[int, int, int]:
    """White to green (towards the explained class) or white to red (against it)."""
    fade = int(255 - 155 * min(abs(weight), 1.0))
    return (fade, 255, fade) if weight > 0 else (255, fade, fade)


def to_rich(explanation: Explanation) -> Text:
    """The review as coloured terminal text (words with |weight| < 0.1 stay plain, for readability)."""
    out = Text()
    for piece, _, weight in pieces(explanation):
        if weight is None:
            out.append(piece if piece else " … [not read by the model] … ", style=None if piece else "dim italic")
        elif abs(weight) < 0.1:
            out.append(piece)
        else:
            out.append(piece, style="black on rgb({},{},{})".format(*_rgb(weight)))
    return out


def to_html(explanation: Explanation, heading: str) -> str:
    """One review as an HTML snippet. All text is escaped, and non-ASCII characters become character
    references, so the snippet is safe to embed and displays the same in any page encoding."""
    parts = [f'<div class="classify-explanation" style="margin:1em 0;line-height:1.7">\n'
             f'<div style="font-weight:bold">{html.escape(heading)}</div>\n<p>']
    for piece, score, weight in pieces(explanation):
        if weight is None:
            parts.append(html.escape(piece) if piece else '<span style="color:#888"> … [not read by the model] … </span>')
        else:
            r, g, b = _rgb(weight)
            parts.append(f'<span style="background-color:rgb({r},{g},{b})" title="{score:+.3f}">'
                         f'{html.escape(piece)}</span>')
    parts.append("</p>\n</div>\n")
    return "".join(parts).encode("ascii", "xmlcharrefreplace").decode("ascii")
