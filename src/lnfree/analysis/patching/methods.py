"""The two patching methods on IOI prompts, and both run on one prompt set (:func:`patch_ioi`).

Activation patching writes a clean activation into the corrupted run, one (prompt, cell) per batch
row; attribution patching takes one forward and one backward pass at the corrupted run. What is
patched and how the results are read: :mod:`lnfree.analysis.patching.run`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lnfree.errors import UsageError
from lnfree.analysis.common import logit_rows
from lnfree.analysis.ioi import IOIPrompts
from lnfree.forms.bridge import LAST_POSITION_LOGITS, hook_name

__all__ = [
    "KINDS",
    "PatchingResult",
    "activation_patching",
    "attribution_from_gradients",
    "attribution_patching",
    "cache_activations",
    "corrupted_gradients",
    "logit_diff",
    "normalise",
    "patch_ioi",
]

#: Patched activations: the residual stream per (layer, position), a head's output per (layer, head).
KINDS = ("resid_pre", "z")


# ----------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------


def _device(bridge: Any) -> torch.device:
    return torch.device(bridge.cfg.device) if getattr(bridge.cfg, "device", None) else torch.device("cpu")


def _io_minus_s(last_logits: torch.Tensor, io_ids: torch.Tensor, s_ids: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(last_logits.shape[0], device=last_logits.device)
    return last_logits[rows, io_ids] - last_logits[rows, s_ids]


def _forward_last(bridge: Any, ids: torch.Tensor, fwd_hooks: Sequence = (), bwd_hooks: Sequence = ()) -> torch.Tensor:
    """Logits ``[batch, d_vocab]`` at the last position (the unembedding sees only that position)."""
    hooks = [*fwd_hooks, LAST_POSITION_LOGITS]
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
        raise UsageError(f"unknown patching kind {kind!r}; known: {KINDS}")
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
        """The clean - corrupted logit difference per prompt, ``[n]``: what the values are normalised by."""
        return self.clean_ld - self.corrupted_ld


def patch_ioi(
    bridge: Any, prompts: IOIPrompts, kinds: Sequence[str] = KINDS, *, batch_size: int = 256,
    skip_unchanged: bool = True,
) -> PatchingResult:
    """Activation and attribution patching of every kind on ``prompts``, normalised per prompt.

    Shares the clean caches between the two methods; times each (``seconds``: the clean and
    corrupted caches and metrics, the patched forward passes, the gradient pass). A pass holds
    ``batch_size`` prompts, fewer where their last-position logits would pass
    `lnfree.analysis.common.LOGITS_BUDGET`.
    """
    vocab = bridge.cfg.d_vocab
    batch_size = logit_rows(1, vocab, batch_size)
    if int(prompts.clean_ids.max()) >= vocab or int(prompts.corrupted_ids.max()) >= vocab:
        raise UsageError("the prompts contain token ids outside the model's vocabulary (wrong tokenizer?)")
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
