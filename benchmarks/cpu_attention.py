"""Causal attention on a CPU under bf16 autocast: PyTorch's kernel in bf16 against fp32 (issue 38).

The measurement behind `lnfree.removal.precision.attention_in_fp32` (`FP32_ATTENTION_MAX_CONTEXT`,
`FP32_ATTENTION_MAX_HEAD_DIM`): for head sizes 64 (SmolLM2, GPT-2, Qwen2.5), 128 (Qwen3) and 256 (Gemma 3) and
contexts of 64 to 1,024 tokens, the process CPU time of one scaled-dot-product attention forward + backward
(best of `--repeats` after one warm-up) from bf16 query, key and value, three ways: the flash kernel in bf16 (what
autocast runs), the math kernel in bf16, and the flash kernel in fp32 after casting the inputs (what
`lnfree.removal.precision.fp32_attention` runs, casts included). Prints a table with the fp32 / bf16-flash time
ratio and whether lnfree's rule computes that shape in fp32, and writes `benchmarks/results/cpu_attention.json`
/ `.txt`.

    python benchmarks/cpu_attention.py [--threads 1] [--repeats 4] [--contexts 64,128,256,512,1024] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lnfree.removal.precision import attention_in_fp32, cpu_description

ROOT = Path(__file__).resolve().parents[1]
#: (head size, query heads, key/value heads): SmolLM2-135M, Qwen3-0.6B, Gemma 3 270M
HEADS = ((64, 9, 3), (128, 16, 8), (256, 4, 1))
#: (context, sequences): the tokens of a CPU step's micro-batch
SHAPES = ((64, 4), (128, 4), (256, 4), (512, 2), (1024, 2))
WAYS = ("flash bf16", "math bf16", "flash fp32")


def attention_seconds(way: str, batch: int, heads: int, kv_heads: int, context: int, head_dim: int,
                      repeats: int) -> float:
    """Best process CPU seconds of one causal attention forward + backward computed `way`."""
    q = torch.randn(batch, heads, context, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, context, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    backend = SDPBackend.MATH if way.startswith("math") else SDPBackend.FLASH_ATTENTION
    cast = (lambda x: x.float()) if way.endswith("fp32") else (lambda x: x)
    times = []
    for _ in range(repeats + 1):
        start = time.process_time()
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(cast(q), cast(k), cast(v), is_causal=True, enable_gqa=True)
        out.float().sum().backward()
        times.append(time.process_time() - start)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--contexts", default=",".join(str(c) for c, _ in SHAPES),
                        help="comma-separated, from the default")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu_attention")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = {int(c) for c in args.contexts.split(",")}
    if unknown := contexts - {c for c, _ in SHAPES}:
        parser.error(f"unknown context(s) {sorted(unknown)}; choose from {[c for c, _ in SHAPES]}")
    rows = []
    lines = [f"# Causal attention forward + backward on a CPU, ms (best of {args.repeats}), {args.threads} thread(s), "
             f"CPU: {cpu_description()}", "",
             "| head size × heads (kv) | context × sequences | " + " | ".join(WAYS) +
             " | fp32 / flash bf16 | lnfree: fp32 |", "|---|---|---|---|---|---|---|"]
    for head_dim, heads, kv_heads in HEADS:
        for context, batch in (shape for shape in SHAPES if shape[0] in contexts):
            ms = {way: 1e3 * attention_seconds(way, batch, heads, kv_heads, context, head_dim, args.repeats)
                  for way in WAYS}
            fp32 = attention_in_fp32(torch.device("cpu"), "bf16", context, head_dim)
            rows.append({"head_dim": head_dim, "heads": heads, "kv_heads": kv_heads, "context": context,
                         "batch": batch, "ms": ms, "lnfree_fp32": fp32})
            lines.append(f"| {head_dim} × {heads} ({kv_heads}) | {context} × {batch} | "
                         + " | ".join(f"{ms[w]:.1f}" for w in WAYS)
                         + f" | {ms['flash fp32'] / ms['flash bf16']:.2f} | {'yes' if fp32 else 'no'} |")
            print(lines[-1], flush=True)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu_description(), "threads": args.threads,
                                                         "torch": torch.__version__, "rows": rows}, indent=1))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:4]))


if __name__ == "__main__":
    main()
