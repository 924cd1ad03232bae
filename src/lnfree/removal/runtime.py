"""Process-level settings for training on a CPU.

Subnormal floats: the gradient of a distillation KL over a large vocabulary holds the teacher's tiny
probabilities times the loss's small weights, many of them below fp32's smallest normal number (1.2e-38);
x86 CPUs handle such numbers in microcode, tens of times slower than normal ones. On Gemma 3 270M's
262,144-token vocabulary (Intel Xeon, one thread) the KL's backward took 3.5 CPU-seconds a step with them
and 0.3 flushed to zero (`benchmarks/results/cpu_step_profile_gemma3-270m_denormals.txt`); a value that small
is zero to every sum it joins.

glibc maps every allocation above 32 MB (logits over a large vocabulary, their gradients, the
distillation's softmaxes) fresh from the kernel and unmaps it on free, so every training step
page-faults those tensors in again. `benchmarks/throughput.py` measures what keeping freed memory
changes for a real run (Gemma 3 270M: vocabulary 262,144, teacher forward included); on small
vocabularies the two are within noise (`benchmarks/results/README.md`).
"""

from __future__ import annotations

import contextlib
import ctypes

import torch


def steady_allocator() -> bool:
    """Make glibc's malloc keep freed memory in the heap instead of returning it to the kernel.

    Applies to the whole process from now on; returns False (and changes nothing) where the C
    library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (m_mmap_max, 0), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30)))



@contextlib.contextmanager
def denormals_flushed(on: bool = True):
    """Within: subnormal floats flushed to zero (FTZ/DAZ) where `on` and the CPU can; yields whether they are.
    The mode belongs to this thread and to the threads it starts meanwhile (a thread inherits its creator's
    floating-point mode: enter it before the first parallel operation, or the intra-op threads already
    running keep subnormals); it is switched off again on leaving."""
    flushed = on and torch.set_flush_denormal(True)
    try:
        yield flushed
    finally:
        if flushed:
            torch.set_flush_denormal(False)
