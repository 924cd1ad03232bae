"""Probe batches that hold what makes a norm input extreme, and the error measured on them.

Real models put their massive activations on the first position (BOS), on special tokens and on
tokens repeated at the start of a sequence (docs/how-to/modern-models.md). Seeded random ids rarely contain any of
them, so a check on random ids alone can call an export exact that is wrong on the first real
sequence. A probe here is real text when there is some, plus rows that start with BOS, with every
special token and with repeated tokens, plus random rows; `export` chooses and checks its eps on
it and `verify` compares every representation on it.
"""

from __future__ import annotations

import math

from pathlib import Path

import torch
from torch import nn

from lnfree.arch import architecture
from lnfree.files import file_sha256

#: At most this many special token ids get rows of their own (tokenizers with thousands of added
#: tokens would otherwise make the probe larger than the model's forward budget).
MAX_SPECIAL_IDS = 32
#: Worst per-token ‖Δlogits‖ / ‖logits‖ an export may show against the installed model: fp32 rounding
#: through eps-trick weights of ~1e6 leaves ~1e-5 (the two forms round in different orders).
RELATIVE_TOLERANCE = 1e-4
#: Logits compare_logits holds at once: it keeps both sides in fp64 with a few temporaries of their size, so
#: eight 64-token rows of Gemma's 262,144 ids peaked at 7.5 GB (benchmarks/compare_logits_memory.py).
COMPARE_LOGITS = 2**24

# Real text for a model that has no held-out data at hand: plain prose and a little code, written for lnfree.
SAMPLE_TEXT = (
    "The committee met on Tuesday to discuss the budget for next year. Most members agreed that the "
    "library needs new shelves, but nobody could say who would pay for them.\n\n"
    "def mean(values):\n    return sum(values) / len(values)\n\n"
    "She opened the window, looked at the rain, and decided to stay at home after all."
)


def sample_tokens(vocab_size: int, n_positions: int, n_sequences: int = 4, length: int = 32, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids (n_sequences, min(length, n_positions))."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_sequences, min(length, n_positions)), generator=generator)


def special_ids(config, tokenizer=None) -> list[int]:
    """The model's special token ids (BOS, EOS, pad, unk and the tokenizer's other special tokens), at
    most `MAX_SPECIAL_IDS` of them, the config's and the named ones first."""
    named = []
    for source in (config, tokenizer):
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(source, attr, None) if source is not None else None
            named.extend(value if isinstance(value, (list, tuple)) else [value])
    others = list(getattr(tokenizer, "all_special_ids", None) or [])
    ids = []
    for value in named + others:
        if isinstance(value, int) and 0 <= value < config.vocab_size and value not in ids:
            ids.append(value)
    return ids[:MAX_SPECIAL_IDS]


def _bos(config, tokenizer) -> int | None:
    for source in (tokenizer, config):
        value = getattr(source, "bos_token_id", None) if source is not None else None
        if isinstance(value, int) and 0 <= value < config.vocab_size:
            return value
    return None


def probe_rows(config, tokenizer=None, *, text_ids: torch.Tensor | None = None, length: int = 64,
               n_positions: int | None = None, n_random: int = 4, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """Input ids (n, L) for checking a model where its activations are largest, and what each row is.

    Rows: `text_ids` (real text, cut to L; L is their length when given), `n_random` seeded random
    rows, the same with BOS first, and for every special token s: [s, s, s, …] and [BOS, s, s, …],
    and [BOS, t, t, …] for a few random t (repeated tokens at positions 1–2); random ids fill the rest.
    For a family that reads BOS, the kind of a row that does not start with it says so.
    """
    if text_ids is not None:
        length = text_ids.shape[1]
    length = min(length, n_positions or length)
    specials, bos = special_ids(config, tokenizer), _bos(config, tokenizer)
    repeated = sample_tokens(config.vocab_size, 1, 4, 1, seed + 1)[:, 0].tolist()
    name = (lambda t: repr(tokenizer.decode([t]))) if tokenizer is not None else str  # noqa: E731
    reads_bos = bos is not None and architecture(config).prepends_bos
    no_bos = " (no BOS first)" if reads_bos else ""  # outside the input a BOS-reading family expects
    starts = [([s, s, s], f"special token {name(s)} three times, then random ids{no_bos if s != bos else ''}")
              for s in specials]
    if bos is not None:
        starts += [([bos], "BOS, then random ids")] * n_random
        starts += [([bos, s, s], f"BOS, special token {name(s)} twice, then random ids") for s in specials]
        starts += [([bos, t, t], f"BOS, token {name(t)} twice, then random ids") for t in repeated]
    rows = sample_tokens(config.vocab_size, length, n_random + len(starts), length, seed)
    for row, (start, _) in zip(rows[n_random:], starts):
        width = min(len(start), length)
        row[:width] = torch.tensor(start[:width])
    kinds = [f"random ids{no_bos}"] * n_random + [kind for _, kind in starts]
    if text_ids is None:
        return rows, kinds
    return torch.cat([text_ids[:, :length].long(), rows]), ["real text"] * len(text_ids) + kinds


def probe_batch(config, tokenizer=None, **options) -> torch.Tensor:
    """The ids of `probe_rows` (the same options)."""
    return probe_rows(config, tokenizer, **options)[0]


def worst_token_relative_error(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, int, int]:
    """The largest per-token ‖logits − reference‖ / ‖reference‖, and its (row, position)."""
    error = (logits.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1).clamp_min(1e-30)
    error = error.nan_to_num(nan=math.inf)  # a non-finite logit on either side is the worst there is
    worst = int(error.argmax())
    return float(error.flatten()[worst]), worst // error.shape[-1], worst % error.shape[-1]


def logits_fn(model: torch.nn.Module):
    """ids → `model`'s logits on CPU (the ids moved to the model's device)."""
    return lambda ids: model(input_ids=ids.to(next(model.parameters()).device)).logits.cpu()


@torch.no_grad()
def compare_logits(model, reference, ids: torch.Tensor, batch_size: int = 8) -> dict:
    """`model` against `reference` (modules, or callables ids → logits) on `ids`, at most `batch_size` rows at
    a time (fewer where a large vocabulary makes their logits exceed `COMPARE_LOGITS`): the largest |Δlogit|,
    the largest |Δlogit| / max(1, the token's logit scale) (the largest
    |logit| of that token: fp32 rounds every logit of a token relative to the size of the vectors whose
    dot products give them, so a logit near 0 beside logits of 10 carries their rounding), and the
    worst token's relative error and (row, position). A non-finite logit on either side counts as an
    infinite difference."""
    model, reference = (logits_fn(m) if isinstance(m, torch.nn.Module) else m for m in (model, reference))
    worst = {"max_abs_diff": 0.0, "max_scaled_diff": 0.0, "worst_token_relative_error": -1.0, "worst_token": None}
    start, rows = 0, 1  # the first row alone tells how large a row's logits are
    while start < len(ids):
        batch = ids[start: start + rows]
        logits, expected = model(batch), reference(batch)
        got, want = logits.double(), expected.double()
        finite = got.isfinite() & want.isfinite()
        diff = torch.where(finite, (got - want).abs(), torch.where(got == want, 0.0, math.inf))
        scale = want.abs().masked_fill(~want.isfinite(), 0).amax(-1, keepdim=True).clamp_min(1)
        scaled = torch.where(finite, diff / scale, diff)
        worst["max_abs_diff"] = max(worst["max_abs_diff"], diff.max().item())
        worst["max_scaled_diff"] = max(worst["max_scaled_diff"], scaled.max().item())
        error, row, position = worst_token_relative_error(logits, expected)
        if error > worst["worst_token_relative_error"]:
            worst.update(worst_token_relative_error=error, worst_token=(start + row, position))
        start += len(batch)
        rows = max(1, min(batch_size, COMPARE_LOGITS // max(1, logits[0].numel())))
    return worst


def text_ids(tokenizer, text: str = SAMPLE_TEXT, length: int = 64) -> torch.Tensor:
    """(1, ≤ length) ids of `text`, BOS first when the tokenizer has one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor([ids[:length]])


def describe_token(ids: torch.Tensor, where: tuple[int, int], tokenizer=None) -> dict:
    """A (row, position) of `ids` as a JSON-ready dict with the token id and, with a tokenizer, its text."""
    row, position = where
    token = int(ids[row, position])
    out = {"row": row, "position": position, "token_id": token}
    if tokenizer is not None:
        out["text"] = tokenizer.decode([token])
    return out


#: The seeded batch an export's fingerprint records logits on (`export_fingerprint`, `lnfree verify`).
PROBE_SEED = 1234
PROBE_SHAPE = (2, 16)


@torch.no_grad()
def probe_logits(model: nn.Module, bos: int | None = None) -> dict[str, list]:
    """Summary of `model`'s fp32 logits on the seeded probe batch (`bos` first in each row, if given):
    per-position logsumexp and next-token logits."""
    ids = sample_tokens(model.config.vocab_size, architecture(model).n_positions or 32, *PROBE_SHAPE, seed=PROBE_SEED)
    if bos is not None:
        ids[:, 0] = bos
    logits = model(input_ids=ids).logits.double()
    return {
        "logsumexp": logits.logsumexp(-1).tolist(),
        "next_token_logits": logits[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].tolist(),
    }


def export_fingerprint(model: nn.Module, folder: Path) -> dict:
    """What `lnfree verify` checks an export against: sha256 of its weight files and `probe_logits`, with
    BOS first where the family always reads one (a model lost without it, or LN-free and running away on
    random tokens without it, would make the recorded logits meaningless)."""
    bos = model.config.bos_token_id if architecture(model).prepends_bos else None
    probe = {"seed": PROBE_SEED, "shape": list(PROBE_SHAPE), **({"bos": bos} if bos is not None else {})}
    return {
        "weights_sha256": {f.name: file_sha256(f) for f in sorted(Path(folder).glob("*.safetensors"))},
        "probe": {**probe, **probe_logits(model, bos)},
    }
