"""Opening a run's folder (`prepare_output_dir`): a new run, a run resumed (amended where its config
changed in a way `lnfree.removal.amend` allows, or only in how it is logged and checkpointed:
`BOOKKEEPING_FIELDS`), or a run replaced (`overwrite`: only the files lnfree wrote). The files in
the folder are named in `lnfree.removal.layout`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from lnfree.removal.amend import AmendError, amendment, without_fields
from lnfree.removal.checkpointing import resume_checkpoint
from lnfree.removal.config import RunConfig
from lnfree.removal.derived import STALE_MARKER, mark_derived_outputs
from lnfree.removal.layout import RUN_CONFIG, RUN_OUTPUTS, TRAINER_STATE
from lnfree.removal.resolve import RunError, learning_rate

logger = logging.getLogger("lnfree")

#: Config fields that change how a run is logged, evaluated or checkpointed, not what it trains: a run
#: may resume with other values (the run config then records the new ones).
BOOKKEEPING_FIELDS = {"train": ("eval_every", "log_every", "save_every", "keep_checkpoints", "keep_steps",
                                "report_to", "steady_allocator")}


def prepare_output_dir(config: RunConfig, resume: bool, overwrite: bool, n_layer: int) -> list[str]:
    """Check that `config.output_dir` may hold this run (resumed, replaced or new), clear what a replaced
    run wrote and record the run config there; return the fields a resumed run amends (see `lnfree.removal.amend`)."""
    out = Path(config.output_dir)
    previous, amended = out / RUN_CONFIG, []
    if previous.exists():
        # A run folder may have been moved: compare everything but where it lives. Read through the
        # config class, so that a field added since the run started compares at its default.
        stored = RunConfig.model_validate({**json.loads(previous.read_text()), "output_dir": config.output_dir})
        same = _trajectory(stored) == _trajectory(config)
        if resume and not same:
            step = json.loads((resume_checkpoint(out) / TRAINER_STATE).read_text())["step"]
            try:
                amended = amendment(stored, config, step, n_layer, learning_rate, BOOKKEEPING_FIELDS)
            except AmendError as error:
                raise RunError(f"{out} holds a run with a different config; cannot resume it with this one: "
                               f"{error}") from None
            logger.warning("amending %s from step %d: %s", out, step, ", ".join(amended))
        if resume and _bookkeeping_changes(stored, config):  # how it is logged or checkpointed changed
            logger.warning("resuming %s with new %s", out, ", ".join(sorted(_bookkeeping_changes(stored, config))))
        if not resume and not overwrite:
            if same:
                raise RunError(f"{out} already holds this same run; continue it with resume=True (CLI: --resume) or "
                               "replace it with overwrite=True (CLI: --overwrite)")
            raise RunError(f"{out} already holds a different run; choose another output_dir (CLI: -o DIR) or replace "
                           "it with overwrite=True (CLI: --overwrite)")
        if overwrite:
            _clear_run_outputs(out)
    elif resume:
        raise RunError(f"nothing to resume in {out}")
    elif out.exists() and any(out.iterdir()) and not overwrite:
        raise RunError(f"{out} is not empty and holds no lnfree run; choose another output_dir (CLI: --output-dir)")
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_CONFIG).write_text(config.model_dump_json(indent=2))
    return amended


def _clear_run_outputs(out: Path) -> None:
    """Remove what the run being replaced wrote in `out`, and mark what was derived from it stale."""
    for folder in mark_derived_outputs(out, skip=RUN_OUTPUTS):
        logger.warning("%s read a model of the run being replaced: marked %s", folder, STALE_MARKER)
    for name in RUN_OUTPUTS:  # never what the user put beside them (e.g. an eval/ folder)
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for partial in out.glob(".export-*"):
        shutil.rmtree(partial)


def _trajectory(config: RunConfig) -> dict:
    """`config` as JSON without its bookkeeping fields: two configs equal here train the same model."""
    return without_fields(BOOKKEEPING_FIELDS, config)


def _bookkeeping_changes(old: RunConfig, new: RunConfig) -> list[str]:
    """`section.field (old → new)` for each bookkeeping field that differs."""
    return [f"{section}.{name} ({getattr(getattr(old, section), name)} → {getattr(getattr(new, section), name)})"
            for section, names in BOOKKEEPING_FIELDS.items() for name in names
            if getattr(getattr(old, section), name) != getattr(getattr(new, section), name)]
