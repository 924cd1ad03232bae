"""The processes a run trains in: accelerate's `Accelerator` (one process, or several under
``torchrun`` / ``accelerate launch``: DDP, or FSDP through an accelerate config; gloo on CPU-only
hosts), the process group's teardown at exit (`close_distributed`), and what the libraries print
silenced while a command runs (`quiet_libraries`), and the end of a distributed command's processes
(`exit_without_teardown`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from transformers.utils import logging as hf_logging

from lnfree.removal.config import RunConfig


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
        atexit.register(close_distributed)
    return accelerator


def average_gradients(params: list[torch.Tensor]) -> None:
    """Average `params`' gradients over the processes in place (a parameter without one counts as zeros), for a
    backward that ran outside DDP's synchronisation (`no_sync`)."""
    world = torch.distributed.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        torch.distributed.all_reduce(p.grad)
        p.grad.div_(world)


def close_distributed() -> bool:
    """Tear down the process group torchrun / accelerate started, after the last collective; whether
    there was one to tear down.

    Local to each process; `run` registers it to run at exit in every distributed process, so scripts
    need not call it. It does not stop gloo's worker threads: DistributedDataParallel keeps the group's
    C++ object alive after `destroy_process_group` and garbage collection (measured on torch 2.13), so
    the threads live into interpreter teardown, where one that drops a finished collective's tensors
    aborts the process (`exit_without_teardown`).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        return True
    return False


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End this process now, after flushing what it wrote, without the interpreter's teardown.

    For a distributed command that has written everything. gloo's worker threads outlive the
    interpreter (`close_distributed`); when one drops a finished collective's Python-owned tensor
    during teardown it must take the GIL, the finalising interpreter ends the thread inside a C++
    destructor, and the process aborts ("terminate called without an active exception", exit -6: about
    one two-process run in thirty on a loaded CPU, the backtrace in
    benchmarks/results/gloo_exit_aborts/; pytorch/pytorch#190489). Skipping teardown removes the window.
    Trackers are ended by the run itself; logging is shut down here.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
