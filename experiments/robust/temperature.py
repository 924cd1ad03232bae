"""Is a removal's CE gap to its control a matter of calibration? Each model's CE on the validation half at the
softmax temperature that suits it best (issue 37).

    python experiments/robust/temperature.py CONTROL ARM... [--labels ...] [--sequences 192] [--out DIR]

A fixed final norm divides by one σ for every token, so the logits' scale follows the residual's: an LN-free
model may be less (or more) confident than its control for that reason alone. This scores every model on the
first `--sequences` sequences of the realtext validation half (never the test half), token by token in fp32, at
each temperature of a grid (logits / T), and reports per model the best T, the CE at T = 1 and at the best T, and
each arm's gap to the first model (the control) at T = 1 and with every model at its own best T, overall and by
the predicted token's position. A temperature folds exactly into a final norm's scale (a fixed σ, or a real
norm's weight) where the head has no soft-capping, so the second gap is what calibration alone could take back;
fitted and read on the same sequences, it is an upper bound for them. Writes results.json and tables.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lnfree.evaluate.results import write_experiment

from gap_by_token import POSITIONS, control_and_arms, validation_half  # this folder's (its folder is on the path)

TEMPERATURES = tuple(round(0.70 + 0.025 * i, 3) for i in range(25))  # 0.70 … 1.30


@torch.no_grad()
def ce_by_temperature(model, ids: torch.Tensor, batch: int, temperatures=TEMPERATURES) -> np.ndarray:
    """CE of every next-token prediction at each temperature, (temperatures, rows, positions − 1), in fp32."""
    out = []
    for chunk in tqdm(ids.split(batch), desc="batches", leave=False):
        logits = model(chunk).logits[:, :-1].float()
        target = chunk[:, 1:].unsqueeze(-1)
        out.append(torch.stack([-F.log_softmax(logits / t, dim=-1).gather(-1, target).squeeze(-1)
                                for t in temperatures]))
    return torch.cat(out, dim=1).numpy()


def summarise(names: list[str], ce: list[np.ndarray]) -> dict:
    """Per model its best temperature and CEs; per arm its gap to the control at T = 1 and at the best Ts,
    overall and by position."""
    one = TEMPERATURES.index(1.0)
    best = [int(np.argmin(c.mean(axis=(1, 2)))) for c in ce]
    spans = {"all": (1, ce[0].shape[2]), **{f"{a}-{b}": (a, b) for a, b in POSITIONS}}
    models = {}
    for name, c, b in zip(names, ce, best):
        models[name] = {"best_temperature": TEMPERATURES[b], "ce_at_1": float(c[one].mean()),
                        "ce_at_best": float(c[b].mean()), "gain": float(c[one].mean() - c[b].mean()),
                        "ce_by_temperature": {str(t): float(c[i].mean()) for i, t in enumerate(TEMPERATURES)}}
    gaps = {}
    for name, c, b in zip(names[1:], ce[1:], best[1:]):
        gaps[name] = {span: {"at_1": float((c[one] - ce[0][one])[:, lo - 1:hi].mean()),
                             "at_best": float((c[b] - ce[0][best[0]])[:, lo - 1:hi].mean())}
                      for span, (lo, hi) in spans.items()}
    return {"temperatures": list(TEMPERATURES), "models": models, "gaps": gaps}


def tables(result: dict, control: str) -> list[str]:
    """The result as markdown."""
    lines = [f"Validation half, the first {result['sequences']} sequences ({result['tokens']:,} predicted tokens, "
             "fp32); T fitted and read on the same tokens", "", "| model | best T | CE at T = 1 | CE at best T | gain |",
             "|---|---|---|---|---|"]
    lines += [f"| {n} | {m['best_temperature']:.3f} | {m['ce_at_1']:.4f} | {m['ce_at_best']:.4f} | {m['gain']:.4f} |"
              for n, m in result["models"].items()]
    for name, by_span in result["gaps"].items():
        lines += ["", f"Gap of {name} to {control} (nats): at T = 1, and with each model at its best T", "",
                  "| positions | " + " | ".join(by_span) + " |", "|---|" + "---|" * len(by_span),
                  "| T = 1 | " + " | ".join(f"{g['at_1']:+.4f}" for g in by_span.values()) + " |",
                  "| best T | " + " | ".join(f"{g['at_best']:+.4f}" for g in by_span.values()) + " |"]
    return lines


def main() -> None:
    parser = control_and_arms(__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    loaded, _, ids = validation_half(args, parser, args.context)
    ce = []
    for model in loaded:
        model.module.eval()
        ce.append(ce_by_temperature(model.module, ids, args.batch_size))
    names = [m.label for m in loaded]
    result = {"sequences": len(ids), "tokens": int(ids[:, 1:].numel()), "split": "validation",
              "models_in": args.models, **summarise(names, ce)}
    lines = tables(result, names[0])
    write_experiment(result, lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
