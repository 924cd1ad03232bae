"""A run's checkpoints: written into a temporary folder that is renamed once complete, so a kill
loses at most the steps since the last one (`save_checkpoint`), and loaded back into the prepared
model, optimiser, RNGs and removal timeline to resume (`resume_checkpoint`, `load_checkpoint_state`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Collection
from pathlib import Path

from accelerate import Accelerator
from torch import nn

from lnfree.fixedscale import surgery
from lnfree.removal.layout import CHECKPOINTS, PARTIAL, TRAINER_STATE, checkpoint_step, checkpoints
from lnfree.removal.resolve import RunError
from lnfree.removal.timeline import Timeline

logger = logging.getLogger("lnfree")


def save_checkpoint(
    accelerator: Accelerator, model: nn.Module, out: Path, step: int, model_config, extra: dict | None = None,
    keep: int | None = None, kept_steps: Collection[int] = (),
) -> Path:
    """Model (with removal buffers), optimiser and RNG states after `step` completed steps, plus `extra`.

    Written into a temporary folder that is renamed to `checkpoints/step_N` once complete; then only the
    newest `keep` complete checkpoints stay (None: all), besides those of `kept_steps`.
    """
    folder = out / CHECKPOINTS / f"step_{step:06d}"
    partial = folder.with_name(PARTIAL + folder.name)
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    check_space(out, folder.name)  # on every process, so that all stop together
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    if accelerator.is_main_process:
        model_config.save_pretrained(partial)
        state = {"step": step, **(extra or {})}
        if surgery.is_installed(model):
            state["removal_state"] = surgery.removal_state(model)
        (partial / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if folder.exists():  # an incomplete folder of an older lnfree, or a re-saved step
            shutil.rmtree(folder)
        partial.rename(folder)
        if keep is not None:
            prunable = [c for c in checkpoints(out)[0] if checkpoint_step(c) not in kept_steps]
            for old in prunable[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return folder


def check_space(out: Path, name: str) -> None:
    """A `RunError` before writing checkpoint `name` where the disk has less room than the newest checkpoint
    took: a full disk otherwise fails deep inside torch.save, with a message that names neither."""
    complete = checkpoints(out)[0]
    if not complete:
        return
    need = sum(f.stat().st_size for f in complete[-1].iterdir() if f.is_file())
    free = shutil.disk_usage(out).free
    if free < need:
        raise RunError(f"no room for checkpoint {name}: {free / 1e9:.2f} GB free on the disk of {out}, the last "
                       f"checkpoint took {need / 1e9:.2f} GB. Free some space (or keep fewer checkpoints: "
                       "train.keep_checkpoints, train.keep_steps) and resume with --resume")


def resume_checkpoint(out: Path) -> Path:
    """The newest complete checkpoint of the run in `out`, to resume from (incomplete ones are skipped
    with a warning); a `RunError` if there is none."""
    complete, incomplete = checkpoints(out)
    if not complete:
        raise RunError(f"no complete checkpoint to resume in {out / CHECKPOINTS}; start again with --overwrite")
    for folder in incomplete:
        logger.warning("ignoring the incomplete checkpoint %s (interrupted while being written)", folder)
    logger.info("resuming from %s", complete[-1])
    return complete[-1]


def load_checkpoint_state(accelerator: Accelerator, out: Path, timeline: Timeline) -> tuple[Path, dict]:
    """Load the newest complete checkpoint of `out` into the prepared model, optimiser and RNGs, and
    into `timeline`; return it and its trainer state."""
    checkpoint = resume_checkpoint(out)
    accelerator.load_state(str(checkpoint))
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    if "timeline" in state:
        timeline.load_state_dict(state["timeline"], accelerator.device)
    else:  # checkpoints of an older lnfree (fixed gaps only)
        timeline.skip_to(state["step"])
    return checkpoint, state
