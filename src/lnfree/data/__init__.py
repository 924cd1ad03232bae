"""Documents in: the fine-tuning and held-out tokens, and the bundled tiny and realtext corpora."""
