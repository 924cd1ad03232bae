"""Amend a run's future on resume: change what has not happened yet, never what has.

A long removal is research: a run that went well up to step 600 and broke at step 620 should be
able to continue from its step-600 checkpoint with a slower pace for the norms still to come, a
longer run, or a ceiling released later, and still be one run (one log, one clock, one token count).
`lnfree remove --resume` accepts such a config when it provably trains the same model up to the
checkpoint: the same recipe in every field, and in the fields that are functions of the step (the
schedule, the learning-rate curve, the scale ceiling, the tail losses) the same value at every
step before it. The run config then records the new plan, and the log an `amend` record with each
change.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from lnfree.errors import LnfreeError
from lnfree.removal.config import STEP_LOSSES, RunConfig
from lnfree.removal.losses.massive import tail_at
from lnfree.removal.schedule import Event

#: The config fields whose effect is a function of the step: an amendment may change them from the
#: resume step on (the learning-rate curve and its restart, the distillation teacher, the tail losses' weights,
#: the removal events, the ceiling).
FUTURE_FIELDS = {"train": ("max_steps", "cosine_steps", "learning_rate_restart", "teacher", "teacher_start",
                           *STEP_LOSSES),
                 "removal": ("schedule", "scale_ceiling")}


class AmendError(LnfreeError, ValueError):
    """The new config would change steps the run has already trained."""


def amendment(
    stored: RunConfig, config: RunConfig, step: int, n_layer: int, learning_rate: Callable[[int, RunConfig], float],
    ignore: dict[str, tuple[str, ...]],
) -> list[str]:
    """The future-only changes from `stored` to `config` for a run resumed after `step` steps (empty:
    the same plan); raises AmendError naming what would change the steps already trained.

    Both configs are resolved (`lnfree.removal.train.resolve_run`): their schedule and max_steps are set.
    `learning_rate(step, config)` is the run's curve; the fields in `ignore` (bookkeeping) may differ.
    """
    fixed = {section: (*FUTURE_FIELDS.get(section, ()), *ignore.get(section, ()))
             for section in {*FUTURE_FIELDS, *ignore}}
    before, after = without_fields(fixed, stored), without_fields(fixed, config)
    if before != after:
        changed = sorted(_changed_fields(before, after))
        future = ", ".join(f"{section}.{name}" for section, names in FUTURE_FIELDS.items() for name in names)
        raise AmendError(f"{', '.join(changed)} changed: only the plan after the checkpoint ({future}) may change "
                         "on resume")
    if stored.removal.adaptive is not None and stored.removal.schedule != config.removal.schedule:
        raise AmendError("an adaptive schedule cannot be amended: its steps depend on the losses it saw")
    problems = []
    old_events, new_events = (_past(c.removal.schedule.events(n_layer), step) for c in (stored, config))
    if old_events != new_events:
        differ = sorted({e.slot for e in set(old_events) ^ set(new_events)})
        problems.append(f"the removals before step {step} ({', '.join(differ[:6])})")
    if any(learning_rate(s, stored) != learning_rate(s, config) for s in range(step)):
        problems.append(f"the learning rate before step {step} (keep train.cosine_steps = "
                        f"{stored.train.cosine_steps or stored.train.max_steps} when max_steps grows)")
    if any(_ceiling(stored, s) != _ceiling(config, s) for s in range(step)):
        problems.append(f"the scale ceiling before step {step} (set removal.scale_ceiling.release_start)")
    if any(stored.train.teacher_at(s) != config.train.teacher_at(s) for s in range(step)):
        problems.append(f"the distillation teacher before step {step} (set train.teacher_start)")
    for name in STEP_LOSSES:
        if any(_tail(stored, name, s) != _tail(config, name, s) for s in range(step)):
            problems.append(f"the {name} loss before step {step} (set train.{name}.start)")
    if problems:
        raise AmendError(f"the new config changes steps this run has trained: {'; '.join(problems)}")
    return sorted(_changed_fields(_future(stored), _future(config)))


def _past(events: list[Event], step: int) -> list[Event]:
    return [e for e in events if e.step < step]


def _ceiling(config: RunConfig, step: int) -> float | None:
    ceiling = config.removal.scale_ceiling
    return None if ceiling is None else ceiling.at(step, config.train.max_steps)


def _tail(config: RunConfig, name: str, step: int) -> tuple[float, dict | None]:
    """A step-dependent loss's weight at `step` and, while it is on, its other settings."""
    tail = tail_at(getattr(config.train, name), step)
    return (0.0, None) if tail is None else (tail.weight, tail.model_dump(exclude={"weight", "start"}))


def without_fields(fields: dict[str, tuple[str, ...]], config: RunConfig) -> dict:
    """`config` as JSON without `fields` ({section: names})."""
    data = json.loads(config.model_dump_json())
    for section, names in fields.items():
        for name in names:
            data[section].pop(name, None)
    return data


def _future(config: RunConfig) -> dict:
    data = json.loads(config.model_dump_json())
    return {section: {name: data[section][name] for name in names} for section, names in FUTURE_FIELDS.items()}


def _changed_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the leaves that differ (a whole list counts as one leaf)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [name for key in dict.fromkeys([*old, *new])
                for name in _changed_fields(old.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if old == new else [prefix.rstrip(".")]
