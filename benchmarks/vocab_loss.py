"""The vocabulary loss of one chunk of tokens, eager against compiled (`train.compile_vocab_loss`, issue 38).

`lnfree.removal.losses.vocab_loss.logits_loss` (CE + distillation KL, α = 0.5, T = 1) on bf16 logits and bf16
teacher logits of `--tokens` tokens over a `--vocab`-token vocabulary (default Gemma 3's 262,144; 2,048 tokens is
one `KL_CHUNK_TOKENS` chunk), forward and backward, in a fresh process per way and round (the order swapped every
round), under the steady allocator a run uses (`lnfree.removal.runtime`):
- eager: PyTorch's operations, in place where they can be (`_chunk_terms`);
- compiled: the same terms compiled by torch.compile into fused loops (`_fused_terms`).
Per process: the median process CPU time of the calls after the first (which compiles), the peak resident memory
over what the inputs hold, and the loss and a gradient fingerprint, which must agree between the ways. Prints the
per-round ratios and writes `benchmarks/results/vocab_loss.json` / `.txt`.

    python benchmarks/vocab_loss.py [--tokens 2048] [--vocab 262144] [--calls 4] [--rounds 3] [--threads 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("eager", "compiled")


def child(way: str, tokens: int, vocab: int, calls: int) -> dict:
    """One way's times, peak memory and results (run in a process of its own)."""
    import resource
    import time

    import torch

    from lnfree.removal.losses.vocab_loss import logits_loss
    from lnfree.removal.runtime import steady_allocator

    steady_allocator()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=gen) * 2).bfloat16().requires_grad_()
    target = (torch.randn(tokens, vocab, generator=gen) * 2).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is in KiB on Linux)
    seconds = []
    for _ in range(calls):
        start = time.process_time()
        loss, _, _ = logits_loss(logits, labels, target, ce_weight=0.5, kl_weight=0.5, compiled=way == "compiled")
        loss.backward()
        seconds.append(time.process_time() - start)
        grad, logits.grad = logits.grad, None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"seconds": seconds, "median_seconds": statistics.median(seconds[1:]), "peak_over_inputs_gib": peak - held,
            "loss": loss.item(), "grad_fingerprint": grad.float().pow(2).sum().sqrt().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--calls", type=int, default=4, help="calls per process; the first (compiling) is not timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vocab_loss")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, tokens, vocab, calls = args.child
        print(json.dumps(child(way, int(tokens), int(vocab), int(calls))))
        return
    if args.calls < 2:
        parser.error("--calls must be at least 2 (the first compiles)")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            done = subprocess.run([sys.executable, __file__, "--child", way, str(args.tokens), str(args.vocab),
                                   str(args.calls)], check=True, env=env, capture_output=True, text=True, cwd=ROOT)
            runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {way}: {runs[way][-1]['median_seconds']:.3f} CPU-s", flush=True)
    eager, compiled = runs["eager"][0], runs["compiled"][0]
    agreement = {key: abs(compiled[key] - eager[key]) / abs(eager[key]) for key in ("loss", "grad_fingerprint")}
    ratios = [e["median_seconds"] / c["median_seconds"] for e, c in zip(runs["eager"], runs["compiled"])]
    result = {"tokens": args.tokens, "vocab": args.vocab, "threads": args.threads, "runs": runs, "ratios": ratios,
              "relative_difference": agreement}
    lines = [f"# CE + KL of {args.tokens:,} tokens over a {args.vocab:,}-token vocabulary (bf16 logits and teacher), "
             f"forward + backward, OMP_NUM_THREADS={args.threads}, {args.rounds} rounds", "",
             "| way | CPU s (median over rounds) | peak memory over the inputs, GiB | loss |", "|---|---|---|---|"]
    for way in WAYS:
        rows = runs[way]
        lines.append(f"| {way} | {statistics.median(r['median_seconds'] for r in rows):.3f} | "
                     f"{max(r['peak_over_inputs_gib'] for r in rows):.2f} | {rows[0]['loss']:.6f} |")
    lines += ["", f"eager / compiled CPU time by round: {', '.join(f'{r:.2f}' for r in ratios)}; relative difference "
              f"of the loss {agreement['loss']:.1e}, of the gradient's norm {agreement['grad_fingerprint']:.1e}"]
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if max(agreement.values()) > 1e-4:
        sys.exit(f"the two ways disagree: {agreement}")


if __name__ == "__main__":
    main()
