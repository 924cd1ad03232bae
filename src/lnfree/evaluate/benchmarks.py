"""Optional benchmarks through lm-evaluation-harness (HellaSwag)."""

from __future__ import annotations

import math

from torch import nn

from lnfree.evaluate.datasets import EvalError


class BenchmarkUnavailable(EvalError):
    """An optional benchmark dependency is missing."""


def _require_lm_eval():
    """The `lm_eval` module, or a clear error naming the package to install."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError as err:
        raise BenchmarkUnavailable(
            "benchmarks need lm-evaluation-harness, which is not installed: pip install 'lm-eval>=0.4.9'") from err
    return lm_eval


def hellaswag(
    module: nn.Module, tokenizer, *, batch_size: int = 8, limit: int | float | None = None, num_fewshot: int = 0,
) -> dict[str, float]:
    """HellaSwag accuracy (acc, acc_norm and their standard errors) through lm-evaluation-harness.

    Needs ``pip install 'lm-eval>=0.4.9'`` (imported only here) and network access for the task's
    data. The model is evaluated as given (e.g. `LoadedModel.model` or its folded form), on its
    current device; P24 reports 29.56% / 29.82% / 29.54% for GPT-2 small original / FT / LN-free.
    """
    lm_eval = _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=module, tokenizer=tokenizer, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], num_fewshot=num_fewshot, limit=limit,
                                      log_samples=False)
    metrics = results["results"]["hellaswag"]
    out = {}
    for name in ("acc", "acc_norm"):
        out[f"hellaswag_{name}"] = float(metrics[f"{name},none"])
        stderr = metrics.get(f"{name}_stderr,none")
        if isinstance(stderr, (int, float)) and not math.isnan(stderr):
            out[f"hellaswag_{name}_stderr"] = float(stderr)
    return out


BENCHMARKS = {"hellaswag": hellaswag}
