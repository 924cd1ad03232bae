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
#: Positions per chunk of the vocabulary-wide statistics: bounds their fp32 temporaries (a few of
#: chunk × vocabulary) whatever the batch (Gemma 3's 262,144-token vocabulary: 128 MB each).
STAT_CHUNK = 128




@dataclass
class TokenScores:
    """Per scored token, shape (n_sequences, L−1): column j is the prediction of token j+1."""

    ce: torch.Tensor  # −log p(target), nats
    entropy: torch.Tensor  # of the predicted distribution, nats
    confidence: torch.Tensor  # top-1 probability
    top1: torch.Tensor  # top-1 token id (int64)


def token_statistics(
    logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-position CE, entropy, top-1 probability and id from next-token logits (maths in `dtype`).

    `logits` (…, V) predicts `targets` (…); returns the statistics and the log-probabilities.
    """
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    p = logp.exp()
    ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    best, top1 = logp.max(dim=-1)
    return {"ce": ce, "entropy": entropy, "confidence": best.exp(), "top1": top1}, logp


def js_divergence(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Per-position Jensen–Shannon divergence (nats) between two log-distributions over the last axis.

    log m = max(a, b) + log1p(½·expm1(−|a − b|)) is exact where a = b, so a model's JSD with
    itself is exactly 0.
    """
    log_m = torch.maximum(logp_a, logp_b) + torch.log1p(0.5 * torch.expm1(-(logp_a - logp_b).abs()))

    def kl_to_m(logp: torch.Tensor) -> torch.Tensor:
        p = logp.exp()
        return torch.where(p > 0, p * (logp - log_m), torch.zeros_like(p)).sum(-1)

    return (0.5 * kl_to_m(logp_a) + 0.5 * kl_to_m(logp_b)).clamp_min(0.0)


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
    logps = {}
    for label, full in logits.items():
        stats, logp = token_statistics(full[:, cols], targets)
        for name, value in stats.items():
            getattr(scores[label], name)[rows, cols] = value.cpu()
        if label in in_pairs:
            logps[label] = logp
    for a, b in pairs:
        if logps[a].shape != logps[b].shape:
            raise EvalError(f"{a} and {b} have different vocabularies ({logps[a].shape[-1]} vs "
                            f"{logps[b].shape[-1]}): no pairwise comparison")
        jsd[(a, b)][rows, cols] = js_divergence(logps[a], logps[b]).cpu()
