"""Block 0's input norm folded into SmolLM2-135M's embedding table: what it costs, and whether the ln_2 runaway
starts later, without any fine-tuning.

    python experiments/smollm2/embedding_fold.py [--out experiments/results/smollm2-135m/embedding_fold]

The residual entering block 0 is the token's embedding alone, so block 0's input norm divides each token by the
RMS of its own embedding row. Rescaling every row to the median row RMS (the head untied, keeping the original
table) makes that division one constant, so block 0's ln_1 becomes exactly a fixed scale; the cost is that the
residual stream now carries the rescaled rows. SmolLM2's rows span 0.57–2.38× the median RMS, and a large
embedding leaves block 0's gated MLP several times the typical token (`local_growth/`), where the bottom-up
runaway starts. This measures, on the first 16 × 64 validation sequences: the held-out CE of the folded model
with every norm real, and the bottom-up ln_2 sweep of `ln2_runaway_probe.py` on the original and on the folded
model (σ measured on the model swept). Writes results.json and tables.md to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ln2_runaway_probe import forward, sweep, table  # this folder's probe (run as a script, its folder is on the path)
from lnfree.data.documents import prepare_data
from lnfree.fixedscale import surgery
from lnfree.models.base import load_base
from lnfree.removal.config import DataConfig
from lnfree.evaluate.results import write_experiment


def fold_embedding(model) -> dict:
    """Every input-embedding row rescaled to the median row RMS; the head untied and left as it was."""
    table_ = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is table_:
        head = torch.nn.Linear(table_.shape[1], table_.shape[0], bias=False)
        head.weight = torch.nn.Parameter(table_.detach().clone())
        model.set_output_embeddings(head)
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        rms = table_.pow(2).mean(-1).sqrt()
        median = rms.median()
        table_.mul_((median / rms).unsqueeze(-1))
    ratio = rms / median
    return {"row_rms_over_median": [float(ratio.min()), float(ratio.max())], "rows_above_2": int((ratio > 2).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/smollm2-135m/embedding_fold"))
    parser.add_argument("--n-sequences", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    results, lines = {"sweeps": {}}, ["# SmolLM2-135M: block 0's input norm folded into the embedding", "",
                                       "By `experiments/smollm2/embedding_fold.py` (no fine-tuning).", ""]
    for name in ("original", "folded"):
        model, tokenizer = load_base("smollm2-135m")
        model.eval()
        tokens = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=args.n_sequences),
                              tokenizer, 64, model.config.vocab_size).eval_batch(args.n_sequences)
        if name == "folded":
            results["fold"] = fold_embedding(model)
        surgery.install(model, special_pos0=True, eot_token_id=tokenizer.eos_token_id)
        surgery.initialise_sigmas(model, tokens.split(4))
        for state in surgery.scale_states(model).values():
            state.switch_to_real()
        results[f"ce_{name}"] = forward(model, tokens)[0]
        print(f"{name}: held-out CE, every norm real {results[f'ce_{name}']:.4f}", flush=True)
        n_layers = sum(1 for key in surgery.scale_states(model) if key.endswith(".ln_2"))
        rows = sweep(model, tokens, tokenizer, list(range(n_layers)))
        results["sweeps"][name] = rows
        lines += [f"## {name} (held-out CE, every norm real: {results[f'ce_{name}']:.4f}), ln_2 fixed bottom-up", "",
                  *table(rows), ""]
    write_experiment(results, lines, args.out)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
