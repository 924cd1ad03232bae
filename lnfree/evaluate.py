"""`lnfree.evaluate`: per-token cross-entropy of models on identical tokens, and how they differ.

One scored-token convention for every model, format and dataset (``SCORING_CONVENTION``): a
sequence of L tokens scores its L−1 next-token predictions. The target at position t (1 ≤ t < L)
is predicted from tokens 0…t−1; the first token of a sequence is context only; the EOT token is a
target like any other; nothing is padded or masked. So a run over N sequences scores exactly
N·(L−1) tokens, whatever the model's format (eps-trick file, lnfree's fixed-scale form, folded
weights, ordinary GPT-2).

Sequences are a deterministic choice: a dataset's documents are tokenised in their stored order,
each followed by EOT, concatenated (pre-tokenised rows are concatenated as they are) and cut into
consecutive L-token sequences; the first N are evaluated. Named presets:

- ``tiny``: the bundled tiny model's held-out synthetic text (the sequences its removal run reports);
- ``owt-val``: the nanoGPT validation split of OpenWebText (``Skylion007/openwebtext``, Parquet
  revision, ``train_test_split(test_size=0.0005, seed=2357)``), 1024-token sequences;
- ``pile``: ``apollo-research/monology-pile-uncopyrighted-tokenizer-gpt2`` (pre-tokenised; streamed),
  the first 10,000 sequences of 1024;
- ``pile-filtered``: ``lucabaroni/apollo-pile-filtered-10k`` (Pile sequences without tokens unseen in
  OpenWebText; streamed), 10,000 sequences of 1024.

Anything else is a local file/folder (``.txt``, ``.jsonl``, ``.parquet``, ``save_to_disk``, ``.npy``
token stream; the whole file is evaluation data) or a Hugging Face dataset id (streamed).

Per model: mean CE with a bootstrap CI over sequences, median, p95, p99, p99.9, max, the tokens
whose CE exceeds a threshold (with their context), entropy, top-1 accuracy and ECE, CE and entropy
by context-position bins. Per pair of models on the same tokens: per-token Jensen–Shannon
divergence and the paired CE difference, with bootstrap CIs over sequences (never over i.i.d.
tokens). Outputs: per-model JSON and CSV, ``comparison.md``/``.csv``, ``pairwise.csv``,
``positions.csv``, ``outliers.csv`` and ``summary.json``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lnfree.analysis.common import bootstrap_ci, model_labels, write_summary, write_table
from lnfree.data import tokenizer_fingerprint
from lnfree.derived import clear_stale
from lnfree.layout import RUN_CONFIG, TRAINER_STATE

SCORING_CONVENTION = (
    "each sequence of L tokens scores its L-1 next-token predictions: the target at position t (1 <= t < L) "
    "is predicted from tokens 0..t-1; the first token is context only; EOT is a target like any other token; "
    "nothing is padded or masked; scored tokens = sequences x (L-1) for every model and format"
)
#: Per-token CE (nats) above which a token is listed as an outlier. P25 (App. E) lists GPT-2 XL
#: LN-free's Pile tokens above 50; the original model's p99.9 there is 43.
DEFAULT_THRESHOLD = 50.0
ECE_BINS = 10
UNITS = "nats"


class EvalError(ValueError):
    """Input that cannot be evaluated as asked (dataset, models, options)."""


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetPreset:
    """A named evaluation set: where its documents or token rows come from and how many to take."""

    name: str
    description: str
    source: str  # a bundled preset ("tiny", "realtext") or a Hub dataset id
    how: str  # "tiny" (a bundled model's own held-out split, per its preset) | "heldout-split" | "stream"
    context: int | None
    n_sequences: int | None  # None: every sequence the set holds
    revision: str | None = None
    split: str = "train"
    val_fraction: float | None = None
    val_seed: int | None = None


def _owt_preset() -> DatasetPreset:
    from lnfree.config import load_preset

    data = load_preset("gpt2").data  # one source of truth for the nanoGPT split
    return DatasetPreset(
        "owt-val", "OpenWebText, nanoGPT validation split", data.source, "heldout-split", 1024, None,
        revision=data.revision, val_fraction=data.val_fraction, val_seed=data.val_seed,
    )


def presets() -> dict[str, DatasetPreset]:
    """The named evaluation sets (`tiny`, `realtext`, `owt-val`, `pile`, `pile-filtered`)."""
    return {
        "tiny": DatasetPreset("tiny", "the bundled tiny model's held-out synthetic text", "tiny", "tiny", None, None),
        "realtext": DatasetPreset("realtext", "held-out Django documentation (the realtext model's split)",
                                  "realtext", "tiny", None, None),
        "owt-val": _owt_preset(),
        "pile": DatasetPreset(
            "pile", "the Pile (uncopyrighted), GPT-2 tokens, first 10k x 1024",
            "apollo-research/monology-pile-uncopyrighted-tokenizer-gpt2", "stream", 1024, 10_000,
        ),
        "pile-filtered": DatasetPreset(
            "pile-filtered", "Pile sequences without tokens unseen in OpenWebText, 10k x 1024",
            "lucabaroni/apollo-pile-filtered-10k", "stream", 1024, 10_000,
        ),
    }


@dataclass(frozen=True)
class DatasetSpec:
    """What `--dataset` resolved to."""

    name: str
    source: str
    how: str  # "tiny" | "heldout-split" | "stream" | "local" | "npy"
    context: int | None = None
    n_sequences: int | None = None
    revision: str | None = None
    split: str = "train"
    text_field: str = "text"
    val_fraction: float | None = None
    val_seed: int | None = None
    description: str = ""


def resolve_dataset(
    name: str, *, split: str | None = None, revision: str | None = None, text_field: str = "text",
) -> DatasetSpec:
    """A preset name, a local path, or a Hub dataset id → a `DatasetSpec` (clear error otherwise)."""
    named = presets()
    if name in named:
        p = named[name]
        return DatasetSpec(p.name, p.source, p.how, p.context, p.n_sequences, revision or p.revision,
                           split or p.split, text_field, p.val_fraction, p.val_seed, p.description)
    path = Path(name).expanduser()
    if path.exists():
        how = "npy" if path.suffix == ".npy" else "local"
        return DatasetSpec(name, str(path), how, split=split or "train", text_field=text_field,
                           description=f"local {'token stream' if how == 'npy' else 'data'} {path}")
    if name.startswith((".", "/", "~")) or path.suffix in {".txt", ".jsonl", ".json", ".parquet", ".npy"}:
        raise EvalError(f"dataset not found: {name}")
    if "/" not in name:
        raise EvalError(f"unknown dataset preset {name!r}: use one of {', '.join(named)}, "
                        "a Hugging Face dataset id (owner/name) or a local path")
    return DatasetSpec(name, name, "stream", revision=revision, split=split or "train", text_field=text_field,
                       description=f"Hugging Face dataset {name} (split {split or 'train'}, streamed)")


def _rows_to_sequences(
    rows: Iterable[Mapping[str, Any]], tokenizer, context: int, n_sequences: int | None, text_field: str,
    *, progress: bool = False, batch: int = 256,
) -> np.ndarray:
    """Documents (text, +EOT each) or pre-tokenised rows (`input_ids`, as they are) → (n, context) int64.

    Reads rows in order and stops once `n_sequences` full sequences are there (all rows if None).
    """
    from tqdm.auto import tqdm

    eot = tokenizer.eos_token_id
    wanted = None if n_sequences is None else n_sequences * context
    chunks: list[np.ndarray] = []
    total = 0
    pending: list[str] = []
    bar = tqdm(total=wanted, unit="tok", desc="reading tokens", disable=not progress, leave=False)

    def add(ids: np.ndarray) -> None:
        nonlocal total
        chunks.append(ids)
        total += len(ids)
        bar.update(len(ids))

    def flush() -> None:
        if pending:
            for ids in tokenizer(pending, verbose=False)["input_ids"]:
                add(np.asarray(list(ids) + [eot], dtype=np.int64))
            pending.clear()

    for row in rows:
        if "input_ids" in row:
            add(np.asarray(row["input_ids"], dtype=np.int64))
        elif text_field in row:
            if eot is None:
                raise EvalError("the tokenizer has no eos (EOT) token to separate documents")
            pending.append(row[text_field])
            if len(pending) >= batch:
                flush()
        else:
            raise EvalError(f"rows have neither 'input_ids' nor {text_field!r} (columns: {sorted(row)}); "
                            "pass --text-field")
        if wanted is not None and total >= wanted:
            break  # stop reading: a streamed set is never read further than needed
    flush()
    bar.close()
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    n = len(stream) // context
    if n_sequences is not None:
        n = min(n, n_sequences)
    return stream[: n * context].reshape(n, context)


def _cache_file(spec: DatasetSpec, tokenizer, context: int, n: int | None, cache_dir: str | None) -> Path:
    key = json.dumps({"spec": asdict(spec), "tokenizer": tokenizer_fingerprint(tokenizer),
                      "context": context, "n": n, "format": 1}, sort_keys=True)
    root = Path(cache_dir or Path.home() / ".cache" / "lnfree" / "eval").expanduser()
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npy"


def _hub_rows(spec: DatasetSpec):
    import datasets

    try:
        if spec.how == "heldout-split":  # the split needs the dataset's length: a full (cached) download
            full = datasets.load_dataset(spec.source, revision=spec.revision, split=spec.split)
            return full.train_test_split(test_size=spec.val_fraction, seed=spec.val_seed, shuffle=True)["test"]
        return datasets.load_dataset(spec.source, revision=spec.revision, split=spec.split, streaming=True)
    except Exception as err:  # the Hub, the network or the id: say which dataset failed
        raise EvalError(f"could not load dataset {spec.source!r} (split {spec.split!r}): {err}") from err


def load_sequences(
    spec: DatasetSpec, tokenizer, *, context: int, n_sequences: int | None, vocab_size: int,
    cache_dir: str | None = None, progress: bool = False, bos_token_id: int | None = None,
) -> np.ndarray:
    """The first `n_sequences` sequences of `context` tokens of a dataset, (n, context) int64 (deterministic).

    Hub sets are streamed (except ``owt-val``, whose split needs the whole dataset) and the tokens
    cached under ``~/.cache/lnfree/eval``. `n_sequences` None takes every full sequence. With
    `bos_token_id` (models that need one: `lnfree.data.bos_token`), each is that token and context − 1 tokens.
    """
    if bos_token_id is not None and spec.how != "tiny":  # a document's own BOS may remain inside a sequence
        from lnfree.data import prepend_bos

        return prepend_bos(load_sequences(spec, tokenizer, context=context - 1, n_sequences=n_sequences,
                                          vocab_size=vocab_size, cache_dir=cache_dir, progress=progress), bos_token_id)
    if spec.how == "tiny":
        from lnfree.config import load_preset
        from lnfree.data import prepare_data

        config = load_preset(spec.source).data.model_copy(update={"context_length": context, "cache_dir": cache_dir})
        held_out = prepare_data(config, tokenizer, context, vocab_size, bos_token_id).held_out
        sequences = np.asarray(held_out[: n_sequences or len(held_out)], dtype=np.int64)
    elif spec.how == "npy":
        stream = np.load(spec.source, mmap_mode="r")
        if stream.ndim != 1:
            raise EvalError(f"{spec.source} must be a 1-D array of token ids")
        n = len(stream) // context if n_sequences is None else min(n_sequences, len(stream) // context)
        sequences = np.asarray(stream[: n * context], dtype=np.int64).reshape(n, context)
    elif spec.how == "local":
        from lnfree.config import DataConfig
        from lnfree.data import DataError, _local_dataset

        try:
            dataset = _local_dataset(Path(spec.source), DataConfig(source=spec.source, split=spec.split))
        except DataError as err:
            raise EvalError(str(err)) from err
        sequences = _rows_to_sequences(dataset, tokenizer, context, n_sequences, spec.text_field, progress=progress)
    else:
        cache = _cache_file(spec, tokenizer, context, n_sequences, cache_dir)
        if cache.is_file():
            sequences = np.load(cache)
        else:
            sequences = _rows_to_sequences(_hub_rows(spec), tokenizer, context, n_sequences, spec.text_field,
                                           progress=progress)
            cache.parent.mkdir(parents=True, exist_ok=True)
            np.save(cache, sequences)
    if len(sequences) == 0:
        raise EvalError(f"{spec.name} holds no full sequence of {context} tokens")
    if n_sequences is not None and len(sequences) < n_sequences:
        raise EvalError(f"{spec.name} holds only {len(sequences)} sequences of {context} tokens "
                        f"({n_sequences} requested); lower --n-sequences or --context")
    if int(sequences.max()) >= vocab_size:
        raise EvalError(f"{spec.name} has token id {int(sequences.max())}, beyond the model's vocabulary ({vocab_size})")
    return sequences


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

FORMS = ("hf", "folded", "plain")
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class EvalModel:
    """A model under a label, in the form it is evaluated in (any module whose output has `.logits`)."""

    label: str
    module: nn.Module
    tokenizer: Any
    source: str = ""
    kind: str = ""
    form: str = "hf"
    dtype: str = "float32"
    fully_ln_free: bool | None = None

    @property
    def vocab_size(self) -> int:
        config = getattr(self.module, "config", None)
        return int(config.vocab_size) if config is not None else len(self.tokenizer)

    @property
    def n_positions(self) -> int | None:
        config = getattr(self.module, "config", None)
        return getattr(config, "n_positions", None)


def resolve_device(device: str) -> torch.device:
    """'auto' → CUDA when available, else CPU; anything else as torch spells it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _plain_module(source: str, dtype: torch.dtype) -> nn.Module:
    """The checkpoint exactly as `transformers` loads it (an export's eps-trick norms included)."""
    from transformers import AutoModelForCausalLM

    from lnfree.arch import architecture
    from lnfree.arch.base import norm_eps
    from lnfree.models import EPS_TRICK_THRESHOLD, EPS_TRICK_WEIGHT, resolve_model_source

    location = resolve_model_source(source)
    if (Path(location) / RUN_CONFIG).is_file() or (Path(location) / TRAINER_STATE).is_file():
        raise EvalError(f"{source} is an lnfree run or checkpoint; --form plain needs a transformers model "
                        "folder or Hub id (use --form hf or folded)")
    module = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, local_files_only=Path(location).exists())
    norms = [module.get_submodule(site.module) for site in architecture(module).sites()]
    scaled = [m for m in norms if m.weight.abs().mean() > EPS_TRICK_WEIGHT]  # eps-trick weights, w·√E/σ
    if any(norm_eps(m) < EPS_TRICK_THRESHOLD for m in scaled):
        raise EvalError(f"{source} carries eps-trick norm weights but eps {norm_eps(scaled[0]):g} in its config: "
                        "transformers computes garbage from it; use --form hf or folded (lnfree.load fixes the eps)")
    eps_trick = any(norm_eps(m) >= EPS_TRICK_THRESHOLD for m in norms)
    if eps_trick and dtype == torch.float16:
        raise EvalError(f"{source} is in the eps-trick format, whose scaled weights overflow fp16; "
                        "use --dtype fp32/bf16 or --form hf/folded")
    return module.to(dtype).eval()


def load_models(
    sources: Sequence[str], labels: Sequence[str] | None = None, *, form: str = "hf", dtype: str = "fp32",
) -> list[EvalModel]:
    """Load each source with `lnfree.load` (exact fixed-scale form) and put it in the requested form.

    `form`: ``hf`` lnfree's exact fixed-scale model; ``folded`` the exactly LN-free folded weights
    (models that still have real norms stay in ``hf`` form, recorded as such); ``plain`` the
    checkpoint as `GPT2LMHeadModel.from_pretrained` gives it (eps-trick norms for exports).
    """
    from lnfree.load import load

    if form not in FORMS:
        raise EvalError(f"unknown form {form!r}; use one of {', '.join(FORMS)}")
    if dtype not in DTYPES:
        raise EvalError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    if not sources:
        raise EvalError("give at least one model")
    try:
        labels = model_labels(sources, labels)
    except ValueError as err:
        raise EvalError(str(err)) from err
    torch_dtype = DTYPES[dtype]
    models = []
    for label, source in zip(labels, sources):
        try:
            loaded = load(source)  # fp32: folding happens before any cast
        except (ValueError, OSError) as err:
            raise EvalError(f"could not load model {source!r}: {err}") from err
        used, ln_free = form, loaded.fully_ln_free
        if form == "folded" and ln_free:
            module = loaded.folded().to(torch_dtype)
        elif form == "plain":
            module = _plain_module(source, torch_dtype)
        else:
            module, used = loaded.model.to(torch_dtype), "hf" if form == "hf" else "hf (not foldable)"
        models.append(EvalModel(label, module.eval(), loaded.tokenizer, str(source), loaded.kind, used,
                                str(torch_dtype).removeprefix("torch."), ln_free))
    return models


# ----------------------------------------------------------------------------------------------
# Per-token scoring
# ----------------------------------------------------------------------------------------------


@dataclass
class TokenScores:
    """Per scored token, shape (n_sequences, L−1): column j is the prediction of token j+1."""

    ce: torch.Tensor  # −log p(target), nats
    entropy: torch.Tensor  # of the predicted distribution, nats
    confidence: torch.Tensor  # top-1 probability
    top1: torch.Tensor  # top-1 token id (int64)


def token_statistics(
    logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-position CE, entropy, top-1 probability and id from next-token logits (maths in `dtype`).

    `logits` (…, V) predicts `targets` (…); returns the statistics and the log-probabilities.
    """
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    p = logp.exp()
    ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    best, top1 = logp.max(dim=-1)
    return {"ce": ce, "entropy": entropy, "confidence": best.exp(), "top1": top1}, logp


def js_divergence(logp_a: torch.Tensor, logp_b: torch.Tensor) -> torch.Tensor:
    """Per-position Jensen–Shannon divergence (nats) between two log-distributions over the last axis.

    log m = max(a, b) + log1p(½·expm1(−|a − b|)) is exact where a = b, so a model's JSD with
    itself is exactly 0.
    """
    log_m = torch.maximum(logp_a, logp_b) + torch.log1p(0.5 * torch.expm1(-(logp_a - logp_b).abs()))

    def kl_to_m(logp: torch.Tensor) -> torch.Tensor:
        p = logp.exp()
        return torch.where(p > 0, p * (logp - log_m), torch.zeros_like(p)).sum(-1)

    return (0.5 * kl_to_m(logp_a) + 0.5 * kl_to_m(logp_b)).clamp_min(0.0)


def _logits(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    out = module(input_ids=input_ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def score(
    models: Mapping[str, nn.Module], tokens: torch.Tensor, *, batch_size: int = 8, device: str | torch.device = "cpu",
    pairs: Sequence[tuple[str, str]] = (), progress: bool = False,
) -> tuple[dict[str, TokenScores], dict[tuple[str, str], torch.Tensor]]:
    """Score every model on the same (N, L) tokens, batch by batch, and each pair's per-token JSD.

    Models run in lockstep on each batch so that a pair's distributions can be compared without
    storing them. Results stay on the CPU; nothing is synchronised per token.
    """
    from tqdm.auto import tqdm

    device = torch.device(device)
    n, length = tokens.shape
    if length < 2:
        raise EvalError("sequences need at least 2 tokens to score a prediction")
    for module in models.values():
        module.eval().to(device)
    shape = (n, length - 1)
    scores = {label: TokenScores(torch.empty(shape), torch.empty(shape), torch.empty(shape),
                                 torch.empty(shape, dtype=torch.int64)) for label in models}
    jsd = {pair: torch.empty(shape) for pair in pairs}
    in_pairs = {label for pair in pairs for label in pair}
    batches = range(0, n, batch_size)
    for start in tqdm(batches, desc=f"scoring {len(models)} model(s)", unit="batch", disable=not progress):
        ids = tokens[start:start + batch_size].to(device)
        targets = ids[:, 1:]
        logps = {}
        for label, module in models.items():
            stats, logp = token_statistics(_logits(module, ids)[:, :-1], targets)
            for name, value in stats.items():
                getattr(scores[label], name)[start:start + len(ids)] = value.cpu()
            if label in in_pairs:
                logps[label] = logp
        for a, b in pairs:
            if logps[a].shape != logps[b].shape:
                raise EvalError(f"{a} and {b} have different vocabularies ({logps[a].shape[-1]} vs "
                                f"{logps[b].shape[-1]}): no pairwise comparison")
            jsd[(a, b)][start:start + len(ids)] = js_divergence(logps[a], logps[b]).cpu()
    return scores, jsd


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------


@dataclass
class Distribution:
    """A per-token quantity over all scored tokens: mean (bootstrap CI over sequences) and percentiles."""

    mean: float
    mean_ci: tuple[float, float]
    median: float
    p95: float
    p99: float
    p99_9: float
    max: float
    std: float


def distribution(values: torch.Tensor, *, n_resamples: int = 1000, seed: int = 0) -> Distribution:
    """Summarise (N, L−1) per-token values; the CI resamples sequences (rows)."""
    flat = values.double().flatten().numpy()
    median, p95, p99, p999 = np.percentile(flat, [50, 95, 99, 99.9])
    per_sequence = values.double().mean(dim=1).numpy()  # equal token counts: mean of means = mean
    ci = bootstrap_ci(per_sequence, n_resamples=n_resamples, seed=seed)
    return Distribution(float(flat.mean()), ci, float(median), float(p95), float(p99), float(p999),
                        float(flat.max()), float(flat.std()))


def calibration_bins(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = ECE_BINS) -> np.ndarray:
    """Per sequence and confidence bin: [count, Σ(correct − confidence)], shape (N, n_bins, 2).

    Bins are equal-width on [0, 1] (a confidence of 1 falls in the last bin).
    """
    index = (confidence * n_bins).long().clamp(0, n_bins - 1)
    counts = torch.zeros(confidence.shape[0], n_bins, dtype=torch.float64)
    gaps = torch.zeros_like(counts)
    counts.scatter_add_(1, index, torch.ones_like(confidence, dtype=torch.float64))
    gaps.scatter_add_(1, index, correct.double() - confidence.double())
    return torch.stack([counts, gaps], dim=-1).numpy()


def ece_from_bins(bins: np.ndarray) -> float:
    """ECE = Σ_b (n_b/N)·|accuracy_b − confidence_b| from `calibration_bins` (summed over sequences)."""
    total = bins.sum(axis=0)
    return float(np.abs(total[:, 1]).sum() / total[:, 0].sum())


def expected_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error of top-1 predictions with `n_bins` equal-width bins."""
    confidence = confidence.reshape(confidence.shape[0], -1)
    return ece_from_bins(calibration_bins(confidence, correct.reshape(confidence.shape), n_bins))


def position_edges(length: int) -> list[int]:
    """Context-length bin edges 1, 2, 4, 8, … , L: bin [lo, hi) holds targets at positions lo…hi−1."""
    edges = [1]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return edges + [length]


def by_position(scores: TokenScores) -> list[dict]:
    """Mean CE and entropy per context-position bin (position = tokens seen before the target)."""
    length = scores.ce.shape[1] + 1
    edges = position_edges(length)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        ce, entropy = scores.ce[:, lo - 1:hi - 1].double(), scores.entropy[:, lo - 1:hi - 1].double()
        rows.append({"positions": str(lo) if hi - 1 == lo else f"{lo}-{hi - 1}", "first": lo, "last": hi - 1, "tokens": ce.numel(),
                     "mean_ce": float(ce.mean()), "mean_entropy": float(entropy.mean())})
    return rows


@dataclass
class Outlier:
    """A token whose CE exceeds the threshold, with the text before it."""

    sequence: int
    position: int  # of the target token in its sequence (≥ 1)
    token_id: int
    token: str
    context: str  # the tokens before the target (the last `context_tokens`), decoded
    ce: float
    predicted_id: int
    predicted: str
    other_models_ce: dict[str, float] = field(default_factory=dict)


def outliers(
    scores: TokenScores, tokens: torch.Tensor, tokenizer, threshold: float, *, limit: int = 50, context_tokens: int = 16,
) -> tuple[int, list[Outlier]]:
    """(count of tokens with CE > threshold, the `limit` highest of them with their context)."""
    above = scores.ce > threshold
    count = int(above.sum())
    if count == 0 or limit <= 0:
        return count, []
    flat = scores.ce.flatten()
    values, order = flat.topk(min(limit, count))
    width = scores.ce.shape[1]
    found = []
    for value, index in zip(values.tolist(), order.tolist()):
        seq, pos = divmod(index, width)
        pos += 1
        target = int(tokens[seq, pos])
        predicted = int(scores.top1[seq, pos - 1])
        before = tokens[seq, max(0, pos - context_tokens):pos].tolist()
        found.append(Outlier(seq, pos, target, tokenizer.decode([target]), tokenizer.decode(before), value,
                             predicted, tokenizer.decode([predicted])))
    return count, found


@dataclass
class ModelResult:
    """Everything measured for one model (JSON-ready)."""

    label: str
    source: str
    kind: str
    form: str
    dtype: str
    fully_ln_free: bool | None
    sequences: int
    context: int
    scored_tokens: int
    ce: Distribution
    threshold: float
    tokens_above_threshold: int
    sequences_with_outliers: int
    mean_ce_at_or_below_threshold: float
    entropy: Distribution
    top1_accuracy: float
    ece: float
    ece_ci: tuple[float, float]
    by_position: list[dict]
    outliers: list[Outlier]
    reference: str | None = None
    delta_ce_vs_reference: float | None = None
    delta_ce_vs_reference_ci: tuple[float, float] | None = None
    benchmarks: dict[str, Any] = field(default_factory=dict)


@dataclass
class PairResult:
    """Two models on identical tokens: per-token JSD and the paired CE difference (b − a)."""

    a: str
    b: str
    scored_tokens: int
    jsd: Distribution
    delta_ce: float
    delta_ce_ci: tuple[float, float]


def paired_delta(ce_a: torch.Tensor, ce_b: torch.Tensor, *, n_resamples: int, seed: int) -> tuple[float, tuple]:
    """Mean of ce_b − ce_a and its bootstrap CI over sequences (paired: same tokens)."""
    per_sequence = (ce_b.double() - ce_a.double()).mean(dim=1).numpy()
    return float(per_sequence.mean()), bootstrap_ci(per_sequence, n_resamples=n_resamples, seed=seed)


def summarise_model(
    model: EvalModel, scores: TokenScores, tokens: torch.Tensor, *, threshold: float, n_resamples: int, seed: int,
    max_outliers: int,
) -> ModelResult:
    """Distribution, outliers, entropy, calibration and position bins of one model's scores."""
    n, width = scores.ce.shape
    correct = scores.top1 == tokens[:, 1:]
    bins = calibration_bins(scores.confidence, correct)
    ece_ci = bootstrap_ci(bins, statistic=ece_from_bins, n_resamples=n_resamples, seed=seed)
    count, listed = outliers(scores, tokens, model.tokenizer, threshold, limit=max_outliers)
    below = scores.ce[scores.ce <= threshold].double()
    return ModelResult(
        label=model.label, source=model.source, kind=model.kind, form=model.form, dtype=model.dtype,
        fully_ln_free=model.fully_ln_free, sequences=n, context=width + 1, scored_tokens=n * width,
        ce=distribution(scores.ce, n_resamples=n_resamples, seed=seed), threshold=threshold,
        tokens_above_threshold=count, sequences_with_outliers=int((scores.ce > threshold).any(dim=1).sum()),
        mean_ce_at_or_below_threshold=float(below.mean()) if below.numel() else float("nan"),
        entropy=distribution(scores.entropy, n_resamples=n_resamples, seed=seed),
        top1_accuracy=float(correct.double().mean()), ece=ece_from_bins(bins), ece_ci=ece_ci,
        by_position=by_position(scores), outliers=listed,
    )


def sequence_table(scores: TokenScores, threshold: float):
    """One row per sequence: mean/median/max CE, tokens above the threshold, mean entropy (pandas)."""
    import pandas as pd

    ce = scores.ce.double()
    return pd.DataFrame({
        "sequence": np.arange(ce.shape[0]), "scored_tokens": ce.shape[1],
        "mean_ce": ce.mean(dim=1).numpy(), "median_ce": np.median(ce.numpy(), axis=1),
        "max_ce": ce.max(dim=1).values.numpy(), "tokens_above_threshold": (ce > threshold).sum(dim=1).numpy(),
        "mean_entropy": scores.entropy.double().mean(dim=1).numpy(),
    })


# ----------------------------------------------------------------------------------------------
# The whole evaluation
# ----------------------------------------------------------------------------------------------


@dataclass
class EvalReport:
    """The result of one evaluation: dataset, settings, per-model results and pairwise comparisons."""

    dataset: dict
    settings: dict
    convention: str
    reference: str | None
    models: list[ModelResult]
    pairs: list[PairResult]
    scores: dict[str, TokenScores] = field(default_factory=dict, repr=False)
    jsd: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # by model label

    def model(self, label: str) -> ModelResult:
        return next(m for m in self.models if m.label == label)

    def pair(self, a: str, b: str) -> PairResult:
        return next(p for p in self.pairs if {p.a, p.b} == {a, b})

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("dataset", "settings", "convention", "reference")}
        out["units"] = UNITS
        out["models"] = [asdict(m) for m in self.models]
        out["pairs"] = [asdict(p) for p in self.pairs]
        return out


def _choose_reference(results: list[ModelResult], wanted: str | None) -> str | None:
    """`wanted`, else a model labelled 'vanilla' (or containing it), else the lowest mean CE."""
    labels = [r.label for r in results]
    if wanted is not None:
        if wanted not in labels:
            raise EvalError(f"reference {wanted!r} is not one of the labels {labels}")
        return wanted
    if len(results) < 2:
        return None
    vanilla = [label for label in labels if label == "vanilla"] or [label for label in labels if "vanilla" in label.lower()]
    return vanilla[0] if vanilla else min(results, key=lambda r: r.ce.mean).label


def evaluate_models(
    models: Sequence[EvalModel], tokens: torch.Tensor | Mapping[str, torch.Tensor], *, dataset: dict | None = None,
    batch_size: int = 8, device: str = "cpu", threshold: float = DEFAULT_THRESHOLD, seed: int = 0,
    n_resamples: int = 1000, max_outliers: int = 50, reference: str | None = None, pairwise: bool | None = None,
    progress: bool = False,
) -> EvalReport:
    """Score `models` on `tokens` ((N, L) ids, or one tensor per label) and summarise.

    Models that share a tokenizer share tokens; pairwise comparison (JSD, paired ΔCE) runs by
    default whenever two or more models score identical tokens; `pairwise=True` demands it for
    all models (an error if their tokens or vocabularies differ), False switches it off.
    """
    labels = [m.label for m in models]
    by_label = dict(tokens) if isinstance(tokens, Mapping) else {label: tokens for label in labels}
    groups: dict[int, list[str]] = {}
    for label in labels:
        groups.setdefault(id(by_label[label]), []).append(label)
    if pairwise and len(groups) > 1:
        raise EvalError(f"pairwise comparison needs identical tokens, but the models' tokenizers differ: "
                        f"{[g for g in groups.values()]}")
    pairs = [pair for group in groups.values() for pair in itertools.combinations(group, 2)] if pairwise is not False else []
    if pairwise and not pairs:
        raise EvalError("pairwise comparison needs at least two models")
    scores, jsd = {}, {}
    for group in groups.values():
        group_pairs = [p for p in pairs if p[0] in group]
        modules = {m.label: m.module for m in models if m.label in group}
        s, j = score(modules, by_label[group[0]], batch_size=batch_size, device=resolve_device(str(device)),
                     pairs=group_pairs, progress=progress)
        scores.update(s)
        jsd.update(j)
    results = [summarise_model(m, scores[m.label], by_label[m.label], threshold=threshold, n_resamples=n_resamples,
                               seed=seed, max_outliers=max_outliers) for m in models]
    for result in results:  # each outlier token's CE under the other models on the same tokens
        for item in result.outliers:
            item.other_models_ce = {
                other: float(scores[other].ce[item.sequence, item.position - 1]) for other in labels
                if other != result.label and by_label[other] is by_label[result.label]}
    ref = _choose_reference(results, reference)
    for result in results:
        if ref is not None and result.label != ref and by_label[result.label] is by_label[ref]:
            result.reference = ref
            result.delta_ce_vs_reference, result.delta_ce_vs_reference_ci = paired_delta(
                scores[ref].ce, scores[result.label].ce, n_resamples=n_resamples, seed=seed)
    pair_results = []
    for a, b in pairs:
        delta, delta_ci = paired_delta(scores[a].ce, scores[b].ce, n_resamples=n_resamples, seed=seed)
        pair_results.append(PairResult(a, b, jsd[(a, b)].numel(),
                                       distribution(jsd[(a, b)], n_resamples=n_resamples, seed=seed), delta, delta_ci))
    settings = {"batch_size": batch_size, "device": str(resolve_device(str(device))), "threshold": threshold, "seed": seed,
                "bootstrap_resamples": n_resamples, "ci_level": 0.95, "bootstrap_unit": "sequence",
                "ece_bins": ECE_BINS, "max_outliers": max_outliers}
    return EvalReport(dataset or {}, settings, SCORING_CONVENTION, ref, results, pair_results, scores, jsd, by_label)


def _bos(model: EvalModel) -> int | None:
    from lnfree.data import bos_token

    config = getattr(model.module, "config", None)
    return bos_token(config, model.tokenizer) if config is not None else None


def evaluate(
    sources: Sequence[str], dataset: str = "tiny", *, labels: Sequence[str] | None = None, form: str = "hf",
    dtype: str = "fp32", device: str = "auto", batch_size: int = 8, n_sequences: int | None = None,
    context: int | None = None, split: str | None = None, revision: str | None = None, text_field: str = "text",
    cache_dir: str | None = None, progress: bool = False, benchmarks: Sequence[str] = (),
    benchmark_limit: int | float | None = None, **options,
) -> EvalReport:
    """Load models, read the dataset's first sequences once per tokenizer, and `evaluate_models`.

    `n_sequences` and `context` default to the dataset preset's (tiny: 64 × 128, the sequences its
    removal run reports; owt-val: the whole split; pile, pile-filtered: 10,000 × 1024; a Hub id:
    1,000; a local file: all of it); the context must fit every model. `benchmarks` (e.g.
    ``["hellaswag"]``, needs lm-evaluation-harness) run on each model after scoring; `options` go to
    `evaluate_models`.
    """
    spec = resolve_dataset(dataset, split=split, revision=revision, text_field=text_field)
    for name in benchmarks:
        if name not in BENCHMARKS:
            raise EvalError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
        _require_lm_eval()  # fail before the long part, not after it
    models = load_models(sources, labels, form=form, dtype=dtype)
    positions = [m.n_positions for m in models if m.n_positions]
    context = context or spec.context or min(positions)
    if positions and context > min(positions):
        raise EvalError(f"context {context} exceeds a model's n_positions ({min(positions)}); pass --context")
    if n_sequences is None:
        n_sequences = spec.n_sequences if spec.how != "tiny" else 64
        if n_sequences is None and spec.how == "stream":
            n_sequences = 1000
    fingerprints = {m.label: tokenizer_fingerprint(m.tokenizer) for m in models}
    tokens: dict[str, torch.Tensor] = {}
    by_fingerprint: dict[str, torch.Tensor] = {}
    for m in models:
        key = fingerprints[m.label]
        if key not in by_fingerprint:
            vocab = min(other.vocab_size for other in models if fingerprints[other.label] == key)
            ids = load_sequences(spec, m.tokenizer, context=context, n_sequences=n_sequences, vocab_size=vocab,
                                 cache_dir=cache_dir, progress=progress, bos_token_id=_bos(m))
            by_fingerprint[key] = torch.from_numpy(ids)
        tokens[m.label] = by_fingerprint[key]
    first = next(iter(by_fingerprint.values()))
    info = {"name": spec.name, "source": spec.source, "revision": spec.revision, "split": spec.split,
            "description": spec.description, "sequences": int(first.shape[0]), "context": context,
            "scored_tokens_per_model": int(first.shape[0]) * (context - 1), "tokenizers": len(by_fingerprint),
            "selection": "the first sequences, in dataset order (documents + EOT concatenated, cut into context-sized pieces)"}
    report = evaluate_models(models, tokens, dataset=info, batch_size=batch_size, device=device, progress=progress,
                             **options)
    report.settings.update({"form": form, "dtype": dtype})
    for name in benchmarks:
        for m in models:
            report.model(m.label).benchmarks.update(
                BENCHMARKS[name](m.module, m.tokenizer, batch_size=batch_size, limit=benchmark_limit))
    return report


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)


def _ci(ci: tuple[float, float] | None, digits: int = 4) -> str:
    return "" if ci is None else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e4 else f"{x:.4f}"


def comparison_rows(report: EvalReport) -> list[dict]:
    """One flat row per model (the comparison table as records)."""
    rows = []
    for m in report.models:
        rows.append({
            "model": m.label, "form": m.form, "dtype": m.dtype, "ln_free": m.fully_ln_free, "scored_tokens": m.scored_tokens,
            "mean_ce": m.ce.mean, "mean_ce_ci_low": m.ce.mean_ci[0], "mean_ce_ci_high": m.ce.mean_ci[1],
            "reference": m.reference, "delta_ce": m.delta_ce_vs_reference,
            "delta_ce_ci_low": m.delta_ce_vs_reference_ci[0] if m.delta_ce_vs_reference_ci else None,
            "delta_ce_ci_high": m.delta_ce_vs_reference_ci[1] if m.delta_ce_vs_reference_ci else None,
            "median_ce": m.ce.median, "p95_ce": m.ce.p95, "p99_ce": m.ce.p99, "p99_9_ce": m.ce.p99_9, "max_ce": m.ce.max,
            "tokens_above_threshold": m.tokens_above_threshold, "threshold": m.threshold,
            "mean_ce_at_or_below_threshold": m.mean_ce_at_or_below_threshold,
            "mean_entropy": m.entropy.mean, "top1_accuracy": m.top1_accuracy, "ece": m.ece,
            "ece_ci_low": m.ece_ci[0], "ece_ci_high": m.ece_ci[1], **m.benchmarks,
        })
    return rows


def markdown(report: EvalReport) -> str:
    """The comparison as markdown: models (Δ to the reference), pairs, position bins, outlier warnings."""
    d = report.dataset
    first = report.models[0] if report.models else None
    sequences, context = d.get("sequences", first and first.sequences), d.get("context", first and first.context)
    lines = [f"# Evaluation on {d.get('name', 'the given tokens')}", "",
             f"{d.get('description', 'tokens')}: {sequences} sequences x {context} tokens, "
             f"{first.scored_tokens if first else 0:,} scored tokens per model. CE in nats; 95% bootstrap CIs over "
             f"sequences ({report.settings.get('bootstrap_resamples')} resamples, seed {report.settings.get('seed')}).",
             f"Scored tokens: {report.convention}.", ""]
    ref = f"Δ vs {report.reference}" if report.reference else "Δ"
    lines += [f"| model | form | scored tokens | mean CE [95% CI] | {ref} [95% CI] | median | p95 | p99 | p99.9 | max "
              f"| CE > {report.settings.get('threshold')} | entropy | top-1 acc | ECE [95% CI] |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in report.models:
        delta = "—" if m.delta_ce_vs_reference is None else f"{m.delta_ce_vs_reference:+.4f}{_ci(m.delta_ce_vs_reference_ci)}"
        lines.append(f"| {m.label} | {m.form} | {m.scored_tokens:,} | {_num(m.ce.mean)}{_ci(m.ce.mean_ci)} | {delta} | "
                     f"{_num(m.ce.median)} | {_num(m.ce.p95)} | {_num(m.ce.p99)} | {_num(m.ce.p99_9)} | {_num(m.ce.max)} | "
                     f"{m.tokens_above_threshold:,} | {m.entropy.mean:.4f} | {m.top1_accuracy:.4f} | "
                     f"{m.ece:.4f}{_ci(m.ece_ci)} |")
    for m in report.models:
        if m.tokens_above_threshold:
            lines += ["", f"**Warning — {m.label}: {m.tokens_above_threshold:,} token(s) in {m.sequences_with_outliers} "
                          f"sequence(s) have CE > {m.threshold:g} (max {m.ce.max:.4g}); the mean without them is "
                          f"{m.mean_ce_at_or_below_threshold:.4f} (median {m.ce.median:.4f}).** See outliers.csv."]
    if any(m.benchmarks for m in report.models):
        lines += ["", "| model | benchmark | value |", "|---|---|---|"]
        for m in report.models:
            lines += [f"| {m.label} | {k} | {v:.4f} |" for k, v in m.benchmarks.items() if isinstance(v, float)]
    if report.pairs:
        lines += ["", "## Pairwise, on identical tokens", "",
                  "| a | b | mean JSD [95% CI] | median JSD | p99 JSD | max JSD | mean CE(b) − CE(a) [95% CI] |",
                  "|---|---|---|---|---|---|---|"]
        for p in report.pairs:
            lines.append(f"| {p.a} | {p.b} | {p.jsd.mean:.4f}{_ci(p.jsd.mean_ci)} | {p.jsd.median:.4f} | {p.jsd.p99:.4f} | "
                         f"{p.jsd.max:.4f} | {p.delta_ce:+.4f}{_ci(p.delta_ce_ci)} |")
    bins = [b["positions"] for b in report.models[0].by_position] if report.models else []
    if bins:
        lines += ["", "## Mean CE (entropy) by context position", "",
                  "| model | " + " | ".join(bins) + " |", "|---|" + "---|" * len(bins)]
        for m in report.models:
            lines.append(f"| {m.label} | " + " | ".join(f"{b['mean_ce']:.3f} ({b['mean_entropy']:.3f})"
                                                      for b in m.by_position) + " |")
    return "\n".join(lines) + "\n"


def _remove_previous_report(out: Path) -> None:
    """One folder holds one evaluation: the files an earlier report listed in its summary.json go first
    (a file the user put beside them stays)."""
    previous = out / "summary.json"
    if not previous.is_file():
        return
    try:
        files = json.loads(previous.read_text()).get("files", [])
    except (ValueError, AttributeError):
        return
    for name in files:
        if isinstance(name, str) and Path(name).name == name:  # plain names inside `out` only
            (out / name).unlink(missing_ok=True)


def write_report(report: EvalReport, out_dir: str | Path, *, save_tokens: bool = False) -> list[Path]:
    """Write per-model JSON/CSV, the comparison (md, csv), pairwise, position and outlier tables, summary.json."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_previous_report(out)
    clear_stale(out)
    written = []
    shared = {"dataset": report.dataset, "settings": report.settings, "convention": report.convention, "units": UNITS}
    for m in report.models:
        path = out / f"{_safe(m.label)}.json"
        path.write_text(json.dumps({**shared, **asdict(m)}, indent=1))
        written += [path, write_table(sequence_table(report.scores[m.label], m.threshold), out, _safe(m.label))]
    written.append(write_table(pd.DataFrame(comparison_rows(report)), out, "comparison"))
    written.append(write_table(pd.DataFrame([
        {"a": p.a, "b": p.b, "scored_tokens": p.scored_tokens, "mean_jsd": p.jsd.mean, "jsd_ci_low": p.jsd.mean_ci[0],
         "jsd_ci_high": p.jsd.mean_ci[1], "median_jsd": p.jsd.median, "p99_jsd": p.jsd.p99, "max_jsd": p.jsd.max,
         "delta_ce": p.delta_ce, "delta_ce_ci_low": p.delta_ce_ci[0], "delta_ce_ci_high": p.delta_ce_ci[1]}
        for p in report.pairs], columns=["a", "b", "scored_tokens", "mean_jsd", "jsd_ci_low", "jsd_ci_high",
                                         "median_jsd", "p99_jsd", "max_jsd", "delta_ce", "delta_ce_ci_low",
                                         "delta_ce_ci_high"]), out, "pairwise"))
    written.append(write_table(pd.DataFrame([{"model": m.label, **b} for m in report.models for b in m.by_position]),
                               out, "positions"))
    columns = ["model", "sequence", "position", "token_id", "token", "context", "ce", "predicted_id", "predicted"]
    columns += [f"ce_{m.label}" for m in report.models]  # the same token's CE under every model
    written.append(write_table(pd.DataFrame(
        [{"model": m.label, **{k: v for k, v in asdict(o).items() if k != "other_models_ce"}, f"ce_{m.label}": o.ce,
          **{f"ce_{other}": v for other, v in o.other_models_ce.items()}} for m in report.models for o in m.outliers],
        columns=columns), out, "outliers"))
    md = out / "comparison.md"
    md.write_text(markdown(report))
    written.append(md)
    if save_tokens:
        arrays = {f"ce__{_safe(k)}": v.ce.numpy() for k, v in report.scores.items()}
        arrays |= {f"entropy__{_safe(k)}": v.entropy.numpy() for k, v in report.scores.items()}
        arrays |= {f"tokens__{_safe(k)}": t.numpy() for k, t in report.tokens.items()}
        arrays |= {f"jsd__{_safe(a)}__{_safe(b)}": v.numpy() for (a, b), v in report.jsd.items()}
        np.savez_compressed(out / "tokens.npz", **arrays)
        written.append(out / "tokens.npz")
    summary = report.to_dict() | {"files": [p.name for p in written] + ["summary.json"]}
    written.append(write_summary(summary, out))
    return written


# ----------------------------------------------------------------------------------------------
# Benchmarks (optional: lm-evaluation-harness)
# ----------------------------------------------------------------------------------------------


class BenchmarkUnavailable(EvalError):
    """An optional benchmark dependency is missing."""


def _require_lm_eval():
    """The `lm_eval` module, or a clear error naming the package to install."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError as err:
        raise BenchmarkUnavailable(
            "benchmarks need lm-evaluation-harness, which is not installed: pip install 'lm-eval>=0.4.9'") from err
    return lm_eval


def hellaswag(
    module: nn.Module, tokenizer, *, batch_size: int = 8, limit: int | float | None = None, num_fewshot: int = 0,
) -> dict[str, float]:
    """HellaSwag accuracy (acc, acc_norm and their standard errors) through lm-evaluation-harness.

    Needs ``pip install 'lm-eval>=0.4.9'`` (imported only here) and network access for the task's
    data. The model is evaluated as given (e.g. `LoadedModel.model` or its folded form), on its
    current device; P24 reports 29.56% / 29.82% / 29.54% for GPT-2 small original / FT / LN-free.
    """
    lm_eval = _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=module, tokenizer=tokenizer, batch_size=batch_size)
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], num_fewshot=num_fewshot, limit=limit,
                                      log_samples=False)
    metrics = results["results"]["hellaswag"]
    out = {}
    for name in ("acc", "acc_norm"):
        out[f"hellaswag_{name}"] = float(metrics[f"{name},none"])
        stderr = metrics.get(f"{name}_stderr,none")
        if isinstance(stderr, (int, float)) and not math.isnan(stderr):
            out[f"hellaswag_{name}_stderr"] = float(stderr)
    return out


BENCHMARKS = {"hellaswag": hellaswag}
