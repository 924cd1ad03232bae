"""The layout of a run folder: one name per file, read by every module that writes or reads one, and
where a run's complete checkpoints are (`checkpoints`, `latest_checkpoint`); a file's fingerprint is
`lnfree.files.file_sha256`.

    RUN/run_config.json          the fully resolved config (RUN_CONFIG)
    RUN/log.jsonl                losses, removal events, evaluations (LOG)
    RUN/start.json               the held-out CE before training (START)
    RUN/tokenizer/               the run's tokenizer (TOKENIZER)
    RUN/checkpoints/step_N/      model, optimiser, RNG state; trainer_state.json written last (CHECKPOINTS, TRAINER_STATE)
    RUN/export/                  the LN-free export (EXPORT)
    RUN/control/                 the vanilla control of `lnfree remove --control` (CONTROL)
    RUN/summary.json             what `lnfree remove` printed (SUMMARY)
"""

from __future__ import annotations

from pathlib import Path

RUN_CONFIG = "run_config.json"
LOG = "log.jsonl"
START = "start.json"
TOKENIZER = "tokenizer"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"  # written last: a checkpoint folder without it is incomplete
PARTIAL = ".partial-"
EXPORT = "export"
CONTROL = "control"
SUMMARY = "summary.json"
MINED = "mined_ids.json"  # the ids `train.coverage.mine` found, by the step its setting started
#: What lnfree writes in a run folder ("lnfree": the trackers' logs); --overwrite removes only these.
RUN_OUTPUTS = (RUN_CONFIG, CHECKPOINTS, TOKENIZER, LOG, START, SUMMARY, EXPORT, CONTROL, MINED, "lnfree")


def checkpoint_step(folder: Path) -> int:
    """The step of a `checkpoints/step_N` folder."""
    return int(folder.name[5:])


def checkpoints(output_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete, incomplete) checkpoint folders of a run, oldest first.

    Incomplete: interrupted while being written (a temporary folder, or an older lnfree's
    `step_N` folder without its trainer state).
    """
    folder = Path(output_dir) / CHECKPOINTS
    steps = sorted((p for p in folder.glob("step_*") if p.name[5:].isdigit()), key=checkpoint_step)
    complete = [p for p in steps if (p / TRAINER_STATE).is_file()]
    return complete, [p for p in steps if p not in complete] + sorted(folder.glob(PARTIAL + "*"))


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete `checkpoints/step_N` folder of a run, if any."""
    complete, _ = checkpoints(output_dir)
    return complete[-1] if complete else None
