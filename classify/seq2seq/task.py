"""The seq2seq example's training task for ``classify.engine.loop.fit``, and its settings."""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import ClassVar

import torch
from tokenizers import Tokenizer

from ..engine.config import RunConfig, fraction, positive, setting
from ..engine.loop import Task
from ..errors import ClassifyError
from ..models import Transformer, TransformerConfig
from .data import PairCollate, decode_ids, pair_lengths, special_ids
from .metrics import bleu_scores, corpus_loss, summed_loss
from .translate import translate_ids

BEST_BY = ("bleu", "loss")


@dataclass(kw_only=True)
class Seq2SeqTrainConfig(RunConfig):
    """Everything that defines a translation training run except the model (config.json's "train")."""

    data: str = RunConfig.redefault("data", MISSING, "folder with train.de/train.en, val.de/val.en (and test.*)")
    src_lang: str = setting("de", "source file suffix")
    tgt_lang: str = setting("en", "target file suffix")
    vocab_size: int = setting(8000, "joint source+target BPE vocabulary size", check=positive)
    epochs: int = RunConfig.redefault("epochs", 10)
    warmup: int = RunConfig.redefault("warmup", 400)
    weight_decay: float = RunConfig.redefault("weight_decay", 0.01)
    max_tokens: int = setting(2048, "token budget per batch (padded length of the longer side x sentences)",
                              check=positive)
    label_smoothing: float = setting(0.1, "label smoothing of the cross-entropy", check=fraction)
    best_by: str = setting("bleu", "which validation score picks model.safetensors (bleu: greedy decoding of val "
                                   "at each validation)", choices=BEST_BY)

    IDENTITY: ClassVar[tuple[str, ...]] = (*RunConfig.IDENTITY, "src_lang", "tgt_lang", "vocab_size")

    def validate(self, model: TransformerConfig) -> None:
        super().validate(model)
        if self.max_tokens < model.max_len:
            raise ClassifyError(f"--max-tokens {self.max_tokens} cannot hold one sequence of --max-len "
                                f"{model.max_len}")


class TranslationTask(Task):
    """Teacher-forced cross-entropy over the target tokens; validation BLEU (greedy) or loss picks the
    best weights."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, src_ids: list[list[int]], tgt_ids: list[list[int]],
                 val_src: list[list[int]], val_tgt: list[list[int]], val_references: list[str],
                 config: Seq2SeqTrainConfig, device: torch.device, dtype: torch.dtype | None):
        self.pad_id, self.bos_id, self.eos_id = special_ids(tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.lengths = pair_lengths(src_ids, tgt_ids)
        self.max_tokens = config.max_tokens
        self.collate = PairCollate(src_ids, tgt_ids, self.pad_id, self.bos_id)
        self.val_src, self.val_tgt, self.val_references = val_src, val_tgt, val_references
        self.config, self.device, self.dtype = config, device, dtype

    def loss(self, model, batch):
        loss_sum, n = summed_loss(model, batch, self.pad_id, self.config.label_smoothing)
        real = n + float((batch["src"] != self.pad_id).sum())
        return loss_sum / n, {"loss": float(loss_sum.detach()), "targets": n, "tokens": real}

    def train_metrics(self, sums):
        return {"train_loss": sums["loss"] / sums["targets"] if sums["targets"] else None}

    def validate(self, model):
        loss = corpus_loss(model, self.val_src, self.val_tgt, self.bos_id, self.device, self.dtype,
                           self.config.max_tokens)
        metrics = {"val_loss": loss["loss"], "val_perplexity": loss["perplexity"]}
        if self.config.best_by == "bleu":
            generated = translate_ids(model, self.val_src, self.bos_id, self.eos_id, self.device, self.dtype)
            hypotheses = [decode_ids(self.tokenizer, ids) for ids in generated]
            metrics["val_bleu"] = bleu_scores(hypotheses, self.val_references)["bleu"]
        return metrics

    def score(self, metrics):
        return metrics["val_bleu"] if self.config.best_by == "bleu" else -metrics["val_loss"]
