"""Where a real model's massive activations sit, and what fixing each norm alone does.

    python experiments/modern/massive_activations.py --model gemma3-270m [--out experiments/results/gemma3-270m/massive_activations]

Any family lnfree knows (the adapter names the norms). On realtext held-out sequences, with the
original model (BOS first where the family puts one there):
1. At every norm's input (per-head q/k norms aside): position 0's RMS and the largest other
   token's (with its text), over the median token's; position 0's largest channel, and its mean
   magnitude there and at every other position.
2. A census over training sequences of the massive tokens: residual norm above `--ratio`× the
   median token's, at the depth where position 0 stands out most; by position, and the commonest
   tokens after position 0.
3. Each norm fixed alone, without fine-tuning (position 0 with its own σ, σ measured on other
   held-out sequences): held-out CE and the largest growth of any token's residual norm.
Writes results.json and tables.md (experiments/smollm2/massive_activations.py is the SmolLM2-only
forerunner, which also mutes channels).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import DataConfig
from lnfree.data.documents import bos_token, prepare_data
from lnfree.removal.losses.massive import NormInputs
from lnfree.models.base import load_base
from lnfree.evaluate.results import write_experiment

CENSUS_SEQUENCES = 320


def site_name(site) -> str:
    return site.stage if site.layer is None else f"blocks.{site.layer}.{site.stage}"


def norm_input_scales(model, tokenizer, tokens: torch.Tensor) -> list[dict]:
    """Per norm input: position 0's and the largest other token's RMS over the median, and position 0's top channel."""
    sites = [s for s in architecture(model).sites() if not s.per_head]  # NormInputs' sites, in forward order
    inputs = NormInputs(model)
    with torch.no_grad():
        model(input_ids=tokens)
    seen = [x.float() for x in inputs.take()]
    inputs.remove()
    rows = []
    for site, x in zip(sites, seen, strict=True):
        rms = x.pow(2).mean(-1).sqrt()  # (batch, positions)
        median = rms[:, 1:].median()
        b, s = divmod(int(rms[:, 1:].argmax()), rms.shape[1] - 1)
        channel = int(x[:, 0].abs().mean(0).argmax())
        rows.append({"norm": site_name(site), "position0_over_median": float(rms[:, 0].mean() / median),
                     "max_other_over_median": float(rms[b, s + 1] / median),
                     "max_other_token": tokenizer.decode(tokens[b, s + 1]), "max_other_position": s + 1,
                     "rms_median_other": float(median), "top_channel": channel,
                     "top_channel_position0": float(x[:, 0, channel].abs().mean()),
                     "top_channel_other": float(x[:, 1:, channel].abs().mean())})
    return rows


def residual_ratios(model, tokens: torch.Tensor) -> torch.Tensor:
    """(depth,) position 0's residual norm over the median other token's, at each hidden state."""
    with torch.no_grad():
        norms = torch.stack(model(input_ids=tokens, output_hidden_states=True).hidden_states).float().norm(dim=-1)
    return norms[:, :, 0].mean(1) / norms[:, :, 1:].flatten(1).median(1).values


def census(model, tokenizer, train: torch.Tensor, depth: int, ratio: float) -> dict:
    by_position, examples, total = collections.Counter(), collections.Counter(), 0
    for batch in train.split(32):
        with torch.no_grad():
            hidden = model(input_ids=batch, output_hidden_states=True).hidden_states[depth]
        norms = hidden.float().norm(dim=-1)
        massive = norms > ratio * norms[:, 1:].median()
        total += len(batch)
        for b, s in massive.nonzero().tolist():
            by_position[s] += 1
            if s:
                examples[f"{tokenizer.decode(batch[b, s - 1])!r} → {tokenizer.decode(batch[b, s])!r}"] += 1
    return {"sequences": total, "depth": depth, "ratio": ratio, "massive_by_position": dict(sorted(by_position.items())),
            "examples_after_position_0": examples.most_common(10)}


def single_fixes(model, eot_token_id: int | None, measure: torch.Tensor, score: torch.Tensor) -> list[dict]:
    """Held-out CE and the largest residual-norm growth with each norm fixed alone (ln_1's two paths together)."""
    surgery.install(model, special_pos0=True, eot_token_id=eot_token_id)
    surgery.initialise_sigmas(model, measure.split(4))
    states = surgery.scale_states(model)

    def forward() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            out = model(input_ids=score, labels=score, output_hidden_states=True)
        return float(out.loss), torch.stack(out.hidden_states).float().norm(dim=-1)

    ce_real, baseline = forward()
    rows = [{"fixed": "nothing", "ce": ce_real, "max_residual_growth": 1.0}]
    groups = collections.defaultdict(list)
    for slot in states:
        groups[slot.replace("ln_1qk", "ln_1").replace("ln_1v", "ln_1")].append(states[slot])
    for name, group in groups.items():
        for state in group:
            state.switch_to_fixed()
        ce, norms = forward()
        growth = float((norms / baseline).nan_to_num(nan=float("inf")).amax())
        rows.append({"fixed": name, "ce": ce, "max_residual_growth": growth})
        for state in group:
            state.switch_to_real()
        print(f"{name:>22}: CE {ce:.3f}, largest residual growth ×{growth:.3g}", flush=True)
    return rows


def tables(result: dict) -> str:
    c, fixes = result["census"], {r["fixed"]: r for r in result["single_fixes"]}
    lines = [f"# {result['model']}: massive activations and single fixed norms", "",
             f"Position 0's residual norm over the median token's, by depth (embedding first): "
             f"{', '.join(f'{r:.1f}' for r in result['position0_residual_ratio'])}.", "",
             f"Massive tokens (residual norm > {c['ratio']:g}× the median, at hidden state {c['depth']}) in "
             f"{c['sequences']} training sequences, by position: {c['massive_by_position'] or 'none'}; after position 0: "
             f"{', '.join(f'{k} ({v})' for k, v in c['examples_after_position_0']) or 'none'}.", "",
             "| norm input | position 0 / median RMS | largest other / median (token, position) | median RMS | "
             "position 0's top channel: there / elsewhere |", "|---|---|---|---|---|"]
    lines += [f"| {r['norm']} | {r['position0_over_median']:.1f}× | {r['max_other_over_median']:.1f}× "
              f"({r['max_other_token']!r}, {r['max_other_position']}) | {r['rms_median_other']:.3g} | "
              f"{r['top_channel']}: {r['top_channel_position0']:.3g} / {r['top_channel_other']:.3g} |"
              for r in result["norm_inputs"]]
    stages = list(dict.fromkeys(name.split(".")[-1] for name in fixes if name.startswith("blocks.")))
    lines += ["", f"Each norm fixed alone, no fine-tuning (CE with every norm real: {fixes['nothing']['ce']:.3f}; "
              f"ln_f alone: {fixes['ln_f']['ce']:.3f}, growth ×{fixes['ln_f']['max_residual_growth']:.3g}): "
              "CE, largest residual growth.", "",
              "| block | " + " | ".join(stages) + " |", "|---" * (len(stages) + 1) + "|"]
    layers = sorted({int(name.split(".")[1]) for name in fixes if name.startswith("blocks.")})
    for layer in layers:
        cells = [fixes.get(f"blocks.{layer}.{stage}") for stage in stages]
        lines.append(f"| {layer} | " + " | ".join(f"{r['ce']:.2f}, ×{r['max_residual_growth']:.3g}" if r else "–"
                                                  for r in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ratio", type=float, default=10.0, help="a token is massive above this many median norms")
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / args.model / "massive_activations"
    torch.manual_seed(0)
    model, tokenizer = load_base(args.model)
    model.eval()
    bos = bos_token(model, tokenizer)
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=16), tokenizer, 64,
                        model.config.vocab_size, bos)
    held_out = data.eval_batch(16)
    step = max(1, len(data.train) // CENSUS_SEQUENCES)
    train = torch.from_numpy(data.train[::step][:CENSUS_SEQUENCES].astype("int64"))
    ratios = residual_ratios(model, held_out[:8])
    depth = int(ratios[1:].argmax()) + 1  # the embedding itself aside
    result = {"model": args.model, "position0_residual_ratio": ratios.tolist(),
              "norm_inputs": norm_input_scales(model, tokenizer, held_out[:8]),
              "census": census(model, tokenizer, train, depth, args.ratio)}
    result["single_fixes"] = single_fixes(model, data.eot_token_id, held_out[:8], held_out[8:])
    write_experiment(result, tables(result), out)
    print(f"→ {out}")


if __name__ == "__main__":
    main()
