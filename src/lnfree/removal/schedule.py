"""The removal schedule as data: stages that expand to an ordered list of events.

A schedule is a list of stages, removed in list order. Per-layer stages (`ln_2`, `ln_1qk`,
`ln_1v`, the per-head `q_norm` / `k_norm`, and the sublayer-output `post_attn` / `post_mlp`) switch one block at a time, `gap` steps apart: every
block from block 0 up, or the blocks listed in `layers` in that order (several stages of one kind
then split the blocks between them, each block exactly once). `ln_f` is one switch;
`eot_special` / `pos0_special` turn off a special σ everywhere at once; `pos0_real` (before
`pos0_special`) makes position 0 divide by its own real scale at every input-side norm from its
step, instead of its frozen σ, so a position-0 loss can shrink it without changing what it feeds
(`pos0_special` then fades from that scale). A stage without `start`
begins where the previous stage ends: previous start + (switches in it) · gap. A stage's
`blend_steps` overrides the run's (`removal.blend_steps`) for its removals; on a special-σ stage
it fades that σ into the general one over as many steps (otherwise it is turned off at once), and its
`blend_shape` says how the fixed fraction rises over them: evenly (`linear`) or on a half cosine (`cosine`, as
TaperNorm, arXiv 2602.10408), which spends as many steps near the fixed form as near the real norm.
An event at step s is applied before the forward passes of step s, so the norm's σ is frozen
at the value the EMA reached after step s − 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lnfree.errors import LnfreeError

PER_LAYER_KINDS = ("ln_2", "ln_1qk", "ln_1v", "q_norm", "k_norm", "post_attn", "post_mlp")
Kind = Literal["ln_2", "ln_1qk", "ln_1v", "q_norm", "k_norm", "post_attn", "post_mlp", "ln_f", "eot_special",
               "pos0_special", "pos0_real"]


SPECIAL_KINDS = ("eot_special", "pos0_special", "pos0_real")
BlendShape = Literal["linear", "cosine"]


class ScheduleError(LnfreeError, ValueError):
    """A schedule that cannot be run as asked."""


@dataclass(frozen=True)
class Event:
    """One removal event: at `step`, switch `kind` (in block `layer` for per-layer kinds).

    `blend_steps` is the stage's own gradual-removal length (None: the run's `removal.blend_steps`), and
    `blend_shape` the curve of its fixed fraction over those steps.
    """

    step: int
    kind: str
    layer: int | None = None
    blend_steps: int | None = None
    blend_shape: str = "linear"

    @property
    def slot(self) -> str:
        """The scale-state name this event switches (see `lnfree.fixedscale.surgery.scale_states`)."""
        return f"blocks.{self.layer}.{self.kind}" if self.layer is not None else self.kind


class Stage(BaseModel):
    """One kind of norm, removed block by block (or at once) from `start`, `gap` steps apart."""

    model_config = ConfigDict(extra="forbid")
    kind: Kind
    start: int | None = Field(default=None, ge=0)
    gap: int = Field(default=0, ge=0)
    layers: list[int] | None = Field(
        default=None, description="per-layer kinds: the blocks this stage switches, in this order (default: all, from 0 up)"
    )
    blend_steps: int | None = Field(default=None, ge=0, description="gradual removal length for this stage's switches (special σ: fade-out length)")
    blend_shape: BlendShape = Field(default="linear", description="how the fixed fraction rises over blend_steps: "
                                    "evenly, or on a half cosine (slow at both ends)")

    @model_validator(mode="after")
    def _layers(self) -> Stage:
        if self.layers is not None:
            if self.kind not in PER_LAYER_KINDS:
                raise ValueError(f"'layers' applies to per-layer stages ({', '.join(PER_LAYER_KINDS)}), not {self.kind}")
            if not self.layers or min(self.layers) < 0 or len(set(self.layers)) != len(self.layers):
                raise ValueError(f"'layers' must list distinct block indices >= 0, got {self.layers}")
        if self.kind == "pos0_real" and (self.blend_steps or 0) > 1:
            raise ValueError("'pos0_real' switches at once; its blend_steps must be unset")
        return self

    def blocks(self, n_layer: int) -> list[int]:
        """The blocks this per-layer stage switches, in order."""
        return list(range(n_layer)) if self.layers is None else self.layers


class Schedule(BaseModel):
    """An ordered list of removal stages."""

    model_config = ConfigDict(extra="forbid")
    stages: list[Stage]

    def events(self, n_layer: int) -> list[Event]:
        """Expand to events sorted by step (ties keep stage and block order)."""
        return sorted((e for stage_events in self._per_stage(n_layer) for e in stage_events), key=lambda e: e.step)

    def _per_stage(self, n_layer: int) -> list[list[Event]]:
        out: list[list[Event]] = []
        start = 0
        for stage in self.stages:
            if stage.start is not None:
                start = stage.start
            layers = stage.blocks(n_layer) if stage.kind in PER_LAYER_KINDS else [None]
            out.append([Event(start + i * stage.gap, stage.kind, layer, stage.blend_steps, stage.blend_shape)
                        for i, layer in enumerate(layers)])
            start += len(layers) * stage.gap
        return out

    def check(
        self, n_layer: int, max_steps: int, special_pos0: bool = False, special_eot: bool = False,
        slots: Iterable[str] | None = None,
    ) -> list[Event]:
        """Validate against a model (its depth and, if given, its slot names) and a run length.

        Returns the events or raises ScheduleError.
        """
        kinds = [stage.kind for stage in self.stages]
        once = [kind for kind in kinds if kind not in PER_LAYER_KINDS]
        if len(set(once)) != len(once):
            raise ScheduleError(f"ln_f and each special σ may appear once in a schedule, got {once}")
        for kind in dict.fromkeys(k for k in kinds if k in PER_LAYER_KINDS):
            stages = [stage for stage in self.stages if stage.kind == kind]
            blocks = [b for stage in stages for b in stage.blocks(n_layer)]
            if len(stages) > 1 and any(stage.layers is None for stage in stages):
                raise ScheduleError(f"{kind} appears in {len(stages)} stages: give each of them its 'layers'")
            if sorted(blocks) != list(range(n_layer)):
                raise ScheduleError(
                    f"the {kind} stages must switch every block 0–{n_layer - 1} exactly once, got {sorted(blocks)}"
                )
        events = self.events(n_layer)
        if slots is not None:
            known = set(slots)
            unknown = sorted({e.kind for e in events if e.kind not in SPECIAL_KINDS and e.slot not in known})
            if unknown:
                raise ScheduleError(f"this model has no {', '.join(unknown)} norms; remove those stages from the schedule")
        removals = [e for e in events if e.kind not in SPECIAL_KINDS]
        if not removals or n_layer < 1:
            raise ScheduleError("this schedule removes no LayerNorm")
        v_steps = [e.step for e in events if e.kind == "ln_1v"]
        lnf = [e.step for e in events if e.kind == "ln_f"]
        # ln_f alone is a partial removal of its own (direct logit attribution is exact with it fixed).
        has_v_paths = slots is None or any(slot.endswith(".ln_1v") for slot in slots)  # OLMo 2 has none
        if lnf and len(removals) > 1 and (lnf[0] < max(v_steps) if v_steps else has_v_paths):
            when = f"step {max(v_steps)}" if v_steps else "never"
            raise ScheduleError(
                f"ln_f is removed at step {lnf[0]}, before the last ln_1 V path ({when}); "
                "remove ln_f after every block's ln_1"
            )
        for kind, enabled in (("pos0_special", special_pos0), ("eot_special", special_eot)):
            if enabled and kind not in kinds:
                raise ScheduleError(f"special σ '{kind}' is enabled but the schedule never turns it off")
            if not enabled and kind in kinds:
                raise ScheduleError(f"the schedule turns off '{kind}' but that special σ is not enabled")
        if "pos0_real" in kinds:
            real = next(e.step for e in events if e.kind == "pos0_real")
            fade = next((e.step for e in events if e.kind == "pos0_special"), None)
            if not special_pos0:
                raise ScheduleError("the schedule has a 'pos0_real' stage but position 0's σ (removal.special_pos0) is off")
            if fade is not None and fade <= real:
                raise ScheduleError(f"'pos0_real' (step {real}) must come before 'pos0_special' (step {fade})")
        last = events[-1].step
        if last >= max_steps:
            raise ScheduleError(f"the schedule's last event is at step {last}, but the run ends after {max_steps} steps")
        return events

    def describe(self, n_layer: int) -> str:
        """A human-readable timeline: one line per stage with its first and last step."""
        lines = []
        for stage, events in zip(self.stages, self._per_stage(n_layer)):
            steps = [e.step for e in events]
            span = f"step {steps[0]}" if len(set(steps)) == 1 else f"steps {steps[0]}–{steps[-1]} (every {stage.gap})"
            what = f"{len(steps)} × {stage.kind}" if stage.kind in PER_LAYER_KINDS else stage.kind
            if stage.layers is not None:
                what += f" (blocks {_blocks(stage.layers)})"
            blend = ""
            if stage.blend_steps and stage.blend_steps > 1:
                blend = f", {'each ' if stage.kind in PER_LAYER_KINDS else ''}{'faded' if stage.kind in SPECIAL_KINDS else 'blended'} over {stage.blend_steps} steps"
                blend += " on a half cosine" if stage.blend_shape == "cosine" else ""
            lines.append(f"{what:>14}: {span}{blend}")
        return "\n".join(lines)


def _blocks(layers: list[int]) -> str:
    """'29–11' for a run of consecutive blocks (either direction), else the list."""
    step = 1 if layers[-1] >= layers[0] else -1
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + step, step)):
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(map(str, layers))


class Adaptive(BaseModel):
    """Adaptive timing: the schedule's order, but each removal waits for the loss to recover.

    The schedule's first removal happens at its step. Each later one (events that share a step in
    the schedule stay together) happens at the first step, at least `min_gap` and at most `max_gap`
    steps after the previous one, at which the training cross-entropy averaged over the last
    `window` steps since that removal is within `delta` nats of its average just before it.
    """

    model_config = ConfigDict(extra="forbid")
    delta: float = Field(0.02, ge=0, description="nats above the pre-removal training CE that count as recovered")
    min_gap: int = Field(1, ge=1, description="fewest steps between removals")
    max_gap: int = Field(8, ge=1, description="most steps between removals (a removal happens then even unrecovered)")
    window: int = Field(4, ge=1, description="training steps averaged into the smoothed CE")

    @model_validator(mode="after")
    def _gaps(self) -> Adaptive:
        if self.max_gap < self.min_gap:
            raise ValueError("max_gap must not be below min_gap")
        return self

    def latest_step(self, events: list[Event]) -> int:
        """The step of the last removal if every wait lasts `max_gap`."""
        groups = len({e.step for e in events})
        return events[0].step + (groups - 1) * self.max_gap


def derive_schedule(n_layer: int, start: int | None = None, stages: tuple[str, ...] = PER_LAYER_KINDS[:3]) -> Schedule:
    """A schedule for any depth and family, following the published presets.

    Up to 24 blocks: ln_2 from step 20, gaps 2/2/3 (as GPT-2 small and medium). Deeper models:
    from step 30, gaps 4/4/6 (as GPT-2 large and XL). `stages` are the family's per-layer stages
    in order (`lnfree.arch`); stages beyond the first three (Qwen3's q_norm / k_norm) use the
    ln_1qk gap. ln_f follows the last per-layer stage.
    """
    shallow = n_layer <= 24
    gaps = {"ln_2": 2, "ln_1qk": 2, "ln_1v": 3} if shallow else {"ln_2": 4, "ln_1qk": 4, "ln_1v": 6}
    first = start if start is not None else (20 if shallow else 30)
    per_layer = [Stage(kind=kind, gap=gaps.get(kind, gaps["ln_1qk"])) for kind in stages]
    per_layer[0] = per_layer[0].model_copy(update={"start": first})
    return Schedule(stages=[*per_layer, Stage(kind="ln_f")])
