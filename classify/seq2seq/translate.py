"""A trained translation run: load it, translate sentences (greedy or beam search)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..engine.device import autocast, to_device
from ..engine.files import load_model_weights
from ..engine.runfolder import TOKENIZER, WEIGHTS, read_model_config
from ..errors import ClassifyError
from ..generate import generate
from ..models import Transformer, TransformerConfig
from ..text.batching import BucketBatchSampler, pad_batch
from ..text.tokenize import load_tokenizer
from .data import decode_ids, encode_side, special_ids

KIND = "seq2seq"


@dataclass
class Translator:
    """A trained translation run ready for inference."""

    path: Path
    model: Transformer
    tokenizer: Tokenizer
    config: dict          # the whole config.json


def load_translator(path: str | Path, device: torch.device) -> Translator:
    """Load ``config.json``, ``tokenizer.json`` and ``model.safetensors`` of a seq2seq run folder;
    every way these can be missing, corrupt or inconsistent is a one-line ClassifyError."""
    path = Path(path)
    config, model_config = read_model_config(path, KIND, TransformerConfig)
    tokenizer = load_tokenizer(path / TOKENIZER)
    vocab = tokenizer.get_vocab_size()
    if vocab != model_config.src_vocab_size or vocab != model_config.tgt_vocab_size:
        raise ClassifyError(f"tokenizer.json has {vocab} tokens but the model's vocabularies have "
                            f"{model_config.src_vocab_size}/{model_config.tgt_vocab_size}: "
                            f"the run folder mixes files from different runs")
    special_ids(tokenizer)  # fail now, not mid-translation, if BOS/EOS are missing
    model = Transformer(model_config)
    load_model_weights(model, path / WEIGHTS)
    model.to(device).eval()
    return Translator(path, model, tokenizer, config)


@torch.inference_mode()
def translate_ids(model: Transformer, src_ids: list[list[int]], bos_id: int, eos_id: int, device: torch.device,
                  dtype: torch.dtype | None, beam_size: int = 1, length_penalty: float = 1.0,
                  batch_size: int = 64) -> list[list[int]]:
    """Source id lists (ending in EOS) -> generated id lists (BOS first), in input order.

    Sentences are batched by length; each batch may generate up to 1.5x its longest source
    plus 10 tokens (English is rarely longer than that in German BPE tokens), within max_len.
    """
    model.eval()
    pad_id = model.config.pad_id
    out: list[list[int]] = [[] for _ in src_ids]
    sampler = BucketBatchSampler([len(s) for s in src_ids], batch_size=batch_size, shuffle=False)
    for indices in sampler:
        src = to_device(pad_batch([src_ids[i] for i in indices], pad_id), device)  # (B, S)
        max_new = min(model.config.max_len, int(1.5 * src.shape[1]) + 10)
        with autocast(device, dtype):
            tokens = generate(model, src, max_new, bos_id, eos_id, beam_size, length_penalty)
        for row, i in zip(tokens.tolist(), indices):
            out[i] = row
    return out


def translate_texts(model: Transformer, tokenizer: Tokenizer, texts: list[str], device: torch.device,
                    dtype: torch.dtype | None, beam_size: int = 1, length_penalty: float = 1.0,
                    batch_size: int = 64) -> list[str]:
    """Raw source sentences -> detokenized translations."""
    _, bos_id, eos_id = special_ids(tokenizer)
    src_ids = encode_side(tokenizer, texts, model.config.max_len)
    generated = translate_ids(model, src_ids, bos_id, eos_id, device, dtype, beam_size, length_penalty, batch_size)
    return [decode_ids(tokenizer, ids) for ids in generated]
