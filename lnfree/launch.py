"""The processes a run trains in: accelerate's `Accelerator` (one process, or several under
``torchrun`` / ``accelerate launch``: DDP, or FSDP through an accelerate config; gloo on CPU-only
hosts), the process group's teardown at exit (`close_distributed`), and what the libraries print
silenced while a command runs (`quiet_libraries`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from transformers.utils import logging as hf_logging

from lnfree.config import RunConfig


def make_accelerator(config: RunConfig) -> Accelerator:
    """The run's accelerator (weights stay fp32: the run applies autocast itself); in a distributed
    run it also registers `close_distributed` to run at exit."""
    accelerator = Accelerator(
        cpu=not torch.accelerator.is_available(),  # lets torchrun start gloo processes on CPU-only hosts
        mixed_precision="no",  # autocast is applied explicitly by the run; weights stay fp32
        log_with=config.train.report_to or None,
        project_dir=config.output_dir,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )
    if accelerator.num_processes > 1:  # whoever called run() (the CLI, a script under torchrun): tear gloo down at exit
        atexit.register(close_distributed)  # still ~1 abort in 10 under load: benchmarks/results/gloo_exit.txt
    return accelerator


def close_distributed() -> None:
    """Tear down the process group torchrun / accelerate started, after the last collective.

    Without it a gloo worker can abort at interpreter exit ("terminate called without an active
    exception", exit code -6) after a run that finished correctly: gloo's worker threads still hold
    work objects whose tensors are freed while the interpreter is torn down (the cause named in
    pytorch/pytorch#179291, which proposed the same remedy in torch). Local to each process; `run`
    registers it to run at exit in every distributed process, so scripts need not call it. It does
    not remove every abort: `benchmarks/gloo_exit.py` still saw one in ten runs under load.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def quiet_libraries():
    """Silence what transformers and accelerate print that is not lnfree's (loading bars, notices, warnings)."""
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    accelerate_log = logging.getLogger("accelerate")
    level = accelerate_log.level
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    accelerate_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        accelerate_log.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
