"""classify: IMDB sentiment classification on a from-scratch transformer core.

Layers, each importing only those listed before it (and ``errors``):

* ``text``: data sources, tokenizer, batching
* the transformer: ``core`` (attention, masks, blocks), ``models`` (``Classifier``, ``Transformer``),
  ``generate`` (greedy / beam search), ``mlm`` (masked-LM pretraining head)
* ``engine``: the training loop, run folders, settings, device, torchrun (knows no model)
* ``inference`` (load a run, texts -> probabilities), ``explain``, ``report``, ``finetune``
* the commands: ``train``, ``pretrain``, ``predict``, ``evaluate``; ``seq2seq`` (the translation example)
"""

__version__ = "0.1.0"
