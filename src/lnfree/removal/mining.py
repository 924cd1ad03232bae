"""Which token ids run away when repeated: a short repeated-id sweep over (part of) a vocabulary.

`lnfree stress` probes a few hundred repeated ids at the full context with every logit; a 262,144-id
vocabulary would take hours that way. Most runaways on a repeated id show within a few repeats (on the
Gemma 3 270M LN-free checkpoints measured, most ids that overflow at 64 tokens already do at 6–8), and
the overflow measure reads only the residual stream, so this sweep runs BOS and the id repeated to a
short context through the model without its head's product (Gemma's 640 × 262,144 unembedding is most of
its forward) and records per id its largest residual norm over the model's *envelope* (per layer, the
largest norm it reaches on real text; inf where a value is non-finite). An id overflows above
`OVERFLOW_RATIO`, as in `lnfree stress`.

An id can also run away among other ids without doing so when repeated (Gemma 3 270M's LN-free model of
the one-command run: place names such as ' Toronto' and ' Zürich' in random rows, through neurons that
fire 5-30× their range on them in the original; `experiments/robust/sweep_neurons.py`). `Mining.random`
adds a sweep of the part in rows of random ids, each id once, as `lnfree stress`'s vocabulary sweep but
in an order of its own: each row that overflows gives the id of its first overflowing token.

Some ids run away only late in a long repeated row (past position 16 on those checkpoints, about 0.3 % of the
ids of one of them), where the short rows miss them. Down such a row BOS's share of the attention shrinks and
each copy tends to the id attending to itself only, the state of a one-token row. On one LN-free Gemma checkpoint
the late runaway that `lnfree stress` found runs away alone too, and 20 of the 256 ids worst alone run away late
against none of 256 others. `Mining.alone` adds that one-token sweep (an eighth of the repeated sweep's tokens)
and mines the ids that overflow alone; it singles them out only once position 0 has been trained alone
(`Coverage.first_token_rows`): before that, on the same run's step 1400, 208,424 of the 262,144 ids overflowed alone.
`Mining.repeated = False` leaves the repeated sweep out, for a later setting that mines alone only.

During a removal, `train.coverage.mine` (`Mining`) runs such a sweep when its coverage setting starts
and replays the ids it finds (`lnfree.removal.losses.coverage`); `experiments/robust/mine_repeated.py`
runs it on a saved model.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lnfree.arch import architecture
from lnfree.removal.losses.vocab_loss import HeadInput

#: A residual norm this many times the model's own envelope at that layer is an overflow.
OVERFLOW_RATIO = 10.0
#: Tokens per swept row (BOS included): long enough for the runaways seen at 64 tokens.
SWEEP_CONTEXT = 8
#: Tokens per row of random ids (BOS included), as `lnfree stress`'s default context.
RANDOM_CONTEXT = 64
#: Mixes into the seed of the random rows' order, so that they are never `lnfree stress`'s sweep rows.
_RANDOM_STREAM = 104729


class Mining(BaseModel):
    """A repeated-id sweep of one part of the vocabulary when a coverage setting starts (`train.coverage.mine`)."""

    model_config = ConfigDict(extra="forbid")
    part: int = Field(0, ge=0, description="which part of the vocabulary to sweep")
    repeated: bool = Field(True, description="sweep the part in repeated rows (false: only the sweeps below that are on)")
    of: int = Field(4, ge=1, description="the vocabulary cut into this many parts (a permutation seeded by train.seed)")
    context: int = Field(SWEEP_CONTEXT, ge=2, description="tokens per swept row, BOS included")
    batch_size: int = Field(256, ge=1, description="rows per forward pass")
    random: bool = Field(False, description="also sweep the part in rows of random ids (each id once, in an order "
                         "seeded apart from lnfree stress's sweep): the first overflowing id of each row is mined too")
    random_context: int = Field(RANDOM_CONTEXT, ge=2, description="tokens per row of random ids, BOS included")
    alone: bool = Field(False, description="also sweep the part as one-token rows, each id alone at position 0 (the "
                        "first token of an input without BOS): an id that overflows there is mined too. The ids that "
                        "run away only late in a long repeated row, past this sweep's short rows, are among them; a "
                        "sweep before position 0 is trained alone (coverage.first_token_rows) finds most of the vocabulary")
    earlier: bool = Field(True, description="replay the ids that earlier settings mined too; false: only the ids "
                          "this sweep finds, so that the setting's replayed rows concentrate on those still running away")

    @model_validator(mode="after")
    def _part_of_the_parts(self):
        if self.part >= self.of:  # caught when the config loads, not hours later when the sweep starts
            raise ValueError(f"mine.part {self.part} of {self.of}: must be below `of`")
        if not (self.repeated or self.random or self.alone):
            raise ValueError("mine sweeps nothing: set repeated, random or alone")
        return self


@torch.no_grad()
def residual_stream(model: torch.nn.Module, ids: torch.Tensor, *, head: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual stream [n_layers + 1, n, T, d]: the input of every block and of the final norm, logits
    [n, T, V] as fp32) of one forward of a transformers model; without `head`, no logits (the head computes no
    product at all: `HeadInput.skipping`). The forward is the whole model's, whose hook sets the positions that
    special σ read."""
    arch = architecture(model)
    captured: list[torch.Tensor] = []
    final = model.get_submodule(arch.final_norm)
    handle = final.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        with nullcontext() if head else HeadInput(model, arch, for_loss=False).skipping():
            out = model(input_ids=ids.to(next(model.parameters()).device), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:  # pragma: no cover - guards a transformers behaviour change
        raise RuntimeError(f"the final norm ran {len(captured)} times in one forward")
    stream = torch.stack([*out.hidden_states[:arch.n_layers], captured[0]])
    return stream, out.logits.float() if head else None


def residual_norms(stream: torch.Tensor) -> torch.Tensor:
    """The L2 norms of a residual stream [..., d] on the CPU, inf where non-finite."""
    norms = torch.linalg.vector_norm(stream.float(), dim=-1).cpu()
    return torch.where(norms.isfinite(), norms, torch.full_like(norms, math.inf))


def repeated_sequences(ids: np.ndarray, context: int, bos: int | None) -> torch.Tensor:
    """One row per id: BOS (if any) then the id repeated to `context` tokens."""
    rows = torch.as_tensor(ids, dtype=torch.long)[:, None].repeat(1, context)
    if bos is not None:
        rows[:, 0] = bos
    return rows


def random_rows(order: np.ndarray, context: int, bos: int | None) -> torch.Tensor:
    """The ids of `order` cut into rows of `context` tokens after BOS (if any), the last row filled up with
    ids from the start of the order."""
    width = context - (bos is not None)
    rows = torch.as_tensor(np.resize(order, -(-len(order) // width) * width).reshape(-1, width), dtype=torch.long)
    if bos is not None:
        rows = torch.cat([torch.full((len(rows), 1), bos, dtype=torch.long), rows], dim=1)
    return rows


def vocabulary_part(vocab_size: int, parts: list[int], of: int, seed: int) -> np.ndarray:
    """Parts `parts` of a seeded permutation of the vocabulary cut into `of` near-equal parts."""
    if not all(0 <= k < of for k in parts):
        raise ValueError(f"parts {parts} of {of}: each must be in 0..{of - 1}")
    chunks = np.array_split(np.random.default_rng(seed).permutation(vocab_size), of)
    return np.concatenate([chunks[k] for k in parts])


def text_envelope(model: torch.nn.Module, ids: torch.Tensor, *, batch_size: int = 8, bf16: bool = False) -> torch.Tensor:
    """Per layer, the largest residual norm over the rows of real text `ids` whose norms are all finite
    (the body only: `lnfree stress` also leaves out rows with a token above 30 nats)."""
    norms = torch.cat([_norms(model, rows, bf16) for rows in ids.split(batch_size)], dim=1)
    sane = norms.isfinite().all(dim=0).all(dim=1)
    return norms[:, sane].flatten(1).amax(dim=1) if sane.any() else torch.zeros(norms.shape[0])


def repeated_sweep(model: torch.nn.Module, ids: torch.Tensor, limits: torch.Tensor, *, bos: int | None,
                   context: int = SWEEP_CONTEXT, batch_size: int = 256, bf16: bool = False,
                   progress=None) -> torch.Tensor:
    """Per id of `ids`, the largest residual norm over `limits` (one per layer) of BOS and the id repeated
    to `context` tokens: inf where a value is non-finite. `bf16`: under bf16 autocast (the same verdicts
    on the checkpoints measured, about 2× faster on a CPU with native bf16)."""
    worst = []
    for start in range(0, len(ids), batch_size):
        rows = repeated_sequences(ids[start:start + batch_size].numpy(), context, bos)
        worst.append((_norms(model, rows, bf16) / limits.clamp_min(1e-30)[:, None, None]).amax(dim=(0, 2)))
        if progress is not None:
            progress.update(len(rows))
    return torch.cat(worst) if worst else torch.zeros(0)


def alone_sweep(model: torch.nn.Module, ids: torch.Tensor, limits: torch.Tensor, *, batch_size: int = 256,
                bf16: bool = False) -> torch.Tensor:
    """Per id of `ids`, the largest residual norm over `limits` of the id alone in a one-token row (position 0
    with nothing before it, so it attends to itself only): inf where a value is non-finite. A row of BOS and
    one id repeated tends to this state as BOS's share of the attention shrinks down the row."""
    rows = ids.reshape(-1, 1)
    worst = [(_norms(model, batch, bf16) / limits.clamp_min(1e-30)[:, None, None]).amax(dim=(0, 2))
             for batch in rows.split(batch_size * SWEEP_CONTEXT)]  # as many tokens a forward as a repeated batch
    return torch.cat(worst) if worst else torch.zeros(0)


def random_order(ids: np.ndarray, seed: int) -> np.ndarray:
    """`ids` shuffled by `seed` in a stream of their own (never `lnfree stress`'s order for the same seed)."""
    return np.random.default_rng([seed, _RANDOM_STREAM]).permutation(ids)


def random_sweep(model: torch.nn.Module, ids: np.ndarray, limits: torch.Tensor, *, bos: int | None, seed: int,
                 context: int = RANDOM_CONTEXT, batch_size: int = 256, bf16: bool = False) -> list[int]:
    """The ids of `ids` that first overflow in their row, one per overflowing row (worst row first), when
    they are shuffled by `seed` (apart from `lnfree stress`'s order) and cut into rows of random ids."""
    rows = random_rows(random_order(ids, seed), context, bos)
    found: list[tuple[float, int]] = []
    for batch in rows.split(max(1, batch_size * SWEEP_CONTEXT // context)):
        ratio = (_norms(model, batch, bf16) / limits.clamp_min(1e-30)[:, None, None]).amax(dim=0)  # (rows, T)
        over = ratio > OVERFLOW_RATIO
        bad = over.any(dim=1)
        first, worst = over[bad].float().argmax(dim=1), ratio[bad].amax(dim=1)
        found += [(float(w), int(row[f])) for row, f, w in zip(batch[bad], first, worst)]
    return list(dict.fromkeys(i for _, i in sorted(found, key=lambda f: -f[0])))


def _norms(model: torch.nn.Module, rows: torch.Tensor, bf16: bool) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
        stream, _ = residual_stream(model, rows, head=False)
    return residual_norms(stream)


class Found(NamedTuple):
    """What one process's sweep of a part found."""

    repeated: list[int]  # ids that overflow when repeated, worst first
    random: list[int]  # the first overflowing id of each row of random ids that overflows (`Mining.random`)
    swept: int  # ids this process swept
    alone: list[int] = []  # ids that overflow alone at position 0, worst first (`Mining.alone`)

    @property
    def ids(self) -> list[int]:
        """Every id found, once: the repeated ones first, then those among random ids, then those alone."""
        return list(dict.fromkeys(self.repeated + self.random + self.alone))


def mine(model: torch.nn.Module, mining: Mining, text: torch.Tensor, *, bos: int | None, seed: int,
         rank: int = 0, world: int = 1, bf16: bool = False) -> Found:
    """The ids of `mining`'s part that overflow when repeated (and, with `mining.random`, among random ids):
    this process's share (every `world`-th id from `rank`) against the envelope of the real-text rows
    `text`, in eval mode and without gradients."""
    was_training = model.training
    model.eval()
    try:
        limits = text_envelope(model, text, bf16=bf16)
        part = vocabulary_part(int(model.config.vocab_size), [mining.part], mining.of, seed)
        # Every process sweeps as many ids, so runs as many forwards: under FSDP each gathers the weights from all.
        ids = np.resize(part[rank::world], -(-len(part) // world))  # a shorter share repeats its first id
        ratio = repeated_sweep(model, torch.from_numpy(ids), limits, bos=bos, context=mining.context,
                               batch_size=mining.batch_size, bf16=bf16) if mining.repeated else torch.zeros(0)
        random = random_sweep(model, ids, limits, bos=bos, seed=seed, context=mining.random_context,
                              batch_size=mining.batch_size, bf16=bf16) if mining.random else []
        alone = alone_sweep(model, torch.from_numpy(ids), limits, batch_size=mining.batch_size,
                            bf16=bf16) if mining.alone else torch.zeros(0)
    finally:
        model.train(was_training)
    return Found(_overflowing(ids, ratio), random, len(part[rank::world]), _overflowing(ids, alone))


def _overflowing(ids: np.ndarray, ratio: torch.Tensor) -> list[int]:
    """The ids whose ratio is above `OVERFLOW_RATIO`, worst first, each once."""
    order = np.argsort(-ratio.numpy(), kind="stable")
    return list(dict.fromkeys(int(ids[i]) for i in order if ratio[i] > OVERFLOW_RATIO))


class MinedIds:
    """The ids each `train.coverage` setting with `mine` found, by the step it started, kept in the run folder."""

    def __init__(self, path: Path):
        self.path = Path(path)
        found = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.found: dict[int, list[int]] = {int(step): ids for step, ids in found.items()}

    def replay(self, coverage) -> list[int] | None:
        """A coverage setting's replay ids: its own `replay` list and, if it mines, every id found by a mining
        setting that started no later (with `mine.earlier` false, by itself only); None when it neither lists nor mines."""
        if coverage.mine is None:
            return coverage.replay
        mined = [i for start, ids in sorted(self.found.items())
                 if start == coverage.start or (coverage.mine.earlier and start < coverage.start) for i in ids]
        return list(dict.fromkeys([*(coverage.replay or []), *mined]))

    def add(self, start: int, ids: list[int], write: bool) -> None:
        """Record what the setting that starts at `start` found (and write the file, on the main process)."""
        self.found[start] = sorted(ids)
        if write:
            self.path.write_text(json.dumps({str(k): v for k, v in sorted(self.found.items())}))
