"""Fine-tuning from a pretraining run: ``python -m classify.train --init-from PRETRAIN_RUN``.

``classify.train`` calls three things here:

* :func:`adopt_pretrained` before building anything: the model sizes, tokenizer kind and
  vocabulary come from the pretraining run's config.json (a flag given on the command line
  that disagrees is one clear error), the learning-rate default drops to :data:`FINETUNE_LR`
  unless ``--lr`` is given, ``--word-vectors`` is off unless given (the embedding comes from
  pretraining), and ``--val-size`` defaults to the split pretraining left out;
* :func:`load_pretrained_encoder` after building the classifier: exactly the ``embed.*`` and
  ``encoder.*`` tensors are copied; the classification head stays freshly initialised;
* :func:`layer_lr_scale` for ``--layer-decay``: lower learning rates for lower layers
  (Clark et al. 2020, ELECTRA), applied through the param groups' ``lr_scale``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .engine.files import load_model_weights
from .engine.runfolder import TOKENIZER, WEIGHTS, read_config
from .engine.config import flag
from .errors import ClassifyError
from .models import Classifier

PRETRAIN_KIND = "pretrain"
# A pretrained encoder has seen its weights move far from initialisation; the from-scratch
# default (1e-3) would partly wash out what pretraining learned. 3e-4 is ELECTRA-small's
# fine-tuning rate, for a model of about this size.
FINETUNE_LR = 3e-4
# ClassifierConfig fields that shape the embedding and encoder: they must equal the pretrained ones.
ENCODER_FIELDS = ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_len", "pad_id",
                  "positional", "activation", "norm_first", "mask_padding")


def _inherited(config: dict[str, Any]) -> dict[str, Any]:
    """classify.train settings -> the value the pretraining run fixes for them (flags and fields share names)."""
    model, train = config["model"], config.get("train", {})
    return {**{name: model[name] for name in ("d_model", "num_heads", "num_layers", "d_ff", "max_len", "positional",
                                              "norm_first", "mask_padding")},
            "vocab_size": train.get("vocab_size"), "tokenizer": train.get("tokenizer")}


def _given(parser: argparse.ArgumentParser, argv: Sequence[str] | None, dests: Sequence[str]) -> set[str]:
    """Which of ``dests`` were set on the command line (argparse fills defaults only into
    attributes the namespace lacks, so a pre-filled sentinel survives where a flag was absent)."""
    unset = object()
    namespace = parser.parse_args(argv, argparse.Namespace(**{d: unset for d in dests}))
    return {d for d in dests if getattr(namespace, d) is not unset}


def _flag(dest: str, value: Any) -> str:
    """How a setting reads on a command line: ``--d-model 128``, ``--norm-first``, ``--no-norm-first``."""
    if isinstance(value, bool):
        return flag(dest) if value else f"--no-{flag(dest)[2:]}"
    return f"{flag(dest)} {value}"


def adopt_pretrained(args: argparse.Namespace, parser: argparse.ArgumentParser,
                     argv: Sequence[str] | None) -> None:
    """Set ``args``' model sizes and tokenizer from ``args.init_from``, lower the lr default and leave
    ``--word-vectors`` off unless given (then ``TrainConfig.validate`` refuses the pair).

    Raises ClassifyError when the folder is not a finished pretraining run or when a flag given
    on the command line contradicts it (e.g. ``--d-model 64`` against a pretrained width 128).
    """
    run = Path(args.init_from)
    try:
        config = read_config(run, PRETRAIN_KIND)
    except ClassifyError as err:
        raise ClassifyError(f"--init-from: {err}") from None
    for name in (TOKENIZER, WEIGHTS):
        if not (run / name).exists():
            raise ClassifyError(f"--init-from {run}: no {name} (the pretraining run has not saved weights yet)")
    try:
        inherited = _inherited(config)
    except KeyError as err:
        raise ClassifyError(f"--init-from {run}: config.json lacks the model field {err}") from None
    given = _given(parser, argv, [*inherited, "lr", "word_vectors"])
    conflicts = [f"{_flag(dest, getattr(args, dest))} vs pretrained {_flag(dest, value)}"
                 for dest, value in inherited.items()
                 if dest in given and value is not None and getattr(args, dest) != value]
    if conflicts:
        raise ClassifyError(f"--init-from {run} fixes the model and tokenizer, but {'; '.join(conflicts)} "
                            f"(leave these flags out when fine-tuning)")
    for dest, value in inherited.items():
        if value is not None:
            setattr(args, dest, value)
    if "lr" not in given:
        args.lr = FINETUNE_LR
    if "word_vectors" not in given:  # they would overwrite the pretrained embedding
        args.word_vectors = False
    pre = config.get("train", {})
    if args.val_size is None:  # validate on the split pretraining left out
        args.val_size = pre.get("val_size")
    if (pre.get("val_size"), pre.get("seed")) != (args.val_size, args.seed) or args.limit:
        # Not an error: fine, but this run's validation reviews may have been seen (unlabelled) in pretraining.
        if not args.quiet:
            print(f"classify.train: note: pretraining left out the validation split of --val-size "
                  f"{pre.get('val_size')} --seed {pre.get('seed')} (no --limit); this run's validation "
                  f"reviews may include pretraining text, so validation accuracy may be slightly optimistic",
                  file=sys.stderr)


def load_pretrained_encoder(model: Classifier, run: str | Path) -> int:
    """Copy the pretrained ``embed.*`` and ``encoder.*`` tensors into ``model``; the head keeps its
    fresh initialisation. Returns the number of tensors copied."""
    run = Path(run)
    config = read_config(run, PRETRAIN_KIND)
    differ = [f"{f} {getattr(model.config, f)!r} vs pretrained {config['model'].get(f)!r}"
              for f in ENCODER_FIELDS if config["model"].get(f) != getattr(model.config, f)]
    if differ:
        raise ClassifyError(f"--init-from {run}: the classifier does not match the pretrained encoder "
                            f"({'; '.join(differ)})")
    return load_model_weights(model, run / WEIGHTS, only=("embed.", "encoder."),
                                         what="pretrained weights")


def layer_lr_scale(num_layers: int, decay: float) -> Callable[[str], float]:
    """Parameter name -> learning-rate scale for layer-wise decay.

    Depth 0 is the embedding, block i is depth i + 1, everything above the blocks (final
    norm, classification head) is depth L + 1 and gets scale 1; depth d gets
    ``decay ** (L + 1 - d)``. Lower layers hold the most general pretrained features and move least.
    """
    def scale(name: str) -> float:
        if name.startswith("embed."):
            depth = 0
        elif name.startswith("encoder.layers."):
            depth = int(name.split(".")[2]) + 1
        else:
            depth = num_layers + 1
        return decay ** (num_layers + 1 - depth)

    return scale
