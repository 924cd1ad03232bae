"""The whole evaluation: every model scored on the same tokens, summarised and paired."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from lnfree.data.documents import bos_token, tokenizer_fingerprint
from lnfree.evaluate.benchmarks import BENCHMARKS, _require_lm_eval
from lnfree.evaluate.datasets import EvalError, load_sequences, resolve_dataset
from lnfree.evaluate.models import EvalModel, load_models, resolve_device
from lnfree.evaluate.scoring import SCORING_CONVENTION, UNITS, TokenScores, score
from lnfree.evaluate.results import auto_block, peak_memory_gb
from lnfree.evaluate.summaries import (
    DEFAULT_THRESHOLD,
    ECE_BINS,
    ModelResult,
    PairResult,
    distribution,
    paired_delta,
    summarise_model,
)


@dataclass
class EvalReport:
    """The result of one evaluation: dataset, settings, per-model results and pairwise comparisons."""

    dataset: dict
    settings: dict
    convention: str
    reference: str | None
    models: list[ModelResult]
    pairs: list[PairResult]
    scores: dict[str, TokenScores] = field(default_factory=dict, repr=False)
    jsd: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # by model label

    def model(self, label: str) -> ModelResult:
        return next(m for m in self.models if m.label == label)

    def pair(self, a: str, b: str) -> PairResult:
        return next(p for p in self.pairs if {p.a, p.b} == {a, b})

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("dataset", "settings", "convention", "reference")}
        out["units"] = UNITS
        out["models"] = [asdict(m) for m in self.models]
        out["pairs"] = [asdict(p) for p in self.pairs]
        return out


def _choose_reference(results: list[ModelResult], wanted: str | None) -> str | None:
    """`wanted`, else a model labelled 'vanilla' (or containing it), else the lowest mean CE."""
    labels = [r.label for r in results]
    if wanted is not None:
        if wanted not in labels:
            raise EvalError(f"reference {wanted!r} is not one of the labels {labels}")
        return wanted
    if len(results) < 2:
        return None
    vanilla = [label for label in labels if label == "vanilla"] or [label for label in labels if "vanilla" in label.lower()]
    return vanilla[0] if vanilla else min(results, key=lambda r: r.ce.mean).label


def evaluate_models(
    models: Sequence[EvalModel], tokens: torch.Tensor | Mapping[str, torch.Tensor], *, dataset: dict | None = None,
    batch_size: int = 8, device: str = "cpu", threshold: float = DEFAULT_THRESHOLD, seed: int = 0,
    n_resamples: int = 1000, max_outliers: int = 50, reference: str | None = None, pairwise: bool | None = None,
    progress: bool = False, bootstrap_block: int | None = None,
) -> EvalReport:
    """Score `models` on `tokens` ((N, L) ids, or one tensor per label) and summarise.

    Models that share a tokenizer share tokens; pairwise comparison (JSD, paired ΔCE) runs by
    default whenever two or more models score identical tokens; `pairwise=True` demands it for
    all models (an error if their tokens or vocabularies differ), False switches it off. Every CI
    resamples blocks of `bootstrap_block` neighbouring sequences (default `lnfree.evaluate.results.auto_block`).
    """
    labels = [m.label for m in models]
    by_label = dict(tokens) if isinstance(tokens, Mapping) else {label: tokens for label in labels}
    groups: dict[int, list[str]] = {}
    for label in labels:
        groups.setdefault(id(by_label[label]), []).append(label)
    if pairwise and len(groups) > 1:
        raise EvalError(f"pairwise comparison needs identical tokens, but the models' tokenizers differ: "
                        f"{[g for g in groups.values()]}")
    pairs = [pair for group in groups.values() for pair in itertools.combinations(group, 2)] if pairwise is not False else []
    if pairwise and not pairs:
        raise EvalError("pairwise comparison needs at least two models")
    scores, jsd = {}, {}
    for group in groups.values():
        group_pairs = [p for p in pairs if p[0] in group]
        modules = {m.label: m.module for m in models if m.label in group}
        s, j = score(modules, by_label[group[0]], batch_size=batch_size, device=resolve_device(str(device)),
                     pairs=group_pairs, progress=progress)
        scores.update(s)
        jsd.update(j)
    n_rows = next(iter(by_label.values())).shape[0]
    block = bootstrap_block or auto_block(n_rows)
    boot = {"n_resamples": n_resamples, "seed": seed, "block": block}
    results = [summarise_model(m, scores[m.label], by_label[m.label], threshold=threshold, max_outliers=max_outliers,
                               **boot) for m in models]
    for result in results:  # each outlier token's CE under the other models on the same tokens
        for item in result.outliers:
            item.other_models_ce = {
                other: float(scores[other].ce[item.sequence, item.position - 1]) for other in labels
                if other != result.label and by_label[other] is by_label[result.label]}
    ref = _choose_reference(results, reference)
    for result in results:
        if ref is not None and result.label != ref and by_label[result.label] is by_label[ref]:
            result.reference = ref
            result.delta_ce_vs_reference, result.delta_ce_vs_reference_ci = paired_delta(
                scores[ref].ce, scores[result.label].ce, **boot)
    pair_results = []
    for a, b in pairs:
        delta, delta_ci = paired_delta(scores[a].ce, scores[b].ce, **boot)
        pair_results.append(PairResult(a, b, jsd[(a, b)].numel(), distribution(jsd[(a, b)], **boot), delta, delta_ci))
    settings = {"batch_size": batch_size, "device": str(resolve_device(str(device))), "threshold": threshold, "seed": seed,
                "bootstrap_resamples": n_resamples, "ci_level": 0.95,
                "bootstrap_unit": f"blocks of {block} neighbouring sequences (circular moving-block bootstrap)",
                "bootstrap_block": block,
                "ece_bins": ECE_BINS, "max_outliers": max_outliers}
    return EvalReport(dataset or {}, settings, SCORING_CONVENTION, ref, results, pair_results, scores, jsd, by_label)


def _bos(model: EvalModel) -> int | None:
    config = getattr(model.module, "config", None)
    return bos_token(config, model.tokenizer) if config is not None else None


#: The context a model gets when neither --context nor the dataset preset gives one, at most (GPT-2's;
#: a modern model's max_position_embeddings, e.g. Gemma 3's 32,768, is no length to score on a CPU).
MAX_DEFAULT_CONTEXT = 1024


def default_context(preset_context: int | None, positions: Sequence[int]) -> int:
    """The dataset preset's context, else `MAX_DEFAULT_CONTEXT`; in both cases at most every model's longest."""
    return min([preset_context or MAX_DEFAULT_CONTEXT, *positions])


#: Logits per model a batch may hold (fp32 values), when the batch size is left to `auto_batch_size`.
LOGITS_BUDGET = 2**28


def auto_batch_size(context: int, vocab_size: int, largest: int = 8) -> int:
    """Sequences per forward whose logits stay within `LOGITS_BUDGET` per model (1 GB), at most `largest`:
    8 for GPT-2 at 256 tokens or Gemma 3 at 64, 1 for Gemma 3 (262,144 ids) at 1,024 tokens."""
    return max(1, min(largest, LOGITS_BUDGET // (context * vocab_size)))


def evaluate(
    sources: Sequence[str], dataset: str = "tiny", *, labels: Sequence[str] | None = None, form: str = "hf",
    dtype: str = "fp32", device: str = "auto", batch_size: int | None = None, n_sequences: int | None = None,
    context: int | None = None, split: str | None = None, revision: str | None = None, text_field: str = "text",
    cache_dir: str | None = None, progress: bool = False, benchmarks: Sequence[str] = (),
    benchmark_limit: int | float | None = None, **options,
) -> EvalReport:
    """Load models, read the dataset's first sequences once per tokenizer, and `evaluate_models`.

    `n_sequences` and `context` default to the dataset preset's (tiny: 64 sequences, the ones its
    removal run reports; owt-val: the whole split; pile, pile-filtered: 10,000 × 1024; a Hub id:
    1,000; a local file: all of it); without a preset's context, the models' longest context up to
    `MAX_DEFAULT_CONTEXT` (`default_context`). The context must fit every model. `benchmarks` (e.g.
    ``["hellaswag"]``, needs lm-evaluation-harness) run on each model after scoring; `options` go to
    `evaluate_models`. `batch_size` None: `auto_batch_size`. The settings record the process's peak
    memory (`peak_memory_gb`, `lnfree.evaluate.results.peak_memory_gb`).
    """
    spec = resolve_dataset(dataset, split=split, revision=revision, text_field=text_field)
    for name in benchmarks:
        if name not in BENCHMARKS:
            raise EvalError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
        _require_lm_eval()  # fail before the long part, not after it
    resolve_device(device)  # an unusable device fails before the models load
    models = load_models(sources, labels, form=form, dtype=dtype)
    positions = [m.n_positions for m in models if m.n_positions]
    if context is None:
        context = default_context(spec.context, positions)
    elif positions and context > min(positions):
        raise EvalError(f"context {context} exceeds a model's longest context ({min(positions)}); lower --context")
    if n_sequences is None:
        n_sequences = spec.n_sequences
        if n_sequences is None and spec.how == "stream":
            n_sequences = 1000
    fingerprints = {m.label: tokenizer_fingerprint(m.tokenizer) for m in models}
    tokens: dict[str, torch.Tensor] = {}
    by_fingerprint: dict[str, torch.Tensor] = {}
    for m in models:
        key = fingerprints[m.label]
        if key not in by_fingerprint:
            vocab = min(other.vocab_size for other in models if fingerprints[other.label] == key)
            ids = load_sequences(spec, m.tokenizer, context=context, n_sequences=n_sequences, vocab_size=vocab,
                                 cache_dir=cache_dir, progress=progress, bos_token_id=_bos(m))
            by_fingerprint[key] = torch.from_numpy(ids)
        tokens[m.label] = by_fingerprint[key]
    first = next(iter(by_fingerprint.values()))
    batch_size = batch_size or auto_batch_size(context, max(m.vocab_size for m in models))
    info = {"name": spec.name, "source": spec.source, "revision": spec.revision, "split": spec.split,
            "description": spec.description, "sequences": int(first.shape[0]), "context": context,
            "scored_tokens_per_model": int(first.shape[0]) * (context - 1), "tokenizers": len(by_fingerprint),
            "selection": "the first sequences, in dataset order (documents + EOT concatenated, cut into context-sized pieces)"}
    report = evaluate_models(models, tokens, dataset=info, batch_size=batch_size, device=device, progress=progress,
                             **options)
    report.settings.update({"form": form, "dtype": dtype})
    for name in benchmarks:
        for m in models:
            report.model(m.label).benchmarks.update(
                BENCHMARKS[name](m.module, m.tokenizer, batch_size=batch_size, limit=benchmark_limit))
    report.settings["peak_memory_gb"] = peak_memory_gb()  # the process's, models and scoring included
    return report
