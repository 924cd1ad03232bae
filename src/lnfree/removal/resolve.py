"""A run's config resolved against its model: the schedule and `max_steps` filled in and checked
(`resolve_run`), the context length, the micro-batch shape that makes `tokens_per_step`
(`micro_batches`) and the learning rate at each step (`learning_rate`). Pure functions of the
config and the model's shape, so they run before anything is loaded or written.
"""

from __future__ import annotations

import math

from lnfree.errors import LnfreeError
from lnfree.removal.config import RunConfig, TrainConfig
from lnfree.removal.schedule import PER_LAYER_KINDS, Event, ScheduleError, derive_schedule
from lnfree.removal.timeline import blend_length


class RunError(LnfreeError, ValueError):
    """A run that cannot start as configured."""


def resolve_run(
    config: RunConfig, n_layer: int, stages: tuple[str, ...] = PER_LAYER_KINDS[:3], slots: list[str] | None = None,
) -> tuple[RunConfig, list[Event]]:
    """Fill in derived defaults (schedule from the depth and the family's `stages`, max_steps) and
    validate the schedule (against the model's `slots` when given)."""
    removal, train = config.removal, config.train
    schedule = removal.schedule or derive_schedule(n_layer, stages=stages)
    events = schedule.events(n_layer)
    # The step at which the last norm is fixed at the latest (adaptive waits and blends included).
    blends = [blend_length(e, removal.blend_steps) for e in events]
    if removal.adaptive:
        latest = removal.adaptive.latest_step(events) + max(blends) - 1
    else:
        latest = max(e.step + b - 1 for e, b in zip(events, blends))
    max_steps = train.max_steps or max(3 * events[-1].step, latest + 1)
    config = config.model_copy(
        update={
            "removal": removal.model_copy(update={"schedule": schedule}),
            "train": train.model_copy(update={"max_steps": max_steps}),
        }
    )
    if removal.mode == "vanilla":
        return config, []
    massive = removal.massive_neurons
    if massive is not None and massive.start + massive.steps > max_steps:
        raise ScheduleError(f"the massive-neuron damping ends at step {massive.start + massive.steps - 1}, but the run "
                            f"ends after {max_steps} steps")
    ceiling = removal.scale_ceiling
    if ceiling is not None and not 0 <= ceiling.release_at(max_steps) <= max_steps - ceiling.release_steps:
        raise ScheduleError(f"the scale ceiling's release (steps {ceiling.release_at(max_steps)}–"
                            f"{ceiling.release_at(max_steps) + ceiling.release_steps - 1}) must lie within the "
                            f"run's {max_steps} steps")
    if ceiling is not None and not ceiling.position0 and not removal.special_pos0:
        raise ScheduleError("removal.scale_ceiling.position0 = false spares position 0's own σ; set removal.special_pos0")
    events = schedule.check(n_layer, max_steps, removal.special_pos0, removal.special_eot, slots)
    if latest >= max_steps:
        raise ScheduleError(f"the last removal can end at step {latest} (adaptive max_gap and blend_steps "
                            f"included), but the run ends after {max_steps} steps")
    return config, events


def context_length(config: RunConfig, n_positions: int | None) -> int:
    """The run's context length: `data.context_length`, else the model's maximum `n_positions`."""
    context = config.data.context_length or n_positions
    if context is None:
        raise RunError("this model has no maximum context length; set data.context_length")
    if n_positions is not None and context > n_positions:
        raise RunError(f"context_length {context} exceeds the model's n_positions {n_positions}")
    return context


def micro_batches(train: TrainConfig, context: int, world: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) that make exactly `tokens_per_step` per optimiser step.

    An unset `micro_batch_size` is the largest divisor of the step's sequences per process up to
    `max_micro_batch_size`; a set one that does not divide them is an error.
    """
    per_process, rest = divmod(train.tokens_per_step, context * world)
    if rest or per_process < 1:
        raise RunError(f"tokens_per_step {train.tokens_per_step} must be a multiple of processes × context "
                       f"= {world} × {context}")
    micro = train.micro_batch_size
    if micro is None:
        micro = max(m for m in range(1, min(per_process, train.max_micro_batch_size) + 1) if per_process % m == 0)
    elif per_process % micro:
        raise RunError(
            f"tokens_per_step {train.tokens_per_step} must be a multiple of micro_batch_size × processes × context "
            f"= {micro} × {world} × {context} (leave micro_batch_size unset to have one chosen)"
        )
    return micro, per_process // micro


def sigma_momentum_per_step(train: TrainConfig, sequences_per_step: int) -> float:
    """The momentum of every real norm's σ average over one optimiser step: `sigma_momentum` per
    `sigma_momentum_sequences` sequences, whatever the step's micro-batches and processes."""
    return train.sigma_momentum ** (sequences_per_step / train.sigma_momentum_sequences)


def learning_rate(step: int, config: RunConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to the minimum over `cosine_steps`; from
    `train.learning_rate_restart.start` on, the restart's own warm-up and cosine (counted from its start)."""
    train, restart = config.train, config.train.learning_rate_restart
    if restart is not None and step >= restart.start:
        curve, step = restart, step - restart.start
        total = restart.cosine_steps or max(1, train.max_steps - restart.start)
    else:
        curve, total = train, train.cosine_steps or train.max_steps
    if step < curve.warmup_steps:
        return curve.learning_rate * (step + 1) / curve.warmup_steps
    progress = min(1.0, (step - curve.warmup_steps) / max(1, total - curve.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return curve.min_learning_rate + cosine * (curve.learning_rate - curve.min_learning_rate)
