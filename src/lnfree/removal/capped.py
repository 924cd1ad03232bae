"""The passes that follow the text's in each training step, each with its gradient capped at a share of the
text's (`HeldGradients`): the generated coverage rows and one-token rows (`train.coverage`,
`lnfree.removal.losses.coverage`) and the stability margin (`lnfree.removal.losses.margin`). `s` is the run's
setup (`lnfree.removal.train._Setup`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from lnfree.removal.launch import average_gradients
from lnfree.removal.losses.coverage import Coverage, HeldGradients
from lnfree.removal.losses.margin import margin_site
from lnfree.removal.losses.objective import TERMS, Objective


def coverage_backward(s, model: nn.Module, objective: Objective, step: int, cov: Coverage,
                      texts: list[torch.Tensor]) -> torch.Tensor:
    """`step`'s generated rows (`lnfree.removal.losses.coverage`, settings `cov`), then its one-token rows (some drawn from `texts`, the step's micro-batches), after the text's gradients, each capped apart at `max_grad_share` of the gradient before them (uncapped share: `cov_share`, `first_share`; with `first_replay_apart` the replayed one-token rows capped apart, `first_replay_share`)."""
    micros, device, bos = range(s.batches.accumulation), s.accelerator.device, s.data.bos_token_id
    rows = (evaluated(lambda m=m: objective.coverage(model, s.coverage_rows(step, m, cov).to(device), cov, bos)) for m in micros)
    totals = capped_backward(s, model, rows, cov.max_grad_share, "cov_share", objective.teaching(cov.kl_weight))
    if not cov.first_token_rows:
        return totals
    # capped apart from the rows above, whose gradient would otherwise scale theirs away; the replayed ones apart too
    parts = (("first", False), ("first_replay", True)) if cov.first_replay_apart else (("first", None),)
    for term, part in parts:
        ids = [s.coverage_rows(step, m, cov, True, texts[m], part).to(device) for m in micros]
        if ids[0].numel():  # no replayed rows while nothing is mined
            first = (evaluated(lambda i=i: objective.first_tokens(model, i, cov, term)) for i in ids)
            totals += capped_backward(s, model, first, cov.max_grad_share, f"{term}_share", reads_logits=False)
    return totals


def margin_backward(s, model: nn.Module, objective: Objective, step: int, texts: list[torch.Tensor],
                    margin, preview: list | None) -> torch.Tensor:
    """The stability margin (`lnfree.removal.losses.margin`) on the first rows of each of `step`'s micro-batches
    (`texts`), after the text's gradients: one perturbed site per micro-step (or the `preview` switches
    made at once), its gradient capped at `max_grad_share` of what came before it (`capped_backward`; the
    uncapped share in `margin_share`)."""
    rank, layers, seed = s.accelerator.process_index, s.arch.n_layers, s.config.train.seed
    passes = (objective.margin(model, ids, margin_site(seed, step, micro, rank, layers=layers, context=ids.shape[1]),
                               margin, preview) for micro, ids in enumerate(texts))
    return capped_backward(s, model, passes, margin.max_grad_share, "margin_share", reads_logits=False)


@contextlib.contextmanager
def evaluated(compute: Callable):
    """A context that gives `compute()`, called on entering it."""
    yield compute()


def capped_backward(s, model: nn.Module, passes, share: float | None, share_term: str,
                    reads_logits: bool = True) -> torch.Tensor:
    """Forwards and backwards after the text's gradients are complete (and synchronised), one per micro-step:
    each of `passes` a context giving (loss, terms), entered inside the micro-step's gradient-sync context and
    left after its backward; their gradient capped at `share` of what came before (`HeldGradients`). Return their
    loss terms, with the uncapped share in `share_term`. Passes whose loss is not read off the logits (norm inputs,
    by hooks) run outside DDP's sync, which traces a backward from the forward's output, then are averaged."""
    accelerator, accumulation = s.accelerator, s.batches.accumulation
    manual = not reads_logits and accelerator.num_processes > 1 and not s.sharded
    text_grads = HeldGradients([p for p in model.parameters() if p.requires_grad], in_place=s.sharded)
    totals = torch.zeros(len(TERMS), device=accelerator.device)
    for micro, losses in enumerate(passes):
        synced = micro == accumulation - 1 and not manual
        with contextlib.nullcontext() if synced else accelerator.no_sync(model), losses as (loss, terms):
            accelerator.backward(loss / accumulation)
        totals += terms / accumulation
    if manual:
        average_gradients(text_grads.params)
    totals[TERMS.index(share_term)] = text_grads.add_back(share)
    return totals
