"""What `auto` means for a run's precision (`train.mixed_precision`, `train.teacher_dtype`) on a device.

bf16 where the device computes in it natively: a CUDA GPU that supports it; a CPU with native bf16
matrix arithmetic (x86's AVX512-BF16 or AMX-BF16) when the run says so with `train.auto_cpu_bf16`:
the modern models' presets and the config of a model without a preset do (on this project's CPU a
Gemma 3 270M removal step takes 5.2 CPU-seconds instead of 9.7, and validation CE after 100 steps
differed from fp32's by +0.010 and +0.002 nats on two seeds, whose fp32 runs differed by 0.088); the
tiny and GPT-2 presets do not, so that their runs reproduce on any CPU (the tiny model gains ~1.1×).
A CPU without native bf16 would emulate it, slower than fp32, so `auto` stays fp32 there. Master
weights, σ statistics, the norm maths and the losses stay fp32 either way; so does attention at a CPU
run's short contexts, where PyTorch's bf16 kernel is the slower one (`attention_in_fp32`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: The /proc/cpuinfo flags of native bf16 matrix products: AVX512-BF16 (Intel Cooper Lake, AMD Zen 4 and
#: later) and AMX-BF16 (Intel Sapphire Rapids and later). torch's own capability ("AVX512") does not say.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _cpuinfo(path: Path) -> tuple[list[str], set[str]] | None:
    """The lines of `path` (/proc/cpuinfo) and the CPU's flags; None where it cannot be read (not Linux)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return lines, {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[-1].split()}


@functools.cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when this CPU multiplies bf16 matrices natively (a flag of `BF16_CPU_FLAGS`); False where
    `cpuinfo` cannot be read (not Linux)."""
    read = _cpuinfo(cpuinfo)
    return read is not None and bool(read[1] & BF16_CPU_FLAGS)


@functools.cache
def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's model name and its native-bf16 flags (benchmark records: timings differ between CPUs);
    "unknown" where `cpuinfo` cannot be read."""
    read = _cpuinfo(cpuinfo)
    if read is None:
        return "unknown"
    lines, flags = read
    name = next((line.split(":", 1)[-1].strip() for line in lines if line.startswith("model name")), "unknown")
    return f"{name} ({', '.join(sorted(flags & BF16_CPU_FLAGS)) or 'no native bf16'})"


def auto_bf16(device: torch.device, cpu_opt_in: bool = False) -> bool:
    """Whether `auto` is bf16 on `device`: a CUDA device that supports it, or (with `cpu_opt_in`,
    `train.auto_cpu_bf16`) a CPU with native bf16 (`cpu_has_native_bf16`)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_opt_in and cpu_has_native_bf16()


#: CPU bf16 autocast computes attention in fp32 up to these sizes, where PyTorch's CPU flash-attention kernel is
#: slower in bf16 than in fp32 with the casts (forward + backward, one thread, an Intel Xeon with AMX,
#: `benchmarks/cpu_attention.py`: head size 64 at 64 tokens 12.3 ms bf16 vs 2.5 fp32, at 128 tokens 14.8 vs 6.6;
#: head size 128 at 64 tokens 19.4 vs 8.8). From 256 tokens bf16 is as fast or faster; at Gemma 3's head size
#: 256 the short contexts were mixed between runs, so it keeps bf16.
FP32_ATTENTION_MAX_CONTEXT = 128
FP32_ATTENTION_MAX_HEAD_DIM = 128
#: The name `fp32_attention` is registered under in transformers' AttentionInterface.
FP32_ATTENTION = "lnfree_fp32_sdpa"


def attention_in_fp32(device: torch.device, precision: str, context: int, head_dim: int) -> bool:
    """Whether a run (with `train.cpu_fp32_attention`) computes attention in fp32 inside its bf16 autocast: on a
    CPU, at contexts and head sizes up to `FP32_ATTENTION_MAX_CONTEXT` and `FP32_ATTENTION_MAX_HEAD_DIM` (GPUs
    keep their bf16 kernels)."""
    return (device.type == "cpu" and precision == "bf16" and context <= FP32_ATTENTION_MAX_CONTEXT
            and head_dim <= FP32_ATTENTION_MAX_HEAD_DIM)


def fp32_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' scaled-dot-product attention with autocast off and its inputs in fp32 (a float mask
    too); the output stays fp32 (the output projection's autocast casts it)."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


def use_fp32_attention(*models) -> None:
    """Switch each transformers model (None skipped) to `fp32_attention`; its saved config is unchanged."""
    AttentionInterface.register(FP32_ATTENTION, fp32_attention)
    for model in models:
        if model is not None:
            model.set_attn_implementation(FP32_ATTENTION)


@contextlib.contextmanager
def casts_kept(enabled: bool = True):
    """Within: autocast keeps its 16-bit casts of the trained weights from one autocast region to the next (each
    of a step's forwards, the text's, the coverage rows' and the stability margin's, entered its own and cast
    every weight again), until the context is left; outside autocast nothing changes. The same values, cast
    once per step. Not under FSDP (`enabled` False there), whose weights are gathered anew inside each forward."""
    if not enabled:
        yield
        return
    torch.autocast_increment_nesting()  # an inner region's exit then leaves autocast's cache alone
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
