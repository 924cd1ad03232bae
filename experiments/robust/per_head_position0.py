"""Does position 0 make Gemma's key norms expensive to fix? Without fine-tuning, on validation sequences.

    python experiments/robust/per_head_position0.py [--model gemma3-270m] [--out FILE]

For every per-head norm (q_norm, k_norm) of the original: position 0's per-head input scale over the median of
the other tokens', their spread (coefficient of variation) and their largest over the median; then the CE with
every k_norm (or q_norm) fixed at one σ per layer, three ways: σ over all tokens, σ over the tokens after
position 0, and σ over those with position 0 kept at its own scale (what `removal.special_pos0_per_head`
gives a run until its position-0 σ fades); the last two again with one σ per head (a per-head σ folds into the
producing projection's rows as exactly as one σ per layer does); position 0's own scale folded into k_proj by a
rank-one edit instead (`fold_table`); and each k_norm fixed alone. σ is measured on 16 validation sequences, the CE
on 16 others.
Writes a text table (default experiments/results/<model>/robust/per_head_position0.txt).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from lnfree.arch import architecture
from lnfree.data.documents import bos_token, prepare_data
from lnfree.models.base import load_base
from lnfree.removal.config import DataConfig


class Probe(nn.Module):
    """A per-head norm that records its input scales ("measure"), or divides by a fixed σ ("fixed"),
    optionally leaving position 0 at its own scale ("fixed, position 0 at its own scale")."""

    def __init__(self, norm: nn.Module, heads_axis: int):
        super().__init__()
        self.norm, self.mode, self.sigma = norm, "real", 1.0
        self.positions_axis = 2 if heads_axis == 1 else 1  # (batch, heads, positions) or (batch, positions, heads)
        self.scales: list[torch.Tensor] = []  # (batch, positions, heads)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.norm(h)
        scale = (h.float().pow(2).mean(-1, keepdim=True) + self.norm.eps).sqrt()
        if self.mode == "measure":
            self.scales.append(scale.squeeze(-1).movedim(self.positions_axis, 1))
        if self.mode in ("real", "measure"):
            return out
        sigma = self.sigma
        if isinstance(sigma, torch.Tensor):  # one per head, along the heads' axis
            shape = [1] * scale.dim()
            shape[1 if self.positions_axis == 2 else 2] = -1
            sigma = sigma.view(shape)
        factor = scale / sigma
        if self.mode == "fixed, position 0 at its own scale":
            factor.select(self.positions_axis, 0).fill_(1.0)
        return (out.float() * factor).to(out.dtype)


def fold_table(model, probes, bos_inputs, ce, base, whiten: bool) -> list[str]:
    """Every k_norm fixed at σ over positions ≥ 1, with position 0's own scale folded into k_proj instead of
    divided by: k_proj += (r − 1)·k_proj·u·dᵀ/(dᵀu), u = BOS's input to k_proj (one vector per layer in BOS-led
    text), r = σ / BOS's key scale, d = u (or C⁻¹u with `whiten`, C the other tokens' second moment), so BOS's
    fixed key is its real one exactly and another token x's moves by (r − 1)·k_proj·u·(dᵀx)/(dᵀu). The table's
    line (with `whiten`, also how far BOS's input varies over the measured sequences)."""
    lines, saved, spread = [], {}, []
    for (kind, layer), probe in probes.items():
        if kind != "k_norm":
            continue
        x = bos_inputs[layer]
        u = x[:, 0]
        spread.append(float((u - u[0]).norm(dim=-1).max() / u[0].norm()))
        u, others = u[0], x[:, 1:].reshape(-1, x.shape[-1])
        direction = u
        if whiten:  # the edit that moves the other tokens' keys least: (C⁻¹u) with C their second moment
            c = others.T @ others / len(others)
            c += 1e-3 * c.diagonal().mean() * torch.eye(len(c))
            direction = torch.linalg.solve(c, u)
        k_proj = model.get_submodule(f"{architecture(model).layers}.{layer}.self_attn.k_proj")
        saved[layer] = k_proj.weight.detach().clone()
        with torch.no_grad():
            key = k_proj.weight.float() @ u
            r = probe.sigma_rest / float(key.pow(2).mean().add(probe.norm.eps).sqrt())
            k_proj.weight += ((r - 1) * torch.outer(key, direction) / direction.dot(u)).to(k_proj.weight.dtype)
        probe.mode, probe.sigma = "fixed", probe.sigma_rest
    folded = ce()
    for (kind, layer), probe in probes.items():
        if kind == "k_norm":
            probe.mode = "real"
            model.get_submodule(f"{architecture(model).layers}.{layer}.self_attn.k_proj").weight.data.copy_(saved[layer])
    how = "along C⁻¹u" if whiten else "along u"
    lines.append(f"| every k_norm fixed, position 0 folded into k_proj {how} | positions ≥ 1 | {folded:.4f} | "
                 f"{folded - base:+.4f} |")
    if whiten:
        lines += ["", f"BOS's input to k_proj over the measured sequences: largest deviation {max(spread):.1e} of its norm."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path("experiments/results") / args.model / "robust" / "per_head_position0.txt"
    model, tokenizer = load_base(args.model)
    model.eval()
    data = prepare_data(DataConfig(source="realtext", context_length=64, eval_sequences=32), tokenizer, 64,
                        model.config.vocab_size, bos_token(model, tokenizer))
    tokens = data.eval_batch(32)
    measure, score = tokens[:16], tokens[16:]
    probes = {}
    for site in architecture(model).sites():
        if site.per_head:
            probes[(site.stage, site.layer)] = probe = Probe(model.get_submodule(site.module), site.heads_axis)
            model.set_submodule(site.module, probe)

    def ce() -> float:
        with torch.no_grad():
            return float(model(input_ids=score, labels=score).loss)

    bos_inputs = {}  # layer → k_proj's input at position 0 on every measured sequence (BOS-led: one vector)
    hooks = [model.get_submodule(site.module.rsplit(".", 1)[0] + ".k_proj").register_forward_pre_hook(
        lambda m, args, layer=site.layer: bos_inputs.update({layer: args[0].detach().float().clone()}))
        for site in architecture(model).sites() if site.stage == "k_norm"]
    for probe in probes.values():
        probe.mode = "measure"
    with torch.no_grad():
        model(input_ids=measure)
    for hook in hooks:
        hook.remove()
    lines = [f"# {args.model}: position 0 at the per-head norms, without fine-tuning ({score.numel() - len(score)} "
             "validation tokens scored)", "", "Per layer: position 0's input scale / the median other token's, "
             "the other tokens' coefficient of variation, their largest / median.", ""]
    for stage in ("k_norm", "q_norm"):
        row = []
        for (kind, layer), probe in probes.items():
            if kind == stage:
                scales = torch.cat(probe.scales)  # (batch, positions, heads)
                others = scales[:, 1:]
                median = others.median()
                row.append(f"{layer}: {float(scales[:, 0].mean() / median):.2f} / {float(others.std() / others.mean()):.2f}"
                           f" / {float(others.max() / median):.1f}")
                probe.sigma_all, probe.sigma_rest = float(scales.mean()), float(others.mean())
                probe.sigma_rest_per_head = others.mean((0, 1))
        lines += [f"{stage}: " + ", ".join(row), ""]
    for probe in probes.values():
        probe.mode = "real"
    base = ce()
    lines += ["| fixed | σ over | CE | Δ CE |", "|---|---|---|---|", f"| nothing (the original) | — | {base:.4f} | — |"]
    for stage in ("k_norm", "q_norm"):
        for mode, over in (("fixed", "sigma_all"), ("fixed", "sigma_rest"), ("fixed, position 0 at its own scale", "sigma_rest"),
                           ("fixed", "sigma_rest_per_head"), ("fixed, position 0 at its own scale", "sigma_rest_per_head")):
            for (kind, _), probe in probes.items():
                probe.mode, probe.sigma = ("real", 1.0) if kind != stage else (mode, getattr(probe, over))
            value = ce()
            name = {"sigma_all": "all tokens", "sigma_rest": "positions ≥ 1"}.get(over, "positions ≥ 1, per head")
            lines.append(f"| every {stage} {mode} | {name} | {value:.4f} | {value - base:+.4f} |")
        for probe in probes.values():
            probe.mode = "real"
    lines += fold_table(model, probes, bos_inputs, ce, base, whiten=False)
    lines += fold_table(model, probes, bos_inputs, ce, base, whiten=True)
    lines += ["", "Each k_norm fixed alone (σ over positions ≥ 1): Δ CE, and with position 0 at its own scale.", "",
              "| layer | Δ CE | position 0 at its own scale |", "|---|---|---|"]
    for (kind, layer), probe in probes.items():
        if kind == "k_norm":
            costs = []
            for mode in ("fixed", "fixed, position 0 at its own scale"):
                probe.mode, probe.sigma = mode, probe.sigma_rest
                costs.append(ce() - base)
            probe.mode = "real"
            lines.append(f"| {layer} | {costs[0]:+.4f} | {costs[1]:+.4f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
