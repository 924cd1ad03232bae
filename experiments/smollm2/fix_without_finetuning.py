"""How far can SmolLM2-135M's norms be fixed without any fine-tuning? Held-out CE as they are fixed in schedule order.

    python experiments/smollm2/fix_without_finetuning.py [--out experiments/results/smollm2-135m/fix_without_finetuning.json]

σ is measured on held-out Django documentation (position 0 with its own σ, as in `cpu.toml`), then
the norms are fixed one at a time in the schedule's order (every ln_2 from block 0 up, then every
ln_1 with both paths, then the final norm, then position 0's own σ off) and the CE of 8 × 64 held-out
tokens is recorded after each. Tells whether a removal run has to repair the model after every single
switch or can ride on a mostly intact model (GPT-2's case).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lnfree.fixedscale import surgery
from lnfree.removal.config import DataConfig
from lnfree.data.documents import prepare_data
from lnfree.models.base import load_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/fix_without_finetuning.json"))
    args = parser.parse_args()
    model, tokenizer = load_base("smollm2-135m")
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=16), tokenizer, 64,
                        model.config.vocab_size)
    tokens = data.eval_batch(16)
    measure, score = tokens[:8], tokens[8:]
    surgery.install(model, special_pos0=True, eot_token_id=tokenizer.eos_token_id)
    surgery.initialise_sigmas(model, measure.split(4))
    states = surgery.scale_states(model)

    def forward() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            out = model(input_ids=score, labels=score, output_hidden_states=True)
        return float(out.loss), torch.stack(out.hidden_states).norm(dim=-1)  # [layers + 1, batch, pos]

    def point(fixed: str) -> dict:
        loss, norms = forward()
        ratio = (norms / baseline).nan_to_num(nan=float("inf")).amax(dim=0).flatten()  # worst layer per token
        worst = int(ratio.argmax())
        return {"fixed": fixed, "ce": loss, "max_residual_growth": float(ratio[worst]),
                "position": worst % score.shape[1], "token": tokenizer.decode(score.flatten()[worst]),
                "token_norm_all_real": float(baseline.amax(dim=0).flatten()[worst]),
                "median_norm_all_real": float(baseline.amax(dim=0).median())}

    _, baseline = forward()
    curve = [point("nothing")]
    n_layers = sum(1 for name in states if name.endswith(".ln_2"))
    order = [[f"blocks.{i}.ln_2"] for i in range(n_layers)]
    order += [[f"blocks.{i}.ln_1qk", f"blocks.{i}.ln_1v"] for i in range(n_layers)]
    order += [["ln_f"]]
    for slots in order:
        for slot in slots:
            states[slot].switch_to_fixed()
        curve.append(point("+".join(slots)))
        p = curve[-1]
        print(f"{p['fixed']:>32}: CE {p['ce']:.3f}, residual ×{p['max_residual_growth']:.3g} at position "
              f"{p['position']} ({p['token']!r}, all-real norm {p['token_norm_all_real']:.0f}, median "
              f"{p['median_norm_all_real']:.0f})", flush=True)
    for state in states.values():
        state.disable_special("pos0")
    curve.append(point("position 0's own σ off"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"scored_tokens": score.shape[0] * (score.shape[1] - 1), "curve": curve}, indent=1))
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
