"""Per-token scoring: cross-entropy, entropy, top-1 and calibration, and divergences between models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lnfree.evaluate.datasets import EvalError

SCORING_CONVENTION = (
    "each sequence of L tokens scores its L-1 next-token predictions: the target at position t (1 <= t < L) "
    "is predicted from tokens 0..t-1; the first token is context only; EOT is a target like any other token; "
    "nothing is padded or masked; scored tokens = sequences x (L-1) for every model and format"
)
UNITS = "nats"
#: Positions per chunk of the vocabulary-wide statistics: bounds their fp32 tensors of chunk × vocabulary
#: (two kept per model that is compared in pairs, a few temporaries) whatever the batch (Gemma 3's
#: 262,144-token vocabulary: 128 MB each).
STAT_CHUNK = 128


@dataclass
class TokenScores:
    """Per scored token, shape (n_sequences, L−1): column j is the prediction of token j+1."""

    ce: torch.Tensor  # −log p(target), nats
    entropy: torch.Tensor  # of the predicted distribution, nats
    confidence: torch.Tensor  # top-1 probability
    top1: torch.Tensor  # top-1 token id (int64)


@dataclass
class Prediction:
    """Next-token probabilities and their p·log p terms (0 where p = 0): what entropy and JSD are made of."""

    p: torch.Tensor
    plogp: torch.Tensor

    @classmethod
    def of(cls, logp: torch.Tensor) -> Prediction:
        """The prediction whose log-probabilities are `logp` (…, V)."""
        p = logp.exp()
        return cls(p, torch.special.xlogy(p, p))


def token_statistics(
    logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], Prediction]:
    """Per-position CE, entropy, top-1 probability and id from next-token logits (maths in `dtype`).

    `logits` (…, V) predicts `targets` (…); returns the statistics and the predicted distribution.
    """
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    pred = Prediction.of(logp)
    ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    best, top1 = logp.max(dim=-1)
    return {"ce": ce, "entropy": -pred.plogp.sum(-1), "confidence": best.exp(), "top1": top1}, pred


def js_divergence(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Per-position Jensen–Shannon divergence (nats) between two log-distributions over the last axis."""
    return prediction_jsd(Prediction.of(logp_a), Prediction.of(logp_b))


def prediction_jsd(a: Prediction, b: Prediction) -> torch.Tensor:
    """Per-position JSD = Σ ½·p log p + ½·q log q − m log m, with m = (p + q)/2, summed per element.

    Each term is formed before the sum, so that where p = q it is exactly 0 (m = p bit for bit): a
    model's JSD with itself is exactly 0. One log per element, the entropies' terms reused: at Gemma 3's
    vocabulary, scoring three models and their pairs takes 2.4× less CPU time than with the KL-to-m form
    (benchmarks/eval_scoring.py).
    """
    m = (a.p + b.p).mul_(0.5)
    return torch.add(a.plogp, b.plogp).mul_(0.5).sub_(torch.special.xlogy(m, m)).sum(-1).clamp_min(0.0)


def _logits(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = module(input_ids=input_ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def score(
    models: Mapping[str, nn.Module], tokens: torch.Tensor, *, batch_size: int = 8, device: str | torch.device = "cpu",
    pairs: Sequence[tuple[str, str]] = (), progress: bool = False,
) -> tuple[dict[str, TokenScores], dict[tuple[str, str], torch.Tensor]]:
    """Score every model on the same (N, L) tokens, batch by batch, and each pair's per-token JSD.

    Models run in lockstep on each batch so that a pair's distributions can be compared without
    storing them. Results stay on the CPU; nothing is synchronised per token.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    n, length = tokens.shape
    if length < 2:
        raise EvalError("sequences need at least 2 tokens to score a prediction")
    for module in models.values():
        module.eval().to(device)
    shape = (n, length - 1)
    scores = {label: TokenScores(torch.empty(shape), torch.empty(shape), torch.empty(shape),
                                 torch.empty(shape, dtype=torch.int64)) for label in models}
    jsd = {pair: torch.empty(shape) for pair in pairs}
    in_pairs = {label for pair in pairs for label in pair}
    batches = range(0, n, batch_size)
    for start in tqdm(batches, desc=f"scoring {len(models)} model(s)", unit="batch", disable=not progress):
        ids = tokens[start:start + batch_size].to(device)
        logits = {label: _logits(module, ids)[:, :-1] for label, module in models.items()}
        rows = slice(start, start + len(ids))
        for first in range(0, length - 1, max(1, STAT_CHUNK // len(ids))):  # positions of every row at once
            cols = slice(first, first + max(1, STAT_CHUNK // len(ids)))
            _score_chunk(logits, ids[:, 1:][:, cols], scores, jsd, pairs, in_pairs, rows, cols)
        del logits
    return scores, jsd


def _score_chunk(logits: dict[str, torch.Tensor], targets: torch.Tensor, scores: dict[str, TokenScores],
                 jsd: dict, pairs: Sequence[tuple[str, str]], in_pairs: set[str], rows: slice, cols: slice) -> None:
    """The statistics of the positions `cols` of the sequences `rows`, written into `scores` and `jsd`."""
    preds = {}
    for label, full in logits.items():
        stats, pred = token_statistics(full[:, cols], targets)
        for name, value in stats.items():
            getattr(scores[label], name)[rows, cols] = value.cpu()
        if label in in_pairs:
            preds[label] = pred
    for a, b in pairs:
        if preds[a].p.shape != preds[b].p.shape:
            raise EvalError(f"{a} and {b} have different vocabularies ({preds[a].p.shape[-1]} vs "
                            f"{preds[b].p.shape[-1]}): no pairwise comparison")
        jsd[(a, b)][rows, cols] = prediction_jsd(preds[a], preds[b]).cpu()
