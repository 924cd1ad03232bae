"""The layout of a run folder: one name per file, read by every module that writes or reads one.

    RUN/run_config.json          the fully resolved config (RUN_CONFIG)
    RUN/log.jsonl                losses, removal events, evaluations (LOG)
    RUN/start.json               the held-out CE before training (START)
    RUN/tokenizer/               the run's tokenizer (TOKENIZER)
    RUN/checkpoints/step_N/      model, optimiser, RNG state; trainer_state.json written last (CHECKPOINTS, TRAINER_STATE)
    RUN/export/                  the LN-free export (EXPORT)
    RUN/control/                 the vanilla control of `lnfree remove --control` (CONTROL)
    RUN/summary.json             what `lnfree remove` printed (SUMMARY)
"""

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
#: What lnfree writes in a run folder ("lnfree": the trackers' logs); --overwrite removes only these.
RUN_OUTPUTS = (RUN_CONFIG, CHECKPOINTS, TOKENIZER, LOG, START, SUMMARY, EXPORT, CONTROL, "lnfree")
