"""Process CPU time of lnfree eval's per-token scoring at a large vocabulary: the JSD form it uses vs the KL-to-m form.

`lnfree eval` scores every model on every position (CE, entropy, top-1) and every pair's JSD over the whole
vocabulary; at Gemma 3's 262,144 tokens this, not the forwards, dominated an eval batch. The two variants
score the same synthetic logits (one chunk of positions, as lnfree.evaluate.scoring does) for three models
and their three pairs and differ in the JSD's form (and in what the statistics hand on to it):

* KL-to-m (the form lnfree used before): log m = max(a, b) + log1p(½·expm1(−|a − b|)) from the
  log-probabilities, then ½·KL(p‖m) + ½·KL(q‖m);
* terms (lnfree.evaluate.scoring.prediction_jsd): Σ ½·p log p + ½·q log q − m log m per element, reusing
  each model's p log p from its entropy.

Rounds are interleaved so that drift in machine load hits both alike; the script prints each median, their
ratio and the largest JSD difference between the forms, measured in this one run.

    python benchmarks/eval_scoring.py [--vocab 262144] [--positions 128] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lnfree.evaluate.scoring import prediction_jsd, token_statistics

RESULTS = Path(__file__).parent / "results"


def kl_to_m_jsd(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """The KL-to-m form of the per-position JSD (the baseline)."""
    log_m = torch.maximum(logp_a, logp_b) + torch.log1p(0.5 * torch.expm1(-(logp_a - logp_b).abs()))

    def kl(logp: torch.Tensor) -> torch.Tensor:
        p = logp.exp()
        return torch.where(p > 0, p * (logp - log_m), torch.zeros_like(p)).sum(-1)

    return (0.5 * kl(logp_a) + 0.5 * kl(logp_b)).clamp_min(0.0)


def statistics_before(logits: torch.Tensor, targets: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """lnfree's per-position statistics as they were with the KL-to-m form: they handed on the log-probabilities."""
    logp = F.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    best, top1 = logp.max(dim=-1)
    ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return {"ce": ce, "entropy": entropy, "confidence": best.exp(), "top1": top1}, logp


def score_kl_to_m(logits: list[torch.Tensor], targets: torch.Tensor) -> list[torch.Tensor]:
    """Statistics of each model, then each pair's JSD in the KL-to-m form (what lnfree eval did before)."""
    logps = [statistics_before(x, targets)[1] for x in logits]
    return [kl_to_m_jsd(a, b) for a, b in itertools.combinations(logps, 2)]


def score_terms(logits: list[torch.Tensor], targets: torch.Tensor) -> list[torch.Tensor]:
    """Statistics of each model, then each pair's JSD from the distributions' terms (what lnfree eval does)."""
    preds = [token_statistics(x, targets)[1] for x in logits]
    return [prediction_jsd(a, b) for a, b in itertools.combinations(preds, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=262_144, help="vocabulary size (default: Gemma 3's)")
    parser.add_argument("--positions", type=int, default=128, help="positions per chunk (lnfree's STAT_CHUNK)")
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "eval_scoring.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(args.positions, args.vocab, generator=g)  # fine-tuned models: near the original
    logits = [base] + [base + 0.3 * torch.randn(base.shape, generator=g) for _ in range(args.models - 1)]
    targets = torch.randint(0, args.vocab, (args.positions,), generator=g)
    variants = {"KL-to-m": score_kl_to_m, "terms": score_terms}
    times: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    for round_ in range(1 + args.repeats):  # round 0 warms up
        for name, fn in variants.items():
            started = time.process_time()
            outputs[name] = fn(logits, targets)
            if round_:
                times[name].append(time.process_time() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    diff = max(float((a - b).abs().max()) for a, b in zip(outputs["KL-to-m"], outputs["terms"]))
    mean_jsd = statistics.fmean(float(j.mean()) for j in outputs["terms"])
    lines = [f"eval scoring, {args.models} models and {args.models * (args.models - 1) // 2} pairs, "
             f"{args.positions} positions x {args.vocab} vocabulary, {args.threads} thread(s), "
             f"median process CPU time of {args.repeats} interleaved rounds:"]
    lines += [f"  {name:8s} {medians[name]:.3f} s" for name in variants]
    lines += [f"  ratio KL-to-m / terms: {medians['KL-to-m'] / medians['terms']:.2f}x",
              f"  largest JSD difference between the forms: {diff:.2e} nats (mean JSD {mean_jsd:.4f})"]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median_cpu_s": medians,
                                    "times_cpu_s": times, "ratio": medians["KL-to-m"] / medians["terms"],
                                    "max_jsd_difference": diff, "mean_jsd": mean_jsd}, indent=2) + "\n")
    args.out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
