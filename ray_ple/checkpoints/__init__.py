"""Where a model's checkpoint comes from: a local directory, or an embedded model built
here (`source.py` resolves a `model_source`; `tiny.py` builds the embedded models, `words.py`
their tokenizer)."""
