"""Attribution patching vs activation patching on IOI, per model.

For each clean IOI prompt and its corruption (the partner prompt whose repeated name S2 differs,
see :mod:`lnfree.analysis.ioi`) the metric is the logit difference at the last position,
``m = logit(IO) - logit(S)`` with the clean prompt's IO and S. Two grids of cells are patched from
the clean run into the corrupted run:

* ``resid_pre``: the residual stream entering block ``layer`` at one ``position``
  (``blocks.L.hook_resid_pre``), a layer x position grid;
* ``z``: one attention head's output (its ``hook_z`` at every position, which fixes the head's
  contribution ``z @ W_O``), a layer x head grid.

**Activation patching** runs the corrupted prompt with the cell's clean activation written in and
reads ``m_patched - m_corrupted``. It is batched: every (prompt, cell) is one row of a batch of
corrupted prompts, and one hook per layer writes each row's own cell, so the number of forward
passes is ``ceil(n_prompts x n_cells / batch_size)``, not one per cell per prompt. Cells whose
clean and corrupted activations are identical (positions before S2, which a causal model cannot
see change) give exactly zero and are not run (``skip_unchanged``).

**Attribution patching** linearises the metric at the corrupted run: ``grad_corrupted(m) .
(clean - corrupted)``, summed over ``d_model`` (``resid_pre``) or over positions and ``d_head``
(``z``). One forward and one backward pass over the corrupted prompts give every cell; gradients
are read with backward hooks.

Both are normalised per prompt by the full gap ``m_clean - m_corrupted``: 1 means the cell alone
restores the clean behaviour. Agreement per model is the per-prompt NMAE
``sum|act - attr| / sum|act|`` and Pearson r over the prompt's informative cells (those whose
activation differs between the clean and corrupted runs), plus the global NMAE (ratio of sums) and
the pooled r, each with a bootstrap CI that resamples partner pairs (a prompt and its partner share
their runs, so the pair is the independent unit). The per-prompt NMAE and r are invariant to the
per-prompt normalisation and are the headline numbers. The global NMAE, the pooled r and the
heatmaps (means over prompts) use normalised values, which weight each prompt by 1/|gap|: a prompt
whose clean and corrupted runs barely differ can dominate them.

On an exactly LN-free model the only non-linearities left are attention softmax and the MLPs; on
an original model the final and per-block LayerNorm scales add more. Whether that makes
attribution patching measurably less faithful is the question this analysis answers per model.

The work is split by step: :mod:`lnfree.analysis.patching.methods` (the two methods and
:func:`patch_ioi`), :mod:`lnfree.analysis.patching.agreement` (NMAE and r with their CIs) and
:mod:`lnfree.analysis.patching.output` (tables, figures, per-model summaries); :func:`run` ties
them together. Everything a user calls is importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lnfree.analysis.common import bridge_of
from lnfree.analysis.ioi import DEFAULT_TEMPLATES, make_ioi_prompts
from lnfree.analysis.patching.agreement import agreement_per_prompt, agreement_summary
from lnfree.analysis.patching.methods import (
    KINDS,
    PatchingResult,
    activation_patching,
    attribution_from_gradients,
    attribution_patching,
    cache_activations,
    corrupted_gradients,
    logit_diff,
    normalise,
    patch_ioi,
)
from lnfree.analysis.patching.output import (
    agreement_rows,
    cell_rows,
    model_summary,
    prompt_rows,
    write_figures,
    write_tables,
)
from lnfree.evaluate.results import TIMINGS, write_summary

__all__ = [
    "KINDS",
    "PatchingResult",
    "activation_patching",
    "agreement_per_prompt",
    "agreement_summary",
    "attribution_from_gradients",
    "attribution_patching",
    "cache_activations",
    "corrupted_gradients",
    "logit_diff",
    "normalise",
    "patch_ioi",
    "run",
]


def run(
    models: Sequence[Any],
    out_dir: str | Path,
    *,
    n_prompts: int = 32,
    seed: int = 0,
    n_bootstrap: int = 1000,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    prepend_bos: bool = True,
    batch_size: int = 256,
    skip_unchanged: bool = True,
    kinds: Sequence[str] = KINDS,
) -> dict:
    """Attribution vs activation patching on IOI for each model; writes tables, figures and a summary.

    ``models`` are :class:`lnfree.analysis.common.AnalysisModel` (a label, a tokenizer, a bridge).
    Each model gets ``n_prompts`` prompts from :func:`lnfree.analysis.ioi.make_ioi_prompts` with
    its own tokenizer and ``seed`` (identical prompts for models sharing a tokenizer).

    Writes ``patching_cells.csv`` (one row per model, kind, prompt, layer, cell: normalised
    activation and attribution values), ``patching_prompts.csv`` (prompts, logit differences,
    per-prompt NMAE and r), ``patching_agreement.csv`` (per model and kind: statistic, value, CI),
    heatmaps per model, a scatter and an agreement figure, ``patching_summary.json`` and ``timings.json``
    (the seconds each method took: kept apart so that the results rewrite byte-identically).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, PatchingResult] = {}
    per_model: dict[str, dict] = {}
    cells, per_prompt, agreement = [], [], []
    for model in models:
        prompts = make_ioi_prompts(model.tokenizer, n_prompts, seed=seed, templates=templates, prepend_bos=prepend_bos)
        with bridge_of(model) as bridge:
            result = patch_ioi(bridge, prompts, kinds, batch_size=batch_size, skip_unchanged=skip_unchanged)
        info = model_summary(model.ln_free, result, kinds, n_bootstrap=n_bootstrap, seed=seed)
        results[model.label], per_model[model.label] = result, info
        cells += cell_rows(model.label, result)
        per_prompt += prompt_rows(model.label, result)
        agreement += agreement_rows(model.label, info["agreement"])

    tables = write_tables(out_dir, cells, per_prompt, agreement)
    figures = write_figures(out_dir, results, agreement)
    first = next(iter(results.values()), None)
    summary = {
        "analysis": "attribution vs activation patching on IOI",
        "settings": {
            "n_prompts": n_prompts, "seed": seed, "n_bootstrap": n_bootstrap, "templates": list(templates),
            "prepend_bos": prepend_bos, "batch_size": batch_size, "skip_unchanged": skip_unchanged,
            "kinds": list(kinds), "metric": "logit(IO) - logit(S) at the last position, normalised per prompt by "
            "(clean - corrupted)", "bootstrap_unit": "partner pair (a prompt and its corruption's prompt)",
            "agreement_cells": "cells whose clean and corrupted activations differ",
        },  # fmt: skip
        "position_labels": first.prompts.position_labels if first else [],
        "models": per_model,
        "tables": [str(p) for p in tables],
        "figures": [str(p) for p in figures],
    }
    summary["summary"] = str(out_dir / "patching_summary.json")
    write_summary(summary, out_dir, "patching_summary")
    write_summary({"seconds": {label: result.seconds for label, result in results.items()}}, out_dir, TIMINGS)
    return summary
