"""Mean ablation of entropy-neuron candidates: dataset-mean activations, batched ablation runs, and
the ablation sets :func:`lnfree.analysis.entropy_neurons.run.run` applies.

Ablations are batched: the clean run and every ablation set are stacked along the batch dimension
(up to ``batch_tokens`` tokens per forward pass, fewer where their logits would pass
`lnfree.analysis.common.LOGITS_BUDGET`), each row with its own replacement, applied by one forward
hook per layer. The per-token statistics are computed a few positions at a time (`STATS_BUDGET`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lnfree.errors import UsageError
from lnfree.analysis.common import logit_rows
from lnfree.analysis.entropy_neurons.candidates import Neuron, neuron_label
from lnfree.forms.bridge import LAST_POSITION_LOGITS, hook_name
from lnfree.evaluate import token_statistics

#: Vocabulary-wide values per slice of the per-token statistics: 2**22 (32 MB in float64 for each of
#: their few temporaries), i.e. 16 positions of Gemma 3's 262,144-token vocabulary, 83 of GPT-2's.
STATS_BUDGET = 2**22


class AblationSets(NamedTuple):
    """The ablation sets of a neuron list, their names (``"11.584"``, ``"top-2"``) and kinds."""

    sets: list[list[Neuron]]
    names: list[str]
    kinds: list[str]


def ablation_sets(neurons: Sequence[Neuron]) -> AblationSets:
    """Each neuron alone, then cumulatively (the first 2, 3, ... of the list together; "top-1" is
    the first single ablation)."""
    singles = [[n] for n in neurons]
    cumulative = [list(neurons[:i]) for i in range(2, len(neurons) + 1)]
    names = [neuron_label(n) for n in neurons] + [f"top-{i}" for i in range(2, len(neurons) + 1)]
    return AblationSets(singles + cumulative, names, ["single"] * len(singles) + ["cumulative"] * len(cumulative))


def _row_chunks(n_rows: int, rows_per_forward: int):
    for start in range(0, n_rows, rows_per_forward):
        yield start, min(start + rows_per_forward, n_rows)


@torch.no_grad()
def mean_activations(
    bridge: Any, tokens: torch.Tensor, layers: Sequence[int], *, batch_tokens: int = 4096,
) -> dict[int, torch.Tensor]:
    """Dataset-mean MLP activation (``mlp.hook_post``) per layer: ``{layer: [d_mlp] float64}``,
    averaged over every token position of ``tokens [batch, pos]`` (no logits are read: the
    unembedding sees only the last position)."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    layers = sorted({int(layer) for layer in layers})
    sums = {layer: None for layer in layers}
    count = 0

    def accumulate(layer: int):
        def fn(activation: torch.Tensor, hook: Any) -> None:
            total = activation.detach().to(torch.float64).sum(dim=(0, 1)).cpu()
            sums[layer] = total if sums[layer] is None else sums[layer] + total

        return fn

    device = bridge.cfg.device
    rows = max(1, batch_tokens // tokens.shape[1])
    hooks = [*((hook_name("mlp_post", layer), accumulate(layer)) for layer in layers), LAST_POSITION_LOGITS]
    with bridge.hooks(fwd_hooks=hooks):
        for start, stop in _row_chunks(tokens.shape[0], rows):
            bridge(tokens[start:stop].to(device), return_type="logits")
            count += (stop - start) * tokens.shape[1]
    missing = [layer for layer in layers if sums[layer] is None]
    if missing:  # pragma: no cover - guards a TL behaviour change
        raise RuntimeError(f"mlp.hook_post did not fire for layers {missing}")
    return {layer: sums[layer] / count for layer in layers}


@dataclass
class AblationEffects:
    """Per-token output entropy and next-token CE, clean and under each ablation set (float64, nats).

    ``entropy [batch, pos]``, ``ce [batch, pos-1]`` (CE of predicting token t+1 at position t);
    ``ablated_entropy [n_sets, batch, pos]``, ``ablated_ce [n_sets, batch, pos-1]``.
    """

    ablations: list[list[Neuron]]
    entropy: torch.Tensor
    ce: torch.Tensor
    ablated_entropy: torch.Tensor
    ablated_ce: torch.Tensor

    @property
    def delta_entropy(self) -> torch.Tensor:
        """``H(ablated) - H(clean)`` per set and token ``[n_sets, batch, pos]``."""
        return self.ablated_entropy - self.entropy

    @property
    def delta_ce(self) -> torch.Tensor:
        """``CE(ablated) - CE(clean)`` per set and token ``[n_sets, batch, pos-1]``."""
        return self.ablated_ce - self.ce


def _token_stats(
    logits: torch.Tensor, ids: torch.Tensor, slice_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy ``[rows, pos]`` and next-token CE ``[rows, pos-1]``, in float64, ``slice_tokens`` at a time
    (default: as many as `STATS_BUDGET` allows, at most 512; each token's numbers are its own)."""
    rows, n_pos, vocab = logits.shape
    slice_tokens = slice_tokens or max(1, min(512, STATS_BUDGET // vocab))
    flat = logits.reshape(rows * n_pos, vocab)
    # Target of position t is token t+1; the last position of each row has none (dropped below).
    targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).reshape(-1).to(logits.device)
    entropy = torch.empty(rows * n_pos, dtype=torch.float64)
    ce = torch.empty(rows * n_pos, dtype=torch.float64)
    for start in range(0, rows * n_pos, slice_tokens):
        stop = start + slice_tokens
        stats, _ = token_statistics(flat[start:stop], targets[start:stop], dtype=torch.float64)
        entropy[start:stop] = stats["entropy"].cpu()
        ce[start:stop] = stats["ce"].cpu()
    return entropy.view(rows, n_pos), ce.view(rows, n_pos)[:, :-1]


@torch.no_grad()
def ablation_effects(
    bridge: Any,
    tokens: torch.Tensor,
    ablations: Sequence[Sequence[Neuron]],
    means: Mapping[int, torch.Tensor] | None = None,
    *,
    batch_tokens: int = 4096,
) -> AblationEffects:
    """Mean-ablate each set of neurons (``[(layer, neuron), ...]``, any layers) and measure per token.

    Each set replaces its neurons' ``mlp.hook_post`` activations by ``means[layer][neuron]`` (default:
    :func:`mean_activations` over ``tokens``) at every position.  The clean run and all sets are
    stacked along the batch dimension: each forward pass holds up to ``batch_tokens`` tokens
    (at least one sequence), rows belonging to different sets, each modified by its own
    hook-applied replacement; fewer rows where their logits would pass
    `lnfree.analysis.common.LOGITS_BUDGET` (at least one sequence).
    """
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_seq, n_pos = tokens.shape
    sets = [[(int(layer), int(neuron)) for layer, neuron in s] for s in ablations]
    d_mlp = bridge.cfg.d_mlp
    for s in sets:
        for layer, neuron in s:
            if not (0 <= layer < bridge.cfg.n_layers and 0 <= neuron < d_mlp):
                raise UsageError(f"no neuron {neuron_label((layer, neuron))} in a {bridge.cfg.n_layers}×{d_mlp} MLP")
    layers = sorted({layer for s in sets for layer, _ in s})
    if means is None:
        means = mean_activations(bridge, tokens, layers, batch_tokens=batch_tokens)
    all_sets = [[]] + sets  # index 0: the clean run
    work = [(set_index, seq) for set_index in range(len(all_sets)) for seq in range(n_seq)]
    entropy = torch.empty(len(all_sets), n_seq, n_pos, dtype=torch.float64)
    ce = torch.empty(len(all_sets), n_seq, n_pos - 1, dtype=torch.float64)
    device = bridge.cfg.device
    rows_per_forward = logit_rows(n_pos, bridge.cfg.d_vocab, max(1, batch_tokens // n_pos))

    for start, stop in _row_chunks(len(work), rows_per_forward):
        chunk = work[start:stop]
        set_idx = torch.tensor([s for s, _ in chunk])
        seq_idx = torch.tensor([q for _, q in chunk])
        replacements: dict[int, tuple[list[int], list[int], list[float]]] = {}
        for row, (s, _) in enumerate(chunk):
            for layer, neuron in all_sets[s]:
                rows, neurons, values = replacements.setdefault(layer, ([], [], []))
                rows.append(row)
                neurons.append(neuron)
                values.append(float(means[layer][neuron]))

        def replace(rows: list[int], neurons: list[int], values: list[float]):
            def fn(activation: torch.Tensor, hook: Any) -> torch.Tensor:
                activation = activation.clone()
                value = torch.tensor(values, dtype=activation.dtype, device=activation.device)
                activation[torch.tensor(rows, device=activation.device), :,
                           torch.tensor(neurons, device=activation.device)] = value[:, None]
                return activation

            return fn

        hooks = [(hook_name("mlp_post", layer), replace(*spec)) for layer, spec in replacements.items()]
        ids = tokens[seq_idx].to(device)
        with bridge.hooks(fwd_hooks=hooks):
            logits = bridge(ids, return_type="logits")
        h, c = _token_stats(logits, ids)
        del logits  # before the next forward pass makes its own
        entropy[set_idx, seq_idx] = h
        ce[set_idx, seq_idx] = c

    return AblationEffects(ablations=sets, entropy=entropy[0], ce=ce[0], ablated_entropy=entropy[1:],
                           ablated_ce=ce[1:])
