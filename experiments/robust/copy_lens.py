"""Where in the stack does a removal lose its copying? A logit lens over induction.py's repeated spans (issue 37).

    python experiments/robust/copy_lens.py MODEL... [--labels ...] [--rows 16] [--out FILE.md] [--json FILE.json]

The rows of induction.py's probe (BOS, 31 ids seen at least 20 times in the realtext training split, the same ids
again). For each model the residual stream after every block is read through the model's own final norm and
unembedding, after each block's attention sublayer and after the whole block, and the table gives the mean CE of the
id to copy over the repeat (after its first token): the sublayer at which the CE falls is where the copied id is
written. A model whose induction heads still attend to the right token (induction.py --heads) but whose CE never
falls there has lost what those heads write; one whose CE falls and rises again loses it to the blocks above.
A fixed final norm divides every residual by one σ, so a residual much smaller than the output's reads as a flat
distribution whatever it holds: --real-final reads each model's residuals through its final norm switched back to
real (each token divided by its own RMS), which compares models whose final norms differ.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# this folder's copying probe (run as a script, its folder is on the path)
from induction import MIN_COUNT, SPAN, load_probe, write_report
from lnfree.analysis.residual import residual_stream
from lnfree.arch import architecture


@torch.no_grad()
def lens_ce(model, ids: torch.Tensor, real_final: bool = False) -> torch.Tensor:
    """(2, blocks): mean CE of the id to copy over the repeat, read in each block after its attention sublayer (row
    0: the input of its MLP-input norm) and after the whole block (row 1; its last entry is the model's output).
    `real_final`: read through the final norm switched back to real where the model has fixed it."""
    arch = architecture(model)
    mlp_inputs = [model.get_submodule(site.module) for site in arch.sites() if site.stage == "ln_2"]
    after_attention: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda module, args: after_attention.append(args[0].detach()))
               for m in mlp_inputs]
    try:
        after_block = residual_stream(model, ids)[1:]  # after block 0 … after the last block
    finally:
        for handle in handles:
            handle.remove()
    final, head = model.get_submodule(arch.final_norm), model.get_output_embeddings()
    state = getattr(final, "state", None)  # lnfree's scale state; absent in a model with real norms only
    fraction = None
    if real_final and state is not None and (state.is_fixed or state.is_blending):
        fraction = state.fixed_fraction
        state.switch_to_real()
    queries = torch.arange(ids.shape[1] - SPAN, ids.shape[1] - 1)  # the repeat's tokens but its last, each predicting
    targets = ids[:, queries + 1]

    def ce(residual: torch.Tensor) -> torch.Tensor:
        logits = head(final(residual[:, queries])).float()
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets)

    try:
        return torch.stack([torch.stack([ce(r) for r in after_attention]), torch.stack([ce(r) for r in after_block])])
    finally:
        if fraction is not None:  # the model as it came
            state.set_fixed_fraction(fraction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="model names or checkpoint folders")
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-final", action="store_true", help="read through the final norm switched to real")
    parser.add_argument("--out", type=Path, help="the table, as markdown")
    parser.add_argument("--json", type=Path, help="the same numbers as JSON")
    args = parser.parse_args()
    loaded, _, _, ids = load_probe(args.models, args.labels, args.rows, SPAN, MIN_COUNT, args.seed)
    record = {}
    for model in loaded:
        attention, block = lens_ce(model.module.eval(), ids, args.real_final).tolist()
        record[model.label] = {"after_attention": attention, "after_block": block}
    blocks = len(block)
    lines = [f"Logit lens over {args.rows} repeated spans of {SPAN} ids (induction.py's rows, seed {args.seed}): mean "
             "CE (nats) of the id to copy over the repeat, the residual in block b after its attention sublayer "
             "(attn) and after the whole block (out) read through the model's own final norm"
             + (" switched to real (each token divided by its own RMS)" if args.real_final else "")
             + " and unembedding (the last column is the model's output"
             + (" with that final norm)" if args.real_final else ")"), "",
             "| model | read | " + " | ".join(str(b) for b in range(blocks)) + " |", "|" + "---|" * (blocks + 2)]
    reads = (("attn", "after_attention"), ("out", "after_block"))
    lines += [f"| {label} | {read} | " + " | ".join(f"{v:.2f}" for v in values[key]) + " |"
              for label, values in record.items() for read, key in reads]
    write_report("\n".join(lines) + "\n", record, args.out, args.json)


if __name__ == "__main__":
    main()
