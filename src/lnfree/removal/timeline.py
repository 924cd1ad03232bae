"""When each removal happens during a run, and how far each gradual removal has gone.

A `Timeline` turns the schedule's events into per-step actions: (event, fixed fraction) pairs
that `lnfree.fixedscale.surgery.apply_event` carries out before the step's forward passes. With fixed gaps
the events happen at their scheduled steps; with `Adaptive` timing they keep the schedule's order
but each waits until the smoothed training loss has recovered (`lnfree.removal.schedule.Adaptive`).
With `blend_steps` = k > 1 a removal at step s is gradual: the fixed fraction is 1/k at step s,
2/k at s + 1, …, exactly 1 (the fixed-scale norm) at s + k − 1 (a `cosine` stage: (1 − cos(π·i/k))/2 at
its i-th step instead of i/k, `blend_fraction`). A stage's own `blend_steps`
(carried by its events) overrides the run's; a special-σ stage with `blend_steps` fades that σ
out over as many steps (`lnfree.fixedscale.state.ScaleState.fade_special`).

Its decisions are a pure function of the per-step training losses it is given: the same on every
rank (the losses are averaged over ranks first) and after a resume (`state_dict` holds what it
has seen). It reads the losses on the host only at steps where an adaptive removal could happen.
"""

from __future__ import annotations

import math

import torch

from lnfree.removal.schedule import SPECIAL_KINDS, Adaptive, Event


def blend_length(event: Event, run_blend_steps: int) -> int:
    """Steps over which `event` takes effect (1: at once): its stage's `blend_steps` if set, else the
    run's for a norm; a special σ fades only over its own stage's."""
    if event.blend_steps is not None:
        return max(1, event.blend_steps)
    return 1 if event.kind in SPECIAL_KINDS else max(1, run_blend_steps)


def blend_fraction(progress: int, length: int, shape: str = "linear") -> float:
    """The fixed fraction at the `progress`-th of `length` blend steps (1 at the last)."""
    if shape == "cosine":
        return 1.0 if progress >= length else (1.0 - math.cos(math.pi * progress / length)) / 2
    return progress / length


class Timeline:
    """Per-step removal actions of a run (static or adaptive timing, instant or gradual switches)."""

    def __init__(self, events: list[Event], blend_steps: int = 0, adaptive: Adaptive | None = None):
        steps = sorted({e.step for e in events})
        self.groups = [[e for e in events if e.step == s] for s in steps]  # removed together
        self.blend_steps = max(1, blend_steps)
        self.adaptive = adaptive
        self.applied: list[Event] = []  # the events so far, at the steps they happened
        self.next_group = 0
        self.reference: float | None = None  # smoothed loss just before the latest removal
        self.recent: list[torch.Tensor] = []  # per-step training losses since the latest removal

    def skip_to(self, step: int) -> None:
        """Fixed gaps only: the state after the steps before `step` (resuming a checkpoint without a timeline)."""
        if self.adaptive is not None:
            raise ValueError("an adaptive timeline cannot be rebuilt without its saved state")
        self.applied = [e for group in self.groups if group[0].step < step for e in group]
        self.next_group = sum(group[0].step < step for group in self.groups)

    def record(self, loss: torch.Tensor) -> None:
        """The training loss of the step just done (a device scalar, averaged over ranks); adaptive timing only."""
        if self.adaptive is not None:
            self.recent = (self.recent + [loss.detach().float().reshape(())])[-self.adaptive.window:]

    def actions(self, step: int) -> list[tuple[Event, float]]:
        """(event, fixed fraction) to apply before the forward passes of `step`, in schedule order."""
        for event in self._due(step):
            self.applied.append(Event(step, event.kind, event.layer, event.blend_steps, event.blend_shape))
        out = []
        for event in self.applied:
            progress = step - event.step + 1
            blend = self.blend_of(event)
            if 1 <= progress <= blend:
                out.append((event, blend_fraction(progress, blend, event.blend_shape)))
        return out

    def upcoming(self, step: int, count: int) -> list[Event]:
        """At most `count` norm events not yet complete at `step` (after its `actions`): those blending, then
        those still to come, in schedule order; special-σ stages aside (`train.stability_margin.preview`)."""
        blending = [e for e in self.applied if e.kind not in SPECIAL_KINDS and step - e.step + 1 < self.blend_of(e)]
        ahead = [e for group in self.groups[self.next_group:] for e in group if e.kind not in SPECIAL_KINDS]
        return (blending + ahead)[:count]

    def blend_of(self, event: Event) -> int:
        """Steps over which `event`'s norm moves to its fixed σ, or its special σ fades out (1: at once)."""
        return blend_length(event, self.blend_steps)

    def _due(self, step: int) -> list[Event]:
        if self.next_group == len(self.groups):
            return []
        group = self.groups[self.next_group]
        if self.adaptive is None or not self.applied:
            if group[0].step != step:
                return []
            if self.adaptive is not None:
                self.reference = self._smoothed()
        elif not self._recovered(step):
            return []
        self.next_group += 1
        self.recent = []
        return group

    def _recovered(self, step: int) -> bool:
        since = step - self.applied[-1].step
        if since < self.adaptive.min_gap:
            return False
        if since >= self.adaptive.max_gap:
            self.reference = self._smoothed()
            return True
        smoothed = self._smoothed()  # reads the losses on the host
        if smoothed is None or (self.reference is not None and smoothed > self.reference + self.adaptive.delta):
            return False
        self.reference = smoothed
        return True

    def _smoothed(self) -> float | None:
        if not self.recent:
            return None
        values = torch.stack(self.recent).tolist()
        return sum(values) / len(values)

    def state_dict(self) -> dict:
        """JSON-ready state (what has happened and the losses seen since the latest removal)."""
        return {
            "applied": [[e.step, e.kind, e.layer, e.blend_steps, e.blend_shape] for e in self.applied],
            "next_group": self.next_group,
            "reference": self.reference,
            "recent": torch.stack(self.recent).tolist() if self.recent else [],
        }

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        """Continue from `state_dict()` output."""
        self.applied = [Event(*entry) for entry in state["applied"]]  # [step, kind, layer(, blend_steps(, blend_shape))]
        self.next_group = state["next_group"]
        self.reference = state["reference"]
        self.recent = [torch.tensor(v, dtype=torch.float32, device=device) for v in state["recent"]]
