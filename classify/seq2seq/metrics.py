"""How good a translation model is: teacher-forced loss and perplexity, BLEU and chrF (sacreBLEU)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..engine.device import autocast, to_device
from ..errors import ClassifyError
from ..models import Transformer
from ..text.batching import BucketBatchSampler
from .data import PairCollate, Parallel, decode_ids, encode_side, pair_lengths, special_ids
from .translate import translate_ids


def summed_loss(model: Transformer, batch: dict[str, torch.Tensor], pad_id: int,
                label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the real target tokens of a batch, and their number.

    logits (B, T, V) are scored in fp32 against ``tgt_out`` (B, T); padding is ignored.
    """
    logits = model(batch["src"], batch["tgt_in"])
    labels = batch["tgt_out"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=pad_id,
                           label_smoothing=label_smoothing, reduction="sum")
    return loss, int((labels != pad_id).sum())


@torch.inference_mode()
def corpus_loss(model: Transformer, src_ids: list[list[int]], tgt_ids: list[list[int]], bos_id: int,
                device: torch.device, dtype: torch.dtype | None, max_tokens: int) -> dict[str, float]:
    """Teacher-forced negative log-likelihood per target token (nats, no label smoothing)."""
    model.eval()
    pad_id = model.config.pad_id
    sampler = BucketBatchSampler(pair_lengths(src_ids, tgt_ids), max_tokens=max_tokens, shuffle=False)
    collate = PairCollate(src_ids, tgt_ids, pad_id, bos_id)
    total, tokens = 0.0, 0
    for indices in sampler:
        batch = to_device(collate(indices), device)
        with autocast(device, dtype):
            loss, n = summed_loss(model, batch, pad_id)
        total, tokens = total + float(loss), tokens + n
    return {"nll": total, "tokens": tokens, "loss": total / max(tokens, 1),
            "perplexity": math.exp(min(total / max(tokens, 1), 50.0))}


def bleu_scores(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus scores of detokenized hypotheses against raw references (one reference each).

    ``bleu``: sacreBLEU's standard score (its own 13a tokenization, cased), comparable across
    papers. ``bleu_lowercase``: the same with both sides lower-cased: close to the "tokenized,
    lower-cased BLEU" of older tutorials (which tokenized with spaCy/Moses and lower-cased
    before building the vocabulary). ``chrf``: character n-gram F-score (chrF2).
    """
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ImportError:
        raise ClassifyError("BLEU needs sacrebleu: pip install 'classify[seq2seq]'") from None
    if len(hypotheses) != len(references):
        raise ClassifyError(f"{len(hypotheses)} translations for {len(references)} references")
    metrics = {"bleu": BLEU(), "bleu_lowercase": BLEU(lowercase=True), "chrf": CHRF()}
    scores = {name: metric.corpus_score(hypotheses, [references]) for name, metric in metrics.items()}
    result: dict[str, Any] = {name: round(score.score, 2) for name, score in scores.items()}
    result["signatures"] = {name: str(metric.get_signature()) for name, metric in metrics.items()}
    return result


def evaluate_split(model: Transformer, tokenizer: Tokenizer, pairs: Parallel, device: torch.device,
                   dtype: torch.dtype | None, beam_size: int, length_penalty: float, batch_size: int,
                   max_tokens: int) -> tuple[dict[str, Any], list[str]]:
    """Loss, perplexities and BLEU/chrF of ``model`` on ``pairs``. Returns (metrics, translations).

    ``perplexity`` is per BPE token (EOS included) and depends on the vocabulary;
    ``word_perplexity`` spreads the same total log-likelihood over the reference's words
    (sacreBLEU 13a tokens) plus one EOS, which is closer to the per-word perplexities of
    word-level tutorials.
    """
    _, bos_id, eos_id = special_ids(tokenizer)
    max_len = model.config.max_len
    src_ids, tgt_ids = encode_side(tokenizer, pairs.src, max_len), encode_side(tokenizer, pairs.tgt, max_len)
    loss = corpus_loss(model, src_ids, tgt_ids, bos_id, device, dtype, max_tokens)
    t0 = time.monotonic()
    generated = translate_ids(model, src_ids, bos_id, eos_id, device, dtype, beam_size, length_penalty, batch_size)
    hypotheses = [decode_ids(tokenizer, ids) for ids in generated]
    seconds = time.monotonic() - t0
    metrics = bleu_scores(hypotheses, pairs.tgt)
    words = sum(len(ref_words) + 1 for ref_words in _words(pairs.tgt))
    metrics.update({"loss": round(loss["loss"], 4), "perplexity": round(loss["perplexity"], 3),
                    "word_perplexity": round(math.exp(min(loss["nll"] / words, 50.0)), 3),
                    "target_tokens": loss["tokens"], "target_words": words, "sentences": len(pairs),
                    "beam_size": beam_size, "length_penalty": length_penalty, "decode_seconds": round(seconds, 1)})
    return metrics, hypotheses


def _words(texts: list[str]) -> list[list[str]]:
    """sacreBLEU's 13a tokenization of each text."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    return [tokenize(t).split() for t in texts]
