"""What a run measures and records: the held-out cross-entropy and massive-activation scales
(`held_out_ce`, `HeldOut`), the records of its log (`RunLog`: `log.jsonl` and the trackers; removal
events, evaluations), the check that stops a diverged run before its state is logged or saved
(`stop_if_diverged`) and the run's training time (`RunClock`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from lnfree.errors import LnfreeError
from lnfree.fixedscale import surgery
from lnfree.fixedscale.ceiling import set_ceiling, watching
from lnfree.data.documents import TokenData
from lnfree.removal.layout import LOG, checkpoints
from lnfree.removal.losses.massive import massive_scales
from lnfree.removal.precision import cpu_description
from lnfree.removal.schedule import SPECIAL_KINDS, Event
from lnfree.removal.timeline import Timeline


class TrainingDiverged(LnfreeError, ValueError):
    """The loss or the gradient norm became non-finite; the run stopped without saving that state.

    A ValueError because its cause is the run's configuration (the CLI reports it as one line)."""


@torch.no_grad()
def held_out_ce(model: nn.Module, data: TokenData, n_sequences: int, batch_size: int, autocast,
                spread: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) on `n_sequences` held-out sequences (`TokenData.eval_batch`: the
    first ones, or with `spread` evenly spaced)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = data.eval_batch(n_sequences, spread)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for chunk in tokens.split(batch_size):
        chunk = chunk.to(device)
        with autocast():
            logits = model(input_ids=chunk, use_cache=False).logits
        total += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
    model.train(was_training)
    return total / (tokens.shape[0] * (tokens.shape[1] - 1))


@dataclass(frozen=True)
class HeldOut:
    """The run's held-out measurements of `model` (what forward runs: DDP/FSDP-wrapped once prepared)
    whose module is `bare`."""

    model: nn.Module
    bare: nn.Module
    data: TokenData
    n_sequences: int  # data.eval_sequences
    batch_size: int
    autocast: Callable
    scale_probe: torch.Tensor  # the sequences on which the massive-activation scales are measured
    device: torch.device
    tokens: int  # next-token predictions behind each held-out CE
    spread: bool = False  # data.eval_spread

    def ce(self) -> torch.Tensor:
        """The held-out cross-entropy (`held_out_ce`), on the device."""
        return held_out_ce(self.model, self.data, self.n_sequences, self.batch_size, self.autocast, self.spread)

    def scales(self) -> dict[str, float]:
        """Position 0's and the outlier token's scale at the norm inputs (`lnfree.removal.losses.massive.massive_scales`)."""
        with self.autocast():
            return massive_scales(self.bare, self.scale_probe.to(self.device), forward=self.model)


def eval_record(held_out: HeldOut, done: int, ceiling_now: float | None) -> dict:
    """The held-out CE and the massive-activation scales after `done` steps; under a scale ceiling
    (`ceiling_now` finite) also the number of activations it clipped and the model without it."""
    bare = held_out.bare
    guarded = ceiling_now is not None and not math.isinf(ceiling_now)
    with watching(bare) as ceiling_hits:
        ce, scale_values = held_out.ce().item(), held_out.scales()
        hits = ceiling_hits() if guarded else None
    record = {"event": "eval", "step": done, "held_out_ce": ce, "held_out_tokens": held_out.tokens, **scale_values}
    if hits:  # what the model is without its guard
        set_ceiling(bare, math.inf)
        record.update(held_out_ce_unguarded=held_out.ce().item(),
                      **{f"{k}_unguarded": v for k, v in held_out.scales().items()})
        set_ceiling(bare, ceiling_now)
    elif hits == 0:  # the ceiling never engaged: those passes computed the unguarded model (up to rounding)
        record.update(held_out_ce_unguarded=ce, **{f"{k}_unguarded": v for k, v in scale_values.items()})
    if guarded:
        record["ceiling_hits"] = hits
    return record


def event_record(event: Event, model: nn.Module) -> dict:
    """The log record of a removal `event` (with the σ it froze, for a norm of the model)."""
    record = {"event": "remove", "step": event.step, "slot": event.slot}
    if event.kind not in SPECIAL_KINDS:
        record["sigma"] = float(surgery.scale_states(model)[event.slot].sigma)  # frozen from this step on
    return record


def stop_if_diverged(rows: torch.Tensor, done: int, timeline: Timeline, out: Path,
                     columns: Sequence[str] = ()) -> None:
    """Raise `TrainingDiverged` if a step in `rows` (the steps up to `done`, one row each) was not finite;
    the message names that step's non-finite `columns` (the names of the rows' entries)."""
    finite = torch.isfinite(rows).all(dim=1).tolist()
    if all(finite):
        return
    first = finite.index(False)
    bad = done - len(rows) + first + 1
    named = [name for name, ok in zip(columns, torch.isfinite(rows[first]).tolist()) if not ok]
    recent = [f"{e.slot} at step {e.step}" for e in timeline.applied if bad - 10 <= e.step < bad][-5:]
    saved, _ = checkpoints(out)
    raise TrainingDiverged(
        f"training diverged: the loss or gradient norm was not finite at step {bad}"
        + (f" (not finite: {', '.join(named)})" if named else "")
        + (f", just after removing {', '.join(recent)}" if recent else "")
        + f". Nothing after step {bad - 1} was saved; the latest checkpoint is "
        + (f"{saved[-1].name}." if saved else "none.")
        + " Common remedies: a lower learning rate, a slower schedule (larger gaps, stage blend_steps, "
        "a special σ for outlier positions) or distillation (train.distill_alpha)."
    )


class RunLog:
    """A run's log: records appended to `path` (`log.jsonl`) by the main process and, with
    `train.report_to`, their numbers sent to the trackers."""

    def __init__(self, path: Path, accelerator: Accelerator, report_to: list[str] | str | None):
        self.path, self.accelerator, self.report_to = path, accelerator, report_to

    def __call__(self, record: dict) -> None:
        """Append `record` (main process only)."""
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.report_to:
                self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                                     step=record.get("step"))

    def truncate(self, step: int) -> None:
        """Drop the records of work after `step`, which a run resumed there repeats (main process only)."""
        if self.accelerator.is_main_process:
            truncate_log(self.path, step)

    def resume(self, step: int, checkpoint: Path, precision: str) -> None:
        """Drop the records that a run resumed from `checkpoint` at `step` repeats, then record the resume
        with the precision and the CPU it goes on with (a run may move between machines)."""
        self.truncate(step)
        self({"event": "resume", "step": step, "checkpoint": str(checkpoint), "precision": precision,
              "cpu": cpu_description()})


def read_records(path: Path) -> list[dict]:
    """The records of a run's log file (`LOG`), in order; none when it does not exist."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def started_precision(path: Path) -> str | None:
    """The precision in the start record of the log at `path` (None without one, or in an older log)."""
    return next((r.get("precision") for r in read_records(path) if r.get("event") == "start"), None)


def cpu_hours(run: Path) -> float:
    """Process CPU time of a run's training in hours, resumes included: the largest `cpu_seconds` of its
    training records (`LOG`), plus each vocabulary mining that a resume dropped from that clock, rounded to
    3 decimals (0 for a log written before lnfree recorded it)."""
    records = read_records(Path(run) / LOG)
    training = max((r.get("cpu_seconds", 0.0) for r in records if r.get("event") in (None, "end")), default=0.0)
    return round((training + _dropped_mining(records)) / 3600, 3)


def _dropped_mining(records: list[dict]) -> float:
    """CPU seconds of the minings that no checkpoint holds: a mining runs after step s's checkpoint, so a
    process resumed from a checkpoint at or before s starts its clock without it, and skips the mining when
    the ids are already in the run folder (no later mining at that step)."""
    dropped = 0.0
    for i, record in enumerate(records):
        if record.get("event") != "mine" or "cpu_seconds" not in record:
            continue
        later = records[i + 1:]
        resumed = any(r.get("event") == "resume" and r["step"] <= record["step"] for r in later)
        mined_again = any(r.get("event") == "mine" and r["step"] == record["step"] for r in later)
        if resumed and not mined_again:
            dropped += record["cpu_seconds"]
    return dropped


def truncate_log(path: Path, step: int) -> None:
    """Drop the log records of work after `step`, which the resumed run repeats (and a half-written line)."""
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        # A removal at step s happens before step s trains; loss/eval records carry the steps done.
        if record.get("step", 0) < step or (record.get("step") == step and record.get("event") != "remove"):
            kept.append(line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class RunClock:
    """Training time over every process of the run (`before`: earlier processes, plus this one's): wall
    time, and this process's CPU time (every thread; pauses and other jobs on the machine not counted)."""

    def __init__(self, before: float, cpu_before: float = 0.0):
        self.before, self.started = before, time.perf_counter()
        self.cpu_before, self.cpu_started = cpu_before, time.process_time()

    def seconds(self) -> float:
        """The wall time so far, rounded to 10 ms as logged and checkpointed."""
        return round(self.before + time.perf_counter() - self.started, 2)

    def cpu_seconds(self) -> float:
        """The process CPU time so far, rounded to 10 ms."""
        return round(self.cpu_before + time.process_time() - self.cpu_started, 2)

    def state(self) -> dict:
        """Both, as logged and checkpointed."""
        return {"seconds": self.seconds(), "cpu_seconds": self.cpu_seconds()}
