"""Process-level settings for training: the allocator on a CPU, and how many graphs torch.compile keeps.

glibc maps every allocation above 32 MB (logits over a large vocabulary, their gradients, the
distillation's softmaxes) fresh from the kernel and unmaps it on free, so every training step
page-faults those tensors in again. `benchmarks/throughput.py` measures what keeping freed memory
changes for a real run (Gemma 3 270M: vocabulary 262,144, teacher forward included); on small
vocabularies the two are within noise (`benchmarks/results/README.md`).
"""

from __future__ import annotations

import ctypes

import torch

#: graphs torch.compile keeps per compiled function (dynamo's default is 8): a block has one per state of its norms,
#: the vocabulary loss one per set of terms a micro-step asks for; past the limit dynamo runs the function eagerly
RECOMPILE_LIMIT = 64


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
    # A trim threshold of -1 is SIZE_MAX to glibc (mallopt's int becomes a size_t): never trim. The largest int
    # (2 GiB) was not enough: a step that frees more than that at the heap's top had all but the 1 GiB pad given
    # back, and faulted it in again the next step (one Gemma 3 270M run: 262,145 faults, 0.5–0.7 CPU-s a step).
    return all(libc.mallopt(option, value) == 1 for option, value in (
        (m_mmap_max, 0), (m_trim_threshold, -1), (m_top_pad, 2**30)))


def allow_recompiles() -> None:
    """Let every compiled function keep up to `RECOMPILE_LIMIT` graphs (a higher limit set elsewhere stays)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
