"""classify: IMDB sentiment classification on a from-scratch transformer core.

Layers, each importing only those listed before it (and ``errors``):

* ``text``: data sources, tokenizer, batching
* the transformer: ``core`` (attention, masks, blocks), ``models`` (``Classifier``, ``Transformer``),
  ``generate`` (greedy / beam search), ``mlm`` (masked-LM pretraining head)
* ``engine``: the training loop, run folders, settings, device, torchrun (knows no model)
* ``inference`` (load a run, texts -> probabilities), ``explain``, ``report``, ``finetune``
* the commands: ``train``, ``pretrain``, ``predict``, ``evaluate``; ``seq2seq`` (the translation example)
"""

import os

__version__ = "0.1.0"

# Transparent huge pages for PyTorch's CPU tensors of 2 MiB and more (PyTorch's own switch, read once, at its first
# CPU allocation: so here, before any module of the package imports torch). Activations are allocated and freed at
# every batch; in 4 KiB pages the kernel faulted each one in again, ~2.5 million page faults per 3,000 reviews of
# inference, and the README command spent 6% of its CPU time in the kernel. Huge pages cut the faults ~10x; training
# and inference ran faster (experiments/RESULTS.md, fiftieth session). Set THP_MEM_ALLOC_ENABLE=0 to turn it off;
# a kernel with huge pages off ignores it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
