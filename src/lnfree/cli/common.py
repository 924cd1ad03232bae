"""What the `lnfree` commands share: one-line errors that name the command line's flags, the model
names their help lists, and the run config that `remove`, `schedule` and `plan` build from
--preset / --config / --model and their options."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import typer

from lnfree.errors import LnfreeError
from lnfree.models.sources import known_names

#: Every model name lnfree knows, for the help of options that take a model.
MODEL_NAMES_HELP = known_names()
#: `name=value (CLI: --flag)` in an error of the Python API: the command line shows only the flag.
_API_AND_FLAG = re.compile(r"\b[\w.]+(?:=\w+)? \(CLI: ([^)]+)\)")


def cli_message(message: str) -> str:
    """An error of the Python API as the command line says it: one line, naming flags, not keywords."""
    one_line = "; ".join(line.strip() for line in str(message).splitlines() if line.strip())
    return _API_AND_FLAG.sub(r"\1", one_line)


def fail(message: str) -> None:
    """Print `error: MESSAGE` (one line) on stderr and exit with status 2 (a user's mistake)."""
    typer.secho(f"error: {cli_message(message)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def user_errors():
    """Errors a user can cause (`LnfreeError`; `OSError`: files) as one `error:` line; anything else is a
    bug in lnfree or below it and keeps its traceback."""
    try:
        yield
    except (LnfreeError, OSError) as err:
        fail(str(err))


def base_config(preset: str | None, config_file: Path | None, model: str | None):
    """The run config a command starts from: --config, --preset, the preset of --model, or the generic one."""
    from lnfree.removal.config import load_config, load_preset, preset_names

    if preset and config_file:
        fail("give either --preset or --config, not both")
    if config_file:
        return load_config(config_file)
    if preset:
        return load_preset(preset)
    if model is None or model == "tiny":
        return load_preset("tiny")
    for name in preset_names():
        candidate = load_preset(name)
        if model in (name, candidate.model):
            return candidate
    # Any other model: distillation to the original with GPT-2 small's hyperparameters (gpt2-distill);
    # context, schedule and length from the model, the model's own dropout (as P25 kept GPT-2's), a
    # micro-batch that fits the step, the token embedding frozen and bf16 on a CPU with native bf16 as on a
    # GPU (as the modern models' presets; the tiny and GPT-2 ones stay fp32 there, so that they reproduce on
    # every CPU).
    generic = load_preset("gpt2-distill")
    return generic.model_copy(update={
        "data": generic.data.model_copy(update={"context_length": None}),
        "removal": generic.removal.model_copy(update={"schedule": None}),
        "train": generic.train.model_copy(update={
            "max_steps": None, "dropout": None, "micro_batch_size": None,
            "max_micro_batch_size": generic.train.micro_batch_size, "auto_cpu_bf16": True,
            "freeze_embeddings": True,
        }),
        "output_dir": f"runs/{Path(model).name}",
    })


def adapt_micro_batch(cfg, named: dict, overrides: list[str]):
    """A preset's micro-batch becomes an upper bound when the user changed the step but not the micro-batch."""
    keys = {k for k, v in named.items() if v is not None} | {item.partition("=")[0].strip() for item in overrides}
    if "train.micro_batch_size" in keys or not keys & {"train.tokens_per_step", "data.context_length"}:
        return cfg
    if cfg.train.micro_batch_size is None:
        return cfg
    from lnfree.removal.config import with_overrides

    return with_overrides(cfg, {"train.micro_batch_size": None, "train.max_micro_batch_size": cfg.train.micro_batch_size})


def remove_config(cfg, named: dict, overrides: list[str]):
    """`cfg` with the options of `lnfree remove` (`named`: config key → value or None) and its --set
    overrides applied. A --lr below the config's learning-rate floor lowers the floor to it."""
    from lnfree.removal.config import with_overrides

    named = {k: v for k, v in named.items() if v is not None}
    lr = named.get("train.learning_rate")
    if lr is not None and cfg.train.min_learning_rate > lr:
        named["train.min_learning_rate"] = lr
    cfg = with_overrides(cfg, named)
    cfg = with_overrides(cfg, overrides)
    return adapt_micro_batch(cfg, named, overrides)
