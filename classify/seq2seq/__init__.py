"""The seq2seq example: German -> English translation on Multi30k (``python -m classify.seq2seq``).

    python -m classify.seq2seq train --data ../shared/multi30k --output runs/multi30k --time-budget 60
    python -m classify.seq2seq translate --model runs/multi30k "Ein Hund läuft über die Wiese."
    python -m classify.seq2seq evaluate --model runs/multi30k --data ../shared/multi30k --split test

Modules: ``data`` (parallel text, token ids, batches), ``metrics`` (loss, BLEU, chrF),
``translate`` (a trained run -> translations), ``task`` (the training task for
``classify.engine.loop.fit``), ``cli`` (the three subcommands).

Data: a folder of line-aligned plain-text files ``{train,val,test}.{de,en}`` (one sentence
per line, raw cased text). The model is ``classify.models.Transformer``; everything around
it (run folders, schedules, mixed precision, Ctrl-C, time budgets, bucketed batches,
torchrun) is the one training loop the classifier and pretraining use too.

Tokenization: ONE byte-pair vocabulary learned on German and English training text
together (Vaswani et al. 2017 did the same for en-de). The two languages share an
alphabet, names and numbers, so copies ("Frisbee", "3") get the same ids on both sides,
one ``tokenizer.json`` serves both, and the decoder's input embedding can be tied to its
output projection. It is cased and reversible (``▁`` marks word starts) so translations
decode back to normally spaced, cased text that is scored against the raw references.

Sequences: the source is ``x1 .. xn EOS``; the decoder reads ``BOS y1 .. ym`` and is
trained to predict ``y1 .. ym EOS``. BOS and EOS are the tokenizer's ``[CLS]`` and
``[SEP]`` specials (ids 2 and 3); padding is ``[PAD]`` (id 0) and never enters the loss.
"""
