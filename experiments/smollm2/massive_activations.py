"""Why SmolLM2-135M resists a fixed-scale removal: its massive activations, measured.

    python experiments/smollm2/massive_activations.py [--out experiments/results/smollm2-135m/massive_activations]

Three measurements on the original model (real English text, `realtext`):
1. Per norm input, how much larger position 0's input to the norm's consumers (weight ⊙ x) is than
   the median token's: once a norm is fixed, that is how much larger position 0's normalised input
   becomes, unless it has its own σ.
2. Which tokens carry a massive activation (residual norm entering block 15 > 10× the median),
   counted over training sequences by position.
3. Each norm fixed alone (position 0 with its own σ, no fine-tuning): held-out CE and the largest
   growth of any token's residual norm.
4. The held-out CE with the norms' weights zeroed on position 0's largest channels (every norm
   real): what muting the massive activation at the norms would cost. A gated MLP is roughly quadratic in its input's scale, so a
   token pushed past a threshold can grow by orders of magnitude in one block.
Writes results.json and README-ready tables (tables.md) to --out.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.arch import architecture
from lnfree.removal.config import DataConfig
from lnfree.data.documents import prepare_data
from lnfree.models.base import load_base
from lnfree.evaluate.results import write_experiment

CENSUS_SEQUENCES = 320
CENSUS_LAYER = 15


def norm_inputs(model, arch_norms: dict[str, torch.nn.Module], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input of each named norm module on `tokens`."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(n, args[0].detach()))
             for n, m in arch_norms.items()]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return seen


def block_norms(model) -> dict[str, torch.nn.Module]:
    """Each block's attention-input ("{layer}.ln_1") and MLP-input ("{layer}.ln_2") norm, in block order."""
    return {f"{site.layer}.{site.stage}": model.get_submodule(site.module) for site in architecture(model).sites()
            if site.stage in ("ln_1", "ln_2")}


def position0_ratios(model, tokens: torch.Tensor) -> list[dict]:
    norms = block_norms(model)
    inputs = norm_inputs(model, norms, tokens)
    rows = []
    for name, module in norms.items():
        x = inputs[name]
        effective = (x * module.weight).norm(dim=-1)  # (batch, positions)
        others = effective[:, 1:]
        rms = x.pow(2).mean(-1).sqrt()
        channel = int(x[:, 0].abs().mean(0).argmax())
        rows.append({"norm": name, "position0_over_median": float(effective[:, 0].mean() / others.median()),
                     "max_other_over_median": float(others.max() / others.median()),
                     "rms_position0": float(rms[:, 0].mean()), "rms_median_other": float(rms[:, 1:].median()),
                     "top_channel": channel, "top_channel_position0": float(x[:, 0, channel].abs().mean()),
                     "top_channel_other": float(x[:, 1:, channel].abs().mean())})
    return rows


def muting(model, score: torch.Tensor, channels: list[int]) -> list[dict]:
    """Held-out CE (every norm real) with the norms' weights zeroed on the largest position-0 channels."""
    rows = []
    for first in range(1, len(channels) + 1):
        for which in ("ln_2", "ln_1", "both"):
            saved = []
            for name, norm in block_norms(model).items():
                if which in (name.split(".")[1], "both"):
                    saved.append((norm.weight, norm.weight.detach().clone()))
                    with torch.no_grad():
                        norm.weight[channels[:first]] = 0
            with torch.no_grad():
                ce = float(model(input_ids=score, labels=score).loss)
            for weight, value in saved:
                with torch.no_grad():
                    weight.copy_(value)
            rows.append({"channels": channels[:first], "norms": which, "ce": ce})
    return rows


def census(model, tokenizer, train: torch.Tensor) -> dict:
    by_position, examples, total = collections.Counter(), collections.Counter(), 0
    for batch in train.split(32):
        with torch.no_grad():
            norms = model(input_ids=batch, output_hidden_states=True).hidden_states[CENSUS_LAYER].norm(dim=-1)
        massive = norms > 10 * norms[:, 1:].median()
        total += massive.shape[0]
        for b, s in massive.nonzero().tolist():
            by_position[s] += 1
            if s:
                examples[f"{tokenizer.decode(batch[b, s - 1])!r} → {tokenizer.decode(batch[b, s])!r}"] += 1
    return {"sequences": total, "massive_by_position": dict(sorted(by_position.items())),
            "examples_after_position_0": examples.most_common(10)}


def single_fixes(model, tokenizer, measure: torch.Tensor, score: torch.Tensor) -> list[dict]:
    surgery.install(model, special_pos0=True, eot_token_id=tokenizer.eos_token_id)
    surgery.initialise_sigmas(model, measure.split(4))
    states = surgery.scale_states(model)

    def forward():
        with torch.no_grad():
            out = model(input_ids=score, labels=score, output_hidden_states=True)
        return float(out.loss), torch.stack(out.hidden_states).norm(dim=-1)

    ce_real, baseline = forward()
    rows = [{"fixed": "nothing", "ce": ce_real, "max_residual_growth": 1.0}]
    for name, state in states.items():
        if name == "ln_f" or name.endswith("ln_1v"):
            continue
        group = [state] + ([states[name.replace("qk", "v")]] if name.endswith("ln_1qk") else [])
        for s in group:
            s.switch_to_fixed()
        ce, norms = forward()
        growth = (norms / baseline).nan_to_num(nan=float("inf")).amax()
        rows.append({"fixed": name.replace("ln_1qk", "ln_1"), "ce": ce, "max_residual_growth": float(growth)})
        for s in group:
            s.switch_to_real()
        print(f"{rows[-1]['fixed']:>16}: CE {ce:.3f}, largest residual growth ×{float(growth):.3g}", flush=True)
    return rows


def tables(result: dict) -> str:
    lines = ["| block | ln_1: position 0 / median | ln_2: position 0 / median | ln_1 fixed alone: CE, growth | "
             "ln_2 fixed alone: CE, growth |", "|---|---|---|---|---|"]
    ratios = {r["norm"]: r for r in result["position0_ratios"]}
    fixes = {r["fixed"]: r for r in result["single_fixes"]}
    n_layers = len(ratios) // 2
    for i in range(n_layers):
        cells = [f"{ratios[f'{i}.{k}']['position0_over_median']:.1f}×" for k in ("ln_1", "ln_2")]
        cells += [f"{fixes[f'blocks.{i}.{k}']['ce']:.2f}, ×{fixes[f'blocks.{i}.{k}']['max_residual_growth']:.3g}"
                  for k in ("ln_1", "ln_2")]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    c = result["census"]
    lines += ["", f"Massive activations (residual entering block {CENSUS_LAYER} > 10× the median) in {c['sequences']} "
              f"training sequences, by position: {c['massive_by_position']}; after position 0: "
              f"{', '.join(f'{k} ({v})' for k, v in c['examples_after_position_0']) or 'none'}.",
              f"CE with every norm real: {fixes['nothing']['ce']:.3f}.", "",
              "| norm | RMS at position 0 | median RMS elsewhere | largest channel at position 0: there / elsewhere |",
              "|---|---|---|---|"]
    lines += [f"| {r['norm']} | {r['rms_position0']:.1f} | {r['rms_median_other']:.1f} | {r['top_channel']}: "
              f"{r['top_channel_position0']:.0f} / {r['top_channel_other']:.1f} |" for r in result["position0_ratios"]]
    lines += ["", "Norm weights zeroed on position 0's largest channels (every norm real):", "",
              "| channels | norms | CE |", "|---|---|---|"]
    lines += [f"| {r['channels']} | {r['norms']} | {r['ce']:.3f} |" for r in result["muting"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/massive_activations"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_base("smollm2-135m")
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=16), tokenizer, 64,
                        model.config.vocab_size)
    held_out = data.eval_batch(16)
    step = max(1, len(data.train) // CENSUS_SEQUENCES)
    train = torch.from_numpy(data.train[::step][:CENSUS_SEQUENCES].astype("int64"))
    ratios = position0_ratios(model, held_out[:8])
    deep = [r for r in ratios if int(r["norm"].split(".")[0]) >= 12]
    channels = list(dict.fromkeys(r["top_channel"] for r in deep))
    result = {"position0_ratios": ratios, "census": census(model, tokenizer, train),
              "muting": muting(model, held_out[8:], (channels + [c for c in (247, 14, 100) if c not in channels])[:3])}
    result["single_fixes"] = single_fixes(model, tokenizer, held_out[:8], held_out[8:])
    write_experiment(result, tables(result), args.out)
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
