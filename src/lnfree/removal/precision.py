"""What `auto` means for a run's precision (`train.mixed_precision`, `train.teacher_dtype`) on a device.

bf16 where the device computes in it natively: a CUDA GPU that supports it; a CPU with native bf16
matrix arithmetic (x86's AVX512-BF16 or AMX-BF16) when the run says so with `train.auto_cpu_bf16`:
the modern models' presets and the config of a model without a preset do (on this project's CPU a
Gemma 3 270M removal step takes 5.2 CPU-seconds instead of 9.7, and validation CE after 100 steps
differed from fp32's by +0.010 and +0.002 nats on two seeds, whose fp32 runs differed by 0.088); the
tiny and GPT-2 presets do not, so that their runs reproduce on any CPU (the tiny model gains ~1.1×).
A CPU without native bf16 would emulate it, slower than fp32, so `auto` stays fp32 there. Master
weights, σ statistics, the norm maths and the losses stay fp32 either way.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

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
