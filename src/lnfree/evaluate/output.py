"""An evaluation's report: comparison.md/.csv, per-model JSON and CSV, pairwise and outlier tables."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lnfree.removal.derived import STALE_MARKER, clear_stale
from lnfree.evaluate.datasets import EvalError
from lnfree.evaluate.run import EvalReport
from lnfree.evaluate.scoring import UNITS
from lnfree.evaluate.summaries import sequence_table
from lnfree.evaluate.results import write_summary, write_table


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)


def _ci(ci: tuple[float, float] | None, digits: int = 4) -> str:
    return "" if ci is None else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e4 else f"{x:.4f}"


def comparison_rows(report: EvalReport) -> list[dict]:
    """One flat row per model (the comparison table as records)."""
    rows = []
    for m in report.models:
        rows.append({
            "model": m.label, "form": m.form, "dtype": m.dtype, "ln_free": m.fully_ln_free, "scored_tokens": m.scored_tokens,
            "mean_ce": m.ce.mean, "mean_ce_ci_low": m.ce.mean_ci[0], "mean_ce_ci_high": m.ce.mean_ci[1],
            "reference": m.reference, "delta_ce": m.delta_ce_vs_reference,
            "delta_ce_ci_low": m.delta_ce_vs_reference_ci[0] if m.delta_ce_vs_reference_ci else None,
            "delta_ce_ci_high": m.delta_ce_vs_reference_ci[1] if m.delta_ce_vs_reference_ci else None,
            "median_ce": m.ce.median, "p95_ce": m.ce.p95, "p99_ce": m.ce.p99, "p99_9_ce": m.ce.p99_9, "max_ce": m.ce.max,
            "tokens_above_threshold": m.tokens_above_threshold, "threshold": m.threshold,
            "mean_ce_at_or_below_threshold": m.mean_ce_at_or_below_threshold,
            "mean_entropy": m.entropy.mean, "top1_accuracy": m.top1_accuracy, "ece": m.ece,
            "ece_ci_low": m.ece_ci[0], "ece_ci_high": m.ece_ci[1], **m.benchmarks,
        })
    return rows


def markdown(report: EvalReport) -> str:
    """The comparison as markdown: models (Δ to the reference), pairs, position bins, outlier warnings."""
    d = report.dataset
    first = report.models[0] if report.models else None
    sequences, context = d.get("sequences", first and first.sequences), d.get("context", first and first.context)
    lines = [f"# Evaluation on {d.get('name', 'the given tokens')}", "",
             f"{d.get('description', 'tokens')}: {sequences} sequences x {context} tokens, "
             f"{first.scored_tokens if first else 0:,} scored tokens per model. CE in nats; 95% bootstrap CIs over "
             f"{report.settings.get('bootstrap_unit', 'sequences')} ({report.settings.get('bootstrap_resamples')} "
             f"resamples, seed {report.settings.get('seed')}).",
             f"Scored tokens: {report.convention}.", ""]
    ref = f"Δ vs {report.reference}" if report.reference else "Δ"
    lines += [f"| model | form | scored tokens | mean CE [95% CI] | {ref} [95% CI] | median | p95 | p99 | p99.9 | max "
              f"| CE > {report.settings.get('threshold')} | entropy | top-1 acc | ECE [95% CI] |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in report.models:
        delta = "—" if m.delta_ce_vs_reference is None else f"{m.delta_ce_vs_reference:+.4f}{_ci(m.delta_ce_vs_reference_ci)}"
        lines.append(f"| {m.label} | {m.form} | {m.scored_tokens:,} | {_num(m.ce.mean)}{_ci(m.ce.mean_ci)} | {delta} | "
                     f"{_num(m.ce.median)} | {_num(m.ce.p95)} | {_num(m.ce.p99)} | {_num(m.ce.p99_9)} | {_num(m.ce.max)} | "
                     f"{m.tokens_above_threshold:,} | {m.entropy.mean:.4f} | {m.top1_accuracy:.4f} | "
                     f"{m.ece:.4f}{_ci(m.ece_ci)} |")
    for m in report.models:
        if m.tokens_above_threshold:
            lines += ["", f"**Warning — {m.label}: {m.tokens_above_threshold:,} token(s) in {m.sequences_with_outliers} "
                          f"sequence(s) have CE > {m.threshold:g} (max {m.ce.max:.4g}); the mean without them is "
                          f"{m.mean_ce_at_or_below_threshold:.4f} (median {m.ce.median:.4f}).** See outliers.csv."]
    if any(m.benchmarks for m in report.models):
        lines += ["", "| model | benchmark | value |", "|---|---|---|"]
        for m in report.models:
            lines += [f"| {m.label} | {k} | {v:.4f} |" for k, v in m.benchmarks.items() if isinstance(v, float)]
    if report.pairs:
        lines += ["", "## Pairwise, on identical tokens", "",
                  "| a | b | mean JSD [95% CI] | median JSD | p99 JSD | max JSD | mean CE(b) − CE(a) [95% CI] |",
                  "|---|---|---|---|---|---|---|"]
        for p in report.pairs:
            lines.append(f"| {p.a} | {p.b} | {p.jsd.mean:.4f}{_ci(p.jsd.mean_ci)} | {p.jsd.median:.4f} | {p.jsd.p99:.4f} | "
                         f"{p.jsd.max:.4f} | {p.delta_ce:+.4f}{_ci(p.delta_ce_ci)} |")
    bins = [b["positions"] for b in report.models[0].by_position] if report.models else []
    if bins:
        lines += ["", "## Mean CE (entropy) by context position", "",
                  "| model | " + " | ".join(bins) + " |", "|---|" + "---|" * len(bins)]
        for m in report.models:
            lines.append(f"| {m.label} | " + " | ".join(f"{b['mean_ce']:.3f} ({b['mean_entropy']:.3f})"
                                                      for b in m.by_position) + " |")
    return "\n".join(lines) + "\n"


#: The tables every evaluation writes (each as NAME.csv), besides one JSON + CSV per model.
TABLES = ("comparison", "pairwise", "positions", "outliers")


def report_files(labels: list[str], *, save_tokens: bool = False) -> list[str]:
    """The names of the files `write_report` writes for models with these labels."""
    per_model = [f"{_safe(label)}{ext}" for label in labels for ext in (".json", ".csv")]
    return per_model + [f"{t}.csv" for t in TABLES] + ["comparison.md"] + ["tokens.npz"] * save_tokens + ["summary.json"]


def earlier_report(out: Path) -> list[str] | None:
    """The files an earlier `lnfree eval` in `out` wrote (as its summary.json lists them), or None if there is none."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    files = summary.get("files") if isinstance(summary, dict) and "convention" in summary else None
    return [f for f in files if isinstance(f, str) and Path(f).name == f] if isinstance(files, list) else None


def check_output_folder(out: str | Path, labels: list[str], *, overwrite: bool = False, save_tokens: bool = False) -> None:
    """Raise `EvalError` unless `out` may take an evaluation of models with these labels.

    A folder that holds anything needs `overwrite`, which replaces only the files an earlier
    evaluation there wrote; a file of the new report's names that no evaluation wrote (a summary.json
    of yours or of a run) is never replaced.
    """
    out = Path(out)
    if not out.is_dir():
        if out.exists():
            raise EvalError(f"{out} is a file, not a folder; choose another folder (CLI: --out)")
        return
    ours = set(earlier_report(out) or ()) | {STALE_MARKER}
    foreign = [name for name in report_files(labels, save_tokens=save_tokens) if (out / name).exists() and name not in ours]
    if foreign:
        raise EvalError(f"{out / foreign[0]} was not written by lnfree eval and would be replaced; choose another "
                        "folder (CLI: --out)")
    if any(out.iterdir()) and not overwrite:
        what = "an earlier evaluation" if earlier_report(out) is not None else "other files"
        raise EvalError(f"{out} already holds {what}; write into it with overwrite=True (CLI: --overwrite), which "
                        "removes only the files an evaluation wrote, or choose another folder (CLI: --out)")


def _remove_earlier_report(out: Path) -> None:
    """The files an earlier evaluation listed in its summary.json (a file the user put beside them stays)."""
    for name in earlier_report(out) or ():
        (out / name).unlink(missing_ok=True)


def write_report(report: EvalReport, out_dir: str | Path, *, save_tokens: bool = False, overwrite: bool = False) -> list[Path]:
    """Write per-model JSON/CSV, the comparison (md, csv), pairwise, position and outlier tables, summary.json.

    `out_dir` must be empty or new, or `overwrite` given: then an earlier evaluation's files there are
    replaced, and nothing else (`check_output_folder`).
    """
    import pandas as pd

    out = Path(out_dir)
    check_output_folder(out, [m.label for m in report.models], overwrite=overwrite, save_tokens=save_tokens)
    out.mkdir(parents=True, exist_ok=True)
    _remove_earlier_report(out)
    clear_stale(out)
    written = []
    shared = {"dataset": report.dataset, "settings": report.settings, "convention": report.convention, "units": UNITS}
    for m in report.models:
        path = out / f"{_safe(m.label)}.json"
        path.write_text(json.dumps({**shared, **asdict(m)}, indent=1))
        written += [path, write_table(sequence_table(report.scores[m.label], m.threshold), out, _safe(m.label))]
    written.append(write_table(pd.DataFrame(comparison_rows(report)), out, "comparison"))
    written.append(write_table(pd.DataFrame([
        {"a": p.a, "b": p.b, "scored_tokens": p.scored_tokens, "mean_jsd": p.jsd.mean, "jsd_ci_low": p.jsd.mean_ci[0],
         "jsd_ci_high": p.jsd.mean_ci[1], "median_jsd": p.jsd.median, "p99_jsd": p.jsd.p99, "max_jsd": p.jsd.max,
         "delta_ce": p.delta_ce, "delta_ce_ci_low": p.delta_ce_ci[0], "delta_ce_ci_high": p.delta_ce_ci[1]}
        for p in report.pairs], columns=["a", "b", "scored_tokens", "mean_jsd", "jsd_ci_low", "jsd_ci_high",
                                         "median_jsd", "p99_jsd", "max_jsd", "delta_ce", "delta_ce_ci_low",
                                         "delta_ce_ci_high"]), out, "pairwise"))
    written.append(write_table(pd.DataFrame([{"model": m.label, **b} for m in report.models for b in m.by_position]),
                               out, "positions"))
    columns = ["model", "sequence", "position", "token_id", "token", "context", "ce", "predicted_id", "predicted"]
    columns += [f"ce_{m.label}" for m in report.models]  # the same token's CE under every model
    written.append(write_table(pd.DataFrame(
        [{"model": m.label, **{k: v for k, v in asdict(o).items() if k != "other_models_ce"}, f"ce_{m.label}": o.ce,
          **{f"ce_{other}": v for other, v in o.other_models_ce.items()}} for m in report.models for o in m.outliers],
        columns=columns), out, "outliers"))
    md = out / "comparison.md"
    md.write_text(markdown(report))
    written.append(md)
    if save_tokens:
        arrays = {f"ce__{_safe(k)}": v.ce.numpy() for k, v in report.scores.items()}
        arrays |= {f"entropy__{_safe(k)}": v.entropy.numpy() for k, v in report.scores.items()}
        arrays |= {f"tokens__{_safe(k)}": t.numpy() for k, t in report.tokens.items()}
        arrays |= {f"jsd__{_safe(a)}__{_safe(b)}": v.numpy() for (a, b), v in report.jsd.items()}
        np.savez_compressed(out / "tokens.npz", **arrays)
        written.append(out / "tokens.npz")
    summary = report.to_dict() | {"files": [p.name for p in written] + ["summary.json"]}
    written.append(write_summary(summary, out))
    return written
