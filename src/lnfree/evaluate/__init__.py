"""`lnfree.evaluate`: per-token cross-entropy of models on identical tokens, and how they differ.

One scored-token convention for every model, format and dataset (``SCORING_CONVENTION``): a
sequence of L tokens scores its L−1 next-token predictions. The target at position t (1 ≤ t < L)
is predicted from tokens 0…t−1; the first token of a sequence is context only; the EOT token is a
target like any other; nothing is padded or masked. So a run over N sequences scores exactly
N·(L−1) tokens, whatever the model's format (eps-trick file, lnfree's fixed-scale form, folded
weights, ordinary GPT-2).

Sequences are a deterministic choice: a dataset's documents are tokenised in their stored order,
each followed by EOT, concatenated (pre-tokenised rows are concatenated as they are) and cut into
consecutive L-token sequences; the first N are evaluated. Named presets:

- ``tiny``: the bundled tiny model's held-out synthetic text (the sequences its removal run reports);
- ``realtext``: the *test* half of the realtext corpus's held-out documents (Django documentation),
  every sequence: no run evaluates on it and no choice is made on it; ``realtext-val``: the
  validation half, what runs evaluate on while training;
- ``owt-val``: the nanoGPT validation split of OpenWebText (``Skylion007/openwebtext``, Parquet
  revision, ``train_test_split(test_size=0.0005, seed=2357)``), 1024-token sequences;
- ``pile``: ``apollo-research/monology-pile-uncopyrighted-tokenizer-gpt2`` (pre-tokenised; streamed),
  the first 10,000 sequences of 1024;
- ``pile-filtered``: ``lucabaroni/apollo-pile-filtered-10k`` (Pile sequences without tokens unseen in
  OpenWebText; streamed), 10,000 sequences of 1024.

Anything else is a local file/folder (``.txt``, ``.jsonl``, ``.parquet``, ``save_to_disk``, ``.npy``
token stream; the whole file is evaluation data) or a Hugging Face dataset id (streamed).

Per model (`summaries`): mean CE with a bootstrap CI over blocks of neighbouring sequences (a
moving-block bootstrap: sequences cut from one document are not independent), median, p95, p99, p99.9, max, the tokens
whose CE exceeds a threshold (with their context), entropy, top-1 accuracy and ECE, CE and entropy
by context-position bins. Per pair of models on the same tokens: per-token Jensen–Shannon
divergence and the paired CE difference, with the same block-bootstrap CIs (never over i.i.d.
tokens). Outputs: per-model JSON and CSV, ``comparison.md``/``.csv``, ``pairwise.csv``,
``positions.csv``, ``outliers.csv`` and ``summary.json``.

One module per step: `datasets` (the token sequences), `models` (the models under their labels),
`scoring` (per-token statistics), `summaries` (distributions, outliers, pairs), `run` (the whole
evaluation), `output` (the report's files), `benchmarks` (lm-evaluation-harness) and `stress`
(robustness: the test split, repeated-token probes and a vocabulary sweep; `lnfree stress`). Everything a user
calls is importable from `lnfree.evaluate`.
"""

from lnfree.evaluate.benchmarks import BENCHMARKS, BenchmarkUnavailable, hellaswag
from lnfree.evaluate.datasets import EvalError, load_sequences, presets, resolve_dataset
from lnfree.evaluate.models import EvalModel, load_models, resolve_device
from lnfree.evaluate.output import markdown, write_report
from lnfree.evaluate.run import EvalReport, evaluate, evaluate_models
from lnfree.evaluate.scoring import (
                                       SCORING_CONVENTION,
                                       Prediction,
                                       TokenScores,
                                       js_divergence,
                                       prediction_jsd,
                                       score,
                                       token_statistics,
)
from lnfree.evaluate.summaries import (
                                       DEFAULT_THRESHOLD,
                                       distribution,
                                       expected_calibration_error,
                                       outliers,
                                       position_edges,
)

__all__ = [
    "BENCHMARKS", "DEFAULT_THRESHOLD", "SCORING_CONVENTION", "BenchmarkUnavailable", "EvalError", "EvalModel",
    "EvalReport", "Prediction", "TokenScores", "distribution", "evaluate", "evaluate_models",
    "expected_calibration_error", "hellaswag", "js_divergence", "load_models", "load_sequences", "markdown",
    "outliers", "position_edges", "prediction_jsd", "presets", "resolve_dataset", "resolve_device", "score",
    "token_statistics", "write_report",
]
