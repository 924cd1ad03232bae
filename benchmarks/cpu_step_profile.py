"""Where a CPU training step spends its time in fp32 and in bf16, by kind of operation (issue 38).

Runs a run config (default: `benchmarks/configs/smollm2-135m_vanilla_realtext.toml`, the step of issue
38's SmolLM2 target) for 3 steps (a removal's first stage at step 1) in a fresh process per precision and profiles the forward and
backward of the third step with torch.profiler (self CPU time per operator; the optimiser step is
outside it). Operators are grouped: matrix products (mm, addmm, bmm), attention (PyTorch's
scaled-dot-product kernels), the vocabulary log-softmax and its backward, dtype casts (copy_, _to_copy)
and the rest; and the ten operators of largest self CPU time with their input shapes (which tensors a
step's time goes to: Gemma 3's are the 256 × 262,144 logits of the distillation loss). `--set KEY=VALUE`
changes a setting of the config in both precisions (`--set train.cpu_fp32_attention=false`). Then a kernel check: causal scaled-dot-product attention forward + backward at the
config's shape (batch × heads × context × head size) with PyTorch's flash and math backends, in fp32
and bf16. Prints each group's seconds per precision and the fp32 / bf16 ratio, and writes
`benchmarks/results/cpu_step_profile_<model>.json` / `.txt`.

    python benchmarks/cpu_step_profile.py [--config FILE] [--threads 1] [--set KEY=VALUE ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import setting

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "benchmarks/configs/smollm2-135m_vanilla_realtext.toml"
PRECISIONS = {"fp32": "no", "bf16": "bf16"}
GROUPS = {"matrix products": ("aten::mm", "aten::addmm", "aten::bmm"), "attention": ("scaled_dot_product",),
          "vocabulary log-softmax": ("log_softmax",), "dtype casts": ("aten::copy_", "aten::_to_copy")}


def group(name: str) -> str:
    return next((g for g, keys in GROUPS.items() if any(k in name for k in keys)), "rest")


TOP = 10


def child(config_path: Path, precision: str, out: Path, overrides: dict) -> None:
    """Profile the third step's forward and backward of the config in `precision`; write seconds per group."""
    from torch.profiler import ProfilerActivity, profile

    import lnfree.removal.train as train
    from lnfree.removal.config import load_config, with_overrides

    from throughput import bench_overrides

    # cut to 3 steps as the throughput benchmarks cut a run (a removal at step 1, no ceiling or special σ)
    config = with_overrides(load_config(config_path), {**bench_overrides(3, out.parent / f"run_{precision}"),
                                                       **overrides, "train.mixed_precision": precision})
    profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    calls, step = [0], train._forward_backward

    def profiled_step(*args, **kwargs):  # a benchmark-only wrapper: the third call runs under the profiler
        calls[0] += 1
        if calls[0] != 3:
            return step(*args, **kwargs)
        with profiler:
            return step(*args, **kwargs)

    train._forward_backward = profiled_step
    train.run(config, overwrite=True, progress=False)
    seconds: dict[str, float] = {}
    for event in profiler.key_averages():
        key = group(event.key)
        seconds[key] = seconds.get(key, 0.0) + event.self_cpu_time_total / 1e6
    by_shape = sorted(profiler.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    top = [[e.key, str(e.input_shapes), e.count, e.self_cpu_time_total / 1e6] for e in by_shape[:TOP]]
    out.write_text(json.dumps({"model": config.model, "seconds": seconds, "top": top,
                               "shape": [config.train.micro_batch_size, config.data.context_length]}))


def attention_kernels(batch: int, heads: int, context: int, head_size: int) -> dict[str, float]:
    """CPU seconds of one causal attention forward + backward per backend and dtype (best of 3)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
            q, k, v = (torch.randn(batch, heads, context, head_size, dtype=dtype, requires_grad=True) for _ in range(3))
            times = []
            for _ in range(4):
                start = time.process_time()
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                times.append(time.process_time() - start)
            out[f"{backend.name.lower()} {str(dtype).removeprefix('torch.')}"] = min(times[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/cpu_step_profile_<model>")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config setting for both precisions (VALUE read as JSON where it parses)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(Path(args.child[0]), args.child[1], Path(args.child[2]), json.loads(args.child[3]))
    overrides = dict(setting(s) for s in args.set)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in PRECISIONS.items():
            out = Path(tmp) / f"{name}.json"
            subprocess.run([sys.executable, __file__, "--child", str(args.config), precision, str(out),
                            json.dumps(overrides)], check=True, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            profiles[name] = json.loads(out.read_text())
    import torch
    from transformers import AutoConfig

    from lnfree.arch import architecture
    from lnfree.models.base import resolve_model_source

    torch.set_num_threads(args.threads)
    model = profiles["fp32"]["model"]
    hf = AutoConfig.from_pretrained(resolve_model_source(model))
    batch, context = profiles["fp32"]["shape"]
    head_dim = architecture(hf).head_dim  # Gemma 3's heads are not hidden / heads wide
    kernels = attention_kernels(batch, hf.num_attention_heads, context, head_dim)
    lines = [f"# {model}: one step's forward + backward ({batch} × {context} tokens), self CPU seconds by kind of "
             f"operator, OMP_NUM_THREADS={args.threads}", "", "| operators | fp32 s | bf16 s | fp32 / bf16 |", "|---|---|---|---|"]
    for key in [*GROUPS, "rest"]:
        a, b = (profiles[p]["seconds"].get(key, 0.0) for p in PRECISIONS)
        lines.append(f"| {key} | {a:.2f} | {b:.2f} | {a / b:.2f} |" if b else f"| {key} | {a:.2f} | {b:.2f} | – |")
    total = [sum(profiles[p]["seconds"].values()) for p in PRECISIONS]
    lines += [f"| **total** | {total[0]:.2f} | {total[1]:.2f} | {total[0] / total[1]:.2f} |", "",
              f"Causal attention forward + backward alone, {batch} × {hf.num_attention_heads} heads × {context} × "
              f"{head_dim}, CPU seconds (best of 3):", "",
              "| kernel | seconds |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in kernels.items()]
    for name in PRECISIONS:
        lines += ["", f"The {TOP} largest operators in {name} (self CPU seconds):", "",
                  "| operator | input shapes | calls | seconds |", "|---|---|---|---|"]
        lines += [f"| {op} | {shapes[:90]} | {calls} | {sec:.3f} |" for op, shapes, calls, sec in profiles[name]["top"]]
    out = args.out or ROOT / "benchmarks/results" / f"cpu_step_profile_{model.replace('/', '_')}"
    (out.parent / f"{out.name}.json").write_text(json.dumps({"profiles": profiles, "attention_kernels": kernels,
                                                             "threads": args.threads, "settings": overrides}, indent=1))
    (out.parent / f"{out.name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
