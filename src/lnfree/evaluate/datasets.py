"""Evaluation datasets: named presets, local files and Hub ids, cut into identical token sequences."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lnfree.errors import LnfreeError
from lnfree.removal.config import DataConfig, load_preset
from lnfree.data.documents import (
    DataError,
    _local_dataset,
    prepare_data,
    prepend_bos,
    tokenizer_fingerprint,
)


class EvalError(LnfreeError, ValueError):
    """Input that cannot be evaluated as asked (dataset, models, options)."""



@dataclass(frozen=True)
class DatasetPreset:
    """A named evaluation set: where its documents or token rows come from and how many to take."""

    name: str
    description: str
    source: str  # a bundled preset ("tiny", "realtext") or a Hub dataset id
    how: str  # "bundled" (a bundled corpus's held-out `part`, per its preset) | "heldout-split" | "stream"
    context: int | None
    n_sequences: int | None  # None: every sequence the set holds
    revision: str | None = None
    split: str = "train"
    val_fraction: float | None = None
    val_seed: int | None = None
    part: str = "validation"  # "bundled": the held-out part (`lnfree.data.documents.prepare_data`)


def _owt_preset() -> DatasetPreset:
    data = load_preset("gpt2").data  # one source of truth for the nanoGPT split
    return DatasetPreset(
        "owt-val", "OpenWebText, nanoGPT validation split", data.source, "heldout-split", 1024, None,
        revision=data.revision, val_fraction=data.val_fraction, val_seed=data.val_seed,
    )


def presets() -> dict[str, DatasetPreset]:
    """The named evaluation sets (`tiny`, `realtext`, `owt-val`, `pile`, `pile-filtered`)."""
    return {
        "tiny": DatasetPreset("tiny", "the bundled tiny model's held-out synthetic text", "tiny", "bundled", None, 64),
        "realtext": DatasetPreset("realtext", "Django documentation, the test half of the held-out documents "
                                  "(no run or choice reads it)", "realtext", "bundled", None, None, part="test"),
        "realtext-val": DatasetPreset("realtext-val", "Django documentation, the validation half of the held-out "
                                      "documents (what runs evaluate on while training)", "realtext", "bundled",
                                      None, None),
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
    how: str  # "bundled" | "heldout-split" | "stream" | "local" | "npy"
    context: int | None = None
    n_sequences: int | None = None
    revision: str | None = None
    split: str = "train"
    text_field: str = "text"
    val_fraction: float | None = None
    val_seed: int | None = None
    description: str = ""
    part: str = "validation"


def resolve_dataset(
    name: str, *, split: str | None = None, revision: str | None = None, text_field: str = "text",
) -> DatasetSpec:
    """A preset name, a local path, or a Hub dataset id → a `DatasetSpec` (clear error otherwise)."""
    named = presets()
    if name in named:
        p = named[name]
        return DatasetSpec(p.name, p.source, p.how, p.context, p.n_sequences, revision or p.revision,
                           split or p.split, text_field, p.val_fraction, p.val_seed, p.description, p.part)
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
    `bos_token_id` (models that need one: `lnfree.data.documents.bos_token`), each is that token and context − 1 tokens.
    """
    if bos_token_id is not None and spec.how != "bundled":  # a document's own BOS may remain inside a sequence
        return prepend_bos(load_sequences(spec, tokenizer, context=context - 1, n_sequences=n_sequences,
                                          vocab_size=vocab_size, cache_dir=cache_dir, progress=progress), bos_token_id)
    if spec.how == "bundled":
        config = load_preset(spec.source).data.model_copy(update={"context_length": context, "cache_dir": cache_dir})
        held_out = prepare_data(config, tokenizer, context, vocab_size, bos_token_id, part=spec.part).held_out
        sequences = np.asarray(held_out[: n_sequences or len(held_out)], dtype=np.int64)
    elif spec.how == "npy":
        stream = np.load(spec.source, mmap_mode="r")
        if stream.ndim != 1:
            raise EvalError(f"{spec.source} must be a 1-D array of token ids")
        n = len(stream) // context if n_sequences is None else min(n_sequences, len(stream) // context)
        sequences = np.asarray(stream[: n * context], dtype=np.int64).reshape(n, context)
    elif spec.how == "local":
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
