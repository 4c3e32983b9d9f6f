"""Autoregressive decoding with a ``Transformer``: greedy and beam search over its key/value caches.

    tokens = generate(model, src, max_new_tokens=50, bos_id=2, eos_id=3, beam_size=4)   # (B, T)

Generation lives outside the model class (as in Hugging Face): the model computes logits for
given tokens (``Transformer.encode`` / ``decode``); this module decides which tokens come next.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .core import KVCache
from .models import Transformer


@torch.no_grad()

def generate(model: Transformer, src: Tensor, max_new_tokens: int, bos_id: int, eos_id: int, beam_size: int = 1,
             length_penalty: float = 1.0, use_cache: bool = True) -> Tensor:
    """Autoregressive decoding. src (B, S) -> tokens (B, T) starting with ``bos_id``.

    ``beam_size=1`` is greedy. Finished rows are padded with ``pad_id`` after EOS.
    ``use_cache=False`` re-runs the whole decoder every step (for tests and benchmarks).
    Beam hypotheses are ranked by log-prob / length**length_penalty.
    """
    was_training = model.training
    model.eval()
    try:
        if beam_size == 1:
            return _greedy(model, src, max_new_tokens, bos_id, eos_id, use_cache)
        return _beam(model, src, max_new_tokens, bos_id, eos_id, beam_size, length_penalty, use_cache)
    finally:
        model.train(was_training)


def _next_log_probs(model: Transformer, out: Tensor, memory: Tensor, src_mask: Tensor,
          caches: list[tuple[KVCache, KVCache]] | None) -> Tensor:
    """Log-probabilities of the next token after ``out`` (N, t). -> (N, V)"""
    new = out[:, -1:] if caches is not None else out
    logits = model.decode(new, memory, src_mask, caches)[:, -1]
    return logits.float().log_softmax(dim=-1)


def _greedy(model: Transformer, src: Tensor, max_new_tokens: int, bos_id: int, eos_id: int, use_cache: bool) -> Tensor:
    memory, src_mask = model.encode(src)
    caches = model.decoder.new_caches() if use_cache else None
    out = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(max_new_tokens):
        next_token = _next_log_probs(model, out, memory, src_mask, caches).argmax(dim=-1)
        next_token = next_token.masked_fill(done, model.config.pad_id)
        out = torch.cat([out, next_token[:, None]], dim=1)
        done |= next_token == eos_id
        if bool(done.all()):
            break
    return out


def _beam(model: Transformer, src: Tensor, max_new_tokens: int, bos_id: int, eos_id: int, beam_size: int,
          length_penalty: float, use_cache: bool) -> Tensor:
    batch, k, device = src.shape[0], beam_size, src.device
    memory, src_mask = model.encode(src)
    # Every source row repeated k times: hypotheses of batch b live in rows b*k .. b*k+k-1.
    memory, src_mask = memory.repeat_interleave(k, dim=0), src_mask.repeat_interleave(k, dim=0)
    caches = model.decoder.new_caches() if use_cache else None
    out = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep only the first alive at step 0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]

    def rank(logp: float, length: int) -> float:
        return logp / (length ** length_penalty)

    for step in range(max_new_tokens):
        logp = _next_log_probs(model, out, memory, src_mask, caches)  # (B*k, V)
        vocab = logp.shape[-1]
        total = (scores.view(-1, 1) + logp).view(batch, k * vocab)
        top_scores, top_ids = total.topk(2 * k, dim=-1)  # 2k so k can survive even if k end in EOS
        rows, tokens, new_scores = [], [], []
        for b in range(batch):
            alive: list[tuple[int, int, float]] = []
            for score, idx in zip(top_scores[b].tolist(), top_ids[b].tolist()):
                beam, token = divmod(idx, vocab)
                if score == float("-inf"):
                    break
                if len(finished[b]) >= k:
                    break  # this source is done; keep filler beams below
                if token == eos_id:
                    hyp = out[b * k + beam, 1:].tolist() + [token]
                    finished[b].append((rank(score, len(hyp)), hyp))
                else:
                    alive.append((beam, token, score))
                if len(alive) == k:
                    break
            while len(alive) < k:  # finished or exhausted source: inert filler beams
                alive.append((0, model.config.pad_id, float("-inf")))
            for beam, token, score in alive:
                rows.append(b * k + beam)
                tokens.append(token)
                new_scores.append(score)
        index = torch.tensor(rows, device=device)
        out = torch.cat([out.index_select(0, index), torch.tensor(tokens, device=device)[:, None]], dim=1)
        scores = torch.tensor(new_scores, device=device).view(batch, k)
        if caches is not None:
            for self_cache, _ in caches:
                self_cache.reorder(index)
        if all(len(f) >= k for f in finished):
            break

    results: list[list[int]] = []
    for b in range(batch):
        candidates = list(finished[b])
        for beam in range(k):  # unfinished hypotheses compete when max_new_tokens ran out
            score = float(scores[b, beam])
            if score != float("-inf"):
                hyp = out[b * k + beam, 1:].tolist()
                candidates.append((rank(score, len(hyp)), hyp))
        best = max(candidates, key=lambda c: c[0])[1] if candidates else []
        results.append([bos_id] + best)
    width = max(len(r) for r in results)
    padded = torch.full((batch, width), model.config.pad_id, dtype=torch.long, device=device)
    for b, r in enumerate(results):
        padded[b, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    return padded
