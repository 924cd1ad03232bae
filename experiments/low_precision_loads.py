"""How far do bf16 and fp16 loads of an LN-free export drift from the fp32 load? |Δlogits| on held-out text.

    python experiments/low_precision_loads.py EXPORT [--dataset tiny] [--sequences 16]
                                              [--out experiments/results/low_precision_loads]

`lnfree.load` converts every checkpoint to its exact fixed-scale form in fp32 and only then casts
the weights; σ stays fp32. This measures what the cast costs: per dtype, the largest and the mean
absolute logit difference to the fp32 load, the mean |logit| of the fp32 load for scale, and the
largest difference in next-token cross-entropy. Writes `low_precision_loads.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.arch import architecture
from lnfree.evaluate import load_sequences, resolve_dataset, token_statistics
from lnfree.forms.load import load

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@torch.no_grad()
def logits_of(source: str, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of `source` loaded in `dtype`."""
    model = load(source, dtype=dtype).hf().eval()
    return torch.cat([model(input_ids=batch, use_cache=False).logits.float() for batch in ids.split(4)])


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross-entropy, (n, context − 1)."""
    return token_statistics(logits[:, :-1], ids[:, 1:])[0]["ce"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", help="an lnfree export (or anything lnfree.load reads)")
    parser.add_argument("--dataset", default="tiny", help="held-out text: a dataset preset or path")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--out", default="experiments/results/low_precision_loads")
    args = parser.parse_args()
    reference = load(args.export)
    spec = resolve_dataset(args.dataset)
    context = spec.context or architecture(reference.model).n_positions
    ids = torch.from_numpy(load_sequences(spec, reference.tokenizer, context=context, n_sequences=args.sequences,
                                          vocab_size=reference.model.config.vocab_size))
    exact = logits_of(args.export, torch.float32, ids)
    exact_ce = cross_entropy(exact, ids)
    rows = {}
    for name, dtype in DTYPES.items():
        low = logits_of(args.export, dtype, ids)
        diff = (low - exact).abs()
        rows[name] = {"max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                      "max_abs_ce_diff": float((cross_entropy(low, ids) - exact_ce).abs().max()),
                      "finite": bool(torch.isfinite(low).all())}
        print(f"{name}: max |Δlogits| {rows[name]['max_abs_logit_diff']:.4f}, mean {rows[name]['mean_abs_logit_diff']:.4f}, "
              f"max |ΔCE| {rows[name]['max_abs_ce_diff']:.4f}")
    result = {"export": args.export, "dataset": spec.name, "tokens": list(ids.shape),
              "mean_abs_logit_fp32": float(exact.abs().mean()), "dtypes": rows}
    print(f"mean |logit| (fp32) {result['mean_abs_logit_fp32']:.3f} over {ids.numel()} tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "low_precision_loads.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
