"""Robustness: does a model stay bounded on everything a user may feed it?

An LN-free model has no norm left to scale a token back, and a gated MLP (SwiGLU/GeGLU) grows with
the square of its input, so a rare token can run away block after block until fp32 overflows. A
model that overflows anywhere is broken there, so `stress` probes three kinds of input, each
sequence starting with BOS where the family reads one:

- the **test split** of a dataset, whole: sequences with a non-finite logit, tokens above 30 nats;
- **repeated-token probes**: one token id repeated to the context length, for ids spread over the
  frequency ranks of the training text (ids it never holds included; every id of a small vocabulary);
- a **vocabulary sweep**: every token id (or a seeded sample of them) once, in random order.

A token *overflows* when a logit is non-finite or its residual norm at some layer (the input of each
block and of the final norm) exceeds `OVERFLOW_RATIO` × the largest that the same model reaches at
that layer on the test split (its *envelope*, over the test sequences with no non-finite logit and no
token above `CE_LIMIT`), so an original's own massive activations are inside its envelope.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from lnfree.arch import architecture
from lnfree.removal.config import load_preset
from lnfree.data.documents import bos_token, prepare_data, tokenizer_fingerprint
from lnfree.evaluate.datasets import EvalError, load_sequences, resolve_dataset
from lnfree.evaluate.models import load_models, resolve_device
from lnfree.removal.mining import (  # noqa: F401 (stress's API too)
    OVERFLOW_RATIO, random_rows, repeated_sequences, residual_norms, residual_stream,
)

#: A token whose cross-entropy exceeds this (nats) counts as a failure on real text.
CE_LIMIT = 30.0
#: How many of the worst tokens each model's record lists.
WORST = 20


@dataclass
class Pass:
    """Per-token measurements of one model on a batch of sequences (CPU tensors)."""

    ids: torch.Tensor  # (n, T)
    norms: torch.Tensor  # (layers + 1, n, T) residual L2 norms, inf where non-finite
    finite: torch.Tensor  # (n, T) every logit finite
    ce: torch.Tensor  # (n, T − 1) next-token cross-entropy (inf where a logit is non-finite)


def measure(model: torch.nn.Module, ids: torch.Tensor, *, batch_size: int = 8, progress=None) -> Pass:
    """Residual norms, finiteness and cross-entropy of every token of `ids`, `batch_size` rows at a time."""
    parts = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size]
        stream, logits = residual_stream(model, batch)
        norms = residual_norms(stream)
        finite = logits.isfinite().all(dim=-1).cpu()
        head = logits[:, :-1]
        ce = (head.logsumexp(dim=-1) - head.gather(-1, batch[:, 1:, None].to(head.device))[..., 0]).cpu()
        ce = torch.where(finite[:, :-1] & ce.isfinite(), ce, torch.full_like(ce, math.inf))
        del stream, logits, head
        parts.append(Pass(batch, norms, finite, ce))
        if progress is not None:
            progress.update(len(batch))
    return Pass(*(torch.cat([getattr(p, name) for p in parts], dim=1 if name == "norms" else 0)
                  for name in ("ids", "norms", "finite", "ce")))


def recorded_envelope(stress_json, label: str | None = None) -> tuple[str, torch.Tensor]:
    """(label, envelope per layer) of one model's record (default: the first) in a `stress.json`."""
    models = json.loads(Path(stress_json).read_text())["models"]
    label = label or next(iter(models))
    return label, torch.tensor(models[label]["envelope"])


def envelope(test: Pass) -> torch.Tensor:
    """The largest residual norm per layer over the test sequences that stayed sane (every logit
    finite, no token above `CE_LIMIT`, every residual norm finite: real norms downstream can turn a
    residual too large for fp32's norm back into finite logits); zeros when none did."""
    sane = (test.finite.all(dim=1) & (test.ce <= CE_LIMIT).all(dim=1)
            & test.norms.isfinite().all(dim=0).all(dim=1))
    if not sane.any():
        return torch.zeros(test.norms.shape[0])
    return test.norms[:, sane].flatten(1).max(dim=1).values


def typical_norms(test: Pass) -> torch.Tensor:
    """The median residual norm per layer over the test tokens after position 0 (a typical token's)."""
    norms = test.norms[:, :, 1:].flatten(1)
    return torch.stack([row[row.isfinite()].median() if row.isfinite().any() else row.new_tensor(math.nan)
                        for row in norms])


def overflow_ratio(run: Pass, limits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per token the largest norm / envelope over layers, inf where a logit is non-finite; the layer)."""
    ratio = run.norms / limits.clamp_min(1e-30)[:, None, None]
    worst, layer = ratio.max(dim=0)
    worst = torch.where(run.finite, worst, torch.full_like(worst, math.inf))
    return worst, layer


# ----------------------------------------------------------------------------------------------
# The probes
# ----------------------------------------------------------------------------------------------


def frequency_ranks(counts: np.ndarray, seed: int = 0) -> np.ndarray:
    """Token ids from the most to the least frequent in `counts` (length = vocabulary size); ties
    (the ids that never occur among them) in a seeded random order."""
    tiebreak = np.random.default_rng(seed).permutation(len(counts))
    return np.lexsort((tiebreak, -counts))


def repeated_probe_ids(counts: np.ndarray, n: int | None, seed: int = 0) -> np.ndarray:
    """`n` ids evenly spread over the frequency ranks (the most frequent, the rarest and ids never seen
    included); every id when `n` is None or at least the vocabulary size."""
    ranks = frequency_ranks(counts, seed)
    if n is None or n >= len(ranks):
        return ranks
    return ranks[np.unique(np.linspace(0, len(ranks) - 1, n).round().astype(int))]


def sweep_sequences(vocab_size: int, context: int, bos: int | None, n_ids: int | None, seed: int = 0) -> torch.Tensor:
    """Every id (or a seeded sample of `n_ids`) once, in seeded random order, cut into rows of
    `context` tokens after BOS; the last row is filled up with ids from the start of the order."""
    order = np.random.default_rng(seed).permutation(vocab_size)
    return random_rows(order if n_ids is None else order[:n_ids], context, bos)


# ----------------------------------------------------------------------------------------------
# The record of one model
# ----------------------------------------------------------------------------------------------


@dataclass
class StressRecord:
    """What `stress` found for one model (JSON-ready)."""

    label: str
    source: str
    envelope: list[float]  # per layer (block inputs, then the final norm's input)
    growth_vs_first: list[float] | None  # envelope / the first model's, per layer
    max_growth_vs_first: float | None
    test_sequences: int
    test_tokens: int
    test_nonfinite_sequences: int
    test_nonfinite_tokens: int
    test_tokens_over_30_nats: int
    test_overflow_tokens: int
    test_ce: float  # mean over the test tokens (inf when any is)
    repeated_probes: int
    repeated_overflow: int  # probes with at least one overflowing token
    repeated_nonfinite: int  # probes with a non-finite logit
    vocab_size: int
    vocab_covered: int
    vocab_sequences: int
    vocab_overflow: int  # overflowing tokens of the sweep
    vocab_overflow_sequences: int
    vocab_nonfinite_tokens: int
    max_times_typical: dict[str, float] = field(default_factory=dict)  # per part: the largest norm / typical norm
    worst: list[dict] = field(default_factory=list)

    @property
    def overflow_total(self) -> int:
        """Every overflow counted: test sequences with a non-finite logit, overflowing test tokens, probes and
        sweep tokens. Tokens above 30 nats are not overflows (an original can predict a token that badly):
        they are counted on their own, `test_tokens_over_30_nats`."""
        return self.test_nonfinite_sequences + self.test_overflow_tokens + self.repeated_overflow + self.vocab_overflow

    def to_dict(self) -> dict:
        return {**asdict(self), "overflow_total": self.overflow_total}


def culprit(norms: torch.Tensor, limits: torch.Tensor) -> int | None:
    """The position of one sequence (`norms`: layers × positions) whose residual norm leaves the envelope
    (`OVERFLOW_RATIO` × `limits`) at the earliest layer, the first such position on a tie; None if none does.
    The earliest layer, not the first position: a runaway reaches later tokens through attention, and a
    non-finite value reaches earlier ones too (0 × inf in attention's weighted sum), position 0 included."""
    over = norms / limits.clamp_min(1e-30)[:, None] > OVERFLOW_RATIO  # inf (non-finite) counts as over
    layers = over.any(dim=1).nonzero()
    return int(over[int(layers[0])].nonzero()[0]) if len(layers) else None


def _worst_tokens(parts: dict[str, tuple[Pass, torch.Tensor, torch.Tensor]], typical: torch.Tensor,
                  limits: torch.Tensor, tokenizer, limit: int) -> list[dict]:
    """The `limit` sequences whose worst token is the largest against a typical token of the test split
    (norm / median norm, the largest over layers; a non-finite logit first), each with its culprit
    (`culprit`: the token that leaves the envelope `limits` first), else the first token whose logits are
    non-finite, else the largest. With the token: its text, the tokens before it, and its norm / envelope
    (the overflow measure)."""
    rows = []
    for part, (run, ratio, layer) in parts.items():
        times, at = times_typical(run, typical)
        per_row = times.max(dim=1).values
        values, index = per_row.topk(min(limit, per_row.numel()))
        for value, seq in zip(values.tolist(), index.tolist()):
            pos = culprit(run.norms[:, seq], limits)
            if pos is None:
                overflowing = (ratio[seq] > OVERFLOW_RATIO).nonzero()
                pos = int(overflowing[0]) if len(overflowing) else int((times[seq] >= value).nonzero()[0])
            token = int(run.ids[seq, pos])
            envelope_ratio = float(ratio[seq, pos])
            rows.append({"part": part, "sequence": seq, "position": pos, "token_id": token,
                         "text": tokenizer.decode([token]), "before": tokenizer.decode(run.ids[seq, max(0, pos - 8):pos].tolist()),
                         "times_typical": float(times[seq, pos]) if math.isfinite(times[seq, pos]) else "non-finite logit",
                         "times_typical_layer": int(at[seq, pos]),
                         "ratio": envelope_ratio if math.isfinite(envelope_ratio) else "non-finite logit",
                         "layer": int(layer[seq, pos]), "_sort": value})
    rows.sort(key=lambda r: -r["_sort"])
    return [{k: v for k, v in r.items() if k != "_sort"} for r in rows[:limit]]


def times_typical(run: Pass, typical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per token its largest norm / the typical token's over layers, inf where a logit is non-finite;
    the layer)."""
    times, layer = (run.norms / typical.clamp_min(1e-30)[:, None, None]).max(dim=0)
    return torch.where(run.finite, times, torch.full_like(times, math.inf)), layer


def stress_model(
    label: str, source: str, model: torch.nn.Module, tokenizer, test_ids: torch.Tensor, probes: torch.Tensor,
    sweep: torch.Tensor, *, first_envelope: torch.Tensor | None = None, batch_size: int = 8, progress: bool = False,
) -> tuple[StressRecord, torch.Tensor]:
    """Measure one model on the test split, the repeated-token probes and the sweep; (its record, its envelope)."""
    from tqdm.auto import tqdm

    total = len(test_ids) + len(probes) + len(sweep)
    with tqdm(total=total, unit="seq", desc=f"stress {label}", disable=not progress, leave=False) as bar:
        test, repeated, swept = (measure(model, ids, batch_size=batch_size, progress=bar)
                                 for ids in (test_ids, probes, sweep))
    limits = envelope(test)
    ratios = {name: (run, *overflow_ratio(run, limits)) for name, run in
              (("test", test), ("repeated", repeated), ("vocab", swept))}
    over = {name: ratio > OVERFLOW_RATIO for name, (_, ratio, _) in ratios.items()}
    typical = typical_norms(test)
    largest = {name: float(times_typical(run, typical)[0].max()) for name, (run, _, _) in ratios.items()}
    growth = None if first_envelope is None else (limits / first_envelope.clamp_min(1e-30))
    record = StressRecord(
        label=label, source=source, envelope=limits.tolist(),
        growth_vs_first=None if growth is None else growth.tolist(),
        max_growth_vs_first=None if growth is None else float(growth.max()),
        test_sequences=len(test_ids), test_tokens=test.ce.numel(),
        test_nonfinite_sequences=int((~test.finite).any(dim=1).sum()),
        test_nonfinite_tokens=int((~test.finite).sum()),
        test_tokens_over_30_nats=int((test.ce > CE_LIMIT).sum()),
        test_overflow_tokens=int(over["test"].sum()),
        test_ce=float(test.ce.double().mean()),
        repeated_probes=len(probes), repeated_overflow=int(over["repeated"].any(dim=1).sum()),
        repeated_nonfinite=int((~repeated.finite).any(dim=1).sum()),
        vocab_size=int(model.config.vocab_size), vocab_covered=int(torch.unique(sweep).numel()),
        vocab_sequences=len(sweep), vocab_overflow=int(over["vocab"].sum()),
        vocab_overflow_sequences=int(over["vocab"].any(dim=1).sum()),
        vocab_nonfinite_tokens=int((~swept.finite).sum()),
        max_times_typical=largest,
        worst=_worst_tokens(ratios, typical, limits, tokenizer, WORST),
    )
    return record, limits


@dataclass
class StressReport:
    """`stress` over several models on the same inputs."""

    settings: dict
    records: list[StressRecord]
    reused: list[str] = field(default_factory=list)  # labels whose saved record was reused (`resume`)
    pending: list[str] = field(default_factory=list)  # labels with no saved record to reuse (`pending_only`)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "models": {r.label: r.to_dict() for r in self.records}}


def stress_models(
    labelled: Sequence[tuple[str, str, torch.nn.Module]], tokenizer, test_ids: torch.Tensor, counts: np.ndarray, *,
    context: int, repeated: int | None, vocab: int | None, seed: int = 0, batch_size: int = 8,
    progress: bool = False, settings: dict | None = None, with_bos: bool = True, parts: Path | None = None,
    resume: bool = False, pending_only: bool = False,
) -> StressReport:
    """`stress_model` on each (label, source, model) in turn, the first one's envelope the reference of
    the growth; `counts` (token frequencies of the training text) choose the repeated-token ids. Probe
    rows start with BOS where the family reads one, unless `with_bos` is False. `parts`: a folder where
    each model's record is saved once measured; `resume`: reuse a saved record whose settings, inputs,
    label, source and weights all match (`part_key`), so an interrupted run measures only what is left.
    `pending_only`: measure nothing; the report lists which labels `resume` would reuse and which it would measure
    (so that a script can give a lone model every core)."""
    model = labelled[0][2]
    vocab_size = int(model.config.vocab_size)
    bos = tokenizer.bos_token_id if architecture(model).prepends_bos and with_bos else None
    if len(counts) != vocab_size:
        raise ValueError(f"{len(counts)} token counts for a vocabulary of {vocab_size}")
    probe_ids = repeated_probe_ids(counts, repeated, seed)
    probes = repeated_sequences(probe_ids, context, bos)
    sweep = sweep_sequences(vocab_size, context, bos, vocab, seed)
    info = {"context": context, "bos": bos, "overflow_ratio": OVERFLOW_RATIO, "ce_limit": CE_LIMIT, "seed": seed,
            "repeated_probe_ids": probe_ids.tolist() if len(probe_ids) <= 4096 else len(probe_ids),
            "vocab_sweep_ids": vocab_size if vocab is None else min(vocab, vocab_size), **(settings or {})}
    inputs = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (test_ids, probes, sweep))).hexdigest()
    records, reused, pending, first = [], [], [], None
    for label, source, module in labelled:
        key = part_key(info | {"inputs": inputs}, label, source, module) if parts is not None else None
        record = load_part(parts, label, key) if parts is not None and resume else None
        if pending_only:
            (pending if record is None else reused).append(label)
            continue
        if record is None:
            record, limits = stress_model(label, source, module, tokenizer, test_ids, probes, sweep,
                                          first_envelope=first, batch_size=batch_size, progress=progress)
            if parts is not None:
                save_part(parts, label, key, record)
        else:
            reused.append(label)
            limits = torch.tensor(record.envelope)
            growth = None if first is None else limits / first.clamp_min(1e-30)
            record.growth_vs_first = None if growth is None else growth.tolist()
            record.max_growth_vs_first = None if growth is None else float(growth.max())
        first = limits if first is None else first
        records.append(record)
    return StressReport(info, records, reused, pending)


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes and bytes): the same weights, the same digest."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def part_key(info: dict, label: str, source: str, module: torch.nn.Module) -> str:
    """What one model's saved record depends on: the settings and inputs, its label, source and weights."""
    described = json.dumps({"info": info, "label": label, "source": source, "weights": weights_digest(module)},
                           sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()


def _part_file(parts: Path, label: str) -> Path:
    return Path(parts) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', label)}.json"


def save_part(parts: Path, label: str, key: str, record: StressRecord) -> None:
    """Keep one model's record (its key beside it) as soon as it is measured."""
    Path(parts).mkdir(parents=True, exist_ok=True)
    _part_file(parts, label).write_text(json.dumps({"key": key, "record": asdict(record)}, default=str))


def load_part(parts: Path, label: str, key: str) -> StressRecord | None:
    """The record saved for this label under the same key (settings, inputs, source, weights), else None."""
    path = _part_file(parts, label)
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return StressRecord(**saved["record"]) if saved.get("key") == key else None


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


def training_counts(spec, tokenizer, test_ids: torch.Tensor, context: int, vocab_size: int,
                    bos: int | None) -> tuple[np.ndarray, str]:
    """(token counts over the vocabulary, where they come from): the training split of a bundled corpus
    (tiny, realtext), else the test sequences themselves."""
    if spec.how == "bundled":
        config = load_preset(spec.source).data.model_copy(update={"context_length": context})
        train = prepare_data(config, tokenizer, context, vocab_size, bos).train
        return np.bincount(np.asarray(train).reshape(-1), minlength=vocab_size)[:vocab_size], f"{spec.source} train split"
    return np.bincount(test_ids.reshape(-1).numpy(), minlength=vocab_size)[:vocab_size], "the test sequences"


def run_stress(
    sources: Sequence[str], dataset: str = "tiny", *, labels: Sequence[str] | None = None, context: int = 128,
    n_sequences: int | None = None, repeated: int | None = 512, vocab: int | None = 8192, batch_size: int = 8,
    device: str = "auto", dtype: str = "fp32", form: str = "hf", seed: int = 0, progress: bool = False,
    with_bos: bool = True, parts: Path | None = None, resume: bool = False, pending_only: bool = False,
) -> StressReport:
    """Load the models (`lnfree.evaluate.load_models`), read the dataset's whole test split (or its first
    `n_sequences`) and `stress_models` them on identical inputs. `repeated` / `vocab` None: every id.
    `with_bos` False: no sequence starts with BOS, even for a family that reads one (what a user who
    tokenises without special tokens feeds it)."""
    spec = resolve_dataset(dataset)
    models = load_models(sources, labels, form=form, dtype=dtype)
    if len({tokenizer_fingerprint(m.tokenizer) for m in models}) > 1:
        raise EvalError("the models' tokenizers differ; stress compares models on identical inputs")
    first = models[0]
    for m in models:
        if m.n_positions and context > m.n_positions:
            raise EvalError(f"context {context} exceeds {m.label}'s n_positions ({m.n_positions}); pass --context")
    target = resolve_device(device)
    vocab_size = min(m.vocab_size for m in models)
    bos = bos_token(first.module.config, first.tokenizer) if with_bos else None
    test_ids = torch.from_numpy(load_sequences(spec, first.tokenizer, context=context, n_sequences=n_sequences,
                                               vocab_size=vocab_size, progress=progress, bos_token_id=bos))
    counts, counted = training_counts(spec, first.tokenizer, test_ids, context, vocab_size, bos)
    labelled = [(m.label, m.source, m.module.to(target)) for m in models]
    settings = {"dataset": spec.name, "dataset_description": spec.description, "frequencies_from": counted,
                "form": form, "dtype": dtype, "device": str(target), "batch_size": batch_size,
                "repeated_requested": "all" if repeated is None else repeated,
                "vocab_requested": "all" if vocab is None else vocab, "with_bos": with_bos}
    return stress_models(labelled, first.tokenizer, test_ids, counts, context=context, repeated=repeated,
                         vocab=vocab, seed=seed, batch_size=batch_size, progress=progress, settings=settings,
                         with_bos=with_bos, parts=parts, resume=resume, pending_only=pending_only)


def markdown(report: StressReport) -> str:
    """The report as a short markdown page: one row per model, then each model's worst tokens."""
    s = report.settings
    lines = [f"# Stress test ({s['dataset']}, context {s['context']}{'' if s.get('with_bos', True) else ', no BOS'}, overflow: a non-finite logit or a residual "
             f"norm > {s['overflow_ratio']:g}× the model's own test-split maximum at that layer)", "",
             "| model | test: non-finite seqs | test: tokens > 30 nats | test: overflow tokens | test CE | "
             "repeated: overflow / probes | vocab: overflow tokens (seqs) / ids covered | max growth vs first | "
             "largest × typical token (test / repeated / vocab) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report.records:
        growth = "—" if r.max_growth_vs_first is None else f"{r.max_growth_vs_first:.3g}×"
        lines.append(f"| {r.label} | {r.test_nonfinite_sequences} / {r.test_sequences} | {r.test_tokens_over_30_nats} "
                     f"| {r.test_overflow_tokens} | {r.test_ce:.4f} | {r.repeated_overflow} / {r.repeated_probes} | "
                     f"{r.vocab_overflow} ({r.vocab_overflow_sequences}) / {r.vocab_covered} of {r.vocab_size} | {growth} | "
                     + " / ".join(f"{r.max_times_typical[part]:.3g}" for part in ("test", "repeated", "vocab")) + " |")
    for r in report.records:
        lines += ["", f"## {r.label}: the worst tokens (residual norm against a typical token's, and against the envelope)",
                  "", "| part | seq | pos | token | before | × typical (layer) | / envelope (layer) |",
                  "|---|---|---|---|---|---|---|"]
        number = lambda v: v if isinstance(v, str) else f"{v:.4g}"  # noqa: E731
        for w in r.worst:
            lines.append(f"| {w['part']} | {w['sequence']} | {w['position']} | {w['text']!r} ({w['token_id']}) | "
                         f"{w['before']!r} | {number(w['times_typical'])} ({w['times_typical_layer']}) | "
                         f"{number(w['ratio'])} ({w['layer']}) |")
    return "\n".join(lines) + "\n"
