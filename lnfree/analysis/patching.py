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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lnfree.analysis.common import write_figure
from lnfree.results import TIMINGS, bootstrap_ci, ratio_of_means_ci, write_summary, write_table
from lnfree.analysis.ioi import DEFAULT_TEMPLATES, IOIPrompts, make_ioi_prompts
from lnfree.bridge import hook_name

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

#: Patched activations: the residual stream per (layer, position), a head's output per (layer, head).
KINDS = ("resid_pre", "z")


# ----------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------


def _device(bridge: Any) -> torch.device:
    return torch.device(bridge.cfg.device) if getattr(bridge.cfg, "device", None) else torch.device("cpu")


def _last_position_only(x: torch.Tensor, hook: Any) -> torch.Tensor:
    """Forward hook on the unembedding's input: keep the last position (only its logits are needed)."""
    return x[:, -1:]


def _io_minus_s(last_logits: torch.Tensor, io_ids: torch.Tensor, s_ids: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(last_logits.shape[0], device=last_logits.device)
    return last_logits[rows, io_ids] - last_logits[rows, s_ids]


def _forward_last(bridge: Any, ids: torch.Tensor, fwd_hooks: Sequence = (), bwd_hooks: Sequence = ()) -> torch.Tensor:
    """Logits ``[batch, d_vocab]`` at the last position (the unembedding sees only that position)."""
    hooks = [*fwd_hooks, ("unembed.hook_in", _last_position_only)]
    with bridge.hooks(fwd_hooks=hooks, bwd_hooks=list(bwd_hooks)):
        return bridge(ids, return_type="logits")[:, -1]


def logit_diff(bridge: Any, ids: torch.Tensor, io_ids: torch.Tensor, s_ids: torch.Tensor, *,
               batch_size: int = 256) -> torch.Tensor:
    """``logit(io) - logit(s)`` at the last position of each row of ``ids`` (no gradient), ``[n]``."""
    device = _device(bridge)
    out = []
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch_size):
            sl = slice(start, start + batch_size)
            last = _forward_last(bridge, ids[sl].to(device))
            out.append(_io_minus_s(last, io_ids[sl].to(device), s_ids[sl].to(device)).float().cpu())
    return torch.cat(out)


def _hook_for(kind: str, layer: int) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown patching kind {kind!r}; known: {KINDS}")
    return hook_name(kind, layer)


def cache_activations(bridge: Any, ids: torch.Tensor, kind: str, *, batch_size: int = 256) -> torch.Tensor:
    """The ``kind`` activation at every layer, ``[n_layers, n, pos, ...]`` (fp32, CPU, no gradient).

    ``resid_pre``: ``[n_layers, n, pos, d_model]``; ``z``: ``[n_layers, n, pos, n_heads, d_head]``.
    """
    n_layers = bridge.cfg.n_layers
    device = _device(bridge)
    chunks: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    def saver(layer: int):
        def fn(x: torch.Tensor, hook: Any) -> None:
            chunks[layer].append(x.detach().float().cpu())

        return fn

    hooks = [(_hook_for(kind, layer), saver(layer)) for layer in range(n_layers)]
    with torch.no_grad():
        for start in range(0, ids.shape[0], batch_size):
            _forward_last(bridge, ids[start : start + batch_size].to(device), fwd_hooks=hooks)
    return torch.stack([torch.cat(c) for c in chunks])


def normalise(delta: torch.Tensor, clean: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
    """``delta / (clean - corrupted)`` per prompt (first axis): 1 = the full clean-corrupted gap."""
    gap = (clean - corrupted).to(delta.dtype)
    return delta / gap.reshape(-1, *([1] * (delta.ndim - 1)))


# ----------------------------------------------------------------------------------------------
# Activation patching (batched)
# ----------------------------------------------------------------------------------------------


def _changed_cells(kind: str, clean: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
    """``[n, n_layers, n_cells]``: cells whose clean and corrupted activations differ."""
    differs = clean != corrupted  # [L, n, pos, ...]
    if kind == "resid_pre":
        return differs.any(-1).permute(1, 0, 2)  # [n, L, pos]
    return differs.any(-1).any(2).permute(1, 0, 2)  # z: over d_head, then positions -> [n, L, heads]


def activation_patching(
    bridge: Any,
    prompts: IOIPrompts,
    kind: str = "resid_pre",
    *,
    batch_size: int = 256,
    skip_unchanged: bool = True,
    clean_cache: torch.Tensor | None = None,
    corrupted_cache: torch.Tensor | None = None,
    corrupted_ld: torch.Tensor | None = None,
) -> torch.Tensor:
    """``m_patched - m_corrupted`` (logits, not normalised) for every prompt and cell.

    Returns ``[n_prompts, n_layers, n_positions]`` for ``kind="resid_pre"`` and
    ``[n_prompts, n_layers, n_heads]`` for ``kind="z"`` (the head's ``z`` patched at all positions).
    Each batch row is one corrupted prompt with one cell patched; a hook per layer writes the
    clean values of the rows assigned to that layer. With ``skip_unchanged`` cells whose clean and
    corrupted activations are identical are not run (their value is exactly 0). Caches and the
    corrupted metric are computed when not given (pass them to share work).
    """
    if clean_cache is None:
        clean_cache = cache_activations(bridge, prompts.clean_ids, kind, batch_size=batch_size)
    if skip_unchanged and corrupted_cache is None:
        corrupted_cache = cache_activations(bridge, prompts.corrupted_ids, kind, batch_size=batch_size)
    if corrupted_ld is None:
        corrupted_ld = logit_diff(bridge, prompts.corrupted_ids, prompts.io_ids, prompts.s_ids, batch_size=batch_size)
    n_layers, n = clean_cache.shape[:2]
    n_cells = clean_cache.shape[2] if kind == "resid_pre" else clean_cache.shape[3]
    if skip_unchanged:
        run_mask = _changed_cells(kind, clean_cache, corrupted_cache)
    else:
        run_mask = torch.ones(n, n_layers, n_cells, dtype=torch.bool)
    jobs = run_mask.nonzero()  # [n_jobs, 3]: (prompt, layer, cell), ordered by prompt then layer
    jobs = jobs[torch.argsort(jobs[:, 1] * n + jobs[:, 0], stable=True)]  # group by layer
    out = torch.zeros(n, n_layers, n_cells)
    device = _device(bridge)
    dtype = next(iter(bridge.parameters())).dtype
    cache_dev = clean_cache.to(device=device, dtype=dtype)

    with torch.no_grad():
        for start in range(0, jobs.shape[0], batch_size):
            chunk = jobs[start : start + batch_size]
            prompt, layer, cell = chunk[:, 0], chunk[:, 1], chunk[:, 2]
            hooks = []
            for lay in layer.unique().tolist():
                rows = (layer == lay).nonzero().squeeze(1)
                src_prompt, src_cell = prompt[rows].to(device), cell[rows].to(device)
                rows = rows.to(device)

                def patch(x: torch.Tensor, hook: Any, lay=lay, rows=rows, src_prompt=src_prompt, src_cell=src_cell):
                    x = x.clone()
                    if kind == "resid_pre":
                        x[rows, src_cell] = cache_dev[lay, src_prompt, src_cell]
                    else:  # z: [batch, pos, head, d_head], the head at every position
                        x[rows, :, src_cell] = cache_dev[lay, src_prompt, :, src_cell]
                    return x

                hooks.append((_hook_for(kind, lay), patch))
            last = _forward_last(bridge, prompts.corrupted_ids[prompt].to(device), fwd_hooks=hooks)
            patched = _io_minus_s(last, prompts.io_ids[prompt].to(device), prompts.s_ids[prompt].to(device))
            out[prompt, layer, cell] = patched.float().cpu() - corrupted_ld[prompt]
    return out


# ----------------------------------------------------------------------------------------------
# Attribution patching (one forward + backward)
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _activation_gradients_only(bridge: Any):
    """Parameters stop requiring grad (no weight gradients are computed); the embeddings' outputs do."""
    params = list(bridge.parameters())
    flags = [p.requires_grad for p in params]

    def leaf(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x.detach().requires_grad_(True)

    try:
        for p in params:
            p.requires_grad_(False)
        yield [(hook_name("embed"), leaf), (hook_name("pos_embed"), leaf)]
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def corrupted_gradients(
    bridge: Any, prompts: IOIPrompts, kinds: Sequence[str] = KINDS, *, batch_size: int = 256,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """At the corrupted run: (activations, gradients of the metric, metric) for every kind and layer.

    Activations and gradients are ``{kind: [n_layers, n, pos, ...]}`` (fp32, CPU); the metric is
    ``[n]``. One forward and one backward pass per batch; gradients come from backward hooks and
    no weight gradient is computed.
    """
    n_layers = bridge.cfg.n_layers
    device = _device(bridge)
    keys = [(k, lay) for k in kinds for lay in range(n_layers)]
    acts: dict[tuple[str, int], list[torch.Tensor]] = {key: [] for key in keys}
    grads: dict[tuple[str, int], list[torch.Tensor]] = {key: [] for key in keys}
    metric = []

    def saver(store: dict, key: tuple[str, int]):
        def fn(x: torch.Tensor, hook: Any) -> None:
            store[key].append(x.detach().float().cpu())

        return fn

    fwd = [(_hook_for(*key), saver(acts, key)) for key in keys]
    bwd = [(_hook_for(*key), saver(grads, key)) for key in keys]
    with _activation_gradients_only(bridge) as leaves, torch.enable_grad():
        for start in range(0, prompts.corrupted_ids.shape[0], batch_size):
            sl = slice(start, start + batch_size)
            last = _forward_last(bridge, prompts.corrupted_ids[sl].to(device), fwd_hooks=[*leaves, *fwd], bwd_hooks=bwd)
            m = _io_minus_s(last, prompts.io_ids[sl].to(device), prompts.s_ids[sl].to(device))
            # Rows are independent, so the gradient of the sum is each row's own gradient.
            m.sum().backward()
            metric.append(m.detach().float().cpu())
            for key in keys:
                if len(grads[key]) != len(metric) or len(acts[key]) != len(metric):  # pragma: no cover
                    raise RuntimeError(f"hook {_hook_for(*key)} fired {len(acts[key])} / {len(grads[key])} times "
                                       f"(forward / backward) in {len(metric)} batches")  # fmt: skip
    stacked_acts = {k: torch.stack([torch.cat(acts[k, lay]) for lay in range(n_layers)]) for k in kinds}
    stacked_grads = {k: torch.stack([torch.cat(grads[k, lay]) for lay in range(n_layers)]) for k in kinds}
    return stacked_acts, stacked_grads, torch.cat(metric)


def attribution_from_gradients(
    kind: str, clean: torch.Tensor, corrupted: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """``grad . (clean - corrupted)`` per cell: ``[n, n_layers, pos]`` (resid_pre) or ``[n, n_layers, heads]`` (z)."""
    product = (clean - corrupted) * grad
    if kind == "resid_pre":
        return product.sum(-1).permute(1, 0, 2)
    return product.sum((-1, 2)).permute(1, 0, 2)  # z [L, n, pos, head, d_head]: over d_head and positions


def attribution_patching(
    bridge: Any, prompts: IOIPrompts, kind: str = "resid_pre", *, batch_size: int = 256,
    clean_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """The linear estimate of ``m_patched - m_corrupted`` for every prompt and cell (logits).

    Same shapes as :func:`activation_patching`: ``grad_corrupted(m) . (clean - corrupted)``.
    """
    if clean_cache is None:
        clean_cache = cache_activations(bridge, prompts.clean_ids, kind, batch_size=batch_size)
    acts, grads, _ = corrupted_gradients(bridge, prompts, (kind,), batch_size=batch_size)
    return attribution_from_gradients(kind, clean_cache, acts[kind], grads[kind])


# ----------------------------------------------------------------------------------------------
# Both, on one set of prompts
# ----------------------------------------------------------------------------------------------


@dataclass
class PatchingResult:
    """Activation and attribution patching of one model on one prompt set (values normalised by the gap)."""

    prompts: IOIPrompts
    clean_ld: torch.Tensor  # [n]
    corrupted_ld: torch.Tensor  # [n]
    activation: dict[str, torch.Tensor]  # kind -> [n, n_layers, n_cells], normalised
    attribution: dict[str, torch.Tensor]  # kind -> [n, n_layers, n_cells], normalised
    changed: dict[str, torch.Tensor]  # kind -> [n, n_layers, n_cells] bool: clean != corrupted activation
    seconds: dict[str, float]  # "activation", "attribution", "caches"

    @property
    def gap(self) -> torch.Tensor:
        return self.clean_ld - self.corrupted_ld


def patch_ioi(
    bridge: Any, prompts: IOIPrompts, kinds: Sequence[str] = KINDS, *, batch_size: int = 256,
    skip_unchanged: bool = True,
) -> PatchingResult:
    """Activation and attribution patching of every kind on ``prompts``, normalised per prompt.

    Shares the clean caches between the two methods; times each (``seconds``: the clean and
    corrupted caches and metrics, the patched forward passes, the gradient pass).
    """
    vocab = bridge.cfg.d_vocab
    if int(prompts.clean_ids.max()) >= vocab or int(prompts.corrupted_ids.max()) >= vocab:
        raise ValueError("the prompts contain token ids outside the model's vocabulary (wrong tokenizer?)")
    t0 = time.perf_counter()
    clean_ld = logit_diff(bridge, prompts.clean_ids, prompts.io_ids, prompts.s_ids, batch_size=batch_size)
    clean = {k: cache_activations(bridge, prompts.clean_ids, k, batch_size=batch_size) for k in kinds}
    t1 = time.perf_counter()
    corrupted_acts, grads, corrupted_ld = corrupted_gradients(bridge, prompts, kinds, batch_size=batch_size)
    attribution = {k: attribution_from_gradients(k, clean[k], corrupted_acts[k], grads[k]) for k in kinds}
    t2 = time.perf_counter()
    # The patched runs are compared with an unpatched corrupted run computed the same way (no grad).
    corrupted_ld_ng = logit_diff(bridge, prompts.corrupted_ids, prompts.io_ids, prompts.s_ids, batch_size=batch_size)
    activation = {
        k: activation_patching(bridge, prompts, k, batch_size=batch_size, skip_unchanged=skip_unchanged,
                               clean_cache=clean[k], corrupted_cache=corrupted_acts[k], corrupted_ld=corrupted_ld_ng)
        for k in kinds
    }  # fmt: skip
    t3 = time.perf_counter()
    changed = {k: _changed_cells(k, clean[k], corrupted_acts[k]) for k in kinds}
    return PatchingResult(
        prompts=prompts,
        clean_ld=clean_ld,
        corrupted_ld=corrupted_ld_ng,
        activation={k: normalise(v, clean_ld, corrupted_ld_ng) for k, v in activation.items()},
        attribution={k: normalise(v, clean_ld, corrupted_ld_ng) for k, v in attribution.items()},
        changed=changed,
        seconds={"caches": t1 - t0, "attribution": t2 - t1, "activation": t3 - t2},
    )


# ----------------------------------------------------------------------------------------------
# Agreement
# ----------------------------------------------------------------------------------------------


def agreement_per_prompt(
    activation: torch.Tensor | np.ndarray, attribution: torch.Tensor | np.ndarray,
    mask: torch.Tensor | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt (first axis): NMAE ``sum|act - attr| / sum|act|`` and Pearson r over the cells in ``mask``.

    A prompt with no activation effect gets NMAE nan; one with fewer than two cells or a constant
    grid gets r nan.
    """
    act = np.asarray(activation, np.float64).reshape(len(activation), -1)
    att = np.asarray(attribution, np.float64).reshape(len(attribution), -1)
    keep = np.ones_like(act, bool) if mask is None else np.asarray(mask, bool).reshape(len(act), -1)
    nmae = np.full(len(act), np.nan)
    r = np.full(len(act), np.nan)
    for i in range(len(act)):
        a, b = act[i, keep[i]], att[i, keep[i]]
        den = np.abs(a).sum()
        if den > 0:
            nmae[i] = np.abs(a - b).sum() / den
        if a.size >= 2 and a.std() > 0 and b.std() > 0:
            r[i] = float(np.corrcoef(a, b)[0, 1])
    return nmae, r


def _pearson_from_sums(s: np.ndarray) -> float:
    n, sa, sb, saa, sbb, sab = s.sum(0)
    cov = sab / n - (sa / n) * (sb / n)
    var_a, var_b = saa / n - (sa / n) ** 2, sbb / n - (sb / n) ** 2
    return float(cov / math.sqrt(var_a * var_b)) if var_a > 0 and var_b > 0 else float("nan")


def agreement_summary(
    activation: torch.Tensor, attribution: torch.Tensor, mask: torch.Tensor | None = None,
    units: Sequence[int] | None = None, *, n_bootstrap: int = 1000, seed: int = 0,
) -> dict[str, Any]:
    """NMAE and Pearson r of attribution vs activation patching, with percentile bootstrap CIs.

    ``units`` (one id per prompt, e.g. the partner pair) are resampled together; default: each
    prompt is its own unit. Returns ``nmae`` (ratio of sums over prompts x cells), ``nmae_per_prompt``
    (mean of per-prompt NMAE), ``pearson_r`` (mean of per-prompt r), ``pearson_r_pooled`` (all cells
    of all prompts) and ``pearson_r_mean_map`` (between the prompt-averaged grids; no CI), each
    as ``{"value", "ci_low", "ci_high"}``, plus ``n_prompts``, ``n_units`` and ``n_cells``.
    """
    act = np.asarray(activation, np.float64).reshape(len(activation), -1)
    att = np.asarray(attribution, np.float64).reshape(len(attribution), -1)
    keep = np.ones_like(act, bool) if mask is None else np.asarray(mask, bool).reshape(len(act), -1)
    nmae_p, r_p = agreement_per_prompt(act, att, keep)
    units = np.arange(len(act)) if units is None else np.asarray(units)
    ids = list(dict.fromkeys(units.tolist()))
    a0, b0 = np.where(keep, act, 0.0), np.where(keep, att, 0.0)
    per_unit = []
    for u in ids:
        sel = units == u
        a, b, k = a0[sel], b0[sel], keep[sel]
        per_unit.append([
            np.abs(a - b).sum(), np.abs(a).sum(),  # NMAE numerator / denominator
            np.nanmean(nmae_p[sel]) if np.isfinite(nmae_p[sel]).any() else np.nan,
            np.nanmean(r_p[sel]) if np.isfinite(r_p[sel]).any() else np.nan,
            k.sum(), a.sum(), b.sum(), (a * a).sum(), (b * b).sum(), (a * b).sum(),
        ])  # fmt: skip
    per_unit = np.array(per_unit)
    boot = {"n_resamples": n_bootstrap, "seed": seed}
    nan_ci = (float("nan"), float("nan"))

    def entry(value: float, ci: tuple[float, float]) -> dict[str, float]:
        return {"value": float(value), "ci_low": ci[0], "ci_high": ci[1]}

    finite = lambda col: per_unit[np.isfinite(per_unit[:, col]), col]  # noqa: E731
    return {
        "nmae": entry(per_unit[:, 0].sum() / per_unit[:, 1].sum(),
                      ratio_of_means_ci(per_unit[:, 0], per_unit[:, 1], **boot)),
        "nmae_per_prompt": entry(np.nanmean(nmae_p), bootstrap_ci(finite(2), **boot)),
        "pearson_r": entry(np.nanmean(r_p), bootstrap_ci(finite(3), **boot)),
        "pearson_r_pooled": entry(_pearson_from_sums(per_unit[:, 4:]),
                                  bootstrap_ci(per_unit[:, 4:], statistic=_pearson_from_sums, **boot)),
        "pearson_r_mean_map": entry(_mean_map_r(act, att, keep), nan_ci),
        "n_prompts": int(len(act)),
        "n_units": int(len(ids)),
        "n_cells": int(keep.sum()),
    }  # fmt: skip


def _mean_map_r(act: np.ndarray, att: np.ndarray, keep: np.ndarray) -> float:
    cells = keep.any(0)
    a, b = act.mean(0)[cells], att.mean(0)[cells]
    if a.size < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


# ----------------------------------------------------------------------------------------------
# Tables, figures, run()
# ----------------------------------------------------------------------------------------------

_GRID_NAMES = {"resid_pre": "resid_pre (layer x position)", "z": "attention heads (layer x head)"}


def _cell_rows(label: str, result: PatchingResult) -> list[dict]:
    p = result.prompts
    rows = []
    for kind in result.activation:
        act, att, changed = result.activation[kind], result.attribution[kind], result.changed[kind]
        n, n_layers, n_cells = act.shape
        for i in range(n):
            for layer in range(n_layers):
                for c in range(n_cells):
                    rows.append({
                        "model": label, "kind": kind, "prompt": i, "pair": p.pair[i], "order": p.orders[i],
                        "layer": layer, "cell": c,
                        "cell_label": p.position_labels[c] if kind == "resid_pre" else f"H{c}",
                        "activation": float(act[i, layer, c]), "attribution": float(att[i, layer, c]),
                        "changed": bool(changed[i, layer, c]),
                    })  # fmt: skip
    return rows


def _prompt_rows(label: str, result: PatchingResult) -> list[dict]:
    p = result.prompts
    per_kind = {k: agreement_per_prompt(result.activation[k], result.attribution[k], result.changed[k])
                for k in result.activation}  # fmt: skip
    rows = []
    for i in range(len(p)):
        row = {
            "model": label, "prompt": i, "pair": p.pair[i], "order": p.orders[i], "template": p.templates[i],
            "clean": p.clean_texts[i], "corrupted": p.corrupted_texts[i], "io": p.io_names[i], "s": p.s_names[i],
            "clean_logit_diff": float(result.clean_ld[i]), "corrupted_logit_diff": float(result.corrupted_ld[i]),
            "gap": float(result.gap[i]),
        }  # fmt: skip
        for k, (nmae, r) in per_kind.items():
            row[f"nmae_{k}"], row[f"pearson_r_{k}"] = float(nmae[i]), float(r[i])
        rows.append(row)
    return rows


def _heatmap_figure(label: str, result: PatchingResult):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    kinds = list(result.activation)
    titles = [f"{method} patching: {_GRID_NAMES.get(k, k)}" for k in kinds for method in ("activation", "attribution")]
    fig = make_subplots(rows=len(kinds), cols=2, subplot_titles=titles, horizontal_spacing=0.12, vertical_spacing=0.18)
    p = result.prompts
    for r, kind in enumerate(kinds, start=1):
        act = result.activation[kind].mean(0).numpy()
        att = result.attribution[kind].mean(0).numpy()
        bound = float(max(np.abs(act).max(), np.abs(att).max(), 1e-9))
        x = ([f"{i}:{lab}" for i, lab in enumerate(p.position_labels)] if kind == "resid_pre"
             else [f"H{h}" for h in range(act.shape[1])])  # fmt: skip
        y = [f"L{layer}" for layer in range(act.shape[0])]
        for c, grid in enumerate((act, att), start=1):
            fig.add_trace(go.Heatmap(
                z=grid, x=x, y=y, zmin=-bound, zmax=bound, colorscale="RdBu", reversescale=True,
                colorbar={"len": 0.4, "y": 1 - (r - 0.5) / len(kinds), "title": "norm."}, showscale=c == 2,
                hovertemplate="%{y} %{x}: %{z:.3f}<extra></extra>",
            ), row=r, col=c)  # fmt: skip
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=f"{label}: IOI patching, mean over {len(p)} prompts (1 = the clean−corrupted gap)",
                      height=380 * len(kinds))  # fmt: skip
    return fig


def _scatter_figure(results: dict[str, PatchingResult]):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    labels = list(results)
    kinds = list(next(iter(results.values())).activation) if results else []
    fig = make_subplots(rows=len(kinds), cols=len(labels), subplot_titles=[
        f"{label}: {k}" for k in kinds for label in labels])  # fmt: skip
    for r, kind in enumerate(kinds, start=1):
        for c, label in enumerate(labels, start=1):
            res = results[label]
            keep = res.changed[kind].numpy()
            a = res.activation[kind].numpy()[keep]
            b = res.attribution[kind].numpy()[keep]
            lo, hi = float(min(a.min(initial=0), b.min(initial=0))), float(max(a.max(initial=0), b.max(initial=0)))
            fig.add_trace(go.Scattergl(x=a, y=b, mode="markers", marker={"size": 3, "opacity": 0.5},
                                       name=f"{label} {kind}", showlegend=False), row=r, col=c)  # fmt: skip
            fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dot", "color": "grey"},
                                     showlegend=False), row=r, col=c)  # fmt: skip
            fig.update_xaxes(title_text="activation patching", row=r, col=c)
            fig.update_yaxes(title_text="attribution patching", row=r, col=c)
    fig.update_layout(title="Attribution vs activation patching per cell and prompt (normalised)",
                      height=420 * max(len(kinds), 1))  # fmt: skip
    return fig


def _agreement_figure(agreement_rows: list[dict]):
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    stats = ("nmae", "pearson_r")
    titles = ["NMAE (global, lower is better)", "Pearson r (mean per prompt)"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles)
    kinds = list(dict.fromkeys(r["kind"] for r in agreement_rows))
    for c, stat in enumerate(stats, start=1):
        for kind in kinds:
            rows = [r for r in agreement_rows if r["kind"] == kind and r["statistic"] == stat]
            fig.add_trace(go.Bar(
                x=[r["model"] for r in rows], y=[r["value"] for r in rows], name=kind, legendgroup=kind,
                showlegend=c == 1,
                error_y={"type": "data", "symmetric": False,
                         "array": [r["ci_high"] - r["value"] for r in rows],
                         "arrayminus": [r["value"] - r["ci_low"] for r in rows]},
            ), row=1, col=c)  # fmt: skip
    fig.update_layout(barmode="group", title="Attribution vs activation patching agreement (95% bootstrap CI)",
                      height=450)  # fmt: skip
    return fig


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
    import pandas as pd

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, PatchingResult] = {}
    cells, prompt_rows, agreement_rows = [], [], []
    per_model: dict[str, dict] = {}
    for model in models:
        prompts = make_ioi_prompts(model.tokenizer, n_prompts, seed=seed, templates=templates, prepend_bos=prepend_bos)
        result = patch_ioi(model.bridge(), prompts, kinds, batch_size=batch_size, skip_unchanged=skip_unchanged)
        results[model.label] = result
        cells.extend(_cell_rows(model.label, result))
        prompt_rows.extend(_prompt_rows(model.label, result))
        info: dict[str, Any] = {
            "ln_free": bool(model.ln_free),
            "n_prompts": len(prompts),
            "templates_dropped": prompts.dropped_templates,  # templates whose tokens do not align with the rest
            "clean_logit_diff_mean": float(result.clean_ld.mean()),
            "corrupted_logit_diff_mean": float(result.corrupted_ld.mean()),
            "ioi_accuracy_clean": float((result.clean_ld > 0).float().mean()),
            "min_abs_gap": float(result.gap.abs().min()),
            "agreement": {},
        }
        for kind in kinds:
            agree = agreement_summary(result.activation[kind], result.attribution[kind], result.changed[kind],
                                      units=prompts.pair, n_bootstrap=n_bootstrap, seed=seed)  # fmt: skip
            info["agreement"][kind] = agree
            for stat, val in agree.items():
                if isinstance(val, dict):
                    agreement_rows.append({"model": model.label, "kind": kind, "statistic": stat, **val,
                                           "n_prompts": agree["n_prompts"], "n_units": agree["n_units"],
                                           "n_cells": agree["n_cells"]})  # fmt: skip
        per_model[model.label] = info

    tables = [
        write_table(pd.DataFrame(cells), out_dir, "patching_cells"),
        write_table(pd.DataFrame(prompt_rows), out_dir, "patching_prompts"),
        write_table(pd.DataFrame(agreement_rows), out_dir, "patching_agreement"),
    ]
    figures: list[Path] = []
    for label, result in results.items():
        figures += write_figure(_heatmap_figure(label, result), out_dir, f"patching_heatmaps_{label}")
    if results:
        figures += write_figure(_scatter_figure(results), out_dir, "patching_scatter")
        figures += write_figure(_agreement_figure(agreement_rows), out_dir, "patching_agreement")
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
