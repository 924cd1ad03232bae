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

from lnfree import surgery
from lnfree.config import DataConfig
from lnfree.data import prepare_data
from lnfree.models import load_base


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

    def ce() -> float:
        with torch.no_grad():
            return float(model(input_ids=score, labels=score).loss)

    curve = [{"fixed": "nothing", "ce": ce()}]
    n_layers = sum(1 for name in states if name.endswith(".ln_2"))
    order = [[f"blocks.{i}.ln_2"] for i in range(n_layers)]
    order += [[f"blocks.{i}.ln_1qk", f"blocks.{i}.ln_1v"] for i in range(n_layers)]
    order += [["ln_f"]]
    for slots in order:
        for slot in slots:
            states[slot].switch_to_fake()
        curve.append({"fixed": "+".join(slots), "ce": ce()})
        print(f"{curve[-1]['fixed']:>32}: CE {curve[-1]['ce']:.3f}", flush=True)
    for state in states.values():
        state.disable_special("pos0")
    curve.append({"fixed": "position 0's own σ off", "ce": ce()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"scored_tokens": score.shape[0] * (score.shape[1] - 1), "curve": curve}, indent=1))
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
