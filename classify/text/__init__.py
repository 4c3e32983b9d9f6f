"""Text in, token ids out: reading review sources (``data``) and predict inputs (``inputs``), the
tokenizer and truncation (``tokenize``), and length-bucketed batches (``batching``)."""
