"""Vocabulary coverage: rows of random and repeated token ids beside every training micro-batch.

An LN-free gated model runs away on tokens its fine-tuning text almost never shows (a rare id, a word
repeated many times): a fixed σ no longer scales them back, and the fixed blocks above square what
they add. Fine-tuning on real text alone never puts them in front of the loss. `train.coverage` adds
`rows` generated sequences to every micro-step, each BOS-led (where the family reads one): BOS and
one id repeated to the context length (a share `repeated_share` of the rows), or BOS and uniformly
random ids; with `copy_share`, a share of the random rows repeat a span of their random ids to the row's
end, so that the KL to the teacher keeps the original's in-context copying (induction), which fixed norms
otherwise wear away (experiments/robust/induction.py). The ids are a pure function of (seed, step,
micro-step, rank), so a resumed run and its vanilla control see the same rows. On them the model is trained

- towards the original's predictions (KL to the teacher, weight `kl_weight`; no cross-entropy, the
  rows are not text), and
- to keep every token's scale at every norm input within `ratio`× the typical scale of *real text*
  at that input (the text micro-batch of the same step): the hinge of `train.scale_tail`, measured
  against text rather than against the generated rows themselves.

They run in a forward of their own with the norms' σ statistics paused, so σ stays a measure of text.

**Replay.** One row per micro-step repeats some 700 of Gemma's 262,144 ids in a 1,401-step removal (one
micro-step per step, half the rows repeated); the ids that still run away when repeated at its end are
found by a short sweep over the whole vocabulary
(`lnfree.removal.mining`, `experiments/robust/mine_repeated.py`). `replay` lists such ids: a share
`replay_share` of the repeated rows then repeats one of them instead of a uniform id. With `mine`, the run
itself sweeps a part of the vocabulary when the setting starts and replays what it finds (kept in the
run folder's `mined_ids.json`); with `mine.random` it also sweeps the part in rows of random ids, and
`replay_random` puts the replayed ids into a share of the random rows as well.

**Position 0 without BOS.** A token at position 0 attends to itself only, so what it writes there is a function of
its id; a recipe whose text always starts with BOS never trains that position for any other id, and half of Gemma 3
270M's vocabulary ran away there in its LN-free model (`experiments/robust/position0_sweep.py`).
`first_token_rows` adds one-token rows of random ids, the hinge at their only token, in a forward and a gradient
cap of their own (`first_token_ids`, `Objective.first_tokens`). Like the other
step-dependent losses, `train.coverage` may be a list of settings by `start`, so a run can mine and
replay from a later step on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch.nn.utils import get_total_norm

from lnfree.fixedscale.functional import second_moment
from lnfree.removal.losses.sharded import whole
from lnfree.removal.mining import Mining

#: Mixes the step into the rows' seed (any fixed number unlikely to collide with a user's seed).
_STREAM = 7919
#: Mixes into the one-token rows' seed (`first_token_ids`), apart from the other rows' stream.
_FIRST_STREAM = 7927
#: The shortest span a copy row repeats (`Coverage.copy_share`); the longest is half the row.
COPY_SPAN_MIN = 4
#: The share of a random row's positions that hold replayed ids (`Coverage.replay_random`): most of the
#: row stays random context, as in the sweep that finds such ids.
REPLAY_DENSITY = 1 / 8


class Coverage(BaseModel):
    """Generated rows of rare and repeated ids beside each micro-batch (`train.coverage`)."""

    model_config = ConfigDict(extra="forbid")
    rows: int = Field(1, ge=1, description="generated sequences per micro-step")
    repeated_share: float = Field(0.5, ge=0, le=1, description="share of them that repeat one id; the rest are random ids")
    ratio: float = Field(2.0, gt=1, description="hinge on tokens above this many times real text's typical scale")
    weight: float = Field(1.0, ge=0, description="the hinge's weight (0 turns the rows off, as every step-dependent "
                          "loss's weight)")
    kl_weight: float = Field(1.0, ge=0, description="weight of the KL to the teacher on these rows (with distillation)")
    start: int = Field(0, ge=0, description="the first step with generated rows")
    max_grad_share: float | None = Field(
        None, gt=0, description="cap the rows' gradient at this share of the text's (by norm, per step), so that "
        "they never dominate an update that gradient clipping then shrinks; None: no cap")
    replay: list[int] | None = Field(
        None, description="ids to replay in the repeated rows: a list, or a JSON file whose `overflow` list holds "
        "them (experiments/robust/mine_repeated.py; read when the config is, so the run config keeps the ids)")
    replay_share: float = Field(0.5, ge=0, le=1, description="share of the repeated rows that repeat a `replay` id")
    replay_random: float = Field(0.0, ge=0, le=1, description="share of the random rows that carry `replay` ids "
                                 f"too, each of their positions one with probability {REPLAY_DENSITY:g} (ids that "
                                 "run away among other ids: `mine.random`)")
    copy_share: float = Field(0.0, ge=0, le=1, description="share of the random rows that repeat a span of their "
                              f"own random ids to the row's end (in-context copying; the span {COPY_SPAN_MIN} ids "
                              "to half the row), which the original predicts from the first span")
    no_bos_share: float = Field(0.0, ge=0, le=1, description="share of the rows that do not start with BOS (a "
                                "family that reads one; its first token is then the row's own id): users who "
                                "tokenise without special tokens feed such input")
    no_bos_position0: bool = Field(False, description="hinge position 0 too in the rows without BOS: their first "
                                   "token is an ordinary id, alone at position 0 (which the hinge otherwise leaves "
                                   "to `train.position0_tail`, written for BOS)")
    first_token_rows: int = Field(0, ge=0, description="one-token rows of uniform random ids (no BOS) per micro-step, "
                                  "in a forward of their own: the hinge at their only token, position 0, where input "
                                  "without BOS puts its first token; their gradient capped apart at max_grad_share")
    first_text_share: float = Field(0.0, ge=0, le=1, description="share of the one-token rows whose id is drawn "
                                    "from the text micro-batch before them (ids as frequent as in text: a uniform "
                                    "draw reaches a frequent id as rarely as any other)")
    first_replay_share: float = Field(0.0, ge=0, le=1, description="share of the one-token rows whose id is one "
                                      "the setting replays (`replay`, `mine`): an id that runs away alone at position 0 "
                                      "(`mine.alone`) is then trained there many times, not once in 1,000 steps")
    first_replay_apart: bool = Field(False, description="cap the replayed one-token rows' gradient apart from the "
                                     "other one-token rows' (each at max_grad_share; logged as first_replay_tail and "
                                     "first_replay_share): under one cap the replayed ids' larger hinge scales the "
                                     "text's and uniform rows' gradient away")
    mine: Mining | None = Field(
        None, description="when this setting starts, sweep a part of the vocabulary for ids that run away when "
        "repeated (lnfree.removal.mining) and replay them with `replay` and the ids earlier settings mined")

    @model_validator(mode="after")
    def _first_shares(self):
        if self.first_text_share + self.first_replay_share > 1:
            raise ValueError(f"first_text_share {self.first_text_share} + first_replay_share "
                             f"{self.first_replay_share}: the shares of the one-token rows add up to more than 1")
        if self.first_replay_share and self.replay is None and self.mine is None:
            raise ValueError("first_replay_share: nothing to replay (set replay or mine)")
        if self.first_replay_apart and not (self.first_replay_share and self.first_token_rows):
            raise ValueError("first_replay_apart: no replayed one-token rows (set first_token_rows and first_replay_share)")
        return self

    @field_validator("replay", mode="before")
    @classmethod
    def _read_replay(cls, value):
        if isinstance(value, (str, Path)):
            try:
                value = json.loads(Path(value).read_text())["overflow"]
            except (OSError, ValueError, KeyError) as err:
                raise ValueError(f"replay: cannot read the `overflow` ids of {value}: {err}") from None
        return value


def coverage_ids(coverage: Coverage, step: int, micro_step: int, rank: int, *, context: int, vocab_size: int,
                 bos: int | None, seed: int, replay: list[int] | None = None) -> torch.Tensor:
    """The generated rows (rows, context) of one micro-step: a pure function of its arguments. `replay`:
    the ids to replay (default: the setting's own `replay` list)."""
    rng = np.random.default_rng([seed, _STREAM, step, micro_step, rank])
    rows = np.empty((coverage.rows, context), dtype=np.int64)
    replay = coverage.replay if replay is None else replay
    for row in rows:
        if rng.random() < coverage.repeated_share:
            if replay and rng.random() < coverage.replay_share:
                row[:] = replay[rng.integers(0, len(replay))]
            else:
                row[:] = rng.integers(0, vocab_size)
        else:
            row[:] = rng.integers(0, vocab_size, context)
            if replay and coverage.replay_random > 0 and rng.random() < coverage.replay_random:
                spots = rng.random(context) < REPLAY_DENSITY
                row[spots] = np.asarray(replay)[rng.integers(0, len(replay), int(spots.sum()))]
            if coverage.copy_share > 0 and rng.random() < coverage.copy_share:
                span = int(rng.integers(COPY_SPAN_MIN, max(COPY_SPAN_MIN, (context - 1) // 2) + 1))
                row[1:] = np.resize(row[1:1 + span], context - 1)  # position 0: BOS or the row's own id
    if bos is not None:
        with_bos = rng.random(len(rows)) >= coverage.no_bos_share if coverage.no_bos_share > 0 else slice(None)
        rows[with_bos, 0] = bos
    return torch.from_numpy(rows)


def first_token_ids(coverage: Coverage, step: int, micro_step: int, rank: int, *, vocab_size: int,
                    seed: int, text: torch.Tensor | None = None, replay: list[int] | None = None) -> torch.Tensor:
    """The one-token rows (`first_token_rows`, 1) of one micro-step, on `text`'s device: uniform random ids,
    the first `first_text_share` of them tokens of the micro-batch `text` instead and the next
    `first_replay_share` ids of `replay` (default: the setting's own list); a pure function of the arguments
    (a stream apart from `coverage_ids`'). A token at position 0 attends to itself only, so what it writes there
    depends on its id alone: these rows bound position 0 for every input without BOS."""
    rng = np.random.default_rng([seed, _FIRST_STREAM, step, micro_step, rank])
    replay = coverage.replay if replay is None else replay
    ids = torch.from_numpy(rng.integers(0, vocab_size, (coverage.first_token_rows, 1)))
    device = text.device if text is not None else ids.device
    drawn, replayed = first_token_counts(coverage, text=text is not None, replaying=bool(replay))
    if drawn:
        at = torch.from_numpy(rng.integers(0, text.numel(), drawn)).to(device)
        ids = torch.cat([text.reshape(-1)[at][:, None], ids[drawn:].to(device)])
    if replayed:  # drawn after the text's ids, so that a setting without it keeps its rows
        picked = torch.as_tensor(replay)[torch.from_numpy(rng.integers(0, len(replay), replayed))]
        ids[drawn:drawn + replayed, 0] = picked.to(device)
    return ids.to(device)


def first_token_counts(coverage: Coverage, *, text: bool, replaying: bool) -> tuple[int, int]:
    """(rows drawn from the text, rows drawn from the replayed ids) of one micro-step's one-token rows
    (`first_token_ids`: those first, in that order, then the uniform ones), given whether there is text to draw
    from and ids to replay."""
    n = coverage.first_token_rows
    drawn = round(coverage.first_text_share * n) if text else 0
    return drawn, min(round(coverage.first_replay_share * n), n - drawn) if replaying else 0


def typical_log_scales(inputs: list[torch.Tensor], input_ids: torch.Tensor, eot_token_id: int,
                       kind: str) -> list[torch.Tensor]:
    """Per norm input, the detached mean log scale of the text's tokens (neither position 0 nor EOT)."""
    typical = input_ids != eot_token_id
    typical[:, 0] = False
    weights = typical.float() / typical.sum().clamp_min(1)
    return [(torch.sqrt(second_moment(x.detach().float(), kind) + 1e-12).log() * weights).sum() for x in inputs]


def coverage_hinge(inputs: list[torch.Tensor], typical: list[torch.Tensor], kind: str, ratio: float,
                   position0: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over norm inputs and tokens (position 0 aside, except in the rows where the bool mask `position0`
    is set) of max(0, log(scale) − typical − log `ratio`)², per sequence, against real text's typical log
    scale at each input."""
    if len(inputs) != len(typical):
        raise RuntimeError(f"{len(inputs)} norm inputs on the generated rows, {len(typical)} on the text")
    total = torch.zeros((), device=inputs[0].device)
    for x, log_typical in zip(inputs, typical):
        log_scale = torch.sqrt(second_moment(x.float(), kind) + 1e-12).log()
        excess = (log_scale - log_typical - math.log(ratio)).clamp_min(0)
        first = excess[:, :1] * position0.to(excess.device)[:, None] if position0 is not None else excess[:, :0]
        total = total + excess[:, 1:].pow(2).sum() + first.pow(2).sum()
    return total / inputs[0].shape[0]


class HeldGradients:
    """The text's gradients, held apart while later rows (coverage, the stability margin) backward their own
    into the parameters; `add_back` then caps those and adds the text's back.

    By default each parameter's gradient is taken out of it (its `grad` left None), so that the next backward
    writes a gradient of its own and nothing is copied. `in_place` (FSDP, whose parameters' gradients are views
    of its flat gradient, accumulated there) keeps the gradients where they are and holds copies instead."""

    def __init__(self, params: list[torch.Tensor], in_place: bool = False):
        self.params, self.in_place = params, in_place
        self.text = [p.grad if p.grad is None or not in_place else p.grad.detach().clone() for p in params]
        if not in_place:
            for p in params:
                p.grad = None

    def add_back(self, share: float | None) -> torch.Tensor:
        """Scale what the gradients gained since they were held down to at most `share` × the text's norm
        (no cap with `share` None), add the text's back; return the gained norm over the text's, uncapped (a
        device scalar, no host sync)."""
        grads = [p.grad for p in self.params]
        gained = grads if not self.in_place else [
            g - t if g is not None and t is not None else g for g, t in zip(grads, self.text)]
        text = whole(get_total_norm([t for t in self.text if t is not None]))
        ratio = whole(get_total_norm([g for g in gained if g is not None])) / text.clamp_min(1e-30)
        factor = None if share is None else (share / ratio.clamp_min(1e-30)).clamp(max=1.0)
        for p, t, g, now in zip(self.params, self.text, gained, grads):
            if g is not None and factor is not None:
                g = g.mul_(factor) if t is None else t.addcmul_(g, factor)
            elif g is not None and t is not None:
                g = t.add_(g)
            total = t if g is None else g
            if self.in_place and now is not None:
                now.copy_(total)
            else:
                p.grad = total
        return ratio
